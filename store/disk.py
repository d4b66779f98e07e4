"""The local disk store: content-addressed entries, atomic publish, verification.

Layout under ``<root>/v1/`` (see docs/store.md)::

    entries/<d[:2]>/<digest>/manifest.json    the truth about an entry
    entries/<d[:2]>/<digest>/data/<name>      hard links into blobs/
    blobs/<c[:2]>/<xxh3>[.x]                  one inode per distinct content and mode
    tmp/                                      staging; swept when stale
    quarantine/                               entries that failed verification
    locks/  pins/  index/                     filelocks, leases, diskcache index

No directory below the root is ever followed if it is a symlink (each level is checked
with lstat on the way down): a lookup through one is an ``insecure`` miss, a write
through one raises InsecureStoreError, and ``verify`` reports it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash

from . import errors
from .fsutil import (
    FULL_ERRNOS,
    HOST_TAG,
    fsync_dir,
    hash_file,
    owner_problem,
    parse_temp_name,
    pid_alive,
    rmtree_quiet,
    temp_name,
    unreal_dir,
    write_new_file,
)
from .index import GRAPH_SCOPE, Index
from .keys import Key, is_digest
from .manifest import check_names, dump_manifest, parse_manifest, validate_name
from .outcomes import Entry, EntryInfo, GcReport, Hit, Miss, VerifyReport
from .policy import (
    expand_groups,
    has_labels,
    is_shared_graph,
    lru_evictions,
    physical_size,
    split_pinned,
)
from .policy import older_than as _older_than

logger = logging.getLogger(__name__)

__all__ = ["Store", "Pin", "FORMAT_DIR", "DEFAULT_MAX_SIZE", "TEMP_GRACE_S", "counter_scope"]

FORMAT_DIR = "v1"
DEFAULT_MAX_SIZE = 10 * 1024**3
TEMP_GRACE_S = 3600.0
MANIFEST = "manifest.json"
DATA = "data"
LAYOUT = ("entries", "blobs", "tmp", "quarantine", "locks", "pins", "index")

# Entries verified in full by this process: entry dir -> (manifest signature, manifest).
# Later reads in this process check sizes only (issue 2: "full checksums on the first read").
_VERIFIED: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
# Manifests parsed and checked against their integrity digest by this process (files not
# hashed yet): entry dir -> (manifest signature, manifest). ``manifest()`` and the first
# ``get`` of an entry share it, so a manifest is parsed and digested once per process.
_PARSED: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def _sig(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _forget(edir: Path) -> None:
    _VERIFIED.pop(str(edir), None)
    _PARSED.pop(str(edir), None)


class _Bad(Exception):
    """Internal: an entry failed inspection; becomes a Miss.

    ``link``: a store directory above the entry is not real; the entry is not ours to
    quarantine (moving it would pull in whatever the link points at).
    """

    def __init__(self, kind: str, reason: str, link: tuple[Path, str] | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.link = link


def _link_error(path: Path, what: str) -> errors.InsecureStoreError:
    return errors.InsecureStoreError(path, f"it is {what}, not a real directory",
                                     errors.LINK_HINT)


def _blob_name(cs: str, executable: bool) -> str:
    """The blob file of content ``cs``: executable content has its own, ``<cs>.x``."""
    return f"{cs}.x" if executable else cs


def _blob_map(manifest: Mapping[str, Any]) -> dict[str, int]:
    """Content checksum -> size of an entry's files: what it holds in blobs/."""
    return {str(r["xxh3_128"]): int(r["size"]) for r in manifest["files"].values()}


def counter_scope(key: Key | str, labels: Mapping[str, str] | None = None) -> str:
    """Counter prefix of a lookup: shared graphs are counted apart from the user's entries.

    A hit knows its labels; a miss knows only the key, whose factors say ``kind=graph``
    for shared graphs (cachecompile/coop.py sets the factor and the label together).
    Whoever adjusts a lookup's counters later (cachecompile.store.tiered) asks here too, so that it
    undoes exactly the counter the lookup moved.
    """
    if labels is None:
        labels = {"kind": str(key.factors.get("kind"))} if isinstance(key, Key) else {}
    return GRAPH_SCOPE if is_shared_graph(labels) else ""


class Pin:
    """A lease on an entry: while held, gc never evicts the entry.

    It is an flock'ed file under ``pins/<digest>/``; the lock dies with the process,
    so a crashed holder never pins forever.
    """

    def __init__(self, path: Path, fd: int, digest: str) -> None:
        self.path = path
        self.digest = digest
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            # Only the holder ever locks this file, nobody waits on it: safe to unlink.
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


class Store:
    """A local, content-addressed artifact store. Build it with :func:`cachecompile.store.open_store`."""

    readonly = False

    def __init__(self, root: Path, *, max_size: int = DEFAULT_MAX_SIZE, shared_group: bool = False) -> None:
        self.root = Path(root)
        self.max_size = int(max_size)
        self.shared_group = shared_group
        self.base = self.root / FORMAT_DIR
        self._entries = self.base / "entries"
        self._blobs = self.base / "blobs"
        self._tmp = self.base / "tmp"
        self._quarantine = self.base / "quarantine"
        self._locks = self.base / "locks"
        self._pins_dir = self.base / "pins"
        self.index = Index(self.base / "index", guard=lambda: self._real("index"))
        self._held_pins: list[Pin] = []
        self._warned_links: set[str] = set()
        self._dir_mode = 0o2770 if shared_group else 0o700
        self._file_mode = 0o440 if shared_group else 0o400

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r}, max_size={self.max_size})"

    # -- layout ------------------------------------------------------------------
    def create_layout(self) -> None:
        if not os.path.lexists(self.base):
            self.base.mkdir(mode=self._dir_mode, exist_ok=True)
        found = self._link_on_path()
        if found is not None:
            raise _link_error(*found)
        for name in LAYOUT:
            d = self.base / name
            # lexists: a symlink in its place is left alone (and refused where used).
            if name != "index" and not os.path.lexists(d):
                d.mkdir(mode=self._dir_mode, exist_ok=True)

    def entry_dir(self, digest: str) -> Path:
        return self._entries / digest[:2] / digest

    @staticmethod
    def digest_of(key: Key | str) -> str:
        if isinstance(key, Key):
            return key.digest
        if isinstance(key, str) and is_digest(key):
            return key
        raise ValueError(f"not a key or a 32-hex-digit digest: {key!r}")

    def check_root(self) -> None:
        """Raise InsecureStoreError unless root (and v1/) are trusted.

        The root may be a symlink (where the cache lives is the user's choice); nothing
        below it may be.
        """
        for p in (self.root, self.base):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                if p == self.base:
                    raise _link_error(p, "a symlink")
                st = os.stat(p)
            problem = owner_problem(st, self.shared_group)
            if problem:
                raise errors.InsecureStoreError(p, problem)

    def _link_on_path(self, *parts: str) -> tuple[Path, str] | None:
        """The first directory from v1/ down to ``v1/<parts>`` that is not real, if any."""
        return unreal_dir(self.base, parts)

    def _real(self, *parts: str) -> Path:
        """``v1/<parts>``; InsecureStoreError if a directory on the way is a symlink."""
        found = self._link_on_path(*parts)
        if found is not None:
            raise _link_error(*found)
        return self.base.joinpath(*parts)

    def staging_dir(self, kind: str, tag: str = "", *, mode: int | None = None) -> Path:
        """Create a fresh directory under ``tmp/`` to stage a write in (swept when stale).

        Raises InsecureStoreError if ``v1/`` or ``tmp/`` is not a real directory: what is
        staged is then linked and renamed into the store, and through a link it would be
        written (and later swept) outside it. ``mode`` defaults to the store's dir mode.
        """
        path = self._real("tmp") / temp_name(kind, tag)
        path.mkdir(mode=self._dir_mode if mode is None else mode)
        return path

    def _warn_link(self, path: Path, what: str) -> None:
        """Warn that ``path`` is ``what`` (a symlink...) and is not followed."""
        # Once per path and store: a link above many entries would otherwise warn per lookup.
        if str(path) not in self._warned_links:
            self._warned_links.add(str(path))
            logger.warning("cache directory %s is %s, not a real directory: not following it "
                           "(lookups through it miss, writes are refused)", path, what)

    # -- lookup --------------------------------------------------------------------
    def _inspect(self, digest: str, *, full: bool | None = None) -> Entry:
        """Load and check one entry; raise _Bad. ``full``: None = first read in process."""
        edir = self.entry_dir(digest)
        found = self._link_on_path("entries", digest[:2])
        if found is not None:
            raise _Bad("insecure", f"{found[0]} is {found[1]}, not a real directory",
                       link=found)
        try:
            dst = os.lstat(edir)
        except FileNotFoundError:
            raise _Bad("absent", "no entry for this key") from None
        except PermissionError as e:
            raise _Bad("unreadable", f"cannot stat entry: {e}") from None
        if not stat.S_ISDIR(dst.st_mode):
            raise _Bad("insecure", "entry is not a real directory (symlink?)")
        problem = owner_problem(dst, self.shared_group)
        if problem:
            raise _Bad("insecure", f"entry {problem}")
        mpath = edir / MANIFEST
        try:
            mst = os.lstat(mpath)
        except FileNotFoundError:
            raise _Bad("corrupt", "manifest.json is missing") from None
        except PermissionError as e:
            raise _Bad("unreadable", f"cannot stat manifest: {e}") from None
        if not stat.S_ISREG(mst.st_mode):
            raise _Bad("insecure", "manifest.json is not a regular file")
        key = str(edir)
        msig = _sig(mst)
        cached = _VERIFIED.get(key)
        if cached is not None and cached[0] == msig and not full:
            manifest = cached[1]
            verified = True
        else:
            verified = False
            parsed = _PARSED.get(key)
            if parsed is not None and parsed[0] == msig and not full:
                manifest = parsed[1]  # parsed and digest-checked by manifest() already
            else:
                try:
                    fd = os.open(mpath, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                    with os.fdopen(fd, "rb") as f:
                        msig = _sig(os.fstat(f.fileno()))  # the signature of what is read
                        text = f.read()
                except PermissionError as e:
                    raise _Bad("unreadable", f"cannot read manifest: {e}") from None
                except OSError as e:
                    raise _Bad("corrupt", f"cannot read manifest: {e}") from None
                try:
                    # Checks the integrity digest over the whole manifest (meta included).
                    manifest = parse_manifest(text, expect_key=digest)
                except errors.UnsafePathError as e:
                    raise _Bad("insecure", str(e)) from None
                except errors.ManifestError as e:
                    raise _Bad("corrupt", str(e)) from None
        data = edir / DATA
        # data/ itself too: lstat of data/<name> would follow a symlinked data/.
        try:
            data_mode: int | None = os.lstat(data).st_mode
        except FileNotFoundError:
            data_mode = None
        if data_mode is None:
            if manifest["files"]:
                raise _Bad("corrupt", "data/ is missing")
        elif not stat.S_ISDIR(data_mode):
            what = "a symlink" if stat.S_ISLNK(data_mode) else "not a directory"
            raise _Bad("insecure", f"{data} is {what}, not a real directory")
        files: dict[str, Path] = {}
        checked_dirs: set[str] = set()
        for name, rec in manifest["files"].items():
            p = data / name
            # A symlinked parent directory would lead out of the entry: check each level once.
            parts = name.split("/")
            for i in range(1, len(parts)):
                sub = "/".join(parts[:i])
                if sub not in checked_dirs:
                    try:
                        sst = os.lstat(data / sub)
                    except FileNotFoundError:
                        raise _Bad("corrupt", f"file {name!r} is missing") from None
                    if not stat.S_ISDIR(sst.st_mode):
                        raise _Bad("insecure", f"{sub!r} is not a real directory")
                    checked_dirs.add(sub)
            try:
                fst = os.lstat(p)
            except FileNotFoundError:
                raise _Bad("corrupt", f"file {name!r} is missing") from None
            except PermissionError as e:
                raise _Bad("unreadable", f"cannot stat {name!r}: {e}") from None
            if not stat.S_ISREG(fst.st_mode):
                raise _Bad("insecure", f"file {name!r} is not a regular file (symlink?)")
            problem = owner_problem(fst, self.shared_group)
            if problem:
                raise _Bad("insecure", f"file {name!r}: {problem}")
            if fst.st_size != rec["size"]:
                raise _Bad("corrupt", f"file {name!r} has size {fst.st_size}, manifest says {rec['size']}")
            files[name] = p
        if not verified:
            for name, rec in manifest["files"].items():
                try:
                    _, digest_hex = hash_file(files[name])
                except PermissionError as e:
                    raise _Bad("unreadable", f"cannot read {name!r}: {e}") from None
                except OSError as e:
                    raise _Bad("corrupt", f"cannot read {name!r}: {e}") from None
                if digest_hex != rec["xxh3_128"]:
                    raise _Bad("corrupt", f"file {name!r} fails its checksum")
            _VERIFIED[key] = (msig, manifest)
            _PARSED.pop(key, None)
        return Entry(key=digest, path=edir, files=files, manifest=manifest)

    def peek(self, key: Key | str) -> Hit | Miss:
        """Look up without side effects: no hit recorded, nothing quarantined."""
        digest = self.digest_of(key)
        try:
            return Hit(self._inspect(digest))
        except _Bad as b:
            return Miss(reason=b.reason, kind=b.kind)

    def get(self, key: Key | str) -> Hit | Miss:
        """Look up and verify an entry; record the hit or miss; quarantine a bad entry."""
        digest = self.digest_of(key)
        try:
            entry = self._inspect(digest)
        except _Bad as b:
            if b.link is not None:
                self._warn_link(*b.link)
            elif b.kind in ("corrupt", "insecure"):
                logger.warning("entry %s is %s: %s; quarantining it", digest, b.kind, b.reason)
                self._index_safely("corruptions", lambda: self.index.incr("corruptions"))
                self.quarantine(digest, b.reason)
            self._count_miss(b.kind, counter_scope(key))
            return Miss(reason=b.reason, kind=b.kind)
        counter = counter_scope(key, entry.labels) + "hits"
        self._index_safely(
            "hit",
            lambda: self.index.record_hit(digest, entry.size_bytes, entry.created, entry.labels,
                                          counter=counter, blobs=_blob_map(entry.manifest)),
        )
        return Hit(entry)

    def contains(self, key: Key | str) -> bool:
        digest = self.digest_of(key)
        if self._link_on_path("entries", digest[:2]) is not None:
            return False
        return (self.entry_dir(digest) / MANIFEST).is_file()

    def stat(self, key: Key | str) -> EntryInfo | None:
        """The index record of an entry (built from its manifest if the index lacks it)."""
        digest = self.digest_of(key)
        info = self._index_safely("stat", lambda: self.index.get(digest))
        if info is not None:
            return info
        try:
            m = self._manifest(digest)
        except errors.StoreError:
            return None
        return self._info_from_manifest(digest, m, state="unindexed")

    def manifest(self, key: Key | str) -> dict[str, Any]:
        """The parsed manifest of an entry, without verifying its files.

        Raises KeyNotFound, or ManifestError when the manifest fails its integrity digest
        (this read has no side effects: ``get`` is what quarantines). The manifest is
        parsed and digest-checked once per process and shared: do not modify it.
        """
        return self._manifest(self.digest_of(key), remember=True)

    def _manifest(self, digest: str, *, remember: bool = False) -> dict[str, Any]:
        # Listings (entries, reindex, stat) read every manifest once: they use the
        # per-process cache but do not fill it, so a big cache is not held in memory.
        found = self._link_on_path("entries", digest[:2], digest)
        if found is not None:
            raise _link_error(*found)
        edir = str(self.entry_dir(digest))
        mpath = os.path.join(edir, MANIFEST)
        try:
            sig = _sig(os.lstat(mpath))
            for cache in (_VERIFIED, _PARSED):
                hit = cache.get(edir)
                if hit is not None and hit[0] == sig:
                    return hit[1]
            fd = os.open(mpath, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                sig = _sig(os.fstat(f.fileno()))  # the signature of what is read
                text = f.read()
        except FileNotFoundError:
            raise errors.KeyNotFound(f"no entry {digest}") from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise errors.UnsafePathError(f"{mpath} is a symlink") from None
        m = parse_manifest(text, expect_key=digest)
        if remember:
            _PARSED[edir] = (sig, m)
        return m

    def record_miss(self, kind: str) -> None:
        """Count a miss of the user's (the integration layer's ``stale``, ``unloadable``...)."""
        self._count_miss(kind, "")

    def _count_miss(self, kind: str, scope: str) -> None:
        self._index_safely("miss", lambda: self.index.incr(f"{scope}miss:{kind}"))

    def _index_safely(self, what: str, fn: Any) -> Any:
        # The index is a cache of the manifests: its failure must not fail a lookup.
        try:
            return fn()
        except errors.InsecureStoreError as e:  # index/ is a symlink: say so once
            found = self._link_on_path("index")
            self._warn_link(*(found or (e.path, "unsafe")))
            return None
        except Exception as e:  # sqlite3 errors, timeouts, a full disk
            logger.warning("cache index update (%s) failed: %s", what, e)
            return None

    # -- publish -------------------------------------------------------------------
    def _blob_path(self, cs: str, executable: bool) -> Path:
        # The mode is part of the blob's identity: entries share the blob's inode, and so
        # its mode, so an executable file and a plain one with the same bytes need two.
        # Checked before the blob is looked at: through a symlinked shard, an outside
        # file of the right size would be hard-linked into the entry as "ours".
        return self._real("blobs", cs[:2]) / _blob_name(cs, executable)

    def _store_blob(self, src: bytes | os.PathLike[str] | str,
                    executable: bool) -> tuple[Path, int, str, bool]:
        """Put one content into blobs/ (once); (blob path, size, checksum, newly stored)."""
        # Read-only for everyone who may read: entries are immutable and share inodes.
        mode = self._file_mode | ((self._file_mode >> 2) & 0o111 if executable else 0)
        tmp = self._tmp / temp_name("blob")
        if isinstance(src, (bytes, bytearray, memoryview)):
            data = bytes(src)
            size, cs = len(data), xxhash.xxh3_128_hexdigest(data)
            blob = self._blob_path(cs, executable)
            if self._blob_ok(blob, size, executable):
                return blob, size, cs, False
            write_new_file(tmp, [data], mode)
        else:
            h = xxhash.xxh3_128()
            size = 0

            def chunks() -> Iterator[bytes]:
                nonlocal size
                with open(src, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                        size += len(chunk)
                        yield chunk

            write_new_file(tmp, chunks(), mode)
            cs = h.hexdigest()
            try:
                blob = self._blob_path(cs, executable)
            except errors.InsecureStoreError:
                os.unlink(tmp)
                raise
            if self._blob_ok(blob, size, executable):
                os.unlink(tmp)
                return blob, size, cs, False
        fresh = True
        try:
            blob.parent.mkdir(mode=self._dir_mode, exist_ok=True)
            self._real("blobs", cs[:2])  # a link may have appeared in its place meanwhile
            try:
                os.link(tmp, blob)
            except FileExistsError:
                if self._blob_ok(blob, size, executable):
                    fresh = False  # another writer stored the same content first
                else:
                    # Stores written before the mode was in the name hold plain names
                    # of either mode. Entries keep their links to the old inode; the
                    # name now gives this mode, for this entry and those after it.
                    os.replace(tmp, blob)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return blob, size, cs, fresh

    @staticmethod
    def _blob_ok(blob: Path, size: int, executable: bool) -> bool:
        try:
            st = os.lstat(blob)
        except FileNotFoundError:
            return False
        return (stat.S_ISREG(st.st_mode) and st.st_size == size
                and bool(st.st_mode & stat.S_IXUSR) == executable)

    def _link_in(self, src: bytes | os.PathLike[str] | str, dst: Path,
                 executable: bool) -> tuple[int, str, int]:
        """Link one file into a staging entry; (size, checksum, bytes newly stored)."""
        dst.parent.mkdir(mode=self._dir_mode, parents=True, exist_ok=True)
        for _ in range(3):
            blob, size, cs, fresh = self._store_blob(src, executable)
            try:
                os.link(blob, dst)
                return size, cs, size if fresh else 0
            except FileNotFoundError:
                continue  # gc removed an unreferenced blob between our check and link
            except OSError as e:
                if e.errno != errno.EMLINK:
                    raise
                # Too many links to one inode: give this entry its own copy.
                with open(blob, "rb") as f:
                    write_new_file(dst, iter(lambda: f.read(1 << 20), b""), os.stat(blob).st_mode & 0o777)
                return size, cs, size
        raise errors.StoreError(f"could not link blob into {dst}")

    def put(
        self,
        key: Key,
        files: Mapping[str, bytes | os.PathLike[str] | str],
        *,
        labels: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Entry:
        """Publish ``files`` under ``key`` atomically; if it already exists, return the winner."""
        if not isinstance(key, Key):
            raise TypeError("put() needs a Key from make_key(), so its factors are recorded")
        digest = key.digest
        check_names([validate_name(n) for n in files])
        lab = {str(k): str(v) for k, v in (labels or {}).items()}
        meta_d = json.loads(json.dumps(dict(meta or {})))  # must be JSON; fails early otherwise
        if self.contains(key):
            existing = self.peek(key)
            if isinstance(existing, Hit):
                return existing.entry
            self.get(key)  # records and quarantines the bad entry; we then publish afresh
        try:
            entry = self._publish(key, files, lab, meta_d)
        except OSError as e:
            if e.errno in FULL_ERRNOS:
                raise errors.StoreFullError(f"no space left publishing {digest} in {self.root}: {e}") from e
            raise
        return entry

    def _publish(
        self, key: Key, files: Mapping[str, bytes | os.PathLike[str] | str],
        labels: dict[str, str], meta: dict[str, Any],
    ) -> Entry:
        digest = key.digest
        # Everything below is written through these: none may lead out of the store.
        self._real("blobs")
        self._real("entries")
        staging = self.staging_dir("put", digest)
        new_bytes = 0
        try:
            data = staging / DATA
            data.mkdir(mode=self._dir_mode)
            recs: dict[str, dict[str, Any]] = {}
            for name, src in files.items():
                executable = False
                if not isinstance(src, (bytes, bytearray, memoryview)):
                    executable = bool(os.stat(src).st_mode & stat.S_IXUSR)
                size, cs, fresh = self._link_in(src, data / name, executable)
                new_bytes += fresh
                recs[name] = {"size": size, "xxh3_128": cs}
            created = time.time()
            body = dump_manifest(key=digest, factors=key.factors, labels=labels, meta=meta,
                                 created=created, files=recs)
            write_new_file(staging / MANIFEST, [body], self._file_mode)
            for d in sorted({(data / n).parent for n in recs} | {data, staging}, reverse=True):
                fsync_dir(d)
            target = self.entry_dir(digest)
            target.parent.mkdir(mode=self._dir_mode, exist_ok=True)
            self._real("entries", digest[:2])
            try:
                os.rename(staging, target)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # Lost the race: the other writer's entry is whole; hand it out.
                rmtree_quiet(staging)
                won = self.get(key)
                if isinstance(won, Hit):
                    return won.entry
                raise errors.CorruptEntryError(digest, f"the winning entry is bad: {won.reason}") from None
            fsync_dir(target.parent)
        except BaseException:
            rmtree_quiet(staging)
            raise
        manifest = json.loads(body)
        _VERIFIED[str(target)] = (_sig(os.lstat(target / MANIFEST)), manifest)
        size = sum(r["size"] for r in recs.values())

        def index_it() -> None:
            self.index.add(digest, size, created, labels, blobs=_blob_map(manifest))
            self.index.incr("publishes")
            # Physical: content already in blobs/ (dedup) takes no more room.
            self.index.incr("bytes", new_bytes)

        self._index_safely("publish", index_it)
        entry = Entry(key=digest, path=target, files={n: target / DATA / n for n in recs},
                      manifest=manifest)
        self._maybe_gc()
        return entry

    def _maybe_gc(self) -> None:
        total = self._index_safely("bytes", lambda: self.index.counter("bytes")) or 0
        if total > self.max_size:
            try:
                self.gc(lock_timeout=0.0)
            except errors.LockTimeout:
                pass  # another process is collecting right now
            except OSError as e:
                logger.warning("automatic gc failed: %s", e)

    # -- removal ---------------------------------------------------------------------
    def _take_away(self, digest: str, kind: str) -> Path | None:
        """Atomically move an entry out of entries/ (readers see it whole or absent)."""
        # Renaming through a symlinked shard would pull an outside tree into tmp/ (and
        # then delete it): refuse instead.
        src = self._real("entries", digest[:2]) / digest
        dst = self._real("tmp") / temp_name(kind, digest)
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return None
        _forget(src)
        return dst

    @staticmethod
    def _exclusive_bytes(edir: Path) -> int:
        """Bytes that removing the entry at ``edir`` frees: content no other entry links.

        Each content's inode is linked by its blob and by every entry holding it, so a
        content is this entry's alone when its links, besides this entry's own, are at most
        the blob's one.
        """
        data = edir / DATA
        try:
            if not (stat.S_ISDIR(os.lstat(edir).st_mode) and stat.S_ISDIR(os.lstat(data).st_mode)):
                return 0
        except OSError:
            return 0
        inodes: dict[int, list[int]] = {}  # inode -> [links from this entry, nlink, size]
        for dirpath, _, names in os.walk(data):  # never follows links
            for n in names:
                try:
                    st = os.lstat(os.path.join(dirpath, n))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    rec = inodes.setdefault(st.st_ino, [0, st.st_nlink, st.st_size])
                    rec[0] += 1
        return sum(size for mine, nlink, size in inodes.values() if nlink - mine <= 1)

    def delete(self, key: Key | str) -> bool:
        return self._remove(self.digest_of(key), respect_pins=False, kind="del")

    def _remove(self, digest: str, *, respect_pins: bool, kind: str) -> bool:
        """Take an entry away and delete it; with ``respect_pins``, keep it if pinned."""
        gone = self._take_away(digest, kind)
        if gone is None:
            self._index_safely("delete", lambda: self.index.remove(digest))
            return False
        if respect_pins and digest in self.pinned():
            # Someone pinned it between the caller's check and the rename: put it back.
            try:
                os.rename(gone, self.entry_dir(digest))
                return False
            except OSError:
                pass  # a fresh copy was published meanwhile; ours can go
        freed = self._exclusive_bytes(gone)

        def unindex() -> None:
            self.index.remove(digest)
            self.index.incr("bytes", -freed)

        self._index_safely("delete", unindex)
        # Readers with open files keep them: unlink does not touch open descriptors.
        rmtree_quiet(gone)
        return True

    def quarantine(self, digest: str, reason: str) -> Path | None:
        """Move a bad entry to quarantine/ (never deleted silently); drop its shared blobs."""
        src = self.entry_dir(digest)
        found = self._link_on_path("entries", digest[:2]) or self._link_on_path("quarantine")
        if found is not None:
            # Moving it would pull in (or push out) whatever the link points at.
            self._warn_link(*found)
            return None
        dst = self._quarantine / f"{digest}.{time.time_ns()}"
        freed = self._exclusive_bytes(src)
        try:
            self._quarantine.mkdir(mode=self._dir_mode, exist_ok=True)
            os.rename(src, dst)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("cannot quarantine %s: %s", src, e)
            return None
        _forget(src)
        with contextlib.suppress(OSError):
            (self._quarantine / f"{dst.name}.reason").write_text(reason + "\n")
        # A damaged blob must not be linked into future entries.
        with contextlib.suppress(Exception):
            m = json.loads((dst / MANIFEST).read_bytes())
            for name, rec in m.get("files", {}).items():
                cs = str(rec.get("xxh3_128", ""))
                if len(cs) != 32 or self._link_on_path("blobs", cs[:2]) is not None:
                    continue
                for executable in (False, True):
                    blob = self._blobs / cs[:2] / _blob_name(cs, executable)
                    with contextlib.suppress(OSError):
                        if os.path.samefile(blob, dst / DATA / validate_name(name)):
                            os.unlink(blob)

        def unindex() -> None:
            self.index.remove(digest)
            self.index.incr("bytes", -freed)

        self._index_safely("quarantine", unindex)
        return dst

    # -- listing ---------------------------------------------------------------------
    def digests(self) -> Iterator[str]:
        """Digests of the entries on disk (the truth), unverified; never through a link."""
        return self._digests(warn=True)

    def _digests(self, *, warn: bool) -> Iterator[str]:
        found = self._link_on_path("entries")
        if found is not None:
            if warn:
                self._warn_link(*found)
            return
        try:
            shards = os.scandir(self._entries)
        except FileNotFoundError:
            return
        with shards:
            for shard in shards:
                if len(shard.name) != 2:
                    continue
                if not shard.is_dir(follow_symlinks=False):
                    if warn and shard.is_symlink():
                        self._warn_link(Path(shard.path), "a symlink")
                    continue
                with os.scandir(shard.path) as it:
                    for e in it:
                        if is_digest(e.name) and e.name.startswith(shard.name):
                            yield e.name

    def _info_from_manifest(self, digest: str, m: dict[str, Any], state: str = "ok") -> EntryInfo:
        size = sum(int(r["size"]) for r in m["files"].values())
        return EntryInfo(key=digest, size_bytes=size, created=float(m["created"]),
                         last_used=float(m["created"]), hits=0,
                         labels={str(k): str(v) for k, v in m["labels"].items()}, state=state)

    def entries(self) -> Iterator[EntryInfo]:
        """One EntryInfo per entry on disk; usage data from the index."""
        yield from self._listing(with_blobs=False)[0]

    def _listing(self, *, with_blobs: bool) -> tuple[list[EntryInfo], dict[str, dict[str, int]]]:
        """The entries on disk and, with ``with_blobs``, what each holds in blobs/.

        Blob maps come from the index; a record without one (written before blob maps, or
        not indexed) reads its manifest, and the index is filled in for next time.
        """
        on_disk = set(self.digests())
        items = self._index_safely("list", lambda: list(self.index.items())) or []
        indexed = {i.key: (i, b) for i, b in items}
        infos: list[EntryInfo] = []
        blobs: dict[str, dict[str, int]] = {}
        healed: dict[str, dict[str, int]] = {}
        for d in sorted(on_disk):
            rec = indexed.get(d)
            if rec is not None:
                infos.append(rec[0])
                if rec[1] is not None:
                    blobs[d] = rec[1]
                if rec[1] is not None or not with_blobs:
                    continue
            try:
                m = self._manifest(d)
            except (errors.StoreError, OSError):
                if rec is None:
                    infos.append(EntryInfo(key=d, size_bytes=0, created=0.0, last_used=0.0,
                                           hits=0, state="bad-manifest"))
                continue
            if rec is None:
                infos.append(self._info_from_manifest(d, m, state="unindexed"))
            else:
                healed[d] = _blob_map(m)
            blobs[d] = _blob_map(m)
        if healed:
            self._index_safely("blobs", lambda: self.index.set_blobs(healed))
        return infos, blobs

    def find(self, **labels: Any) -> list[EntryInfo]:
        return [i for i in self.entries() if has_labels(i.labels, labels)]

    def resolve(self, prefix: str) -> str:
        """The full digest of the one entry whose digest starts with ``prefix``."""
        p = prefix.strip().lower()
        if not p or any(c not in "0123456789abcdef" for c in p):
            raise errors.KeyNotFound(f"{prefix!r} is not a hex key prefix")
        if len(p) >= 2:
            found = self._link_on_path("entries", p[:2])
            if found is not None:
                raise _link_error(*found)
            try:
                names = [n for n in os.listdir(self._entries / p[:2]) if is_digest(n)]
            except FileNotFoundError:
                names = []
        else:
            names = list(self.digests())
        matches = sorted(n for n in names if n.startswith(p))
        if not matches:
            raise errors.KeyNotFound(f"no entry matches {prefix!r}")
        if len(matches) > 1:
            raise errors.AmbiguousKey(prefix, matches)
        return matches[0]

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts of the user's entries and lookups, as ``cachectl ls`` lists them; shared
        graphs apart under ``shared_graphs``. ``bytes`` is physical (what counts against
        the cap, shared graphs included), ``logical_bytes`` the sum of entry sizes."""
        infos, blobs = self._listing(with_blobs=True)
        counters = self._index_safely("counters", self.index.counters) or {}
        misses = {k[5:]: v for k, v in counters.items() if k.startswith("miss:")}
        graph_miss = GRAPH_SCOPE + "miss:"
        graph_misses = {k[len(graph_miss):]: v for k, v in counters.items()
                        if k.startswith(graph_miss)}
        try:
            quarantined = sum(1 for n in os.listdir(self._quarantine) if not n.endswith(".reason"))
        except FileNotFoundError:
            quarantined = 0
        graphs = sum(1 for i in infos if is_shared_graph(i.labels))
        return {
            "root": str(self.root),
            "entries": len(infos) - graphs,
            "bytes": physical_size(infos, blobs),
            "logical_bytes": sum(i.size_bytes for i in infos),
            "cap": self.max_size,
            "hits": int(counters.get("hits", 0)),
            "misses": misses,
            "shared_graphs": {"entries": graphs,
                              "hits": int(counters.get(GRAPH_SCOPE + "hits", 0)),
                              "misses": graph_misses},
            "publishes": int(counters.get("publishes", 0)),
            "evictions": int(counters.get("evictions", 0)),
            "corruptions": int(counters.get("corruptions", 0)),
            "quarantined": quarantined,
            "readonly": self.readonly,
        }

    def zero_stats(self) -> None:
        keep = self.index.counter("bytes")
        self.index.zero()
        self.index.incr("bytes", keep)

    # -- locks and pins --------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, name: str, timeout: float = 600.0) -> Iterator[Path]:
        """Hold an inter-process lock ``name`` (a filelock under locks/)."""
        import filelock  # deferred: only writers lock

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100]
        if safe != name:
            safe += "-" + xxhash.xxh3_64_hexdigest(name.encode())
        path = self._real("locks") / f"{safe}.lock"
        lk = filelock.FileLock(str(path), timeout=timeout, mode=0o660 if self.shared_group else 0o600)
        try:
            lk.acquire()
        except filelock.Timeout:
            raise errors.LockTimeout(path, timeout) from None
        try:
            yield path
        finally:
            # filelock never unlinks the file on Unix: others may be waiting on it.
            lk.release()

    def pin(self, entry: Entry | Key | str) -> Pin:
        """Lease an entry so that gc skips it while the returned Pin is held.

        The store also keeps the pin, so it lasts for the store's (usually the process's)
        lifetime unless released. Raises KeyNotFound if the entry went away meanwhile.
        """
        digest = entry.key if isinstance(entry, Entry) else self.digest_of(entry)
        pdir = self._real("pins") / digest
        pdir.mkdir(mode=self._dir_mode, parents=True, exist_ok=True)
        self._real("pins", digest)
        tmp = self._real("tmp") / temp_name("pin", digest)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Locked before it becomes visible, so gc never mistakes a new pin for a dead one.
        final = pdir / f"{HOST_TAG}.{os.getpid()}.{tmp.name.rsplit('.', 1)[-1]}.pin"
        os.rename(tmp, final)
        pin = Pin(final, fd, digest)
        # gc takes an entry away, then re-checks pins: one of us sees the other.
        if not self.entry_dir(digest).is_dir():
            pin.release()
            raise errors.KeyNotFound(f"entry {digest} went away before it could be pinned")
        self._held_pins.append(pin)
        return pin

    def pinned(self) -> set[str]:
        """Digests with a live pin; pins of dead processes are removed on the way."""
        out: set[str] = set()
        # Raises for a symlinked pins/: gc must not take "no pins readable" for "none".
        pins_dir = self._real("pins")
        try:
            dirs = list(os.scandir(pins_dir))
        except FileNotFoundError:
            return out
        for d in dirs:
            if not d.is_dir(follow_symlinks=False):
                continue  # never unlink "dead pins" through a link
            live = False
            try:
                names = os.listdir(d.path)
            except OSError:
                continue
            for n in names:
                p = os.path.join(d.path, n)
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    live = True
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(p)  # holder is dead; nobody waits on pin files
                finally:
                    os.close(fd)
            if live:
                out.add(d.name)
            else:
                with contextlib.suppress(OSError):
                    os.rmdir(d.path)
        return out

    # -- maintenance -----------------------------------------------------------------
    def sweep_temp(self, grace_s: float = TEMP_GRACE_S) -> int:
        """Remove staging leftovers whose owner is dead or which are older than ``grace_s``."""
        n = 0
        now = time.time()
        found = self._link_on_path("tmp")
        if found is not None:
            self._warn_link(*found)  # sweeping through it would delete outside files
            return 0
        try:
            items = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return 0
        me = os.getpid()
        for it in items:
            parsed = parse_temp_name(it.name)
            try:
                age = now - it.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            stale = age > grace_s
            if parsed is not None and parsed[0] == HOST_TAG and parsed[1] != me:
                stale = stale or not pid_alive(parsed[1])
            if parsed is not None and parsed[0] == HOST_TAG and parsed[1] == me:
                stale = False  # our own work in progress
            if stale:
                rmtree_quiet(Path(it.path))
                n += 1
        return n

    def sweep_blobs(self) -> int:
        """Remove blobs no entry links to any more (link count 1)."""
        n = 0
        found = self._link_on_path("blobs")
        if found is not None:
            self._warn_link(*found)  # sweeping through it would delete outside files
            return 0
        try:
            shards = list(os.scandir(self._blobs))
        except FileNotFoundError:
            return 0
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                if shard.is_symlink():
                    self._warn_link(Path(shard.path), "a symlink")
                continue
            with os.scandir(shard.path) as it:
                for b in it:
                    try:
                        if b.stat(follow_symlinks=False).st_nlink <= 1:
                            os.unlink(b.path)
                            n += 1
                    except FileNotFoundError:
                        pass
        return n

    def gc(self, max_size: int | None = None, *, lock_timeout: float = 60.0) -> GcReport:
        """Enforce the size cap (LRU, pinned entries skipped) and sweep leftovers.

        Sizes are physical: content shared by several entries counts once, and evicting
        an entry frees only what no remaining entry holds.
        """
        cap = self.max_size if max_size is None else int(max_size)
        report = GcReport(max_size=cap)
        with self.lock("gc", timeout=lock_timeout):
            report.temp_swept = self.sweep_temp()
            infos, blobs = self._listing(with_blobs=True)
            report.bytes_before = physical_size(infos, blobs)
            pinned = self.pinned()
            report.pinned_skipped = sorted(pinned & {i.key for i in infos})
            for victim in lru_evictions(infos, cap, pinned, blobs):
                if self._remove(victim.key, respect_pins=True, kind="evict"):
                    report.evicted.append(victim)
            gone = {i.key for i in report.evicted}
            report.blobs_removed = self.sweep_blobs()
            report.bytes_after = physical_size([i for i in infos if i.key not in gone], blobs)
            report.freed_bytes = report.bytes_before - report.bytes_after

            def fix_counters() -> None:
                c = self.index.counter("bytes")
                self.index.incr("bytes", report.bytes_after - c)
                self.index.incr("evictions", len(report.evicted))

            self._index_safely("gc", fix_counters)
        return report

    def purge_plan(
        self,
        *,
        keys: list[str] | None = None,
        labels: Mapping[str, Any] | None = None,
        older_than: float | None = None,
        all: bool = False,
        include_pinned: bool = False,
    ) -> tuple[list[EntryInfo], list[EntryInfo]]:
        """(goes, kept): what :meth:`purge` would remove, and what it keeps because a live
        process pinned it or a member of its group (as gc does), unless ``include_pinned``.

        Criteria combine with AND; with none given and ``all`` false, nothing goes.
        """
        if not (keys or labels or older_than is not None or all):
            return [], []
        universe = list(self.entries())
        infos = universe
        if keys:
            want = {self.digest_of(k) for k in keys}
            infos = [i for i in infos if i.key in want]
        if labels:
            infos = [i for i in infos if has_labels(i.labels, labels)]
        if older_than is not None:
            # Age of a group is its latest use over ALL members, not the selected ones.
            old = {i.key for i in _older_than(universe, time.time() - older_than)}
            infos = [i for i in infos if i.key in old]
        # Never one rank of a group: whatever is selected takes its whole group along.
        infos = expand_groups(infos, universe)
        if include_pinned:
            return infos, []
        return split_pinned(infos, self.pinned())

    def purge(
        self,
        *,
        keys: list[str] | None = None,
        labels: Mapping[str, Any] | None = None,
        older_than: float | None = None,
        all: bool = False,
        include_pinned: bool = False,
        dry_run: bool = False,
    ) -> list[EntryInfo]:
        """Remove entries by key, by labels, by age (seconds since last use) or all.

        Pinned entries and their groups stay unless ``include_pinned`` (see
        :meth:`purge_plan`, which also says what was kept). Returns what was removed.
        """
        goes, _ = self.purge_plan(keys=keys, labels=labels, older_than=older_than, all=all,
                                  include_pinned=include_pinned)
        if dry_run:
            return goes
        return [i for i in goes
                if self._remove(i.key, respect_pins=not include_pinned, kind="del")]

    def reindex(self) -> int:
        """Rebuild the index from the manifests on disk (the manifests are the truth)."""
        infos = []
        blobs: dict[str, dict[str, int]] = {}
        for d in self.digests():
            try:
                m = self._manifest(d)
                infos.append(self._info_from_manifest(d, m))
                blobs[d] = _blob_map(m)
            except (errors.StoreError, OSError):
                continue
        self.index.replace_all(infos, blobs)
        total = physical_size(infos, blobs)
        self.index.incr("bytes", total - self.index.counter("bytes"))
        return len(infos)

    def _layout_problems(self) -> list[tuple[str, str]]:
        """Store directories (layout, fan-out shards, pin dirs) that are not real."""
        out: list[tuple[str, str]] = []

        def report(path: Path, what: str) -> None:
            out.append((str(path), f"insecure: {what}, not a real directory; never followed "
                                   "(remove it: the store recreates what it needs)"))

        found = self._link_on_path()
        if found is not None:
            report(*found)
            return out
        for name in LAYOUT:
            found = self._link_on_path(name)
            if found is not None:
                report(*found)
                continue
            if name not in ("entries", "blobs", "pins"):
                continue
            try:
                subs = list(os.scandir(self.base / name))
            except FileNotFoundError:
                continue
            for sub in subs:
                if sub.is_symlink():
                    report(Path(sub.path), "a symlink")
        return out

    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every entry in full, the store's directories, and the index against the disk.

        A directory that is a symlink is a problem (named by its path, not a digest);
        ``fix`` leaves it alone (whatever it points at is not the store's to move).
        """
        report = VerifyReport()
        report.problems.extend(self._layout_problems())
        on_disk = set(self._digests(warn=False))
        for d in sorted(on_disk):
            report.checked += 1
            try:
                self._inspect(d, full=True)
            except _Bad as b:
                report.problems.append((d, f"{b.kind}: {b.reason}"))
        indexed = self._index_safely("list", self.index.digests) or set()
        report.index_missing = sorted(on_disk - indexed)
        report.index_stale = sorted(indexed - on_disk)
        if fix:
            for d, reason in report.problems:
                if is_digest(d) and self.quarantine(d, reason) is not None:
                    report.quarantined.append(d)
                    self._index_safely("corruptions", lambda: self.index.incr("corruptions"))
            self.reindex()
            report.reindexed = True
        return report

    def close(self) -> None:
        self.index.close()
