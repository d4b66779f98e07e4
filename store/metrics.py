"""Counters of processes that may not write the store: one Prometheus text file each.

A read-only store (an image layer, a read-only mount) has an index nobody may write, so
its serving processes cannot count hits and misses there. Each such process keeps its
counters in memory and writes them, whenever they move (lookups are rare: the first call
of each signature), to ``<stats dir>/cachecompile-<host>-<pid>-<store>.prom`` in the Prometheus
text format, which a node exporter's textfile collector reads as is::

    cachecompile_counter{store="/opt/cachecompile",host="h",pid="42",name="hits"} 3
    cachecompile_counter{store="/opt/cachecompile",host="h",pid="42",name="miss:guard"} 1

``cachectl stats`` adds the files of the store's stats dir to the index's counters.
The stats dir is ``$CACHECOMPILE_STATS_DIR`` (point a fleet's collector there), else
``/tmp/cachecompile-<uid>/stats/<digest of the root>`` (``/tmp`` even where ``$TMPDIR``
says otherwise, so that a server and a shell agree): per user, per store, private. The
digest is of the root and the store's instance id (store/layout.py): a store deleted and
made again at the same path starts its counts at zero, not at its predecessor's.

The directory is created 0700 and must be a real directory owned by this user; a file
is read only if it is a regular file owned by this user (no symlink is followed).
Anything else is skipped with a log line: counters never fail a lookup.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from . import settings
from .layout import Layout

logger = logging.getLogger(__name__)

__all__ = ["ProcessCounters", "read_counters", "remove_counters", "stats_dir"]

METRIC = "cachecompile_counter"
_LINE = re.compile(r'^' + METRIC + r'\{(?P<labels>[^}]*)\}\s+(?P<value>-?[0-9]+)\s*$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_MAX_FILE = 1 << 20  # a counters file is a few hundred bytes; refuse to read a huge one


def stats_dir(root: Path | str) -> Path:
    """Where the counters of ``root``'s read-only processes go (see the module doc)."""
    explicit = settings.STATS_DIR.get()
    if explicit:
        return Path(explicit)
    resolved = Path(root).resolve()
    instance = Layout(resolved).instance()
    named = f"{resolved}\n{instance}" if instance else str(resolved)
    digest = hashlib.sha256(named.encode()).hexdigest()[:16]
    # /tmp itself, not $TMPDIR: a server and the shell that runs `cachectl stats` often
    # differ in TMPDIR (a launcher, a test harness), rarely in /tmp.
    base = Path("/tmp") if os.access("/tmp", os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    return base / f"cachecompile-{os.getuid()}" / "stats" / digest


def _own_dir(path: Path, create: bool) -> bool:
    """``path`` is (or, with ``create``, is made) a real directory owned by this user."""
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            logger.info("cannot create the stats dir %s: %s", path, e)
            return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        logger.warning("stats dir %s is not a directory owned by this user; counters of "
                       "read-only processes are not kept there", path)
        return False
    return True


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)


class ProcessCounters:
    """This process's counters for one store, written to its own file in the stats dir."""

    def __init__(self, root: Path | str, directory: Path | None = None) -> None:
        self.root = str(Path(root).resolve())
        self.directory = directory if directory is not None else stats_dir(root)
        self.host = socket.gethostname()
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()
        self._usable: bool | None = None
        self._pid = os.getpid()

    @property
    def path(self) -> Path:
        # One file per process and store: two stores of one process never overwrite.
        tag = hashlib.sha256(self.root.encode()).hexdigest()[:8]
        return self.directory / f"cachecompile-{self.host}-{os.getpid()}-{tag}.prom"

    def incr(self, counter: str, delta: int = 1) -> None:
        """Move a counter and rewrite this process's file; never raises."""
        with self._lock:
            if os.getpid() != self._pid:  # a forked child counts its own lookups
                self._pid = os.getpid()
                self.counters = {}
            self.counters[counter] = self.counters.get(counter, 0) + delta
            try:
                self._write()
            except OSError as e:
                logger.info("could not write the counters file %s: %s", self.path, e)

    def _write(self) -> None:
        if self._usable is None:
            self._usable = _own_dir(self.directory, create=True)
        if not self._usable:
            return
        base = (f'store="{_escape(self.root)}",host="{_escape(self.host)}",'
                f'pid="{os.getpid()}"')
        text = (f"# HELP {METRIC} cachecompile lookups of a read-only store, by outcome\n"
                f"# TYPE {METRIC} counter\n"
                + "".join(f'{METRIC}{{{base},name="{_escape(k)}"}} {v}\n'
                          for k, v in sorted(self.counters.items())))
        target = self.path
        fd, tmp = tempfile.mkstemp(prefix=".counters-", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, target)  # a collector never reads half a file
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _files(directory: Path) -> Iterable[Path]:
    if not _own_dir(directory, create=False):
        return []
    try:
        return sorted(p for p in directory.iterdir() if p.name.endswith(".prom"))
    except OSError:
        return []


def _read(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > _MAX_FILE:
            logger.info("skipping counters file %s (not a small regular file of this user)",
                        path)
            return None
        with os.fdopen(fd, "r", errors="replace") as f:
            fd = -1
            return f.read(_MAX_FILE)
    finally:
        if fd >= 0:
            os.close(fd)


def parse(text: str, root: str | None = None) -> dict[str, int]:
    """The counters in one file's text (only those of ``root``, when given)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group("labels"))}
        if "name" not in labels or (root is not None and labels.get("store") != root):
            continue
        out[labels["name"]] = out.get(labels["name"], 0) + int(m.group("value"))
    return out


def read_counters(root: Path | str, directory: Path | None = None) -> dict[str, int]:
    """The sum of the counters every read-only process of ``root`` wrote."""
    d = directory if directory is not None else stats_dir(root)
    total: dict[str, int] = {}
    for path in _files(d):
        text = _read(path)
        if text is None:
            continue
        for k, v in parse(text, str(Path(root).resolve())).items():
            total[k] = total.get(k, 0) + v
    return total


def remove_counters(root: Path | str, directory: Path | None = None) -> int:
    """Remove the counters files of ``root`` (``cachectl stats --zero``); how many."""
    d = directory if directory is not None else stats_dir(root)
    n = 0
    for path in _files(d):
        text = _read(path)
        if text is not None and parse(text, str(Path(root).resolve())):
            try:
                path.unlink()
                n += 1
            except OSError as e:
                logger.info("could not remove %s: %s", path, e)
    return n


def merge(counters: Mapping[str, int], extra: Mapping[str, int]) -> dict[str, int]:
    out = dict(counters)
    for k, v in extra.items():
        out[k] = out.get(k, 0) + v
    return out
