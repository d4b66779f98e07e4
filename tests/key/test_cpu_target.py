"""Named CPU targets (issue 35), in process: the levels against a CPU's flags (given,
never this machine's), the candidates a ``CACHECOMPILE_CPU_TARGET`` names, the ``cpu``
key factor, Inductor's options for a level, and what a cached method does with them: a
lookup of every candidate the CPU supports, best first, a compile for the best, and a
named miss (no lookup, no load, a live compile) where it supports none. A fake adapter
with CPU targets keeps the compiler out; the store and Dynamo are real. The kernels
themselves are tests/e2e/test_cpu_target.py's."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cachecompile.api import _cpu_targets
from cachecompile.backends.base import Compiled, GraphCallable, Program
from cachecompile.backends.inductor import ADAPTER as INDUCTOR
from cachecompile.cached import CachedFunction
from cachecompile.entry.guards import GuardMode
from cachecompile.errors import CacheFaultWarning, CpuTargetError
from cachecompile.key import cpu
from cachecompile.key.ranks import detect
from cachecompile.spec import CompileSpec
from cachecompile.store import open_store

V1 = frozenset("fpu cmov cx8 fxsr mmx syscall sse sse2".split())
V2 = V1 | {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
V3 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def _flags(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str]) -> None:
    monkeypatch.setenv(cpu.TEST_FLAGS_ENV, " ".join(sorted(flags)))
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")


# -- levels, candidates, the factor ----------------------------------------------------------
def test_parse_names_the_candidates() -> None:
    assert cpu.parse(None) == cpu.parse("") == ("native",)
    assert cpu.parse("auto") == ("x86-64-v4", "x86-64-v3", "x86-64-v2")
    assert cpu.parse(" x86-64-v3 , x86-64-v4,x86-64-v3") == ("x86-64-v3", "x86-64-v4")
    with pytest.raises(CpuTargetError, match="unknown CPU target 'haswell'"):
        cpu.parse("x86-64-v3,haswell")


def test_a_plan_keeps_what_the_cpu_supports_best_first() -> None:
    p = cpu.plan(cpu.parse("x86-64-v2,x86-64-v3,x86-64-v4"), V3, "x86_64")
    assert p.supported == ("x86-64-v3", "x86-64-v2") and p.build == "x86-64-v3"
    assert p.lacks == {"x86-64-v4": ["avx512f", "avx512bw", "avx512cd", "avx512dq",
                                     "avx512vl"]}
    assert cpu.plan(cpu.parse("auto"), V4, "x86_64").supported[0] == "x86-64-v4"
    assert cpu.plan(("x86-64-v3", "native"), V2, "x86_64").supported == ("native",)
    # v3 without one flag of the level's (LZCNT, "abm") is not v3.
    assert cpu.plan(("x86-64-v3",), V3 - {"abm"}, "x86_64").lacks == {"x86-64-v3": ["abm"]}
    none = cpu.plan(("x86-64-v3",), V4, "aarch64")
    assert none.build is None and "an x86_64 CPU (this is aarch64)" in none.why_none()


def test_a_build_target_the_cpu_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _flags(monkeypatch, V3)
    assert cpu.build_targets(["auto"]) == ("x86-64-v3", "x86-64-v2")
    assert cpu.build_targets(["x86-64-v3,native", "x86-64-v3"]) == ("x86-64-v3", "native")
    with pytest.raises(CpuTargetError, match="cannot build for x86-64-v4: this CPU lacks "
                                              "avx512f"):
        cpu.build_targets(["x86-64-v3", "x86-64-v4"])


def test_the_cpu_factor_holds_the_level_not_the_model() -> None:
    native = cpu.factor(None)
    assert set(native) == {"machine", "model", "flags"} and cpu.factor("native") == native
    v3 = cpu.factor("x86-64-v3")
    assert v3 == {"machine": native["machine"], "target": "x86-64-v3"}


def test_inductor_builds_a_level_with_its_march_and_vector_width() -> None:
    assert INDUCTOR.cpu_target({"max_autotune": False}, "native") == {"max_autotune": False}
    assert INDUCTOR.cpu_target({}, "x86-64-v3") == {"cpp.march": "x86-64-v3",
                                                    "cpp.simdlen": 256}
    assert INDUCTOR.cpu_target({}, "x86-64-v4")["cpp.simdlen"] == 512  # type: ignore[index]
    assert INDUCTOR.cpu_target({}, "x86-64-v2") == {"cpp.march": "x86-64-v2"}
    # A config that names its own march keeps it (and is keyed by it).
    assert INDUCTOR.cpu_target({"cpp.march": "x86-64-v3"}, "x86-64-v4") is None
    assert INDUCTOR.factors({"cpp.march": "x86-64-v3"})["cpu"]["target"] == "x86-64-v3"
    assert "model" in INDUCTOR.factors({})["cpu"]


def test_only_a_backend_with_cpu_targets_gets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    _flags(monkeypatch, V3)
    monkeypatch.setenv(cpu.ENV, "auto")
    got = _cpu_targets(INDUCTOR, {})
    assert got["cpu_target"] == "x86-64-v3" and got["options"]["cpp.march"] == "x86-64-v3"
    assert [o["cpp.march"] for o in got["alternates"]] == ["x86-64-v2"]
    from cachecompile.backends.aot_eager import ADAPTER as AOT_EAGER

    assert _cpu_targets(AOT_EAGER, {}) == {}
    monkeypatch.setenv(cpu.ENV, "native")
    assert _cpu_targets(INDUCTOR, {}) == {}


# -- a cached method's lookups -----------------------------------------------------------------
_graphs: dict[str, Any] = {}
_tokens = itertools.count()


class TargetedAdapter:
    """Compiles nothing (the graph module is the program) and has CPU targets: the
    options name the target, and the factors hold it, as Inductor's do."""

    name = "fake-targeted"
    shares_graphs = False
    torch_parts: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.compiled_for: list[str] = []
        self.loads = 0

    def factors(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {"cpu": cpu.factor(options.get("target"))}

    def cpu_target(self, options: Mapping[str, Any], target: str) -> Mapping[str, Any]:
        return {**options, "target": target}

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        self.compiled_for.append(options.get("target", "native"))
        token = f"g{next(_tokens)}"
        _graphs[token] = gm
        return Compiled(live=gm, program=lambda: Program(files={"program.py": b"# fake\n"},
                                                         meta={"token": token}, light=gm))

    def load(self, files: Mapping[str, Path], meta: Mapping[str, Any]) -> GraphCallable:
        self.loads += 1
        return _graphs[meta["token"]]

    def plain_backend(self, options: Mapping[str, Any], decompositions: Mapping[Any, Any] | None
                      ) -> tuple[Any, dict[str, Any] | None]:
        return "eager", None


class Scaled(torch.nn.Module):
    k = 2.0  # guarded by Dynamo (a constant of the trace), not a key factor

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k + 1.0


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))


def _cached(adapter: TargetedAdapter, store: Path, k: float = 2.0) -> CachedFunction:
    """As ``cache_compile`` makes it, under this process's CACHECOMPILE_CPU_TARGET."""
    targets = _cpu_targets(adapter, {})
    options = targets.pop("options", {})
    spec = CompileSpec(adapter=adapter, options=options, decompositions=None, dynamic=False,  # type: ignore[arg-type]
                       guards=GuardMode.ALWAYS, ranks=detect(), cache_dir=str(store),
                       max_signatures=8, **targets)
    module = Scaled().eval()
    module.k = k
    return CachedFunction(module.run, spec)  # type: ignore[arg-type]


def _targets_stored(store: Path) -> list[str]:
    return sorted(e.labels.get("cpu_target", "native")
                  for e in open_store(str(store)).maintenance().entries())


def test_a_lookup_tries_each_supported_level_best_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = TargetedAdapter()
    _flags(monkeypatch, V3)
    monkeypatch.setenv(cpu.ENV, "x86-64-v2")
    built = _cached(fake, tmp_path)
    assert torch.equal(built(X), X * 2.0 + 1.0) and fake.compiled_for == ["x86-64-v2"]
    assert _targets_stored(tmp_path) == ["x86-64-v2"]

    # One image, built for v2 only: a v3 host asking for auto misses v3 and loads v2.
    monkeypatch.setenv(cpu.ENV, "auto")
    served = _cached(fake, tmp_path)
    assert torch.equal(served(X), X * 2.0 + 1.0)
    assert [e[0] for e in served.events] == ["hit"] and fake.loads == 1
    assert fake.compiled_for == ["x86-64-v2"]

    # A v4 host with the same image and candidates v4,v3 only: v2 is not a candidate, so
    # the miss compiles for the best, v4, and publishes it beside v2.
    _flags(monkeypatch, V4)
    monkeypatch.setenv(cpu.ENV, "x86-64-v3,x86-64-v4")
    other = _cached(fake, tmp_path)
    other(X)
    assert [e[0] for e in other.events] == ["miss"] and fake.compiled_for[-1] == "x86-64-v4"
    assert _targets_stored(tmp_path) == ["x86-64-v2", "x86-64-v4"]


def test_a_level_the_cpu_lacks_is_a_named_miss_never_a_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = TargetedAdapter()
    _flags(monkeypatch, V4)
    monkeypatch.setenv(cpu.ENV, "x86-64-v4")
    _cached(fake, tmp_path)(X)
    assert _targets_stored(tmp_path) == ["x86-64-v4"]

    _flags(monkeypatch, V3)  # the same image on a host without AVX-512
    lacking = _cached(fake, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(lacking(X), X * 2.0 + 1.0)
    assert [e[0] for e in lacking.events] == ["live"] and fake.loads == 0
    assert lacking.spec.options == {}  # the live compile is native, never for v4
    said = [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)]
    assert any("this CPU lacks avx512f" in w and "for x86-64-v4" in w for w in said), said
    assert _targets_stored(tmp_path) == ["x86-64-v4"]  # nothing published either
    assert open_store(str(tmp_path)).maintenance().stats()["misses"].get("cpu") == 1


def test_the_miss_line_names_the_key_cachectl_ls_shows_under_a_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """An operator greps the miss line's digest in `cachectl ls`: it must be the key the
    compile published (the target's variant), not a key no entry is stored under."""
    import json
    import logging

    import ccutil

    def miss_digests(caplog: pytest.LogCaptureFixture) -> list[str]:
        return [r.getMessage().split()[3] for r in caplog.records
                if r.getMessage().startswith("cachecompile miss")]

    def listed() -> dict[str, dict[str, str]]:
        r = ccutil.cachectl("ls", "--cache-dir", str(tmp_path), "--json")
        return {e["key"]: e["labels"] for e in json.loads(r.stdout)}

    fake = TargetedAdapter()
    _flags(monkeypatch, V3)
    monkeypatch.setenv(cpu.ENV, "x86-64-v2")
    caplog.set_level(logging.INFO, logger="cachecompile")
    _cached(fake, tmp_path)(X)
    (said,) = miss_digests(caplog)
    (key,) = listed()
    assert key.startswith(said), (said, key)
    assert listed()[key]["cpu_target"] == "x86-64-v2"

    # A second variant of the same frame (a guarded attribute differs): the next free
    # index's key, not the first one's.
    caplog.clear()
    other = _cached(fake, tmp_path, k=3.0)
    assert torch.equal(other(X), X * 3.0 + 1.0)
    (said,) = miss_digests(caplog)
    assert not key.startswith(said)
    assert [k for k in listed() if k.startswith(said)], (said, list(listed()))


def test_cachectl_build_refuses_a_target_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cachecompile.cli.common import EXIT_USAGE
    from cachecompile.cli.main import cli

    _flags(monkeypatch, V3)
    # Before any worker starts or the factory is imported (there is no such module).
    lacking = CliRunner().invoke(cli, ["build", "nowhere:factory", "--cache-dir", str(tmp_path),
                                       "--cpu-target", "x86-64-v3,x86-64-v4"])
    assert lacking.exit_code == EXIT_USAGE, lacking.output
    assert "cannot build for x86-64-v4: this CPU lacks avx512f" in lacking.output
    unknown = CliRunner().invoke(cli, ["build", "nowhere:factory", "--cpu-target", "haswell"])
    assert unknown.exit_code == EXIT_USAGE and "unknown CPU target 'haswell'" in unknown.output


def test_cachectl_build_takes_the_environments_target_as_a_server_would(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without --cpu-target, $CACHECOMPILE_CPU_TARGET is checked before any worker starts,
    for a build and for --check alike: a level this CPU lacks was a check that passed on
    the native entries, and a build whose every signature failed in its workers (exit 1)."""
    from click.testing import CliRunner

    from cachecompile.cli import build as build_cli
    from cachecompile.cli.common import EXIT_USAGE
    from cachecompile.cli.main import cli

    _flags(monkeypatch, V3)
    monkeypatch.setenv(cpu.ENV, "x86-64-v4")
    for extra in ([], ["--check"]):
        r = CliRunner().invoke(cli, ["build", "nowhere:factory", "--cache-dir", str(tmp_path),
                                     *extra])
        assert r.exit_code == EXIT_USAGE, r.output
        assert "this CPU lacks avx512f" in r.output and "CACHECOMPILE_CPU_TARGET" in r.output
    # A list: the best candidate this CPU has, as a serving process compiles on a miss.
    monkeypatch.setenv(cpu.ENV, "x86-64-v4,x86-64-v3")
    assert build_cli._env_target() == ("x86-64-v3",)
    monkeypatch.setenv(cpu.ENV, "native")
    assert build_cli._env_target() == (None,)


def test_a_level_overrides_what_an_avx512_host_would_pick() -> None:
    """What the e2e test cannot show on a CPU without AVX-512: there, Inductor would pick
    its AVX-512 ISA (with -mavx512bf16 on a CPU that has it) and append its flags after
    -march. Pretend it does, and read the build command a kernel's key holds."""
    import unittest.mock

    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions

    from cachecompile._torch import inductor

    def flags() -> list[str]:
        isa = cpu_vec_isa.pick_vec_isa()
        line = CppBuilder(name="o", sources="i",
                          BuildOption=CppTorchOptions(vec_isa=isa)).get_command_line()
        return [f for f in line.split() if f.startswith("-m")]

    host = cpu_vec_isa.VecAVX512()
    host._is_avx512_bf16_supported = True
    with unittest.mock.patch.object(cpu_vec_isa, "valid_vec_isa_list",
                                    lambda: [host, cpu_vec_isa.VecAVX2()]):
        assert "-mavx512bf16" in flags() and "-march=native" in flags()  # the control
        with inductor.vec_isa_limited("x86-64-v3", "avx2"):
            assert flags() == ["-march=x86-64-v3", "-mavx2", "-mfma", "-mf16c"]
        with inductor.vec_isa_limited("x86-64-v4", "avx512"):
            assert flags()[0] == "-march=x86-64-v4" and "-mavx512f" in flags()
            assert "-mavx512bf16" not in flags()
        with inductor.vec_isa_limited("x86-64-v2", None):
            assert flags() == ["-march=x86-64-v2"]
        assert "-mavx512bf16" in flags()  # restored
