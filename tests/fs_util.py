"""A shared directory seen by two "nodes" at two mount points, for the file:// tier's tests.

A real NFS mount on loopback is what the tier is for, but this machine cannot make one:
its kernel (a Firecracker VM's) has neither the NFS client nor nfsd built in
(/proc/filesystems lists no ``nfs``/``nfs4``/``nfsd``) and loads no modules, so neither
Debian's nfs-kernel-server nor nfs-ganesha (whose exports still need the kernel's client
to mount) can give a mount. What stands in: one tmpfs mounted at ``<tmp>/node-a`` and
bind-mounted at ``<tmp>/node-b`` (two mount points, two paths, one filesystem, as two
nodes mount one export); where mounting is refused (not root), one plain directory that
both nodes use, and :attr:`SharedDir.how` says which ran.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NO_NFS = ("no NFS mount on this machine: its kernel has no NFS client or server built in "
          "(/proc/filesystems) and loads no modules")


def nfs_available() -> bool:
    with contextlib.suppress(OSError):
        names = Path("/proc/filesystems").read_text().split()
        return "nfs" in names or "nfs4" in names
    return False


@dataclass
class SharedDir:
    """The share's root as node A and node B see it, and how it was made."""

    a: Path
    b: Path
    how: str

    def url(self, node: str = "a", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        root = self.a if node == "a" else self.b
        return f"file://{root}/cc" + (f"?{query}" if query else "")


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def shared_dir(tmp: Path) -> Iterator[SharedDir]:
    """Two mount points of one tmpfs (root), else one directory; ``<root>/cc`` made,
    mode 0700, as an operator makes the tier's root."""
    a, b = tmp / "node-a", tmp / "node-b"
    a.mkdir(parents=True)
    b.mkdir()
    mounted: list[Path] = []
    try:
        if os.geteuid() == 0 and _mount("-t", "tmpfs", "-o", "size=256m,mode=0700", "tmpfs",
                                        str(a)):
            mounted.append(a)
            if _mount("--bind", str(a), str(b)):
                mounted.append(b)
                how = "tmpfs at two mount points (a bind mount)"
            else:
                b.rmdir()
                b = a
                how = "one tmpfs, one mount point (bind mount refused)"
        else:
            b.rmdir()
            b = a
            how = "one plain directory (mounting refused)"
        (a / "cc").mkdir(mode=0o700)
        yield SharedDir(a, b, how)
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
