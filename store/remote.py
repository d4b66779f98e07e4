"""A Redis tier: entries as signed records plus content-addressed, chunked blobs.

Layout under a key prefix (default ``cachecompile:v1``)::

    <p>:entry:<digest>        the record (cachecompile.store.signing): manifest, SHA-256s, signature
    <p>:blob:<sha256>         blob marker, value = its chunk size; written after the chunks
    <p>:chunk:<sha256>:<i>    the i-th chunk of a file's bytes (at most 64 MiB each)
    <p>:pin:<sha256>          "an upload needs this blob"; expires ``lease`` s after its
                              last refresh

Blobs are addressed by SHA-256, so identical files are stored once across entries and
a planted blob cannot pass for another. An upload pins its blobs, writes the chunks,
then the blob markers, then the record: a record is the last thing written, so an entry
is visible whole or not at all; a killed upload leaves only unreferenced chunks, which
``cachectl remote purge`` sweeps once their pins have expired. The sweep deletes a blob
only where no pin is (atomically, in a Lua script), so it cannot take the chunks of an
upload in flight, nor a blob that an upload has just decided to reuse.

A record is written only if it is still what the uploader looked at (compare-and-set
in Lua), and never over a record the uploader cannot vouch for: see :meth:`upload`.

Failures degrade: a connection error, a timeout, OOM or a partial read trips a breaker
that logs ONE warning, makes every remote call a quick :class:`RemoteError` (the process
goes on local-only) and lets one call through again after a backoff (1 s, doubling, at
most 60 s). ``redis`` is imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import stat
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import errors
from .config import parse_size
from .fsutil import write_new_file
from .outcomes import Entry
from .signing import Record, Trust, make_record, parse_record, sha256_file

logger = logging.getLogger(__name__)

__all__ = ["MAX_CHUNK", "RecordState", "RemoteConfig", "RedisRemote", "Uploaded"]

MAX_CHUNK = 64 * 1024**2  # Redis caps a value at 512 MB; big values stall the server
# 4 MiB: redis-py's reply parser copies big values; 4 MiB GETs ran 600 MB/s on loopback,
# 16 MiB ones 440 (tools/bench_remote.py), and smaller ones add round trips.
DEFAULT_CHUNK = 4 * 1024**2
_OURS = ("mode", "chunk", "timeout", "backoff", "prefix", "lease")
# How long an upload's pins keep ``purge`` off its blobs after their last refresh. A
# killed upload's chunks are swept this long after it died, not before.
DEFAULT_LEASE = 600.0
_CAS_TRIES = 5  # records rewritten under us this often in a row: give up this upload

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

# What a remote record is, as this node sees it: "ours" verifies under our signing key;
# "trusted" under one of our other verify keys (an old key, while it is rotated out);
# "foreign" is signed but not verifiable here (another key, tampered, or we have none).
RecordState = Literal["absent", "malformed", "unsigned", "ours", "trusted", "foreign"]


@dataclass(frozen=True)
class Uploaded:
    """What :meth:`RedisRemote.upload` did: true if it wrote the record.

    ``found`` is the record that was there before: the one replaced, or the one kept.
    """

    written: bool
    found: RecordState

    def __bool__(self) -> bool:
        return self.written


def redact(url: str) -> str:
    """``url`` with its password masked, however malformed the rest of it is."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    creds, at, host = netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = creds.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}{slash}{tail}"


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote is and how to use it, parsed from a ``redis://`` URL.

    Our own query parameters are taken out before the URL reaches redis-py:
    ``mode=ro`` (consume, never publish), ``chunk=4M``, ``timeout=5`` (seconds per socket
    operation), ``backoff=1`` (first retry delay), ``prefix=cachecompile:v1``,
    ``lease=600`` (seconds an upload's pins hold off ``purge``).
    """

    url: str
    redis_url: str
    readonly: bool = False
    chunk: int = DEFAULT_CHUNK
    timeout: float = 5.0
    backoff: float = 1.0
    max_backoff: float = 60.0
    prefix: str = "cachecompile:v1"
    lease: float = DEFAULT_LEASE
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> RemoteConfig:
        """Parse a remote URL; RemoteConfigError (a ValueError) names what is wrong, with
        the password masked (``redis://:***@host``): it ends up in logs and terminals."""
        try:
            return cls._parse(url)
        except errors.RemoteConfigError:
            raise
        except (ValueError, TypeError) as e:
            why = str(e)
            password = urllib.parse.urlsplit(url).password if "@" in url else None
            if password:
                why = why.replace(password, "***")
            raise errors.RemoteConfigError(
                f"remote {redact(url)} (CACHECOMPILE_REMOTE or --remote): {why}") from None

    @classmethod
    def _parse(cls, url: str) -> RemoteConfig:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("only redis://, rediss:// and unix:// URLs are supported")
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
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
            raise ValueError(f"mode must be rw or ro, not {mode!r}")
        chunk = parse_size(ours["chunk"]) if "chunk" in ours else DEFAULT_CHUNK
        if not 0 < chunk <= MAX_CHUNK:
            raise ValueError("chunk must be between 1 byte and 64M")
        lease = float(ours.get("lease", DEFAULT_LEASE))
        if not lease >= 1:
            raise ValueError("lease must be at least 1 second")
        redis_url = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(rest)))
        return cls(url=url, redis_url=redis_url, readonly=mode == "ro", chunk=chunk,
                   timeout=float(ours.get("timeout", 5.0)),
                   backoff=float(ours.get("backoff", 1.0)),
                   prefix=ours.get("prefix", "cachecompile:v1"), lease=lease)

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
    """One Redis remote. Every method raises :class:`~cachecompile.store.errors.RemoteError` on failure."""

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
        self._pin_k = f"{p}:pin:"

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
                                               0o700 if name in rec.executable else 0o600,
                                               progress)
            except errors.CorruptEntryError:
                self.bad_blobs.add(sha)
                raise
            if got != size or actual != sha:
                self.bad_blobs.add(sha)
                raise errors.CorruptEntryError(digest, f"file {name!r} fails its SHA-256 "
                                                       f"({got} of {size} bytes)")
        return rec

    def _fetch_file(self, digest: str, name: str, keys: list[str], target: Path, mode: int,
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

        write_new_file(target, chunks(), mode)
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

    def state(self, digest: str, raw: bytes | None) -> RecordState:
        """What the record ``raw`` of ``digest`` is to this node (see :data:`RecordState`)."""
        if raw is None:
            return "absent"
        try:
            rec = parse_record(raw, digest)
            body, sig = rec.body, rec.sig
        except errors.ManifestError:
            # Not a record this version reads (garbage, or a newer format): signed is
            # still signed, and only a key that verifies it may replace it.
            body, sig = _lenient_signed(raw, digest)
            if not sig:
                return "malformed"
        if not sig:
            return "unsigned"
        if self.trust.signed_by_us(body, sig):
            return "ours"
        return "trusted" if self.trust.verifies(body, sig) else "foreign"

    def may_replace(self, found: RecordState, *, overwrite: bool, repair: bool,
                    resign: bool = False) -> bool:
        """Whether our upload may take the place of a record in state ``found``.

        The record is what every node loads, so a node that cannot vouch for a signed
        record never replaces it: without a key ours would be unsigned, and keyed nodes
        refuse that fleet-wide; with another key we cannot tell whose key is the wrong
        one, unless the caller says ours is right (``repair``: ``cachectl push``).
        """
        if found in ("absent", "malformed"):
            return True  # nobody can load it: anything well-formed is better
        if found == "ours":
            return overwrite  # same signer: only to replace damaged blobs, or --force
        if found == "trusted":
            # Signed with a key being rotated out: every node that loads it now may also
            # load ours; re-signing it with the current key is what ``push --resign`` asks.
            return resign or overwrite
        if self.trust.key is None:
            return found == "unsigned" and overwrite
        if found == "unsigned":
            return True  # signing it only adds trust: keyed nodes refuse it as it is
        return repair

    def upload(self, entry: Entry, *, overwrite: bool = False, repair: bool = False,
               resign: bool = False,
               progress: Callable[[int], None] | None = None) -> Uploaded:
        """Publish a local entry unless the remote record should stay (:meth:`may_replace`).

        Order is the atomicity: pins, chunks, then each blob's marker, then the record,
        and that only if the record is still the one judged at the start.
        """
        self._refuse_ro()
        digest = entry.key
        raw = self._raw_record(digest)
        found = self.state(digest, raw)
        if not self.may_replace(found, overwrite=overwrite, repair=repair, resign=resign):
            self._kept(digest, found)
            return Uploaded(False, found)
        names = sorted(entry.manifest["files"])
        sha = {n: sha256_file(entry.files[n]) for n in names}
        executable = [n for n in names if os.stat(entry.files[n]).st_mode & stat.S_IXUSR]
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
                    if time.monotonic() - pinned > self.config.lease / 4:
                        pinned = self._pin(blobs)
            self._cmd("set marker", "SET", self._blob_k + s, chunk)
            self.bad_blobs.discard(s)
            chunks[s] = chunk
        rec = make_record(entry.manifest, sha, {s: chunks[s] for s in blobs}, self.trust,
                          executable)
        data = rec.to_bytes()
        for _ in range(_CAS_TRIES):
            if self._cmd("set record", "EVAL", _SET_IF, 1, self.key_of(digest),
                         raw or b"", data):
                logger.debug("uploaded %s (%d files, replacing: %s)", digest, len(names), found)
                return Uploaded(True, found)
            # Another node wrote the record since we looked: judge what is there now.
            raw = self._raw_record(digest)
            found = self.state(digest, raw)
            if not self.may_replace(found, overwrite=overwrite, repair=repair,
                                    resign=resign):
                self._kept(digest, found)
                return Uploaded(False, found)
        raise errors.RemoteError(f"remote cache {self.config.display}: the record of {digest} "
                                 f"changed {_CAS_TRIES} times while we wrote it")

    def _raw_record(self, digest: str) -> bytes | None:
        raw = self._cmd("get record", "GET", self.key_of(digest))
        return None if raw is None else bytes(raw)

    def _kept(self, digest: str, found: RecordState) -> None:
        if found == "foreign":
            logger.info("not replacing remote entry %s: it is signed, and not with %s", digest,
                        "our key" if self.trust.key else "a key we have")
        else:
            logger.debug("remote has %s already (%s)", digest, found)

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
        """Remove the record; its blobs go with the next :meth:`sweep`."""
        self._refuse_ro()
        return bool(self._call("del", lambda r: r.delete(self.key_of(digest))))

    def sweep(self, *, batch: int = 200) -> int:
        """Delete blobs and chunks that no record references and no upload has pinned.

        The number of keys deleted. Safe while others upload: an upload pins its blobs
        before it writes or reuses them and the pin outlives its record by more than
        ``lease / 2``; each blob is deleted in one script that checks its pin, and only
        within ``lease / 2`` of starting to read the records (a record written after
        that start is covered by its pin). A sweep that runs longer stops, and says so.
        """
        self._refuse_ro()
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


def _lenient_signed(raw: bytes, digest: str) -> tuple[bytes, str | None]:
    """(body, signature) of a record we cannot parse, if it has that much shape.

    A body that names another key is no signed record of ``digest`` (a copy moved here).
    """
    try:
        outer = json.loads(raw)
        body, sig = outer["body"], outer["sig"]
        doc = json.loads(body)
    except (ValueError, KeyError, TypeError):
        return b"", None
    if (not isinstance(sig, str) or not sig or not isinstance(doc, dict)
            or doc.get("key") != digest):
        return b"", None
    return body.encode("utf-8"), sig


def env_remote() -> str | None:
    """``$CACHECOMPILE_REMOTE``, or None."""
    return os.environ.get("CACHECOMPILE_REMOTE") or None
