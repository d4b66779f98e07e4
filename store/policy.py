"""Eviction policy: a pure function over entry stats (no I/O), so it is testable
and replaceable. The store applies what it returns.

Entries may form **groups** (label ``group``: the entries of all ranks of one job for
one function and signature). A group is evicted or purged whole, never one rank of
it, so a restart never finds rank 0 warm and rank 3 cold. Its last use is its
members' latest; one pinned member protects the whole group.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .outcomes import EntryInfo

__all__ = ["expand_groups", "group_of", "lru_evictions", "older_than"]


def group_of(e: EntryInfo) -> str:
    """The unit of eviction: the entry's ``group`` label, else the entry itself."""
    return e.labels.get("group") or f"key:{e.key}"


def _units(entries: Sequence[EntryInfo]) -> dict[str, list[EntryInfo]]:
    units: dict[str, list[EntryInfo]] = {}
    for e in entries:
        units.setdefault(group_of(e), []).append(e)
    return units


def lru_evictions(
    entries: Sequence[EntryInfo], max_size: int, pinned: Collection[str] = ()
) -> list[EntryInfo]:
    """Entries to evict, least recently used group first, until the rest fit in ``max_size``.

    Pinned entries (and the groups they belong to) are never chosen; if the pinned
    ones alone exceed the cap, the result evicts every unpinned group and the total
    stays above the cap. Ties on last use break on creation then name, so the
    result is deterministic.
    """
    total = sum(e.size_bytes for e in entries)
    if total <= max_size:
        return []
    units = _units(entries)
    order = sorted(units.items(), key=lambda kv: (max(e.last_used for e in kv[1]),
                                                  max(e.created for e in kv[1]), kv[0]))
    out: list[EntryInfo] = []
    for _, members in order:
        if total <= max_size:
            break
        if any(e.key in pinned for e in members):
            continue
        out.extend(members)
        total -= sum(e.size_bytes for e in members)
    return out


def older_than(entries: Sequence[EntryInfo], cutoff: float) -> list[EntryInfo]:
    """Entries whose group was last used before ``cutoff`` (a UNIX timestamp)."""
    out: list[EntryInfo] = []
    for members in _units(entries).values():
        if max(e.last_used for e in members) < cutoff:
            out.extend(members)
    return out


def expand_groups(selected: Sequence[EntryInfo], universe: Sequence[EntryInfo]) -> list[EntryInfo]:
    """``selected`` plus every other member of the groups it touches."""
    groups = {group_of(e) for e in selected}
    return [e for e in universe if group_of(e) in groups]
