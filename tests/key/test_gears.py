"""Gears: declared static shapes, one entry each; out-of-gear calls live or padded.

In-process, real torch.compile on the aot_eager backend (the gear logic is backend-agnostic).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cachecompile import ContractError, OutOfGearWarning, cache_compile, store
from cachecompile.build import Exact, prebuild


class Rows(nn.Module):
    """Row-independent along dim 0 of x (so padding rows is safe)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)

    def run(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + y.sum(-1, keepdim=True)

    def mix(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(0, keepdim=True) + y.sum(1, keepdim=True)

    def pair(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h.sum(-1)



def _signatures(cache_dir: Path, function: str) -> list[str]:
    st = store.open_store(cache_dir)
    return sorted(i.labels["signature"] for i in st.entries()
                  if i.labels.get("function") == function)


def _xy(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows * 10 + cols)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, cols, generator=g)


def test_zip_gears_one_entry_each(cache_dir: Path) -> None:
    m = Rows()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                           gears={"x": {0: [2, 4]}, "y": {0: [2, 4], 1: [3, 5]}})
    assert cached.gears is not None and list(cached.gears.shapes) == [(2, 2, 3), (4, 4, 5)]
    results = prebuild(cached, [_xy(2, 3)])
    assert [r.status for r in results] == ["built", "built"]
    assert _signatures(cache_dir, "run") == ["float32[2,6]@cpu, float32[2,3]@cpu",
                                             "float32[4,6]@cpu, float32[4,5]@cpu"]
    # A second prebuild finds them all.
    assert [r.status for r in prebuild(cached, [_xy(4, 5)])] == ["present", "present"]
    for shape in ((2, 3), (4, 5)):
        x, y = _xy(*shape)
        assert torch.allclose(cached(x, y), m.run(x, y))


def test_product_gears_every_combination(cache_dir: Path) -> None:
    m = Rows()
    cached = cache_compile(m.mix, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                           gears={"x": {0: [2, 4]}, "y": {1: [3, 5]}}, gear_policy="product",
                           max_signatures=1)
    results = prebuild(cached, [_xy(4, 3)])
    # y's dim 0 follows the template (4 rows): x's rows vary, y's columns vary.
    assert [r.status for r in results] == ["built"] * 4
    assert _signatures(cache_dir, "mix") == [
        "float32[2,6]@cpu, float32[4,3]@cpu", "float32[2,6]@cpu, float32[4,5]@cpu",
        "float32[4,6]@cpu, float32[4,3]@cpu", "float32[4,6]@cpu, float32[4,5]@cpu"]


def test_out_of_gear_call_is_cached_with_one_warning(cache_dir: Path) -> None:
    """Issue 34: a signature outside the gears is compiled once and published like any
    other (a fresh process loads it), with one warning, and counted in stats."""
    m = Rows()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                           gears={"x": {0: [2, 4]}, "y": {0: [2, 4]}})
    x, y = _xy(2, 3)
    cached(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (3, 3, 5):
            x, y = _xy(rows, 3)
            assert torch.allclose(cached(x, y), m.run(x, y))
    out_of_gear = [w for w in caught if issubclass(w.category, OutOfGearWarning)]
    assert len(out_of_gear) == 1, [str(w.message) for w in caught]
    message = str(out_of_gear[0].message)
    assert "x[0]=3, y[0]=3" in message and "x[0]=2, y[0]=2; x[0]=4, y[0]=4" in message
    assert "cached like any other signature" in message
    assert [e[0] for e in cached.events] == ["miss", "miss", "miss"]
    assert _signatures(cache_dir, "run") == ["float32[2,6]@cpu, float32[2,3]@cpu",
                                             "float32[3,6]@cpu, float32[3,3]@cpu",
                                             "float32[5,6]@cpu, float32[5,3]@cpu"]
    about = store.open_store(cache_dir).stats()["misses_about"]["absent"]
    assert about["outside the declared gears"] == 2
    # Another wrapper (a fresh process's) loads it; an Exact example prebuilds one.
    again = cache_compile(Rows().run, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                          gears={"x": {0: [2, 4]}, "y": {0: [2, 4]}})
    x, y = _xy(3, 3)
    assert torch.allclose(again(x, y), m.run(x, y))
    assert [e[0] for e in again.events] == ["hit"]
    results = prebuild(again, [Exact(*_xy(7, 3))])
    assert [(r.status, r.signature) for r in results] == [
        ("built", "float32[7,6]@cpu, float32[7,3]@cpu")]


def test_pad_runs_the_next_gear_and_slices_the_outputs(cache_dir: Path) -> None:
    m = Rows()
    cached = cache_compile(m.pair, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                           gears={"x": {0: [2, 4, 8]}}, pad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfGearWarning)
        for rows in (3, 1, 4, 7):
            x = torch.randn(rows, 6)
            got, want = cached(x), m.pair(x)
            assert [t.shape for t in got] == [t.shape for t in want]
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want, strict=True))
    assert _signatures(cache_dir, "pair") == ["float32[2,6]@cpu", "float32[4,6]@cpu",
                                              "float32[8,6]@cpu"]
    # Larger than every gear: no padding, a live compile and the warning.
    with pytest.warns(OutOfGearWarning, match="larger than every gear"):
        x = torch.randn(9, 6)
        got = cached(x)
    assert torch.allclose(got[0], m.pair(x)[0], atol=1e-6)


def test_pad_refuses_an_ambiguous_output_dim(cache_dir: Path) -> None:
    class Two(nn.Module):
        def run(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.sum(0) + b.sum(0)

    m = Two()
    # a and b are both padded along dim 0, to the same gear but from different sizes:
    # which original size an output's dim 0 has is not knowable.
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                           gears={"a": {0: [4]}, "b": {0: [4]}}, pad=True)
    with pytest.warns(OutOfGearWarning, match="ambiguous"):
        cached(torch.randn(2, 3), torch.randn(3, 3))


@pytest.mark.parametrize("kwargs, needle", [
    ({"gears": {"x": {0: [2, 4]}}}, "use them with dynamic=False"),
    ({"dynamic": False, "gears": {"z": {0: [2]}}}, "not an argument"),
    ({"dynamic": False, "gears": {"x": {-1: [2]}}}, "dims are ints"),
    ({"dynamic": False, "gears": {"x": {0: [2, 2]}}}, "repeats a size"),
    ({"dynamic": False, "gears": {"x": {0: [0]}}}, "ints >= 1"),
    ({"dynamic": False, "gears": {"x": {0: list(range(1, 102))}}}, "at most 100"),
    ({"dynamic": False, "gears": {"x": {0: [2, 4]}, "y": {0: [2]}}}, "same length"),
    ({"dynamic": False, "gears": {"x": {0: [2]}}, "gear_policy": "cross"}, "zip' or 'product"),
    ({"dynamic": False, "pad": True}, "declare gears"),
])
def test_bad_gears_are_refused(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ContractError, match=needle):
        cache_compile(Rows().run, backend="aot_eager", **kwargs)


def test_gears_raise_the_signature_limit(cache_dir: Path) -> None:
    cached = cache_compile(Rows().pair, backend="aot_eager", cache_dir=cache_dir,
                           dynamic=False, max_signatures=2,
                           gears={"x": {0: [1, 2, 3, 4]}})
    results = prebuild(cached, [torch.randn(5, 6)])
    assert [r.status for r in results] == ["built"] * 4
