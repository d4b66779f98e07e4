"""Where a store's files live, and the checks on the way to them.

Layout under ``<root>/v1/`` (see docs/store.md)::

    entries/<d[:2]>/<digest>/manifest.json    the truth about an entry
    entries/<d[:2]>/<digest>/data/<name>      hard links into blobs/
    blobs/<c[:2]>/<xxh3>[.x]                  one inode per distinct content and mode
    tmp/                                      staging; swept when stale
    quarantine/                               entries that failed verification
    locks/  pins/  index/                     filelocks, leases, SQLite index
    instance                                  this store's random id, written once

No directory below the root is ever followed if it is a symlink (each level is checked
with lstat on the way down): a lookup through one is an ``insecure`` miss, a write
through one raises InsecureStoreError, and ``verify`` reports it. :class:`Layout` is
that rule in one place; every other part of the store reaches files through it.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from . import errors
from .fsutil import (
    HOST_TAG,
    owner_problem,
    parse_temp_name,
    pid_alive,
    rmtree_quiet,
    temp_name,
    unreal_dir,
)
from .keys import is_digest, match_prefix

logger = logging.getLogger(__name__)

__all__ = ["DATA", "DIRS", "FORMAT_DIR", "Layout", "MANIFEST", "TEMP_GRACE_S", "blob_name",
           "link_error", "sweep_temp"]

FORMAT_DIR = "v1"
# How old a file in tmp/ must be before a sweep takes it: a writer's staging lives less.
TEMP_GRACE_S = 3600.0
MANIFEST = "manifest.json"
DATA = "data"
DIRS = ("entries", "blobs", "tmp", "quarantine", "locks", "pins", "index")
# A store made again at a path is another store: what is kept outside it by its path (the
# counters of its read-only processes, store/metrics.py) is kept by path and instance.
INSTANCE = "instance"
_INSTANCE_BYTES = 16


def link_error(path: Path, what: str) -> errors.InsecureStoreError:
    """The error of a write that would go through ``path``, which is ``what`` (a symlink...)."""
    return errors.InsecureStoreError(path, f"it is {what}, not a real directory",
                                     errors.LINK_HINT)


def blob_name(cs: str, executable: bool) -> str:
    """The blob file of content ``cs``: executable content has its own, ``<cs>.x``."""
    return f"{cs}.x" if executable else cs


class Layout:
    """The paths of one store, its modes, and the refusal to follow links below its root."""

    def __init__(self, root: Path, *, shared_group: bool = False) -> None:
        self.root = Path(root)
        self.shared_group = shared_group
        self.base = self.root / FORMAT_DIR
        self.entries = self.base / "entries"
        self.blobs = self.base / "blobs"
        self.tmp = self.base / "tmp"
        self.quarantine = self.base / "quarantine"
        self.locks = self.base / "locks"
        self.pins = self.base / "pins"
        self.index = self.base / "index"
        self.dir_mode = 0o2770 if shared_group else 0o700
        self.file_mode = 0o440 if shared_group else 0o400
        self._warned_links: set[str] = set()

    # -- creation and trust ------------------------------------------------------------
    def mkdir(self, path: Path, *, mode: int | None = None, parents: bool = False,
              exist_ok: bool = False) -> None:
        """Make a directory of the store with its mode whatever the umask: a shared
        store's directories must be group-writable (and setgid, so that what is made in
        them gets the store's group) for every member, and ``mkdir`` masks the mode with
        the creator's umask (022 made them 2750: the next member was read-only)."""
        want = self.dir_mode if mode is None else mode
        if parents and not path.parent.is_dir():
            self.mkdir(path.parent, mode=mode, parents=True, exist_ok=True)
        try:
            path.mkdir(mode=want)
        except FileExistsError:
            if not exist_ok:
                raise
            return
        if self.shared_group:
            os.chmod(path, want)   # only the creator may, and only it needs to

    def create(self) -> None:
        """Make ``v1/`` and its directories (a symlink in a directory's place stays, refused)."""
        if not os.path.lexists(self.base):
            self.mkdir(self.base, exist_ok=True)
        found = self.unreal()
        if found is not None:
            raise link_error(*found)
        for name in DIRS:
            d = self.base / name
            # lexists: a symlink in its place is left alone (and refused where used).
            if name != "index" and not os.path.lexists(d):
                self.mkdir(d, exist_ok=True)
        if not os.path.lexists(self.base / INSTANCE):
            self._write_instance()

    def _write_instance(self) -> None:
        token = os.urandom(_INSTANCE_BYTES).hex().encode()
        try:
            fd = os.open(self.base / INSTANCE, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | os.O_NOFOLLOW, self.file_mode | 0o200)
        except FileExistsError:
            return   # another process made the store at the same time: its id stands
        try:
            os.write(fd, token)
            os.fchmod(fd, self.file_mode)
        finally:
            os.close(fd)

    def instance(self) -> str:
        """This store's random id, or "" for a store made before it had one (or one whose
        file is not a small regular file: it is never followed through a link)."""
        try:
            fd = os.open(self.base / INSTANCE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return ""
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            text = os.read(fd, 2 * _INSTANCE_BYTES + 1).decode("ascii", "replace")
        except OSError:
            return ""
        finally:
            os.close(fd)
        ok = len(text) == 2 * _INSTANCE_BYTES and all(c in "0123456789abcdef" for c in text)
        return text if ok else ""

    @functools.cached_property
    def group(self) -> int | None:
        """A shared store's group: its root's (setgid directories hand it down)."""
        if not self.shared_group:
            return None
        try:
            return os.stat(self.root).st_gid
        except OSError:
            return None

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
                    raise link_error(p, "a symlink")
                st = os.stat(p)
            problem = owner_problem(st, self.shared_group, self.group)
            if problem:
                raise errors.InsecureStoreError(p, problem)

    # -- paths, checked ----------------------------------------------------------------
    def unreal(self, *parts: str) -> tuple[Path, str] | None:
        """The first directory from v1/ down to ``v1/<parts>`` that is not real, if any."""
        return unreal_dir(self.base, parts)

    def real(self, *parts: str) -> Path:
        """``v1/<parts>``; InsecureStoreError if a directory on the way is a symlink."""
        found = self.unreal(*parts)
        if found is not None:
            raise link_error(*found)
        return self.base.joinpath(*parts)

    def entry_dir(self, digest: str) -> Path:
        """Where the entry ``digest`` lives (unchecked: lookups check it level by level)."""
        return self.entries / digest[:2] / digest

    def blob_path(self, cs: str, executable: bool) -> Path:
        """The blob of content ``cs``, through real directories only.

        The mode is part of the blob's identity: entries share the blob's inode, and so
        its mode, so an executable file and a plain one with the same bytes need two.
        Checked before the blob is looked at: through a symlinked shard, an outside file
        of the right size would be hard-linked into the entry as "ours".
        """
        return self.real("blobs", cs[:2]) / blob_name(cs, executable)

    def staging_dir(self, kind: str, tag: str = "", *, mode: int | None = None) -> Path:
        """Create a fresh directory under ``tmp/`` to stage a write in (swept when stale).

        Raises InsecureStoreError if ``v1/`` or ``tmp/`` is not a real directory: what is
        staged is then linked and renamed into the store, and through a link it would be
        written (and later swept) outside it. ``mode`` defaults to the store's dir mode.
        """
        path = self.real("tmp") / temp_name(kind, tag)
        self.mkdir(path, mode=mode)
        return path

    # -- links found -------------------------------------------------------------------
    def warn_link(self, path: Path, what: str) -> None:
        """Warn that ``path`` is ``what`` (a symlink...) and is not followed."""
        # Once per path and store: a link above many entries would otherwise warn per lookup.
        if str(path) not in self._warned_links:
            self._warned_links.add(str(path))
            logger.warning("cache directory %s is %s, not a real directory: not following it "
                           "(lookups through it miss, writes are refused)", path, what)

    def warn_unsafe_index(self, e: errors.InsecureStoreError) -> None:
        """The index refused to open through a link: name the link, once."""
        self.warn_link(*(self.unreal("index") or (e.path, "unsafe")))

    def problems(self) -> list[tuple[str, str]]:
        """Store directories (layout, fan-out shards, pin dirs) that are not real."""
        out: list[tuple[str, str]] = []

        def report(path: Path, what: str) -> None:
            out.append((str(path), f"insecure: {what}, not a real directory; never followed "
                                   "(remove it: the store recreates what it needs)"))

        found = self.unreal()
        if found is not None:
            report(*found)
            return out
        for name in DIRS:
            found = self.unreal(name)
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

    # -- what is on disk ---------------------------------------------------------------
    def scan(self, name: str) -> list[os.DirEntry[str]]:
        """What ``v1/<name>`` holds: nothing when it is missing, or when it is not a real
        directory (warned once: sweeping through a link would delete outside files)."""
        found = self.unreal(name)
        if found is not None:
            self.warn_link(*found)
            return []
        try:
            return list(os.scandir(self.base / name))
        except FileNotFoundError:
            return []

    def digests(self, *, warn: bool = True) -> Iterator[str]:
        """Digests of the entries on disk (the truth), unverified; never through a link."""
        found = self.unreal("entries")
        if found is not None:
            if warn:
                self.warn_link(*found)
            return
        try:
            shards = os.scandir(self.entries)
        except FileNotFoundError:
            return
        with shards:
            for shard in shards:
                if len(shard.name) != 2:
                    continue
                if not shard.is_dir(follow_symlinks=False):
                    if warn and shard.is_symlink():
                        self.warn_link(Path(shard.path), "a symlink")
                    continue
                with os.scandir(shard.path) as it:
                    for e in it:
                        if is_digest(e.name) and e.name.startswith(shard.name):
                            yield e.name

    def resolve(self, prefix: str) -> str:
        """The full digest of the one entry whose digest starts with ``prefix``."""
        p = prefix.strip().lower()
        if not p or any(c not in "0123456789abcdef" for c in p):
            raise errors.KeyNotFound(f"{prefix!r} is not a hex key prefix")
        if len(p) >= 2:
            found = self.unreal("entries", p[:2])
            if found is not None:
                raise link_error(*found)
            try:
                names = [n for n in os.listdir(self.entries / p[:2]) if is_digest(n)]
            except FileNotFoundError:
                names = []
        else:
            names = list(self.digests())
        return match_prefix(prefix, names)


def sweep_temp(layout: Layout, grace_s: float = TEMP_GRACE_S) -> int:
    """Remove staging leftovers whose owner is dead or which are older than ``grace_s``."""
    n = 0
    now = time.time()
    me = os.getpid()
    for it in layout.scan("tmp"):
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
