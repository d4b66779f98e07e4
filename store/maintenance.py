"""Maintenance: listing, the size cap (gc), purge, verify/reindex, statistics, sweeps.

Functions over a store's :class:`~cachecompile.store.layout.Layout` and
:class:`~cachecompile.store.index.Index`; what to evict or purge is decided by the pure
functions of :mod:`cachecompile.store.policy`, and applied here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import errors, verification
from .blobs import blob_map
from .index import ABOUT, GRAPH_SCOPE, LEVEL_HITS, PULLS, REMOTE_HITS, Index
from .keys import digest_of
from .layout import Layout, blob_name, sweep_temp
from .metrics import merge, read_counters, remove_counters
from .outcomes import EntryInfo, GcReport, VerifyReport
from .pins import lock, pinned
from .policy import (
    expand_groups,
    has_labels,
    is_shared_graph,
    lru_evictions,
    older_than,
    physical_size,
    split_pinned,
)
from .publishing import RM_THREADS, remove, remove_many
from .verification import Bad, Stamp, quarantine, read_manifest

logger = logging.getLogger(__name__)

__all__ = ["gc", "info_from_manifest", "listing", "purge", "purge_plan",
           "reindex", "stats", "sweep_blobs", "sweep_temp", "verify"]

# Entries gc takes away per pin scan and index transaction: large enough that neither
# dominates, small enough that the index is not held long while readers record hits.
GC_BATCH = 256
# Victims gc chooses before it deletes any of them (see _evict): reading the index while
# deleting threads run is slow, and holding more records than this is not needed.
GC_READ_AHEAD = 16384
# Stamps verify writes per index transaction (the index is not held long while readers
# record hits).
_STAMP_BATCH = 2000
Blobs = dict[str, dict[str, int]]


# -- listing ------------------------------------------------------------------------------
def info_from_manifest(digest: str, m: Mapping[str, Any], state: str = "ok") -> EntryInfo:
    """An entry's record as the index would hold it, from its manifest (no usage data)."""
    size = sum(int(r["size"]) for r in m["files"].values())
    return EntryInfo(key=digest, size_bytes=size, created=float(m["created"]),
                     last_used=float(m["created"]), hits=0,
                     labels={str(k): str(v) for k, v in m["labels"].items()}, state=state)


def listing(layout: Layout, index: Index, *, with_blobs: bool) -> tuple[list[EntryInfo], Blobs]:
    """The entries on disk (ordered by digest) and, with ``with_blobs``, what each holds
    in blobs/.

    Blob maps come from the index; a record without one (written before blob maps, or
    not indexed) reads its manifest, and the index is filled in for next time. Records
    are read as one stream (nothing but the entries kept is held: 100,000 entries held
    every record twice over, 220-390 MB), and blob maps only when asked for.
    """
    unseen = set(layout.digests())
    infos: list[EntryInfo] = []
    blobs: Blobs = {}
    healed: Blobs = {}
    need: list[str] = []   # on disk, indexed without a blob map: read the manifest

    def scan() -> None:
        for info, held in index.items(blobs=with_blobs):
            if info.key not in unseen:
                continue   # a row whose entry is gone (verify drops it)
            unseen.discard(info.key)
            infos.append(info)
            if held is not None:
                blobs[info.key] = held
            elif with_blobs:
                need.append(info.key)

    # A scan that fails (midway) keeps what it read; the rest is read from manifests.
    index.safely("list", scan)
    for d in [*need, *sorted(unseen)]:
        indexed = d not in unseen
        try:
            m = read_manifest(layout, d)
        except (errors.StoreError, OSError):
            if not indexed:
                infos.append(EntryInfo(key=d, size_bytes=0, created=0.0, last_used=0.0,
                                       hits=0, state="bad-manifest"))
            continue
        if not indexed:
            infos.append(info_from_manifest(d, m, state="unindexed"))
        else:
            healed[d] = blob_map(m)
        blobs[d] = blob_map(m)
    if healed:
        index.safely("blobs", lambda: index.set_blobs(healed))
    infos.sort(key=_by_key)
    return infos, blobs


def _by_key(i: EntryInfo) -> str:
    return i.key


# -- sweeps -------------------------------------------------------------------------------
def sweep_blobs(layout: Layout) -> int:
    """Remove blobs no entry links to any more (link count 1)."""
    return _sweep_blobs(layout)[0]


def _sweep_blobs(layout: Layout) -> tuple[int, int]:
    """:func:`sweep_blobs`: (blobs removed, bytes of the blobs kept). The bytes kept are the
    store's physical size: each content is one inode under blobs/, whichever entries link it."""
    unused: list[str] = []
    kept = 0
    for shard in layout.scan("blobs"):
        if not shard.is_dir(follow_symlinks=False):
            if shard.is_symlink():
                layout.warn_link(Path(shard.path), "a symlink")
            continue
        with os.scandir(shard.path) as it:
            for b in it:
                try:
                    st = b.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if st.st_nlink <= 1:
                    unused.append(b.path)
                else:
                    kept += st.st_size
    if len(unused) <= 1:
        freed = [_unlink_unused(p) for p in unused]
    else:
        # Each unlink that frees a blob's blocks waits on the disk: many at once (see
        # RM_THREADS).
        with ThreadPoolExecutor(min(len(unused), RM_THREADS)) as pool:
            freed = list(pool.map(_unlink_unused, unused))
    # A blob linked again since the scan (a publish took its content) is kept, and counted.
    for path, n in zip(unused, freed, strict=True):
        if n is None:
            with contextlib.suppress(OSError):
                kept += os.lstat(path).st_size
    return sum(n is not None for n in freed), kept


def _unlink_unused(path: str) -> int | None:
    """Unlink the blob ``path`` if still no entry links it (one may have since the scan):
    its size, or None where it stays."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            return None
        os.unlink(path)
    except OSError:
        return None
    return st.st_size


def _drop_blobs(layout: Layout, held: Mapping[str, int]) -> tuple[int, int]:
    """Unlink the blobs of the contents ``held`` (an evicted entry's) that no entry links
    any more: :func:`sweep_blobs` for one entry, run as soon as its tree is deleted.
    Returns (blobs removed, bytes freed)."""
    n = freed = 0
    for cs in held:
        if len(cs) != 32 or layout.unreal("blobs", cs[:2]) is not None:
            continue   # not a checksum, or a shard that is a link: sweep_blobs warns
        for executable in (False, True):
            size = _unlink_unused(os.path.join(layout.blobs, cs[:2], blob_name(cs, executable)))
            if size is not None:
                n += 1
                freed += size
    return n, freed


# -- the cap and purge --------------------------------------------------------------------
def gc(layout: Layout, index: Index, cap: int, *, lock_timeout: float = 60.0) -> GcReport:
    """Enforce the size cap ``cap`` (LRU, pinned groups skipped) and sweep leftovers.

    Sizes are physical: content shared by several entries counts once, and evicting
    an entry frees only what no remaining entry holds.

    The total is the blobs' own (:func:`sweep_blobs` sums what it keeps: one inode per
    content, the true physical size, unindexed entries' content included); the victims
    come from the index in eviction order (:meth:`Index.by_unit_use`: SQL sorts, gc
    reads only as far as it evicts) once gc has put the index in step with entries/
    (:func:`_in_step`); what each eviction frees is what it unlinks from blobs/. No
    record but the victims' is decoded, no blob map but theirs read. An index that
    cannot be read falls back to a full listing (:func:`_gc_listed`).

    Entries go in batches, each taken out of entries/ and the index at once; their trees
    and freed blobs are deleted by threads while the next batch is taken away.
    """
    report = GcReport(max_size=cap)
    with lock(layout, "gc", timeout=lock_timeout):
        report.temp_swept = sweep_temp(layout)
        swept, total = _sweep_blobs(layout)
        report.blobs_removed = swept
        report.bytes_before = total
        live = pinned(layout)
        first = index.safely("gc", lambda: _in_step(layout, index, live, report))
        if first is None:
            return _gc_listed(layout, index, cap, report, live)
        report.bytes_after = _evict(layout, index, cap, total, live, first, report, swept)
        report.freed_bytes = report.bytes_before - report.bytes_after

        def fix_counters() -> None:
            index.incr("bytes", report.bytes_after - index.counter("bytes"))
            index.incr("evictions", len(report.evicted))

        index.safely("gc", fix_counters)
    return report


def _in_step(layout: Layout, index: Index, live: set[str], report: GcReport) -> list[str]:
    """Put the index in step with entries/ for gc: entries on disk without a record get
    one from their manifest (an unindexed entry is evicted by its creation time, as its
    record would be), records of entries no longer on disk go. Sets the report's
    ``pinned_skipped``; returns the entries whose manifest cannot be read (no record can
    be made for them: gc evicts them first, as if last used at time 0)."""
    unseen = set(layout.digests())
    report.pinned_skipped = sorted(live & unseen)
    stale = []
    for d in index.each_digest():
        if d in unseen:
            unseen.discard(d)
        else:
            stale.append(d)
    # Looked at again: an entry published since the scan of entries/ is no stale row.
    stale = [d for d in stale if not os.path.lexists(layout.entry_dir(d))]
    if stale:
        index.remove_many(stale)
    unreadable = []
    for d in sorted(unseen):
        try:
            m = read_manifest(layout, d)
        except (errors.StoreError, OSError):
            if os.path.lexists(layout.entry_dir(d)):
                unreadable.append(d)
            continue
        i = info_from_manifest(d, m)
        index.add(d, i.size_bytes, i.created, i.labels, blobs=blob_map(m))
    return unreadable


def _evict(layout: Layout, index: Index, cap: int, total: int, live: set[str],
           first: list[str], report: GcReport, swept: int) -> int:
    """Evict in eviction order until the physical ``total`` fits in ``cap``; the total after.

    A unit's eviction frees at most its contents' sizes, counted once across the victims
    chosen so far (an upper bound: a content another entry holds is not freed). Victims
    are chosen until that bound says the rest fits; then their deletions are waited for
    and what they really freed counted, and if the total is still over the cap, the next
    units are chosen the same way. So gc stops at the same unit as the exact policy
    (:func:`policy.lru_evictions` over every record), never after it.
    """
    if total <= cap:
        return total
    deletion = _Deletion(layout, index, report)
    batch: dict[str, EntryInfo] = {}

    def settle() -> int:   # every chosen victim deleted: the true total now
        deletion.take(batch)
        batch.clear()
        deletion.wait()
        report.blobs_removed = swept + deletion.blobs
        return total - deletion.bytes

    bound = total   # the total less what the victims chosen since the last settle may free
    counted: set[str] = set()
    units = _Units(index, first)
    try:
        unit: list[EntryInfo] = []
        known: dict[str, Mapping[str, int] | None] = {}
        for name, info, held_map in units:
            unit.append(info)
            known[info.key] = held_map
            if name is not None and _same_unit(units, name):
                continue
            members, unit = unit, []
            if bound <= cap:
                bound = settle()
                counted.clear()
                if bound <= cap:
                    break
            if any(e.key in live for e in members):
                continue
            held = _held(layout, members, known)
            known.clear()
            for e in members:
                deletion.maps[e.key] = held[e.key]
                for content, size in held[e.key].items():
                    if content not in counted:
                        counted.add(content)
                        bound -= size
                batch[e.key] = e
            # Victims are chosen before their deletion starts: a row read from SQLite
            # while the deleting threads run waits for the GIL at every step (2-3 s
            # for 5,000 rows at 100,000 entries, against ~20 ms with none running).
            if len(batch) >= GC_READ_AHEAD:
                deletion.take(batch)
                batch.clear()
        return settle()
    finally:
        units.close()   # the rest of the stream unread: its read transaction ends here
        deletion.close()


class _Deletion:
    """gc's victims taken away in batches (:func:`remove_many`: a rename each, one pin
    scan and index transaction a batch), their trees and freed blobs deleted by a pool's
    threads; counts the blobs, and their bytes, that those unlinks freed."""

    def __init__(self, layout: Layout, index: Index, report: GcReport) -> None:
        self.layout, self.index, self.report = layout, index, report
        self.maps: dict[str, Mapping[str, int]] = {}   # what each victim holds in blobs/
        self.blobs = self.bytes = 0
        self._counting = threading.Lock()
        self._pool = ThreadPoolExecutor(RM_THREADS)

    def _drop(self, d: str) -> None:   # in a deleting thread, once d's tree is gone
        n, size = _drop_blobs(self.layout, self.maps.pop(d, {}))
        with self._counting:
            self.blobs += n
            self.bytes += size

    def take(self, victims: Mapping[str, EntryInfo]) -> None:
        """Take ``victims`` away (the evicted go into the report); their deletion runs on."""
        chosen = list(victims)
        for at in range(0, len(chosen), GC_BATCH):
            for d in remove_many(self.layout, self.index, chosen[at:at + GC_BATCH],
                                 respect_pins=True, kind="evict", pool=self._pool,
                                 then=self._drop):
                self.report.evicted.append(victims[d])

    def wait(self) -> None:
        """Every deletion so far done (the counts final for them)."""
        self._pool.shutdown(wait=True)
        self._pool = ThreadPoolExecutor(RM_THREADS)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Units:
    """(unit, record) in eviction order: the unreadable entries first (unit None: each
    its own), then the index's records, with a look at the next row's unit."""

    def __init__(self, index: Index, first: list[str]) -> None:
        self._first: list[tuple[str | None, EntryInfo, dict[str, int] | None]] = [
            (None, EntryInfo(key=d, size_bytes=0, created=0.0, last_used=0.0, hits=0,
                             state="bad-manifest"), None) for d in first]
        self._rows = index.by_unit_use()
        self._next: tuple[str, EntryInfo, dict[str, int] | None] | None = None
        self._done = False

    def __iter__(self) -> _Units:
        return self

    def __next__(self) -> tuple[str | None, EntryInfo, dict[str, int] | None]:
        if self._first:
            return self._first.pop(0)
        got = self.peek()
        if got is None:
            raise StopIteration
        self._next = None
        return got

    def close(self) -> None:
        self._rows.close()

    def peek(self) -> tuple[str, EntryInfo, dict[str, int] | None] | None:
        if self._next is None and not self._done:
            self._next = next(self._rows, None)
            self._done = self._next is None
        return self._next


def _same_unit(units: _Units, name: str) -> bool:
    """Whether the next row belongs to the unit ``name`` too (rows of a unit are adjacent)."""
    nxt = units.peek()
    return nxt is not None and nxt[0] == name


def _held(layout: Layout, members: list[EntryInfo],
          known: Mapping[str, Mapping[str, int] | None]) -> dict[str, Mapping[str, int]]:
    """What each of ``members`` holds in blobs/: the index's blob map (``known``), else its
    manifest's, else (unreadable) its logical size as one content of its own
    (policy._contents)."""
    out: dict[str, Mapping[str, int]] = {}
    for e in members:
        held = known.get(e.key)
        if held is None:
            try:
                held = blob_map(read_manifest(layout, e.key))
            except (errors.StoreError, OSError):
                held = {f"entry:{e.key}": e.size_bytes}
        out[e.key] = held
    return out


def _gc_listed(layout: Layout, index: Index, cap: int, report: GcReport,
               live: set[str]) -> GcReport:
    """gc from a full listing and :func:`policy.lru_evictions` (every record held): where
    the index cannot be read, so that the cap holds without it."""
    infos, blobs = listing(layout, index, with_blobs=True)
    report.pinned_skipped = sorted(live & {i.key for i in infos})
    victims = lru_evictions(infos, cap, live, blobs)
    deletion = _Deletion(layout, index, report)
    deletion.maps.update(blobs)
    try:
        deletion.take({v.key: v for v in victims})
    finally:
        deletion.close()
    report.blobs_removed += deletion.blobs
    report.bytes_after = report.bytes_before - deletion.bytes
    report.freed_bytes = deletion.bytes
    return report


def purge_plan(
    layout: Layout, index: Index, *,
    keys: list[str] | None = None,
    labels: Mapping[str, Any] | None = None,
    older_than_s: float | None = None,
    all: bool = False,
    include_pinned: bool = False,
) -> tuple[list[EntryInfo], list[EntryInfo]]:
    """(goes, kept): what :func:`purge` would remove, and what it keeps because a live
    process pinned it or a member of its group (as gc does), unless ``include_pinned``.

    Criteria combine with AND; with none given and ``all`` false, nothing goes.
    """
    if not (keys or labels or older_than_s is not None or all):
        return [], []
    universe = listing(layout, index, with_blobs=False)[0]
    infos = universe
    if keys:
        want = {digest_of(k) for k in keys}
        infos = [i for i in infos if i.key in want]
    if labels:
        infos = [i for i in infos if has_labels(i.labels, labels)]
    if older_than_s is not None:
        # Age of a group is its latest use over ALL members, not the selected ones.
        old = {i.key for i in older_than(universe, time.time() - older_than_s)}
        infos = [i for i in infos if i.key in old]
    # Never one rank of a group: whatever is selected takes its whole group along.
    infos = expand_groups(infos, universe)
    if include_pinned:
        return infos, []
    return split_pinned(infos, pinned(layout))


def purge(layout: Layout, index: Index, goes: list[EntryInfo], *,
          include_pinned: bool = False) -> list[EntryInfo]:
    """Remove the entries ``goes`` (a plan's); those pinned meanwhile stay unless
    ``include_pinned``. Returns what was removed."""
    return [i for i in goes
            if remove(layout, index, i.key, respect_pins=not include_pinned, kind="del")]


# -- verify and reindex -------------------------------------------------------------------
def reindex(layout: Layout, index: Index) -> int:
    """Rebuild the index from the manifests on disk (the manifests are the truth)."""
    infos = []
    blobs: Blobs = {}
    for d in layout.digests():
        try:
            m = read_manifest(layout, d)
            infos.append(info_from_manifest(d, m))
            blobs[d] = blob_map(m)
        except (errors.StoreError, OSError):
            continue
    index.replace_all(infos, blobs)
    total = physical_size(infos, blobs)
    index.incr("bytes", total - index.counter("bytes"))
    return len(infos)


def verify(layout: Layout, index: Index, fix: bool = False, *,  # noqa: C901 (today's exception: one check per kind of store damage)
           full: bool = False) -> VerifyReport:
    """Check the entries, the store's directories, and the index against the disk.

    Each entry is checked in full (manifest digest, every checksum) once, and then only
    when it changed: a full check leaves a stamp in the index (the lstat of each path it
    read: inode, mode, owner, size, mtime, ctime), and an entry that still matches its
    stamp is not read again (:func:`verification.unchanged`). Any write, rename, chmod,
    chown or utime moves a ctime, so what a stamp misses is damage that changes bytes
    without a write (a failing disk): ``full`` reads every entry, as the first run does.

    A directory that is a symlink is a problem (named by its path, not a digest);
    ``fix`` leaves it alone (whatever it points at is not the store's to move).
    """
    report = VerifyReport()
    report.problems.extend(layout.problems())
    on_disk = set(layout.digests(warn=False))
    known = index.safely("stamps", index.stamps) or {}
    fresh: dict[str, tuple[bool, Stamp]] = {}
    writable = not index.readonly

    def keep_stamps() -> None:
        if fresh and writable:
            batch = dict(fresh)
            index.safely("stamps", lambda: index.set_stamps(batch))
        fresh.clear()

    for d in sorted(on_disk):
        report.checked += 1
        was = known.get(d)
        if not full and was is not None and verification.unchanged(layout, d, was[1]):
            report.unchanged += 1
            report.shared_graphs += was[0]
            continue

        def bad(b: Bad, d: str = d) -> None:
            # Called while the entry's directory is held open (corrupt or insecure), so
            # that quarantine takes that directory, not one published under d since.
            reason = f"{b.kind}: {b.reason}"
            report.problems.append((d, reason))
            if fix and quarantine(layout, index, d, reason, b.ident) is not None:
                report.quarantined.append(d)
                index.safely("corruptions", lambda: index.incr("corruptions"))

        try:
            entry, stamp = verification.check(layout, d, on_bad=bad)
            graph = is_shared_graph(entry.labels)
            report.shared_graphs += graph
            if stamp is not None and (graph, stamp) != was:   # a row per change only
                fresh[d] = (graph, stamp)
                if len(fresh) >= _STAMP_BATCH:
                    keep_stamps()
        except Bad as b:
            if b.kind == "absent":
                report.checked -= 1  # deleted or evicted while verify read it: not a problem
            elif b.kind not in ("corrupt", "insecure"):   # those went through bad()
                bad(b)
    keep_stamps()
    # Stamps of entries gone (or found bad: a stamp is only kept for an entry that was
    # whole) are dropped; a stale one could not match anyway (a new directory, a new ctime).
    stale = [d for d in known if d not in on_disk]
    stale += [d for d, _ in report.problems if d in known]
    if stale and writable:
        index.safely("stamps", lambda: index.drop_stamps(stale))
    indexed = index.safely("list", index.digests) or set()
    # Looked at again now: an entry published or removed while verify ran is no mismatch.
    def unindexed(d: str) -> bool:
        return index.safely("get", lambda: index.get(d)) is None

    def drop(d: str) -> None:
        index.safely("stale row", lambda: index.remove(d))

    report.index_missing = sorted(d for d in on_disk - indexed
                                  if os.path.lexists(layout.entry_dir(d)) and unindexed(d))
    # A row whose entry is absent is the index lagging the disk, not damage: a hit is
    # recorded just as gc evicts the entry, and the record re-creates its row. The
    # manifests are the truth, so the row goes, silently (a read-only index keeps it).
    gone = sorted(d for d in indexed - on_disk if not os.path.lexists(layout.entry_dir(d)))
    if gone and not index.readonly:
        for d in gone:
            drop(d)
        logger.debug("dropped %d index rows of entries no longer on disk", len(gone))
    if fix:
        reindex(layout, index)
        report.reindexed = True
    return report


# -- statistics ---------------------------------------------------------------------------
def _recounted(layout: Layout, index: Index) -> dict[str, int]:
    """Entries, shared graphs, physical and logical bytes from a full listing (every
    record, the disk); the index's totals and ``bytes`` counter are set to them."""
    infos, blobs = listing(layout, index, with_blobs=True)
    graphs = sum(1 for i in infos if is_shared_graph(i.labels))
    physical = physical_size(infos, blobs)
    if not index.readonly:
        def fix() -> None:
            index.recount()
            index.incr("bytes", physical - index.counter("bytes"))

        index.safely("recount", fix)
    return {"entries": len(infos), "graphs": graphs, "bytes": physical,
            "logical_bytes": sum(i.size_bytes for i in infos)}


def _kept(index: Index) -> dict[str, int] | None:
    """The same figures from the totals the index keeps (no record read), or None."""
    totals = index.safely("totals", index.totals)
    physical = index.safely("bytes", lambda: index.counter("bytes"))
    if totals is None or physical is None:
        return None
    return {**totals, "bytes": max(physical, 0)}


def stats(layout: Layout, index: Index, cap: int, *, recount: bool = False) -> dict[str, Any]:
    """Counts of the user's entries and lookups, as ``cachectl ls`` lists them; shared
    graphs apart under ``shared_graphs``. ``bytes`` is physical (what counts against
    the cap, shared graphs included), ``logical_bytes`` the sum of entry sizes; of the
    ``hits``, ``hits_remote`` were served by a download from a remote tier (by level in
    ``hits_remote_levels``); ``pulls``
    counts the entries ``cachectl pull`` downloaded ahead of use (not lookups, so not hits).

    Entry counts and sizes come from the totals the index keeps as entries come and go
    (constant time at any store size); ``recount`` (or an index that cannot be read)
    recounts them from every record and the disk, and writes the totals back.
    """
    sums = None if recount else _kept(index)
    if sums is None:
        sums = _recounted(layout, index)
    # The index's counters, plus those of read-only processes (their counters files).
    readers = read_counters(layout.root)
    counters = merge(index.safely("counters", index.counters) or {}, readers)
    misses = {k[5:]: v for k, v in counters.items() if k.startswith("miss:")}
    about: dict[str, dict[str, int]] = {}
    for k, v in counters.items():
        if k.startswith(ABOUT):
            kind, _, subject = k[len(ABOUT):].partition(":")
            about.setdefault(kind, {})[subject] = v
    graph_miss = GRAPH_SCOPE + "miss:"
    graph_misses = {k[len(graph_miss):]: v for k, v in counters.items()
                    if k.startswith(graph_miss)}
    try:
        quarantined = sum(1 for n in os.listdir(layout.quarantine) if not n.endswith(".reason"))
    except FileNotFoundError:
        quarantined = 0
    graphs = sums["graphs"]
    hits = int(counters.get("hits", 0))
    remote = int(counters.get(REMOTE_HITS, 0))
    return {
        "root": str(layout.root),
        "entries": sums["entries"] - graphs,
        "bytes": sums["bytes"],
        "logical_bytes": sums["logical_bytes"],
        "cap": cap,
        "hits": hits,
        "hits_local": max(hits - remote, 0),
        "hits_remote": remote,
        # Of those, what each level of the remote chain served (by its URL, shown).
        "hits_remote_levels": {k[len(LEVEL_HITS):]: int(v) for k, v in counters.items()
                               if k.startswith(LEVEL_HITS)},
        "misses": misses,
        "misses_about": about,   # {"guard": {"input_ids": 3}}: what the misses were about
        "shared_graphs": {"entries": graphs,
                          "hits": int(counters.get(GRAPH_SCOPE + "hits", 0)),
                          "publishes": int(counters.get(GRAPH_SCOPE + "publishes", 0)),
                          "misses": graph_misses},
        "publishes": int(counters.get("publishes", 0)),
        "pulls": int(counters.get(PULLS, 0)),
        "evictions": int(counters.get("evictions", 0)),
        "corruptions": int(counters.get("corruptions", 0)),
        "quarantined": quarantined,
        # Of the counts above, what read-only processes recorded (metrics.stats_dir).
        "readonly_processes": {"hits": int(readers.get("hits", 0)),
                               "misses": sum(v for k, v in readers.items()
                                             if k.startswith("miss:"))},
    }


def zero_stats(layout: Layout, index: Index) -> None:
    """Reset the counters, keeping ``bytes`` (the running size gc depends on), and remove
    the read-only processes' counters files."""
    keep = index.counter("bytes")
    index.zero()
    index.incr("bytes", keep)
    remove_counters(layout.root)
