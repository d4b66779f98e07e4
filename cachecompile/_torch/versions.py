"""Which torch this is, and which releases cachecompile is tested on.

Where the layer's code must differ between torch releases, the branches sit side by side
in the module that uses the name, on :func:`release`::

    if versions.at_least(2, 13):
        ...   # the 2.13+ spelling
    else:
        ...   # 2.11 and 2.12

so each difference is visible in one place. On a release outside :data:`SUPPORTED`,
``cache_compile`` runs as plain ``torch.compile`` (see :func:`unsupported`).

Everything here reads ``torch.__version__`` when asked, not at import: it is what a test
(or a user's odd build) sets, and it is what goes into every key.
"""

from __future__ import annotations

import re

import torch

# major.minor releases whose private names and replay behaviour the tests cover.
SUPPORTED = ("2.11", "2.12", "2.13", "2.14", "2.15")

_RELEASE = re.compile(r"(\d+)\.(\d+)")


def version() -> str:
    """The full version string, local build tag included (``2.13.0+cpu``, ``2.14.1+cu128``)."""
    return str(torch.__version__)


def git_version() -> str | None:
    """The commit torch was built from (two builds of one version may differ)."""
    return getattr(torch.version, "git_version", None)


def cuda() -> str | None:
    """The CUDA runtime torch was built against; None for a CPU or ROCm build."""
    return torch.version.cuda


def release() -> tuple[int, int] | None:
    """(major, minor) of the running torch; None if the version string is not one."""
    m = _RELEASE.match(version())
    return (int(m.group(1)), int(m.group(2))) if m else None


def at_least(major: int, minor: int) -> bool:
    """Whether the running torch is release ``major.minor`` or newer (False when its version
    string names no release): the one test the layer's side-by-side branches use."""
    rel = release()
    return rel is not None and rel >= (major, minor)


def unsupported() -> str | None:
    """Why this torch is outside what cachecompile is tested on, or None if it is inside."""
    rel = release()
    if rel is not None and f"{rel[0]}.{rel[1]}" in SUPPORTED:
        return None
    shown = f"{rel[0]}.{rel[1]}" if rel is not None else version()
    return (f"cachecompile is tested on torch {SUPPORTED[0]}-{SUPPORTED[-1]}; "
            f"torch {shown} runs as plain torch.compile")
