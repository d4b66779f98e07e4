"""cachecompile's artifact store: content-addressed, verified, torch-free.

    >>> st = open_store()
    >>> key = make_key({"model": "m", "torch": "2.13.0"})
    >>> st.put(key, {"kernel.so": b"..."}, labels={"model": "m"})
    >>> st.get(key)            # Hit(entry) or Miss(reason, kind)

Importing this package loads only the standard library and xxhash; sqlite3 (the index)
and filelock are imported on first use.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from . import errors, settings
from .config import parse_size
from .disk import DEFAULT_MAX_SIZE, FORMAT_DIR, Pin, Store
from .keys import Key, canonical_json, make_key
from .outcomes import Entry, EntryInfo, GcReport, Hit, Miss, VerifyReport
from .protocol import (
    Catalog,
    DiskStorage,
    LocalStorage,
    Locking,
    Maintenance,
    OpenStore,
    Storage,
)
from .readonly import ReadOnlyStore

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_SIZE",
    "init_shared",
    "made_shared",
    "Catalog",
    "DiskStorage",
    "Entry",
    "EntryInfo",
    "GcReport",
    "Hit",
    "Key",
    "LocalStorage",
    "Locking",
    "Maintenance",
    "Miss",
    "OpenStore",
    "Pin",
    "ReadOnlyStore",
    "Storage",
    "Store",
    "VerifyReport",
    "canonical_json",
    "default_root",
    "errors",
    "make_key",
    "open_store",
    "parse_size",
]

def default_root() -> Path:
    """``$CACHECOMPILE_DIR``, else ``$XDG_CACHE_HOME/cachecompile``, else ``~/.cache/cachecompile``."""
    env = settings.DIR.get()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cachecompile"


def _writable(path: Path) -> bool:
    """Whether this process may create files in ``path`` (root ignores mode bits)."""
    return os.access(path, os.W_OK | os.X_OK)


def _must_exist(path: Path) -> None:
    if not path.is_dir():
        problem = "not a directory" if path.exists() else "no such directory (mistyped?)"
        raise errors.StoreNotFound(path, problem)
    if not os.path.lexists(path / FORMAT_DIR):
        raise errors.StoreNotFound(path, f"the directory holds no store (no {FORMAT_DIR}/)")


def open_store(
    root: str | os.PathLike[str] | None = None,
    *,
    max_size: int | str | None = None,
    readonly: bool = False,
    shared_group: bool | None = None,
    remote: str | None = None,
    create: bool = True,
    hits_later: bool = False,
) -> OpenStore:
    """Open (creating with mode 0700) the store at ``root``.

    Returns the :class:`~cachecompile.store.protocol.OpenStore` protocol, whatever
    stands behind it; its ``maintenance()`` is the store on this node's disk, which
    ``cachectl`` maintains. Raises InsecureStoreError if the root may be written by
    someone else. A root that cannot be written gives a read-only store
    (:class:`ReadOnlyStore`), with one warning logged; so does
    ``readonly=True`` or ``$CACHECOMPILE_READONLY=1`` (decided here, so that the cache and
    ``cachectl`` both honour it). ``create=False`` raises StoreNotFound instead of creating
    a missing store (a mistyped path must not look like an empty cache). ``hits_later``:
    hits are queued and written together a moment later (a serving process's first calls
    then never open the index; :mod:`cachecompile.store.index` says when they are written).
    With ``remote`` (else ``$CACHECOMPILE_REMOTE``), e.g. ``redis://host:6379/0``, the
    local store gets a remote tier behind it (:mod:`cachecompile.store.tiered`); ``remote=""`` opts out.
    A malformed ``remote`` raises RemoteConfigError; a malformed ``$CACHECOMPILE_REMOTE``
    (or an unreadable ``$CACHECOMPILE_SIGNING_KEY`` file) is one warning, and the local
    store alone is returned.
    """
    local = _open_local(root, max_size=max_size, readonly=readonly, shared_group=shared_group,
                        create=create, hits_later=hits_later)
    url = settings.REMOTE.get() if remote is None else remote
    if not url:
        return local
    from .tiered import wrap  # deferred: only remote users pay for it

    try:
        return wrap(local, url)
    except errors.RemoteConfigError as e:
        if remote is not None:
            raise  # the caller's own argument: its error
        # The environment's remote (or signing key) is broken: the local entries still
        # serve, as a remote that is down leaves them serving.
        logger.warning("%s; using the local store at %s only", e, local.root)
        return local


def made_shared(root: Path) -> bool:
    """Whether ``root`` is a team store (``cachectl init --shared``, or made by hand the
    same way): a setgid, group-writable directory that others may not write."""
    try:
        mode = os.stat(root).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_ISGID and mode & stat.S_IWGRP and not mode & stat.S_IWOTH)


def init_shared(root: str | os.PathLike[str], group: str) -> Store:
    """Make (or convert) ``root`` a store that every member of ``group`` reads and writes
    whatever their umask: the root setgid, group-owned and mode 2770, the layout and the
    index group-writable. Raises StoreError naming the fix if this user is not in
    ``group``."""
    import grp

    path = Path(root).expanduser()
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise errors.StoreError(f"there is no group {group!r} (create it: groupadd "
                                f"{group}, and add the team: usermod -aG {group} USER)") from None
    if gid not in set(os.getgroups()) | {os.getegid()} and os.geteuid() != 0:
        raise errors.StoreError(f"this user is not in group {group!r}: a member adds you "
                                f"(usermod -aG {group} {os.environ.get('USER', 'USER')}), "
                                "then log in again")
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, -1, gid)
    os.chmod(path, 0o2770)
    st = Store(path, shared_group=True)
    st.check_root()
    st.create_layout()
    st.stats()  # opens (creates) the index, group-writable
    return st


def _open_local(
    root: str | os.PathLike[str] | None,
    *,
    max_size: int | str | None,
    readonly: bool,
    shared_group: bool | None,
    create: bool,
    hits_later: bool = False,
) -> Maintenance:
    path = Path(root).expanduser() if root is not None else default_root()
    if max_size is None:
        max_size = settings.MAX_SIZE.get()
    if shared_group is None:
        shared_group = settings.SHARED_GROUP.get()
        if shared_group is None:
            shared_group = made_shared(path)
    st = Store(path, max_size=parse_size(max_size), shared_group=shared_group,
               hits_later=hits_later)
    if not create:
        st.check_root()  # an insecure root says so, even if it holds no store
        _must_exist(path)
    if readonly or settings.READONLY.get():
        st.check_root()
        return ReadOnlyStore(st, "opened with readonly=True" if readonly
                             else "CACHECOMPILE_READONLY is set")
    try:
        if not path.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o2770 if shared_group else 0o700, exist_ok=True)
            if shared_group:
                os.chmod(path, 0o2770)  # whatever the umask
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            # /proc/cc, a path through a file, a name too long: nothing to fall back on.
            raise errors.StoreError(f"cannot create the cache directory {path}: "
                                    f"{e.strerror or e}; set cache_dir= or CACHECOMPILE_DIR "
                                    "to a directory this user can create") from e
        return _read_only_after(st, e, "cannot create it")
    st.check_root()
    if not _writable(path) or (st.base.exists() and not _writable(st.base)):
        logger.warning("cache %s is not writable: using it read-only", path)
        return ReadOnlyStore(st, "no write permission")
    try:
        st.create_layout()
    except OSError as e:
        return _read_only_after(st, e, "not writable")
    st.sweep_temp()
    return st


def _read_only_after(st: Store, e: OSError, why: str) -> ReadOnlyStore:
    """``st`` read-only, after a write to it was refused (EACCES, EPERM, EROFS: a
    shared or mounted cache this user may only read), with one warning; any other error
    is raised."""
    if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise e
    logger.warning("cache %s: %s (%s): using it read-only", st.root, why, e)
    return ReadOnlyStore(st, f"{why}: {e.strerror}")
