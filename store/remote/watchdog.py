"""A deadline on a whole request where the transport bounds only each socket read.

Python's ``http.client`` applies its timeout to every ``recv``, so a server that trickles
its answer (a byte every two seconds) keeps a request going without limit. One daemon
thread per process holds the deadlines of the requests in flight and, when one passes
first, calls that request's ``abort`` (the HTTP tier shuts its connection's socket down:
the blocked read returns at once, as a dropped connection). Where no thread can start
(Python 3.12+ while the interpreter exits) the request keeps the per-read bound only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["Ticket", "start"]

logger = logging.getLogger(__name__)


class Ticket:
    """One request's deadline: ``fired`` once its ``abort`` ran; ``cancel`` when done."""

    __slots__ = ("abort", "deadline", "done", "fired")

    def __init__(self, deadline: float, abort: Callable[[], None]) -> None:
        self.deadline = deadline
        self.abort = abort
        self.done = False
        self.fired = False

    def cancel(self) -> None:
        self.done = True


class _Watchdog:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Ticket]] = []
        self._seq = itertools.count()
        self._pid = 0

    def start(self, seconds: float, abort: Callable[[], None]) -> Ticket:
        t = Ticket(time.monotonic() + seconds, abort)
        with self._cv:
            if self._running():
                heapq.heappush(self._heap, (t.deadline, next(self._seq), t))
                self._cv.notify()
        return t

    def _running(self) -> bool:
        if self._pid == os.getpid():
            return True
        try:
            threading.Thread(target=self._run, name="cc-remote-watchdog", daemon=True).start()
        except RuntimeError as e:  # "can't create new thread at interpreter shutdown"
            logger.debug("no request deadline: %s", e)
            return False
        self._pid = os.getpid()
        return True

    def _run(self) -> None:
        with self._cv:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                t = heapq.heappop(self._heap)[2]
                t.fired = True
                try:
                    t.abort()
                except Exception:  # a socket already closed: nothing left to stop
                    logger.debug("aborting a request failed", exc_info=True)

    def after_fork(self) -> None:
        # The parent's thread is not in the child, and may have held the lock.
        self.__init__()  # type: ignore[misc]


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.after_fork)


def start(seconds: float, abort: Callable[[], None]) -> Ticket:
    """A deadline ``seconds`` from now that calls ``abort`` unless cancelled first."""
    return _WATCHDOG.start(seconds, abort)
