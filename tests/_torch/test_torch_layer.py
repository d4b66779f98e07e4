"""The layer over torch's private names: its probe, the version gate, and the fallback.

A torch that lacks a private name cachecompile needs, or a release it is not tested on,
must turn caching off for the process with one warning and run the method as plain
torch.compile: the right result, nothing published, no exception. Each case runs in a
fresh process, with the name removed (or the version changed) before cachecompile is
imported or first used, as a user's other torch would be.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ccutil import REPO, Sandbox

from cachecompile import _torch
from cachecompile._torch import versions

# A child that caches two methods (one of them called at two sizes) and reports what
# happened. {prelude} runs first: it breaks torch the way the test needs.
SCRIPT = """
{prelude}
import sys, warnings
import torch
from cachecompile import GraphBreakError, cache_compile

class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def run(self, x):
        return torch.tanh(self.lin(x)) * 2
    def other(self, x, k: int = 3):
        return self.lin(x).relu() + k
    def breaks(self, x):
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y

torch.manual_seed(0)
m = Small().eval()
xs = [torch.randn(n, 4, generator=torch.Generator().manual_seed(n)) for n in (3, 5)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run = cache_compile(m.run, backend={backend!r})
    other = cache_compile(m.other, backend={backend!r})
    ok = True
    with torch.no_grad():
        for x in xs:
            ok = ok and bool(torch.allclose(run(x), m.run(x), atol=1e-5))
            ok = ok and bool(torch.allclose(other(x), m.other(x), atol=1e-5))
    try:
        cache_compile(m.breaks, backend="aot_eager")(xs[0])
        graph_break = "no error"
    except GraphBreakError:
        graph_break = "GraphBreakError"
    except Exception as e:
        graph_break = type(e).__name__
report({{
    "ok": ok,
    "events": {{"run": [e[0] for e in run.events], "other": [e[0] for e in other.events]}},
    "warnings": [[w.category.__name__, str(w.message)] for w in caught
                 if "cachecompile" in str(w.message)],
    "warning_files": [w.filename for w in caught if "cachecompile" in str(w.message)],
    "graph_break": graph_break,
    "torch": torch.__version__,
}})
"""


def _manifests(box: Sandbox) -> list[Path]:
    return list(box.store.rglob("manifest.json")) if box.store.exists() else []


def _run(box: Sandbox, prelude: str, backend: str = "aot_eager") -> dict[str, object]:
    res = box.run(SCRIPT.format(prelude=prelude, backend=backend))
    value: dict[str, object] = res.value
    return value


def _assert_plain(out: dict[str, object], box: Sandbox) -> list[str]:
    """Right results, every method live, nothing stored, the contract kept; the one warning."""
    assert out["ok"] is True, out
    assert out["events"] == {"run": ["live"], "other": ["live"]}, out
    assert out["graph_break"] == "GraphBreakError", out
    assert _manifests(box) == [], "caching was off: nothing may be published"
    warned = out["warnings"]
    assert isinstance(warned, list) and len(warned) == 1, warned
    category, message = warned[0]
    assert category == "UnsupportedTorchWarning", warned
    # It points at the user's code (the child's script), not into cachecompile.
    assert out["warning_files"] == ["<string>"], out
    return [category, message]


@pytest.mark.slow
def test_missing_warm_name_turns_cache_off_with_one_warning(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    name = "_torchinductor_pyobject_tensor_data_ptr"
    out = _run(box, f"import torch\ndel torch._C._dynamo.guards.{name}")
    _, message = _assert_plain(out, box)
    assert f"torch._C._dynamo.guards.{name}" in message, message
    assert str(out["torch"]) in message, message
    assert "plain torch.compile" in message, message


@pytest.mark.slow
def test_missing_cold_name_turns_cache_off_at_the_first_compile(tmp_path: Path) -> None:
    # Only a compile reads it: cache_compile() itself is quiet, the first miss warns.
    box = Sandbox(tmp_path)
    name = "_debug_get_cache_entry_list"
    out = _run(box, f"import torch\ndel torch._C._dynamo.eval_frame.{name}")
    _, message = _assert_plain(out, box)
    assert f"torch._C._dynamo.eval_frame.{name}" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_unsupported_torch_release_runs_plain_torch_compile(tmp_path: Path, backend: str) -> None:
    box = Sandbox(tmp_path)
    out = _run(box, 'import torch\ntorch.__version__ = "2.99.0"', backend)
    _, message = _assert_plain(out, box)
    assert message == ("cachecompile is tested on torch 2.11-2.15; "
                       "torch 2.99 runs as plain torch.compile"), message


@pytest.mark.slow
def test_healthy_torch_caches_with_the_same_script(tmp_path: Path) -> None:
    # The control for the cases above: the same child on this torch publishes and warns
    # about nothing.
    box = Sandbox(tmp_path)
    out = _run(box, "")
    assert out["ok"] is True, out
    assert out["events"] == {"run": ["miss"], "other": ["miss"]}, out
    assert out["warnings"] == [], out
    assert out["graph_break"] == "GraphBreakError", out
    assert len(_manifests(box)) == 2


def test_probe_finds_every_name_on_this_torch() -> None:
    # Fails on a torch release that moved a name the layer uses: the layer needs an
    # update (a branch in the module that uses the name, see _torch/versions.py).
    assert _torch.probe((_torch.DYNAMO, _torch.INDUCTOR)) is None


def test_probe_names_what_is_missing() -> None:
    assert _torch._lacks("torch", "_C._no_such_name") == "torch._C._no_such_name"
    assert _torch._lacks("torch._no_such_module", "") == "torch._no_such_module"
    assert _torch._lacks("torch._no_such_module", "x") == "torch._no_such_module"
    assert _torch._lacks("torch", "_C._dynamo.guards.GlobalStateGuard") is None


@pytest.mark.parametrize("version, supported", [
    ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", True), ("2.14.1+cu128", True),
    ("2.15.0a0+git1234abc", True), ("2.10.0", False), ("2.16.0", False), ("3.0.0", False),
    ("not a version", False),
])
def test_version_gate(monkeypatch: pytest.MonkeyPatch, version: str, supported: bool) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    why = versions.unsupported()
    assert (why is None) is supported, why
    if not supported:
        assert why is not None and "tested on torch 2.11-2.15" in why
        assert _torch.probe() == why


def test_key_has_the_exact_torch_build() -> None:
    from cachecompile.key import factors

    v = factors.versions()
    assert v["torch"] == torch.__version__  # with its local tag: +cpu, +cu128
    assert "+" in v["torch"] or torch.version.git_version, v
    assert v["torch_git"] == torch.version.git_version


def test_warm_probe_imports_neither_dynamo_nor_inductor() -> None:
    code = (
        "import sys, torch\n"
        "from cachecompile import _torch, cache_compile\n"
        "assert _torch.probe() is None\n"
        "m = torch.nn.Linear(2, 2)\n"
        "cache_compile(m.forward)\n"
        "print([n for n in ('torch._dynamo', 'torch._inductor') if n in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_warm_call_under_the_profiler_is_marked(tmp_path: Path) -> None:
    """Replayed bytecode enters Dynamo's "Pregraph bytecode" marker through the stand-in
    (dynamo_shim): while a profiler runs the marker is there, and a call outside one
    enters nothing."""
    from torch.profiler import ProfilerActivity, profile

    from cachecompile import cache_compile
    from cachecompile._torch import dynamo_shim

    m = _Twice().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        cache_compile(m.run, backend="aot_eager", cache_dir=tmp_path)(x)   # publish
        warm = cache_compile(m.run, backend="aot_eager", cache_dir=tmp_path)
        assert torch.allclose(warm(x), m.run(x))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = warm(x)
        assert torch.allclose(got, m.run(x))
    assert [e for e, _ in warm.events] == ["hit"]
    assert any(e.name == "Pregraph bytecode" for e in prof.events())
    assert dynamo_shim.record_pregraph_bytecode_enter() is None
    dynamo_shim.record_pregraph_bytecode_exit(None)


class _Twice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2
