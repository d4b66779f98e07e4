"""A Redis tier: entries as signed records plus content-addressed, chunked blobs.

Layout under a key prefix (default ``cachecompile:v1``)::

    <p>:entry:<digest>        the record (store.signing): manifest, SHA-256s, signature
    <p>:blob:<sha256>         blob marker, value = its chunk size; written after the chunks
    <p>:chunk:<sha256>:<i>    the i-th chunk of a file's bytes (at most 64 MiB each)

Blobs are addressed by SHA-256, so identical files are stored once across entries and
a planted blob cannot pass for another. An upload writes the chunks, then the blob
markers, then the record: a record is the last thing written, so an entry is visible
whole or not at all; a killed upload leaves only unreferenced chunks (``cachectl remote
purge`` sweeps them).

Failures degrade: a connection error, a timeout, OOM or a partial read trips a breaker
that logs ONE warning, makes every remote call a quick :class:`RemoteError` (the process
goes on local-only) and lets one call through again after a backoff (1 s, doubling, at
most 60 s). ``redis`` is imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import errors
from .fsutil import write_new_file
from .outcomes import Entry
from .signing import Record, Trust, make_record, parse_record, sha256_file

logger = logging.getLogger(__name__)

__all__ = ["MAX_CHUNK", "RemoteConfig", "RedisRemote"]

MAX_CHUNK = 64 * 1024**2  # Redis caps a value at 512 MB; big values stall the server
# 4 MiB: redis-py's reply parser copies big values; 4 MiB GETs ran 600 MB/s on loopback,
# 16 MiB ones 440 (tools/bench_remote.py), and smaller ones add round trips.
DEFAULT_CHUNK = 4 * 1024**2
_UNITS = {"": 1, "K": 1024, "M": 1024**2}
_OURS = ("mode", "chunk", "timeout", "backoff", "prefix")


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in "KM" else ""
    return int(float(t[: len(t) - len(unit)]) * _UNITS[unit])


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote is and how to use it, parsed from a ``redis://`` URL.

    Our own query parameters are taken out before the URL reaches redis-py:
    ``mode=ro`` (consume, never publish), ``chunk=4M``, ``timeout=5`` (seconds per socket
    operation), ``backoff=1`` (first retry delay), ``prefix=cachecompile:v1``.
    """

    url: str
    redis_url: str
    readonly: bool = False
    chunk: int = DEFAULT_CHUNK
    timeout: float = 5.0
    backoff: float = 1.0
    max_backoff: float = 60.0
    prefix: str = "cachecompile:v1"
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> RemoteConfig:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"remote {url!r}: only redis://, rediss:// and unix:// URLs "
                             "are supported")
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        ours: dict[str, str] = {}
        rest: list[tuple[str, str]] = []
        for k, v in query:
            if k in _OURS:
                ours[k] = v
            else:
                rest.append((k, v))
        mode = ours.get("mode", "rw").lower()
        if mode not in ("rw", "ro"):
            raise ValueError(f"remote {url!r}: mode must be rw or ro, not {mode!r}")
        chunk = _size(ours["chunk"]) if "chunk" in ours else DEFAULT_CHUNK
        if not 0 < chunk <= MAX_CHUNK:
            raise ValueError(f"remote {url!r}: chunk must be between 1 byte and 64M")
        redis_url = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(rest)))
        return cls(url=url, redis_url=redis_url, readonly=mode == "ro", chunk=chunk,
                   timeout=float(ours.get("timeout", 5.0)),
                   backoff=float(ours.get("backoff", 1.0)),
                   prefix=ours.get("prefix", "cachecompile:v1"))

    @property
    def display(self) -> str:
        """The URL without a password, for logs."""
        p = urllib.parse.urlsplit(self.redis_url)
        host = p.hostname or ""
        netloc = f"{host}:{p.port}" if p.port else host
        return urllib.parse.urlunsplit(p._replace(netloc=netloc, query=""))


class _Breaker:
    """Trips on a remote failure; lets one call through again after a growing backoff."""

    def __init__(self, name: str, backoff: float, max_backoff: float) -> None:
        self.name = name
        self.base = backoff
        self.max = max_backoff
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.delay = backoff
        self.failures = 0
        self._warned = False
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def allow(self) -> bool:
        with self._lock:
            return self.down_since is None or time.monotonic() >= self.retry_at

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                self.delay = self.base
                if not self._warned:
                    # One warning per process: a flapping remote must not flood the log.
                    self._warned = True
                    logger.warning("remote cache %s failed (%s: %s): continuing local-only; "
                                   "it is retried with backoff", self.name,
                                   type(exc).__name__, exc)
                else:
                    logger.info("remote cache %s failed again (%s: %s)", self.name,
                                type(exc).__name__, exc)
            else:
                self.delay = min(self.delay * 2, self.max)
            self.retry_at = now + self.delay
            logger.debug("remote cache %s: next try in %.1f s", self.name, self.delay)

    def ok(self) -> None:
        if self.down_since is None:
            return
        with self._lock:
            if self.down_since is not None:
                logger.info("remote cache %s is back after %.1f s", self.name,
                            time.monotonic() - self.down_since)
                self.down_since = None


class RedisRemote:
    """One Redis remote. Every method raises :class:`~store.errors.RemoteError` on failure."""

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None,
                 client: Any = None) -> None:
        self.config = RemoteConfig.parse(config) if isinstance(config, str) else config
        self.trust = trust if trust is not None else Trust.from_env()
        self.breaker = _Breaker(self.config.display, self.config.backoff, self.config.max_backoff)
        self._client = client
        self._client_lock = threading.Lock()
        # Blobs this process downloaded and found damaged: an upload rewrites them instead
        # of trusting their marker (content addressing alone would keep the bad bytes).
        self.bad_blobs: set[str] = set()
        p = self.config.prefix
        self._entry_k = f"{p}:entry:"
        self._blob_k = f"{p}:blob:"
        self._chunk_k = f"{p}:chunk:"

    def __repr__(self) -> str:
        return f"RedisRemote({self.config.display!r}, readonly={self.readonly})"

    @property
    def readonly(self) -> bool:
        return self.config.readonly

    @property
    def available(self) -> bool:
        """False while the breaker is open and its backoff has not elapsed (no network)."""
        return self.breaker.allow()

    # -- plumbing ----------------------------------------------------------------------
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                # No retries inside redis-py: our breaker decides when to try again, so a
                # dead remote costs one connect timeout per backoff period, not per call.
                self._client = redis.Redis.from_url(
                    self.config.redis_url, socket_timeout=self.config.timeout,
                    socket_connect_timeout=min(self.config.timeout, 2.0),
                    retry=Retry(NoBackoff(), 0), health_check_interval=0)
            return self._client

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        if not self.breaker.allow():
            raise errors.RemoteError(f"remote cache {self.config.display} is unavailable "
                                     "(waiting before the next try)")
        try:
            import redis
        except ImportError as e:  # the extra is missing: as good as unreachable
            self.breaker.failed(e)
            raise errors.RemoteError(f"the redis client library is not installed: {e}") from e
        try:
            out = fn(self.client())
        except (redis.RedisError, OSError) as e:
            self.breaker.failed(e)
            raise errors.RemoteError(f"remote cache {self.config.display}: {what} failed: "
                                     f"{type(e).__name__}: {e}") from e
        self.breaker.ok()
        return out

    def _cmd(self, what: str, *args: Any) -> Any:
        return self._call(what, lambda r: r.execute_command(*args))

    def _scan(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix`` (SCAN: never blocks the server like KEYS)."""
        def scan(r: Any) -> list[str]:
            return [k.decode() if isinstance(k, bytes) else str(k)
                    for k in r.scan_iter(match=prefix + "*", count=1000)]

        return list(self._call("scan", scan))

    def key_of(self, digest: str) -> str:
        return self._entry_k + digest

    def _chunk_keys(self, sha: str, size: int, chunk: int) -> list[str]:
        return [f"{self._chunk_k}{sha}:{i}" for i in range(math.ceil(size / chunk))]

    # -- reads ---------------------------------------------------------------------------
    def ping(self) -> bool:
        return bool(self._call("ping", lambda r: r.ping()))

    def contains(self, digest: str) -> bool:
        return bool(self._call("exists", lambda r: r.exists(self.key_of(digest))))

    def record(self, digest: str) -> Record | None:
        """The parsed record of ``digest`` (not yet trusted), or None if absent."""
        raw = self._call("get", lambda r: r.get(self.key_of(digest)))
        if raw is None:
            return None
        return parse_record(raw, digest)

    def download(self, digest: str, dest: Path,
                 progress: Callable[[int], None] | None = None) -> Record | None:
        """Fetch a trusted entry's files into ``dest`` (a fresh dir); None if absent.

        Raises UntrustedEntryError before any byte of a file is fetched if the record is
        not trusted; CorruptEntryError if a file is short, missing or fails its SHA-256;
        RemoteError if the remote fails midway. The caller discards ``dest`` on error.
        """
        rec = self.record(digest)
        if rec is None:
            return None
        self.trust.check(rec.body, rec.sig, digest)
        for name, frec in rec.manifest["files"].items():
            sha = rec.sha256[name]
            size = int(frec["size"])
            chunk = rec.chunks.get(sha)
            if chunk is None and size:
                raise errors.CorruptEntryError(digest, f"record has no chunk size for {name!r}")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                got, actual = self._fetch_file(digest, name,
                                               self._chunk_keys(sha, size, chunk or 1), target,
                                               progress)
            except errors.CorruptEntryError:
                self.bad_blobs.add(sha)
                raise
            if got != size or actual != sha:
                self.bad_blobs.add(sha)
                raise errors.CorruptEntryError(digest, f"file {name!r} fails its SHA-256 "
                                                       f"({got} of {size} bytes)")
        return rec

    def _fetch_file(self, digest: str, name: str, keys: list[str], target: Path,
                    progress: Callable[[int], None] | None) -> tuple[int, str]:
        """Stream chunks into ``target``; (bytes written, SHA-256 hex)."""
        h = hashlib.sha256()
        got = 0

        def fetched() -> Iterator[tuple[str, Any]]:
            if len(keys) <= 1:
                yield from ((k, self._cmd("get chunk", "GET", k)) for k in keys)
                return
            # Two GETs in flight: the next chunk crosses the network while this one is
            # hashed and written (the pure-Python reply parser is the bottleneck otherwise).
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cc-get") as pool:
                window: deque[tuple[str, Future[Any]]] = deque()
                for k in keys:
                    window.append((k, pool.submit(self._cmd, "get chunk", "GET", k)))
                    if len(window) == 2:
                        k0, fut = window.popleft()
                        yield k0, fut.result()
                while window:
                    k0, fut = window.popleft()
                    yield k0, fut.result()

        def chunks() -> Iterator[bytes]:
            nonlocal got
            for k, data in fetched():
                if data is None:
                    # Evicted (maxmemory policy) or purged under us: a partial entry.
                    raise errors.CorruptEntryError(digest, f"chunk {k} of {name!r} is gone")
                h.update(data)
                got += len(data)
                if progress is not None:
                    progress(len(data))
                yield data

        write_new_file(target, chunks(), 0o600)
        return got, h.hexdigest()

    def records(self, *, batch: int = 500) -> Iterator[Record]:
        """Every parsable record (unverified); malformed ones are logged and skipped."""
        keys = self._scan(self._entry_k)
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            raws = self._cmd("mget", "MGET", *part)
            for k, raw in zip(part, raws, strict=True):
                if raw is None:
                    continue
                digest = k[len(self._entry_k):]
                try:
                    yield parse_record(raw, digest)
                except errors.ManifestError as e:
                    logger.warning("remote entry %s is malformed: %s", digest, e)

    def info(self) -> dict[str, Any]:
        raw = self._call("info", lambda r: r.info("memory"))
        return {"used_memory": int(raw.get("used_memory", 0)),
                "maxmemory": int(raw.get("maxmemory", 0)),
                "maxmemory_policy": str(raw.get("maxmemory_policy", ""))}

    # -- writes --------------------------------------------------------------------------
    def _refuse_ro(self) -> None:
        if self.readonly:
            raise errors.ReadOnlyStoreError(f"remote cache {self.config.display} is read-only "
                                            "(mode=ro)")

    def upload(self, entry: Entry, *, overwrite: bool = False,
               progress: Callable[[int], None] | None = None) -> bool:
        """Publish a local entry; False if the remote had it already (and not ``overwrite``).

        Order is the atomicity: chunks, then each blob's marker, then the record.
        """
        self._refuse_ro()
        digest = entry.key
        if not overwrite and self.contains(digest):
            return False
        names = sorted(entry.manifest["files"])
        sha = {n: sha256_file(entry.files[n]) for n in names}
        blobs = sorted(set(sha.values()))
        markers = self._cmd("mget", "MGET", *[self._blob_k + s for s in blobs]) if blobs else []
        chunks: dict[str, int] = {}
        for s, m in zip(blobs, markers, strict=True):
            if m is not None and s not in self.bad_blobs:
                with contextlib.suppress(ValueError):
                    chunks[s] = int(m)
        for n in names:
            s = sha[n]
            if s in chunks:
                continue  # dedup: another entry (or file) stored these bytes already
            chunk = self.config.chunk
            with open(entry.files[n], "rb") as f:
                # An empty file has no chunks; its marker alone says it is stored.
                for i, data in enumerate(iter(functools.partial(f.read, chunk), b"")):
                    self._cmd("set chunk", "SET", f"{self._chunk_k}{s}:{i}", data)
                    if progress is not None:
                        progress(len(data))
            self._cmd("set marker", "SET", self._blob_k + s, chunk)
            self.bad_blobs.discard(s)
            chunks[s] = chunk
        rec = make_record(entry.manifest, sha, {s: chunks[s] for s in blobs}, self.trust)
        self._call("set record", lambda r: r.set(self.key_of(digest), rec.to_bytes()))
        logger.debug("uploaded %s (%d files)", digest, len(names))
        return True

    def delete(self, digest: str) -> bool:
        """Remove the record; its blobs go with the next :meth:`sweep`."""
        self._refuse_ro()
        return bool(self._call("del", lambda r: r.delete(self.key_of(digest))))

    def sweep(self) -> int:
        """Delete blobs and chunks no record references (killed uploads, purged entries).

        A blob uploaded by a concurrent writer whose record is not yet written looks
        unreferenced too: run it when nobody publishes (it is ``cachectl remote purge``).
        """
        self._refuse_ro()
        used: set[str] = set()
        for rec in self.records():
            used.update(rec.sha256.values())
        pattern_keys = self._scan(self._chunk_k)
        marker_keys = self._scan(self._blob_k)
        doomed = [k for k in marker_keys if k[len(self._blob_k):] not in used]
        # Markers first: a blob without its marker is re-uploaded whole, never half-trusted.
        doomed += [k for k in pattern_keys
                   if k[len(self._chunk_k):].rsplit(":", 1)[0] not in used]
        for i in range(0, len(doomed), 500):
            part = doomed[i:i + 500]
            self._cmd("del blobs", "DEL", *part)
        return len(doomed)

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                with contextlib.suppress(Exception):
                    self._client.close()
                self._client = None


def env_remote() -> str | None:
    """``$CACHECOMPILE_REMOTE``, or None."""
    return os.environ.get("CACHECOMPILE_REMOTE") or None
