"""Verification: an entry is loaded only after its manifest and every file check out, and
one that does not is moved to ``quarantine/`` (never deleted silently).

Full checksums on the first read of an entry in a process, sizes only after that (issue
2): what this process verified, and which manifests it parsed and digest-checked, is
remembered per entry directory and manifest signature (inode, mtime, size).

``cachectl verify`` reads every entry in full once, and then only what changed: a full
check (:func:`check`) returns a :data:`Stamp` of what it read, and :func:`unchanged`
tells whether the entry still matches it without reading the manifest or hashing a file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import errors
from .blobs import exclusive_bytes
from .fsutil import hash_file, owner_problem, rmtree_quiet
from .index import Index
from .layout import DATA, MANIFEST, Layout, blob_name, link_error
from .manifest import parse_manifest, validate_name
from .outcomes import Entry, MissKind

logger = logging.getLogger(__name__)

__all__ = ["Bad", "Ident", "Stamp", "check", "forget", "inspect", "quarantine",
           "read_manifest", "remember", "unchanged"]

# Entries verified in full by this process: entry dir -> (manifest signature, manifest).
# Later reads in this process check sizes only (issue 2: "full checksums on the first read").
_VERIFIED: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
# Manifests parsed and checked against their integrity digest by this process (files not
# hashed yet): entry dir -> (manifest signature, manifest). ``manifest()`` and the first
# ``get`` of an entry share it, so a manifest is parsed and digested once per process.
_PARSED: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def _sig(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def forget(edir: Path) -> None:
    """The entry at ``edir`` went away: what this process knew of it no longer holds."""
    _VERIFIED.pop(str(edir), None)
    _PARSED.pop(str(edir), None)


def remember(edir: Path, manifest: dict[str, Any]) -> bool:
    """This process wrote the entry at ``edir`` and hashed its files while writing them.

    False if it is gone already: a delete (or an eviction) may follow any publish at once.
    """
    try:
        _VERIFIED[str(edir)] = (_sig(os.lstat(edir / MANIFEST)), manifest)
    except FileNotFoundError:
        return False
    return True


# An entry directory's identity: (st_dev, st_ino). Taken from a descriptor held open for
# the whole inspection, so the inode cannot be freed and reused by another entry meanwhile.
Ident = tuple[int, int]

_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))


class Bad(Exception):
    """An entry failed inspection; becomes a Miss of ``kind``.

    ``link``: a store directory above the entry is not real; the entry is not ours to
    quarantine (moving it would pull in whatever the link points at). ``ident``: the
    entry directory the verdict is about (what :func:`quarantine` may move).
    """

    def __init__(self, kind: MissKind, reason: str, link: tuple[Path, str] | None = None,
                 ident: Ident | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.link = link
        self.ident = ident


# What a full check of an entry read, as :func:`unchanged` compares it later: the paths
# (relative to the entry directory: ".", the manifest, data/, each directory on the way to
# a file, each file) and a digest of their lstat (inode, mode, owner, size, mtime, ctime).
# Any write, rename, chmod, chown, utime or replacement moves the ctime of what it
# touches, which the kernel sets and no user can set back.
Stamp = tuple[tuple[str, ...], bytes]
StatRecord = tuple[str, int, int, int, int, int, int, int]
# A stamp is only kept when everything it covers last changed this long before the check
# began: file times come from a coarse clock (a tick of a few ms; seconds on some file
# systems), so a change made in the same tick as the last one could leave every field
# equal ("racy git"). An entry changed that recently is read in full next time.
RACY_NS = 2_000_000_000
_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}   # one tuple per distinct name list


def _record(name: str, st: os.stat_result) -> StatRecord:
    return (name, st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size,
            st.st_mtime_ns, st.st_ctime_ns)


def _seal(records: list[StatRecord]) -> Stamp:
    names = tuple(r[0] for r in records)
    shared = _NAMES.setdefault(names, names)
    numbers = [v for r in records for v in r[1:]]
    try:
        packed = struct.pack(f"<{len(numbers)}q", *numbers)   # repr was a third of verify
    except struct.error:   # an inode number past 2**63 (some network file systems)
        packed = repr(numbers).encode()
    return shared, hashlib.blake2b(packed, digest_size=16).digest()


def _lstat(name: str, fd: int, missing: tuple[MissKind, str], what: str) -> os.stat_result:
    """lstat ``name`` inside the directory ``fd``; Bad(*missing) when it is not there,
    ``unreadable`` when it may not be looked at."""
    try:
        return os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        raise Bad(*missing) from None
    except PermissionError as e:
        raise Bad("unreadable", f"cannot stat {what}: {e}") from None


def _went_away(edir: Path, held: Ident) -> bool:
    """Whether the directory ``held`` is no longer the one under ``edir``."""
    try:
        now = os.lstat(edir)
    except FileNotFoundError:
        return True
    return (now.st_dev, now.st_ino) != held


def inspect(layout: Layout, digest: str, *, full: bool | None = None,
            on_bad: Callable[[Bad], None] | None = None) -> Entry:
    """Load and check one entry; raise Bad. ``full``: None = first read in process.

    Whole or absent, whatever removes entries meanwhile: everything is read through one
    descriptor of the entry directory. A delete or an eviction renames the directory out
    of ``entries/`` before it removes anything, so what this reads is one entry's, whole,
    until the removal reaches it; a piece found missing (or a bad verdict of any kind) is
    then only believed while that same directory is still the one under the key. If it
    is not, the entry went away while it was read: ``absent``, never ``corrupt``.

    ``on_bad`` is called with a ``corrupt`` or ``insecure`` verdict (not one about a link
    above the entry) before the descriptor is closed: it may :func:`quarantine` the
    directory by :attr:`Bad.ident`, which cannot name a new entry while the descriptor
    keeps the inode from being reused.
    """
    return _inspect(layout, digest, full, on_bad, None)


def check(layout: Layout, digest: str, *, on_bad: Callable[[Bad], None] | None = None,
          ) -> tuple[Entry, Stamp | None]:
    """:func:`inspect` in full (every checksum), and the stamp of what it read, for
    :func:`unchanged` to compare later; None when something in the entry changed too
    recently for its times to tell a later change apart (see ``RACY_NS``).

    The stamp is of the state before the manifest and files were read: whatever changes
    them during or after the check moves their ctime, so it cannot match it.
    """
    began = time.time_ns()
    seen: list[StatRecord] = []
    entry = _inspect(layout, digest, True, on_bad, seen)
    if max(r[7] for r in seen) > began - RACY_NS:
        return entry, None
    return entry, _seal(seen)


def unchanged(layout: Layout, digest: str, stamp: Stamp) -> bool:
    """Whether the entry is still exactly what a full check stamped ``stamp``: the same
    paths, through one descriptor of the entry directory (no link followed), with the
    same inode, mode, owner, size, mtime and ctime. No file is read."""
    names, sealed = stamp
    try:
        # A str path: pathlib's joins were a quarter of a verify with nothing changed.
        fd = os.open(os.path.join(layout.entries, digest[:2], digest), _DIR_FLAGS)
    except OSError:
        return False
    try:
        records = [_record(n, os.fstat(fd) if n == "." else os.lstat(n, dir_fd=fd))
                   for n in names]
    except OSError:
        return False
    finally:
        os.close(fd)
    return _seal(records)[1] == sealed


def _inspect(layout: Layout, digest: str, full: bool | None,
             on_bad: Callable[[Bad], None] | None, seen: list[StatRecord] | None) -> Entry:
    edir = layout.entry_dir(digest)
    found = layout.unreal("entries", digest[:2])
    if found is not None:
        raise Bad("insecure", f"{found[0]} is {found[1]}, not a real directory", link=found)
    try:
        fd = os.open(edir, _DIR_FLAGS)
    except FileNotFoundError:
        raise Bad("absent", "no entry for this key") from None
    except PermissionError as e:
        raise Bad("unreadable", f"cannot open entry: {e}") from None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise Bad("unreadable", f"cannot open entry: {e}") from None
        bad = Bad("insecure", "entry is not a real directory (symlink?)")
        if on_bad is not None:
            on_bad(bad)
        raise bad from None
    try:
        dst = os.fstat(fd)
        held = (dst.st_dev, dst.st_ino)
        try:
            return _inspect_dir(layout, digest, edir, fd, dst, full, seen)
        except Bad as b:
            if b.kind not in ("corrupt", "insecure"):
                raise
            if _went_away(edir, held):
                raise Bad("absent", "the entry went away while it was read (deleted or "
                                    "evicted)") from None
            b.ident = held
            if on_bad is not None:
                on_bad(b)
            raise
    finally:
        os.close(fd)


def _inspect_dir(layout: Layout, digest: str, edir: Path, fd: int, dst: os.stat_result,  # noqa: C901 (today's exception: one check per kind of entry damage)
                 full: bool | None, seen: list[StatRecord] | None = None) -> Entry:
    """:func:`inspect` of the entry directory open as ``fd`` (``dst``: its stat). Each
    lstat made on the way is added to ``seen`` (what a :data:`Stamp` covers)."""
    problem = owner_problem(dst, layout.shared_group, layout.group)
    if problem:
        raise Bad("insecure", f"entry {problem}")
    mst = _lstat(MANIFEST, fd, ("corrupt", "manifest.json is missing"), "manifest")
    if seen is not None:
        seen += [_record(".", dst), _record(MANIFEST, mst)]
    if not stat.S_ISREG(mst.st_mode):
        raise Bad("insecure", "manifest.json is not a regular file")
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
                mfd = os.open(MANIFEST, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)
                with os.fdopen(mfd, "rb") as f:
                    msig = _sig(os.fstat(f.fileno()))  # the signature of what is read
                    text = f.read()
            except PermissionError as e:
                raise Bad("unreadable", f"cannot read manifest: {e}") from None
            except OSError as e:
                raise Bad("corrupt", f"cannot read manifest: {e}") from None
            try:
                # Checks the integrity digest over the whole manifest (meta included).
                manifest = parse_manifest(text, expect_key=digest)
            except errors.UnsafePathError as e:
                raise Bad("insecure", str(e)) from None
            except errors.ManifestError as e:
                raise Bad("corrupt", str(e)) from None
    data = edir / DATA
    # data/ itself too: lstat of data/<name> would follow a symlinked data/.
    try:
        dat = os.lstat(DATA, dir_fd=fd)
    except FileNotFoundError:
        dat = None
    data_mode = None if dat is None else dat.st_mode
    if seen is not None and dat is not None:
        seen.append(_record(DATA, dat))
    if data_mode is None:
        if manifest["files"]:
            raise Bad("corrupt", "data/ is missing")
    elif not stat.S_ISDIR(data_mode):
        what = "a symlink" if stat.S_ISLNK(data_mode) else "not a directory"
        raise Bad("insecure", f"{data} is {what}, not a real directory")
    files: dict[str, Path] = {}
    checked_dirs: set[str] = set()
    for name, rec in manifest["files"].items():
        # A symlinked parent directory would lead out of the entry: check each level once.
        parts = name.split("/")
        for i in range(1, len(parts)):
            sub = "/".join(parts[:i])
            if sub not in checked_dirs:
                try:
                    sst = os.lstat(f"{DATA}/{sub}", dir_fd=fd)
                except FileNotFoundError:
                    raise Bad("corrupt", f"file {name!r} is missing") from None
                if not stat.S_ISDIR(sst.st_mode):
                    raise Bad("insecure", f"{sub!r} is not a real directory")
                checked_dirs.add(sub)
                if seen is not None:
                    seen.append(_record(f"{DATA}/{sub}", sst))
        fst = _lstat(f"{DATA}/{name}", fd, ("corrupt", f"file {name!r} is missing"), repr(name))
        if not stat.S_ISREG(fst.st_mode):
            raise Bad("insecure", f"file {name!r} is not a regular file (symlink?)")
        problem = owner_problem(fst, layout.shared_group, layout.group)
        if problem:
            raise Bad("insecure", f"file {name!r}: {problem}")
        if fst.st_size != rec["size"]:
            raise Bad("corrupt", f"file {name!r} has size {fst.st_size}, manifest says {rec['size']}")
        files[name] = data / name
        if seen is not None:
            seen.append(_record(f"{DATA}/{name}", fst))
    if not verified:
        for name, rec in manifest["files"].items():
            try:
                _, digest_hex = hash_file(f"{DATA}/{name}", dir_fd=fd)
            except PermissionError as e:
                raise Bad("unreadable", f"cannot read {name!r}: {e}") from None
            except OSError as e:
                raise Bad("corrupt", f"cannot read {name!r}: {e}") from None
            if digest_hex != rec["xxh3_128"]:
                raise Bad("corrupt", f"file {name!r} fails its checksum")
        # A check for verify (``seen``) adds nothing: holding every manifest of the store
        # took verify to 350 MB at 100,000 entries. It refreshes what a lookup holds.
        if seen is None or key in _VERIFIED:
            _VERIFIED[key] = (msig, manifest)
        _PARSED.pop(key, None)
    return Entry(key=digest, path=edir, files=files, manifest=manifest)


def read_manifest(layout: Layout, digest: str, *, remember: bool = False) -> dict[str, Any]:
    """The parsed, digest-checked manifest of an entry, its files unchecked.

    Raises KeyNotFound, UnsafePathError (a link) or ManifestError. With ``remember`` the
    result is kept for this process (shared with the first ``inspect``). Listings
    (entries, reindex, stat) read every manifest once: they use what is remembered but
    add nothing, so a big cache is not held in memory.
    """
    found = layout.unreal("entries", digest[:2], digest)
    if found is not None:
        raise link_error(*found)
    edir = str(layout.entry_dir(digest))
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


def quarantine(layout: Layout, index: Index, digest: str, reason: str,
               ident: Ident | None = None) -> Path | None:
    """Move a bad entry to quarantine/ (never deleted silently); drop its shared blobs.

    ``ident``: the entry directory found bad (:attr:`Bad.ident`, from ``inspect``'s
    ``on_bad`` while its descriptor is open). Only that one is quarantined: if the key
    holds another by the time it is moved (the bad one was deleted and the key published
    again), that one goes back, untouched.
    """
    src = layout.entry_dir(digest)
    found = layout.unreal("entries", digest[:2]) or layout.unreal("quarantine")
    if found is not None:
        # Moving it would pull in (or push out) whatever the link points at.
        layout.warn_link(*found)
        return None
    dst = layout.quarantine / f"{digest}.{time.time_ns()}"
    try:
        layout.mkdir(layout.quarantine, exist_ok=True)
        os.rename(src, dst)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("cannot quarantine %s: %s", src, e)
        return None
    if ident is not None:
        # rename() cannot be made conditional on the inode: move, then look at what moved.
        try:
            moved = os.lstat(dst)
            same = (moved.st_dev, moved.st_ino) == ident
        except OSError:
            same = False
        if not same:
            _give_back(layout, index, src, dst)
            return None
    freed = exclusive_bytes(dst)
    forget(src)
    with contextlib.suppress(OSError):
        (layout.quarantine / f"{dst.name}.reason").write_text(reason + "\n")
    # A damaged blob must not be linked into future entries.
    with contextlib.suppress(Exception):
        m = json.loads((dst / MANIFEST).read_bytes())
        for name, rec in m.get("files", {}).items():
            cs = str(rec.get("xxh3_128", ""))
            if len(cs) != 32 or layout.unreal("blobs", cs[:2]) is not None:
                continue
            for executable in (False, True):
                blob = layout.blobs / cs[:2] / blob_name(cs, executable)
                with contextlib.suppress(OSError):
                    if os.path.samefile(blob, dst / DATA / validate_name(name)):
                        os.unlink(blob)

    def unindex() -> None:
        index.remove(digest)
        index.incr("bytes", -freed)

    index.safely("quarantine", unindex)
    return dst


def _give_back(layout: Layout, index: Index, src: Path, dst: Path) -> None:
    """``dst`` is an entry quarantine took by mistake (published under the key after the
    bad one went): put it back at ``src``, or, if yet another took the key meanwhile,
    drop it as a removal would (it is a duplicate nobody can reach)."""
    try:
        os.rename(dst, src)
        logger.debug("%s was published again before it could be quarantined: kept", src)
        return
    except OSError:
        pass
    freed = exclusive_bytes(dst)
    rmtree_quiet(dst)
    index.safely("quarantine", lambda: index.incr("bytes", -freed))
