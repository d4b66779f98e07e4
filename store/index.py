"""The metadata index: an SQLite database of entry records and counters, in a schema
of its own (``index/entries.db``, ``PRAGMA user_version`` = :data:`SCHEMA_VERSION`).

It is a cache of what the manifests say plus usage data (last use, hits), and can
always be rebuilt from the manifests on disk. Tables:

- ``entries``: one row per entry, a column per field that ``ls``, ``stats`` and gc read
  (digest, size, created, last use, hits, labels as JSON, shared graph or not, state) and
  ``blobs`` (JSON: checksum -> size: gc counts shared content once without reading every
  manifest). Scans are SQL (``ORDER BY``, ``SUM``): no row is decoded whole to sort.
- ``counters``: name -> int; ``stamps``: digest -> its last full verification's Stamp.

Counters: ``hits``, ``miss:<kind>`` (one per lookup that found nothing to use, counted
by its caller), ``about:<kind>:<subject>`` (what such misses were about, e.g. the guard
that failed), ``publishes``, ``evictions``, ``corruptions``,
``hits:remote`` (hits a remote tier served by a download, counted in ``hits`` too),
``pulls`` (entries ``cachectl pull`` downloaded: never hits) and ``bytes`` (the running
physical size that triggers gc). Shared-graph lookups (cachecompile.store.policy) count
under ``graph:hits`` and ``graph:miss:<kind>``: ``hits`` and ``miss:*`` are the user's.

The totals (entries, shared graphs, logical bytes) are aggregates of ``entries``, read
in one query: they cannot drift from the records.

Upgrade: older versions kept the index in diskcache's table (``index/cache.db``, pickled
records). The first writable open of a store without ``entries.db`` (or of another
version) creates the schema and copies the old records, counters and stamps in one ``BEGIN
IMMEDIATE`` transaction that sets the version: SQLite's write lock serialises openers, each
re-checks the version under it, and a reader sees no schema (an empty index: entries read
as unindexed) or the whole migrated one. ``cache.db`` stays (an older process may still
write it).

Hits recorded later (``open_store(hits_later=True)``, a serving process's store): a warm
start's first calls neither open the database (nor import sqlite3) nor write a
transaction per entry. The hits are queued and written in one transaction
:data:`HITS_DELAY_S` after the first, when this index is next used for anything else (so
this process sees its own hits), or at exit; a process killed before then loses them.

The index is a cache: :meth:`Index.safely` runs an index operation so that its failure
(a locked or damaged database, a full disk, a symlinked ``index/``) is logged and never
fails the lookup or publish around it. A read-only index (:meth:`Index.reader`) whose
database does not exist is empty, not failed (a read-only consumer of a store nothing was
published to reads it on every miss); one that cannot be read is said once per index.
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import io
import json
import logging
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from . import errors
from .database import connect
from .keys import Key
from .outcomes import EntryInfo
from .policy import is_shared_graph

if TYPE_CHECKING:
    import sqlite3

logger = logging.getLogger(__name__)

__all__ = ["GRAPH_SCOPE", "Index", "PULLS", "REMOTE_HITS", "counter_scope", "level_counter"]

T = TypeVar("T")

DB_NAME = "entries.db"
OLD_DB_NAME = "cache.db"   # diskcache's, before SCHEMA_VERSION 2: migrated once
SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    digest TEXT PRIMARY KEY,
    size_bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    labels TEXT NOT NULL DEFAULT '{}',
    graph INTEGER NOT NULL DEFAULT 0,
    state TEXT,
    blobs TEXT
);
CREATE INDEX IF NOT EXISTS entries_by_last_use ON entries (last_used);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS stamps (digest TEXT PRIMARY KEY, value BLOB NOT NULL);
"""
_MODE_PICKLE = 4  # diskcache.core.MODE_PICKLE: how the old index stored a record inline
TOTALS = ("entries", "graphs", "logical_bytes")
COUNTERS = ("hits", "publishes", "evictions", "corruptions")
GRAPH_SCOPE = "graph:"  # prefix of the counters of shared-graph lookups
REMOTE_HITS = "hits:remote"
# Entries `cachectl pull` downloaded ahead of use: not lookups, so never hits.
PULLS = "pulls"
# The remote hits one level of a chain served: hits:remote@<the level's URL, shown>.
LEVEL_HITS = REMOTE_HITS + "@"


def level_counter(display: str) -> str:
    """The counter of the remote hits served by the level shown as ``display`` (its URL,
    without a password)."""
    return (LEVEL_HITS + display)[:200]


ABOUT = "about:"   # counters of what misses were about: about:<kind>:<subject>
# Seconds from a queued hit to the transaction that writes the queue (hits_later).
HITS_DELAY_S = 2.0


def miss_counters(kind: str, about: str | None = None) -> list[str]:
    """The counters one missed lookup moves (see ``record_miss``)."""
    if kind.startswith(GRAPH_SCOPE):
        return [f"{GRAPH_SCOPE}miss:{kind[len(GRAPH_SCOPE):]}"]
    out = [f"miss:{kind}"]
    if about:
        out.append(f"{ABOUT}{kind}:{about}"[:200])
    return out


def counter_scope(key: Key | str, labels: Mapping[str, str] | None = None) -> str:
    """Counter prefix of a lookup: shared graphs are counted apart from the user's entries.

    A hit knows its labels; a miss knows only the key, whose factors say ``kind=graph``
    for shared graphs (cachecompile/coop.py sets the factor and the label together).
    Whoever adjusts a lookup's counters later (cachecompile.store.tiered) asks here too,
    so that it undoes exactly the counter the lookup moved.
    """
    if labels is None:
        labels = {"kind": str(key.factors.get("kind"))} if isinstance(key, Key) else {}
    return GRAPH_SCOPE if is_shared_graph(labels) else ""


def _labels_json(labels: Mapping[str, str] | None) -> str:
    return json.dumps(dict(labels or {}), sort_keys=True, separators=(",", ":"))


def _blobs_json(blobs: Mapping[str, int] | None) -> str | None:
    return None if blobs is None else json.dumps(dict(blobs), separators=(",", ":"))


class _Labels:
    """Decodes label columns, each distinct text once (most entries share a few label
    sets: 100,000 json.loads were most of a scan), handing out a copy per entry."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, str]] = {}

    def __call__(self, text: str | None) -> dict[str, str]:
        got = self._seen.get(text or "{}")
        if got is None:
            try:
                raw = json.loads(text or "{}")
            except ValueError:
                raw = {}
            got = {sys.intern(str(k)): sys.intern(str(v))
                   for k, v in (raw.items() if isinstance(raw, dict) else ())}
            self._seen[text or "{}"] = got
        return dict(got)


_COLS = "digest, size_bytes, created, last_used, hits, labels, state"
# policy.group_of in SQL: the ``group`` label (an empty one is none), else the entry itself.
_GROUP = "NULLIF(json_extract(labels, '$.group'), '')"


def _unit_order(row: Sequence[Any]) -> tuple[float, float, str, str]:
    """The eviction order of a :meth:`Index.by_unit_use` row: its unit's latest use and
    creation, the unit's name, the digest."""
    return (row[9], row[10], row[8], row[0])


def _info(row: Sequence[Any], labels: _Labels) -> EntryInfo:
    digest, size, created, last_used, hits, text, state = row[:7]
    return EntryInfo(digest, int(size), float(created), float(last_used), int(hits),
                     labels(text), state or "ok")


class _NoDatabase(Exception):
    """A read-only index whose database was never made (nothing was published there), or
    is of an older layout that only a writer migrates: an empty index."""


class _PlainUnpickler(pickle.Unpickler):
    """Reads what the index pickles (the old index's records, the stamps: dicts, tuples,
    strings, numbers) and nothing that names a class or a function: an index file is
    not trusted to run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused: the index names {module}.{name}")


def _plain_loads(data: bytes) -> Any:
    return _PlainUnpickler(io.BytesIO(data)).load()


def _old_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(key, value) of each row of an index of the old layout (diskcache's ``Cache``
    table, its values pickled inline). A value diskcache kept in a file of its own (over
    32 KB: a huge blob map) is skipped: that entry reads as unindexed until a hit or
    ``verify --fix`` writes it again, never as something it is not."""
    con = connect(path, readonly=True)   # its path quoted: "?" or "#" are a URI's syntax
    try:
        rows = con.execute("SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND "
                           "(expire_time IS NULL OR expire_time > ?)", (time.time(),))
        for key, mode, filename, value in rows:
            if isinstance(key, str):
                if mode == _MODE_PICKLE and filename is None and isinstance(value, bytes):
                    try:
                        yield key, _plain_loads(value)  # this package's own old index
                    except Exception:  # a damaged row: skipped, not guessed
                        continue
                elif isinstance(value, int):
                    yield key, value   # diskcache stores integers as themselves
    finally:
        con.close()


def _migrate(con: sqlite3.Connection, old: Path) -> int:
    """Copy an old index's records, counters and stamps (inside the caller's transaction).
    Returns the number of records copied."""
    n = 0
    for key, value in _old_rows(old):
        if key.startswith("e:") and isinstance(value, dict):
            try:
                raw = value.get("labels")
                labels: dict[str, str] = (
                    {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {})
                blobs = value.get("blobs")
                created = float(value.get("created", 0.0))
                con.execute(
                    "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (key[2:], int(value.get("size_bytes", 0)), created,
                     float(value.get("last_used", created)), int(value.get("hits", 0)),
                     _labels_json(labels), int(is_shared_graph(labels)),
                     value.get("state") if value.get("state") not in (None, "ok") else None,
                     _blobs_json(blobs) if isinstance(blobs, dict) else None))
                n += 1
            except (TypeError, ValueError):
                continue
        elif key.startswith("c:") and isinstance(value, int):
            con.execute("INSERT OR REPLACE INTO counters VALUES (?, ?)", (key[2:], value))
        elif key.startswith("v:"):
            con.execute("INSERT OR REPLACE INTO stamps VALUES (?, ?)",
                        (key[2:], pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)))
    return n


class Index:
    """Lazily opened database. Opening is deferred so that ``open_store()`` stays cheap."""

    def __init__(self, path: Path, guard: Callable[[], object] | None = None,
                 on_unsafe: Callable[[errors.InsecureStoreError], None] | None = None,
                 *, readonly: bool = False, shared: bool = False,
                 hits_later: bool = False) -> None:
        self.path = path
        self._con: sqlite3.Connection | None = None
        # One connection shared by this process's threads (gc's deleters, the hits
        # timer): its use is serialised here, SQLite's locks serialise the processes.
        self._lock = threading.RLock()
        # Hits queued to be written together (see the module doc): (pid, record_hit's
        # arguments); another pid's (a fork's copy) are not this process's to write.
        self.hits_later = hits_later
        self._hits: list[tuple[int, tuple[Any, ...]]] = []
        self._hits_lock = threading.Lock()
        self._hits_timer: threading.Timer | None = None
        self._hits_timer_pid = 0
        self._hits_atexit = False
        self._readonly = readonly
        # A team store's index: every member of the group writes it (hits, deletions).
        self._shared = shared
        self._scan: sqlite3.Connection | None = None
        # Called before the database is opened (the store checks that no directory on
        # the way is a symlink); once open, the handle no longer depends on the path.
        self._guard = guard
        # Told when the guard refused (the store warns once per link, not per lookup).
        self._on_unsafe = on_unsafe
        # A read-only index cannot repair itself: its failure is warned about once.
        self._warned = False
        _LIVE.add(self)

    @property
    def db(self) -> Path:
        """The database file."""
        return self.path / DB_NAME

    def _db(self) -> sqlite3.Connection:
        if self._hits:
            self.flush_hits()   # this process reads its own hits
        return self._open()

    def _open(self) -> sqlite3.Connection:
        with self._lock:
            if self._con is None:
                if self._guard is not None:
                    self._guard()
                if self._readonly:
                    if not self.db.exists():
                        # Not kept: a writer may make it later, and this reader then reads it.
                        raise _NoDatabase(self.path)
                    con = connect(self.db, readonly=True)
                    (version,) = con.execute("PRAGMA user_version").fetchone()
                    if version != SCHEMA_VERSION:
                        con.close()
                        raise _NoDatabase(self.path)   # not migrated yet: nothing to read
                    self._con = con
                    return con
                self.path.mkdir(parents=True, exist_ok=True)
                con = connect(self.db, readonly=False)
                try:
                    self._upgrade(con)
                except BaseException:
                    con.close()
                    raise
                self._con = con
                if self._shared:
                    self._share()
            return self._con

    def _upgrade(self, con: sqlite3.Connection) -> None:
        """Create the schema, migrating an old-layout index once (see the module doc)."""
        import sqlite3
        (version,) = con.execute("PRAGMA user_version").fetchone()
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise errors.StoreError(
                f"the index {self.db} is of a newer layout ({version}) than this version "
                f"reads ({SCHEMA_VERSION}): upgrade cachecompile")
        con.execute("BEGIN IMMEDIATE")   # the write lock: one process migrates
        try:
            (version,) = con.execute("PRAGMA user_version").fetchone()
            if version == 0:
                # Statement by statement: executescript would commit the transaction.
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    con.execute(statement)
                old = self.path / OLD_DB_NAME
                if old.is_file():
                    try:
                        n = _migrate(con, old)
                        logger.info("cache index %s: %d records migrated from %s", self.db,
                                    n, OLD_DB_NAME)
                    except sqlite3.Error as e:   # unreadable: rebuilt by hits, verify --fix
                        logger.warning("cache index %s: the old index %s could not be "
                                       "read (%s); starting empty (`cachectl verify --fix` "
                                       "rebuilds it)", self.db, old, e)
                con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def _share(self) -> None:
        """Group-write the index whatever the creator's umask (it made the database 0644,
        and the other members' hits and deletions failed: "readonly database"). SQLite
        gives its -wal and -shm files the database file's mode."""
        me = os.geteuid()
        for path, mode in ((self.path, 0o2770), (self.db, 0o660),
                           (self.path / (DB_NAME + "-wal"), 0o660),
                           (self.path / (DB_NAME + "-shm"), 0o660)):
            with contextlib.suppress(OSError):
                if os.lstat(path).st_uid == me and not os.path.islink(path):
                    os.chmod(path, mode)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (the write lock taken at its start)."""
        if self._readonly:
            raise errors.ReadOnlyStoreError("the index of a read-only store is not written")
        con = self._db()
        with self._lock:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> Iterator[Any]:
        """The rows of a scan, streamed from a connection of their own (its snapshot is
        what was committed when it began; this process may write meanwhile)."""
        con = self._db()
        with self._lock:
            if self._readonly:
                scan = con
            else:
                if self._scan is None:
                    self._scan = connect(self.db, readonly=True)
                scan = self._scan
            cursor = scan.execute(sql, args)
        # Stepped under the lock, a batch at a time: no thread is inside SQLite while
        # another forks (see _before_fork), and a long scan does not hold off the writes.
        while True:
            with self._lock:
                rows = cursor.fetchmany(_SCAN_BATCH)
            if not rows:
                return
            yield from rows

    @property
    def readonly(self) -> bool:
        """Whether this index was opened read-only (:meth:`reader`)."""
        return self._readonly

    def reader(self) -> Index:
        """The same index, opened read-only (a read-only store's: never written)."""
        return Index(self.path, self._guard, self._on_unsafe, readonly=True,
                     shared=self._shared)

    # -- fork ------------------------------------------------------------------
    def _before_fork(self) -> None:
        """Hold both locks across the fork: no other thread is then inside SQLite or
        half-way through the hits queue, in the parent or the child's copy of it."""
        self._hits_lock.acquire()
        self._lock.acquire()

    def _after_fork_in_parent(self) -> None:
        self._lock.release()
        self._hits_lock.release()

    def _after_fork_in_child(self) -> None:
        """A child opens its own connections: SQLite's are not to be used across a
        fork, nor closed (closing may checkpoint the parent's WAL); they are kept, never
        touched. The parent's queued hits are the parent's to write."""
        _INHERITED.extend(c for c in (self._scan, self._con) if c is not None)
        self._scan = self._con = None
        self._lock = threading.RLock()
        self._hits_lock = threading.Lock()
        self._hits = []
        self._hits_timer = None

    def close(self) -> None:
        self.flush_hits()
        with self._lock:
            for con in (self._scan, self._con):
                if con is not None:
                    con.close()
            self._scan = self._con = None

    def safely(self, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None when it fails: logged, never raised (see the module doc)."""
        try:
            return fn()
        except errors.InsecureStoreError as e:  # index/ is a symlink: the store says so once
            if self._on_unsafe is not None:
                self._on_unsafe(e)
            return None
        except _NoDatabase:
            return None  # an empty index: every caller reads None as "no records"
        except Exception as e:  # sqlite3 errors, timeouts, a full disk
            if self._readonly and self._warned:
                logger.debug("cache index read (%s) failed: %s", what, e)
            elif self._readonly:
                self._warned = True
                logger.warning("cache index %s cannot be read (%s: %s); this read-only "
                               "view goes on without it (said once)", self.path, what, e)
            else:
                logger.warning("cache index update (%s) failed: %s", what, e)
            return None

    # -- records ---------------------------------------------------------------
    def add(self, digest: str, size_bytes: int, created: float, labels: dict[str, str],
            blobs: Mapping[str, int] | None = None) -> None:
        with self._tx() as con:
            con.execute("INSERT OR IGNORE INTO entries (digest, size_bytes, created, "
                        "last_used, hits, labels, graph, blobs) VALUES (?, ?, ?, ?, 0, ?, ?, ?)",
                        (digest, size_bytes, created, created, _labels_json(labels),
                         int(is_shared_graph(labels)), _blobs_json(blobs)))

    def record_hit(self, digest: str, size_bytes: int, created: float, labels: dict[str, str],
                   counter: str = "hits", blobs: Mapping[str, int] | None = None) -> None:
        hit = (digest, size_bytes, created, labels, counter, blobs, time.time())
        if not self.hits_later:
            self._write_hits([hit])
            return
        me = os.getpid()
        with self._hits_lock:
            self._hits.append((me, hit))
            # A forked child holds its parent's timer object but not its thread.
            if self._hits_timer is None or self._hits_timer_pid != me:
                self._hits_timer = threading.Timer(HITS_DELAY_S, self._flush_quietly)
                self._hits_timer.daemon = True
                self._hits_timer_pid = me
                self._hits_timer.start()
            if not self._hits_atexit:
                self._hits_atexit = True
                atexit.register(self._flush_quietly)

    def flush_hits(self) -> None:
        """Write the queued hits (hits_later) in one transaction."""
        with self._hits_lock:
            queued, self._hits = self._hits, []
            timer, self._hits_timer = self._hits_timer, None
        if timer is not None:
            timer.cancel()
        me = os.getpid()
        mine = [hit for pid, hit in queued if pid == me]
        if mine:
            self._write_hits(mine)

    def _flush_quietly(self) -> None:
        """The timer's and exit's flush: a failure is logged, as every hit's is."""
        self.safely("hit", self.flush_hits)

    def _write_hits(self, hits: list[tuple[Any, ...]]) -> None:
        with self._tx() as con:
            for digest, size_bytes, created, labels, counter, blobs, when in hits:
                # A missing row: published by a process that died before indexing, healed.
                con.execute(
                    "INSERT INTO entries (digest, size_bytes, created, last_used, hits, "
                    "labels, graph, blobs) VALUES (?, ?, ?, ?, 1, ?, ?, ?) "
                    "ON CONFLICT (digest) DO UPDATE SET hits = hits + 1, "
                    "last_used = max(last_used, excluded.last_used)",
                    (digest, size_bytes, created, when, _labels_json(labels),
                     int(is_shared_graph(labels)), _blobs_json(blobs)))
                self._incr(con, counter, 1)

    def remove(self, digest: str) -> None:
        with self._tx() as con:
            con.execute("DELETE FROM entries WHERE digest = ?", (digest,))

    def remove_many(self, digests: list[str], freed: int = 0) -> None:
        """:meth:`remove` of each, and ``bytes`` down by ``freed``, in one transaction (gc
        evicts in batches: one commit per batch instead of two per entry)."""
        with self._tx() as con:
            if freed:
                self._incr(con, "bytes", -freed)
            con.executemany("DELETE FROM entries WHERE digest = ?", [(d,) for d in digests])

    def get(self, digest: str) -> EntryInfo | None:
        con = self._db()
        with self._lock:
            row = con.execute(f"SELECT {_COLS} FROM entries WHERE digest = ?",
                              (digest,)).fetchone()
        return None if row is None else _info(row, _Labels())

    def records(self) -> Iterator[EntryInfo]:
        for info, _ in self.items(blobs=False):
            yield info

    def items(self, *, blobs: bool = True,
              order: str = "digest") -> Iterator[tuple[EntryInfo, dict[str, int] | None]]:
        """Each record with its blob map (None for records written without one, and
        without ``blobs``), in ``order`` (``digest``, or ``last_used``: least recently
        used first). Streamed from one query: nothing is held but the current row."""
        by = {"digest": "digest", "last_used": "last_used, digest"}[order]
        sql = f"SELECT {_COLS}{', blobs' if blobs else ''} FROM entries ORDER BY {by}"
        labels = _Labels()
        for row in self._rows(sql):
            held = None
            if blobs and row[7] is not None:
                with contextlib.suppress(ValueError):
                    held = json.loads(row[7])
            yield _info(row, labels), (held if isinstance(held, dict) else None)

    def by_unit_use(self) -> Generator[
            tuple[str, EntryInfo, dict[str, int] | None], None, None]:
        """Each record with its unit of eviction (:func:`policy.group_of`: its ``group``
        label, else ``key:<digest>``) and blob map (None: a record without one), least
        recently used unit first: units by their members' latest use, then latest
        creation, then name; members by digest (:func:`policy.lru_evictions`' order).

        Two streams sorted by SQLite, merged here; gc reads only as far as it evicts.
        Entries of no group walk the ``last_used`` index (no sort of the table: 5,000
        rows of 100,000 in ~20 ms); grouped ones, usually few, are ordered by their
        group's latest use. One window query over every row sorted the whole table
        first (0.8 s at 100,000, and 2-3 s while gc's deleting threads held the GIL)."""
        singles = self._rows(f"SELECT {_COLS}, blobs, 'key:' || digest, last_used, created "
                             f"FROM entries WHERE {_GROUP} IS NULL "
                             "ORDER BY last_used, created, digest")
        grouped = self._rows(f"SELECT {_COLS}, blobs, unit, unit_used, unit_created FROM "
                             "(SELECT *, MAX(last_used) OVER w AS unit_used, MAX(created) "
                             f"OVER w AS unit_created FROM (SELECT *, {_GROUP} AS unit FROM "
                             f"entries WHERE {_GROUP} IS NOT NULL) WINDOW w AS "
                             "(PARTITION BY unit)) ORDER BY unit_used, unit_created, unit, digest")
        labels = _Labels()
        for row in heapq.merge(singles, grouped, key=_unit_order):
            held = None
            if row[7] is not None:
                with contextlib.suppress(ValueError):
                    held = json.loads(row[7])
            yield row[8], _info(row, labels), (held if isinstance(held, dict) else None)

    def each_digest(self) -> Iterator[str]:
        """The digest of every record, streamed (:meth:`digests` holds them as a set)."""
        for (d,) in self._rows("SELECT digest FROM entries"):
            yield d

    def totals(self) -> dict[str, int]:
        """``entries``, ``graphs`` (shared-graph entries among them) and ``logical_bytes``
        of the records: aggregates of the entries table in one query (no record decoded),
        so they are always those of the records."""
        row = next(self._rows("SELECT COUNT(*), TOTAL(graph), TOTAL(size_bytes) FROM entries"))
        return {n: int(v or 0) for n, v in zip(TOTALS, row, strict=True)}

    def recount(self) -> dict[str, int]:
        """The totals, read afresh (kept for ``stats --recount``: they are aggregates now)."""
        return self.totals()

    def set_blobs(self, blobs: Mapping[str, Mapping[str, int]]) -> None:
        """Fill in the blob maps of existing records (read from their manifests)."""
        with self._tx() as con:
            con.executemany("UPDATE entries SET blobs = ? WHERE digest = ?",
                            [(_blobs_json(held), d) for d, held in blobs.items()])

    def digests(self) -> set[str]:
        return {d for (d,) in self._rows("SELECT digest FROM entries")}

    def replace_all(self, infos: list[EntryInfo],
                    blobs: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Rebuild records from ``infos`` (from manifests), keeping known usage data."""
        with self._tx() as con:
            old = {d: (lu, h) for d, lu, h in
                   con.execute("SELECT digest, last_used, hits FROM entries")}
            con.execute("DELETE FROM entries")
            rows = []
            for i in infos:
                last_used, hits = old.get(i.key, (i.created, 0))
                held = blobs.get(i.key) if blobs is not None else None
                rows.append((i.key, i.size_bytes, i.created, last_used, hits,
                             _labels_json(i.labels), int(is_shared_graph(i.labels)),
                             _blobs_json(held)))
            con.executemany("INSERT OR REPLACE INTO entries (digest, size_bytes, created, "
                            "last_used, hits, labels, graph, blobs) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    # -- verification stamps ---------------------------------------------------
    def stamps(self) -> dict[str, tuple[bool, Any]]:
        """Digest -> (shared graph, stamp) of each entry a full check stamped, from one
        query (rows whose value is not such a pair are ignored: verify reads those
        entries in full)."""
        out: dict[str, tuple[bool, Any]] = {}
        names: dict[Any, Any] = {}   # the path lists, one object each (most are alike)
        for d, blob in self._rows("SELECT digest, value FROM stamps"):
            try:
                v = _plain_loads(blob)   # written by set_stamps: plain tuples only
            except Exception:  # a damaged stamp: that entry is read in full
                continue
            if (isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], tuple)
                    and len(v[1]) == 2 and isinstance(v[1][0], tuple)):
                graph, (paths, sealed) = v
                out[d] = (bool(graph), (names.setdefault(paths, paths), sealed))
        return out

    def set_stamps(self, stamps: Mapping[str, tuple[bool, Any]]) -> None:
        """Keep the stamps of entries just checked in full, in one transaction."""
        with self._tx() as con:
            con.executemany("INSERT OR REPLACE INTO stamps VALUES (?, ?)",
                            [(d, pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))
                             for d, v in stamps.items()])

    def drop_stamps(self, digests: list[str]) -> None:
        """Forget the stamps of ``digests`` (gone, or found bad), in one transaction."""
        with self._tx() as con:
            con.executemany("DELETE FROM stamps WHERE digest = ?", [(d,) for d in digests])

    # -- counters --------------------------------------------------------------
    @staticmethod
    def _incr(con: sqlite3.Connection, name: str, delta: int) -> None:
        con.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) "
                    "DO UPDATE SET value = value + excluded.value", (name, delta))

    def incr(self, name: str, delta: int = 1) -> None:
        with self._tx() as con:
            self._incr(con, name, delta)

    def counter(self, name: str) -> int:
        con = self._db()
        with self._lock:
            row = con.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else 0

    def counters(self) -> dict[str, int]:
        out = {n: 0 for n in COUNTERS}
        for name, v in self._rows("SELECT name, value FROM counters"):
            out[name] = int(v or 0)
        return out

    def zero(self) -> None:
        with self._tx() as con:
            con.execute("DELETE FROM counters")



# Every index this process opened (weakly), those locked for the fork in progress (a
# WeakSet may lose one between the hooks), and the connections a forked child inherited
# (kept open, never used: see Index._after_fork_in_child).
_LIVE: weakref.WeakSet[Index] = weakref.WeakSet()
_FORKING: list[Index] = []
_INHERITED: list[sqlite3.Connection] = []
# Rows a scan reads per step under the index's lock.
_SCAN_BATCH = 256


def _before_fork() -> None:
    _FORKING[:] = list(_LIVE)
    for index in _FORKING:
        index._before_fork()


def _after_fork(child: bool) -> None:
    for index in _FORKING:
        if child:
            index._after_fork_in_child()
        else:
            index._after_fork_in_parent()
    _FORKING.clear()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork to survive
    os.register_at_fork(before=_before_fork,
                        after_in_parent=lambda: _after_fork(child=False),
                        after_in_child=lambda: _after_fork(child=True))
