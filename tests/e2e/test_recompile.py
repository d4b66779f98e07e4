"""State that changes after a signature's first call.

Entries carry Dynamo's guards, so a recompile no longer withdraws anything: each state
gets its own variant. What a process does when state changes *after* the first call:

* the compiling process runs Dynamo's own live compile, which recompiles: right;
* a process that loaded an entry checks every guard on every call (``guards="always"``,
  the default, like torch.compile: the change finds or compiles the variant that fits),
  or the state guards only on each signature's first call (``guards="first"``, opt-in,
  like TorchAir: a later change is not seen).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tiny
import torch
from torch import nn

from cachecompile import cache_compile, store
from cachecompile.cold.miss import CHURN_LIMIT

ACT = "tanh"  # a global the method reads: Dynamo guards on it


class UsesGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(torch, ACT)(self.lin(x))


def _method_entries(d: Path) -> list[store.EntryInfo]:
    # Shared-graph entries (kind=graph) hold only a program.
    return [e for e in store.open_store(d).entries() if e.labels.get("kind") != "graph"]


def _set_act(value: str) -> None:
    global ACT
    ACT = value


def test_each_state_gets_its_own_variant(tmp_path: Path) -> None:
    d = tmp_path / "cc"
    m = UsesGlobal().eval()
    x = torch.randn(2, 4)
    try:
        cold = cache_compile(m.run, backend="aot_eager", cache_dir=d)
        with torch.no_grad():
            assert torch.allclose(cold(x), m.run(x))
            _set_act("sigmoid")  # after the first call: every guard runs on every call
            assert torch.allclose(cold(x), m.run(x))
        # The change is a lookup: the new state compiles and publishes its own variant,
        # and nothing is withdrawn.
        assert [e[0] for e in cold.events] == ["miss", "miss"], cold.events
        assert sorted(e.labels["variant"] for e in _method_entries(d)) == ["0", "1"]
        for act in ("tanh", "sigmoid"):
            _set_act(act)
            again = cache_compile(m.run, backend="aot_eager", cache_dir=d)
            with torch.no_grad():
                assert torch.allclose(again(x), m.run(x))
            assert [e[0] for e in again.events] == ["hit"], act
    finally:
        _set_act("tanh")


def test_the_default_follows_a_change_after_the_first_call(tmp_path: Path) -> None:
    d = tmp_path / "cc"
    m = UsesGlobal().eval()
    x = torch.randn(2, 4)
    try:
        for act in ("tanh", "sigmoid"):  # publish both variants
            _set_act(act)
            with torch.no_grad():
                cache_compile(m.run, backend="aot_eager", cache_dir=d)(x)
        _set_act("tanh")
        always = cache_compile(m.run, backend="aot_eager", cache_dir=d)  # the default
        first = cache_compile(m.run, backend="aot_eager", cache_dir=d, guards="first")
        with torch.no_grad():
            assert torch.allclose(always(x), torch.tanh(m.lin(x)))
            assert torch.allclose(first(x), torch.tanh(m.lin(x)))
            _set_act("sigmoid")
            # Every guard on every call: the change is seen, variant 1 is loaded.
            assert torch.allclose(always(x), torch.sigmoid(m.lin(x)))
            assert [e[0] for e in always.events] == ["hit", "hit"]
            # The opt-in "first" checks state once per signature and process (documented):
            # the loaded variant keeps running.
            assert torch.allclose(first(x), torch.tanh(m.lin(x)))
    finally:
        _set_act("tanh")


class _Counter:
    """A plain object whose int the method reads and bumps (a cache layer's position)."""

    def __init__(self) -> None:
        self.n = 0


class Stepper(tiny.Small):
    def __init__(self) -> None:
        super().__init__()
        self.state = _Counter()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.state.n += 1
        return self.lin(x) * self.state.n


def _steps(cached: object, m: Stepper, ref: Stepper, n: int) -> list[str]:
    """``n`` calls, each equal to eager's; the SignatureLimitWarnings they gave."""
    import warnings

    from cachecompile import SignatureLimitWarning

    x = torch.randn(2, 4)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            assert torch.equal(cached(x), ref.step(x))  # type: ignore[operator]
    assert m.state.n == ref.state.n
    return [str(w.message) for w in caught if issubclass(w.category, SignatureLimitWarning)]


def test_an_int_that_changes_every_call_never_crashes_and_stays_right(tmp_path: Path) -> None:
    """A value Dynamo guards by value changes on every call (a cache layer's position).
    Each value is a new compile, up to Dynamo's recompile limit, which fullgraph makes a
    hard error (FailOnRecompileLimitHit used to reach the user and kill the process).
    Every step must give eager's result, the counter must count, and the limit is one
    warning that names the guard."""
    d = tmp_path / "cc"
    # The compiling process: its live compile recompiles itself until Dynamo's limit.
    m, ref = Stepper().eval(), Stepper().eval()
    cold = cache_compile(m.step, backend="aot_eager", cache_dir=d, dynamic=False)
    limit = _steps(cold, m, ref, 24)
    assert len(limit) == 3, limit  # churn, then the signature limit, then Dynamo's
    assert "self.state.n has a new value on call after call" in limit[0], limit
    assert "recompile limit" in limit[2] and "self.state.n ==" in limit[2], limit
    assert "dynamic=True" in limit[0] and "not cached" in limit[0], limit
    assert "static variants" in limit[1], limit
    # A process that loads the entries, in the default mode (every guard on every call,
    # torch.compile's behaviour): eager's result at every step; the published variants
    # hit, then new ones run live, unpublished, then past Dynamo's limit eagerly.
    m2, ref2 = Stepper().eval(), Stepper().eval()
    warm = cache_compile(m2.step, backend="aot_eager", cache_dir=d, dynamic=False)
    _steps(warm, m2, ref2, 24)
    assert [e[0] for e in warm.events][:1 + CHURN_LIMIT + 1] == \
        ["hit"] * (1 + CHURN_LIMIT) + ["miss"], warm.events
    # The first entry (n == 1, which every restarted process meets again) and
    # CHURN_LIMIT variants, from the compiling process: not one per step.
    assert len(_method_entries(d)) == 1 + CHURN_LIMIT, _method_entries(d)
    # A third process meets steps 1..3 again: hits, all of them.
    m3, ref3 = Stepper().eval(), Stepper().eval()
    again = cache_compile(m3.step, backend="aot_eager", cache_dir=d, dynamic=False)
    _steps(again, m3, ref3, 3)
    assert [e[0] for e in again.events] == ["hit"] * 3, again.events


class ReadsEnv(tiny.Small):
    def run(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("CC_TEST_FLAG") == "1":
            return self.lin(x) * 2
        return self.lin(x)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_an_env_var_unset_at_trace_and_set_later_misses(tmp_path: Path, backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo leaves no guard for a variable its trace read while unset; the entry must
    not hit once it is set (a process that loads the entry, torch.compile traced anew)."""
    monkeypatch.delenv("CC_TEST_FLAG", raising=False)
    d = tmp_path / "cc"
    x = torch.randn(2, 4)
    with torch.no_grad():
        m = ReadsEnv().eval()
        cache_compile(m.run, backend=backend, cache_dir=d)(x)
        monkeypatch.setenv("CC_TEST_FLAG", "1")
        warm = cache_compile(ReadsEnv().eval().run, backend=backend, cache_dir=d)
        assert torch.allclose(warm(x), m.run(x)) and torch.allclose(warm(x), m.lin(x) * 2)
        monkeypatch.delenv("CC_TEST_FLAG")
        again = cache_compile(ReadsEnv().eval().run, backend=backend, cache_dir=d)
        assert torch.allclose(again(x), m.lin(x))
    assert [e[0] for e in warm.events] == ["miss"] and [e[0] for e in again.events] == ["hit"]


class Tied(nn.Module):
    """An embedding and an output head that share one weight (tied, as in most LMs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_sharing_lost_after_the_first_call_is_a_miss(tmp_path: Path, backend: str) -> None:
    """Dynamo reads tied weights as one graph input (DUPLICATE_INPUT): untying them after
    the entry was made must not reuse the program that reads one weight for both."""
    d = tmp_path / "cc"
    ids = torch.arange(4)
    with torch.no_grad():
        cache_compile(Tied().eval().run, backend=backend, cache_dir=d)(ids)
        # In a process that loaded the entry: untie after the first call.
        m = Tied().eval()
        warm = cache_compile(m.run, backend=backend, cache_dir=d)
        assert torch.equal(warm(ids), m.run(ids))
        m.head.weight = nn.Parameter(torch.randn(16, 8))
        assert torch.allclose(warm(ids), m.run(ids), atol=1e-6)
        assert [e for e, _ in warm.events] == ["hit", "miss"], warm.events
        # Across processes: untied before the first call gets the untied variant; tied
        # still gets its own.
        for tie in (False, True):
            m2 = Tied().eval()
            if not tie:
                m2.head.weight = nn.Parameter(torch.randn(16, 8))
            again = cache_compile(m2.run, backend=backend, cache_dir=d)
            assert torch.allclose(again(ids), m2.run(ids), atol=1e-6)
            assert [e for e, _ in again.events] == ["hit"], (tie, again.events)
