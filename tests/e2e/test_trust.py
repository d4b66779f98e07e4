"""A hit is never wrong, whatever changed around it (issue 31).

- **cachecompile's own code is in the key:** an entry written by other cachecompile code
  (a release, a local edit) is a named miss, and ``cachectl gc --other-versions`` retires it;
  the same code installed elsewhere (a wheel's layout) shares entries.
- **Global compiler settings are in the key:** ``torch._inductor.config.fallback_random``
  set in a fresh process is a miss there, and then gives eager's random numbers; set
  between two signatures in one process (either way), each signature is published under
  the settings it was compiled with (issue 47).
- **Absent state is guarded:** a subclass that gains a class attribute its base held, a
  config object's class likewise, a module global shadowing a builtin the method calls:
  changed *after* the first call in a process that loaded the entry, every call gives
  eager's result (plain torch.compile gives a stale one here; across processes the guard
  matrix has the same three cases).
- **Seeded random streams are kept:** a method that samples gives eager's stream
  (aot_eager) or torch.compile's (inductor) at every call, in the compiling and the loading
  process, and leaves the generator where they leave it.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ccutil import REPO, Sandbox
from click.testing import CliRunner
from torch import nn

from cachecompile import cache_compile

pytestmark = pytest.mark.slow


# -- absent state, changed after the first call in a process that loaded the entry ---------
class ScaledBase(nn.Module):
    K = 2.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)


class ScaledChild(ScaledBase):
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.K


class ActBase:
    act = "relu"


class ActConfig(ActBase):
    pass


class UsesConfig(ScaledBase):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = ActConfig()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(torch, self.cfg.act)(self.lin(x))


class CallsBuiltin(ScaledBase):
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return abs(self.lin(x))


def _shadow_k() -> Callable[[], None]:
    ScaledChild.K = 5.0
    return lambda: delattr(ScaledChild, "K")


def _shadow_act() -> Callable[[], None]:
    ActConfig.act = "tanh"
    return lambda: delattr(ActConfig, "act")


def _shadow_abs() -> Callable[[], None]:
    globals()["abs"] = lambda t: t * 100
    return lambda: globals().pop("abs")


ABSENT = {"subclass_attr": (ScaledChild, _shadow_k), "config_class": (UsesConfig, _shadow_act),
          "builtin": (CallsBuiltin, _shadow_abs)}


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("case", sorted(ABSENT))
def test_absent_state_added_after_the_first_call_in_a_loaded_process(
        tmp_path: Path, backend: str, case: str) -> None:
    cls, change = ABSENT[case]
    m = cls().eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache_compile(m.run, backend=backend, cache_dir=tmp_path)(x)  # type: ignore[arg-type]  # publish
        warm = cache_compile(m.run, backend=backend, cache_dir=tmp_path)  # type: ignore[arg-type]  # loads it
        for _ in range(3):
            assert torch.equal(warm(x), m.run(x))  # type: ignore[operator]
        assert [e for e, _ in warm.events] == ["hit"]
        plain = m.run(x)  # type: ignore[operator]
        undo = change()
        try:
            for _ in range(3):
                want = warm(x), m.run(x)  # type: ignore[operator]
                assert torch.allclose(*want, atol=1e-6), case
            assert not torch.allclose(want[1], plain), "the change makes a difference"
            assert len(warm.events) > 1, warm.events    # the check saw it: a new lookup
        finally:
            undo()
        for _ in range(2):
            assert torch.allclose(warm(x), m.run(x), atol=1e-6)  # type: ignore[operator]


# -- seeded random streams ---------------------------------------------------------------
class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)) + torch.rand_like(x)


def _stream(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> tuple[list[torch.Tensor],
                                                                          torch.Tensor]:
    torch.manual_seed(0)
    outs = [fn(x) for _ in range(4)]
    return outs, torch.get_rng_state()


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_seeded_stream_is_kept_at_every_call(tmp_path: Path, backend: str) -> None:
    m = Sampler().train()   # dropout samples; no grad: inference, as the contract says
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # The spec: eager's numbers for aot_eager, torch.compile's for Inductor (its own
        # random kernels), and the generator left where they leave it.
        spec = m.run if backend == "aot_eager" else torch.compile(m.run, backend=backend)
        want, want_state = _stream(spec, x)
        for role in ("compiling", "loading"):
            cached = cache_compile(m.run, backend=backend, cache_dir=tmp_path)
            got, state = _stream(cached, x)
            assert cached.events[0][0] == ("miss" if role == "compiling" else "hit")
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), role
            assert torch.equal(state, want_state), role


# -- global compiler settings ------------------------------------------------------------
# A module whose method draws random numbers (fallback_random changes which).
NOISY = """
class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
    def run(self, x):
        return self.lin(x) + torch.rand_like(x)
m = Noisy().eval()
"""

SAMPLES = """
import logging, os, torch
from torch import nn
from cachecompile import cache_compile
records = []
class H(logging.Handler):
    def emit(self, r):
        records.append(r.getMessage())
logging.getLogger("cachecompile").addHandler(H())
logging.getLogger("cachecompile").setLevel(logging.INFO)
if os.environ.get("FALLBACK") == "1":
    import torch._inductor.config as inductor_config
    inductor_config.fallback_random = True
""" + NOISY + """x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
cached = cache_compile(m.run)
with torch.no_grad():
    torch.manual_seed(7)
    got = cached(x)
    torch.manual_seed(7)
    want = m.run(x)
report({"event": cached.events[-1][0], "eager": bool(torch.equal(got, want)),
        "log": [r for r in records if "miss" in r]})
"""


def test_a_global_inductor_option_is_in_the_key(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    assert box.run(SAMPLES)["event"] == "miss"          # publishes, default settings
    fallback = box.run(SAMPLES, FALLBACK="1")
    # Set in a fresh process: not the entry compiled without it; eager's random numbers.
    assert fallback["event"] == "miss", fallback.value
    assert fallback["eager"], "fallback_random gives eager's random numbers"
    assert any("compiler_config.inductor.fallback_random" in line for line in fallback["log"]), \
        fallback["log"]
    assert box.run(SAMPLES)["event"] == "hit"           # the default entry, side by side


PER_SIGNATURE = """
import os, torch
import torch._inductor.config as inductor_config
from torch import nn
from cachecompile import cache_compile
backend = os.environ["PS_BACKEND"]
""" + NOISY + """cached = cache_compile(m.run, backend=backend, dynamic=False)
# The spec: one torch.compile of the method beside it, called on the same steps.
plain = torch.compile(m.run, backend=backend, dynamic=False, fullgraph=True)
def call(fn, n):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
    torch.manual_seed(7)
    return fn(x)
steps = []
with torch.no_grad():
    for step in os.environ["PS_STEPS"].split(","):
        if step in ("set", "unset"):
            inductor_config.fallback_random = step == "set"
            continue
        n = int(step)
        got, want, eager = call(cached, n), call(plain, n), call(m.run, n)
        steps.append({"rows": n, "event": cached.events[-1][0], "n_events": len(cached.events),
                      "as_torch_compile": bool(torch.allclose(got, want, atol=1e-6)),
                      "eager": bool(torch.allclose(got, eager, atol=1e-6))})
report(steps)
"""


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiler_settings_are_read_for_each_signature(tmp_path: Path, backend: str) -> None:
    """A setting changed between two signatures in one process, both ways: each signature is
    compiled and published under the settings of its own first call, and every process
    gets what a torch.compile of the method beside it gets."""
    box = Sandbox(tmp_path)

    def run(steps: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = box.run(PER_SIGNATURE, PS_BACKEND=backend,
                                             PS_STEPS=steps).value
        assert all(s["as_torch_compile"] for s in out), (steps, out)
        return out

    random_kernels = backend == "inductor"   # Inductor's own random numbers unless fallback
    first = run("3,5")                       # two signatures, default settings: published
    assert [s["event"] for s in first] == ["miss", "miss"], first
    # Set after the first call, then a new signature: not the entry compiled without it.
    # The loaded signature keeps what it loaded, as torch.compile keeps what it compiled
    # (Dynamo guards no compiler setting): still the default program's numbers.
    mirror = run("3,set,5,3,6")
    assert [s["event"] for s in mirror[:2]] == ["hit", "miss"], mirror
    assert mirror[1]["eager"], "compiled under fallback_random: eager's random numbers"
    assert mirror[2]["n_events"] == 2 and mirror[2]["eager"] is not random_kernels, mirror
    # Set after the first call, a signature no process compiled (6): published under the
    # setting, so a fresh process with the defaults is not served it ...
    assert mirror[3]["event"] == "miss" and mirror[3]["eager"], mirror
    fresh = run("6")
    assert fresh[0]["event"] == "miss" and fresh[0]["eager"] is not random_kernels, fresh
    # ... and one with the setting is.
    assert run("set,6")[0]["event"] == "hit"


def test_compiler_config_factor_reads_changed_settings_only() -> None:
    import torch._inductor.config as inductor_config

    from cachecompile._torch import runtime
    from cachecompile.key import factors

    base = factors.compiler_config()
    with inductor_config.patch(coordinate_descent_tuning=True, epilogue_fusion=False,
                               compile_threads=3, fx_graph_cache=False):
        got = factors.compiler_config()
    # What changes the program, not where caches live nor how many workers build it.
    assert got["inductor"]["coordinate_descent_tuning"] is True, got
    assert got["inductor"]["epilogue_fusion"] is False, got
    assert "compile_threads" not in got["inductor"] and "fx_graph_cache" not in got["inductor"]
    assert factors.compiler_config() == base
    assert "torch._dynamo.config" in runtime.COMPILER_CONFIGS


# -- cachecompile's own code -------------------------------------------------------------
RUN = """
import logging, sys, torch
from torch import nn
import cachecompile
from cachecompile import cache_compile
from cachecompile._version import code_digest
records = []
class H(logging.Handler):
    def emit(self, r):
        records.append(r.getMessage())
logging.getLogger("cachecompile").addHandler(H())
logging.getLogger("cachecompile").setLevel(logging.INFO)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
    def run(self, x):
        return self.lin(x).relu()
m = Net().eval()
cached = cache_compile(m.run, backend="aot_eager")
x = torch.randn(2, 4)
with torch.no_grad():
    ok = bool(torch.equal(cached(x), m.run(x)))
report({"event": cached.events[-1][0], "ok": ok, "code": code_digest(),
        "from": cachecompile.__file__, "log": [r for r in records if "miss" in r]})
"""


def _installed_copy(dest: Path) -> Path:
    """The package as a wheel lays it out (the store inside it), importable from ``dest``."""
    pkg = dest / "cachecompile"
    shutil.copytree(REPO / "cachecompile", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(pkg / "store", ignore_errors=True)   # a checkout laid out as a wheel has it
    shutil.copytree(REPO / "store", pkg / "store", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_an_entry_of_other_cachecompile_code_is_a_named_miss(tmp_path: Path) -> None:
    from cachecompile.cli.main import cli

    box = Sandbox(tmp_path / "box")
    same = _installed_copy(tmp_path / "same")
    edited = _installed_copy(tmp_path / "edited")
    guards = edited / "cachecompile" / "entry" / "guards.py"
    guards.write_text(guards.read_text() + "\n# a local edit: one more line\n")

    def run(where: Path | None) -> Any:
        extra = {} if where is None else {"PYTHONPATH": os.pathsep.join([str(where), str(box.root)])}
        return box.run(RUN, environ=extra)

    first = run(None)
    assert first["event"] == "miss" and first["ok"]
    # The same code in another layout (installed, not editable) is the same code.
    moved = run(same)
    assert moved["from"].startswith(str(same)) and moved["code"] == first["code"]
    assert moved["event"] == "hit" and moved["ok"], moved.value
    # Other code: never served the entry it did not write, and the miss says why.
    other = run(edited)
    assert other["from"].startswith(str(edited)) and other["code"] != first["code"]
    assert other["event"] == "miss" and other["ok"], other.value
    assert any("cachecompile code changed" in line for line in other["log"]), other["log"]
    assert run(None)["event"] == "hit"        # side by side: each code hits its own

    runner = CliRunner()
    ls = runner.invoke(cli, ["ls", "--cache-dir", str(box.store)])
    assert ls.exit_code == 0 and "other" in ls.output and "this" in ls.output, ls.output
    gc = runner.invoke(cli, ["gc", "--other-versions", "--cache-dir", str(box.store)])
    assert gc.exit_code == 0 and "retired 1 entries" in gc.output, gc.output
    ls = runner.invoke(cli, ["ls", "--cache-dir", str(box.store)])
    assert "other" not in ls.output.split("\n", 1)[1], ls.output
    assert run(None)["event"] == "hit"


def test_code_digest_covers_every_module_that_decides_an_entry(tmp_path: Path) -> None:
    from cachecompile import _version

    names = {rel for rel, _ in _version._sources(str(REPO / "cachecompile"), "")}
    assert "entry/guards.py" in names and "cold/guard_capture.py" in names
    assert "_torch/runtime.py" in names and "_version.py" in names
    assert not any(n.startswith(("cli/", "demo/", "store/")) for n in names)
    store = {rel for rel, _ in _version._sources(str(REPO / "store"), "store/")}
    assert "store/manifest.py" in store
    assert sys.modules["cachecompile._version"].code_digest() == _version.code_digest()


# -- a graph break's frame compiled after a setting changed, in a process that loaded -------
BRANCHY = '''
import torch
def rand_branch(x):
    s = x.sum().item()        # a graph break: the branch picks the resume frame's path
    if s > 0:
        return x + torch.rand_like(x)
    return x - torch.rand_like(x) + torch.arange(x.shape[0]) * 0.5   # the default dtype's
'''

FRAME_STEPS = """
import os, torch
import torch._inductor.config as inductor_config
import branchy
from cachecompile import cache_compile
cached = cache_compile(branchy.rand_branch, fullgraph=False)
plain = torch.compile(branchy.rand_branch, fullgraph=False)
out = []
with torch.no_grad():
    for fn in (cached, plain, branchy.rand_branch):
        inductor_config.fallback_random = False
        torch.set_default_dtype(torch.float32)
        got = []
        for step in os.environ["FS_STEPS"].split(","):
            if step == "set":
                if os.environ["FS_CHANGE"] == "fallback_random":
                    inductor_config.fallback_random = True
                else:
                    torch.set_default_dtype(torch.float64)
                continue
            torch.manual_seed(0)
            got.append(fn(torch.ones(6) * (1 if step == "pos" else -1)))
        out.append(got)
report([{"as_torch_compile": c.dtype == t.dtype and bool(torch.equal(c, t)),
         "eager": c.dtype == e.dtype and bool(torch.equal(c, e)), "dtype": str(c.dtype)}
        for c, t, e in zip(*out)])
"""


@pytest.mark.parametrize("change", ["fallback_random", "default_dtype"])
def test_a_frame_compiled_after_a_setting_changed_is_not_served_to_the_defaults(
        tmp_path: Path, change: str) -> None:
    """A process loads a graph-breaking function's entry, sets fallback_random and takes a
    branch never taken before: that frame is compiled live under the setting (as
    torch.compile compiles it there) and is not published under the signature's key, which
    names the defaults; a later process with the defaults gets torch.compile's numbers.
    (Found by a new user: the variant was published and served, giving eager's numbers.)
    The default dtype is a sibling Dynamo guards itself (its global state guard, which the
    variant keeps): that case held before the check too; fallback_random it does not."""
    box = Sandbox(tmp_path)
    (box.root / "branchy.py").write_text(BRANCHY)

    def run(steps: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = box.run(FRAME_STEPS, FS_STEPS=steps,
                                             FS_CHANGE=change).value
        assert all(s["as_torch_compile"] for s in out), (steps, out)
        return out

    run("pos")                                 # cold: the positive branch's frames
    changed = run("pos,set,neg")               # loaded, then the setting, then a new branch
    later = run("pos,neg")                     # the defaults: torch.compile's own result
    if change == "fallback_random":
        assert changed[1]["eager"], changed    # compiled under fallback_random: eager's
        assert not later[1]["eager"], later    # Inductor's own random numbers
    else:
        assert changed[1]["dtype"] == "torch.float64", changed
        assert later[1]["dtype"] == "torch.float32", later
