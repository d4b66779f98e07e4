"""A local store with a remote tier behind it: look up remote on a local miss, backfill,
upload local publishes in the background.

``open_store()`` builds one when ``$CACHECOMPILE_REMOTE`` (or ``remote=``) is set:

* :class:`TieredStore` is the local :class:`~cachecompile.store.disk.Store` (it *is* one, so every local
  operation, lock and pin works unchanged) with ``get``/``put``/``delete`` wrapped: a local
  miss asks the remote; a remote hit is downloaded, verified (signature, SHA-256), published
  locally through the normal ``put`` and returned as a Hit of that LOCAL entry.
  A local ``put`` queues an upload for the :class:`Uploader` thread.
* :class:`ReadOnlyTieredStore` is the same over a read-only local root: a remote hit is
  published into a private scratch store that lives as long as the process.

Remote faults never reach the caller: the tier logs (once, see cachecompile.store.remote) and the
lookup is the local miss. A remote entry refused (untrusted or damaged) is warned about
once per process, however many lookups and stores meet it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import errors
from .config import env_float, env_int
from .disk import Store, counter_scope
from .fsutil import rmtree_quiet
from .keys import Key
from .outcomes import Entry, Hit, Miss
from .readonly import ReadOnlyStore
from .remote import RedisRemote

logger = logging.getLogger(__name__)

__all__ = ["TieredStore", "ReadOnlyTieredStore", "Uploader", "hit_split", "wrap"]

DEFAULT_FLUSH_TIMEOUT = 5.0
DEFAULT_QUEUE = 64
# Index counter: hits served by a download (cachectl stats); a shared graph's goes under
# the graph scope, as its hits do (cachecompile.store.disk.counter_scope).
REMOTE_HITS = "hits:remote"

# (remote, subject, message) already warned about: one lookup looks an entry up several
# times (its meta, then its variant, then a free variant slot), and every cache_compile'd
# function opens its own store, but a refused entry is one fact for the log.
_refusals: set[tuple[str, str, str]] = set()
_refusals_lock = threading.Lock()


def _warn_once(remote: RedisRemote, subject: str, message: str) -> None:
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
    """

    def __init__(self, remote: RedisRemote, maxsize: int | None = None) -> None:
        self.remote = remote
        size = maxsize or env_int("CACHECOMPILE_REMOTE_QUEUE", DEFAULT_QUEUE, lenient=True) or 1
        self._q: queue.Queue[tuple[Entry, bool]] = queue.Queue(maxsize=max(size, 1))
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._dropped_warned = False
        self.uploaded = 0
        self.failed = 0

    def submit(self, entry: Entry, overwrite: bool = False) -> bool:
        self._ensure_thread()
        try:
            self._q.put_nowait((entry, overwrite))
        except queue.Full:
            if not self._dropped_warned:
                self._dropped_warned = True
                logger.warning("remote upload queue is full (%d): not uploading %s and later "
                               "overflows", self._q.maxsize, entry.key)
            return False
        return True

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cachecompile-upload",
                                                daemon=True)
                self._thread.start()
                # weakref: the atexit hook must not keep a closed store's uploader alive.
                ref = weakref.ref(self)
                atexit.register(lambda: (u := ref()) is not None and u.flush())

    def _run(self) -> None:
        while True:
            entry, overwrite = self._q.get()
            try:
                if not self.remote.available:
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
            except Exception:  # noqa: BLE001 - a daemon thread must outlive any one upload
                self.failed += 1
                logger.warning("upload of %s failed unexpectedly", entry.key[:12], exc_info=True)
            finally:
                self._q.task_done()

    def pending(self) -> int:
        return self._q.unfinished_tasks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is drained; False if ``timeout`` ran out first."""
        if timeout is None:
            timeout = env_float("CACHECOMPILE_REMOTE_FLUSH_TIMEOUT", DEFAULT_FLUSH_TIMEOUT)
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
        return True


class _RemoteSide:
    """What both tiered stores share: download into a local Store, refusals, counters."""

    remote: RedisRemote

    def _init_remote(self, remote: RedisRemote) -> None:
        self.remote = remote
        self.uploader: Uploader | None = None if remote.readonly else Uploader(remote)
        # Entries this process found bad or withdrew: its own upload may replace them.
        self._replace: set[str] = set()
        self.remote_hits = 0

    def _fetch_into(self, target: Store, key: Key | str, digest: str) -> Hit | None:
        """Download ``digest`` into ``target`` and return its local Hit; None on any failure."""
        if not self.remote.available:
            return None
        staging: Path | None = None
        t0 = time.perf_counter()
        try:
            # Private (0700) even in a shared cache: the files are checked, then put.
            staging = target.staging_dir("remote", digest, mode=0o700)
            rec = self.remote.download(digest, staging)
            if rec is None:
                return None
            m = rec.manifest
            files = {n: staging / n for n in m["files"]}
            factors = key.factors if isinstance(key, Key) and key.factors else m["factors"]
            # Store.put, not target.put: a backfilled entry must not be uploaded back.
            entry = Store.put(target, Key(digest=digest, factors=factors), files,
                              labels=m["labels"], meta=m["meta"])
            # put re-hashed every file with XXH3: it must agree with the signed manifest.
            for n, r in m["files"].items():
                mine = entry.manifest["files"].get(n, {})
                if (mine.get("size"), mine.get("xxh3_128")) != (r["size"], r["xxh3_128"]):
                    Store.delete(target, digest)
                    raise errors.CorruptEntryError(digest, f"file {n!r} does not match the "
                                                           "manifest's XXH3-128")
        except errors.RemoteError:
            return None  # the breaker logged it
        except errors.InsecureStoreError as e:
            # Our own store refuses the write (a symlinked tmp/, blobs/...): the remote
            # entry is not at fault, so it is neither refused nor ours to replace.
            _warn_once(self.remote, str(e.path), f"not downloading remote entries: {e}")
            return None
        except errors.UntrustedEntryError as e:
            # Our own upload may replace it; cachecompile.store.remote decides whether it really may.
            self._replace.add(digest)
            _warn_once(self.remote, digest, f"remote {e}")
            return None
        except errors.StoreError as e:  # corrupt remote entry, or the local put failed
            self._replace.add(digest)
            _warn_once(self.remote, digest, f"remote entry {digest} refused: {e}")
            return None
        except OSError as e:
            logger.warning("downloading remote entry %s failed: %s", digest, e)
            return None
        finally:
            if staging is not None:
                rmtree_quiet(staging)
        self.remote_hits += 1
        logger.info("remote hit %s: downloaded %d bytes in %.1f ms", digest[:12],
                    rec.size_bytes, (time.perf_counter() - t0) * 1e3)
        hit = Store.get(target, digest)
        return hit if isinstance(hit, Hit) else None

    def _submit(self, entry: Entry) -> None:
        if self.uploader is not None:
            self.uploader.submit(entry, overwrite=entry.key in self._replace)

    def flush(self, timeout: float | None = None) -> bool:
        return True if self.uploader is None else self.uploader.flush(timeout)


class TieredStore(_RemoteSide, Store):
    """The local store at ``local.root`` plus ``remote`` behind it (see module docstring)."""

    def __init__(self, local: Store, remote: RedisRemote) -> None:
        Store.__init__(self, local.root, max_size=local.max_size,
                       shared_group=local.shared_group)
        self._init_remote(remote)

    def __repr__(self) -> str:
        return f"TieredStore({str(self.root)!r}, {self.remote!r})"

    def get(self, key: Key | str) -> Hit | Miss:
        local = Store.get(self, key)
        if isinstance(local, Hit):
            return local
        digest = self.digest_of(key)
        hit = self._fetch_into(self, key, digest)
        if hit is None:
            return local

        def count() -> None:
            self.index.incr(counter_scope(key, hit.entry.labels) + REMOTE_HITS)
            if local.kind == "absent":
                # It was a hit after all, one tier down: take back the very counter that
                # Store.get moved (a shared graph's miss is not the user's).
                self.index.incr(counter_scope(key) + "miss:absent", -1)

        self._index_safely("remote hit", count)
        return hit

    def put(self, key: Key, files: Mapping[str, bytes | os.PathLike[str] | str], *,
            labels: Mapping[str, Any] | None = None,
            meta: Mapping[str, Any] | None = None) -> Entry:
        entry = Store.put(self, key, files, labels=labels, meta=meta)
        self._submit(entry)
        return entry

    def delete(self, key: Key | str) -> bool:
        # Withdrawn here (stale, unloadable, recompiled): our next publish may replace
        # the remote copy. The remote record itself stays: another node may load it fine.
        self._replace.add(self.digest_of(key))
        return Store.delete(self, key)

    def stats(self) -> dict[str, Any]:
        s = Store.stats(self)
        s.update(hit_split(self, s["hits"]))
        s["remote"] = self.remote.config.display
        return s

    def close(self) -> None:
        self.flush()
        self.remote.close()
        Store.close(self)


class ReadOnlyTieredStore(_RemoteSide, ReadOnlyStore):
    """A read-only local root plus a remote: remote hits land in a per-process scratch store."""

    def __init__(self, inner: Store, why: str, remote: RedisRemote) -> None:
        ReadOnlyStore.__init__(self, inner, why)
        self._init_remote(remote)
        self.uploader = None  # nothing is published from a read-only node
        self._scratch: Store | None = None

    def __repr__(self) -> str:
        return f"ReadOnlyTieredStore({self.inner!r}, {self.remote!r})"

    def _scratch_store(self) -> Store:
        if self._scratch is None:
            root = Path(tempfile.mkdtemp(prefix="cachecompile-remote-"))
            st = Store(root, max_size=self.inner.max_size)
            st.create_layout()
            atexit.register(rmtree_quiet, root)
            self._scratch = st
        return self._scratch

    def get(self, key: Key | str) -> Hit | Miss:
        local = self.inner.peek(key)
        if isinstance(local, Hit):
            return local
        digest = self.inner.digest_of(key)
        if self._scratch is not None:
            cached = self._scratch.peek(digest)
            if isinstance(cached, Hit):
                return cached
        try:
            scratch = self._scratch_store()
        except OSError as e:
            logger.warning("cannot make a scratch store for remote hits: %s", e)
            return local
        hit = self._fetch_into(scratch, key, digest)
        return local if hit is None else hit

    def close(self) -> None:
        self.remote.close()
        ReadOnlyStore.close(self)


def hit_split(st: Any, hits: int | None = None) -> dict[str, int]:
    """``{"hits_local", "hits_remote"}`` from the index counters of any local store."""
    inner = st.inner if isinstance(st, ReadOnlyStore) else st
    remote = 0
    with contextlib.suppress(Exception):  # an unreadable index: report zero remote hits
        remote = int(inner.index.counter(REMOTE_HITS))
    if hits is None:
        hits = 0
        with contextlib.suppress(Exception):
            hits = int(inner.index.counter("hits"))
    return {"hits_local": max(hits - remote, 0), "hits_remote": remote}


def wrap(local: Store | ReadOnlyStore, remote: str | RedisRemote) -> Store | ReadOnlyStore:
    """Put ``remote`` behind ``local``; a bad URL raises ValueError."""
    r = remote if isinstance(remote, RedisRemote) else RedisRemote(remote)
    if isinstance(local, ReadOnlyStore):
        return ReadOnlyTieredStore(local.inner, local.why, r)
    return TieredStore(local, r)
