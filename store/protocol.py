"""The storage protocols: one small one every tier implements, and the parts a cache
needs beyond it. Callers type against these, never against a concrete store.

::

    Storage          get / put / contains / delete / entries / stat: bytes and files only
    Catalog          where it is and whether it may be written; an entry's manifest
                     without its files; entries by labels; a miss of the caller's counted
    Locking          inter-process locks, and pins that keep gc off an entry in use
    LocalStorage     Storage + Catalog + Locking: what cachecompile uses (cached, coop)
    DiskStorage      LocalStorage + side-effect-free lookups, staging under its own
                     tmp/, counters, stats: what a tier wraps (tiered, bundle)
    OpenStore        DiskStorage + ``maintenance()``: what ``open_store`` returns,
                     with or without a remote tier behind the local store
    Maintenance      OpenStore + what ``cachectl`` does to the store on this node's disk:
                     resolve a prefix, gc, purge, verify, reindex, zero the counters;
                     ``require_writable`` (a capability with a default: writable)

:class:`~cachecompile.store.disk.Store` implements all of them. The features wrap one:
:class:`~cachecompile.store.readonly.ReadOnlyStore` (lookups only; a Maintenance whose
writes are refused) and :class:`~cachecompile.store.tiered.TieredStore` (a remote behind
a local store; an OpenStore whose ``maintenance()`` is the local store's), both through
:class:`~cachecompile.store.wrapper.Wrapper`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .errors import ReadOnlyStoreError
from .keys import Key
from .outcomes import Entry, EntryInfo, GcReport, Hit, Miss, VerifyReport

__all__ = ["Catalog", "DiskStorage", "FileSource", "LocalStorage", "Locking", "Maintenance",
           "OpenStore", "Owned", "Storage"]

FileSource = bytes | os.PathLike[str] | str


class Owned(os.PathLike[str]):
    """A file the store may take rather than copy: ``put`` hard-links it into ``blobs/``
    (one copy on disk, not two) when it lies under the store's own ``tmp/``, is a regular
    file with no other link and is ours; anywhere else it is copied like any path.

    For files a caller staged through the store's ``staging_dir`` and discards after the
    put (a bundle import): the put may change its mode, and the caller must not write
    to it again.
    """

    __slots__ = ("path",)

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"Owned({str(self.path)!r})"


@runtime_checkable
class Storage(Protocol):
    def get(self, key: Key | str) -> Hit | Miss:
        """Look up and verify an entry: ``Hit(entry)`` or ``Miss(reason, kind)``."""
        ...

    def put(
        self,
        key: Key,
        files: Mapping[str, FileSource],
        *,
        labels: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Entry:
        """Publish ``files`` under ``key`` atomically; an existing entry wins."""
        ...

    def contains(self, key: Key | str) -> bool: ...

    def delete(self, key: Key | str) -> bool: ...

    def entries(self) -> Iterator[EntryInfo]: ...

    def stat(self, key: Key | str) -> EntryInfo | None: ...


@runtime_checkable
class Catalog(Protocol):
    @property
    def root(self) -> Path: ...

    @property
    def readonly(self) -> bool:
        """True when every write is refused (ReadOnlyStoreError)."""
        ...

    def manifest(self, key: Key | str) -> dict[str, Any]:
        """An entry's parsed, digest-checked manifest, its files unchecked (no side effects)."""
        ...

    def find(self, **labels: Any) -> list[EntryInfo]: ...

    def record_miss(self, kind: str, about: str | None = None) -> None:
        """Count one lookup that found nothing to use, by ``kind`` (``absent``, ``guard``,
        ``stale``...) and, where given, what it was about (the failing guard's subject)."""
        ...


@runtime_checkable
class Locking(Protocol):
    def lock(self, name: str, timeout: float = 600.0) -> AbstractContextManager[Path | None]:
        """Hold an inter-process lock; LockTimeout (with the lock's path) after ``timeout``.
        Entering gives the lock file, or None where there is nothing to lock."""
        ...

    def pin(self, entry: Entry | Key | str) -> AbstractContextManager[object]:
        """Lease an entry so that gc keeps it while the lease is held."""
        ...


@runtime_checkable
class LocalStorage(Storage, Catalog, Locking, Protocol):
    """Everything cachecompile asks of a store."""


@runtime_checkable
class DiskStorage(LocalStorage, Protocol):
    """A store on this node's disk, as a tier wraps it."""

    def peek(self, key: Key | str) -> Hit | Miss:
        """Look up without side effects: no hit recorded, nothing quarantined."""
        ...

    def staging_dir(self, kind: str, tag: str = "", *, mode: int | None = None) -> Path:
        """A fresh private directory on the store's file system to stage files in."""
        ...

    def count(self, counter: str, delta: int = 1) -> None:
        """Move one of the store's counters (cachecompile.store.index); never raises."""
        ...

    def stats(self, *, recount: bool = False) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class OpenStore(DiskStorage, Protocol):
    """What :func:`~cachecompile.store.open_store` returns: the local store, or a remote
    tier behind it. Lookups and publishes go through it (a tier asks its remote on a
    local miss and uploads its puts); maintenance is the local store's alone."""

    def maintenance(self) -> Maintenance:
        """The store on this node's disk that ``cachectl`` maintains (gc, purge...)."""
        ...


@runtime_checkable
class Maintenance(OpenStore, Protocol):
    """The store on this node's disk, as ``cachectl`` (and a node's prepare step)
    maintains it. Its ``maintenance()`` is itself. A read-only one lists, verifies and
    plans a purge, and refuses every write with ReadOnlyStoreError."""

    @property
    def max_size(self) -> int:
        """The size cap gc enforces, in bytes."""
        ...

    def require_writable(self, what: str) -> None:
        """Raise the ReadOnlyStoreError a write ``what`` ("purge entries"...) would raise,
        before any work; nothing on a writable store (the default)."""
        if self.readonly:
            raise ReadOnlyStoreError(f"cannot {what}: cache {self.root} is read-only")

    def resolve(self, prefix: str) -> str:
        """The full digest of the one entry whose digest starts with ``prefix``
        (KeyNotFound, AmbiguousKey)."""
        ...

    def entry_dir(self, digest: str) -> Path: ...

    def digests(self) -> Iterator[str]:
        """Digests of the entries on disk, unverified."""
        ...

    def gc(self, max_size: int | None = None, *, lock_timeout: float = 60.0) -> GcReport:
        """Enforce the size cap (LRU, pinned entries skipped) and sweep leftovers."""
        ...

    def purge_plan(
        self, *, keys: list[str] | None = None, labels: Mapping[str, Any] | None = None,
        older_than: float | None = None, all: bool = False, include_pinned: bool = False,
    ) -> tuple[list[EntryInfo], list[EntryInfo]]:
        """(goes, kept) of a purge: read-only, so a read-only store answers it too."""
        ...

    def purge(
        self, *, keys: list[str] | None = None, labels: Mapping[str, Any] | None = None,
        older_than: float | None = None, all: bool = False, include_pinned: bool = False,
        dry_run: bool = False,
    ) -> list[EntryInfo]: ...

    def verify(self, fix: bool = False, *, full: bool = False) -> VerifyReport:
        """Check entries against their manifests (``fix``: quarantine the bad); an entry
        whose files still match the stamp of its last full check is not read again,
        unless ``full``."""
        ...

    def reindex(self) -> int: ...

    def zero_stats(self) -> None: ...
