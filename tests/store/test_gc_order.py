"""gc chooses its victims from the index in SQL order and counts what they free by what
they unlink (issue 32): it must evict exactly what the policy over every record would
(:func:`policy.lru_evictions`: groups whole, by their members' latest use, pinned groups
kept, shared content counted once, unindexed entries included), and so must its fallback
when the index cannot be read."""

from __future__ import annotations

import random
import sqlite3
import time
from pathlib import Path

import pytest

from cachecompile import store
from cachecompile.store import Store, maintenance, make_key
from cachecompile.store.index import Index
from cachecompile.store.pins import pinned
from cachecompile.store.policy import lru_evictions, physical_size


def _messy_store(root: Path) -> tuple[Store, str]:
    """Groups, shared content, hits that reorder them, an unindexed entry, a stale row
    and a pinned group member; returns the store and the pinned digest."""
    rng = random.Random(7)
    st = store.open_store(root)
    assert isinstance(st, Store)
    shared = b"shared" * 300
    keys = []
    for i in range(40):
        files = {"own.bin": bytes([i]) * rng.randrange(100, 900)}
        if i % 4 == 0:
            files["shared.bin"] = shared
        labels = {"group": f"g{i % 7}"} if i % 3 == 0 else {"model": "m"}
        keys.append(st.put(make_key({"i": i}), files, labels=labels).key)
        time.sleep(0.001)   # distinct creation times, as in life
    for i in rng.sample(range(40), 15):   # hits move their units later
        assert st.get(make_key({"i": i})) is not None
    with sqlite3.connect(st.index.db) as con:
        con.execute("DELETE FROM entries WHERE digest = ?", (keys[5],))   # unindexed
        con.execute("INSERT INTO entries (digest, size_bytes, created, last_used, labels) "
                    "VALUES (?, 10, 0, 0, '{\"group\": \"g1\"}')", ("f" * 32,))  # stale row
    st.pin(keys[6])   # i=6 is in group g6: the group stays whole
    return st, keys[6]


def _expected(st: Store, cap: int) -> tuple[set[str], int]:
    infos, blobs = maintenance.listing(st.layout, st.index, with_blobs=True)
    infos = [i for i in infos if i.key != "f" * 32]
    victims = lru_evictions(infos, cap, pinned(st.layout), blobs)
    gone = {v.key for v in victims}
    return gone, physical_size([i for i in infos if i.key not in gone], blobs)


@pytest.mark.parametrize("cap", [0, 9_000, 15_000])
def test_gc_evicts_what_the_policy_over_every_record_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    monkeypatch.setattr(maintenance, "GC_BATCH", 3)
    st, held = _messy_store(tmp_path / "c")
    want, after = _expected(st, cap)
    assert want, "the cap evicts something"
    report = st.gc(max_size=cap)
    assert {i.key for i in report.evicted} == want and held not in want
    assert report.bytes_after == after
    assert report.freed_bytes == report.bytes_before - after
    assert st.stats()["bytes"] == after and st.stats(recount=True)["bytes"] == after


def test_gc_without_a_readable_index_evicts_the_same(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    st, _ = _messy_store(tmp_path / "c")
    want, after = _expected(st, 9_000)

    def broken(self: Index) -> None:
        raise sqlite3.OperationalError("database disk image is malformed")

    monkeypatch.setattr(Index, "each_digest", broken)
    report = st.gc(max_size=9_000)
    assert {i.key for i in report.evicted} == want and report.bytes_after == after
