"""Single trace per entry: a Dynamo recompile within one signature withdraws the entry."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import store
from cachecompile import RecompileWarning, cache_compile

ACT = "tanh"  # a global the method reads: Dynamo guards on it, the cache key cannot see it


class UsesGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(torch, ACT)(self.lin(x))


def test_recompile_withdraws_entry_and_keeps_results_right(tmp_path: Path) -> None:
    global ACT
    d = tmp_path / "cc"
    m = UsesGlobal().eval()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=d)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.allclose(cached(x), m.run(x))
    st = store.open_store(d)

    def method_entries() -> list[store.EntryInfo]:
        # Shared-graph entries (kind=graph) hold only a program and stay valid.
        return [e for e in st.entries() if e.labels.get("kind") != "graph"]

    assert len(method_entries()) == 1

    ACT = "sigmoid"
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            out = cached(x)
            assert torch.allclose(out, m.run(x)), "live compile must follow the new global"
    finally:
        ACT = "tanh"
    recompiles = [w for w in caught if issubclass(w.category, RecompileWarning)]
    assert len(recompiles) == 1
    assert "traced twice" in str(recompiles[0].message)
    assert "ACT" in str(recompiles[0].message)  # Dynamo's guard-failure reason
    assert method_entries() == [], "the entry must be withdrawn"
