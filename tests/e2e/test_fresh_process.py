"""Claims about fresh processes: source edits, weight swaps, faults, read-only caches.

Every run is a new process on a shared store (tests/ccutil.Sandbox: forked from a zygote
that imported torch and nothing else, or a plain interpreter).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

MODEL_SRC = '''
import torch
from torch import nn
import helper_traced

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def run(self, x):
        return helper_traced.act(self.lin(x)) * 2
'''
HELPER_TRACED = '''
import torch
def act(y):
    return torch.tanh(y)
'''
HELPER_UNTRACED = '''
# a module the model never calls into
def unused():
    return 1
'''

RUN = '''
import torch, warnings
import helper_untraced
from cachecompile import cache_compile
import model
m = model.Net().eval()
cached = cache_compile(m.run, backend="{backend}")
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = cached(x)
report({{"event": cached.events[-1][0], "ok": bool(torch.allclose(out, m.run(x), atol=1e-6)),
        "sum": float(out.sum()),
        "warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught
                     if "cachecompile" in str(w.message)]}})
'''


def _setup(box: Sandbox) -> None:
    (box.root / "model.py").write_text(MODEL_SRC)
    (box.root / "helper_traced.py").write_text(HELPER_TRACED)
    (box.root / "helper_untraced.py").write_text(HELPER_UNTRACED)


def test_source_edits(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    _setup(box)
    run = RUN.format(backend="aot_eager")
    first = box.run(run)
    assert (first["event"], first["ok"], first["warnings"]) == ("miss", True, [])
    assert box.run(run)["event"] == "hit"

    # A comment in a file the trace never entered: still a hit.
    (box.root / "helper_untraced.py").write_text(HELPER_UNTRACED + "# edited\n")
    assert box.run(run)["event"] == "hit"

    # The method's own source changes: a miss, and the NEW code's result.
    (box.root / "model.py").write_text(MODEL_SRC.replace("* 2", "* 3"))
    edited = box.run(run)
    assert (edited["event"], edited["ok"]) == ("miss", True)
    assert edited["sum"] == pytest.approx(first["sum"] * 1.5, rel=1e-5)
    assert box.run(run)["event"] == "hit"

    # A helper that the trace inlined changes (a file outside the module's classes):
    # the recorded dependency hash catches it.
    (box.root / "helper_traced.py").write_text(HELPER_TRACED.replace("tanh", "sigmoid"))
    dep = box.run(run)
    assert (dep["event"], dep["ok"]) == ("miss", True)
    assert dep["sum"] != pytest.approx(edited["sum"])
    assert box.run(run)["event"] == "hit"


WEIGHTS = '''
import torch
from cachecompile import cache_compile
import model
m = model.Net().eval()
cached = cache_compile(m.run)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
before = cached(x)
torch.manual_seed(123)
new = model.Net().eval()
for p in new.parameters():
    torch.nn.init.normal_(p)
m.load_state_dict(new.state_dict())
after = cached(x)
report({"events": [e[0] for e in cached.events],
        "before_ok": bool(torch.allclose(before, new.run(x) * 0 + model.Net().eval().run(x),
                                         atol=1e-5)),
        "after_ok": bool(torch.allclose(after, m.run(x), atol=1e-5)),
        "changed": not bool(torch.allclose(before, after))})
'''


def test_weight_swap_after_warm_load_uses_new_weights(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    _setup(box)
    cold = box.run(WEIGHTS)  # Inductor
    assert cold["events"] == ["miss"] and cold["after_ok"] and cold["changed"]
    warm = box.run(WEIGHTS)
    assert warm["events"] == ["hit"], warm.value
    assert warm["before_ok"] and warm["after_ok"] and warm["changed"], warm.value


def _entry_files(box: Sandbox) -> list[Path]:
    return [p for p in box.store.rglob("*") if p.is_file() and p.name in ("program.py",
                                                                          "bytecode.bin")]


def test_corrupt_entry_falls_back_to_a_recompile(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    _setup(box)
    run = RUN.format(backend="aot_eager")
    assert box.run(run)["event"] == "miss"
    programs = [p for p in _entry_files(box) if p.name == "program.py"]
    assert programs, "expected a stored program"
    inodes = {p.stat().st_ino: p for p in programs}  # entries share blobs by hard link
    for p in inodes.values():  # flip one byte per blob: every entry linking it sees it
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x01
        p.chmod(0o600)
        p.write_bytes(bytes(data))
    broken = box.run(run)
    assert broken["event"] == "miss" and broken["ok"], broken.value
    assert any("CacheFaultWarning" in w and "unusable" in w for w in broken["warnings"]), \
        broken["warnings"]
    assert box.run(run)["event"] == "hit"  # republished whole


def test_edited_manifest_meta_is_quarantined_once(tmp_path: Path) -> None:
    """A one-character edit in a manifest's meta fails its integrity digest: the first
    warm process warns once, quarantines and recompiles; the next one hits."""
    box = Sandbox(tmp_path)
    _setup(box)
    run = RUN.format(backend="aot_eager")
    assert box.run(run)["event"] == "miss"
    manifests = list((box.store / "v1" / "entries").rglob("manifest.json"))
    assert manifests
    for p in manifests:
        doc = json.loads(p.read_text())
        doc["meta"]["tampered"] = 1
        p.chmod(0o600)
        p.write_text(json.dumps(doc))
    broken = box.run(run)
    assert broken["event"] in ("miss", "shared") and broken["ok"], broken.value
    faults = [w for w in broken["warnings"] if "CacheFaultWarning" in w]
    assert len(faults) <= 1, faults
    quarantine = box.store / "v1" / "quarantine"
    assert quarantine.is_dir() and any(quarantine.iterdir()), "the edited entries are quarantined"
    again = box.run(run)
    assert again["event"] == "hit" and again["ok"] and not again["warnings"], again.value


FORGE = '''
import torch
from cachecompile import store
from cachecompile import cache_compile
import model
m = model.Net().eval()
cached = cache_compile(m.run, backend="aot_eager")
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
from cachecompile.key.signature import signature
from cachecompile.warm.lookup import variant_key
key = variant_key(cached.key(signature((x,), {}, True)), 0)
st = store.open_store()
hit = st.get(key)
files = {name: path.read_bytes() for name, path in hit.entry.files.items()}
files["bytecode.bin"] = b"not marshal data"
st.delete(key)
st.put(key, files, labels=hit.entry.labels, meta=hit.entry.meta)
report({"forged": key.digest})
'''


def test_undeserialisable_entry_is_replaced_with_a_warning(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    _setup(box)
    run = RUN.format(backend="aot_eager")
    assert box.run(run)["event"] == "miss"
    box.run(FORGE)  # valid checksums, garbage bytecode
    bad = box.run(run)
    # Traced again; the shared-graph entry (intact) may supply the program.
    assert bad["event"] in ("miss", "shared") and bad["ok"]
    assert any("could not be loaded" in w and "bytecode" in w for w in bad["warnings"]), \
        bad["warnings"]
    assert box.run(run)["event"] == "hit"


def test_read_only_cache(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    _setup(box)
    run = RUN.format(backend="aot_eager")
    # Empty and read-only: compiles, warns once that nothing is published, right result.
    ro = box.run(run, CACHECOMPILE_READONLY="1")
    assert ro["event"] == "miss" and ro["ok"]
    assert len(ro["warnings"]) == 1 and "read-only" in ro["warnings"][0]
    assert not list(box.store.rglob("manifest.json"))
    # Populated, then read-only: hits.
    assert box.run(run)["event"] == "miss"
    ro2 = box.run(run, CACHECOMPILE_READONLY="1")
    assert (ro2["event"], ro2["ok"], ro2["warnings"]) == ("hit", True, [])


ENOSPC = '''
import errno, os, torch, warnings
from cachecompile.store import disk
from cachecompile import cache_compile
import model
real_rename = os.rename
def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
os.rename = full   # the publish step's rename fails as on a full disk
m = model.Net().eval()
cached = cache_compile(m.run, backend="aot_eager")
x = torch.randn(4, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = cached(x)
os.rename = real_rename
report({"ok": bool(torch.allclose(out, m.run(x), atol=1e-6)),
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]})
'''


def test_full_disk_publish_degrades(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    _setup(box)
    res = box.run(ENOSPC)
    assert res["ok"]
    assert len(res["warnings"]) == 1 and "publishing" in res["warnings"][0], res["warnings"]
    manifests = list(box.store.rglob("manifest.json"))
    assert manifests == [], "no half entry may be visible"
    assert box.run(RUN.format(backend="aot_eager"))["event"] == "miss"


def test_manifest_factors_are_readable(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    _setup(box)
    box.run(RUN.format(backend="aot_eager"))
    manifests = [json.loads(p.read_text()) for p in box.store.rglob("manifest.json")]
    method = [m for m in manifests if m["labels"].get("kind") != "graph"]
    graph = [m for m in manifests if m["labels"].get("kind") == "graph"]
    assert len(method) == 1 and graph == []  # aot_eager shares no graphs (shares_graphs=False)
    m = method[0]
    text = json.dumps(m)
    for factor in ("function", "module", "backend", "config", "dynamic", "decompositions",
                   "ranks", "versions", "device", "signature"):
        assert f'"{factor}"' in text, factor


FLAG = '''
import torch
from cachecompile import cache_compile
import model
m = model.Net().eval()
cached = cache_compile(m.run, backend="aot_eager")
cached(torch.randn(4, 8))
cached(torch.randn(1, 8))
report({"events": [e[0] for e in cached.events]})
'''


def test_cachectl_ls_and_explain_show_signatures(tmp_path: Path) -> None:
    import subprocess
    import sys

    box = Sandbox(tmp_path)
    _setup(box)
    assert box.run(FLAG)["events"] == ["miss", "miss"]

    def ctl(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "cachecompile.cli.main", *args, "--cache-dir",
                               str(box.store)], capture_output=True, text=True,
                              env=box.env(), timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    table = ctl("ls")
    assert "Net" in table and "run" in table and "g0/1" in table
    assert "float32[n,n]@cpu" in table and "float32[1,n]@cpu" in table  # size-1 dim
    keys = [e["key"] for e in json.loads(ctl("ls", "--json"))]
    assert len(keys) == 2
    explained = ctl("explain", keys[0][:10])  # nearest entry: the other signature
    assert "1 of" in explained and "signature" in explained
