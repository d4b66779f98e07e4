"""Locks and pins: inter-process locks through filelock, and leases that keep gc off an
entry while a process uses it.

A lock file is never unlinked (others may be waiting on it: filelock's ``_unix.py``
explains why); a pin file is, since only its holder ever locks it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import xxhash

from . import errors
from .fsutil import HOST_TAG, temp_name
from .layout import Layout

logger = logging.getLogger(__name__)

__all__ = ["Pin", "lock", "pin", "pinned"]

# A pin is placed in its pins dir; gc may remove that dir (empty) just then: try again.
_PLACE_TRIES = 16


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


@contextlib.contextmanager
def lock(layout: Layout, name: str, timeout: float = 600.0) -> Iterator[Path]:
    """Hold the inter-process lock ``name`` (a filelock under locks/); LockTimeout after
    ``timeout`` seconds, carrying the lock file's path."""
    import filelock  # deferred: only writers lock

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100]
    if safe != name:
        safe += "-" + xxhash.xxh3_64_hexdigest(name.encode())
    path = layout.real("locks") / f"{safe}.lock"
    _refuse_unreal_lock(path)
    lk = filelock.FileLock(str(path), timeout=timeout,
                           mode=0o660 if layout.shared_group else 0o600)
    try:
        lk.acquire()
    except filelock.Timeout:
        raise errors.LockTimeout(path, timeout) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        _refuse_unreal_lock(path)  # it became a link since we looked
        raise
    try:
        yield path
    finally:
        # filelock never unlinks the file on Unix: others may be waiting on it.
        lk.release()


def _refuse_unreal_lock(path: Path) -> None:
    """InsecureStoreError, naming the fix, if the lock file ``path`` is a symlink (or not
    a regular file): locking through it would open whatever it points at, and every
    process would fail on it (gc for everyone) with a bare ELOOP."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return  # filelock makes it
    if stat.S_ISREG(mode):
        return
    what = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
    raise errors.InsecureStoreError(
        path, f"the lock file is {what}", f"remove it (rm {path}): every process that "
        "takes this lock fails until then, and the store makes the file again")


def pin(layout: Layout, digest: str) -> Pin:
    """Lease the entry ``digest``; KeyNotFound if it went away meanwhile.

    Whatever fails, nothing is left behind: no ``tmp/pin.*`` file, no open descriptor.
    """
    tmp = layout.real("tmp") / temp_name("pin", digest)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    placed: Path | None = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Locked before it becomes visible, so gc never mistakes a new pin for a dead one.
        name = f"{HOST_TAG}.{os.getpid()}.{tmp.name.rsplit('.', 1)[-1]}.pin"
        for _ in range(_PLACE_TRIES):
            pdir = layout.real("pins") / digest
            try:
                layout.mkdir(pdir, parents=True, exist_ok=True)
                layout.real("pins", digest)
                os.rename(tmp, pdir / name)
            except (FileNotFoundError, FileExistsError):
                # gc (pinned()) removed the pins dir it found empty, between our mkdir and
                # our rename: make it again.
                continue
            placed = pdir / name
            break
        if placed is None:
            raise errors.StoreError(f"could not place a pin for {digest} under "
                                    f"{layout.real('pins')}: its directory kept vanishing")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        raise
    held = Pin(placed, fd, digest)
    # gc takes an entry away, then re-checks pins: one of us sees the other.
    if not layout.entry_dir(digest).is_dir():
        held.release()
        raise errors.KeyNotFound(f"entry {digest} went away before it could be pinned")
    return held


def pinned(layout: Layout) -> set[str]:
    """Digests with a live pin; pins of dead processes are removed on the way."""
    out: set[str] = set()
    # Raises for a symlinked pins/: gc must not take "no pins readable" for "none".
    pins_dir = layout.real("pins")
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
