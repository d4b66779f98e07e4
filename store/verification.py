"""Verification: an entry is loaded only after its manifest and every file check out, and
one that does not is moved to ``quarantine/`` (never deleted silently).

Full checksums on the first read of an entry in a process, sizes only after that (issue
2): what this process verified, and which manifests it parsed and digest-checked, is
remembered per entry directory and manifest signature (inode, mtime, size).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

from . import errors
from .blobs import exclusive_bytes
from .fsutil import hash_file, owner_problem
from .index import Index
from .layout import DATA, MANIFEST, Layout, blob_name, link_error
from .manifest import parse_manifest, validate_name
from .outcomes import Entry

logger = logging.getLogger(__name__)

__all__ = ["Bad", "forget", "inspect", "quarantine", "read_manifest", "remember"]

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


def remember(edir: Path, manifest: dict[str, Any]) -> None:
    """This process wrote the entry at ``edir`` and hashed its files while writing them."""
    _VERIFIED[str(edir)] = (_sig(os.lstat(edir / MANIFEST)), manifest)


class Bad(Exception):
    """An entry failed inspection; becomes a Miss of ``kind``.

    ``link``: a store directory above the entry is not real; the entry is not ours to
    quarantine (moving it would pull in whatever the link points at).
    """

    def __init__(self, kind: str, reason: str, link: tuple[Path, str] | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.link = link


def _lstat(path: Path, missing: tuple[str, str], what: str) -> os.stat_result:
    """lstat ``path``; Bad(*missing) when it is not there, ``unreadable`` when it may not
    be looked at."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise Bad(*missing) from None
    except PermissionError as e:
        raise Bad("unreadable", f"cannot stat {what}: {e}") from None


def inspect(layout: Layout, digest: str, *, full: bool | None = None) -> Entry:
    """Load and check one entry; raise Bad. ``full``: None = first read in process."""
    edir = layout.entry_dir(digest)
    found = layout.unreal("entries", digest[:2])
    if found is not None:
        raise Bad("insecure", f"{found[0]} is {found[1]}, not a real directory", link=found)
    dst = _lstat(edir, ("absent", "no entry for this key"), "entry")
    if not stat.S_ISDIR(dst.st_mode):
        raise Bad("insecure", "entry is not a real directory (symlink?)")
    problem = owner_problem(dst, layout.shared_group, layout.group)
    if problem:
        raise Bad("insecure", f"entry {problem}")
    mpath = edir / MANIFEST
    mst = _lstat(mpath, ("corrupt", "manifest.json is missing"), "manifest")
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
                fd = os.open(mpath, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                with os.fdopen(fd, "rb") as f:
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
        data_mode: int | None = os.lstat(data).st_mode
    except FileNotFoundError:
        data_mode = None
    if data_mode is None:
        if manifest["files"]:
            raise Bad("corrupt", "data/ is missing")
    elif not stat.S_ISDIR(data_mode):
        what = "a symlink" if stat.S_ISLNK(data_mode) else "not a directory"
        raise Bad("insecure", f"{data} is {what}, not a real directory")
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
                    raise Bad("corrupt", f"file {name!r} is missing") from None
                if not stat.S_ISDIR(sst.st_mode):
                    raise Bad("insecure", f"{sub!r} is not a real directory")
                checked_dirs.add(sub)
        fst = _lstat(p, ("corrupt", f"file {name!r} is missing"), repr(name))
        if not stat.S_ISREG(fst.st_mode):
            raise Bad("insecure", f"file {name!r} is not a regular file (symlink?)")
        problem = owner_problem(fst, layout.shared_group, layout.group)
        if problem:
            raise Bad("insecure", f"file {name!r}: {problem}")
        if fst.st_size != rec["size"]:
            raise Bad("corrupt", f"file {name!r} has size {fst.st_size}, manifest says {rec['size']}")
        files[name] = p
    if not verified:
        for name, rec in manifest["files"].items():
            try:
                _, digest_hex = hash_file(files[name])
            except PermissionError as e:
                raise Bad("unreadable", f"cannot read {name!r}: {e}") from None
            except OSError as e:
                raise Bad("corrupt", f"cannot read {name!r}: {e}") from None
            if digest_hex != rec["xxh3_128"]:
                raise Bad("corrupt", f"file {name!r} fails its checksum")
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


def quarantine(layout: Layout, index: Index, digest: str, reason: str) -> Path | None:
    """Move a bad entry to quarantine/ (never deleted silently); drop its shared blobs."""
    src = layout.entry_dir(digest)
    found = layout.unreal("entries", digest[:2]) or layout.unreal("quarantine")
    if found is not None:
        # Moving it would pull in (or push out) whatever the link points at.
        layout.warn_link(*found)
        return None
    dst = layout.quarantine / f"{digest}.{time.time_ns()}"
    freed = exclusive_bytes(src)
    try:
        layout.mkdir(layout.quarantine, exist_ok=True)
        os.rename(src, dst)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("cannot quarantine %s: %s", src, e)
        return None
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
