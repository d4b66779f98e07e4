"""cachecompile's version and the digest of its own code: one leaf module, so that the key
(``key.factors``) and ``cachectl`` (torch-free) can name them without importing the
package face."""

from __future__ import annotations

import functools
import importlib.util
import os

import xxhash

__version__ = "0.1.0"

# The stored entry's format (cachecompile.entry.meta.EntryMeta; the key holds it):
# 2: Dynamo's guards carried per entry; variants per frame key; rebuilt constants.
# 3: Inductor programs import their stand-ins from cachecompile._torch.inductor_runtime.
#    Later additions are optional fields a format-3 reader does without (``checker``).
ENTRY_FORMAT = 3

# Folders of the package that never decide what an entry holds or how it is replayed:
# they read entries (the CLI) or use the package as a user does (the demo). The store
# installs as ``cachecompile.store`` from its own folder (editable) or inside the package
# (a wheel); it is hashed once, under ``store/``, either way.
_NOT_HASHED = frozenset({"cli", "demo", "store"})


def _sources(root: str, prefix: str) -> list[tuple[str, str]]:
    """(name relative to the package, path) of every module under ``root``; os.walk, not
    Path.rglob, which costs a warm start twice as much."""
    out: list[tuple[str, str]] = []
    for top, dirs, files in os.walk(root):
        rel = os.path.relpath(top, root).replace(os.sep, "/")
        rel = "" if rel == "." else rel + "/"
        if not prefix and not rel:
            dirs[:] = [d for d in dirs if d not in _NOT_HASHED]
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out.extend((prefix + rel + f, os.path.join(top, f)) for f in files if f.endswith(".py"))
    return out


@functools.cache
def code_digest() -> str:
    """XXH3-128 of the source of every cachecompile module that decides what is captured,
    stored or replayed (the package but its CLI and demo, and the store), by path
    relative to the package and content, so two installs of the same code agree.

    Every key holds it (``versions.cachecompile_code``): an entry written by other
    cachecompile code, a release or a local edit, is a named miss, never served without
    the guards a later fix added. torch keys Inductor's caches by a hash of its own
    source for the same reason (``torch._inductor.codecache.torch_key``). Computed once
    per process: reading ~100 small files costs about a millisecond."""
    package = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.find_spec("cachecompile.store")
    store = (os.path.dirname(os.path.abspath(spec.origin)) if spec is not None and spec.origin
             else os.path.join(package, "store"))
    h = xxhash.xxh3_128()
    for rel, path in sorted(_sources(package, "") + _sources(store, "store/")):
        with open(path, "rb") as f:
            data = f.read()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def code_label() -> str:
    """The ``code`` label of every entry: the first 16 hex digits of :func:`code_digest`
    (the key holds it whole), so ``cachectl`` finds entries of other code by the index."""
    return code_digest()[:16]
