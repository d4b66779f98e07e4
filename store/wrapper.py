"""The base of the features that wrap a store (read-only, tiered): each holds an
``inner`` store, passes every protocol operation on to it, and overrides only what the
feature changes, so reading a feature's class shows exactly what it does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Generic, TypeVar

from .keys import Key
from .outcomes import Entry, EntryInfo, Hit, Miss
from .protocol import DiskStorage, FileSource

logger = logging.getLogger(__name__)

__all__ = ["Wrapper"]

S = TypeVar("S", bound=DiskStorage)


class Wrapper(Generic[S]):
    """Implements :class:`~cachecompile.store.protocol.DiskStorage` by delegating to ``inner``."""

    def __init__(self, inner: S) -> None:
        self.inner = inner

    @property
    def root(self) -> Path:
        return self.inner.root

    @property
    def readonly(self) -> bool:
        return self.inner.readonly

    # -- Storage -------------------------------------------------------------------------
    def get(self, key: Key | str) -> Hit | Miss:
        return self.inner.get(key)

    def put(self, key: Key, files: Mapping[str, FileSource], *,
            labels: Mapping[str, Any] | None = None,
            meta: Mapping[str, Any] | None = None) -> Entry:
        return self.inner.put(key, files, labels=labels, meta=meta)

    def contains(self, key: Key | str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: Key | str) -> bool:
        return self.inner.delete(key)

    def entries(self) -> Iterator[EntryInfo]:
        return self.inner.entries()

    def stat(self, key: Key | str) -> EntryInfo | None:
        return self.inner.stat(key)

    # -- Catalog and Locking -------------------------------------------------------------
    def manifest(self, key: Key | str) -> dict[str, Any]:
        return self.inner.manifest(key)

    def find(self, **labels: Any) -> list[EntryInfo]:
        return self.inner.find(**labels)

    def record_miss(self, kind: str, about: str | None = None) -> None:
        self.inner.record_miss(kind, about)

    def lock(self, name: str, timeout: float = 600.0) -> AbstractContextManager[Path | None]:
        return self.inner.lock(name, timeout)

    def pin(self, entry: Entry | Key | str) -> AbstractContextManager[object]:
        return self.inner.pin(entry)

    # -- DiskStorage ---------------------------------------------------------------------
    def peek(self, key: Key | str) -> Hit | Miss:
        return self.inner.peek(key)

    def staging_dir(self, kind: str, tag: str = "", *, mode: int | None = None) -> Path:
        return self.inner.staging_dir(kind, tag, mode=mode)

    def count(self, counter: str, delta: int = 1) -> None:
        self.inner.count(counter, delta)

    def stats(self, *, recount: bool = False) -> dict[str, Any]:
        return self.inner.stats(recount=recount)

    def close(self) -> None:
        self.inner.close()
