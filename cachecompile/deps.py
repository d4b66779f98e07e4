"""Hashes of the user source files a trace depended on, checked on every hit."""

from __future__ import annotations

import logging

import xxhash

logger = logging.getLogger(__name__)

_cache: dict[str, str | None] = {}


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


def changed(deps: dict[str, str]) -> list[str]:
    """The files among ``deps`` whose content differs from the recorded hash."""
    return [p for p, h in deps.items() if hash_file(p) != h]
