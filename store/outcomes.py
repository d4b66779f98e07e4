"""Value types of the store: lookup outcomes, entries, entry stats, reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Entry", "EntryInfo", "Hit", "Miss", "MissKind", "GcReport", "VerifyReport"]

# Why a lookup found no usable entry (the store's own reasons; cachecompile's lookup adds
# its own: a failed guard, another format...).
MissKind = Literal["absent", "corrupt", "insecure", "unreadable", "stale"]


@dataclass(frozen=True)
class Entry:
    """A verified entry. ``files`` maps names to real paths inside ``path``."""

    key: str
    path: Path
    files: dict[str, Path]
    manifest: dict[str, Any]

    @property
    def factors(self) -> dict[str, Any]:
        return dict(self.manifest["factors"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.manifest["labels"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.manifest["meta"])

    @property
    def created(self) -> float:
        return float(self.manifest["created"])

    @property
    def size_bytes(self) -> int:
        return sum(int(r["size"]) for r in self.manifest["files"].values())


@dataclass(frozen=True)
class Hit:
    entry: Entry
    found: Literal[True] = True

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class Miss:
    reason: str
    kind: MissKind = "absent"
    found: Literal[False] = False

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)  # slots: ls and gc hold one per entry (100,000+)
class EntryInfo:
    """Index record of one entry, as shown by ``cachectl ls``."""

    key: str
    size_bytes: int
    created: float
    last_used: float
    hits: int
    labels: dict[str, str] = field(default_factory=dict)
    state: str = "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "size_bytes": self.size_bytes,
            "created": self.created,
            "last_used": self.last_used,
            "hits": self.hits,
            "labels": dict(self.labels),
            "state": self.state,
        }


@dataclass
class GcReport:
    evicted: list[EntryInfo] = field(default_factory=list)
    freed_bytes: int = 0
    pinned_skipped: list[str] = field(default_factory=list)
    temp_swept: int = 0
    blobs_removed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    max_size: int = 0


@dataclass
class VerifyReport:
    checked: int = 0
    # Of those checked, the entries that matched the stamp of their last full check and
    # were not read again (``verify(full=True)`` reads every one).
    unchanged: int = 0
    # Of those checked, the shared graphs' programs (``cachectl ls`` lists them apart).
    shared_graphs: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)  # (digest, reason)
    index_missing: list[str] = field(default_factory=list)  # on disk, not in index
    # In the index, not on disk. Stays empty: verify drops such rows silently (the index
    # lagging the disk, e.g. a hit recorded as gc evicted the entry, is no damage).
    index_stale: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    reindexed: bool = False

    @property
    def ok(self) -> bool:
        return not (self.problems or self.index_missing or self.index_stale)
