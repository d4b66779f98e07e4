"""Named CPU targets (issue 35), end to end, as an image is made for a mixed fleet: two
shards of ``cachectl build --shard I/2 --cpu-target LEVEL --cpu-target native`` build
the matrix for a level and for native; one bundle is exported and imported into a fresh
store (the image); the level's kernels there hold no instruction above it (the native
build, disassembled the same way, is the control that must hold them); fresh processes
forced to each target, and one that looks up ``auto``, serve it with zero compiler calls.
(A process whose CPU lacks the level, and the order of the lookups, are
tests/key/test_cpu_target.py's, in process.)

On an AVX-512 CPU the level is x86-64-v3 and the instructions above it are AVX-512's (zmm
registers). On an AVX2 CPU (no avx512f: native could not be the control for zmm) the
level is x86-64-v2 and the instructions above it are AVX's (ymm and zmm registers).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ccutil import Sandbox, cachectl

from cachecompile.key import cpu
from cachecompile.store import Hit, open_store

FLAGS = cpu.cpu_flags()
if "avx512f" in FLAGS:
    LOW, ABOVE = "x86-64-v3", re.compile(r"%zmm\d")
else:
    LOW, ABOVE = "x86-64-v2", re.compile(r"%[yz]mm\d")

pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the levels are x86-64's"),
    pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)"),
    pytest.mark.skipif("avx2" not in FLAGS,
                       reason="this CPU has neither AVX-512 nor AVX2: a native build holds "
                              "no vector register above x86-64-v2 to be the control"),
]

SERVED = '''
import torch
from torch import nn
from cachecompile import cache_compile

class Tiny(nn.Module):
    def forward(self, x):
        return torch.sin(x) * 2.0 + x

def factory():
    m = Tiny().eval()
    return [(cache_compile(m.forward, dynamic=False), [torch.randn(8, 64), torch.randn(4, 64)])]
'''

SERVE = """
import warnings, torch
import served
m = served.Tiny().eval()
f = served.cache_compile(m.forward, dynamic=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ok = all(torch.allclose(f(x), m.forward(x), atol=1e-6)
             for x in (torch.randn(8, 64), torch.randn(4, 64)))
report({"events": [e[0] for e in f.events], "ok": ok, "spec": f.spec.cpu_target,
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]})
"""


def _kernels_by_target(store: Path) -> dict[str, list[Path]]:
    st = open_store(store)
    out: dict[str, list[Path]] = {}
    for info in st.entries():
        hit = st.get(info.key)
        assert isinstance(hit, Hit), hit
        target = hit.entry.factors["backend"]["cpu"].get("target", cpu.NATIVE)
        out.setdefault(target, []).extend(
            p for n, p in hit.entry.files.items() if n.startswith("kernels/"))
    return out


def _above(lib: Path) -> int:
    asm = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    return len(ABOVE.findall(asm))


@pytest.mark.slow
def test_a_level_build_holds_nothing_above_it_and_serves_with_zero_compiles(
        tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    (tmp_path / "served.py").write_text(SERVED)
    # The build machines: two shards, each for both targets, into one build store.
    for shard in ("0/2", "1/2"):
        built = subprocess.run(
            [sys.executable, "-m", "cachecompile.cli.main", "build", "served:factory",
             "--jobs", "1", "--shard", shard, "--cpu-target", LOW, "--cpu-target", "native"],
            env=box.env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stdout + built.stderr
        assert f"CPU target {LOW}" in built.stdout
    # One bundle, imported into the image's store.
    image = tmp_path / "image"
    out = cachectl("export", "--cache-dir", str(box.store), str(tmp_path / "warm.tar.zst"),
                   env=box.env())
    assert out.returncode == 0 and "exported" in out.stdout, out.stdout + out.stderr
    out = cachectl("import", "--cache-dir", str(image), str(tmp_path / "warm.tar.zst"),
                   env=box.env())
    assert out.returncode == 0 and "imported" in out.stdout, out.stdout + out.stderr
    # 2 signatures x 2 targets, whichever shard built each (graphs shared between entries
    # travel beside them).
    methods = [i for i in open_store(image).entries() if i.labels.get("kind") != "graph"]
    assert len(methods) == 4, [i.labels for i in methods]

    kernels = _kernels_by_target(image)
    assert set(kernels) == {LOW, cpu.NATIVE}, kernels
    assert kernels[LOW] and kernels[cpu.NATIVE], kernels
    # The control: the same graph built for this CPU uses the wider registers.
    assert sum(_above(k) for k in kernels[cpu.NATIVE]) > 0, kernels[cpu.NATIVE]
    assert [_above(k) for k in kernels[LOW]] == [0] * len(kernels[LOW])

    # Each kind of host, emulated by forcing its target, then auto (every level this CPU
    # has, best first: the best one above LOW, if any, misses and LOW serves). Empty
    # Inductor dirs: a compile would call the logging g++.
    for target in (LOW, cpu.NATIVE, "auto"):
        box.reset_compiler_log()
        warm = box.run(SERVE, fresh_inductor=True, CACHECOMPILE_DIR=str(image),
                       CACHECOMPILE_CPU_TARGET=target)
        assert warm["events"] == ["hit", "hit"], (target, warm.value)
        assert warm["ok"] and warm["warnings"] == [], (target, warm.value)
        assert box.compiler_calls() == 0, (target, box.gxx_log.read_text())
