"""The one wait loop of cooperating processes: try, and until it works or time runs out,
say now and then who is waited for, then try again.

Compile locks, compile slots and node-level steps (:mod:`cachecompile.procs.coop`,
:mod:`cachecompile.procs.node`) all wait this way, so they agree on what a timeout means.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

__all__ = ["poll"]

T = TypeVar("T")


def poll(attempt: Callable[[float], T | None], *, timeout: float, interval: float,
         expired: Callable[[float], BaseException],
         report: Callable[[float], None] | None = None,
         report_every: float = math.inf) -> T:
    """Call ``attempt(seconds left)`` until it returns something other than None.

    Between attempts sleep ``interval`` (0 for an attempt that itself blocks, such as a
    lock acquired with a timeout). Once ``timeout`` seconds have passed since the first
    attempt, raise ``expired(seconds waited)``; before that, ``report(seconds waited)`` is
    called at most every ``report_every`` seconds. An exception from ``attempt`` ends the
    wait (a failed step, a mismatched configuration).
    """
    start = time.monotonic()
    last_report = -report_every
    while True:
        result = attempt(max(0.0, timeout - (time.monotonic() - start)))
        if result is not None:
            return result
        waited = time.monotonic() - start
        if waited >= timeout:
            raise expired(waited)
        if report is not None and waited - last_report >= report_every:
            last_report = waited
            report(waited)
        if interval > 0:
            time.sleep(interval)
