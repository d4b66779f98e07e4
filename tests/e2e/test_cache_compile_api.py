"""cache_compile's contract: argument checking, inference only, fullgraph, disable switch.

In-process tests with real torch.compile on the fast aot_eager backend.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import tiny
import torch
from torch import nn

from cachecompile import (
    ContractError,
    GraphBreakError,
    InferenceOnlyError,
    SignatureLimitWarning,
    cache_compile,
)


class Small(tiny.Small):
    def breaks(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        torch._dynamo.graph_break()  # the line the error must name
        return y * 2


def plain(x: torch.Tensor) -> torch.Tensor:
    return x + 1


class NotAModule:
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _CallableWrapper:
    """A decorator that returns an object, not a function: no bytecode to replay."""

    def __init__(self, fn: Any) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self.fn(*a, **k)

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)


class Decorated(nn.Module):
    @_CallableWrapper
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x



# A plain function, a module and a lambda are forms of their own now (issue 34,
# tests/e2e/test_forms.py).
@pytest.mark.parametrize("bad, needle", [
    (NotAModule().run, "method of NotAModule"),
    (Decorated().run, "not a Python function"),
    (42, "got int"),
])
def test_non_method_is_a_type_error_with_the_pattern(bad: Any, needle: str) -> None:
    with pytest.raises(TypeError) as info:
        cache_compile(bad)
    msg = str(info.value)
    assert needle in msg
    assert "self.cached_forward = cache_compile(self._forward)" in msg
    assert isinstance(info.value, ContractError)
    # TorchAir raises ValueError here: handlers written for it still catch ours.
    assert isinstance(info.value, ValueError)


def test_unbound_method_through_the_class_is_refused() -> None:
    with pytest.raises(ContractError, match="bound to an instance"):
        cache_compile(Small.run)


@pytest.mark.parametrize("kwargs, needle", [
    ({"backend": "tensorrt"}, "unknown backend 'tensorrt'"),
    ({"backend": object()}, "backend must be an adapter name"),
    ({"config": ["max_autotune"]}, "must be a dict of options"),
    ({"dynamic": "yes"}, "dynamic must be True, False or None"),
    ({"global_rank": "0"}, "global_rank must be an int"),
    ({"max_signatures": 0}, "max_signatures must be a positive int"),
    ({"custom_decompositions": [1]}, "custom_decompositions must be a dict"),
    ({"ge_cache": True}, "torchair"),
])
def test_bad_arguments_name_the_problem(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ContractError, match=needle):
        cache_compile(Small().run, **kwargs)


def test_double_wrapping_is_refused() -> None:
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager")
    with pytest.raises(ContractError, match="already cached"):
        cache_compile(cached)


def eager_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """A user's backend callable: cached for inference only."""
    return gm.forward


def test_grad_input_on_an_inference_only_backend_is_refused(cache_dir: Path) -> None:
    m = Small()
    cached = cache_compile(m.run, backend=eager_backend, cache_dir=cache_dir)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(InferenceOnlyError, match="inference only"):
        cached(x)
    # The same call without autograd works and matches eager.
    with torch.no_grad():
        assert torch.allclose(cached(x), m.run(x))


def test_grad_input_on_a_training_backend_gets_its_gradient(cache_dir: Path) -> None:
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir)
    x = torch.randn(2, 4, requires_grad=True)
    cached(x).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    m.run(x2).sum().backward()
    assert x.grad is not None and x2.grad is not None
    assert torch.allclose(x.grad, x2.grad)


def test_an_eval_module_output_has_no_autograd_history(cache_dir: Path) -> None:
    """The inference path: a module in eval mode, called in grad mode, runs under no_grad."""
    m = Small().eval()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir)
    out = cached(torch.randn(2, 4))
    assert not out.requires_grad


def test_graph_break_names_file_line_and_reason(cache_dir: Path) -> None:
    m = Small()
    cached = cache_compile(m.breaks, backend="aot_eager", cache_dir=cache_dir)
    with pytest.raises(GraphBreakError) as info:
        cached(torch.randn(2, 4))
    err = info.value
    assert err.filename == __file__
    assert err.lineno is not None
    assert "graph_break" in Path(__file__).read_text().splitlines()[err.lineno - 1]
    assert f"{__file__}:{err.lineno}" in str(err)
    assert "Hint:" in str(err)
    # Nothing was published.
    from cachecompile import store

    assert list(store.open_store(cache_dir).entries()) == []


def test_disable_switch_runs_plain_torch_compile(cache_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_DISABLE", "1")
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir)
    x = torch.randn(3, 4)
    assert torch.allclose(cached(x), m.run(x))
    assert [e[0] for e in cached.events] == ["live"]
    assert not cache_dir.exists() or not any(cache_dir.rglob("manifest.json"))
    # The contract still holds when caching is off.
    with pytest.raises(GraphBreakError):
        cache_compile(m.breaks, backend="aot_eager", cache_dir=cache_dir)(x)


def test_static_signature_limit_warns_once_then_runs_live(cache_dir: Path) -> None:
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                           max_signatures=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (1, 2, 3, 4):
            x = torch.randn(n + 1, 4)
            assert torch.allclose(cached(x), m.run(x))
    limit = [w for w in caught if issubclass(w.category, SignatureLimitWarning)]
    assert len(limit) == 1
    message = str(limit[0].message)
    assert "more than 2 static variants" in message
    # It names the argument that varies and how.
    assert "argument 'x': float32[" in message and "-> float32[4,4]@cpu" in message, message
    assert [e[0] for e in cached.events] == ["miss", "miss", "live", "live"]


def test_dynamic_true_one_entry_serves_all_sizes(cache_dir: Path) -> None:
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, dynamic=True)
    for n in (2, 3, 7, 16):
        x = torch.randn(n, 4)
        assert torch.allclose(cached(x), m.run(x))
    assert [e[0] for e in cached.events] == ["miss"]


def test_an_argument_the_method_cannot_use_is_eagers_error(cache_dir: Path) -> None:
    # Any argument type is accepted (Dynamo guards what the method reads of it); one
    # the method cannot use fails as the method itself does on it, not as a graph break
    # (issue 51; tests/e2e/test_user_mistakes.py has the other wrong inputs).
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir)
    with pytest.raises(TypeError, match="must be Tensor, not object") as info:
        cached(object())  # type: ignore[arg-type]
    assert not isinstance(info.value, GraphBreakError)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to give the directory to another user")
def test_foreign_owned_cache_dir_degrades_with_a_clear_warning(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)  # another user's cache: its entries would run their code
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=d)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            assert torch.allclose(cached(x), m.run(x))
    faults = [str(w.message) for w in caught if "cachecompile" in str(w.message)]
    assert len(faults) == 1, faults
    assert "unusable" in faults[0] and "CACHECOMPILE_SHARED_GROUP" in faults[0], faults[0]
    assert [e[0] for e in cached.events] == ["live"]
    assert list(d.iterdir()) == [], "nothing may be written into another user's cache"


class Twin(nn.Module):
    """Another class whose method traces the same graph as Small.run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward_tanh(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_a_graph_shared_within_one_process_says_so(cache_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Two methods with one graph: the second loads the first's program, and the log says
    it came from this process (it used to say "another process", naming its own pid)."""
    x = torch.randn(2, 4)
    a, b = Small().eval(), Twin().eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad(), caplog.at_level("INFO", logger="cachecompile"):
        ca = cache_compile(a.run, backend="inductor", cache_dir=str(cache_dir))
        cb = cache_compile(b.forward_tanh, backend="inductor", cache_dir=str(cache_dir))
        torch.testing.assert_close(ca(x), a.run(x))
        torch.testing.assert_close(cb(x), b.forward_tanh(x))
    assert cb.events[-1][0] == "shared", cb.events
    lines = [r.getMessage() for r in caplog.records if "was compiled" in r.getMessage()]
    assert lines and all("earlier in this process" in ln for ln in lines), lines


def test_a_cold_entry_says_where_its_first_call_went(cache_dir: Path) -> None:
    """Each entry keeps its cold phases (tools/bench_compile.py --profile reads them)."""
    from cachecompile import store

    m = Small().eval()
    with torch.no_grad():
        cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir)(torch.randn(2, 4))
    st = store.open_store(cache_dir)
    metas = [st.manifest(i.key)["meta"] for i in st.entries()]
    phases = [meta["cold_phases"] for meta in metas if "cold_phases" in meta]
    assert len(phases) == 1, metas
    p = phases[0]
    for name in ("key", "lookup", "torch_imports", "lock", "dynamo", "backend", "guards",
                 "capture", "verify", "run", "deps", "entry"):
        assert name in p and p[name] >= 0, (name, p)
    assert p["backend"] > 0 and p["dynamo"] > 0, p


class Noisy(nn.Module):
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_miss_draws_random_numbers_once(cache_dir: Path, backend: str) -> None:
    """The cold call runs the replayable program beside the live one to verify it: the
    random numbers must be drawn once, as torch.compile's one call draws them (same
    output, same generator state after), and the entry must be cached and hit."""
    x = torch.zeros(8)
    with torch.no_grad():
        plain = torch.compile(Noisy().run, backend=backend, fullgraph=True)
        torch.manual_seed(0)
        want = plain(x)
        want_state = torch.get_rng_state()
        cold = cache_compile(Noisy().run, backend=backend, cache_dir=cache_dir)
        torch.manual_seed(0)
        got = cold(x)
        assert torch.equal(got, want)
        assert torch.equal(torch.get_rng_state(), want_state), "the generator moved twice"
        warm = cache_compile(Noisy().run, backend=backend, cache_dir=cache_dir)
        torch.manual_seed(0)
        assert torch.equal(warm(x), want)
        assert torch.equal(torch.get_rng_state(), want_state)
    assert [e[0] for e in cold.events] == ["miss"] and [e[0] for e in warm.events] == ["hit"]


def test_autocast_after_a_compile_gets_its_own_program_on_inductor(cache_dir: Path) -> None:
    """Under CPU autocast Dynamo traces the same graph; AOTAutograd makes another program.
    The shared-graph path keyed only the graph and handed the autocast variant the plain
    program (float32 out, published as the autocast variant: a wrong hit in every later
    process). Both variants must give torch.compile's result, in this process and after
    loading."""
    x = torch.randn(4, 4)
    auto = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        plain = torch.compile(Small().run, fullgraph=True)
        want = plain(x)
        with auto():
            want_auto = plain(x)
        assert want_auto.dtype is torch.bfloat16
        cold = cache_compile(Small().run, cache_dir=cache_dir)
        assert torch.equal(cold(x), want)
        with auto():
            got = cold(x)
        assert got.dtype is torch.bfloat16 and torch.equal(got, want_auto)
        # The compiling process checks every guard on every call: the autocast call is a
        # lookup that misses and compiles its own variant; Dynamo's graph is the plain
        # one's, the program must not be.
        assert [e[0] for e in cold.events] == ["miss", "miss"], cold.events
        # A later process (every guard, the default) hits each variant with its own
        # program.
        later = cache_compile(Small().run, cache_dir=cache_dir)
        with auto():
            got = later(x)
        assert got.dtype is torch.bfloat16 and torch.equal(got, want_auto)
        assert torch.equal(later(x), want)
    assert [e[0] for e in later.events] == ["hit", "hit"], later.events
