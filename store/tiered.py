"""A local store with remote tiers behind it: look up the levels in turn on a local miss,
backfill, upload local publishes in the background.

``open_store()`` builds one when ``$CACHECOMPILE_REMOTE`` (or ``remote=``) is set:

* :class:`TieredStore` wraps the local store (any
  :class:`~cachecompile.store.protocol.Maintenance`): a local miss asks the remote; a
  remote hit is downloaded, verified (signature, SHA-256), published through the local
  store's own ``put`` (so it is not uploaded back) and returned as a Hit of that LOCAL
  entry. A ``put`` through the tier publishes locally, then queues an upload for the
  :class:`Uploader` thread. Maintenance is the local store's alone
  (:meth:`TieredStore.maintenance`).
* Over a read-only local store (:class:`~cachecompile.store.readonly.ReadOnlyStore`) the
  tier is the same class composed with that view: every write is refused as on any
  read-only store, nothing is uploaded, and a remote hit is published into a private
  scratch store that lives as long as the process (:func:`scratch_store`).

The remote is any :class:`~cachecompile.store.remote.base.Remote` (Redis, S3, a shared
directory, an HTTP cache), or a chain of them, nearest first
(``CACHECOMPILE_REMOTE="file:///mnt/cc,s3://bucket/p"``), as sccache chains its levels:

* a lookup asks the levels in turn; a hit in level *i* is published locally and then
  queued for upload to every writable level above it (the backfill), so the next node
  finds it nearer;
* a local publish is queued for every writable level (``?mode=ro`` levels are only read);
* the write-error policy is "each level on its own": every level has its own upload
  queue and breaker, so a level that fails (down, full, refusing) warns once and is
  skipped while the others go on, and the local publish never waits on or fails by any
  of them;
* ``stats()`` (``cachectl stats``) counts remote hits per level.

Remote faults never reach the caller: the tier logs (once, see cachecompile.store.remote.base)
and the lookup is the local miss. A remote entry refused (untrusted or damaged) is warned
about once per process, however many lookups and stores meet it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import stat
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from . import errors, settings
from .disk import Store
from .fsutil import HOST_TAG, parse_temp_name, pid_alive, rmtree_quiet, temp_name
from .index import PULLS, REMOTE_HITS, counter_scope, level_counter
from .keys import Key, digest_of
from .outcomes import Entry, Hit, Miss
from .protocol import DiskStorage, FileSource, Maintenance
from .remote.base import Remote, open_levels
from .wrapper import Wrapper

logger = logging.getLogger(__name__)

__all__ = ["Level", "TieredStore", "Uploader", "scratch_store", "wrap"]

DEFAULT_FLUSH_TIMEOUT = settings.REMOTE_FLUSH_TIMEOUT.default
DEFAULT_QUEUE = settings.REMOTE_QUEUE.default

S = TypeVar("S", bound=Maintenance)

# (remote, subject, message) already warned about: one lookup looks an entry up several
# times (its meta, then its variant, then a free variant slot), and every cache_compile'd
# function opens its own store, but a refused entry is one fact for the log.
_refusals: set[tuple[str, str, str]] = set()
_refusals_lock = threading.Lock()


def _warn_once(remote: Remote, subject: str, message: str) -> None:
    """Warn ``message`` about ``subject`` (an entry's digest, a local path) once per process."""
    with _refusals_lock:
        first = (remote.config.display, subject, message) not in _refusals
        _refusals.add((remote.config.display, subject, message))
    if first:
        logger.warning("%s", message)
    else:
        logger.debug("%s (again)", message)


class Uploader:
    """One daemon thread draining a bounded queue of local entries to the remote.

    A full queue drops the upload (another node, or the next run, will publish it): a
    publish must never wait on the network. At exit the process waits at most
    ``$CACHECOMPILE_REMOTE_FLUSH_TIMEOUT`` seconds (default 5) for the queue to drain.
    A forked child starts with an empty queue and a thread of its own (the parent's
    thread is not in it, and the parent uploads what it queued).
    """

    def __init__(self, remote: Remote, maxsize: int | None = None) -> None:
        self.remote = remote
        size = maxsize or settings.REMOTE_QUEUE.get()
        self._size = max(size, 1)
        self._pid = 0
        self._own_process()
        self._dropped_warned = False
        self.uploaded = 0
        self.failed = 0  # failed, dropped (the remote down, the queue full) or refused
        self._failed_seen = 0  # as many as the last flush reported

    def _own_process(self) -> None:
        """A queue, a lock and (later) a thread of this process's own: in a forked child
        the parent's may be held by its upload thread, which the child does not have
        (what the parent had queued is the parent's to upload). The one pid check of the
        uploader, run first by everything that touches the queue; the remote's client is
        the remote's own to re-create (``BlobRemote.reset_client``)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._q: queue.Queue[tuple[Entry, bool]] = queue.Queue(maxsize=self._size)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, entry: Entry, overwrite: bool = False) -> bool:
        self._own_process()
        try:
            self._ensure_thread()
        except RuntimeError as e:  # Python 3.12+: no new thread once the interpreter exits
            self.failed += 1
            logger.info("not uploading %s: %s", entry.key[:12], e)
            return False
        try:
            self._q.put_nowait((entry, overwrite))
        except queue.Full:
            self.failed += 1
            if not self._dropped_warned:
                self._dropped_warned = True
                logger.warning("remote upload queue is full (%d): not uploading %s and later "
                               "overflows", self._q.maxsize, entry.key)
            return False
        return True

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="cachecompile-upload",
                                          daemon=True)
                thread.start()  # first: one that failed to start is not kept as started
                self._thread = thread
                # weakref: the atexit hook must not keep a closed store's uploader alive.
                ref = weakref.ref(self)

                def flush() -> None:
                    u = ref()
                    if u is not None:
                        u.flush()

                atexit.register(flush)
                mp_util = sys.modules.get("multiprocessing.util")
                if mp_util is not None:
                    # A multiprocessing child (a forked Pool worker...) leaves through
                    # os._exit: no atexit hook runs there, only multiprocessing's own
                    # finalizers, and its uploads were dropped.
                    mp_util.Finalize(None, flush, exitpriority=0)

    def _run(self) -> None:
        while True:
            entry, overwrite = self._q.get()
            try:
                if not self.remote.available:
                    self.failed += 1
                    logger.debug("remote down: dropping upload of %s", entry.key)
                    continue
                t0 = time.perf_counter()
                if self.remote.upload(entry, overwrite=overwrite):
                    self.uploaded += 1
                    logger.info("uploaded %s to %s in %.1f ms", entry.key[:12],
                                self.remote.config.display, (time.perf_counter() - t0) * 1e3)
            except errors.RemoteError as e:
                self.failed += 1
                logger.debug("upload of %s failed: %s", entry.key, e)  # breaker warned once
            except (OSError, errors.StoreError) as e:
                # The local entry went away (gc, delete) or cannot be read: nothing to share.
                self.failed += 1
                logger.info("not uploading %s: %s", entry.key[:12], e)
            except Exception:  # a daemon thread must outlive any one upload
                self.failed += 1
                logger.warning("upload of %s failed unexpectedly", entry.key[:12], exc_info=True)
            finally:
                self._q.task_done()

    def pending(self) -> int:
        self._own_process()
        return self._q.unfinished_tasks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is drained. True if it was and every upload since the
        last flush reached the remote (or found its entry there); False if ``timeout``
        ran out first, or an upload failed or was dropped (the remote down, the queue
        full): a caller that must know its entries are shared asks here."""
        self._own_process()
        if timeout is None:
            timeout = settings.REMOTE_FLUSH_TIMEOUT.get()
        deadline = time.monotonic() + timeout
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("%d remote upload(s) not finished after %.1f s; giving up "
                                   "(CACHECOMPILE_REMOTE_FLUSH_TIMEOUT)",
                                   self._q.unfinished_tasks, timeout)
                    return False
                self._q.all_tasks_done.wait(left)
        failed, self._failed_seen = self.failed - self._failed_seen, self.failed
        return failed == 0


@dataclass
class Level:
    """One remote level of a tiered store: the remote and its own upload queue (None
    where nothing is uploaded to it: a ``mode=ro`` level, or a read-only node)."""

    remote: Remote
    uploader: Uploader | None
    hits: int = 0  # remote hits this level served in this process


class TieredStore(Wrapper[S]):
    """The local store ``local`` plus ``remote`` behind it: one remote, or a chain of
    levels, nearest first (see the module docstring).

    ``backfill`` makes the store remote hits are published into (default: ``local``
    itself); an OSError from it is a local miss.
    """

    def __init__(self, local: S, remote: Remote | Sequence[Remote], *,
                 backfill: Callable[[], DiskStorage] | None = None) -> None:
        super().__init__(local)
        remotes: list[Remote] = (list(remote) if isinstance(remote, (list, tuple))
                                 else [cast(Remote, remote)])
        if not remotes:
            raise ValueError("a tiered store needs at least one remote level")
        # Nothing is published from a read-only node, nor to a read-only level.
        self.levels = [Level(r, None if r.readonly or local.readonly else Uploader(r))
                       for r in remotes]
        self._backfill = backfill
        # Entries this process found bad or withdrew: its own upload may replace them.
        self._replace: set[str] = set()

    def __repr__(self) -> str:
        return f"TieredStore({self.inner!r}, {', '.join(repr(v.remote) for v in self.levels)})"

    @property
    def remote(self) -> Remote:
        """The nearest remote level."""
        return self.levels[0].remote

    @property
    def uploader(self) -> Uploader | None:
        """The nearest remote level's upload queue."""
        return self.levels[0].uploader

    @property
    def remote_hits(self) -> int:
        return sum(v.hits for v in self.levels)

    @property
    def local(self) -> S:
        """The local store: what maintenance (cachectl gc, verify, purge...) works on."""
        return self.inner

    def maintenance(self) -> S:
        """The local store's maintenance (gc, verify, purge...): the tier adds nothing to
        it, and a remote has its own verbs (``cachectl remote``)."""
        return self.inner

    def get(self, key: Key | str) -> Hit | Miss:
        local = self.inner.get(key)
        if isinstance(local, Hit):
            return local
        digest = digest_of(key)
        try:
            target = self.inner if self._backfill is None else self._backfill()
        except (OSError, errors.StoreError):
            return local  # the backfill said why
        if target is not self.inner:
            kept = target.peek(digest)  # downloaded earlier in this process
            if isinstance(kept, Hit):
                return kept
        for i, level in enumerate(self.levels):
            hit = self._fetch_into(level, target, key, digest)
            if hit is None:
                continue  # absent there, refused, or the level is down: ask the next
            scope = counter_scope(key, hit.entry.labels)
            self.inner.count(scope + REMOTE_HITS)
            self.inner.count(scope + level_counter(level.remote.config.display))
            self._fill_above(i, hit.entry)
            return hit
        return local

    def pull(self, key: Key | str) -> Hit | Miss:
        """Download ``key`` from the remote levels into the local store ahead of use
        (``cachectl pull``); the local entry if it is here already.

        Not a lookup: neither the store's hits nor the entry's own hit count and last use
        move (a prefetch is not evidence the entry serves anyone, and ``gc``'s LRU must
        not think so); each download counts once under ``pulls`` instead."""
        local = self.inner.peek(key)
        if isinstance(local, Hit):
            return local
        digest = digest_of(key)
        for i, level in enumerate(self.levels):
            got = self._fetch_into(level, self.inner, key, digest, lookup=False)
            if got is not None:
                self.inner.count(PULLS)
                self._fill_above(i, got.entry)
                return got
        return local

    def _fill_above(self, i: int, entry: Entry) -> None:
        """Queue ``entry`` (a hit of level ``i``, now local) for every writable level
        nearer than ``i``: the next lookup finds it there."""
        if self.inner.readonly:
            return  # a scratch copy: a read-only node publishes nothing
        for level in self.levels[:i]:
            if level.uploader is not None:
                level.uploader.submit(entry, overwrite=entry.key in self._replace)

    def put(self, key: Key, files: Mapping[str, FileSource], *,
            labels: Mapping[str, Any] | None = None,
            meta: Mapping[str, Any] | None = None) -> Entry:
        entry = self.inner.put(key, files, labels=labels, meta=meta)
        for level in self.levels:
            if level.uploader is not None:
                level.uploader.submit(entry, overwrite=entry.key in self._replace)
        return entry

    def delete(self, key: Key | str) -> bool:
        # Withdrawn here (stale, unloadable, recompiled): our next publish may replace
        # the remote copy. The remote record itself stays: another node may load it fine.
        self._replace.add(digest_of(key))
        return self.inner.delete(key)

    def stats(self, *, recount: bool = False) -> dict[str, Any]:
        s = self.inner.stats(recount=recount)
        by_level = s.get("hits_remote_levels") or {}
        return {**s, "remote": ", ".join(v.remote.config.display for v in self.levels),
                "levels": [{"remote": v.remote.config.display, "readonly": v.remote.readonly,
                            "hits": int(by_level.get(v.remote.config.display, 0))}
                           for v in self.levels]}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued uploads of every level (see :meth:`Uploader.flush`); True if
        none is left and none failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for level in self.levels:
            if level.uploader is not None:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                done = level.uploader.flush(left) and done
        return done

    def close(self) -> None:
        self.flush()
        for level in self.levels:
            level.remote.close()
        self.inner.close()

    def _fetch_into(self, level: Level, target: DiskStorage, key: Key | str, digest: str, *,  # noqa: C901 (today's exception: each download fault is a named miss)
                    lookup: bool = True) -> Hit | None:
        """Download ``digest`` from ``level`` into ``target`` and return its local Hit;
        None on any failure.

        ``lookup`` (a process wants the entry now) reads it back with ``get``, which
        records the hit; a pull (``lookup=False``) reads it with ``peek``, which does not."""
        remote = level.remote
        if not remote.available:
            return None
        staging: Path | None = None
        t0 = time.perf_counter()
        try:
            # Private (0700) even in a shared cache: the files are checked, then put.
            staging = target.staging_dir("remote", digest, mode=0o700)
            rec = remote.download(digest, staging)
            if rec is None:
                return None
            m = rec.manifest
            files = {n: staging / n for n in m["files"]}
            factors = key.factors if isinstance(key, Key) and key.factors else m["factors"]
            # The target's own put: a backfilled entry must not be uploaded back.
            entry = target.put(Key(digest=digest, factors=factors), files,
                               labels=m["labels"], meta=m["meta"])
            # put re-hashed every file with XXH3: it must agree with the signed manifest.
            for n, r in m["files"].items():
                mine = entry.manifest["files"].get(n, {})
                if (mine.get("size"), mine.get("xxh3_128")) != (r["size"], r["xxh3_128"]):
                    target.delete(digest)
                    raise errors.CorruptEntryError(digest, f"file {n!r} does not match the "
                                                           "manifest's XXH3-128")
        except errors.RemoteError:
            return None  # the breaker logged it
        except errors.InsecureStoreError as e:
            # Our own store refuses the write (a symlinked tmp/, blobs/...): the remote
            # entry is not at fault, so it is neither refused nor ours to replace.
            _warn_once(remote, str(e.path), f"not downloading remote entries: {e}")
            return None
        except errors.ReadOnlyStoreError as e:
            # A read-only local store and no backfill to download into (wrap() gives one
            # a scratch store): again not the remote entry's fault.
            _warn_once(remote, str(target.root), f"not downloading remote entries: {e}")
            return None
        except errors.UntrustedEntryError as e:
            # Our own upload may replace it; cachecompile.store.remote decides whether it
            # really may.
            self._replace.add(digest)
            _warn_once(remote, digest, f"remote {e}")
            return None
        except errors.StoreError as e:  # corrupt remote entry, or the local put failed
            self._replace.add(digest)
            _warn_once(remote, digest, f"remote entry {digest} refused: {e}")
            return None
        except OSError as e:
            logger.warning("downloading remote entry %s failed: %s", digest, e)
            return None
        finally:
            if staging is not None:
                rmtree_quiet(staging)
        ms = (time.perf_counter() - t0) * 1e3
        if not lookup:
            logger.info("pulled %s: downloaded %d bytes in %.1f ms", digest[:12],
                        rec.size_bytes, ms)
            got = target.peek(digest)
            return got if isinstance(got, Hit) else None
        level.hits += 1
        logger.info("remote hit %s from %s: downloaded %d bytes in %.1f ms", digest[:12],
                    remote.config.display, rec.size_bytes, ms)
        hit = target.get(digest)
        return hit if isinstance(hit, Hit) else None


def scratch_parent() -> Path:
    """Where this user's read-only nodes keep their scratch stores:
    ``$TMPDIR/cachecompile-<uid>-remote``, private. Each scratch store inside is named by
    its host and pid, so that the next process sweeps those of processes that died
    without running their exit hooks (a SIGKILL, an OOM kill, a node drain)."""
    parent = Path(tempfile.gettempdir()) / f"cachecompile-{os.getuid()}-remote"
    with contextlib.suppress(FileExistsError):
        parent.mkdir(mode=0o700)
    st = os.lstat(parent)
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()
            or st.st_mode & 0o077):
        # Someone else made it (or a link): never put entries, which are code, there.
        raise errors.InsecureStoreError(
            parent, "not a private directory of this user (owned by another, a link, or "
            "open to others)", "remove it; read-only nodes make it again, mode 0700")
    return parent


def sweep_scratch(parent: Path) -> int:
    """Remove the scratch stores of dead processes of this host under ``parent``."""
    removed = 0
    for child in parent.iterdir():
        owner = parse_temp_name(child.name)
        if owner is not None and owner[0] == HOST_TAG and not pid_alive(owner[1]):
            rmtree_quiet(child)
            removed += 1
    return removed


def _remove_own(root: Path, pid: int) -> None:
    """The exit hook of a scratch store: a forked child inherits the hook, and must not
    remove the store its parent still serves from."""
    if os.getpid() == pid:
        rmtree_quiet(root)


def scratch_store(max_size: int) -> Callable[[], Store]:
    """A backfill for a read-only node: a private store made on first use and removed at
    exit (remote hits must land somewhere this process may write); one left by a
    process that was killed is swept by the next one. A forked child makes its own: the
    parent's is removed when the parent exits, and only by the parent."""
    made: dict[int, Store] = {}  # by the pid of the process that made it

    def get() -> Store:
        st = made.get(os.getpid())
        if st is None:
            made.clear()  # the parent's, if we were forked: the parent's to keep and remove
            try:
                parent = scratch_parent()
                swept = sweep_scratch(parent)
                if swept:
                    logger.info("removed %d scratch stores of dead processes", swept)
                root = parent / temp_name("scratch")
                root.mkdir(mode=0o700)
                st = Store(root, max_size=max_size)
                st.create_layout()
            except (OSError, errors.StoreError) as e:
                logger.warning("cannot make a scratch store for remote hits: %s", e)
                raise
            atexit.register(_remove_own, root, os.getpid())
            made[os.getpid()] = st
        return st

    return get


def wrap(local: S, remote: str | Remote | Sequence[Remote]) -> TieredStore[S]:
    """Put ``remote`` (a URL, or a chain of levels: a comma list, nearest first) behind
    ``local``; a bad URL raises RemoteConfigError (a ValueError).

    Over a read-only local store the tier is the same class, composed with the read-only
    view: lookups go local, then remote; remote hits land in a per-process scratch store
    (the view refuses writes), and nothing is uploaded (the view says it is read-only).
    """
    r = open_levels(remote) if isinstance(remote, str) else remote
    if local.readonly:
        return TieredStore(local, r, backfill=scratch_store(local.max_size))
    return TieredStore(local, r)
