"""The garbage collector around cachecompile's own warm-start work: it collects nothing
while that work runs, so the work's short-lived objects never look long-lived to it.

Each young collection promotes whatever is alive at that moment. Inside an import, a
manifest's parse or a checker's build, most of what is alive is about to be dropped (the
import machinery's, the parser's and the builder's temporaries), yet a collection there
promotes it to the oldest generation, and CPython runs a full collection once the objects
promoted since the last one pass a quarter of those it kept then. After ``import torch``
that full collection walks every object torch made, about 170,000, 60-85 ms on a 2-core
machine. An eager process that only calls its model promotes almost nothing and serves its
first outputs before it; a warm process importing cachecompile and loading 8 entries
promoted its temporaries, reached it inside ``cache_compile()`` or its first loads, and its
first output waited for it (issue 53: most of what its warm start spent beyond eager's).

So cachecompile's warm-start work runs in a window with automatic collection paused
(``gc.disable()``, then ``gc.enable()`` as the window ends): importing the package's names,
``cache_compile()`` itself, and each signature's first-call decision (key, lookup, load).
What the work drops is freed by reference counting as usual; what it keeps is promoted by
the collections that follow, as anything a process keeps is; cyclic garbage made inside a
window is collected by the first collection after it. Nothing is collected less, and only
what cachecompile really keeps counts toward the next full collection.

Bounds:
- Never around the user's code: a compile and the program's first run are outside (the
  decision runs in the window, the call after it), and so is a remote tier's download
  (:func:`release` ends the pause for the rest of a window that waits on the network).
- Never where the collector was off already: the window leaves it off.
- One pause across threads (a depth count under a lock): the last window to end resumes.
- A child forked inside a window starts with the collector on.
- A ``gc.disable()`` another thread calls inside a window is undone when the window ends:
  the one case this cannot tell apart.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0            # windows open now, across threads
_paused = False       # this module turned the collector off; it turns it on again


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Around cachecompile's own warm-start work: no automatic collection inside."""
    global _depth, _paused
    with _lock:
        _depth += 1
        if _depth == 1 and gc.isenabled():
            gc.disable()
            _paused = True
    try:
        yield
    finally:
        with _lock:
            # Never below 0: in a child forked inside a window the count starts at 0 and
            # the forking thread's window still ends.
            _depth = max(0, _depth - 1)
            if _depth == 0 and _paused:
                _paused = False
                gc.enable()


def release() -> None:
    """The rest of the open windows runs with the collector on: their work waits on
    something else (a remote tier's download), for longer than a pause should last."""
    global _paused
    with _lock:
        if _paused:
            _paused = False
            gc.enable()


def _after_fork_in_child() -> None:
    """A child forked inside a window has no thread left to end it."""
    global _depth, _paused, _lock
    _lock = threading.Lock()
    _depth = 0
    if _paused:
        _paused = False
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
