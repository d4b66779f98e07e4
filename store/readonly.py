"""Read-only access as a wrapper: lookups pass through without side effects;
every write raises :class:`~cachecompile.store.errors.ReadOnlyStoreError`, and publishing logs
one warning per store so that a read-only cache never floods the log."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .disk import Store
from .errors import ReadOnlyStoreError
from .keys import Key
from .outcomes import Entry, EntryInfo, GcReport, Hit, Miss, VerifyReport

logger = logging.getLogger(__name__)

__all__ = ["ReadOnlyStore"]


class ReadOnlyStore:
    """Wraps a :class:`Store`; lookups only. ``why`` says why it is read-only."""

    readonly = True

    def __init__(self, inner: Store, why: str = "opened read-only") -> None:
        self.inner = inner
        self.why = why
        self._warned = False

    def __repr__(self) -> str:
        return f"ReadOnlyStore({self.inner!r}, why={self.why!r})"

    @property
    def root(self) -> Path:
        return self.inner.root

    @property
    def max_size(self) -> int:
        return self.inner.max_size

    def refusal(self, what: str) -> ReadOnlyStoreError:
        """The error a write ``what`` ("purge entries"...) raises; says why it is read-only."""
        return ReadOnlyStoreError(f"cannot {what}: cache {self.root} is read-only ({self.why})")

    _refuse = refusal

    # -- reads: no hit recording, no quarantine (both would write) --------------------
    def get(self, key: Key | str) -> Hit | Miss:
        return self.inner.peek(key)

    def peek(self, key: Key | str) -> Hit | Miss:
        return self.inner.peek(key)

    def contains(self, key: Key | str) -> bool:
        return self.inner.contains(key)

    def stat(self, key: Key | str) -> EntryInfo | None:
        return self.inner.stat(key)

    def entry_dir(self, digest: str) -> Path:
        return self.inner.entry_dir(digest)

    def manifest(self, key: Key | str) -> dict[str, Any]:
        return self.inner.manifest(key)

    def entries(self) -> Iterator[EntryInfo]:
        return self.inner.entries()

    def digests(self) -> Iterator[str]:
        return self.inner.digests()

    def find(self, **labels: Any) -> list[EntryInfo]:
        return self.inner.find(**labels)

    def resolve(self, prefix: str) -> str:
        return self.inner.resolve(prefix)

    def stats(self) -> dict[str, Any]:
        s = self.inner.stats()
        s["readonly"] = True
        return s

    def verify(self, fix: bool = False) -> VerifyReport:
        if fix:
            raise self._refuse("fix entries")
        return self.inner.verify(fix=False)

    def record_miss(self, kind: str) -> None:
        pass  # counters live in the index, which we may not write

    @contextlib.contextmanager
    def lock(self, name: str, timeout: float = 600.0) -> Iterator[None]:
        # Nobody publishes through a read-only view, so there is nothing to serialise.
        yield None

    @contextlib.contextmanager
    def pin(self, entry: Entry | Key | str) -> Iterator[None]:
        # Pins are files under the root; eviction needs write access we lack anyway.
        yield None

    # -- writes ---------------------------------------------------------------------
    def put(
        self,
        key: Key,
        files: Mapping[str, Any],
        *,
        labels: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Entry:
        if not self._warned:
            self._warned = True
            logger.warning("cache %s is read-only (%s): publishing is disabled", self.root, self.why)
        raise self._refuse("publish")

    def delete(self, key: Key | str) -> bool:
        raise self._refuse("delete entries")

    def gc(self, max_size: int | None = None, **_: Any) -> GcReport:
        raise self._refuse("collect garbage")

    def purge(self, **_: Any) -> list[EntryInfo]:
        raise self._refuse("purge entries")

    def purge_plan(self, **kw: Any) -> tuple[list[EntryInfo], list[EntryInfo]]:
        return self.inner.purge_plan(**kw)  # only lists: what a purge would do

    def zero_stats(self) -> None:
        raise self._refuse("zero statistics")

    def reindex(self) -> int:
        raise self._refuse("reindex")

    def close(self) -> None:
        self.inner.close()
