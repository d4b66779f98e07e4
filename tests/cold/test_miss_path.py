"""The miss path's decisions, in-process and in milliseconds, with a fake adapter.

A ``CompileSpec`` built by hand carries a fake adapter whose "compile" keeps Dynamo's
graph module in memory and whose "load" hands it back, so no compiler runs: Dynamo still
traces for real (the entry's bytecode and guards are real), the store is real. What is
tested is what ``cached`` / ``cold.miss`` / ``warm.lookup`` decide: a hit after a publish,
a new variant when a guard fails, when not to publish (churn, read-only, not
replayable), what a bad entry degrades to, and that the locks are released. The promises
that need fresh processes stay in the subprocess tests.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cachecompile.backends.base import Compiled, GraphCallable, Program
from cachecompile.cached import CachedFunction
from cachecompile.cold.miss import CHURN_LIMIT, Churn
from cachecompile.entry.guards import GuardMode
from cachecompile.errors import CacheFaultWarning, SignatureLimitWarning, UnsupportedProgramError
from cachecompile.key.ranks import detect
from cachecompile.procs import coop
from cachecompile.spec import CompileSpec
from cachecompile.store import open_store
from cachecompile.warm import state
from cachecompile.warm.lookup import Probe

_graphs: dict[str, torch.fx.GraphModule] = {}
_tokens = itertools.count()


class FakeAdapter:
    """Compiles nothing: the graph module is the program, kept in this process."""

    name = "fake"
    shares_graphs = False
    torch_parts: tuple[str, ...] = ()

    def __init__(self, *, replayable: bool = True, loadable: bool = True) -> None:
        self.replayable = replayable
        self.loadable = loadable
        self.compiles = 0
        self.loads = 0

    def factors(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {"fake": 1}

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        self.compiles += 1
        token = f"g{next(_tokens)}"
        _graphs[token] = gm

        def program() -> Program:
            if not self.replayable:
                raise UnsupportedProgramError("the fake adapter was told so")
            return Program(files={"program.py": b"# fake\n"}, meta={"token": token}, light=gm)

        return Compiled(live=gm, program=program)

    def load(self, files: Mapping[str, Path], meta: Mapping[str, Any]) -> GraphCallable:
        self.loads += 1
        if not self.loadable:
            raise RuntimeError("the fake adapter cannot load this")
        return _graphs[meta["token"]]

    def plain_backend(self, options: Mapping[str, Any], decompositions: Mapping[Any, Any] | None
                      ) -> tuple[Any, dict[str, Any] | None]:
        return "eager", None


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = 2.0

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _cached(module: torch.nn.Module, adapter: FakeAdapter, store: Path, **kw: Any) -> CachedFunction:
    spec = CompileSpec(adapter=adapter, options={}, decompositions=None, dynamic=False,  # type: ignore[arg-type]
                       guards=kw.pop("guards", GuardMode.ALWAYS), ranks=detect(),
                       cache_dir=str(store), max_signatures=8, **kw)
    return CachedFunction(module.run, spec)  # type: ignore[arg-type]


def _entries(store: Path) -> list[Any]:
    return [e for e in open_store(str(store)).maintenance().entries() if e.labels.get("kind") != "graph"]


@pytest.fixture
def model() -> Scaled:
    torch.manual_seed(0)
    return Scaled().eval()


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))


def test_publish_then_a_new_cached_function_hits(tmp_path: Path, model: Scaled) -> None:
    fake = FakeAdapter()
    first = _cached(model, fake, tmp_path)
    assert torch.equal(first(X), model.run(X))
    assert [e[0] for e in first.events] == ["miss"] and fake.compiles == 1
    second = _cached(model, fake, tmp_path)  # as a restarted process would
    assert torch.equal(second(X), model.run(X))
    assert [e[0] for e in second.events] == ["hit"]
    assert fake.compiles == 1 and fake.loads == 1
    assert len(_entries(tmp_path)) == 1


def test_a_failed_guard_publishes_a_second_variant(tmp_path: Path, model: Scaled) -> None:
    fake = FakeAdapter()
    cached = _cached(model, fake, tmp_path)
    cached(X)
    model.scale = 3.0                       # after the first call, in the same process
    assert torch.equal(cached(X), model.run(X))
    assert [e[0] for e in cached.events] == ["miss", "miss"]
    assert sorted(e.labels["variant"] for e in _entries(tmp_path)) == ["0", "1"]
    model.scale = 2.0                       # the first variant serves again, no compile
    assert torch.equal(cached(X), model.run(X)) and fake.compiles == 2


def test_first_mode_does_not_see_state_changed_later(tmp_path: Path, model: Scaled) -> None:
    # The opt-in TorchAir behaviour, stated: a loaded entry's state guards ran on its first
    # calls only (when loaded and on the next call). (The compiling process serves from
    # its live compile, which Dynamo guards.)
    _cached(model, FakeAdapter(), tmp_path)(X)
    loaded = _cached(model, FakeAdapter(), tmp_path, guards=GuardMode.FIRST)
    want = loaded(X)
    assert torch.equal(loaded(X), want)
    assert [e[0] for e in loaded.events] == ["hit"]
    model.scale = 3.0
    assert torch.equal(loaded(X), want) and not torch.equal(want, model.run(X))
    always = _cached(model, FakeAdapter(), tmp_path)
    assert torch.equal(always(X), model.run(X))   # the default sees it: a new variant


def test_churn_stops_publishing_after_the_limit(tmp_path: Path, model: Scaled) -> None:
    cached = _cached(model, FakeAdapter(), tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(CHURN_LIMIT + 4):
            model.scale = float(step)
            assert torch.equal(cached(X), model.run(X))
    limit = [w for w in caught if issubclass(w.category, SignatureLimitWarning)]
    assert len(limit) == 1 and "self.scale" in str(limit[0].message)
    assert len(_entries(tmp_path)) == 1 + CHURN_LIMIT


def test_a_change_made_once_is_no_churn_however_many_variants_it_fails() -> None:
    """Stored variants made for other changes (train(), a hook, another flag) all fail
    first on a value changed once, each wanting the value it had then: one value, so the
    new variant is published (it was refused, and every later process compiled again).
    Variants made for many values of it are churn."""
    once = Probe(kind="guard", guard="self.config.n", guard_reason="n == 2, got 1",
                 guard_values={"self.config.n": {"2"}})
    assert Churn("M.run").worth_publishing(once, ())
    counter = Probe(kind="guard", guard="self.pos", guard_reason="pos == 3, got 4",
                    guard_values={"self.pos": {str(i) for i in range(CHURN_LIMIT + 1)}})
    with pytest.warns(SignatureLimitWarning, match="self.pos"):
        assert not Churn("M.run").worth_publishing(counter, ())


class Flags(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.a = self.b = self.c = 1.0

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.a * self.b * self.c


def test_each_one_time_change_is_published_and_hits_in_the_next_process(tmp_path: Path) -> None:
    """Processes in turn, each with one flag changed once (b, then c, then a): every
    stored variant fails first on a, all for its one old value; a's variant is published,
    so the next process with it hits."""
    torch.manual_seed(0)
    m = Flags().eval()
    fake = FakeAdapter()
    runs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for flag in ("", "b", "c", "a", "a"):
            m.a = m.b = m.c = 1.0
            if flag:
                setattr(m, flag, 2.0)
            cached = _cached(m, fake, tmp_path)   # as a new process would
            assert torch.equal(cached(X), m.run(X))
            runs.append([e[0] for e in cached.events])
    assert runs == [["miss"], ["miss"], ["miss"], ["miss"], ["hit"]], runs
    assert not [w for w in caught if issubclass(w.category, SignatureLimitWarning)]


def test_readonly_store_compiles_and_publishes_nothing(tmp_path: Path, model: Scaled,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    open_store(str(tmp_path))  # the store exists; this process may only read it
    monkeypatch.setenv("CACHECOMPILE_READONLY", "1")
    cached = _cached(model, FakeAdapter(), tmp_path)
    with pytest.warns(CacheFaultWarning, match="read-only"):
        assert torch.equal(cached(X), model.run(X))
    assert [e[0] for e in cached.events] == ["miss"]
    assert _entries(tmp_path) == []


def test_not_replayable_runs_live_and_publishes_nothing(tmp_path: Path, model: Scaled) -> None:
    cached = _cached(model, FakeAdapter(replayable=False), tmp_path)
    with pytest.warns(CacheFaultWarning, match="not cacheable"):
        assert torch.equal(cached(X), model.run(X))
    assert _entries(tmp_path) == []
    assert torch.equal(cached(X), model.run(X))  # served by its live compile


def test_an_unloadable_entry_is_removed_and_recompiled(tmp_path: Path, model: Scaled) -> None:
    _cached(model, FakeAdapter(), tmp_path)(X)
    broken = FakeAdapter(loadable=False)
    cached = _cached(model, broken, tmp_path)
    with pytest.warns(CacheFaultWarning, match="could not be loaded"):
        assert torch.equal(cached(X), model.run(X))
    assert [e[0] for e in cached.events] == ["miss"] and broken.compiles == 1
    assert len(_entries(tmp_path)) == 1   # the bad one removed, this one published
    stats = open_store(str(tmp_path)).stats()
    assert stats["misses"].get("unloadable") == 1, stats


def test_the_frame_lock_is_released_after_a_miss(tmp_path: Path, model: Scaled) -> None:
    cached = _cached(model, FakeAdapter(), tmp_path)
    cached(X)
    st = open_store(str(tmp_path))
    frame = cached.key(next(iter(cached._runners)))
    with coop.held(st, frame.digest, who="test", purpose="test", timeout=0.5):
        pass  # would time out (LockTimeout) if the miss path still held it


def test_a_malformed_remote_falls_back_to_the_local_entry(tmp_path: Path, model: Scaled,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A serving process whose CACHECOMPILE_REMOTE is malformed: one warning that names the
    # variable (not the password), and the valid local entry still serves.
    _cached(model, FakeAdapter(), tmp_path)(X)
    monkeypatch.setattr(state, "_stores", {})   # as a new process: the store opened again
    monkeypatch.setenv("CACHECOMPILE_REMOTE", "redis://:s3cret@localhost:notaport/0")
    fresh = _cached(model, FakeAdapter(), tmp_path)
    with pytest.warns(CacheFaultWarning, match="CACHECOMPILE_REMOTE") as caught:
        assert torch.equal(fresh(X), model.run(X))
    assert [e[0] for e in fresh.events] == ["hit"]
    assert all("s3cret" not in str(w.message) for w in caught)


def test_an_unreadable_signing_key_file_keeps_the_local_cache(tmp_path: Path, model: Scaled,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    # A mistyped key file used to make the whole store "unusable" (no cache at all) with
    # a message that never named the variable.
    _cached(model, FakeAdapter(), tmp_path)(X)
    monkeypatch.setattr(state, "_stores", {})
    monkeypatch.setenv("CACHECOMPILE_REMOTE", "redis://localhost:6379/0")
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", f"file:{tmp_path / 'no-such-key'}")
    fresh = _cached(model, FakeAdapter(), tmp_path)
    with pytest.warns(CacheFaultWarning, match="CACHECOMPILE_SIGNING_KEY=file:.*no-such-key"):
        assert torch.equal(fresh(X), model.run(X))
    assert [e[0] for e in fresh.events] == ["hit"]


def test_a_remote_hit_counts_one_hit(tmp_path: Path, model: Scaled,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # One lookup served by a download is one hit, and a remote one ('cachectl stats'
    # showed 2: the entry was read once for its meta, then again to load it).
    from memory_remote import MemoryRemote

    from cachecompile.store import open_store
    from cachecompile.store.signing import Trust
    from cachecompile.store.tiered import wrap

    remote = MemoryRemote(Trust(key=b"k"))
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a = wrap(open_store(a_dir, remote=""), remote)  # type: ignore[type-var]
    monkeypatch.setattr(state, "_stores", {str(a_dir): a})
    _cached(model, FakeAdapter(), a_dir)(X)
    assert a.flush(5) and remote.records_
    b = wrap(open_store(b_dir, remote=""), remote)  # type: ignore[type-var]
    monkeypatch.setattr(state, "_stores", {str(b_dir): b})
    fresh = _cached(model, FakeAdapter(), b_dir)
    assert torch.equal(fresh(X), model.run(X)) and [e[0] for e in fresh.events] == ["hit"]
    s = b.stats()
    assert (s["hits"], s["hits_local"], s["hits_remote"]) == (1, 0, 1), s
