"""The local disk store: the facade over the store's parts, one module per role.

    layout.py        paths, root checks, the refusal to follow symlinks, staging dirs
    verification.py  inspect an entry (manifest digest, sizes, checksums), quarantine
    blobs.py         content stored once (hard links), what removing an entry frees
    publishing.py    stage, fsync, rename, then index; take away, then delete
    pins.py          filelocks and pins (leases that keep gc off an entry)
    maintenance.py   listing, gc, purge, verify/reindex, stats, sweeps
    index.py         the SQLite index of records and counters (a cache of manifests)

:class:`Store` holds a :class:`~cachecompile.store.layout.Layout` and an
:class:`~cachecompile.store.index.Index` and turns each operation into a call of the
module that owns it: read the role's module to see how an operation works.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# publishing and maintenance are imported by the methods that use them: a hit (get)
# reads, checks and records, and needs neither (issue 63: a third of the store's import
# time in a warm start).
from . import errors, pins, settings, verification
from .blobs import blob_map
from .fsutil import FULL_ERRNOS
from .index import Index, counter_scope, miss_counters
from .keys import Key, digest_of
from .layout import FORMAT_DIR, MANIFEST, TEMP_GRACE_S, Layout, sweep_temp
from .manifest import check_names, validate_name
from .outcomes import Entry, EntryInfo, GcReport, Hit, Miss, VerifyReport
from .pins import Pin
from .policy import has_labels
from .protocol import FileSource, Maintenance

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_SIZE", "FORMAT_DIR", "Pin", "Store", "TEMP_GRACE_S"]

DEFAULT_MAX_SIZE = settings.MAX_SIZE.default


class Store(Maintenance):
    """A local, content-addressed artifact store. Build it with
    :func:`cachecompile.store.open_store`.

    Implements :class:`~cachecompile.store.protocol.Maintenance` (and so every storage
    protocol): the maintenance operations (gc, purge, verify, stats...) are its own,
    for ``cachectl``. Subclassed, not only matched, for the protocol's defaults.
    """

    readonly = False

    def __init__(self, root: Path, *, max_size: int = DEFAULT_MAX_SIZE,
                 shared_group: bool = False, hits_later: bool = False) -> None:
        self.layout = Layout(root, shared_group=shared_group)
        self._max_size = int(max_size)
        # hits_later: a serving process's hits are written together, a moment after its
        # first calls (see cachecompile.store.index).
        self.index = Index(self.layout.index, guard=lambda: self.layout.real("index"),
                           on_unsafe=self.layout.warn_unsafe_index, shared=shared_group,
                           hits_later=hits_later)
        # Pins taken through this store last as long as it does (usually the process).
        self._held_pins: list[Pin] = []
        self._gc_failed = False  # an automatic gc failed (warned once)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r}, max_size={self.max_size})"

    def reading(self) -> Store:
        """Another view of this store whose index is opened read-only (ReadOnlyStore's)."""
        view = copy.copy(self)
        view.index = self.index.reader()
        view._held_pins = []
        return view

    @property
    def max_size(self) -> int:
        return self._max_size

    @property
    def root(self) -> Path:
        return self.layout.root

    @property
    def base(self) -> Path:
        return self.layout.base

    @property
    def shared_group(self) -> bool:
        return self.layout.shared_group

    def maintenance(self) -> Store:
        """The store on this node's disk that maintenance works on: this one."""
        return self

    digest_of = staticmethod(digest_of)

    # -- layout --------------------------------------------------------------------------
    def create_layout(self) -> None:
        self.layout.create()

    def check_root(self) -> None:
        """Raise InsecureStoreError unless root (and v1/) are trusted."""
        self.layout.check_root()

    def entry_dir(self, digest: str) -> Path:
        return self.layout.entry_dir(digest)

    def staging_dir(self, kind: str, tag: str = "", *, mode: int | None = None) -> Path:
        """A fresh directory under ``tmp/`` to stage a write in (see Layout.staging_dir)."""
        return self.layout.staging_dir(kind, tag, mode=mode)

    # -- lookup --------------------------------------------------------------------------
    def peek(self, key: Key | str) -> Hit | Miss:
        """Look up without side effects: no hit recorded, nothing quarantined."""
        try:
            return Hit(verification.inspect(self.layout, digest_of(key)))
        except verification.Bad as b:
            return Miss(reason=b.reason, kind=b.kind)

    def get(self, key: Key | str) -> Hit | Miss:
        """Look up and verify an entry; record the hit; quarantine a bad entry.

        A miss is not counted here: one user lookup may probe several keys (a frame's
        variants, a remote tier behind this one), and only the caller knows what the
        lookup came to. It says so once, with :meth:`record_miss`."""
        digest = digest_of(key)

        def bad(b: verification.Bad) -> None:
            # Proven bad while the entry was still the one under the key (an entry that
            # went away while it was read is a plain absent miss, and never gets here).
            logger.warning("entry %s is %s: %s; quarantining it", digest, b.kind, b.reason)
            self.count("corruptions")
            self.quarantine(digest, b.reason, ident=b.ident)

        try:
            entry = verification.inspect(self.layout, digest, on_bad=bad)
        except verification.Bad as b:
            if b.link is not None:
                self.layout.warn_link(*b.link)
            return Miss(reason=b.reason, kind=b.kind)
        counter = counter_scope(key, entry.labels) + "hits"
        self.index.safely(
            "hit",
            lambda: self.index.record_hit(digest, entry.size_bytes, entry.created, entry.labels,
                                          counter=counter,
                                          blobs=blob_map(entry.manifest)),
        )
        return Hit(entry)

    def contains(self, key: Key | str) -> bool:
        digest = digest_of(key)
        if self.layout.unreal("entries", digest[:2]) is not None:
            return False
        return (self.entry_dir(digest) / MANIFEST).is_file()

    def stat(self, key: Key | str) -> EntryInfo | None:
        """The index record of an entry (built from its manifest if the index lacks it)."""
        from . import maintenance
        digest = digest_of(key)
        info = self.index.safely("stat", lambda: self.index.get(digest))
        if info is not None:
            return info
        try:
            m = verification.read_manifest(self.layout, digest)
        except errors.StoreError:
            return None
        return maintenance.info_from_manifest(digest, m, state="unindexed")

    def manifest(self, key: Key | str) -> dict[str, Any]:
        """The parsed manifest of an entry, without verifying its files.

        Raises KeyNotFound, or ManifestError when the manifest fails its integrity digest
        (this read has no side effects: ``get`` is what quarantines). The manifest is
        parsed and digest-checked once per process and shared: do not modify it.
        """
        return verification.read_manifest(self.layout, digest_of(key), remember=True)

    def digests(self) -> Iterator[str]:
        """Digests of the entries on disk (the truth), unverified; never through a link."""
        return self.layout.digests()

    def entries(self) -> Iterator[EntryInfo]:
        """One EntryInfo per entry on disk; usage data from the index."""
        from . import maintenance
        yield from maintenance.listing(self.layout, self.index, with_blobs=False)[0]

    def find(self, **labels: Any) -> list[EntryInfo]:
        return [i for i in self.entries() if has_labels(i.labels, labels)]

    def resolve(self, prefix: str) -> str:
        """The full digest of the one entry whose digest starts with ``prefix``."""
        return self.layout.resolve(prefix)

    # -- counters ------------------------------------------------------------------------
    def count(self, counter: str, delta: int = 1) -> None:
        """Move an index counter (see cachecompile.store.index); never fails the caller."""
        self.index.safely(counter, lambda: self.index.incr(counter, delta))

    def record_miss(self, kind: str, about: str | None = None) -> None:
        """Count the outcome of one lookup that found nothing to use: ``absent``, ``guard``
        (an entry was there, its guards did not hold), ``stale``, ``corrupt``...; a kind
        ``graph:<kind>`` counts a shared graph's (see :func:`counter_scope`). ``about``
        (the failing guard's subject, ``input_ids``) is counted too, under ``about:``."""
        for counter in miss_counters(kind, about):
            self.count(counter)

    # -- publish and remove --------------------------------------------------------------
    def put(
        self,
        key: Key,
        files: Mapping[str, FileSource],
        *,
        labels: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Entry:
        """Publish ``files`` under ``key`` atomically; if it already exists, return the winner."""
        from . import publishing
        if not isinstance(key, Key):
            raise TypeError("put() needs a Key from make_key(), so its factors are recorded")
        check_names([validate_name(n) for n in files])
        lab = {str(k): str(v) for k, v in (labels or {}).items()}
        meta_d = json.loads(json.dumps(dict(meta or {})))  # must be JSON; fails early otherwise
        if self.contains(key):
            existing = self.peek(key)
            if isinstance(existing, Hit):
                return existing.entry
            self.get(key)  # records and quarantines the bad entry; we then publish afresh
        try:
            entry, published = publishing.publish(self.layout, self.index, key, files, lab,
                                                  meta_d, lookup=self.get)
        except OSError as e:
            if e.errno in FULL_ERRNOS:
                raise errors.StoreFullError(
                    f"no space left publishing {key.digest} in {self.root}: {e}") from e
            raise
        if published:
            self._maybe_gc()
        return entry

    def _maybe_gc(self) -> None:
        total = self.index.safely("bytes", lambda: self.index.counter("bytes")) or 0
        if total > self.max_size:
            try:
                self.gc(lock_timeout=0.0)
            except errors.LockTimeout:
                pass  # another process is collecting right now
            except (OSError, errors.StoreError) as e:
                # The publish stands; gc's own fault (a symlinked gc.lock...) says the fix,
                # once per store: every publish over the cap would say it again.
                log = logger.debug if self._gc_failed else logger.warning
                self._gc_failed = True
                log("automatic gc failed: %s", e)

    def delete(self, key: Key | str) -> bool:
        from . import publishing
        return publishing.remove(self.layout, self.index, digest_of(key), respect_pins=False,
                                 kind="del")

    def quarantine(self, digest: str, reason: str,
                   ident: verification.Ident | None = None) -> Path | None:
        """Move a bad entry to quarantine/ (never deleted silently); drop its shared blobs.
        ``ident``: only the entry directory found bad (see verification.quarantine)."""
        return verification.quarantine(self.layout, self.index, digest, reason, ident)

    # -- locks and pins ------------------------------------------------------------------
    def lock(self, name: str, timeout: float = 600.0) -> contextlib.AbstractContextManager[Path]:
        """Hold an inter-process lock ``name`` (a filelock under locks/)."""
        return pins.lock(self.layout, name, timeout)

    def pin(self, entry: Entry | Key | str) -> Pin:
        """Lease an entry so that gc skips it while the returned Pin is held.

        The store also keeps the pin, so it lasts for the store's (usually the process's)
        lifetime unless released. Raises KeyNotFound if the entry went away meanwhile.
        """
        held = pins.pin(self.layout, entry.key if isinstance(entry, Entry) else digest_of(entry))
        self._held_pins.append(held)
        return held

    def pinned(self) -> set[str]:
        """Digests with a live pin; pins of dead processes are removed on the way."""
        return pins.pinned(self.layout)

    # -- maintenance ---------------------------------------------------------------------
    def sweep_temp(self, grace_s: float = TEMP_GRACE_S) -> int:
        return sweep_temp(self.layout, grace_s)  # every open runs it: kept light

    def sweep_blobs(self) -> int:
        from . import maintenance
        return maintenance.sweep_blobs(self.layout)

    def gc(self, max_size: int | None = None, *, lock_timeout: float = 60.0) -> GcReport:
        """Enforce the size cap (LRU, pinned entries skipped) and sweep leftovers."""
        from . import maintenance
        cap = self.max_size if max_size is None else int(max_size)
        return maintenance.gc(self.layout, self.index, cap, lock_timeout=lock_timeout)

    def purge_plan(
        self, *, keys: list[str] | None = None, labels: Mapping[str, Any] | None = None,
        older_than: float | None = None, all: bool = False, include_pinned: bool = False,
    ) -> tuple[list[EntryInfo], list[EntryInfo]]:
        """(goes, kept) of a purge; see :func:`cachecompile.store.maintenance.purge_plan`."""
        from . import maintenance
        return maintenance.purge_plan(self.layout, self.index, keys=keys, labels=labels,
                                      older_than_s=older_than, all=all,
                                      include_pinned=include_pinned)

    def purge(
        self, *, keys: list[str] | None = None, labels: Mapping[str, Any] | None = None,
        older_than: float | None = None, all: bool = False, include_pinned: bool = False,
        dry_run: bool = False,
    ) -> list[EntryInfo]:
        """Remove entries by key, by labels, by age (seconds since last use) or all.

        Pinned entries and their groups stay unless ``include_pinned`` (see
        :meth:`purge_plan`, which also says what was kept). Returns what was removed.
        """
        from . import maintenance
        goes, _ = self.purge_plan(keys=keys, labels=labels, older_than=older_than, all=all,
                                  include_pinned=include_pinned)
        if dry_run:
            return goes
        return maintenance.purge(self.layout, self.index, goes, include_pinned=include_pinned)

    def reindex(self) -> int:
        """Rebuild the index from the manifests on disk (the manifests are the truth)."""
        from . import maintenance
        return maintenance.reindex(self.layout, self.index)

    def verify(self, fix: bool = False, *, full: bool = False) -> VerifyReport:
        """Check the entries (in full the first time, then those that changed; ``full``:
        every one), the store's directories, and the index against the disk."""
        from . import maintenance
        return maintenance.verify(self.layout, self.index, fix, full=full)

    def stats(self, *, recount: bool = False) -> dict[str, Any]:
        """Entries, sizes, hits and misses (see :func:`cachecompile.store.maintenance.stats`)."""
        from . import maintenance
        return {**maintenance.stats(self.layout, self.index, self.max_size, recount=recount),
                "readonly": self.readonly}

    def zero_stats(self) -> None:
        from . import maintenance
        maintenance.zero_stats(self.layout, self.index)

    def close(self) -> None:
        self.index.close()
