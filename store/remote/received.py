"""What a blob's download has read: every tier's ``fetch_blob`` passes the bytes it gets
through one :class:`Received`, which counts and hashes them and reports progress, so that
the check after (size and SHA-256, :meth:`BlobRemote.download`) is the same on all."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator

__all__ = ["Received"]


class Received:
    """The bytes of one blob as they pass: :meth:`passing` wraps the tier's chunks;
    :attr:`result` is (bytes, SHA-256 hex) once they have passed."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self._h = hashlib.sha256()
        self.got = 0
        self._progress = progress

    def passing(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for data in chunks:
            self._h.update(data)
            self.got += len(data)
            if self._progress is not None:
                self._progress(len(data))
            yield data

    @property
    def result(self) -> tuple[int, str]:
        return self.got, self._h.hexdigest()
