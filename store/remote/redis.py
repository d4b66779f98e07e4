"""The Redis tier: a :class:`~cachecompile.store.remote.base.Remote` over Redis keys.

Layout under a key prefix (default ``cachecompile:v1``)::

    <p>:entry:<digest>        the record (cachecompile.store.signing): manifest, SHA-256s, signature
    <p>:blob:<sha256>         blob marker, value = its chunk size; written after the chunks
    <p>:chunk:<sha256>:<i>    the i-th chunk of a file's bytes (at most 64 MiB each)
    <p>:pin:<sha256>          "an upload needs this blob"; expires ``lease`` s after its
                              last refresh

The upload and download flow is the shared one (:mod:`.base`). Here: the record is
written only if it is still what the uploader looked at (compare-and-set in Lua); a
killed upload leaves only unreferenced chunks, which ``cachectl remote purge`` sweeps
once their pins have expired. The sweep deletes a blob only where no pin is (atomically,
in a Lua script), so it cannot take the chunks of an upload in flight, nor a blob that an
upload has just decided to reuse. ``redis`` is imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import errors
from ..fsutil import write_new_file
from ..outcomes import Entry
from ..signing import Trust
from .base import BlobRemote, RemoteConfig, call_with_deadline, refuse_readonly, register
from .received import Received

logger = logging.getLogger(__name__)

__all__ = ["RedisRemote"]

# Write the record only if it is still what the uploader judged ('' = there was none).
_SET_IF = """
local cur = redis.call('GET', KEYS[1])
if cur == false then cur = '' end
if cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
# Delete one blob (KEYS[2..]: marker and chunks) unless an upload pinned it (KEYS[1]).
_DROP_UNPINNED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local n = 0
for i = 2, #KEYS do n = n + redis.call('DEL', KEYS[i]) end
return n
"""


@register
class RedisRemote(BlobRemote):
    """One Redis remote: the half of :class:`~cachecompile.store.remote.base.BlobRemote`
    that differs by server, over Redis keys."""

    kind = "redis"
    schemes = ("redis", "rediss", "unix")
    default_timeout = 5.0  # seconds per socket operation (a command: RedisRemote.deadline)
    default_prefix = "cachecompile:v1"

    @classmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        # redis-py gets the URL without credentials or our parameters, and keeps its own
        # (db, ssl_cert_reqs...). By hand: urlunsplit drops the "//" of an empty host
        # (unix:///run/redis.sock would become unix:/run/redis.sock, which redis-py refuses).
        passed = urllib.parse.urlencode(rest)
        target = (f"{parts.scheme}://{parts.netloc}{parts.path}"
                  + (f"?{passed}" if passed else ""))
        return target, ours.get("prefix", cls.default_prefix)

    @classmethod
    def display_of(cls, target: str, prefix: str) -> str:
        p = urllib.parse.urlsplit(target)
        host = p.hostname or ""
        netloc = f"{host}:{p.port}" if p.port else host
        return urllib.parse.urlunsplit(p._replace(netloc=netloc, query=""))

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None,
                 client: Any = None) -> None:
        super().__init__(config, trust)
        self._client = client
        self._made_here = client is None  # a client we were given is the giver's to keep
        self._client_lock = threading.Lock()
        p = self.config.prefix
        self._entry_k = f"{p}:entry:"
        self._blob_k = f"{p}:blob:"
        self._chunk_k = f"{p}:chunk:"
        self._pin_k = f"{p}:pin:"

    # -- plumbing ----------------------------------------------------------------------
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                # No retries inside redis-py: our breaker decides when to try again, so a
                # dead remote costs one connect timeout per backoff period, not per call.
                # The credentials go apart from the URL (which holds none): a password
                # may hold characters a URL cannot (docs/remote.md).
                creds = {k: v for k, v in (("username", self.config.username),
                                           ("password", self.config.password)) if v}
                self._client = redis.Redis.from_url(
                    self.config.target, **creds, socket_timeout=self.config.timeout,
                    socket_connect_timeout=min(self.config.timeout, 2.0),
                    retry=Retry(NoBackoff(), 0), health_check_interval=0)
            return self._client

    def reset_client(self) -> None:
        # redis-py's pool would notice the new pid itself; the lock would not (another
        # thread may have held it at the fork). The parent's client is dropped, not closed:
        # redis-py shuts a socket down only in the process that opened it.
        self._client_lock = threading.Lock()
        if self._made_here:
            self._client = None

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        self.guard(what)
        try:
            import redis
        except ImportError as e:  # the extra is missing: as good as unreachable
            self.breaker.failed(e)
            raise errors.RemoteError(f"the redis client library is not installed: {e}") from e
        try:
            # The whole command within a deadline: the socket timeout bounds each read,
            # and a server trickling its answer would hold the lookup as long as it liked.
            out = call_with_deadline(lambda: fn(self.client()), self.deadline,
                                     f"{self.config.display}: {what}")
        except errors.RemoteError as e:  # no whole answer within the deadline
            self.breaker.failed(e)
            raise
        except (redis.RedisError, OSError, ValueError) as e:
            # ValueError: redis-py refusing the URL's settings (the URL holds no password).
            self.breaker.failed(e)
            raise errors.RemoteError(f"remote cache {self.config.display}: {what} failed: "
                                     f"{type(e).__name__}: {e}") from e
        self.breaker.ok()
        return out

    @property
    def deadline(self) -> float:
        """How long one command may take: two stalls, and a chunk at 2 MiB/s."""
        return 2 * self.config.timeout + 1.0 + self.config.chunk / (2 * 1024**2)

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

    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        raw = self._cmd("get record", "GET", self.key_of(digest))
        # The tag is the record itself: _SET_IF compares values.
        return None if raw is None else (bytes(raw), bytes(raw))

    def fetch_blob(self, digest: str, name: str, sha: str, size: int, chunk: int,
                   target: Path, mode: int,
                   progress: Callable[[int], None] | None) -> tuple[int, str]:
        """Stream chunks into ``target``; (bytes written, SHA-256 hex)."""
        keys = self._chunk_keys(sha, size, chunk)

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
            for k, data in fetched():
                if data is None:
                    # Evicted (maxmemory policy) or purged under us: a partial entry.
                    raise errors.CorruptEntryError(digest, f"chunk {k} of {name!r} is gone")
                yield data

        got = Received(progress)
        write_new_file(target, got.passing(chunks()), mode)
        return got.result

    def raw_records(self, *, batch: int = 500) -> Iterator[tuple[str, bytes | None]]:
        keys = self._scan(self._entry_k)
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            for k, raw in zip(part, self._cmd("mget", "MGET", *part), strict=True):
                yield k[len(self._entry_k):], None if raw is None else bytes(raw)

    def info(self) -> dict[str, Any]:
        raw = self._call("info", lambda r: r.info("memory"))
        return {"used_memory": int(raw.get("used_memory", 0)),
                "maxmemory": int(raw.get("maxmemory", 0)),
                "maxmemory_policy": str(raw.get("maxmemory_policy", ""))}

    # -- writes --------------------------------------------------------------------------
    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        # Never blind: the script compares and sets (replace_refused is always "").
        judged = tag if isinstance(tag, bytes) else b""
        return bool(self._cmd("set record", "EVAL", _SET_IF, 1, self.key_of(digest),
                              judged, data))

    def put_blobs(self, entry: Entry, sha: dict[str, str],
                  progress: Callable[[int], None] | None) -> dict[str, int]:
        """Pins, chunks, then each blob's marker (what says the blob is whole)."""
        blobs = sorted(set(sha.values()))
        # Pinned before we look for them: a purge then either deleted a blob before this
        # (we see no marker and upload it whole) or leaves it alone.
        pinned = self._pin(blobs)
        markers = self._cmd("mget", "MGET", *[self._blob_k + s for s in blobs]) if blobs else []
        chunks: dict[str, int] = {}
        for s, m in zip(blobs, markers, strict=True):
            if m is not None and s not in self.bad_blobs:
                with contextlib.suppress(ValueError):
                    chunks[s] = int(m)
        for n in sorted(sha):
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
                    if time.monotonic() - pinned > self.config.lease / 4:
                        pinned = self._pin(blobs)
            self._cmd("set marker", "SET", self._blob_k + s, chunk)
            self.bad_blobs.discard(s)
            chunks[s] = chunk
        return chunks

    def _pin(self, blobs: list[str]) -> float:
        """(Re)pin ``blobs`` for ``lease`` seconds; the time it was done."""
        now = time.monotonic()
        if not blobs:
            return now
        ttl = max(1, math.ceil(self.config.lease))

        def pin(r: Any) -> None:
            pipe = r.pipeline(transaction=False)
            for s in blobs:
                pipe.set(self._pin_k + s, b"1", ex=ttl)
            pipe.execute()

        self._call("pin blobs", pin)
        return now

    def delete(self, digest: str) -> bool:
        refuse_readonly(self.config)
        return bool(self._call("del", lambda r: r.delete(self.key_of(digest))))

    def sweep(self, *, batch: int = 200) -> int:  # noqa: C901 (today's exception: records, blobs, chunks and pins in one pass)
        """Delete blobs and chunks that no record references and no upload has pinned.

        The number of keys deleted. Safe while others upload: an upload pins its blobs
        before it writes or reuses them and the pin outlives its record by more than
        ``lease / 2``; each blob is deleted in one script that checks its pin, and only
        within ``lease / 2`` of starting to read the records (a record written after
        that start is covered by its pin). A sweep that runs longer stops, and says so.
        """
        refuse_readonly(self.config)
        chunk_keys = self._scan(self._chunk_k)
        marker_keys = self._scan(self._blob_k)
        deadline = time.monotonic() + self.config.lease / 2
        used: set[str] = set()
        for rec in self.records():
            used.update(rec.sha256.values())
        doomed: dict[str, list[str]] = {}
        for k in marker_keys:
            if (s := k[len(self._blob_k):]) not in used:
                doomed.setdefault(s, []).append(k)
        for k in chunk_keys:
            if (s := k[len(self._chunk_k):].rsplit(":", 1)[0]) not in used:
                doomed.setdefault(s, []).append(k)
        todo = sorted(doomed)
        deleted = pinned = 0
        for i in range(0, len(todo), batch):
            if time.monotonic() > deadline:
                logger.warning("remote sweep stopped after %.0f s, with %d unreferenced blobs "
                               "left: run it again", self.config.lease / 2, len(todo) - i)
                break
            part = todo[i:i + batch]

            def drop(r: Any, part: list[str] = part) -> list[int]:
                pipe = r.pipeline(transaction=False)
                for s in part:
                    pipe.eval(_DROP_UNPINNED, 1 + len(doomed[s]), self._pin_k + s, *doomed[s])
                return list(pipe.execute())

            for n in self._call("sweep blobs", drop):
                if int(n) < 0:
                    pinned += 1
                else:
                    deleted += int(n)
        if pinned:
            logger.info("remote sweep kept %d unreferenced blobs that uploads have pinned",
                        pinned)
        return deleted

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                with contextlib.suppress(Exception):
                    self._client.close()
                self._client = None

