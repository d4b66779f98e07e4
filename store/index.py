"""The metadata index: a diskcache (SQLite) of entry records and counters.

It is a cache of what the manifests say plus usage data (last use, hits), and can
always be rebuilt from the manifests on disk. Records are ``"e:<digest>"`` ->
dict (size, dates, hits, labels, and ``blobs``: content checksum -> size, so that gc
counts shared content once without reading every manifest); counters are
``"c:<name>"`` -> int.

Counters: ``hits``, ``miss:<kind>`` (one per lookup that found nothing to use, counted
by its caller), ``about:<kind>:<subject>`` (what such misses were about, e.g. the guard
that failed), ``publishes``, ``evictions``, ``corruptions``,
``hits:remote`` (hits a remote tier served by a download, counted in ``hits`` too),
``pulls`` (entries ``cachectl pull`` downloaded: not lookups, so never hits) and
``bytes`` (the running physical size that triggers gc). Lookups of shared-graph entries
(see cachecompile.store.policy) count under ``graph:hits`` and ``graph:miss:<kind>``
instead, so ``hits`` and ``miss:*`` are what the user's own methods did.

Hits recorded later (``open_store(hits_later=True)``, a serving process's store): a warm
start's first calls neither open the database (~20 ms: diskcache's import, its pragmas)
nor write a transaction per entry. The hits are queued and written in one transaction
:data:`HITS_DELAY_S` after the first, when this index is next used for anything else
(so this process always reads its own hits), or at exit; a process killed before then
loses them (its entries' last use is then older than it was: gc may take them earlier).

The index is a cache: :meth:`Index.safely` runs an index operation so that its failure
(a locked or damaged database, a full disk, a symlinked ``index/``) is logged and never
fails the lookup or publish around it. A read-only index (:meth:`Index.reader`) whose
database does not exist is empty, not failed (a read-only consumer of a store nothing was
published to reads it on every miss); one that cannot be read is said once per index.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from . import errors
from .keys import Key
from .outcomes import EntryInfo
from .policy import is_shared_graph

logger = logging.getLogger(__name__)

__all__ = ["GRAPH_SCOPE", "Index", "PULLS", "REMOTE_HITS", "counter_scope"]

T = TypeVar("T")

_E = "e:"
_C = "c:"
# Totals of the records, moved in the transaction that adds or removes a record, so that
# ``stats`` reads three rows instead of every record (5 s and 500 MB at 100,000 entries).
# Apart from the ``c:`` counters: ``stats --zero`` does not reset what the store holds.
_T = "t:"
# Stamps of the last full verification of each entry (see verification.Stamp): what lets
# ``cachectl verify`` read only the entries that changed since. Not records: the totals
# and ``ls`` never see them; verify drops those of entries no longer on disk.
_V = "v:"
_MODE_PICKLE = 4  # diskcache.core.MODE_PICKLE: a value stored pickled
TOTALS = ("entries", "graphs", "logical_bytes")
COUNTERS = ("hits", "publishes", "evictions", "corruptions")
GRAPH_SCOPE = "graph:"  # prefix of the counters of shared-graph lookups
REMOTE_HITS = "hits:remote"
# Entries `cachectl pull` downloaded ahead of use: not lookups, so never hits.
PULLS = "pulls"


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


def _interned(labels: Any) -> dict[str, str]:
    """The labels with their strings shared between records (each record decodes its
    own copies of "model", "forward"...: 100,000 of them held by ls and gc)."""
    if not isinstance(labels, dict):
        return {}
    return {sys.intern(k) if isinstance(k, str) else k: sys.intern(v) if isinstance(v, str)
            else v for k, v in labels.items()}


_intern = sys.intern


def _info(digest: str, rec: dict[str, Any]) -> EntryInfo:
    # What this package writes (see Index.add), read without a conversion per field: half
    # the time of ls and gc at 100,000 entries was here. Anything else takes the long way.
    try:
        size, created, last_used, hits, labels = (
            rec["size_bytes"], rec["created"], rec["last_used"], rec["hits"], rec["labels"])
        if (type(size) is int and type(created) is float and type(last_used) is float
                and type(hits) is int and type(labels) is dict and "state" not in rec):
            return EntryInfo(digest, size, created, last_used, hits,
                             {_intern(k): _intern(v) for k, v in labels.items()})
    except (KeyError, TypeError):   # a record of another shape; a label not a string
        pass
    return EntryInfo(
        key=digest,
        size_bytes=int(rec.get("size_bytes", 0)),
        created=float(rec.get("created", 0.0)),
        last_used=float(rec.get("last_used", rec.get("created", 0.0))),
        hits=int(rec.get("hits", 0)),
        labels=_interned(rec.get("labels")),
        state=str(rec.get("state", "ok")),
    )


class _NoDatabase(Exception):
    """A read-only index whose database was never made: nothing was published there."""


class _ReadOnlyCache:
    """The few reads :class:`Index` makes of a diskcache, on a database it may not write.

    diskcache always opens its database for writing (it sets pragmas and creates tables),
    which fails on a read-only file system: ``verify`` then took every entry for
    unindexed and ``stats`` showed no counters. This opens the SQLite file read-only
    (``mode=ro``; ``immutable=1`` where not even the ``-shm`` file can be made, which then
    reads the last checkpoint) and decodes rows with diskcache's own ``Disk``.
    """

    def __init__(self, directory: Path) -> None:
        import sqlite3
        import urllib.parse

        import diskcache

        self._disk = diskcache.Disk(str(directory))
        db = urllib.parse.quote(str(directory / "cache.db"))
        try:
            self._con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, check_same_thread=False)
            self._con.execute("SELECT 1 FROM Cache LIMIT 1").fetchall()
        except sqlite3.Error:
            self._con = sqlite3.connect(f"file:{db}?immutable=1", uri=True,
                                        check_same_thread=False)
            self._con.execute("SELECT 1 FROM Cache LIMIT 1").fetchall()

    def get(self, key: str, default: Any = None) -> Any:
        row = self._con.execute(
            "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1 AND "
            "(expire_time IS NULL OR expire_time > ?)", (key, time.time())).fetchone()
        return default if row is None else self._disk.fetch(row[0], row[1], row[2], False)

    def iterkeys(self) -> Iterator[Any]:
        for key, raw in self._con.execute("SELECT key, raw FROM Cache ORDER BY rowid"):
            yield self._disk.get(key, raw)

    def prefixed(self, prefix: str) -> Iterator[tuple[str, Any]]:
        """Every (key, value) whose string key starts with ``prefix``, in one query
        (``ls`` at 10,000 entries made 10,000 single-row lookups)."""
        rows = self._con.execute(
            "SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND key >= ? AND "
            "key < ? AND (expire_time IS NULL OR expire_time > ?)",  # in key order, unsorted
            (prefix, prefix + "\uffff", time.time()))
        fetch = self._disk.fetch
        for key, mode, filename, value in rows:
            if isinstance(key, str):
                if mode == _MODE_PICKLE and filename is None and isinstance(value, bytes):
                    # What diskcache's fetch does for a pickle stored inline, without its
                    # BytesIO per row (0.2 s of the 3 s of ls at 100,000 entries, measured).
                    yield key, pickle.loads(value)  # the store's own index, as diskcache reads it
                else:
                    yield key, fetch(mode, filename, value, False)

    def keys(self, prefix: str) -> list[str]:
        """The string keys that start with ``prefix`` (the key index only, no value)."""
        rows = self._con.execute(
            "SELECT key FROM Cache WHERE raw = 1 AND key >= ? AND key < ?",
            (prefix, prefix + "\uffff"))
        return [k for (k,) in rows if isinstance(k, str)]

    def totals_snapshot(self, prefix: str, names: list[str]) -> tuple[int, list[Any]]:
        """(how many keys start with ``prefix``, the values of ``names`` or None), read in
        one snapshot: counting rows uses the key index, no value is decoded."""
        con = self._con
        con.execute("BEGIN")
        try:
            (n,) = con.execute("SELECT COUNT(*) FROM Cache WHERE raw = 1 AND key >= ? AND "
                               "key < ?", (prefix, prefix + "\uffff")).fetchone()
            return int(n), [self.get(name) for name in names]
        finally:
            con.execute("COMMIT")

    @contextlib.contextmanager
    def transact(self) -> Iterator[None]:
        yield  # one reader's snapshot: nothing to hold

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise errors.ReadOnlyStoreError("the index of a read-only store is not written")

    set = incr = delete = _refuse

    def close(self) -> None:
        self._con.close()


def _count(c: Any, recs: Sequence[Mapping[str, Any]], sign: int) -> None:
    """Move the totals by the records ``recs``, added (+1) or removed (-1), with one
    update of each total (gc removes a batch: three updates per entry were a third of
    its index time); inside the caller's transaction."""
    c.incr(_T + "entries", sign * len(recs))
    # Moved by 0 too: a store without graphs has a total of 0, not none (none recounts).
    c.incr(_T + "graphs", sign * sum(is_shared_graph(r.get("labels") or {}) for r in recs))
    c.incr(_T + "logical_bytes", sign * sum(int(r.get("size_bytes", 0)) for r in recs))


class Index:
    """Lazily opened diskcache. Opening is deferred so that ``open_store()`` stays cheap."""

    def __init__(self, path: Path, guard: Callable[[], object] | None = None,
                 on_unsafe: Callable[[errors.InsecureStoreError], None] | None = None,
                 *, readonly: bool = False, shared: bool = False,
                 hits_later: bool = False) -> None:
        self.path = path
        self._cache: Any = None
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
        self._scan: _ReadOnlyCache | None = None
        # Called before the database is opened (the store checks that no directory on
        # the way is a symlink); once open, the handle no longer depends on the path.
        self._guard = guard
        # Told when the guard refused (the store warns once per link, not per lookup).
        self._on_unsafe = on_unsafe
        # A read-only index cannot repair itself: its failure is warned about once.
        self._warned = False

    @property
    def cache(self) -> Any:
        if self._hits:
            self.flush_hits()   # this process reads its own hits
        return self._open()

    def _open(self) -> Any:
        if self._cache is None:
            if self._guard is not None:
                self._guard()
            if self._readonly:
                if not (self.path / "cache.db").exists():
                    # Not kept: a writer may make it later, and this reader then reads it.
                    raise _NoDatabase(self.path)
                self._cache = _ReadOnlyCache(self.path)
                return self._cache
            import diskcache  # deferred: ~15 ms of imports not needed by every caller

            # Eviction inside diskcache is off: the store owns eviction policy.
            self._cache = diskcache.Cache(
                str(self.path), eviction_policy="none", size_limit=2**62, timeout=60
            )
            if self._shared:
                self._share()
        return self._cache

    def _share(self) -> None:
        """Group-write the index whatever the creator's umask (it made cache.db 0644, and
        the other members' hits and deletions failed: "readonly database"). SQLite gives
        its -wal and -shm files the database file's mode."""
        me = os.geteuid()
        for path, mode in ((self.path, 0o2770), (self.path / "cache.db", 0o660),
                           (self.path / "cache.db-wal", 0o660),
                           (self.path / "cache.db-shm", 0o660)):
            with contextlib.suppress(OSError):
                if os.lstat(path).st_uid == me and not os.path.islink(path):
                    os.chmod(path, mode)

    @property
    def readonly(self) -> bool:
        """Whether this index was opened read-only (:meth:`reader`)."""
        return self._readonly

    def reader(self) -> Index:
        """The same index, opened read-only (a read-only store's: never written)."""
        return Index(self.path, self._guard, self._on_unsafe, readonly=True,
                     shared=self._shared)

    def close(self) -> None:
        self.flush_hits()
        if self._scan is not None:
            self._scan.close()
            self._scan = None
        if self._cache is not None:
            self._cache.close()
            self._cache = None

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
        c = self.cache
        with c.transact():
            if c.get(_E + digest) is None:
                rec: dict[str, Any] = {
                    "size_bytes": size_bytes,
                    "created": created,
                    "last_used": created,
                    "hits": 0,
                    "labels": labels,
                }
                if blobs is not None:
                    rec["blobs"] = dict(blobs)
                c.set(_E + digest, rec)
                _count(c, [rec], +1)

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
        c = self._open()
        with c.transact():
            for digest, size_bytes, created, labels, counter, blobs, when in hits:
                rec = c.get(_E + digest)
                if rec is None:
                    # Published by a process that died before indexing: heal the index.
                    rec = {"size_bytes": size_bytes, "created": created, "hits": 0,
                           "labels": labels}
                    if blobs is not None:
                        rec["blobs"] = dict(blobs)
                    _count(c, [rec], +1)
                rec["hits"] = int(rec.get("hits", 0)) + 1
                rec["last_used"] = max(when, float(rec.get("last_used") or 0))
                c.set(_E + digest, rec)
                c.incr(_C + counter)

    def remove(self, digest: str) -> None:
        c = self.cache
        with c.transact():
            rec = c.get(_E + digest)
            if rec is not None:
                c.delete(_E + digest)
                _count(c, [rec], -1)

    def remove_many(self, digests: list[str], freed: int = 0) -> None:
        """:meth:`remove` of each, and ``bytes`` down by ``freed``, in one transaction (gc
        evicts in batches: one commit per batch instead of two per entry)."""
        c = self.cache
        with c.transact():
            if freed:
                c.incr(_C + "bytes", -freed)
            gone = [rec for rec in (c.pop(_E + d) for d in digests) if isinstance(rec, dict)]
            if gone:
                _count(c, gone, -1)

    def get(self, digest: str) -> EntryInfo | None:
        rec = self.cache.get(_E + digest)
        return None if rec is None else _info(digest, rec)

    def records(self) -> Iterator[EntryInfo]:
        for info, _ in self.items():
            yield info

    def items(self, *, blobs: bool = True) -> Iterator[tuple[EntryInfo, dict[str, int] | None]]:
        """Each record with its blob map (None for records written before blob maps, and
        without ``blobs``). Streamed from one query: nothing is held but the current row."""
        for k, rec in self._bulk().prefixed(_E):
            if isinstance(rec, dict):
                held = rec.get("blobs") if blobs else None
                # Each row is decoded afresh: its blob map is the caller's, uncopied.
                yield _info(k[len(_E) :], rec), (held if isinstance(held, dict) else None)

    def totals(self) -> dict[str, int]:
        """``entries``, ``graphs`` (shared-graph entries among them) and ``logical_bytes``
        of the records, from the totals kept as records come and go.

        The totals are checked against a count of the records in the same snapshot (an
        index query, no record read); when they are missing (an index written before
        totals) or off (a process of an older version added or removed records), they
        are recounted from the records, and written back where the index is writable.
        """
        snap = self._bulk()
        counted, kept = snap.totals_snapshot(_E, [_T + n for n in TOTALS])
        if kept[0] == counted and all(v is not None for v in kept):
            return {n: int(v or 0) for n, v in zip(TOTALS, kept, strict=True)}
        return self.recount()

    def recount(self) -> dict[str, int]:
        """Recount the totals from every record (and write them, if writable)."""
        out = {n: 0 for n in TOTALS}
        c = self.cache
        # Read in one query on the scan connection while the writer lock is held: no
        # other process commits meanwhile, so the snapshot read is the state written over.
        with c.transact():
            for _k, rec in self._bulk().prefixed(_E):
                if isinstance(rec, dict):
                    out["entries"] += 1
                    out["graphs"] += is_shared_graph(rec.get("labels") or {})
                    out["logical_bytes"] += int(rec.get("size_bytes", 0))
            if not self._readonly:
                for n, v in out.items():
                    c.set(_T + n, v)
        return out

    def _bulk(self) -> _ReadOnlyCache:
        """A reading connection for whole-index scans: what was committed (a writer's
        open transaction is not seen; nothing here reads inside one)."""
        c = self.cache  # opened (and created) first
        if isinstance(c, _ReadOnlyCache):
            return c
        if self._scan is None:
            self._scan = _ReadOnlyCache(self.path)
        return self._scan

    def set_blobs(self, blobs: Mapping[str, Mapping[str, int]]) -> None:
        """Fill in the blob maps of existing records (read from their manifests)."""
        c = self.cache
        with c.transact():
            for digest, held in blobs.items():
                rec = c.get(_E + digest)
                if rec is not None:
                    rec["blobs"] = dict(held)
                    c.set(_E + digest, rec)

    def digests(self) -> set[str]:
        # One query on the key index: iterating every key through diskcache took 7 s at
        # 100,000 entries.
        return {k[len(_E) :] for k in self._bulk().keys(_E)}

    def replace_all(self, infos: list[EntryInfo],
                    blobs: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Rebuild records from ``infos`` (from manifests), keeping known usage data."""
        c = self.cache
        with c.transact():
            old = {i.key: i for i in self.records()}
            for k in self._bulk().keys(_E):
                c.delete(k)
            totals = dict.fromkeys(TOTALS, 0)
            for i in infos:
                totals["entries"] += 1
                totals["graphs"] += is_shared_graph(i.labels)
                totals["logical_bytes"] += i.size_bytes
                prev = old.get(i.key)
                rec: dict[str, Any] = {
                    "size_bytes": i.size_bytes,
                    "created": i.created,
                    "last_used": prev.last_used if prev else i.created,
                    "hits": prev.hits if prev else 0,
                    "labels": i.labels,
                }
                if blobs is not None and i.key in blobs:
                    rec["blobs"] = dict(blobs[i.key])
                c.set(_E + i.key, rec)
            for n, v in totals.items():
                c.set(_T + n, v)

    # -- verification stamps ---------------------------------------------------
    def stamps(self) -> dict[str, tuple[bool, Any]]:
        """Digest -> (shared graph, stamp) of each entry a full check stamped, from one
        query (rows whose value is not such a pair are ignored: verify reads those
        entries in full)."""
        out: dict[str, tuple[bool, Any]] = {}
        names: dict[Any, Any] = {}   # the path lists, one object each (most are alike)
        for k, v in self._bulk().prefixed(_V):
            if (isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], tuple)
                    and len(v[1]) == 2 and isinstance(v[1][0], tuple)):
                graph, (paths, sealed) = v
                out[k[len(_V):]] = (bool(graph), (names.setdefault(paths, paths), sealed))
        return out

    def set_stamps(self, stamps: Mapping[str, tuple[bool, Any]]) -> None:
        """Keep the stamps of entries just checked in full, in one transaction."""
        c = self.cache
        with c.transact():
            for digest, value in stamps.items():
                c.set(_V + digest, value)

    def drop_stamps(self, digests: list[str]) -> None:
        """Forget the stamps of ``digests`` (gone, or found bad), in one transaction."""
        c = self.cache
        with c.transact():
            for digest in digests:
                c.delete(_V + digest)

    # -- counters --------------------------------------------------------------
    def incr(self, name: str, delta: int = 1) -> None:
        self.cache.incr(_C + name, delta)

    def counter(self, name: str) -> int:
        return int(self.cache.get(_C + name, 0))

    def counters(self) -> dict[str, int]:
        out = {n: 0 for n in COUNTERS}
        for k, v in self._bulk().prefixed(_C):   # one query, not one per key of the index
            out[k[len(_C) :]] = int(v or 0)
        return out

    def zero(self) -> None:
        c = self.cache
        with c.transact():
            for k in self._bulk().keys(_C):
                c.delete(k)
