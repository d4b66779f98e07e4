"""The one writer of entries: a method's entry and a shared graph's program alike.

Both carry the same core (format, adapter, the backend's program, who published it: the
typed :class:`~cachecompile.entry.meta.EntryMeta`) and the same core labels (backend,
function, the code that wrote it), so ``cachectl`` reads them one way.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachecompile._version import code_label
from cachecompile.entry.meta import EntryMeta
from cachecompile.store import Key, LocalStorage
from cachecompile.store.outcomes import Entry


def publisher(who: str) -> dict[str, Any]:
    """Who wrote an entry: the process's own words, pid and host."""
    return {"who": who, "pid": os.getpid(), "host": socket.gethostname()}


def write(st: LocalStorage, key: Key, files: Mapping[str, bytes | Path], *, meta: EntryMeta,
          who: str, function: str, labels: Mapping[str, str] | None = None) -> Entry:
    """Publish one entry (atomically, then indexed: the store's ``put``): its ``meta`` as
    the typed record's JSON, stamped with who published it."""
    stamped = dataclasses.replace(meta, publisher=publisher(who))
    # The code that wrote it, as a label: `cachectl ls --label code=...` and
    # `cachectl gc --other-versions` find entries of other cachecompile code by the index.
    full_labels = {"backend": meta.adapter, "function": function, "code": code_label(),
                   **(labels or {})}
    return st.put(key, dict(files), labels=full_labels, meta=stamped.to_json())
