"""Publishing and removal: an entry appears whole or not at all, and goes the same way.

Publish: stage the files (hard links into blobs/) and the manifest in a unique temp dir
under ``tmp/``, fsync, rename the dir into ``entries/``, then index it. The writer that
loses the rename race hands out the winner's entry. Removal renames the entry out of
``entries/`` first, so readers see it whole or absent, then deletes it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import errors
from .blobs import blob_map, exclusive_bytes, exclusive_bytes_of, link_in
from .fsutil import fsync_dir, remove_entry_tree, rmtree_quiet, temp_name, write_new_file
from .index import Index, counter_scope
from .keys import Key
from .layout import DATA, MANIFEST, Layout
from .manifest import dump_manifest
from .outcomes import Entry, Hit, Miss
from .pins import pinned
from .protocol import FileSource
from .verification import forget, remember

logger = logging.getLogger(__name__)

__all__ = ["RENAME_TRIES", "publish", "remove"]

# A put whose rename loses to an entry that is deleted before it can be looked at tries
# again this often (each try means another process published and a third deleted).
RENAME_TRIES = 8


def publish(
    layout: Layout, index: Index, key: Key, files: Mapping[str, FileSource],
    labels: dict[str, str], meta: dict[str, Any], *, lookup: Callable[[Key], Hit | Miss],
) -> tuple[Entry, bool]:
    """Publish ``files`` under ``key``; (entry, whether this call published it).

    ``lookup`` finds the winner when another writer published the key first.
    """
    digest = key.digest
    # Everything below is written through these: none may lead out of the store.
    layout.real("blobs")
    layout.real("entries")
    staging = layout.staging_dir("put", digest)
    new_bytes = 0
    try:
        data = staging / DATA
        layout.mkdir(data)
        recs: dict[str, dict[str, Any]] = {}
        for name, src in files.items():
            executable = False
            if not isinstance(src, (bytes, bytearray, memoryview)):
                executable = bool(os.stat(src).st_mode & stat.S_IXUSR)
            size, cs, fresh = link_in(layout, src, data / name, executable)
            new_bytes += fresh
            recs[name] = {"size": size, "xxh3_128": cs}
        created = time.time()
        body = dump_manifest(key=digest, factors=key.factors, labels=labels, meta=meta,
                             created=created, files=recs)
        write_new_file(staging / MANIFEST, [body], layout.file_mode)
        for d in sorted({(data / n).parent for n in recs} | {data, staging}, reverse=True):
            fsync_dir(d)
        target = layout.entry_dir(digest)
        for _ in range(RENAME_TRIES):
            layout.mkdir(target.parent, exist_ok=True)
            layout.real("entries", digest[:2])
            try:
                os.rename(staging, target)
                break
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            # Lost the race: the other writer's entry is whole; hand it out.
            won = lookup(key)
            if isinstance(won, Hit):
                rmtree_quiet(staging)
                return won.entry, False
            if won.kind != "absent":
                raise errors.CorruptEntryError(digest, f"the winning entry is bad: {won.reason}")
            # The winner was deleted (or evicted) before we could look at it: the key is
            # free again, and ours is still staged. Try again.
        else:
            raise errors.PublishConflict(
                f"could not publish {digest}: {RENAME_TRIES} times another process published "
                "it and it was deleted again before it could be read")
        fsync_dir(target.parent)
    except BaseException:
        rmtree_quiet(staging)
        raise
    manifest = json.loads(body)
    # Its files were hashed as they were written. A delete may already have taken it (a
    # delete may follow any publish): then it gets no index row, which nothing would remove.
    present = remember(target, manifest)
    size = sum(r["size"] for r in recs.values())

    def index_it() -> None:
        if present:
            index.add(digest, size, created, labels, blobs=blob_map(manifest))
        # A shared graph's publish is counted apart, as its lookups are ("graph:").
        index.incr(counter_scope(digest, labels) + "publishes")
        # Physical: content already in blobs/ (dedup) takes no more room.
        index.incr("bytes", new_bytes)

    index.safely("publish", index_it)
    return Entry(key=digest, path=target, files={n: target / DATA / n for n in recs},
                 manifest=manifest), True


def _take_away(layout: Layout, digest: str, kind: str, tmp: Path | None = None) -> Path | None:
    """Atomically move an entry out of entries/ (readers see it whole or absent).
    ``tmp``: ``layout.real("tmp")``, checked by the caller already."""
    # Renaming through a symlinked shard would pull an outside tree into tmp/ (and
    # then delete it): refuse instead.
    src = layout.real("entries", digest[:2]) / digest
    dst = (tmp if tmp is not None else layout.real("tmp")) / temp_name(kind, digest)
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return None
    forget(src)
    return dst


def remove(layout: Layout, index: Index, digest: str, *, respect_pins: bool, kind: str) -> bool:
    """Take an entry away and delete it; with ``respect_pins``, keep it if pinned."""
    gone = _take_away(layout, digest, kind)
    if gone is None:
        index.safely("delete", lambda: index.remove(digest))
        return False
    if respect_pins and digest in pinned(layout):
        # Someone pinned it between the caller's check and the rename: put it back.
        try:
            os.rename(gone, layout.entry_dir(digest))
            return False
        except OSError:
            pass  # a fresh copy was published meanwhile; ours can go
    freed = exclusive_bytes(gone)

    def unindex() -> None:
        index.remove(digest)
        index.incr("bytes", -freed)

    index.safely("delete", unindex)
    # Readers with open files keep them: unlink does not touch open descriptors.
    rmtree_quiet(gone)
    return True


# Deleting trees: each rmdir, and each unlink that frees a file's blocks, waited about 3 ms
# on this disk (ext4 mounted with discard), and they overlap: 16 threads unlinked 20x as
# many files per second as one (32 no more than 16).
RM_THREADS = 16


def remove_many(layout: Layout, index: Index, digests: list[str], *, respect_pins: bool,  # noqa: C901 (today's exception: pins, index and disk for each digest)
                kind: str, pool: Executor | None = None,
                then: Callable[[str], None] | None = None) -> list[str]:
    """:func:`remove` of each of ``digests``, with one pin scan and one index transaction
    for all of them (gc removing one entry at a time made a pin scan and two index
    commits each: 46 entries/s with four readers recording hits). Returns the removed.

    The promises are :func:`remove`'s: each entry leaves entries/ by one rename (whole or
    absent to readers), and the pins are read after every rename of the batch, so an
    entry pinned before its rename is put back.

    With ``pool``, the trees (already out of entries/, and out of the index) are deleted
    by its threads, and this returns without waiting: the caller waits for the pool
    (gc deletes one batch while it takes the next away), and sets the ``bytes`` counter
    itself. ``then(digest)`` runs in the same thread after an entry's tree is deleted.
    """
    taken: list[tuple[str, Path]] = []
    absent: list[str] = []
    # The batch goes into a directory of its own under tmp/ (swept if this process dies):
    # a rename into a directory waits for its lock, which the deleting threads' rmdirs
    # held 3 ms each when every batch went into tmp/ itself (renames took 1 ms each).
    into = layout.staging_dir(kind, "batch")

    def take(d: str) -> Path | None:
        return _take_away(layout, d, kind, into)

    if pool is not None and len(digests) > 1:
        with ThreadPoolExecutor(min(len(digests), RM_THREADS)) as renaming:
            moved = list(renaming.map(take, digests))   # all of them before pins are read
    else:
        moved = [take(d) for d in digests]
    for d, gone in zip(digests, moved, strict=True):
        if gone is None:
            absent.append(d)
        else:
            taken.append((d, gone))
    if respect_pins and taken:
        live = pinned(layout)
        kept: list[tuple[str, Path]] = []
        for d, gone in taken:
            if d in live:
                try:
                    os.rename(gone, layout.entry_dir(d))
                    continue
                except OSError:
                    pass  # a fresh copy was published meanwhile; ours can go
            kept.append((d, gone))
        taken = kept
    # What the batch frees moves the ``bytes`` counter; with ``pool`` the caller (gc) sets
    # the counter from its own count at the end instead, and the walk of every tree it
    # deletes (a third of remove_many's time) is saved.
    freed = 0 if pool is not None else exclusive_bytes_of([gone for _, gone in taken])
    # The renames above were the removal; deleting the trees is I/O wait, so several
    # threads delete them at once. Readers with open files keep them.

    left = [len(taken)]
    counting = threading.Lock()

    def delete(d: str, gone: Path) -> None:
        try:
            remove_entry_tree(gone)
            if then is not None:
                then(d)
        except Exception as e:   # in a pool's thread, where nobody would see it raised
            logger.warning("deleting the evicted entry %s failed: %s (tmp/ sweeps it)",
                           d, e)
        with counting:
            left[0] -= 1
            last = left[0] == 0
        if last:
            rmtree_quiet(into)   # empty by now, unless a put-back failed midway

    if not taken:
        rmtree_quiet(into)
    removed = [d for d, _ in taken]
    index.safely("delete", lambda: index.remove_many(removed + absent, freed))
    if pool is not None:
        for d, gone in taken:
            pool.submit(delete, d, gone)
    elif len(taken) > 1:
        with ThreadPoolExecutor(min(len(taken), RM_THREADS)) as own:
            list(own.map(delete, removed, [gone for _, gone in taken]))
    else:
        for d, gone in taken:
            delete(d, gone)
    return removed
