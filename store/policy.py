"""Eviction policy: a pure function over entry stats (no I/O), so it is testable
and replaceable. The store applies what it returns.

Entries may form **groups** (label ``group``: the entries of all ranks of one job for
one function and signature). A group is evicted or purged whole, never one rank of
it, so a restart never finds rank 0 warm and rank 3 cold. Its last use is its
members' latest; one pinned member protects the whole group.

Sizes against the cap are **physical**: entries that share content share one blob (a
hard link), so with ``blobs`` (entry key -> {content checksum: bytes}) each content
counts once, and evicting an entry frees only the contents no remaining entry holds.

Entries labelled ``kind=graph`` are **shared graphs**: programs that cachecompile's ranks
share, published as internal entries. They take space like any entry, but ``ls`` and
``stats`` count them apart from the user's own entries.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from .outcomes import EntryInfo

__all__ = ["Blobs", "expand_groups", "group_of", "has_labels", "is_shared_graph",
           "lru_evictions", "older_than", "physical_size", "split_pinned"]

# Entry key -> {content checksum: size}. Entries missing from it count at their logical size.
Blobs = Mapping[str, Mapping[str, int]]
SHARED_GRAPH_KIND = "graph"


def has_labels(labels: Mapping[str, str], want: Mapping[str, object]) -> bool:
    """Whether ``labels`` hold every ``want`` pair (values compared as strings, as labels
    are stored): the one selection by labels of ``find``, ``purge``, ``ls`` and ``push``."""
    return all(labels.get(k) == str(v) for k, v in want.items())


def is_shared_graph(labels: Mapping[str, str]) -> bool:
    """Whether labels mark an internal shared-graph entry (cachecompile/procs/coop.py sets them)."""
    return labels.get("kind") == SHARED_GRAPH_KIND


def _contents(e: EntryInfo, blobs: Blobs | None) -> Mapping[str, int]:
    held = blobs.get(e.key) if blobs is not None else None
    return held if held is not None else {f"entry:{e.key}": e.size_bytes}


def physical_size(entries: Sequence[EntryInfo], blobs: Blobs | None = None) -> int:
    """Bytes the entries take on disk: each distinct content once."""
    sizes: dict[str, int] = {}
    for e in entries:
        sizes.update(_contents(e, blobs))
    return sum(sizes.values())


def group_of(e: EntryInfo) -> str:
    """The unit of eviction: the entry's ``group`` label, else the entry itself."""
    return e.labels.get("group") or f"key:{e.key}"


def _units(entries: Sequence[EntryInfo]) -> dict[str, list[EntryInfo]]:
    units: dict[str, list[EntryInfo]] = {}
    for e in entries:
        units.setdefault(group_of(e), []).append(e)
    return units


def lru_evictions(
    entries: Sequence[EntryInfo], max_size: int, pinned: Collection[str] = (),
    blobs: Blobs | None = None,
) -> list[EntryInfo]:
    """Entries to evict, least recently used group first, until the rest fit in ``max_size``.

    Pinned entries (and the groups they belong to) are never chosen; if the pinned
    ones alone exceed the cap, the result evicts every unpinned group and the total
    stays above the cap. Ties on last use break on creation then name, so the
    result is deterministic. With ``blobs``, sizes are physical (see the module doc).
    """
    refs: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for e in entries:
        for content, n in _contents(e, blobs).items():
            refs[content] = refs.get(content, 0) + 1
            sizes[content] = n
    total = sum(sizes.values())
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
        for e in members:
            for content in _contents(e, blobs):
                refs[content] -= 1
                if refs[content] == 0:  # its last holder goes: the blob is freed
                    total -= sizes[content]
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


def split_pinned(selected: Sequence[EntryInfo],
                 pinned: Collection[str]) -> tuple[list[EntryInfo], list[EntryInfo]]:
    """(removable, kept): groups with a pinned member are kept whole, as gc keeps them."""
    held = {group_of(e) for e in selected if e.key in pinned}
    return ([e for e in selected if group_of(e) not in held],
            [e for e in selected if group_of(e) in held])
