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

import copy
import os
import re
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
            assert torch.allclose(first(x), torch.tanh(m.lin(x)))  # its state looked at again
            _set_act("sigmoid")
            # Every guard on every call: the change is seen, variant 1 is loaded.
            assert torch.allclose(always(x), torch.sigmoid(m.lin(x)))
            assert [e[0] for e in always.events] == ["hit", "hit"]
            # The opt-in "first" checks state on a variant's first two calls only
            # (documented): the loaded variant keeps running.
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


class PerDeployment(tiny.Small):
    """A Python int set once per process (a deployment's config), never during one."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.n


def test_a_value_new_in_each_process_is_said_so(tmp_path: Path) -> None:
    """A value each process sets once and never changes: past CHURN_LIMIT stored variants
    the next one is not published, and the warning says the value changed from process
    to process (it said 'on call after call' of a process that called once; found by a
    new user's trial)."""
    import warnings

    from cachecompile import SignatureLimitWarning

    d, x = tmp_path / "cc", torch.randn(2, 4)
    said: list[list[str]] = []
    for n in range(1, CHURN_LIMIT + 3):
        torch._dynamo.reset()  # Dynamo's caches as a fresh process has them
        m = PerDeployment(n).eval()
        cached = cache_compile(m.scaled, backend="aot_eager", cache_dir=d, dynamic=False)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(cached(x), m.scaled(x))
        said.append([str(w.message) for w in caught
                     if issubclass(w.category, SignatureLimitWarning)])
    assert said[:-1] == [[]] * (CHURN_LIMIT + 1), said
    (last,) = said[-1]
    assert (f"self.n has a new value in process after process ({CHURN_LIMIT + 1} stored "
            "variants were made for other values of it") in last, last
    assert "call after call" not in last, last


class ItemScale(tiny.Small):
    def scaled(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        # A break first: traced whole (as a capture tries first), Dynamo would keep the
        # .item() in the graph, general in k, and there would be no variants to make.
        torch._dynamo.graph_break()
        k = n.sum().item()  # a break; the resume frame specialises on k (dynamic=False)
        return self.lin(x) * k


def test_a_frame_whose_variants_fill_names_the_value_that_changes(tmp_path: Path) -> None:
    """Each process publishes the resume frame's variants for the values it met, up to
    16 per frame; the process that finds them all taken says so once, naming the guard
    whose value changes, and stays right; `cachectl ls` shows the signature on one row."""
    import warnings

    from cachecompile import CacheFaultWarning
    from cachecompile.cli.common import fold_variants
    from cachecompile.store import open_store

    d, x, m = tmp_path / "cc", torch.randn(2, 4), ItemScale().eval()

    def process(values: range) -> tuple[list[str], list[str]]:
        torch._dynamo.reset()  # Dynamo's caches as a fresh process has them
        cached = cache_compile(m.scaled, backend="aot_eager", cache_dir=d, dynamic=False,
                               fullgraph=False)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for v in values:
                n = torch.tensor([v + 0.5])
                assert torch.equal(cached(x, n), m.scaled(x, n))
        return ([e[0] for e in cached.events],
                [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)])

    events, _ = process(range(0, 3))
    assert events == ["miss"], events
    for values in (range(3, 10), range(10, 17)):
        events, said = process(values)
        assert events == ["hit"] and not [s for s in said if "already has" in s], said
    events, said = process(range(17, 22))
    full = [s for s in said if "already has 16 published variants" in s]
    assert events == ["hit"] and len(full) == 1, said
    assert re.search(r"`___stack0 == \d+\.5` here, `___stack0 == \d+\.5` in a stored "
                     r"variant", full[0]), full[0]
    # ___stack0 read as what it is: the value .item() left on Python's stack.
    assert "___stack0 is a value on Python's stack at the break, line " in full[0], full[0]
    assert "`k = n.sum().item()  # a break;" in full[0], full[0]
    infos = list(open_store(d).entries())
    folded = fold_variants(infos)
    assert len(infos) == 17 and len(folded.rows) == 1, [i.labels for i in infos]
    assert folded.variants == {folded.rows[0].key: "17 (16 frame)"}


def test_a_published_frame_variant_serves_whatever_order_values_come_in(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process that needs the chain's variants out of their order is served each one: a
    variant walked past for one value is checked again for the next (found from outside:
    after variant 1 served, the value of variant 0 compiled live), and so after a value
    no variant holds has compiled live."""
    import logging
    import warnings

    from cachecompile import CacheFaultWarning

    d, x, m = tmp_path / "cc", torch.randn(2, 4), ItemScale().eval()

    def process(values: list[float]) -> tuple[list[str], list[str]]:
        torch._dynamo.reset()  # Dynamo's caches as a fresh process has them
        cached = cache_compile(m.scaled, backend="aot_eager", cache_dir=d, dynamic=False,
                               fullgraph=False)
        caplog.clear()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught, \
                caplog.at_level(logging.INFO, logger="cachecompile"):
            warnings.simplefilter("always")
            for v in values:
                n = torch.tensor([v])
                assert torch.equal(cached(x, n), m.scaled(x, n))
        served = [r.getMessage().rsplit(" ", 1)[-1] for r in caplog.records
                  if "served by its published variant" in r.getMessage()]
        return served, [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)]

    process([0.5, 1.5, 2.5, 3.5])  # the entry (0.5), frame variants 0, 1, 2
    served, said = process([3.5, 1.5, 2.5])
    assert served == ["2", "0", "1"] and said == [], (served, said)
    served, said = process([9.5, 2.5, 1.5])
    assert served == ["1", "0"], (served, said)
    assert len(said) == 1 and "compiled live in this process" in said[0], said


class Config:
    """A config object as a model holds one (a SimpleNamespace would be a value)."""

    scale = 3.0


class CopiesItsConfig(torch.nn.Module):
    """LED's decoder, reduced: it deep-copies its config after a break."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = Config()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()
        return y * copy.deepcopy(self.cfg).scale


def test_a_frame_that_reads_an_id_is_live_and_says_which_line(tmp_path: Path) -> None:
    """copy.deepcopy reads id(x) for its memo, so Dynamo guards the object's identity,
    which no other process can match: the frame compiles live in each, and the warning
    names the line that made the guard, not a fix that does not fit."""
    import warnings

    from cachecompile import CacheFaultWarning

    x, cache_dir = torch.randn(3), tmp_path / "cc"
    said: list[str] = []
    for event in ("miss", "hit"):
        torch._dynamo.reset()   # Dynamo's caches as a fresh process has them
        m = CopiesItsConfig().eval()
        c = cache_compile(m.run, backend="aot_eager", cache_dir=cache_dir, fullgraph=False)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(c(x), m.run(x))
        assert [e for e, _ in c.events] == [event]
        said = [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)]
    assert len(said) == 1 and "compiled live in every process" in said[0], said
    assert "for `copy.py:" in said[0] and "in deepcopy: d = id(x)`" in said[0], said[0]
    assert "reads its id()" in said[0] and "pass it as an argument" not in said[0], said[0]


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


class WritesBoth(nn.Module):
    def run(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        b.mul_(2)
        return a + b


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_overlapping_views_after_the_first_call_are_a_miss(tmp_path: Path, backend: str) -> None:
    """Two views of one buffer, both written, passed where the entry was traced with two
    buffers: the program assumes a write to one is not seen through the other. Dynamo's
    identity guard lets the views through (torch.compile gives a wrong result here with
    static shapes); the entry's memory-overlap guard misses."""
    d = tmp_path / "cc"
    m = WritesBoth()

    def views() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buf = torch.zeros(6)
        return buf, buf[0:4], buf[2:6]

    cache_compile(m.run, backend=backend, cache_dir=d)(torch.zeros(4), torch.zeros(4))
    warm = cache_compile(m.run, backend=backend, cache_dir=d)   # loads the entry
    assert torch.equal(warm(torch.zeros(4), torch.zeros(4)), torch.full((4,), 1.0))
    buf, a, b = views()
    ref_buf, ra, rb = views()
    got, want = warm(a, b), m.run(ra, rb)
    assert torch.equal(got, want) and torch.equal(buf, ref_buf), (got, want, buf, ref_buf)
    assert [e for e, _ in warm.events] == ["hit", "miss"], warm.events
    # Views that do not overlap (one buffer, disjoint halves) behave as two buffers: a hit.
    buf = torch.zeros(8)
    again = cache_compile(m.run, backend=backend, cache_dir=d)
    assert torch.equal(again(buf[0:4], buf[4:8]), torch.full((4,), 1.0))
    assert [e for e, _ in again.events] == ["hit"], again.events


TREE_MODEL = '''
import torch
from torch import nn
ACT = "tanh"
class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.table = {"scale": 2}
        self.use_gate = True
    def run(self, x):
        y = getattr(torch, ACT)(self.lin(x)) * self.table["scale"]
        return y.relu() if self.use_gate else y
'''

TREE_CHILD = '''
import os, sys, torch
import tree_model as tm
from cachecompile import cache_compile
from cachecompile.entry import guard_tree
# The subject is a built tree meeting changes: build it on the first passing check, not
# once the Python checks have paid for it (guard_tree.BuildCost).
guard_tree.BuildCost.price_ms = lambda self, n_guards: 0.0
m = tm.Gated().eval()
f = cache_compile(m.run, backend=os.environ["BACKEND"])
x = torch.randn(3, 4)
ok = []
steps = [None, None, None, ("use_gate", False), None, None, ("act", "sigmoid"), None, None,
         ("use_gate", True), None]
if os.environ.get("NEW_STATE"):   # a state no process published: compiled live here
    steps += [("scale", 5), None, None]
dynamo_before_change = None
for step in steps:
    if step is not None and dynamo_before_change is None:
        dynamo_before_change = "torch._dynamo" in sys.modules
    if step and step[0] == "use_gate":
        m.use_gate = step[1]
    elif step and step[0] == "scale":
        m.table["scale"] = step[1]
    elif step and step[0] == "act":
        tm.ACT = step[1]
    with torch.no_grad():
        ok.append(bool(torch.allclose(f(x), m.run(x), atol=1e-6)))
v = [v for vs in f._runners.values() for v in vs]
report({"ok": ok, "events": [e for e, _ in f.events], "dynamo_before_change":
        dynamo_before_change, "trees": [getattr(x.check.__func__, "tree", None) is not None
                                        for x in v if x.check is not None]})
'''


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_state_changes_after_the_tree_is_built_in_a_warm_process(tmp_path: Path,
                                                                  backend: str) -> None:
    """A warm process (no Dynamo imported) checks by the C++ tree once it is built (here
    on its second call);
    changes after that (an attribute, a dict value, a module global) each fail the tree
    and are looked up, or compiled live with the real Dynamo imported then; every output
    equals eager's."""
    from ccutil import Sandbox

    box = Sandbox(tmp_path)
    (tmp_path / "tree_model.py").write_text(TREE_MODEL)
    cold = box.run(TREE_CHILD, BACKEND=backend)
    assert all(cold["ok"]), cold.value
    warm = box.run(TREE_CHILD, BACKEND=backend)
    assert all(warm["ok"]), warm.value
    assert warm["dynamo_before_change"] is False, warm.value
    # Every state the cold process published is a hit here; the tree was built on them.
    assert set(warm["events"]) == {"hit"}, (cold.value["events"], warm.value["events"])
    assert all(warm["trees"]), warm.value
    # A new state after trees were built without Dynamo: the real Dynamo compiles it live
    # in this process (it adopts the stand-in's manager type), right, and its own later
    # calls check by a tree too.
    new = box.run(TREE_CHILD, BACKEND=backend, NEW_STATE="1")
    assert all(new["ok"]), new.value
    assert new["events"] == ["hit"] * len(warm["events"]) + ["miss"], new.value
    assert all(new["trees"]), new.value


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_first_mode_runs_the_methods_own_side_effects_on_every_call(tmp_path: Path,
                                                                     backend: str) -> None:
    """guards="first" in a process that loaded the entry: a method that bumps a counter it
    is guarded on (self.state.n += 1) must count on every call. The replayed program
    writes the traced value, so the state no longer fits after one call; the second look
    at the state guards sees it and the variant checks every guard from then on."""
    d = tmp_path / "cc"
    cold_m = Stepper()
    cold = cache_compile(cold_m.step, backend=backend, cache_dir=d)
    x = torch.randn(2, 4)
    with torch.no_grad():
        cold(x)
        m, ref = Stepper(), Stepper()
        first = cache_compile(m.step, backend=backend, cache_dir=d, guards="first")
        for _ in range(4):
            assert torch.allclose(first(x), ref.step(x), atol=1e-6)
    assert m.state.n == ref.state.n == 4
    assert first.events[0][0] == "hit", first.events


PATCH_CHILD = '''
import os, torch
from torch import nn
if os.environ.get("PATCH") == "1":
    # A kernel-patching library's way: replace a torch class's method at import.
    _orig = nn.LayerNorm.forward
    def forward(self, x):
        return _orig(self, x) * 3.0
    nn.LayerNorm.forward = forward
from cachecompile import cache_compile

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
    def run(self, x):
        return self.norm(self.lin(x))

def doubled(module, args, out):
    return out * 2.0 if isinstance(module, nn.LayerNorm) else out

m = Net().eval()
f = cache_compile(m.run, backend=os.environ["BACKEND"])
x = torch.randn(3, 4)
ok, handle = [], None
if os.environ.get("HOOK") == "1":   # a global module hook present before the first call
    handle = nn.modules.module.register_module_forward_hook(doubled)
with torch.no_grad():
    for step in range(4):
        if os.environ.get("HOOK") == "late" and step == 2:   # ... or registered later
            handle = nn.modules.module.register_module_forward_hook(doubled)
        ok.append(bool(torch.allclose(f(x), m.run(x), atol=1e-6)))
if handle is not None:
    handle.remove()
report({"ok": ok, "events": [e for e, _ in f.events]})
'''


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_global_module_hooks_and_patched_torch_classes_are_guarded(tmp_path: Path,
                                                                     backend: str) -> None:
    """Two wrong hits a new-user trial found: an entry made without a global module hook
    (register_module_forward_hook) ran where one is registered, and an entry made with
    torch's nn.LayerNorm.forward pristine ran where a library patched it (and back).
    Dynamo guards only the global hook dicts' type and pins torch's classes by version."""
    from ccutil import Sandbox

    box = Sandbox(tmp_path)

    def run(**env: str) -> dict:
        r = box.run(PATCH_CHILD, BACKEND=backend, environ=env).value
        assert all(r["ok"]), (env, r)
        return r

    assert run()["events"] == ["miss"]                       # publishes the plain entry
    assert run(HOOK="1")["events"] == ["miss"]               # a global hook: not that entry
    late = run(HOOK="late")["events"]                        # registered after a call: the
    # hook's program (run() checked every output): the HOOK=1 entry where this process's
    # handle got the same id (its guard holds the hook dict's keys), else compiled here.
    assert late[0] == "hit" and late[1] in ("hit", "miss", "shared"), late
    assert run(PATCH="1")["events"] == ["miss"]              # torch's class patched
    assert run(PATCH="1")["events"] == ["hit"]               # ... has its own entry
    assert run()["events"] == ["hit"]                        # pristine again: the first
