"""The shared-filesystem tier: a :class:`~cachecompile.store.remote.base.Remote` over a
directory that several nodes mount (NFS, FSx, CephFS, a Kubernetes PVC).

``CACHECOMPILE_REMOTE=file:///mnt/shared/cc``. The directory must exist (an unmounted
share must not turn into a cache on the node's own disk); the layout under it is made on
the first write::

    <root>/v1/entry/<dd>/<digest>    the record (cachecompile.store.signing), published last
    <root>/v1/blob/<ss>/<sha256>     one file's bytes, written once, never changed
    <root>/v1/pin/<ss>/<sha256>      "an upload needs this blob"; its mtime is the lease
    <root>/v1/tmp/<name>             writes in flight (and blobs a sweep is judging)

The protocol needs no lock and no database on the shared side, only what NFS makes
atomic across clients: ``link`` (create-only) and ``rename``, on one filesystem. Every
file is written whole under ``tmp/``, fsynced, then linked into place: a blob or a record
appears whole or not at all (NFS's close-to-open consistency: a reader that opens it
after the link sees every byte), and a reader never opens anything under ``tmp/``, so a
writer killed midway leaves only a temp file, which the sweep removes after ``lease``.

* **Blobs are write-once**: linked in with create-only semantics; ``EEXIST`` means another
  node stored the same bytes (they are addressed by SHA-256), so the upload drops its copy.
* **A record is created** by the same create-only link (``EEXIST``: another node published
  it first; judge again). **It is replaced** by a compare-and-set built from one atomic
  rename: the uploader renames the record it judged away under ``tmp/`` (of several nodes
  doing so at once exactly one wins; the others get ``ENOENT`` and judge again), checks
  that what it took is byte for byte what it judged (else puts it back), then links its
  own record in, create-only. For that instant the record is absent: a reader misses.
* **Purge** deletes records, then the blobs no record references whose pin is older than
  ``lease`` (judged by the file server's clock, read from a file's mtime, not the node's;
  an upload drops its pins when it ends, so only a crashed one's wait for the lease).
  A blob is first renamed away under ``tmp/``, its pin read again, and linked back if an
  upload pinned it meanwhile: an upload pins before it looks for a blob, so a blob it
  decided to reuse is never lost (it also checks its blobs once more after writing the
  record, as the S3 tier does).

Trust is the other tiers' (signed records, every file's SHA-256) plus the filesystem's
own: the root and every directory and file under it must be owned by this user (or root)
and writable by no one else, or, for a team root (setgid, group-writable, never
world-writable, as ``cachectl init --shared`` makes a local one), by members of its group;
no symlink is followed below the root (every file is opened ``O_NOFOLLOW``, every
directory checked with ``lstat``); every name is checked before it becomes a path.

A hung mount (a hard NFS mount whose server is gone) must not hang a serving process:
each call that reads metadata or a record gives up after ``timeout`` seconds (default 10)
and trips the breaker, as a dead Redis or S3 server does; the call goes on in a daemon
thread. Blob copies are bounded by no deadline (a big file on a slow share takes long).

Fork: nothing here holds a connection, a lock or a thread between calls, so a forked child
uses the tier as it is (the checked-directory cache stays true in the child): the base
class's :meth:`~cachecompile.store.remote.base.BlobRemote.reset_client` has nothing to
forget here.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import errors
from ..fsutil import owner_problem, temp_name, write_new_file
from ..keys import is_digest
from ..outcomes import Entry
from ..signing import Trust
from .base import BlobRemote, RemoteConfig, call_with_deadline, refuse_readonly, register
from .received import Received

logger = logging.getLogger(__name__)

__all__ = ["FileRemote"]

_LAYOUT = "v1"
_KINDS = ("entry", "blob", "pin", "tmp")
_SHA = re.compile(r"[0-9a-f]{64}")
# A record is small; a bigger file where one should be is not read into memory.
_MAX_RECORD = 64 * 1024**2
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# An operation that did not happen yet, or a file a purge took while it was read (NFS
# answers a read of a file unlinked on another client with ESTALE).
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE})


class _Gone(Exception):
    """The file is not there, told apart from a failure of the tier."""


@register
class FileRemote(BlobRemote):
    """One shared directory: the half of :class:`~cachecompile.store.remote.base.BlobRemote`
    that differs by server, over files (see the module docstring)."""

    kind = "file"
    schemes = ("file",)
    default_timeout = 10.0  # seconds a metadata call or record read may take (a hung mount)
    default_prefix = _LAYOUT
    credentials_elsewhere = ("a file:// tier has no password: the filesystem's ownership "
                             "and modes are its access control")

    @classmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        if credentials:
            raise ValueError("file:///path takes no user or password")
        if rest:
            raise ValueError(f"unknown parameters {sorted(k for k, _ in rest)} (file:// "
                             "takes mode, chunk, timeout, backoff and lease)")
        if parts.netloc not in ("", "localhost"):
            raise ValueError("file:// takes an absolute path on this node: file:///mnt/shared/cc "
                             "(three slashes; a host name has no place here)")
        if "prefix" in ours:
            raise ValueError("on file:// the directory is the URL's path")
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/") or "\0" in path:
            raise ValueError("file:// takes an absolute path: file:///mnt/shared/cc")
        if any(p in (".", "..") for p in path.split("/")):
            raise ValueError("the path of a file:// tier may not hold '.' or '..'")
        return os.path.normpath(path), _LAYOUT

    @classmethod
    def display_of(cls, target: str, prefix: str) -> str:
        return f"file://{target}"

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None) -> None:
        super().__init__(config, trust)
        self.root = Path(self.config.target)
        self.base = self.root / _LAYOUT
        # Directories checked (owner, mode, not a link) in this process: each is checked
        # once, and its parent's check keeps others from swapping it afterwards.
        self._good_dirs: set[Path] = set()
        self._shared: bool | None = None
        self._group: int | None = None
        self._held = threading.local()  # the blobs this thread's upload pinned

    # -- plumbing ----------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], Any], *, bounded: bool = True) -> Any:
        """``fn()``: a missing file raises :class:`_Gone`; an unsafe path, a missing root
        or any other OSError trips the breaker and is a RemoteError (one warning)."""
        self.guard(what)
        try:
            out = (call_with_deadline(fn, self.config.timeout, f"{self.config.display}: {what}")
                   if bounded else fn())
        except _Gone:
            self.breaker.ok()
            raise
        except (errors.UntrustedEntryError, errors.CorruptEntryError):
            self.breaker.ok()  # one entry's fault: the tier works
            raise
        except errors.RemoteError as e:
            self.breaker.failed(e)
            raise
        except errors.InsecureStoreError as e:
            err = errors.RemoteError(f"remote cache {self.config.display}: {what} refused: "
                                     f"{e.path}: {e.problem}")
            self.breaker.failed(err)
            raise err from None
        except OSError as e:
            if e.errno in _GONE_ERRNOS:
                self.breaker.ok()
                raise _Gone(what) from None
            err = errors.RemoteError(f"remote cache {self.config.display}: {what} failed: "
                                     f"{type(e).__name__}: {e.strerror or e}")
            self.breaker.failed(err)
            raise err from None
        self.breaker.ok()
        return out

    def _team(self) -> tuple[bool, int | None]:
        """(whether the root is a team root, its group): read once per process."""
        if self._shared is None:
            from .. import made_shared  # the package's rule for a team store's root

            st = os.stat(self.root)
            self._shared = made_shared(self.root)
            self._group = st.st_gid if self._shared else None
        return self._shared, self._group

    def _check_root(self) -> None:
        if self.root in self._good_dirs:
            return
        try:
            st = os.stat(self.root)  # the operator's own path: links in it are theirs
        except FileNotFoundError:
            raise errors.RemoteError(
                f"remote cache {self.config.display}: the directory does not exist (mount "
                "the shared filesystem, or create the directory: the tier never makes its "
                "root, so that an unmounted share is not filled on this node's disk)") from None
        if not stat.S_ISDIR(st.st_mode):
            raise errors.RemoteError(f"remote cache {self.config.display}: not a directory")
        shared, group = self._team()
        problem = owner_problem(st, shared, group)
        if problem:
            raise errors.InsecureStoreError(self.root, problem)
        self._good_dirs.add(self.root)

    def _check_dir(self, path: Path) -> None:
        """Raise InsecureStoreError unless ``path`` (under the root) is a real directory
        that only this user (or the team) may write; _Gone if it is not there."""
        if path in self._good_dirs:
            return
        if path.parent != self.root:
            self._check_dir(path.parent)
        else:
            self._check_root()
        st = os.lstat(path)  # FileNotFoundError: _Gone
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise errors.InsecureStoreError(path, "a symlink" if stat.S_ISLNK(st.st_mode)
                                            else "not a directory", "remove it")
        problem = owner_problem(st, *self._team())
        if problem:
            raise errors.InsecureStoreError(path, problem)
        self._good_dirs.add(path)

    def _dir_of(self, kind: str, name: str = "") -> Path:
        return self.base / kind / name[:2] if name else self.base / kind

    def _path(self, kind: str, name: str) -> Path:
        if not (is_digest(name) if kind == "entry" else bool(_SHA.fullmatch(name))):
            raise errors.CorruptEntryError(name[:80], f"{name[:80]!r} is not a valid {kind} name")
        return self._dir_of(kind, name) / name

    def _mkdirs(self, path: Path) -> None:
        """Make ``path`` and its parents under the root (checked as they are)."""
        if path in self._good_dirs:
            return
        if path.parent != self.root:
            self._mkdirs(path.parent)
        else:
            self._check_root()
        shared, _ = self._team()
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o2770 if shared else 0o700)
            os.chmod(path, 0o2770 if shared else 0o700)  # whatever the umask
        self._check_dir(path)

    def _file_mode(self) -> int:
        return 0o640 if self._team()[0] else 0o600

    def _open(self, path: Path) -> int:
        """A descriptor of the regular file ``path``, checked (no link followed, owner)."""
        self._check_dir(path.parent)
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise errors.InsecureStoreError(path, "a symlink", "remove it") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise errors.InsecureStoreError(path, "not a regular file", "remove it")
            problem = owner_problem(st, *self._team())
            if problem:
                raise errors.InsecureStoreError(path, problem)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _read(self, path: Path) -> bytes:
        fd = self._open(path)
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_RECORD + 1)
        if len(data) > _MAX_RECORD:
            raise errors.InsecureStoreError(path, f"over {_MAX_RECORD} bytes: no record",
                                            "remove it")
        return data

    def _temp(self, kind: str) -> Path:
        self._mkdirs(self._dir_of("tmp"))
        return self._dir_of("tmp") / temp_name(kind)

    def _write_temp(self, kind: str, chunks: Iterator[bytes] | list[bytes]) -> Path:
        tmp = self._temp(kind)
        write_new_file(tmp, chunks, self._file_mode())
        return tmp

    def _link_new(self, src: Path, dst: Path) -> bool:
        """Link ``src`` at ``dst`` if nothing is there (True), else False. An ``EEXIST``
        that is our own link (an NFS reply lost and the call retried) counts as done."""
        self._mkdirs(dst.parent)
        try:
            os.link(src, dst, follow_symlinks=False)
            return True
        except FileExistsError:
            with contextlib.suppress(OSError):
                if os.lstat(dst).st_ino == os.lstat(src).st_ino:
                    return True
            return False

    # -- reads ---------------------------------------------------------------------------
    def ping(self) -> bool:
        self._call("check the directory", self._check_root)
        return True

    def contains(self, digest: str) -> bool:
        try:
            return bool(self._call("stat record", lambda: self._open_close(
                self._path("entry", digest))))
        except _Gone:
            return False

    def _open_close(self, path: Path) -> bool:
        os.close(self._open(path))
        return True

    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        path = self._path("entry", digest)
        try:
            raw = bytes(self._call("read record", lambda: self._read(path)))
        except _Gone:
            return None
        return raw, raw  # the tag is the record itself: the swap compares bytes

    def fetch_blob(self, digest: str, name: str, sha: str, size: int, chunk: int,
                   target: Path, mode: int,
                   progress: Callable[[int], None] | None) -> tuple[int, str]:
        path = self._path("blob", sha)
        try:
            fd = int(self._call("open blob", lambda: self._open(path)))
        except _Gone:
            raise errors.CorruptEntryError(digest, f"the blob of {name!r} is gone") from None
        got = Received(progress)
        with os.fdopen(fd, "rb") as f:
            def chunks() -> Iterator[bytes]:
                while True:
                    try:
                        data = f.read(self.config.chunk)
                    except OSError as e:
                        if e.errno in _GONE_ERRNOS:  # purged on another node as we read
                            raise errors.CorruptEntryError(
                                digest, f"the blob of {name!r} went while it was read") from None
                        # The share failed: the tier's fault (the breaker), not the entry's.
                        err = errors.RemoteError(f"remote cache {self.config.display}: read "
                                                 f"blob failed: {e.strerror or e}")
                        self.breaker.failed(err)
                        raise err from None
                    if not data:
                        return
                    yield data

            # An OSError from here on is the write into our own staging dir: the caller's.
            write_new_file(target, got.passing(chunks()), mode)
        return got.result

    def _record_names(self) -> list[str]:
        names: list[str] = []
        top = self._dir_of("entry")
        try:
            self._check_dir(top)
        except FileNotFoundError:
            return []
        for sub in sorted(os.listdir(top)):
            d = top / sub
            if len(sub) != 2:
                continue
            try:
                self._check_dir(d)
                names += [n for n in os.listdir(d) if is_digest(n) and n[:2] == sub]
            except FileNotFoundError:
                continue
        return sorted(names)

    def raw_records(self) -> Iterator[tuple[str, bytes | None]]:
        for digest in list(self._call("list records", self._record_names)):
            got = self.read_record(digest)
            yield digest, None if got is None else got[0]

    def info(self) -> dict[str, Any]:
        def walk() -> dict[str, Any]:
            objects = stored = 0
            for kind in ("entry", "blob"):
                top = self._dir_of(kind)
                try:
                    self._check_dir(top)
                except FileNotFoundError:
                    continue
                for dirpath, _dirs, files in os.walk(top):  # walk never follows links
                    for n in files:
                        with contextlib.suppress(FileNotFoundError):
                            stored += os.lstat(os.path.join(dirpath, n)).st_size
                            objects += 1
            return {"objects": objects, "stored_bytes": stored}

        return dict(self._call("measure", walk, bounded=False))

    # -- writes --------------------------------------------------------------------------
    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        path = self._path("entry", digest)

        def create() -> bool:
            tmp = self._write_temp("record", [data])
            try:
                return self._link_new(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

        def swap() -> bool:
            # Take the judged record away (one atomic rename: one node wins), check it is
            # what we judged, then link ours in where nothing is.
            new = self._write_temp("record", [data])
            taken = self._temp("claim")
            try:
                try:
                    os.rename(path, taken)
                except FileNotFoundError:
                    return False  # another node took it, or purged it: judge again
                with contextlib.suppress(OSError):
                    os.chmod(taken, self._file_mode())
                if _read_plain(taken) != tag:
                    self._link_new(taken, path)  # not ours to replace: put it back
                    return False
                return self._link_new(new, path)
            finally:
                for p in (new, taken):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)

        return bool(self._call("write record", create if tag is None else swap))

    def put_blobs(self, entry: Entry, sha: dict[str, str],
                  progress: Callable[[int], None] | None) -> dict[str, int]:
        blobs = sorted(set(sha.values()))
        # Pinned before we look for them: a sweep that took one puts it back.
        pinned = self._pin(blobs)
        self._held.blobs = blobs
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
        try:
            fd = int(self._call("stat blob", lambda: self._open(self._path("blob", sha))))
        except _Gone:
            return None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def put_blob(self, src: Path, sha: str,
                 progress: Callable[[int], None] | None = None) -> int:
        path = self._path("blob", sha)

        def put() -> int:
            h = hashlib.sha256()
            size = 0

            def chunks() -> Iterator[bytes]:
                nonlocal size
                with open(src, "rb") as f:
                    for data in iter(functools.partial(f.read, self.config.chunk), b""):
                        h.update(data)
                        size += len(data)
                        if progress is not None:
                            progress(len(data))
                        yield data

            tmp = self._write_temp("blob", chunks())
            try:
                if h.hexdigest() != sha:  # the local file changed under us: store nothing
                    raise errors.CorruptEntryError(sha[:12], f"{src} changed while it was sent")
                if not self._link_new(tmp, path) and (  # EEXIST: another node's, kept
                        sha in self.bad_blobs or os.lstat(path).st_size != size):
                    os.replace(tmp, path)  # unless damaged: the right bytes over it
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return size

        size = int(self._call("put blob", put, bounded=False))
        self.bad_blobs.discard(sha)
        return max(size, 1)

    def _pin(self, blobs: list[str]) -> float:
        """(Re)pin ``blobs``: their pin files' mtime is now, by the file server's clock."""
        now = time.monotonic()

        def pin() -> None:
            for s in blobs:
                path = self._path("pin", s)
                self._mkdirs(path.parent)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, self._file_mode())
                try:
                    os.utime(fd)  # NFS: SETATTR to the server's time
                finally:
                    os.close(fd)

        if blobs:
            self._call("pin blobs", pin)
        return now

    def release_pins(self) -> None:
        """Unpin what this thread's upload pinned: a purge of a full share frees those
        blobs now, not a lease later. Another upload's pin of the same blob goes too; its
        recheck_blobs stores the blob again should a purge take it meanwhile."""
        for s in getattr(self._held, "blobs", ()):
            with contextlib.suppress(OSError, errors.StoreError):
                os.unlink(self._path("pin", s))
        self._held.blobs = ()

    def delete(self, digest: str) -> bool:
        refuse_readonly(self.config)
        path = self._path("entry", digest)

        def unlink() -> bool:
            self._check_dir(path.parent)
            os.unlink(path)
            return True

        try:
            return bool(self._call("delete record", unlink))
        except _Gone:
            return False

    def _server_now(self) -> float:
        """The file server's clock: the mtime of a file made now (nodes' clocks drift)."""
        tmp = self._write_temp("clock", [b""])
        try:
            return os.lstat(tmp).st_mtime
        finally:
            os.unlink(tmp)

    def sweep(self) -> int:
        """Delete blobs no record references, unless pinned within ``lease``; then pins
        and temp files older than ``lease``. Stops after ``lease / 2``."""
        refuse_readonly(self.config)
        return int(self._call("sweep", self._sweep, bounded=False))

    def _sweep(self) -> int:  # noqa: C901 (today's exception: records, blobs and pins in one pass)
        try:
            self._check_root()
            self._check_dir(self.base)
        except FileNotFoundError:
            return 0  # nothing was ever written
        t0 = time.monotonic()
        deadline = t0 + self.config.lease / 2
        # The server's clock, read once: an older reading only makes pins look fresher.
        now0 = self._server_now()

        def fresh(sha: str) -> bool:
            try:
                mtime = os.lstat(self._dir_of("pin", sha) / sha).st_mtime
            except FileNotFoundError:
                return False
            return now0 + (time.monotonic() - t0) - mtime < self.config.lease

        stored = self._names("blob")
        used = self.referenced_blobs()
        todo = sorted(s for s in stored if s not in used)
        deleted = kept = 0
        for i, s in enumerate(todo):
            if time.monotonic() > deadline:
                logger.warning("remote sweep stopped after %.0f s, with %d unreferenced blobs "
                               "left: run it again", self.config.lease / 2, len(todo) - i)
                break
            if fresh(s):
                kept += 1
                continue
            path = self._path("blob", s)
            doomed = self._temp("doomed")
            try:
                os.rename(path, doomed)
            except FileNotFoundError:
                continue
            # An upload may have pinned it and decided to reuse it since: then it stays.
            if fresh(s):
                self._link_new(doomed, path)
                kept += 1
            else:
                deleted += 1
            os.unlink(doomed)
        now = now0 + (time.monotonic() - t0)
        for kind in ("pin", "tmp"):
            for p in self._files(kind):
                with contextlib.suppress(FileNotFoundError):
                    if now - os.lstat(p).st_mtime >= self.config.lease:
                        os.unlink(p)
        if kept:
            logger.info("remote sweep kept %d unreferenced blobs that uploads have pinned", kept)
        return deleted

    def _names(self, kind: str) -> list[str]:
        return [p.name for p in self._files(kind) if _SHA.fullmatch(p.name)]

    def _files(self, kind: str) -> list[Path]:
        """The files under ``v1/<kind>/`` (one level of fan-out below it for all but tmp)."""
        top = self._dir_of(kind)
        try:
            self._check_dir(top)
        except FileNotFoundError:
            return []
        out: list[Path] = []
        for e in os.scandir(top):
            if kind == "tmp":
                if e.is_file(follow_symlinks=False):
                    out.append(Path(e.path))
                continue
            if len(e.name) != 2:
                continue
            try:
                self._check_dir(Path(e.path))
            except FileNotFoundError:
                continue
            out += [Path(f.path) for f in os.scandir(e.path) if f.is_file(follow_symlinks=False)]
        return out

    def close(self) -> None:
        return None


def _read_plain(path: Path) -> bytes:
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | _NOFOLLOW)) as f:
        return f.read(_MAX_RECORD + 1)

