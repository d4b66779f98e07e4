"""Read-only access as a wrapper: lookups pass through without side effects on the
store; every write raises :class:`~cachecompile.store.errors.ReadOnlyStoreError`, and
publishing logs one warning per store so that a read-only cache never floods the log.
Hits and misses are counted in this process's counters file
(:mod:`cachecompile.store.metrics`), which ``cachectl stats`` reads."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .disk import Store
from .errors import ReadOnlyStoreError
from .index import counter_scope, miss_counters
from .keys import Key
from .metrics import ProcessCounters, remove_counters
from .outcomes import Entry, EntryInfo, GcReport, Hit, Miss, VerifyReport
from .protocol import FileSource
from .wrapper import Wrapper

logger = logging.getLogger(__name__)

__all__ = ["ReadOnlyStore"]


class ReadOnlyStore(Wrapper[Store]):
    """Wraps a :class:`Store`; lookups only. ``why`` says why it is read-only.

    What it changes: ``get`` is the inner store's ``peek`` (recording a hit in the index
    or quarantining a bad entry would write); counters go to this process's counters
    file (the index may not be written); locks and pins do nothing; every write is
    refused. ``cachectl``'s reads (``stats``, ``verify``, a purge's plan) pass
    through; its writes are refused.
    """

    def __init__(self, inner: Store, why: str = "opened read-only") -> None:
        # Its own view of the store, whose index is read and never written (a read-only
        # file system cannot open it for writing at all); ``inner`` itself is unchanged.
        super().__init__(inner.reading())
        self.why = why
        self._warned = False
        self.counters = ProcessCounters(inner.root)

    def __repr__(self) -> str:
        return f"ReadOnlyStore({self.inner!r}, why={self.why!r})"

    @property
    def readonly(self) -> bool:
        return True

    def maintenance(self) -> ReadOnlyStore:
        """The store maintenance works on: this view (its writes are refused)."""
        return self

    @property
    def max_size(self) -> int:
        return self.inner.max_size

    def refusal(self, what: str) -> ReadOnlyStoreError:
        """The error a write ``what`` ("purge entries"...) raises; says why it is read-only."""
        return ReadOnlyStoreError(f"cannot {what}: cache {self.root} is read-only ({self.why})")

    def require_writable(self, what: str) -> None:
        raise self.refusal(what)

    # -- reads: no hit recording in the index, no quarantine (both would write) ----------
    def get(self, key: Key | str) -> Hit | Miss:
        outcome = self.inner.peek(key)
        if isinstance(outcome, Hit):
            self.count(counter_scope(key, outcome.entry.labels) + "hits")
        return outcome

    def record_miss(self, kind: str, about: str | None = None) -> None:
        for counter in miss_counters(kind, about):
            self.count(counter)

    def count(self, counter: str, delta: int = 1) -> None:
        self.counters.incr(counter, delta)

    @contextlib.contextmanager
    def lock(self, name: str, timeout: float = 600.0) -> Iterator[None]:
        # Nobody publishes through a read-only view, so there is nothing to serialise.
        yield None

    @contextlib.contextmanager
    def pin(self, entry: Entry | Key | str) -> Iterator[None]:
        # Pins are files under the root; eviction needs write access we lack anyway.
        yield None

    # -- writes --------------------------------------------------------------------------
    def put(self, key: Key, files: Mapping[str, FileSource], *,
            labels: Mapping[str, Any] | None = None,
            meta: Mapping[str, Any] | None = None) -> Entry:
        if not self._warned:
            self._warned = True
            logger.warning("cache %s is read-only (%s): publishing is disabled", self.root, self.why)
        raise self.refusal("publish")

    def delete(self, key: Key | str) -> bool:
        raise self.refusal("delete entries")

    def staging_dir(self, kind: str, tag: str = "", *, mode: int | None = None) -> Path:
        raise self.refusal("stage files")

    # -- maintenance (cachectl): reads pass through, writes are refused ------------------
    def stats(self, *, recount: bool = False) -> dict[str, Any]:
        return {**self.inner.stats(recount=recount), "readonly": True}

    def verify(self, fix: bool = False, *, full: bool = False) -> VerifyReport:
        if fix:
            raise self.refusal("fix entries")
        return self.inner.verify(fix=False, full=full)

    def purge_plan(
        self, *, keys: list[str] | None = None, labels: Mapping[str, Any] | None = None,
        older_than: float | None = None, all: bool = False, include_pinned: bool = False,
    ) -> tuple[list[EntryInfo], list[EntryInfo]]:
        # Only lists: what a purge would do.
        return self.inner.purge_plan(keys=keys, labels=labels, older_than=older_than, all=all,
                                     include_pinned=include_pinned)

    def resolve(self, prefix: str) -> str:
        return self.inner.resolve(prefix)

    def entry_dir(self, digest: str) -> Path:
        return self.inner.entry_dir(digest)

    def digests(self) -> Iterator[str]:
        return self.inner.digests()

    def gc(self, max_size: int | None = None, *, lock_timeout: float = 60.0) -> GcReport:
        raise self.refusal("collect garbage")

    def purge(self, *, keys: list[str] | None = None,
              labels: Mapping[str, Any] | None = None, older_than: float | None = None,
              all: bool = False, include_pinned: bool = False,
              dry_run: bool = False) -> list[EntryInfo]:
        raise self.refusal("purge entries")

    def zero_stats(self) -> None:
        # The index may not be written; the read-only processes' counters files may.
        remove_counters(self.root)

    def reindex(self) -> int:
        raise self.refusal("reindex")
