"""dynamic=None per dimension, as torch.compile's automatic dynamic shapes: a call that
differs from the first of its form in some sizes compiles with those dims dynamic and
every other one static (not the whole method dynamic, a compile torch.compile never
makes: Longformer's global attention failed inside Inductor that way). The spec is
torch.compile itself, run beside it on the same calls: the same number of compiles, the
same outputs; a second process compiles nothing; the user's tensors keep no mark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cachecompile import cache_compile


class Attend(nn.Module):
    """Reads a size as a Python number (static dims are guarded by value, dynamic ones
    symbolically), and a second input whose sizes move with the first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * mask.unsqueeze(-1)
        return torch.softmax(h @ h.transpose(-1, -2) / x.shape[-1] ** 0.5, -1) @ h


# (batch, sequence): the sequence changes, then the batch: each change one more dim.
CALLS = [(2, 8), (2, 12), (2, 20), (3, 20), (2, 8), (4, 6)]


def _inputs(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b * 100 + n)
    return torch.randn(b, n, 16, generator=g), (torch.rand(b, n, generator=g) > 0.2).float()


# A batch of one that grows: Dynamo specialises sizes 0 and 1, so the dim that changed
# serves every batch from 2 on, and the first compile stays for the batch of one.
CALLS_FROM_ONE = [(1, 8), (2, 8), (3, 8), (1, 8), (5, 8)]


def _torch_compiles(backend: str, calls: list[tuple[int, int]] = CALLS
                    ) -> tuple[int, list[torch.Tensor]]:
    """Plain torch.compile's frame compiles and outputs on ``calls`` (the spec)."""
    import torch._dynamo

    torch._dynamo.reset()
    compiles = 0
    inner = torch._dynamo.lookup_backend(backend)

    def counting(gm: torch.fx.GraphModule, example: list[Any]) -> Any:
        nonlocal compiles
        compiles += 1
        return inner(gm, example)

    m = Attend().eval()
    f = torch.compile(m, backend=counting)
    with torch.no_grad():
        outs = [f(*_inputs(b, n)) for b, n in calls]
    return compiles, outs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_dims_that_changed_are_dynamic_and_no_others(cache_dir: Path, backend: str) -> None:
    want_compiles, want = _torch_compiles(backend)

    def run() -> tuple[list[tuple[str, str]], list[torch.Tensor], list[dict[str, Any]]]:
        m = Attend().eval()
        cached = cache_compile(m, backend=backend, cache_dir=cache_dir)
        outs, marks = [], []
        with torch.no_grad():
            for b, n in CALLS:
                x, mask = _inputs(b, n)
                outs.append(cached(x, mask))
                marks += [x.__dict__, mask.__dict__]
        return cached.events, outs, marks

    events, outs, marks = run()
    # Static first; then the sequence dim of both inputs dynamic, the batch still 2;
    # then the batch too: three compiles, as torch.compile's automatic dynamic makes.
    assert events == [("miss", "float32[2,8,16]@cpu, float32[2,8]@cpu"),
                      ("miss", "float32[2,n,16]@cpu, float32[2,n]@cpu"),
                      ("miss", "float32[n,n,16]@cpu, float32[n,n]@cpu")], events
    assert len(events) == want_compiles
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(got, ref)
    # The dims were marked for Dynamo's compile only: the caller's tensors keep nothing.
    assert all(d == {} for d in marks), marks
    # A process that makes the same calls loads the same three entries and compiles none.
    events, outs, _ = run()
    assert [e for e, _ in events] == ["hit", "hit", "hit"], events
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(got, ref)


def test_a_size_of_one_that_grows_compiles_as_torch_compile_does(cache_dir: Path) -> None:
    """A size-1 dim that grows is the same form as its size-1 first call (sizes 0 and 1 are
    not a form of their own): two compiles, as torch.compile's, not a static one more."""
    want_compiles, want = _torch_compiles("aot_eager", CALLS_FROM_ONE)
    for process in ("cold", "warm"):
        m = Attend().eval()
        cached = cache_compile(m, backend="aot_eager", cache_dir=cache_dir)
        with torch.no_grad():
            outs = [cached(*_inputs(b, n)) for b, n in CALLS_FROM_ONE]
        for got, ref in zip(outs, want, strict=True):
            torch.testing.assert_close(got, ref)
        outcome = "miss" if process == "cold" else "hit"
        assert cached.events == [(outcome, "float32[1,8,16]@cpu, float32[1,8]@cpu"),
                                 (outcome, "float32[n,8,16]@cpu, float32[n,8]@cpu")], cached.events
    assert want_compiles == 2


def test_an_int_that_changes_makes_the_method_dynamic(cache_dir: Path) -> None:
    """More than sizes changed (an int's value): the whole method dynamic, as before."""

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
            return x * k + x.shape[0]

    cached = cache_compile(Scaled(), backend="aot_eager", cache_dir=cache_dir)
    with torch.no_grad():
        for n, k in ((4, 2), (4, 3), (6, 5)):
            x = torch.randn(n, 3)
            assert torch.equal(cached(x, k), x * k + n)
    assert cached.events == [("miss", "float32[4,3]@cpu, 2"),
                             ("miss", "float32[n,n]@cpu, int")], cached.events
