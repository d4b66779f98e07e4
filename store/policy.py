"""Eviction policy: a pure function over entry stats (no I/O), so it is testable
and replaceable. The store applies what it returns."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .outcomes import EntryInfo

__all__ = ["lru_evictions", "older_than"]


def lru_evictions(
    entries: Sequence[EntryInfo], max_size: int, pinned: Collection[str] = ()
) -> list[EntryInfo]:
    """Entries to evict, least recently used first, until the rest fit in ``max_size``.

    Pinned entries are never chosen; if the pinned ones alone exceed the cap, the
    result evicts every unpinned entry and the total stays above the cap.
    Ties on ``last_used`` break on ``created`` then ``key`` so the result is deterministic.
    """
    total = sum(e.size_bytes for e in entries)
    if total <= max_size:
        return []
    out: list[EntryInfo] = []
    for e in sorted(entries, key=lambda e: (e.last_used, e.created, e.key)):
        if total <= max_size:
            break
        if e.key in pinned:
            continue
        out.append(e)
        total -= e.size_bytes
    return out


def older_than(entries: Sequence[EntryInfo], cutoff: float) -> list[EntryInfo]:
    """Entries last used before ``cutoff`` (a UNIX timestamp)."""
    return [e for e in entries if e.last_used < cutoff]
