"""Content storage: one inode per distinct content and mode under ``blobs/``, hard-linked
into every entry that holds it (dedup), and what removing an entry frees.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash

from . import errors
from .fsutil import temp_name, write_new_file
from .layout import DATA, Layout
from .protocol import FileSource, Owned

logger = logging.getLogger(__name__)

__all__ = ["blob_map", "exclusive_bytes", "link_in"]


def blob_map(manifest: Mapping[str, Any]) -> dict[str, int]:
    """Content checksum -> size of an entry's files: what it holds in blobs/."""
    return {str(r["xxh3_128"]): int(r["size"]) for r in manifest["files"].values()}


def exclusive_bytes(edir: Path) -> int:
    """Bytes that removing the entry at ``edir`` frees: content no other entry links.

    Each content's inode is linked by its blob and by every entry holding it, so a
    content is this entry's alone when its links, besides this entry's own, are at most
    the blob's one.
    """
    return exclusive_bytes_of([edir])


def exclusive_bytes_of(edirs: list[Path]) -> int:
    """Bytes that removing all the entries at ``edirs`` frees (content they share with
    each other, and with no other entry, counts once): :func:`exclusive_bytes` of a
    batch, counted before any of them is deleted."""
    inodes: dict[int, list[int]] = {}  # inode -> [links from these entries, nlink, size]
    for edir in edirs:
        data = edir / DATA
        try:
            if not (stat.S_ISDIR(os.lstat(edir).st_mode)
                    and stat.S_ISDIR(os.lstat(data).st_mode)):
                continue
        except OSError:
            continue
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


def _blob_ok(blob: Path, size: int, executable: bool) -> bool:
    try:
        st = os.lstat(blob)
    except FileNotFoundError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_size == size
            and bool(st.st_mode & stat.S_IXUSR) == executable)


def _take(layout: Layout, src: Owned, tmp: Path, mode: int) -> bool:
    """Hard-link the staged file ``src`` to ``tmp`` (no copy), with the blob's mode; False
    (copy it instead) unless it is a regular file of ours, under the store's ``tmp/``,
    with no other link: anything else may be someone's file, whose mode we must not touch.
    """
    try:
        tmp_root = os.path.realpath(layout.real("tmp"))
        where = os.path.realpath(src.path)
        st = os.lstat(src.path)
    except (OSError, errors.InsecureStoreError):
        return False
    if (os.path.commonpath([tmp_root, where]) != tmp_root or where == tmp_root
            or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1
            or st.st_uid != os.geteuid()):
        return False
    try:
        os.chmod(src.path, mode)  # the inode becomes the blob: read-only, like every blob
        os.link(src.path, tmp)
    except OSError as e:
        # EXDEV (another file system), EPERM/EMLINK: copy, as for any other path.
        logger.debug("cannot link staged %s (%s): copying it", src.path, e)
        return False
    return True


def _hashed(path: Path) -> tuple[int, str]:
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _store_blob(layout: Layout, src: FileSource, executable: bool) -> tuple[Path, int, str, bool]:
    """Put one content into blobs/ (once); (blob path, size, checksum, newly stored)."""
    # Read-only for everyone who may read: entries are immutable and share inodes.
    mode = layout.file_mode | ((layout.file_mode >> 2) & 0o111 if executable else 0)
    tmp = layout.tmp / temp_name("blob")
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        size, cs = len(data), xxhash.xxh3_128_hexdigest(data)
        blob = layout.blob_path(cs, executable)
        if _blob_ok(blob, size, executable):
            return blob, size, cs, False
        write_new_file(tmp, [data], mode)
    else:
        if isinstance(src, Owned) and _take(layout, src, tmp, mode):
            # One copy on disk: the staged inode becomes the blob (a bundle import would
            # otherwise need twice its size free).
            size, cs = _hashed(tmp)
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
            blob = layout.blob_path(cs, executable)
        except errors.InsecureStoreError:
            os.unlink(tmp)
            raise
        if _blob_ok(blob, size, executable):
            os.unlink(tmp)
            return blob, size, cs, False
    fresh = True
    try:
        layout.mkdir(blob.parent, exist_ok=True)
        layout.real("blobs", cs[:2])  # a link may have appeared in its place meanwhile
        try:
            os.link(tmp, blob)
        except FileExistsError:
            if _blob_ok(blob, size, executable):
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


def link_in(layout: Layout, src: FileSource, dst: Path, executable: bool) -> tuple[int, str, int]:
    """Link one file into a staging entry; (size, checksum, bytes newly stored)."""
    layout.mkdir(dst.parent, parents=True, exist_ok=True)
    for _ in range(3):
        blob, size, cs, fresh = _store_blob(layout, src, executable)
        try:
            os.link(blob, dst)
            return size, cs, size if fresh else 0
        except FileNotFoundError:
            continue  # gc removed an unreferenced blob between our check and link
        except OSError as e:
            if e.errno not in (errno.EMLINK, errno.EPERM):
                raise
            # Too many links to one inode, or (EPERM) the kernel's protected_hardlinks
            # refusing a link to another member's blob in a shared store: give this entry
            # its own copy.
            with open(blob, "rb") as f:
                write_new_file(dst, iter(lambda: f.read(1 << 20), b""),
                               os.stat(blob).st_mode & 0o777)
            return size, cs, size
    raise errors.StoreError(f"could not link blob into {dst}")
