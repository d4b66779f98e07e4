"""The object-store tier: a :class:`~cachecompile.store.remote.base.Remote` over an
S3-compatible bucket (AWS S3, MinIO, Ceph RGW, GCS's S3 API, R2).

``CACHECOMPILE_REMOTE=s3://bucket/prefix``; the endpoint, keys and region come from the
usual variables (``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3``, a plain ``http://``
endpoint allowed; ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``;
``AWS_REGION`` / ``AWS_DEFAULT_REGION``). Layout under the prefix::

    <p>/v1/entry/<digest>    the record (cachecompile.store.signing), written last
    <p>/v1/blob/<sha256>     one file's bytes, one object (multipart above ``chunk``)
    <p>/v1/pin/<sha256>      "an upload needs this blob"; its Last-Modified is the lease

Why one object per blob: an object appears whole or not at all (a multipart upload
only at its completion), so no marker is needed, and S3 has no value-size cap to chunk
around. The record is written with a conditional put: ``If-None-Match: *`` where there
was none, ``If-Match: <ETag>`` where the uploader judged one, so two uploaders never
replace each other's record unjudged (412 -> judge again).

Servers differ, so neither is taken on trust. Before its first record write a process
probes the bucket, once: a probe object, then ``If-None-Match: *`` and ``If-Match: <a
stale ETag>`` over it must both give 412, then the probe is deleted. A server that
accepts them (s3rver, some gateways) gets one warning, and uploads there only create
records, never replace one: every safety that rests on compare-and-set would be off.
The bucket check that names a missing bucket is a GET of an object that is not there
(NoSuchKey or NoSuchBucket), so a node needs no ListBucket, and a server that fails big
LISTs only fails the verbs that list (``cachectl remote ls``, ``purge``, ``pull``).

Purge: a blob goes when no record references it and its pin is older than ``lease``
(read just before the delete). S3 has no atomic check-and-delete, so an upload that pins
and decides to reuse a blob in the instant between that read and the delete could lose
it; the uploader checks its blobs again after writing the record and stores any that
went, and a download that finds one missing is a miss that the next upload repairs.

Client: obstore (Rust's object_store; an optional extra, ``pip install
'cachecompile[s3]'``): conditional puts by ETag, streamed multipart uploads and
streamed downloads are built in, its import costs ~5 ms against boto3's ~150 ms, and
it moves 80 MB at several hundred MB/s from Python (tools/bench_remote.py). It retries
a failed request twice, quickly; beyond that the breaker decides when to try again.

Forks: obstore runs every request on one tokio runtime per loaded copy of its native
module, made on first use, and documents that runtime as not fork-safe. A forked child
inherits it without its threads and with its epoll instance *shared* with the parent: a
request there never completes (no thread drives its I/O), and the socket it registers
on the shared epoll hands the parent's runtime events for memory the parent does not
have (the parent's SIGSEGV). So a process forked from one that had obstore loaded never
calls that copy, nor drops a client made with it (:func:`_native`,
:meth:`S3Remote.reset_client`): it loads a private copy of the native module (its own
runtime, its own epoll) from an in-memory file, since the dynamic loader hands back a
library it has loaded already, by inode, whatever its path. ~0.1 s and ~15 MB once per
forked process that uses the tier.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from .. import errors
from ..fsutil import write_new_file
from ..outcomes import Entry
from ..signing import Trust
from .base import BlobRemote, RemoteConfig, call_with_deadline, refuse_readonly, register
from .received import Received

logger = logging.getLogger(__name__)

__all__ = ["S3Remote"]

EXTRA = "pip install 'cachecompile[s3]'"
_LAYOUT = "v1"
# Two quick retries of a 5xx or a dropped connection, as the AWS SDKs do: object stores
# answer 500/503 now and then under load. A dead endpoint still fails within ~0.2 s
# (refused connections), and the breaker then decides when to try again.
# A whole request's limit: a big file on a slow link may take long; a stall may not.
_TRANSFER_LIMIT_S = 1800
_RETRY: Any = {"max_retries": 2,
               "backoff": {"init_backoff": timedelta(milliseconds=50),
                           "max_backoff": timedelta(milliseconds=400), "base": 2}}


# Per process, per endpoint and bucket: "" where the server honours conditional puts,
# else what it did instead. Probed once; the warning is said once with it.
_CAS: dict[tuple[str, str], str] = {}
_CAS_LOCK = threading.Lock()
# A GET of this (never written) says whether the bucket exists, without a LIST.
_CHECK_KEY = f"{_LAYOUT}/bucket-check"

# obstore's native module as this process calls it (see the module docstring, "Forks").
_NATIVE = "obstore._obstore"
_native_lock = threading.Lock()
_native_mod: Any = None
_native_pid = 0
# obstore was loaded in the process this one was forked from: never call that copy here.
_inherited = False
# Clients a forked child inherited, kept from the garbage collector: dropping one would
# run obstore's destructors on the parent's runtime in this process.
_INHERITED: list[Any] = []


def _after_fork_in_child() -> None:
    global _CAS_LOCK, _native_lock, _native_mod, _inherited
    # Locks another thread may have held at the fork: nothing would release them here.
    _CAS_LOCK = threading.Lock()
    _native_lock = threading.Lock()
    _inherited = _inherited or _native_mod is not None or _NATIVE in sys.modules
    if _native_mod is not None:
        _INHERITED.append(_native_mod)
    _native_mod = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _native() -> Any:
    """obstore's native module for this process: the one ``import obstore`` loads, or,
    in a process forked from one that had it loaded, a private copy (ImportError if the
    extra is missing, OSError if no copy can be loaded). A pid check backs the fork hook."""
    global _native_mod, _native_pid, _inherited
    with _native_lock:
        pid = os.getpid()
        if _native_mod is not None and _native_pid == pid:
            return _native_mod
        if _native_mod is not None:  # forked without Python's hooks
            _INHERITED.append(_native_mod)
            _inherited = True
        if _inherited:
            mod = _private_copy()
        else:
            import obstore._obstore as mod
        _native_mod, _native_pid = mod, pid
        return mod


def _private_copy() -> Any:
    """A copy of obstore's native module of this process's own (its own runtime): the
    library copied into an in-memory file (a file in the temp dir where there is no
    memfd) and loaded from there."""
    spec = importlib.util.find_spec(_NATIVE)
    if spec is None or not spec.origin:
        raise ImportError(f"{_NATIVE} is not installed")
    memfd = getattr(os, "memfd_create", None)
    path: str
    if memfd is not None and os.path.isdir("/proc/self/fd"):
        fd = memfd("cachecompile-obstore")
        path = f"/proc/self/fd/{fd}"
        temp = None
    else:
        fd, temp = tempfile.mkstemp(prefix="cachecompile-obstore-", suffix=".so")
        path = temp
    try:
        with open(spec.origin, "rb") as src, os.fdopen(os.dup(fd), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        loader = importlib.machinery.ExtensionFileLoader(_NATIVE, path)
        copy = importlib.util.spec_from_file_location(_NATIVE, path, loader=loader)
        assert copy is not None
        mod = importlib.util.module_from_spec(copy)
        loader.exec_module(mod)
    finally:
        os.close(fd)  # the loader keeps its own mapping
        if temp is not None:
            os.unlink(temp)
    logger.debug("loaded a private copy of obstore's native module in forked process %d",
                 os.getpid())
    return mod


class _Gone(Exception):
    """The object is not there (HTTP 404), told apart from a failure of the remote."""


@register
class S3Remote(BlobRemote):
    """One bucket and prefix: the half of :class:`~cachecompile.store.remote.base.BlobRemote`
    that differs by server, over S3 objects."""

    kind = "s3"
    schemes = ("s3",)
    default_timeout = 5.0  # seconds of a stall (no byte for that long)
    default_prefix = "cachecompile"
    credentials_elsewhere = "the S3 tier takes its keys from the AWS_* variables"

    @classmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        if credentials:
            raise ValueError("s3://bucket/prefix takes no user or password (the keys "
                             "come from the AWS_* variables; an '@' in the prefix is "
                             "written %40)")
        if rest:
            raise ValueError(f"unknown parameters {sorted(k for k, _ in rest)} (the "
                             "endpoint, keys and region come from the AWS_* variables)")
        if len(parts.hostname or "") < 3 or parts.port:
            raise ValueError("s3:// takes a bucket name (3 characters or more) and an "
                             "optional prefix: s3://bucket/prefix")
        if "prefix" in ours:
            raise ValueError("on s3:// the prefix is the URL's path: s3://bucket/prefix")
        return parts.hostname or "", parts.path.strip("/") or cls.default_prefix

    @classmethod
    def display_of(cls, target: str, prefix: str) -> str:
        return f"s3://{target}/{prefix}"

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None) -> None:
        super().__init__(config, trust)
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._checked = False
        # The wall clock a pin's age is judged by (against the server's Last-Modified): a
        # test advances it past the lease instead of sleeping through it.
        self.clock: Callable[[], float] = time.time

    # -- plumbing ----------------------------------------------------------------------
    @staticmethod
    def _endpoint() -> str:
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""

    def reset_client(self) -> None:
        # The inherited client is kept, not dropped (see _INHERITED); the next call makes
        # one with this process's own copy of obstore (_native).
        self._store_lock = threading.Lock()
        if self._store is not None:
            _INHERITED.append(self._store)
        self._store = None

    def client(self) -> Any:
        with self._store_lock:
            if self._store is None:
                S3Store = _native()._store.S3Store  # obstore's own class, not its Python subclass

                endpoint = self._endpoint()
                t = self.config.timeout
                # ``timeout`` bounds a stall (no byte for that long: read_timeout), not a
                # whole transfer, which may take minutes for a big file on a slow link.
                options: Any = {"read_timeout": f"{t}s", "connect_timeout": f"{min(t, 2.0)}s",
                                "timeout": f"{_TRANSFER_LIMIT_S}s"}
                if endpoint.startswith("http://"):
                    options["allow_http"] = True  # a MinIO or a test server on loopback
                extra: dict[str, Any] = {"endpoint": endpoint} if endpoint else {}
                retry: Any = {**_RETRY, "retry_timeout": timedelta(seconds=t)}
                self._store = S3Store(self.config.target, prefix=self.config.prefix,
                                      client_options=options, retry_config=retry, **extra)
            return self._store

    def _call(self, what: str, fn: Callable[[Any, Any], Any], *,
              bounded: bool = True) -> Any:
        """``fn(obstore, store)``: a missing object raises :class:`_Gone`; any other
        failure trips the breaker and is a RemoteError. obstore is imported here, so a
        missing extra is one clear failure like any other.

        ``bounded``: give up after :meth:`deadline` even if the client has not (a server,
        or the credentials' metadata service, that accepts and never answers): the caller
        goes on local-only and the request finishes, or not, in the background."""
        self.guard(what)
        try:
            ob = _native()
        except ImportError as e:  # the extra is missing: as good as unreachable
            missing = errors.RemoteError(f"the S3 tier needs obstore ({e}): {EXTRA}")
            self.breaker.failed(missing)
            raise missing from e
        except OSError as e:  # a forked process could not load a copy of its own
            err = errors.RemoteError(f"remote cache {self.config.display}: this forked "
                                     f"process cannot load a copy of obstore of its own ({e})")
            self.breaker.failed(err)
            raise err from e
        ox = ob.exceptions
        try:
            if not self._checked:
                # Once per process: a missing bucket is named, not read as "every entry
                # absent" (a GET's 404 does not say which is missing).
                self._run(lambda: self._check_bucket(ob), bounded)
                self._checked = True
            out = self._run(lambda: fn(ob, self.client()), bounded)
        except errors.RemoteError as e:
            self.breaker.failed(e)
            raise
        except FileNotFoundError as e:  # obstore's NotFound: the object, or the bucket
            if "NoSuchBucket" in str(e):
                raise self._no_bucket(e) from None
            self.breaker.ok()
            raise _Gone(what) from None
        except (ox.BaseError, OSError, ValueError) as e:
            if "NoSuchBucket" in str(e):
                raise self._no_bucket(e) from None
            err = errors.RemoteError(f"{what} failed: {type(e).__name__}: {_brief(e)}")
            self.breaker.failed(err)  # its one warning says what _brief makes of it
            raise errors.RemoteError(f"remote cache {self.config.display}: {err}") from None
        self.breaker.ok()
        return out

    @property
    def deadline(self) -> float:
        """How long a bounded call may take: the stall timeout, once retried."""
        return 2 * self.config.timeout + 1.0

    def _run(self, fn: Callable[[], Any], bounded: bool) -> Any:
        if not bounded:
            return fn()
        return call_with_deadline(
            fn, self.deadline, self.config.display,
            "the endpoint, or the credentials' metadata service when no AWS keys are set, "
            "accepts and does not answer")

    def _check_bucket(self, ob: Any) -> None:
        """Raise obstore's NotFound (NoSuchBucket) if the bucket is missing. A GET of an
        object that is not there: a LIST would need ListBucket, and some servers fail a
        LIST of a big prefix while their GETs work."""
        try:
            ob.get(self.client(), _CHECK_KEY)
        except FileNotFoundError as e:
            if "NoSuchBucket" in str(e):
                raise
        except ob.exceptions.PermissionDeniedError:
            # AWS answers a node without ListBucket 403 for a missing object; a missing
            # bucket is 404 NoSuchBucket to everyone. Reads are judged by their own calls.
            pass

    def _no_bucket(self, e: BaseException) -> errors.RemoteError:
        err = errors.RemoteError(f"remote cache {self.config.display}: the bucket "
                                 f"{self.config.target!r} does not exist (create it, or fix "
                                 "CACHECOMPILE_REMOTE)")
        self.breaker.failed(err)
        return err

    def _key(self, kind: str, name: str) -> str:
        return f"{_LAYOUT}/{kind}/{name}"

    def _get(self, what: str, key: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of a small object, or None if it is not there."""

        def get(ob: Any, s: Any) -> tuple[bytes, str]:
            r = ob.get(s, key)
            return bytes(r.bytes()), str(r.meta.get("e_tag") or "")

        try:
            return tuple(self._call(what, get))
        except _Gone:
            return None

    def _head(self, what: str, key: str) -> dict[str, Any] | None:
        try:
            return dict(self._call(what, lambda ob, s: ob.head(s, key)))
        except _Gone:
            return None

    def _list(self, kind: str = "") -> list[Any]:
        """Every object's meta under ``v1/<kind>/`` (everything under ``v1/`` without one)."""
        prefix = f"{_LAYOUT}/{kind}/" if kind else f"{_LAYOUT}/"

        def ls(ob: Any, s: Any) -> list[Any]:
            return [m for batch in ob.list(s, prefix) for m in batch]

        return list(self._call(f"list {kind or 'object'}s", ls))

    def _delete(self, what: str, key: str) -> None:
        try:
            self._call(what, lambda ob, s: ob.delete(s, key))
        except _Gone:
            pass

    # -- reads ---------------------------------------------------------------------------
    def ping(self) -> bool:
        self._call("check bucket", lambda ob, _s: self._check_bucket(ob))
        return True

    def replace_refused(self) -> str:
        why = self._conditional_puts()
        return (f"the server does not honour conditional puts ({why}), so a record on it "
                "is never replaced") if why else ""

    def _conditional_puts(self) -> str:
        """"" if the server refuses a conditional put that does not hold (412), else what
        it did: probed once per process, endpoint and bucket (one PUT, two conditional
        PUTs, one DELETE), and warned about once. A RemoteError if the probe could not
        run (it is tried again next time)."""
        at = (self._endpoint(), self.config.target)
        with _CAS_LOCK:
            if at in _CAS:
                return _CAS[at]
            why = str(self._call("probe conditional puts", _probe))
            _CAS[at] = why
        if why:
            logger.warning(
                "remote cache %s: the server does not honour conditional puts (%s). Uploads "
                "to it only create records and never replace one (a stale, unsigned or "
                "re-signed record stays until it is deleted; a malformed one, until a keyed "
                "`cachectl push` or `cachectl remote purge --malformed`), and two nodes "
                "uploading the same new entry at once may each write it, the last one "
                "staying. Use a server that answers 412 to If-None-Match and If-Match "
                "(docs/remote.md)", self.config.display, why)
        return why

    def contains(self, digest: str) -> bool:
        return self._head("head record", self._key("entry", digest)) is not None

    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        return self._get("get record", self._key("entry", digest))

    def fetch_blob(self, digest: str, name: str, sha: str, size: int, chunk: int,
                   target: Path, mode: int,
                   progress: Callable[[int], None] | None) -> tuple[int, str]:
        key = self._key("blob", sha)
        try:
            result = self._call("get blob", lambda ob, s: ob.get(s, key))
        except _Gone:
            raise errors.CorruptEntryError(digest, f"the blob of {name!r} is gone") from None

        def chunks() -> Iterator[bytes]:
            stream = iter(result.stream(min_chunk_size=self.config.chunk))
            while True:
                # The body arrives as we iterate: a dropped connection fails here.
                part = self._call("read blob", lambda _ob, _s: next(stream, None))
                if part is None:
                    return
                yield memoryview(part)  # type: ignore[misc]

        got = Received(progress)
        write_new_file(target, got.passing(chunks()), mode)
        return got.result

    def raw_records(self) -> Iterator[tuple[str, bytes | None]]:
        metas = self._list("entry")
        names = [str(m["path"]).rsplit("/", 1)[-1] for m in metas]
        # A few GETs in flight: one round trip per record otherwise. A window at a time,
        # so that a reader that stops early (build --check's explanation) stops the GETs.
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="cc-s3") as pool:
            for i in range(0, len(names), 256):
                part = names[i:i + 256]
                got = pool.map(lambda d: self._get("get record", self._key("entry", d)),
                               part)
                for digest, one in zip(part, got, strict=True):
                    yield digest, None if one is None else one[0]

    def info(self) -> dict[str, Any]:
        objs = self._list()
        return {"objects": len(objs), "stored_bytes": sum(int(m["size"]) for m in objs)}

    # -- writes --------------------------------------------------------------------------
    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        mode: Any = "create" if tag is None else {"e_tag": str(tag)}
        key = self._key("entry", digest)
        if self._conditional_puts():
            # The put below would be blind. Over a record only where the caller proved it
            # malformed and it is still that very object (its ETag) when read just now;
            # a create only where a HEAD just found none. Both narrow a race they cannot
            # close (docs/remote.md). Otherwise judge again: the upload then keeps it.
            if tag is not None:
                if not (blind and tag):
                    return False
                now = self._head("head record", key)
                if now is None or str(now.get("e_tag") or "") != str(tag):
                    return False
                mode = "overwrite"
            elif self._head("head record", key) is not None:
                return False

        def put(ob: Any, s: Any) -> bool:
            try:
                ob.put(s, key, data, mode=mode)
            except (ob.exceptions.AlreadyExistsError, ob.exceptions.PreconditionError):
                return False  # another node wrote it since we judged: 412
            return True

        try:
            return bool(self._call("put record", put))
        except _Gone:
            # If-Match on a record purged meanwhile: judge again (it is now absent).
            return False

    def put_blobs(self, entry: Entry, sha: dict[str, str],
                  progress: Callable[[int], None] | None) -> dict[str, int]:
        blobs = sorted(set(sha.values()))
        # Pinned before we look for them: a purge reads the pin just before deleting.
        pinned = self._pin(blobs)
        chunks: dict[str, int] = {}
        sizes = {sha[n]: os.path.getsize(entry.files[n]) for n in sha}
        for s in blobs:
            size = self.stored_whole(s, sizes[s])
            if size is not None:
                chunks[s] = max(size, 1)  # dedup: stored already, whole
        for n in sorted(sha):
            s = sha[n]
            if s in chunks:
                continue
            if time.monotonic() - pinned > self.config.lease / 4:
                pinned = self._pin(blobs)
            chunks[s] = self.put_blob(entry.files[n], s, progress)
        return chunks

    sizes_blobs = True

    def stored_size(self, sha: str) -> int | None:
        meta = self._head("head blob", self._key("blob", sha))
        return None if meta is None else int(meta["size"])

    def put_blob(self, path: Path, sha: str,
                 progress: Callable[[int], None] | None = None) -> int:
        size = os.path.getsize(path)
        key = self._key("blob", sha)
        chunk = max(self.config.chunk, 5 * 1024**2)  # S3's smallest multipart part

        def put(ob: Any, s: Any) -> None:
            with open(path, "rb") as f:
                if size <= chunk:
                    ob.put(s, key, f.read(), use_multipart=False)
                else:
                    def parts() -> Iterator[bytes]:
                        for data in iter(functools.partial(f.read, chunk), b""):
                            if progress is not None:
                                progress(len(data))
                            yield data

                    ob.put(s, key, parts(), chunk_size=chunk, max_concurrency=4)

        self._call("put blob", put, bounded=False)  # a whole file: bounded by stalls only
        if size <= chunk and progress is not None:
            progress(size)
        self.bad_blobs.discard(sha)
        return max(size, 1)

    def _pin(self, blobs: list[str]) -> float:
        """(Re)pin ``blobs``: their pin objects' Last-Modified is now."""

        now = time.monotonic()
        for s in blobs:
            key = self._key("pin", s)

            def pin(ob: Any, st: Any, key: str = key) -> None:
                ob.put(st, key, b"")

            self._call("pin blob", pin)
        return now

    def delete(self, digest: str) -> bool:
        refuse_readonly(self.config)
        key = self._key("entry", digest)
        if self._head("head record", key) is None:
            return False
        self._delete("delete record", key)
        return True

    def sweep(self) -> int:
        """Delete blobs no record references, unless pinned within ``lease`` (the pin is
        read again just before each delete); then pins older than ``lease``. Stops after
        ``lease / 2`` (a record written after the records were read is covered by its
        upload's pin only that long)."""
        refuse_readonly(self.config)
        blob_names = [str(m["path"]).rsplit("/", 1)[-1] for m in self._list("blob")]
        deadline = time.monotonic() + self.config.lease / 2
        used: set[str] = set()
        for rec in self.records():
            used.update(rec.sha256.values())
        todo = sorted(s for s in blob_names if s not in used)
        deleted = pinned = 0
        for i, s in enumerate(todo):
            if time.monotonic() > deadline:
                logger.warning("remote sweep stopped after %.0f s, with %d unreferenced blobs "
                               "left: run it again", self.config.lease / 2, len(todo) - i)
                break
            if self._fresh_pin(s):
                pinned += 1
                continue
            self._delete("delete blob", self._key("blob", s))
            deleted += 1
        # Stale pins; and probe objects a writer without s3:DeleteObject left behind.
        for kind in ("pin", "probe"):
            for m in self._list(kind):
                if self.clock() - m["last_modified"].timestamp() >= self.config.lease:
                    self._delete(f"delete {kind}", str(m["path"]))  # under our prefix
        if pinned:
            logger.info("remote sweep kept %d unreferenced blobs that uploads have pinned",
                        pinned)
        return deleted

    def _fresh_pin(self, sha: str) -> bool:
        meta = self._head("head pin", self._key("pin", sha))
        if meta is None:
            return False
        return bool(self.clock() - meta["last_modified"].timestamp() < self.config.lease)

    def close(self) -> None:
        with self._store_lock:
            self._store = None


def _probe(ob: Any, s: Any) -> str:
    """Whether the server refuses both conditional puts that do not hold: "" if so, else
    what it did. The probe object has its own random name and is deleted after."""
    key = f"{_LAYOUT}/probe/{uuid.uuid4().hex}"
    refused = (ob.exceptions.AlreadyExistsError, ob.exceptions.PreconditionError)
    ob.put(s, key, b"probe")
    try:
        try:
            ob.put(s, key, b"create", mode="create")
            return "If-None-Match: * over an existing object was accepted, not refused with 412"
        except refused:
            pass
        try:
            # An ETag the probe object cannot have (a single-part PUT's ETag is its MD5).
            ob.put(s, key, b"replace", mode={"e_tag": '"0123456789abcdef0123456789abcdef"'})
            return "If-Match with a stale ETag was accepted, not refused with 412"
        except refused:
            return ""
    finally:
        try:
            ob.delete(s, key)
        except (ob.exceptions.BaseError, OSError) as e:  # a writer without DeleteObject
            logger.debug("could not delete the probe object %s: %s", key, _brief(e))


def _brief(exc: BaseException) -> str:
    """An object-store error in a line: its first line without the HTTP body, the S3
    error's code and message, and what a missing credential looks like."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0].split("<?xml")[0].rstrip(" :")[:300]
    code = re.search(r"<Code>(.*?)</Code>", text)
    message = re.search(r"<Message>(.*?)</Message>", text)
    if code:
        line += f" ({code.group(1)}{': ' + message.group(1) if message else ''})"
    if "169.254.169.254" in text or "api/token" in text:
        line += (" (no AWS credentials were found: set AWS_ACCESS_KEY_ID and "
                 "AWS_SECRET_ACCESS_KEY, a profile, or an instance role)")
    return line
