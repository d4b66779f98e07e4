"""Dynamo's marks on inputs (mark_dynamic, maybe_mark_dynamic, mark_static) are honoured
and keyed: they are part of the signature, as they are part of what Dynamo compiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ccutil import Sandbox
from tiny import Small

from cachecompile import cache_compile, store
from cachecompile.key.signature import describe, signature


def _marked(rows: int, how: str) -> torch.Tensor:
    x = torch.randn(rows, 4)
    getattr(torch._dynamo, how)(x, 0)
    return x


def _entries(cache_dir: Path) -> list[str]:
    return sorted(i.labels["signature"] for i in store.open_store(cache_dir).entries()
                  if i.labels.get("function") == "run")


@pytest.mark.parametrize("how", ["mark_dynamic", "maybe_mark_dynamic"])
def test_a_dim_marked_dynamic_serves_every_size_under_dynamic_false(cache_dir: Path,
                                                                    how: str) -> None:
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, dynamic=False)
    for rows in (3, 5, 9):
        x = _marked(rows, how)
        assert torch.allclose(cached(x), m.run(x))
    assert [e[0] for e in cached.events] == ["miss"]
    (sig,) = _entries(cache_dir)
    assert sig.startswith("float32[n,4]@cpu marked "), sig
    # Unmarked inputs are another signature: static, one entry per shape.
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        assert torch.allclose(cached(x), m.run(x))
    assert [e[0] for e in cached.events] == ["miss", "miss", "miss"]


def test_a_dim_marked_static_is_one_entry_per_size_under_dynamic_true(cache_dir: Path) -> None:
    m = Small()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, dynamic=True)
    for rows in (3, 5, 5):
        x = _marked(rows, "mark_static")
        assert torch.allclose(cached(x), m.run(x))
    assert [e[0] for e in cached.events] == ["miss", "miss"]
    assert _entries(cache_dir) == ["float32[3,n]@cpu marked static[0]",
                                   "float32[5,n]@cpu marked static[0]"]


def test_marks_are_keyed() -> None:
    plain = signature((torch.randn(3, 4),), {}, False)
    dyn = signature((_marked(3, "mark_dynamic"),), {}, False)
    maybe = signature((_marked(3, "maybe_mark_dynamic"),), {}, False)
    static = signature((_marked(3, "mark_static"),), {}, False)
    assert len({plain, dyn, maybe, static}) == 4
    assert describe(plain) == "float32[3,4]@cpu"
    # Unmarked tensors keep the signature (and so the keys) they had before marks counted.
    assert len(plain[0]) == 7
    # A range is part of the mark.
    ranged = torch.randn(3, 4)
    torch._dynamo.mark_dynamic(ranged, 0, min=2, max=64)
    assert signature((ranged,), {}, False) != dyn


WARM = """
import torch
from torch import nn
from cachecompile import cache_compile
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
    def run(self, x):
        return torch.tanh(self.lin(x))
m = Small()
cached = cache_compile(m.run, backend="aot_eager", dynamic=False)
x = torch.randn({rows}, 4)
if {mark}:
    torch._dynamo.mark_dynamic(x, 0)
out = cached(x)
import sys
report({{"events": [e[0] for e in cached.events], "ok": bool(torch.allclose(out, m.run(x))),
         "dynamo": "torch._dynamo" in sys.modules}})
"""


@pytest.mark.slow
def test_a_fresh_process_with_the_mark_hits_and_one_without_misses(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    assert box.run(WARM.format(rows=3, mark=True))["events"] == ["miss"]
    warm = box.run(WARM.format(rows=7, mark=True))
    assert warm["events"] == ["hit"] and warm["ok"]
    unmarked = box.run(WARM.format(rows=7, mark=False))
    assert unmarked["events"] == ["miss"] and unmarked["ok"]
