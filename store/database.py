"""Connections to the index's SQLite database (:mod:`cachecompile.store.index`): the busy
timeout every statement waits, WAL for a writer, ``mode=ro`` (or ``immutable=1``) for a
reader. ``sqlite3`` is imported on the first connection, not at import: a warm process's
hits are written after its calls."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlite3

# How long a statement waits for another process's lock (SQLite's busy timeout).
BUSY_TIMEOUT_S = 60.0


def into_wal(con: sqlite3.Connection) -> None:
    """``PRAGMA journal_mode=WAL``, waiting out other openers as every other statement does.

    Switching a database into WAL takes an exclusive lock without SQLite's busy handler:
    while another connection reads the new file (a rank opening the same fresh store), it
    fails at once with "database is locked", whatever the timeout (seen under the suite's
    load; 5-10% of rounds of six threads opening one new file). Retried here until
    :data:`BUSY_TIMEOUT_S`, the wait every other statement gets."""
    import sqlite3
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    pause = 0.001
    while True:
        try:
            con.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            if time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def connect(path: Path, *, readonly: bool) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit: :meth:`Index._tx`).

    Read-only: ``mode=ro``, or ``immutable=1`` where not even the ``-shm`` file can be
    made (a read-only file system), which then reads the last checkpoint."""
    import sqlite3  # here, not at import: a warm hit writes its hits after its calls
    if not readonly:
        con = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                              check_same_thread=False)
        try:
            into_wal(con)
            con.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            con.close()
            raise
        return con
    import urllib.parse

    db = urllib.parse.quote(str(path))
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S,
                          isolation_level=None, check_same_thread=False)
    try:
        con.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.Error:
        con.close()
        con = sqlite3.connect(f"file:{db}?immutable=1", uri=True, isolation_level=None,
                              check_same_thread=False)
    return con
