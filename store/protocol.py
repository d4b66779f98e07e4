"""The one small storage protocol every tier implements and every feature wraps.

get / put / contains / delete / iterate (``entries``) / stat. A remote tier (e.g.
Redis) or a tiered store with backfill implements this and wraps another Storage;
read-only is such a wrapper already (:class:`cachecompile.store.readonly.ReadOnlyStore`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from .keys import Key
from .outcomes import Entry, EntryInfo, Hit, Miss

__all__ = ["Storage", "FileSource"]

FileSource = bytes | os.PathLike[str] | str


@runtime_checkable
class Storage(Protocol):
    def get(self, key: Key | str) -> Hit | Miss: ...

    def put(
        self,
        key: Key,
        files: Mapping[str, FileSource],
        *,
        labels: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Entry: ...

    def contains(self, key: Key | str) -> bool: ...

    def delete(self, key: Key | str) -> bool: ...

    def entries(self) -> Iterator[EntryInfo]: ...

    def stat(self, key: Key | str) -> EntryInfo | None: ...
