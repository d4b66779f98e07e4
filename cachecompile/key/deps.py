"""Hashes of the user source files a trace depended on, checked on every hit.

A file is recorded by the module it defines (``module:pkg.helpers``) where it is one, so
that a second checkout of the same code at another path checks *its own* files: keyed
by absolute path, an edit in checkout B would be checked against A's unchanged file.
Files that are no importable module (a script run as ``__main__``) stay keyed by path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import xxhash

logger = logging.getLogger(__name__)

_cache: dict[str, str | None] = {}
# A loaded module's file resolved, per ``__file__`` string: by_module resolved every loaded
# module's file on each cold capture (~3,000 after transformers: ~0.2 s a frame).
_resolved: dict[str, str] = {}


def _realpath(f: str) -> str:
    if not os.path.isabs(f):
        return os.path.realpath(f)   # relative to a working directory that may change
    r = _resolved.get(f)
    if r is None:
        r = _resolved[f] = os.path.realpath(f)
    return r


def hash_file(path: str) -> str | None:
    """XXH3-128 of a file's bytes, memoised per process; None if unreadable."""
    if path in _cache:
        return _cache[path]
    try:
        with open(path, "rb") as f:
            digest: str | None = xxhash.xxh3_128_hexdigest(f.read())
    except OSError:
        digest = None
    _cache[path] = digest
    return digest


def by_module(files: dict[str, str]) -> dict[str, str]:
    """``{path: digest}`` -> ``{"module:name" | "path:/abs": digest}``."""
    owners: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and name != "__main__" and not name.startswith("cachecompile_k"):
            owners.setdefault(_realpath(f), name)
    out: dict[str, str] = {}
    for path, digest in files.items():
        owner = owners.get(os.path.realpath(path))
        out[f"module:{owner}" if owner else f"path:{path}"] = digest
    return dict(sorted(out.items()))


def _locate(ident: str) -> str | None:
    kind, _, rest = ident.partition(":")
    if kind == "path":
        return rest
    if kind != "module":
        return None
    mod = sys.modules.get(rest)
    f = getattr(mod, "__file__", None) if mod is not None else None
    if f:
        return str(f)
    try:
        spec = importlib.util.find_spec(rest)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def changed(deps: dict[str, str]) -> list[str]:
    """The recorded dependencies whose current file differs from the recorded hash."""
    out: list[str] = []
    for ident, digest in deps.items():
        path = _locate(ident)
        if path is None or hash_file(path) != digest:
            out.append(ident.partition(":")[2] or ident)
    return out
