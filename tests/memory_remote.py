"""An in-memory remote: the shared upload/download flow (store/remote/base.py's BlobRemote) over dicts,
so the tier's logic is tested without a server as well as against the real ones.

``down = True`` makes every call fail as a dead server would (through the breaker).
"""

from __future__ import annotations

import hashlib
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from cachecompile.store import errors
from cachecompile.store.fsutil import write_new_file
from cachecompile.store.outcomes import Entry
from cachecompile.store.remote.base import BlobRemote, RemoteConfig, refuse_readonly
from cachecompile.store.signing import Trust


class MemoryRemote(BlobRemote):
    kind = "memory"

    def __init__(self, trust: Trust, *, readonly: bool = False,
                 config: RemoteConfig | None = None) -> None:
        super().__init__(config or RemoteConfig(url="memory://", target="memory",
                                                kind=self.kind, readonly=readonly,
                                                backoff=0.05, max_backoff=0.05),
                         trust)
        self.records_: dict[str, bytes] = {}
        self.blobs: dict[str, bytes] = {}
        self.down = False
        self.calls = 0
        self._lock = threading.Lock()

    # -- its URL (made by the tests, not parsed; a subclass that registers a scheme is) ----
    @classmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        if rest:
            raise ValueError(f"{cls.kind}:// takes no parameters")
        return parts.netloc or cls.kind, parts.path.strip("/") or cls.default_prefix

    @classmethod
    def display_of(cls, target: str, prefix: str) -> str:
        return f"{cls.kind}://{target}/{prefix}"

    # -- plumbing ----------------------------------------------------------------------
    def _io(self, what: str) -> None:
        self.breaker.guard(what)
        self.calls += 1
        if self.down:
            e = ConnectionRefusedError(f"{what}: memory remote is down")
            self.breaker.failed(e)
            raise errors.RemoteError(str(e))
        self.breaker.ok()

    # -- Blobs -------------------------------------------------------------------------
    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        self._io("get record")
        raw = self.records_.get(digest)
        return None if raw is None else (raw, raw)

    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        self._io("put record")
        with self._lock:
            if self.records_.get(digest) != tag:
                return False
            self.records_[digest] = data
            return True

    def put_blobs(self, entry: Entry, sha: dict[str, str],
                  progress: Callable[[int], None] | None) -> dict[str, int]:
        self._io("put blobs")
        for name, s in sha.items():
            if s not in self.blobs or s in self.bad_blobs:
                self.blobs[s] = Path(entry.files[name]).read_bytes()
                self.bad_blobs.discard(s)
        return {s: max(len(self.blobs[s]), 1) for s in sha.values()}

    def fetch_blob(self, digest: str, name: str, sha: str, size: int, chunk: int,
                   target: Path, mode: int,
                   progress: Callable[[int], None] | None) -> tuple[int, str]:
        self._io("get blob")
        data = self.blobs.get(sha)
        if data is None:
            raise errors.CorruptEntryError(digest, f"the blob of {name!r} is gone")
        write_new_file(target, [data], mode)
        return len(data), hashlib.sha256(data).hexdigest()

    # -- Remote --------------------------------------------------------------------------
    def ping(self) -> bool:
        self._io("ping")
        return True

    def contains(self, digest: str) -> bool:
        self._io("exists")
        return digest in self.records_

    def raw_records(self) -> Iterator[tuple[str, bytes | None]]:
        self._io("list")
        return iter(list(self.records_.items()))

    def delete(self, digest: str) -> bool:
        refuse_readonly(self.config)
        self._io("delete")
        return self.records_.pop(digest, None) is not None

    def sweep(self) -> int:
        refuse_readonly(self.config)
        used = {s for r in self.records() for s in r.sha256.values()}
        gone = [s for s in self.blobs if s not in used]
        for s in gone:
            del self.blobs[s]
        return len(gone)

    def info(self) -> dict[str, Any]:
        return {"objects": len(self.records_) + len(self.blobs),
                "stored_bytes": sum(map(len, self.blobs.values()))}

    def close(self) -> None:
        return None


def tamper(remote: MemoryRemote, sha: str) -> None:
    """Flip a byte of one stored blob (bit rot, or an attacker with write access)."""
    data = bytearray(remote.blobs[sha])
    data[0] ^= 0xFF if data else 0
    remote.blobs[sha] = bytes(data) or os.urandom(1)
