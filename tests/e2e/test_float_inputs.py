"""Floats the graph takes as tensors, on a warm call (issue 53).

Under ``dynamic=True`` Dynamo traces a module's float attribute used in arithmetic (a
norm's eps, a scale) as a symbol: its bytecode turns the float into a 0-d tensor on every
call (``torch._as_tensor_fullprec``) and passes it to the graph. A warm call makes that
tensor once per float object (cachecompile._torch.runtime.as_tensor_fullprec). What must
hold, against torch.compile beside it on the same steps: a new value, set after the first
call in the process that loaded the entry, reaches the graph; two attributes holding the
same float object; a tensor someone wrote to is not served again; inference mode.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import th_alias
import torch

from cachecompile import cache_compile
from cachecompile._torch import dynamo_shim, runtime


class Scaled(th_alias.AliasScaled):
    """RMSNorm-like arithmetic on three float attributes (two may be one object); its
    ``run`` is this module's, which reads ``torch`` by that name."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 0.5
        self.shift = 0.125

    def run(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h * self.scale + self.shift


def _steps(m: Scaled) -> list[tuple[str, Any]]:
    """Changes made between calls: new values, one object in two attributes, undone."""
    shared = 0.75
    return [("scale", 2.0), ("eps", 0.5), ("scale", shared), ("shift", shared),
            ("scale", 0.5), ("eps", 1e-6), ("shift", 0.125)]


def _made_during(monkeypatch: pytest.MonkeyPatch, calls: Any) -> list[Any]:
    """The numbers torch was asked to make a tensor of while ``calls()`` ran."""
    made: list[Any] = []
    real = torch._as_tensor_fullprec

    def counting(v: Any) -> Any:
        made.append(v)
        return real(v)

    monkeypatch.setattr(torch, "_as_tensor_fullprec", counting)
    try:
        calls()
    finally:
        monkeypatch.undo()
    return made


def _same_as(warm: Any, x: torch.Tensor, want: torch.Tensor, n: int) -> None:
    for _ in range(n):
        assert torch.allclose(warm(x), want, atol=1e-6)


def _steps_against(warm: Any, compiled: Any, m: Scaled, ref: Scaled, x: torch.Tensor,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """No tensor made again for unchanged floats; then each change of :func:`_steps`, on
    the loaded method's module and on torch.compile's, three calls each against both
    torch.compile and eager."""
    want = compiled(x)
    made = _made_during(monkeypatch, lambda: _same_as(warm, x, want, 4))
    assert made == [], "a float's tensor was made again for an unchanged float"
    for name, value in _steps(m):
        setattr(m, name, value)
        setattr(ref, name, value)
        for i in range(3):
            got, want = warm(x), compiled(x)
            assert torch.allclose(got, want, atol=1e-6), (name, value, i)
            assert torch.allclose(got, m.run(x), atol=1e-6), (name, value, i)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_float_attributes_changed_after_the_first_call(tmp_path: Path, backend: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m, ref = Scaled().eval(), Scaled().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        cache_compile(m.run, dynamic=True, backend=backend, cache_dir=tmp_path)(x)  # publish
        warm = cache_compile(m.run, dynamic=True, backend=backend, cache_dir=tmp_path)
        compiled = torch.compile(ref.run, dynamic=True, backend=backend, fullgraph=True)
        assert torch.allclose(warm(x), compiled(x), atol=1e-6)
        assert [e for e, _ in warm.events] == ["hit"]
        run: Any = next(v for vs in warm._runners.values() for v in vs).run
        # The test means the stand-in: the replayed code reads torch through it (bound
        # into the code as a constant; the function runs in the module's own globals).
        assert any(c is dynamo_shim.torch_standin for c in run.__func__.__code__.co_consts)
        assert run.__func__.__globals__ is vars(sys.modules[Scaled.__module__])
        _steps_against(warm, compiled, m, ref, x, monkeypatch)
        with torch.inference_mode():
            assert torch.allclose(warm(x), compiled(x), atol=1e-6)
    # Dynamo traced them as symbols: no value of theirs is a guard, one variant served all.
    assert [e for e, _ in warm.events] == ["hit"]


def test_one_tensor_per_float_while_unwritten() -> None:
    v = 0.1 + 0.2                    # a float object of its own
    t = runtime.as_tensor_fullprec(v)
    assert t.dtype == torch.float64 and t.dim() == 0 and t.item() == v
    assert runtime.as_tensor_fullprec(v) is t
    t.add_(1.0)                      # written to: not served again
    again = runtime.as_tensor_fullprec(v)
    assert again is not t and again.item() == v
    other = float(str(v))            # an equal value, another object: its own tensor
    assert runtime.as_tensor_fullprec(other).item() == v
    with torch.inference_mode():
        inside = runtime.as_tensor_fullprec(v)
        assert inside is again and not inside.is_inference()
        fresh = runtime.as_tensor_fullprec(12345.5)
        assert not fresh.is_inference() and fresh._version == 0
    n = 2**40 + 3
    assert runtime.as_tensor_fullprec(n).dtype == torch.int64
    assert runtime.as_tensor_fullprec(n).item() == n
    # Anything but a plain float or int is made each time, as torch makes it.
    assert runtime.as_tensor_fullprec(True) is not runtime.as_tensor_fullprec(True)


def test_the_torch_standin_is_torch_for_any_other_name() -> None:
    s = dynamo_shim.torch_standin
    assert s.nn is torch.nn and s.float64 is torch.float64 and s.rsqrt is torch.rsqrt
    assert s._as_tensor_fullprec is runtime.as_tensor_fullprec


def test_torch_under_another_name(tmp_path: Path) -> None:
    """``import torch as th`` in the model's module: the stand-in under Dynamo's name."""
    m = th_alias.AliasScaled().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        cache_compile(m.run, dynamic=True, backend="aot_eager", cache_dir=tmp_path)(x)
        names = set(vars(th_alias))   # with what the cold compile's Dynamo installed there
        warm = cache_compile(m.run, dynamic=True, backend="aot_eager", cache_dir=tmp_path)
        assert torch.allclose(warm(x), m.run(x), atol=1e-6)
        run: Any = next(v for vs in warm._runners.values() for v in vs).run
        # The stand-in bound into the code in place of Dynamo's name for the module; the
        # function runs in the model's module's own globals, where the load wrote nothing.
        code = run.__func__.__code__
        assert any(c is dynamo_shim.torch_standin for c in code.co_consts)
        assert run.__func__.__globals__ is vars(th_alias)
        assert set(vars(th_alias)) == names
        m.eps = 0.25
        assert torch.allclose(warm(x), m.run(x), atol=1e-6)
    assert [e for e, _ in warm.events] == ["hit"]


class Broken(Scaled):
    """The same arithmetic on both sides of a graph break: the frame after it (Dynamo's
    resume function) takes the floats as tensors too."""

    def run(self, x: torch.Tensor) -> torch.Tensor:
        h = super().run(x)
        if h.sum().item() > -1e9:          # data-dependent: the graph breaks here
            h = h + 0.0
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def test_floats_after_a_graph_break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, ref = Broken().eval(), Broken().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        cache_compile(m.run, dynamic=True, fullgraph=False, cache_dir=tmp_path)(x)  # publish
        warm = cache_compile(m.run, dynamic=True, fullgraph=False, cache_dir=tmp_path)
        compiled = torch.compile(ref.run, dynamic=True)
        assert torch.allclose(warm(x), compiled(x), atol=1e-6)
        _steps_against(warm, compiled, m, ref, x, monkeypatch)
    assert [e for e, _ in warm.events][0] == "hit"
