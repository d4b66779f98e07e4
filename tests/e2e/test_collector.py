"""The garbage collector around a warm load (cachecompile.warm.collector, issue 53).

``import torch`` leaves a full collection due; a warm process's first load set it off and
its first output waited for it (75-85 ms: it walks every object torch made). Each scenario
is a fresh process that loads entries a cold process published (the demo decoder on
aot_eager, several hundred guards). It first drives the collector's counts to where
``import torch`` leaves them, a full collection due at the next young one, then loads;
a callback notes every full collection and how many objects were frozen while it ran:

* control, the window turned off: a full collection walks everything inside the load
  (the test can fail, and the situation is real);
* the window: no full collection walks the old objects during the load, nothing stays
  frozen after it, and the call's result is eager's;
* once per process: a second due load runs without the window;
* a user who froze objects themselves keeps them frozen (their freeze is not undone);
* a child forked inside a window starts with nothing frozen.

Python 3.12 freezes a few hundred of its own objects at start; there the window never opens
(an unfreeze would release those too), and the tests check that instead.
"""

from __future__ import annotations

from typing import Any

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

SETUP = '''
import gc, os, torch, warnings
from cachecompile.demo.models import build_decoder
from cachecompile import cache_compile
from cachecompile.warm import collector
warnings.simplefilter("ignore")
m = build_decoder().eval()
cc = cache_compile(m.forward, backend="aot_eager", dynamic=False)
x = {b: torch.randint(0, 100, (b, 4), generator=torch.Generator().manual_seed(b)) for b in (1, 2)}
# What the interpreter froze itself (Python 3.12 freezes a few hundred of its own tuples at
# start); the window never opens over it (collector._due).
BASE = gc.get_freeze_count()
fulls = []       # each full collection: how many objects were frozen (beyond BASE) while it ran
seen = []        # each collection of any generation: the same


def noted(phase, info):
    if phase == "start":
        seen.append(gc.get_freeze_count() - BASE)
        if info["generation"] == 2:
            fulls.append(gc.get_freeze_count() - BASE)


def make_due():
    """The counts ``import torch`` leaves: the next young collection is a middle one that
    makes a full one due, and the young count is near its threshold."""
    keep = []
    t0, t1, t2 = gc.get_threshold()
    for _ in range(3_000_000):
        c = gc.get_count()
        if c[1] == t1 and c[2] >= t2 and c[0] >= t0 - 30:
            del fulls[:], seen[:]
            return keep
        keep.append([None])
    raise AssertionError(f"the collector's counts never came due: {gc.get_count()}")


gc.callbacks.append(noted)
'''

PUBLISH = '''
import torch
from cachecompile.demo.models import build_decoder
from cachecompile import cache_compile
m = build_decoder().eval()
cc = cache_compile(m.forward, backend="aot_eager", dynamic=False)
with torch.no_grad():
    for b in (1, 2):
        cc(torch.randint(0, 100, (b, 4), generator=torch.Generator().manual_seed(b)))
report([e for e, _ in cc.events])
'''


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    b = Sandbox(tmp_path_factory.mktemp("collector"))
    assert b.run(PUBLISH).value == ["miss", "miss"]
    return b


def _load(box: Sandbox, body: str) -> dict[str, Any]:
    out = box.run(SETUP + body, compiles=False).value
    assert isinstance(out, dict)
    return out


def test_control_without_the_window_a_full_collection_walks_everything(box: Sandbox) -> None:
    out = _load(box, '''
collector._used = True                 # as if this process had used its window
keep = make_due()
with torch.no_grad():
    y = cc(x[1])
report({"base": BASE, "fulls": fulls, "events": [e for e, _ in cc.events]})
''')
    assert out["events"] == ["hit"]
    assert 0 in out["fulls"], out     # a full collection with nothing frozen: the whole heap


def test_the_first_due_load_walks_only_what_it_made(box: Sandbox) -> None:
    out = _load(box, '''
keep = make_due()
with torch.no_grad():
    y = cc(x[1])
    ok = bool(torch.equal(y, m.forward(x[1])))
report({"base": BASE, "fulls": fulls, "seen": seen,
        "frozen_after": gc.get_freeze_count() - BASE, "ok": ok,
        "events": [e for e, _ in cc.events]})
''')
    assert out["events"] == ["hit"] and out["ok"]
    assert out["frozen_after"] == 0
    if out["base"]:                    # the interpreter froze objects itself: no window
        assert not any(out["seen"]), out
        return
    assert any(out["seen"]), out       # collections ran inside the window
    assert 0 not in out["fulls"], out  # none walked the old objects


def test_once_per_process(box: Sandbox) -> None:
    out = _load(box, '''
keep = make_due()
with torch.no_grad():
    cc(x[1])
first = list(seen)
keep2 = make_due()
with torch.no_grad():
    cc(x[2])
report({"base": BASE, "first": first, "second": list(seen),
        "events": [e for e, _ in cc.events], "frozen_after": gc.get_freeze_count() - BASE})
''')
    assert out["events"] == ["hit", "hit"]
    assert bool(any(out["first"])) != bool(out["base"]), out  # the first due load's window
    assert out["second"] and not any(out["second"]), out  # the second did not
    assert out["frozen_after"] == 0


def test_a_users_freeze_is_left_as_it_is(box: Sandbox) -> None:
    out = _load(box, '''
keep = make_due()
gc.freeze()
frozen = gc.get_freeze_count()
with torch.no_grad():
    cc(x[1])
report({"base": BASE, "before": frozen, "after": gc.get_freeze_count(),
        "used": collector._used})
''')
    assert out["before"] > 0 and out["after"] >= out["before"]
    assert out["used"] is False        # the window was not opened at all


def test_a_child_forked_inside_a_window_has_nothing_frozen(box: Sandbox) -> None:
    out = _load(box, '''
keep = make_due()
with collector.loading():
    inside = gc.get_freeze_count() - BASE
    pid = os.fork()
    if pid == 0:
        os._exit(0 if gc.get_freeze_count() == BASE else 1)
    _, status = os.waitpid(pid, 0)
report({"base": BASE, "inside": inside, "child": os.waitstatus_to_exitcode(status),
        "after": gc.get_freeze_count() - BASE})
''')
    if out["base"]:
        pytest.skip("this Python freezes objects of its own at start: the window never opens")
    assert out["inside"] > 0           # the window was open when the child was forked
    assert out["child"] == 0, "the forked child still had objects frozen"
    assert out["after"] == 0


def test_a_load_that_finds_nothing_due_does_not_count_the_frozen(monkeypatch: Any) -> None:
    """``gc.get_freeze_count()`` walks every frozen object (~20 ms over torch's on Python
    3.11): a load asks it only when a full collection is due, and never while its window is
    open (issue 53: a debug line counted them inside every window)."""
    import gc

    from cachecompile.warm import collector

    asked: list[int] = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or real())
    monkeypatch.setattr(collector, "_used", False)
    monkeypatch.setattr(gc, "get_count", lambda: (0, 0, 0))        # nothing due
    with collector.loading():
        pass
    assert asked == [] and not collector._used
    monkeypatch.setattr(gc, "get_count", lambda: (0, 0, gc.get_threshold()[2]))   # due
    frozen_before = real()
    with collector.loading():
        inside = len(asked)
    assert collector._used and real() == frozen_before
    if frozen_before == 0 and gc.isenabled() and gc.get_threshold()[2] > 0:
        assert inside == 1, "the window counted the frozen objects again"
