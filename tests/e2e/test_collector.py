"""The garbage collector around cachecompile's warm-start work (cachecompile.warm.collector,
issue 53).

A young collection inside that work promoted its temporaries (the import machinery's, a
manifest's parse, a checker's build) as if they were long-lived, and enough of them set
off a full collection that walks every object torch made (60-85 ms): a warm process of 8
entries paid one more than eager did before its first outputs. So the work runs with
automatic collection paused. Each scenario is a fresh process. It first drives the
collector's counts to just below a young collection's threshold, so that any work that
allocates sets one off; a callback notes every collection that starts inside the work:

* control, the pause turned off: a load sets collections off (the test can fail, and the
  situation is real);
* a load, the package's import and ``cache_compile()`` itself set none off, and the
  collector is on again after each, with the call's result eager's;
* cyclic garbage made inside a window is collected by the first collection after it;
* a user who turned the collector off keeps it off;
* a child forked inside a window starts with the collector on;
* a window that waits on the network (``release``) runs the rest with the collector on.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

# Before anything of cachecompile is imported: the import itself is a subject.
NOTE = '''
import gc, os, sys, warnings
import torch
warnings.simplefilter("ignore")
started = []     # each collection that started inside the work watched: its generation
in_window = []   # each that started while one of cachecompile's windows was open
watching = [False]


def noted(phase, info):
    if phase != "start":
        return
    if watching[0]:
        started.append(info["generation"])
    collector = sys.modules.get("cachecompile.warm.collector")
    if collector is not None and collector._depth > 0:
        in_window.append(info["generation"])


def near_threshold():
    """The young count just below its threshold: the next ~20 tracked objects any work
    keeps set off a collection."""
    keep = []
    t0 = gc.get_threshold()[0]
    for _ in range(3_000_000):
        if gc.get_count()[0] >= t0 - 20:
            return keep
        keep.append([None])
    raise AssertionError(f"the young count never neared its threshold: {gc.get_count()}")


@__import__("contextlib").contextmanager
def watched():
    keep = near_threshold()
    del started[:]
    watching[0] = True
    try:
        yield
    finally:
        watching[0] = False
        del keep


gc.callbacks.append(noted)
pauses = []      # each gc.disable() call
_disable = gc.disable
gc.disable = lambda: (pauses.append(1), _disable())[1]
'''

SETUP = NOTE + '''
from cachecompile.demo.models import build_decoder
from cachecompile import cache_compile
from cachecompile.warm import collector
m = build_decoder().eval()
cc = cache_compile(m.forward, backend="aot_eager", dynamic=False)
x = {b: torch.randint(0, 100, (b, 4), generator=torch.Generator().manual_seed(b)) for b in (1, 2)}
decide = cc._decide


def decide_watched(*args):
    with watched():
        return decide(*args)


cc._decide = decide_watched   # the load (key, lookup, load), not the call it decides
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


def _run(box: Sandbox, body: str, setup: str = SETUP) -> dict[str, Any]:
    out = box.run(setup + body, compiles=False).value
    assert isinstance(out, dict)
    return out


def test_control_without_the_pause_a_load_sets_collections_off(box: Sandbox) -> None:
    out = _run(box, '''
import contextlib
collector.paused = contextlib.nullcontext      # as before issue 53
with torch.no_grad():
    y = cc(x[1])
report({"started": started, "events": [e for e, _ in cc.events]})
''')
    assert out["events"] == ["hit"]
    assert out["started"], out


def test_a_load_sets_no_collection_off_and_leaves_the_collector_on(box: Sandbox) -> None:
    out = _run(box, '''
with torch.no_grad():
    y = cc(x[1])
    ok = bool(torch.equal(y, m.forward(x[1])))
inside = list(started)
enabled = gc.isenabled()
with watched():
    keep = [[None] for _ in range(100)]      # what any code keeps: collected as before
report({"inside": inside, "enabled": enabled, "after": started, "ok": ok,
        "events": [e for e, _ in cc.events]})
''')
    assert out["events"] == ["hit"] and out["ok"]
    assert out["inside"] == [], out
    assert out["enabled"] is True
    assert out["after"], "the collector did not run again after the load"


def test_the_import_and_cache_compile_set_no_collection_off(box: Sandbox) -> None:
    out = _run(box, '''
with watched():
    from cachecompile import cache_compile     # the package's names, in a window
by_name = "cachecompile.api" in sys.modules and len(pauses)
from cachecompile.demo.models import build_decoder
m = build_decoder().eval()
with watched():
    cc = cache_compile(m.forward, dynamic=False)  # resolves (imports) its backend
constructed = "cachecompile.backends.inductor" in sys.modules and len(pauses)
windows = list(in_window)
with watched():
    import cachecompile.cli.main                   # a submodule, as such: no window
report({"windows": windows, "plain": started, "by_name": by_name,
        "constructed": constructed, "enabled": gc.isenabled()})
''', setup=NOTE)
    assert out["by_name"] == 1 and out["constructed"] == 2, out  # each in a window
    assert out["windows"] == [], out   # nothing collected while the windows were open
    assert out["plain"], out           # the control: an import that large does collect
    assert out["enabled"] is True


def test_a_users_disabled_collector_stays_off(box: Sandbox) -> None:
    out = _run(box, '''
gc.disable()
with torch.no_grad():
    cc(x[1])
report({"enabled": gc.isenabled(), "events": [e for e, _ in cc.events]})
''')
    assert out == {"enabled": False, "events": ["hit"]}


def test_a_child_forked_inside_a_window_has_the_collector_on(box: Sandbox) -> None:
    out = _run(box, '''
with collector.paused():
    inside = gc.isenabled()
    pid = os.fork()
    if pid == 0:
        ok = gc.isenabled()
    else:
        _, status = os.waitpid(pid, 0)
if pid == 0:           # the child's window ended too: a later one pauses and resumes
    with collector.paused():
        ok = ok and not gc.isenabled()
    os._exit(0 if ok and gc.isenabled() else 1)
report({"inside": inside, "child": os.waitstatus_to_exitcode(status),
        "after": gc.isenabled()})
''')
    assert out == {"inside": False, "child": 0, "after": True}


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@contextlib.contextmanager
def _collector_on() -> Any:
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was:
            gc.disable()


def test_cyclic_garbage_made_in_a_window_is_collected_after_it() -> None:
    from cachecompile.warm import collector

    with _collector_on():
        with collector.paused():
            assert not gc.isenabled()
            a, b = _Node(), _Node()
            a.other, b.other = b, a
            dead = weakref.ref(a)
            del a, b
            kept: list[list[None]] = [[] for _ in range(5 * gc.get_threshold()[0])]
            assert dead() is not None
        assert gc.isenabled()
        kept += [[] for _ in range(5 * gc.get_threshold()[0])]  # the collections after it
        assert dead() is None, "a cycle made inside the window outlived it"


def test_windows_nest_across_threads_and_release_ends_the_pause() -> None:
    import threading

    from cachecompile.warm import collector

    with _collector_on():
        inner = threading.Event()
        done = threading.Event()

        def other() -> None:
            with collector.paused():
                inner.set()
                done.wait(10)

        t = threading.Thread(target=other)
        with collector.paused():
            t.start()
            assert inner.wait(10)
        assert not gc.isenabled(), "the first window to end resumed under an open one"
        done.set()
        t.join(10)
        assert gc.isenabled()
        with collector.paused():
            collector.release()           # a remote tier's download: the collector is on
            assert gc.isenabled()
        assert gc.isenabled()


def test_a_remote_download_runs_with_the_collector_on(tmp_path: Any) -> None:
    """A lookup that goes to the network (here a shared filesystem tier) ends the pause:
    a pause must not last as long as a download may."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    remote = {"CACHECOMPILE_REMOTE": f"file://{shared}", "CACHECOMPILE_TRUST_REMOTE": "1"}
    assert Sandbox(tmp_path / "a").run(PUBLISH, environ=remote).value == ["miss", "miss"]
    out = Sandbox(tmp_path / "b").run(SETUP + '''
from cachecompile.warm.state import store_for
st = store_for(None)
real_get, during_get = st.get, []


def get(key, *args, **kwargs):
    during_get.append(gc.isenabled())
    return real_get(key, *args, **kwargs)


st.get = get
with torch.no_grad():
    ok = bool(torch.equal(cc(x[1]), m.forward(x[1])))
report({"events": [e for e, _ in cc.events], "during_get": during_get, "ok": ok,
        "enabled": gc.isenabled()})
''', compiles=False, environ=remote).value
    assert out["events"] == ["hit"] and out["ok"], out
    assert out["during_get"][:1] == [True], out   # the download: the collector on
    assert out["enabled"] is True
