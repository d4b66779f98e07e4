"""A chain of variant entries: the one owner of their keys, their walk and their free slots.

A signature's key holds up to :data:`LIMIT` entries, one per set of guard values, at
variant indexes 0, 1, ...; so does each frame of a graph break under it (a *frame
variant*: a frame compiled after the signature's entry was made). Both are a
:class:`VariantChain`: keys derived here only (:meth:`VariantChain.key`), read in order up
to the first free index (the end of the chain: entries are published at the lowest free
index, and a gap left by eviction is refilled by the next publish), and published at the
first free index, or, with every index taken, over one whose source files changed, or
nowhere, said once (:meth:`VariantChain.publish`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from cachecompile.entry.meta import EntryMeta
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key import deps as deps_mod
from cachecompile.store import Entry, Hit, Key, LocalStorage, make_key
from cachecompile.store.errors import KeyNotFound, StoreError
from cachecompile.warm import collector

logger = logging.getLogger(__name__)

# A chain holds up to this many entries; past it, new variants run with a live compile.
LIMIT = 16


class ChainEnd(Exception):
    """No entry at this index: the end of the chain."""


class Vacated(Exception):
    """The entry at this index was removed while being read (``kind``: corrupt,
    insecure): the store quarantined it; the index is free again."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Unusable(Exception):
    """The entry at this index cannot be used (the store says why); the chain goes on."""


class VariantChain:
    """The variants of one signature (``frame_id`` None) or of one frame of it, in ``st``."""

    def __init__(self, st: LocalStorage, signature_key: Key, frame_id: str | None = None
                 ) -> None:
        self.st = st
        self.signature_key = signature_key
        self.frame_id = frame_id

    def key(self, i: int) -> Key:
        """The key of variant ``i``."""
        return self.key_of(self.signature_key, i, self.frame_id)

    @staticmethod
    def key_of(signature_key: Key, i: int, frame_id: str | None = None) -> Key:
        """The key of variant ``i`` of a signature, or of its frame ``frame_id`` (the only
        place a variant's key is derived)."""
        extra: dict[str, Any] = {"variant": i}
        if frame_id is not None:
            extra = {"dynamo_frame": frame_id, **extra}
        return make_key({**signature_key.factors, **extra})

    @staticmethod
    def signature_of(variant_key: Key) -> Key:
        """The signature's key a signature variant's key was derived from."""
        return make_key({k: v for k, v in variant_key.factors.items() if k != "variant"})

    def read(self, i: int) -> tuple[dict[str, Any], Hit | None]:
        """Variant ``i``'s meta: from its manifest where the local store has it (no file
        hashing, no hit counted), else through ``get`` (a remote tier downloads it, with
        the collector on), whose Hit is returned so that the load uses it (one lookup, one
        download). ChainEnd where there is none; Vacated where the store just quarantined
        it; Unusable where the store refuses it otherwise; StoreError and OSError where the
        store itself failed."""
        key = self.key(i)
        try:
            return dict(self.st.manifest(key)["meta"]), None
        except KeyNotFound:
            pass
        except StoreError:
            # A manifest that fails its digest: ``get`` verifies it again and quarantines
            # it, so it is warned about once, not on every run.
            pass
        collector.release()
        outcome = self.st.get(key)
        if isinstance(outcome, Hit):
            return dict(outcome.entry.meta), outcome
        if outcome.kind == "absent":
            raise ChainEnd()
        message = f"entry {key.digest[:12]} is unusable: {outcome.reason}"
        if outcome.kind in ("corrupt", "insecure"):
            raise Vacated(outcome.kind, message)
        raise Unusable(message)

    def _taken(self, i: int) -> bool:
        key = self.key(i)
        return self.st.contains(key) or isinstance(self.st.get(key), Hit)

    def _stale(self, i: int) -> bool:
        try:
            # Any format: a variant another release wrote is as reusable a slot.
            meta = EntryMeta.from_json(self.st.manifest(self.key(i))["meta"], any_format=True)
        except (StoreError, OSError, KeyError, UnsupportedProgramError):
            return False
        return bool(deps_mod.changed(dict(meta.deps)))

    @staticmethod
    def _serves(same: Callable[[Mapping[str, Any]], bool], meta: Mapping[str, Any]) -> bool:
        """``meta`` is the variant being published, and its source files are unchanged (a
        stale twin serves nobody: it is not "already there")."""
        try:
            return same(meta) and not deps_mod.changed(dict(meta.get("deps") or {}))
        except Exception:  # a record this code cannot read is not ours
            return False

    def publish(self, write: Callable[[Key, int], Entry],
                same: Callable[[Mapping[str, Any]], bool]) -> Key | None:
        """Publish a variant: at the first free index (``write(key, i)``), unless an entry
        there already is the same one (``same(meta)``, its sources unchanged: published by
        another process); with
        every index taken, over the first whose source files changed. Another process (a
        node through a remote tier) may take the same index at once: whichever entry is
        there after the write is read back, and a different one moves this one on. The key
        published at (or found), or None when the chain is full of live variants."""
        reclaimed = False
        i = 0
        while i < LIMIT:
            if self._taken(i):
                try:
                    if self._serves(same, self.st.manifest(self.key(i))["meta"]):
                        return self.key(i)
                except (StoreError, OSError, KeyError):
                    pass
                i += 1
                if i == LIMIT and not reclaimed:
                    stale = next((j for j in range(LIMIT) if self._stale(j)), None)
                    if stale is not None and self.st.delete(self.key(stale)):
                        reclaimed, i = True, stale
                continue
            entry = write(self.key(i), i)
            if self._serves(same, entry.meta):
                return self.key(i)
            i += 1
        return None
