"""Small filesystem helpers: durable writes, hashing, ownership checks, temp names."""

from __future__ import annotations

import contextlib
import errno
import functools
import grp
import mmap
import os
import pwd
import secrets
import shutil
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path

import xxhash

__all__ = [
    "FULL_ERRNOS",
    "fsync_dir",
    "hash_file",
    "owner_problem",
    "pid_alive",
    "remove_entry_tree",
    "rmtree_quiet",
    "temp_name",
    "parse_temp_name",
    "unreal_dir",
    "write_new_file",
]

# Out of space or quota: publish fails with StoreFullError.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_MMAP_MIN = 1 << 16
HOST_TAG = format(zlib.crc32(os.uname().nodename.encode()), "08x")


def hash_file(path: Path | str, *, dir_fd: int | None = None) -> tuple[int, str]:
    """(size, XXH3-128 hex) of a file; mmap for large files avoids a copy per chunk.

    With ``dir_fd``, ``path`` is relative to that directory, and a symlink in its place
    is not followed (ELOOP)."""

    def opener(p: str, flags: int) -> int:
        return os.open(p, flags | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)

    with open(path, "rb", opener=None if dir_fd is None else opener) as f:
        size = os.fstat(f.fileno()).st_size
        if size >= _MMAP_MIN:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return size, xxhash.xxh3_128_hexdigest(m)
        data = f.read()
        return len(data), xxhash.xxh3_128_hexdigest(data)


def write_new_file(path: Path, chunks: Iterable[bytes], mode: int) -> None:
    """Create ``path`` exclusively, write ``chunks``, fsync. Removes the file on failure."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def temp_name(kind: str, tag: str = "") -> str:
    """``kind.tag.host.pid.random``: the sweeper reads host and pid back out of it."""
    return f"{kind}.{tag or '-'}.{HOST_TAG}.{os.getpid()}.{secrets.token_hex(4)}"


def parse_temp_name(name: str) -> tuple[str, int] | None:
    """(host tag, pid) of a name made by :func:`temp_name`, or None."""
    parts = name.split(".")
    if len(parts) < 5:
        return None
    try:
        return parts[-3], int(parts[-2])
    except ValueError:
        return None


def rmtree_quiet(path: Path) -> None:
    """Remove a file or tree, making read-only directories writable first."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
            return
    except FileNotFoundError:
        return

    def onerror(func: object, p: str, exc: object) -> None:
        try:
            parent = os.path.dirname(p)
            os.chmod(parent, stat.S_IMODE(os.lstat(parent).st_mode) | stat.S_IWUSR | stat.S_IXUSR)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)  # onexc is 3.12+


def remove_entry_tree(path: Path) -> None:
    """:func:`rmtree_quiet` of an entry taken away (its files, ``data/`` and what is in it,
    no deeper): unlinked by name from one scan per directory, half the CPU of
    shutil.rmtree's descriptor walk (gc deletes thousands). Anything else (a deeper
    tree, a directory that refuses) goes to :func:`rmtree_quiet`."""
    try:
        with os.scandir(path) as top:
            for e in top:
                if e.is_dir(follow_symlinks=False):
                    with os.scandir(e.path) as inner:
                        for f in inner:
                            if f.is_dir(follow_symlinks=False):
                                raise IsADirectoryError(f.path)   # deeper: rmtree's
                            os.unlink(f.path)
                    os.rmdir(e.path)
                else:
                    os.unlink(e.path)   # a link is unlinked, never followed
        os.rmdir(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            rmtree_quiet(path)
    except OSError:
        rmtree_quiet(path)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


@functools.lru_cache(maxsize=16)
def group_members(gid: int) -> frozenset[int]:
    """The uids of a group's members: listed in it, or with it as their primary group."""
    uids: set[int] = set()
    with contextlib.suppress(KeyError):
        for name in grp.getgrgid(gid).gr_mem:
            with contextlib.suppress(KeyError):
                uids.add(pwd.getpwnam(name).pw_uid)
    uids.update(p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid)
    return frozenset(uids)


def owner_problem(st: os.stat_result, shared_group: bool, group: int | None = None) -> str | None:
    """Why a file/dir with stat ``st`` is not trusted, or None if it is.

    Trusted: owned by this user (or root), not group- or world-writable. In shared mode
    (a team store, ``group`` its group): never world-writable; owned by this user or
    root, or by a member of the store's group with that group, which this user is in.
    """
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return f"it is world-writable (mode {mode:o})"
    uid = os.geteuid()
    if shared_group:
        if st.st_uid in (uid, 0):
            return None
        name = group_name(st.st_gid)
        groups = set(os.getgroups()) | {os.getegid()}
        if st.st_gid not in groups:
            user = next((p.pw_name for p in [_pw(uid)] if p is not None), str(uid))
            return (f"it is owned by uid {st.st_uid} and group {name}, and this user is not "
                    f"in group {name} (a member adds you: usermod -aG {name} {user}; then "
                    "log in again)")
        if group is not None and st.st_gid != group:
            return f"its group {name} is not the store's group {group_name(group)}"
        if st.st_uid not in group_members(st.st_gid):
            return f"it is owned by uid {st.st_uid}, who is not a member of group {name}"
        return None
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if mode & stat.S_IWGRP:
        return f"it is group-writable (mode {mode:o})"
    return None


def _pw(uid: int) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        return None


def unreal_dir(base: Path, parts: Iterable[str] = ()) -> tuple[Path, str] | None:
    """The first of ``base``, ``base/p0``, ``base/p0/p1``... that is not a real directory,
    with what it is instead (``"a symlink"``, ``"not a directory"``); None if all are real.

    Checked with lstat, so nothing is followed: a symlinked directory inside the store
    would let lookups load (and gc delete) files outside it. A missing level ends the
    walk: the caller finds the thing absent and creates it or reports a miss.
    """
    p = base
    for part in ("", *parts):
        if part:
            p = p / part
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None  # reported at the level above, which is not a directory
        if stat.S_ISLNK(mode):
            return p, "a symlink"
        if not stat.S_ISDIR(mode):
            return p, "not a directory"
    return None
