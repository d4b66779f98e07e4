"""Remote calls with a deadline: a hung mount or a server that accepts and never
answers costs a RemoteError after the remote's timeout, never a stuck process.

The call runs on a daemon thread while the caller waits. Threads are reused: Python
3.12 refuses to start a thread once the interpreter is finalizing, which is exactly when
the uploader's exit flush runs the last uploads, so a worker started earlier in the
process serves those. Where no idle worker is left and none can be started, the call runs
in the caller's own thread, without a deadline of its own: at exit that caller is the
upload thread, a daemon, whose waiter (``Uploader.flush``) holds its own deadline.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from .. import errors

__all__ = ["call_with_deadline"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_Job = Callable[[], None]


class _Worker:
    """A daemon thread that runs one job at a time and goes back to the idle list after
    each; one stuck in a job that never returns stays out of it for good."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="cc-remote-call", daemon=True).start()

    def run(self, job: _Job) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            self._jobs.get()()
            with _LOCK:
                _IDLE.append(self)


_LOCK = threading.Lock()
_IDLE: list[_Worker] = []


def _worker() -> _Worker | None:
    """An idle worker of this process, or a new one; None where no thread can start."""
    with _LOCK:
        while _IDLE:
            w = _IDLE.pop()
            if w.pid == os.getpid():  # a forked child has none of its parent's threads
                return w
    try:
        return _Worker()
    except RuntimeError as e:  # "can't create new thread at interpreter shutdown"
        logger.debug("remote call without a deadline thread: %s", e)
        return None


def call_with_deadline(fn: Callable[[], T], seconds: float, what: str, why: str = "") -> T:
    """``fn()``, given up on after ``seconds``: a RemoteError then, while ``fn`` runs on
    (or stays stuck) in its worker thread."""
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def call() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # handed to the caller as raised
            box.append((False, e))
        finally:
            done.set()

    worker = _worker()
    if worker is None:
        call()
    else:
        worker.run(call)
    if not done.wait(seconds):
        raise errors.RemoteError(f"remote cache {what}: no answer in {seconds:.0f} s"
                                 + (f" ({why})" if why else ""))
    ok, value = box[0]
    if ok:
        return cast(T, value)
    raise value
