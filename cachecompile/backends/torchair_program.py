"""TorchAir's stored program: its generated code executed as a module, the GE cache and
static-kernel dirs pointed at private staging or private views of an entry's files, and
the input gears checked on every call of a hit.

Entry files are read-only hard links in the store: GE never gets the entry directory
itself. :func:`private_view` gives it a private directory of symlinks to them instead.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cachecompile.backends.base import GraphCallable
from cachecompile.entry import files as entry_files
from cachecompile.errors import GearMismatchError, UnsupportedProgramError
from cachecompile.store.jsonvalue import JSON

PROGRAM_FILE = entry_files.TORCHAIR_PROGRAM
GE_CACHE_PREFIX = "ge_cache/"
STATIC_KERNEL_PREFIX = "static_kernel/"


# -- staging ------------------------------------------------------------------------------
_TEMP_DIRS: list[str] = []


def temp_dir(prefix: str) -> Path:
    """A private directory removed at exit (GE writes or reads through it)."""
    if not _TEMP_DIRS:
        atexit.register(_remove_temp_dirs)
    d = tempfile.mkdtemp(prefix=prefix)
    _TEMP_DIRS.append(d)
    return Path(d)


def _remove_temp_dirs() -> None:
    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def staged_files(root: Path, prefix: str) -> dict[str, Path]:
    out: dict[str, Path] = {}
    if not root.is_dir():
        return out
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[prefix + p.relative_to(root).as_posix()] = p
    return out


def private_view(files: Mapping[str, Path], prefix: str, tag: str) -> Path:
    """A writable private dir of symlinks to an entry's read-only files under ``prefix``."""
    d = temp_dir(f"cachecompile-{tag}-")
    for rel, path in files.items():
        if rel.startswith(prefix):
            dst = d / rel[len(prefix):]
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.realpath(path), dst)
    return d


# -- the program --------------------------------------------------------------------------
def exec_program(src: str, filename: str) -> types.ModuleType:
    """TorchAir's ``_compile_py_code``, with a real file name for tracebacks."""
    mod = types.ModuleType("cachecompile_torchair_program")
    mod.__file__ = filename
    exec(compile(src, filename, "exec"), mod.__dict__)  # verified, owned entry
    return mod


def point_dirs(mod: types.ModuleType, ge_dir: Path | None, static_dir: Path | None) -> None:
    """Point a program's GE cache and static-kernel builds at ``ge_dir`` / ``static_dir``
    (each None where that feature is off), through the hooks TorchAir's code defines."""
    for where, hook, feature in ((ge_dir, "_update_ge_cache_dir", "ge_cache is on"),
                                 (static_dir, "_update_static_kernel_cache_dir",
                                  "static kernels are on")):
        if where is None:
            continue
        update = getattr(mod, hook, None)
        if update is None:
            raise UnsupportedProgramError(f"torchair's code has no {hook} although {feature}")
        update(str(where))


def gears_of(args: Sequence[Any]) -> dict[str, JSON]:
    """Input index -> {dim: gears} for inputs marked with torchair's set_dim_gears."""
    out: dict[str, JSON] = {}
    for i, a in enumerate(args):
        g = getattr(a, "dim_gears", None) if isinstance(a, torch.Tensor) else None
        if g:
            out[str(i)] = {str(d): list(v) for d, v in sorted(g.items())}
    return out


def with_gear_check(kernel: Callable[..., Any], gears: Mapping[str, JSON]) -> GraphCallable:
    # Gears are not part of the call signature (a hook in signature.py would make them a
    # key factor, see docs/ascend.md); until then, check them on every call of a hit
    # instead of running a GE graph built for other gears.
    def compiled_fn(*args: Any) -> Any:
        seen = gears_of(args)
        if seen != gears:
            raise GearMismatchError(
                f"this cached program was compiled for input gears {dict(gears) or 'none'}, "
                f"but the call's inputs carry {seen or 'none'}; set_dim_gears must be the "
                "same on every run (or clear the cache entry)")
        return kernel(*args)

    return compiled_fn
