"""The garbage collector around a warm load: the full collection that ``import torch``
leaves due is not paid inside one.

Importing torch leaves the collector's oldest generation about to be collected
(``gc.get_count()`` is ``(_, 11, 10)`` just after it, 2.13 on Python 3.11): the next
~1,400 objects a process keeps set off a full collection, which walks every object torch
made, about 170,000 of them, 75-85 ms on a 2-core machine. An eager process that only
calls its model allocates almost nothing and does not reach it before its first outputs;
a warm process does, inside its first load (a manifest's guards, a checker), and its
first output waits for it (issue 53: most of what 8 entries' warm start spent beyond
eager's).

So the first load that finds that collection due runs with the older objects frozen
(``gc.freeze()``, then ``gc.unfreeze()`` as it ends): a collection the load sets off walks
only what was made since, and ``gc.freeze`` starts the collector's counts again, so the
full collection comes ~11 younger collections later, while the process serves, as it does
in any process that allocates as much. Nothing is collected less: a frozen object that
became garbage during the load is collected by that later full collection.

Bounds: once per process (a process that loads entries all the time still gets its full
collections); never where the user froze objects themselves (``gc.freeze()`` after start-up,
as docs/deploy.md advises: unfreezing would undo theirs) or turned the collector off; one
window at a time across threads; and a child forked inside a window starts with nothing
frozen. A ``gc.freeze()`` another thread calls inside the window is undone when it ends:
the one case this cannot tell apart. Where the collector is incremental (Python
3.14.0-3.14.4), no collection walks the whole heap at once, and the window never opens. Nor
does it where the interpreter froze objects of its own at start (Python 3.12 freezes a few
hundred tuples of its deep-frozen code: 375 on 3.12.1): they cannot be told from a user's,
and the unfreeze would release them too.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_depth = 0            # loads inside a window now, across threads
_frozen = False       # this module froze the objects; it unfreezes them
_used = False         # this process's one window has been opened


def _due() -> bool:
    """Whether a full collection may come within the next younger collection or two."""
    if not gc.isenabled():
        return False
    # 0: an incremental collector (Python 3.14.0-3.14.4), where no collection walks the
    # whole heap at once.
    oldest = gc.get_threshold()[2]
    # The freeze count last: it walks the frozen objects (Python 3.11: ~20 ms for the
    # ~170,000 a user's gc.freeze() after start-up leaves there), so it is asked only
    # when a collection is due, which is rare.
    return oldest > 0 and gc.get_count()[2] >= oldest - 1 and not gc.get_freeze_count()


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around a load: the process's first one that finds a full collection due runs with
    the objects made before it frozen (see the module doc)."""
    global _depth, _frozen, _used
    with _lock:
        _depth += 1
        if not _used and _due():   # _frozen implies _used
            _used = _frozen = True
            gc.freeze()
            # Not the frozen count: counting walks them all (~20 ms; issue 53).
            logger.debug("a full collection is due: the load runs with the older objects "
                         "frozen")
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _frozen:
                _frozen = False
                gc.unfreeze()


def _after_fork_in_child() -> None:
    """A child forked inside a window has no thread left to end it."""
    global _depth, _frozen, _lock
    _lock = threading.Lock()
    _depth = 0
    if _frozen:
        _frozen = False
        gc.unfreeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
