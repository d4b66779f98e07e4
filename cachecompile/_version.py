"""cachecompile's version and the digest of its own code: one leaf module, so that the key
(``key.factors``) and ``cachectl`` (torch-free) can name them without importing the
package face."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time

import xxhash

__version__ = "0.1.0"

# The stored entry's format (cachecompile.entry.meta.EntryMeta; the key holds it):
# 2: Dynamo's guards carried per entry; variants per frame key; rebuilt constants.
# 3: Inductor programs import their stand-ins from cachecompile._torch.inductor_runtime.
#    Later additions are optional fields a format-3 reader does without (``checker``).
# 4: graph breaks (fullgraph=False): every frame Dynamo compiled for the call (``frames``,
#    ``graphs``, ``resumes``; entry.frame_records). A format-3 reader would run the method's
#    bytecode without the frames it calls, so it must refuse these entries by name.
ENTRY_FORMAT = 4

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
    per process, from the files' stamps where they are what a cache beside the
    bytecode says (:func:`tree_digest`)."""
    package, store = _roots()
    return tree_digest(package, store, os.path.join(package, "__pycache__"),
                       write=not sys.dont_write_bytecode)


def save_code_digest() -> str:
    """Write the digest's cache beside the package's bytecode, as byte-compiling an
    install does (whatever ``PYTHONDONTWRITEBYTECODE`` says); the digest."""
    package, store = _roots()
    return tree_digest(package, store, os.path.join(package, "__pycache__"), write=True)


def _roots() -> tuple[str, str]:
    package = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.find_spec("cachecompile.store")
    store = (os.path.dirname(os.path.abspath(spec.origin)) if spec is not None and spec.origin
             else os.path.join(package, "store"))
    return package, store


# The digest's cache: one small JSON file beside the package's bytecode.
_CACHE = f"cachecompile-code.{sys.implementation.cache_tag}.json"
# Files whose last change is at least this old are cached by their stamps.
_SETTLED_NS = 2_000_000_000


def tree_digest(package: str, store: str, cache_dir: str, *, write: bool) -> str:
    """:func:`code_digest` of the sources under ``package`` and ``store``.

    Reading ~90 files cost a warm start 2-15 ms (loaded machine); their stamps (size,
    mtime and ctime in ns, inode) cost a stat each. Where ``cache_dir`` holds the digest
    for exactly these stamps it is that; else the files are read and hashed (and, with
    ``write``, the cache written). An edit changes a file's mtime and ctime (a replace,
    as editors and git do it, its inode too), so edited source is read again: the same
    rule Python's bytecode cache keeps, on more of each file's stat."""
    files = sorted(_sources(package, "") + _sources(store, "store/"))
    stamp = xxhash.xxh3_128()
    newest = 0
    for rel, path in files:
        st = os.stat(path)
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
        stamp.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0"
                     f"{st.st_ino}\0".encode())
    stamps = stamp.hexdigest()
    cache = os.path.join(cache_dir, _CACHE)
    # A file changed within the clock's granularity of now may change again with the
    # same stamps (git's "racily clean" files): neither believed nor cached then.
    settled = time.time_ns() - newest > _SETTLED_NS
    try:
        if settled:
            with open(cache, encoding="utf-8") as f:
                found = json.load(f)
            if (isinstance(found, dict) and found.get("stamps") == stamps
                    and isinstance(found.get("digest"), str)):
                return str(found["digest"])
    except (OSError, ValueError):
        pass    # none yet, or unreadable: read the sources
    h = xxhash.xxh3_128()
    for rel, path in files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    digest = h.hexdigest()
    if write and settled:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"stamps": stamps, "digest": digest}, f)
            os.replace(tmp, cache)
        except OSError:
            pass    # a read-only install: read the sources in every process
    return digest


def code_label() -> str:
    """The ``code`` label of every entry: the first 16 hex digits of :func:`code_digest`
    (the key holds it whole), so ``cachectl`` finds entries of other code by the index."""
    return code_digest()[:16]
