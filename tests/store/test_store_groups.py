"""Rank groups: eviction and purge take whole groups; ls marks incomplete ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cachecompile import store
from cachecompile.cli.common import group_status
from cachecompile.store.outcomes import EntryInfo
from cachecompile.store.policy import (
    expand_groups,
    lru_evictions,
    older_than,
    physical_size,
    split_pinned,
)


def info(key: str, group: str | None, last_used: float, size: int = 10,
         rank: str = "0", world: str = "2") -> EntryInfo:
    labels = {"global_rank": rank, "group_size": world}
    if group:
        labels["group"] = group
    return EntryInfo(key=key, size_bytes=size, created=0.0, last_used=last_used, hits=0,
                     labels=labels)


def test_lru_evicts_whole_groups_by_latest_member_use() -> None:
    a0, a1 = info("a0", "A", 1.0), info("a1", "A", 9.0, rank="1")  # A used at 9
    b0, b1 = info("b0", "B", 5.0), info("b1", "B", 6.0, rank="1")  # B used at 6
    c = info("c", None, 7.0)
    out = lru_evictions([a0, a1, b0, b1, c], max_size=30)
    # B is the least recently used UNIT even though a0 is the oldest entry.
    assert [e.key for e in out] == ["b0", "b1"]


def test_a_pinned_member_protects_its_group() -> None:
    a0, a1 = info("a0", "A", 1.0), info("a1", "A", 2.0, rank="1")
    b0 = info("b0", "B", 3.0)
    out = lru_evictions([a0, a1, b0], max_size=10, pinned={"a1"})
    assert [e.key for e in out] == ["b0"]


def test_age_purge_and_expansion_are_group_wide() -> None:
    a0, a1 = info("a0", "A", 1.0), info("a1", "A", 100.0, rank="1")
    b0 = info("b0", "B", 1.0)
    assert [e.key for e in older_than([a0, a1, b0], cutoff=50.0)] == ["b0"]
    assert {e.key for e in expand_groups([a0], [a0, a1, b0])} == {"a0", "a1"}


def test_group_status_marks_incomplete_groups() -> None:
    s = group_status([info("a0", "A" * 16, 1.0), info("a1", "A" * 16, 1.0, rank="1"),
                      info("b0", "B" * 16, 1.0)])
    assert s["A" * 16] == "AAAAAAAA 2/2"
    assert s["B" * 16] == "BBBBBBBB 1/2 incomplete"


def test_purge_by_label_takes_the_whole_group(tmp_path: Path) -> None:
    st = store.open_store(tmp_path / "s")
    for rank in ("0", "1"):
        st.put(store.make_key({"f": "x", "rank": rank}), {"k.bin": b"same bytes"},
               labels={"group": "G" * 16, "group_size": "2", "global_rank": rank})
    st.put(store.make_key({"f": "y"}), {"k.bin": b"other"}, labels={"model": "other"})
    gone = st.maintenance().purge(labels={"global_rank": "1"})
    assert sorted(i.labels.get("global_rank", "") for i in gone) == ["0", "1"]
    assert [i.labels.get("model") for i in st.entries()] == ["other"]


def test_cachectl_ls_shows_groups(tmp_path: Path) -> None:
    st = store.open_store(tmp_path / "s")
    st.put(store.make_key({"f": "x", "rank": "0"}), {"k.bin": b"x"},
           labels={"group": "G" * 16, "group_size": "4", "global_rank": "0"})
    out = subprocess.run([sys.executable, "-m", "cachecompile.cli.main", "ls", "--cache-dir",
                          str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "GGGGGGGG 1/4 incomplete" in out.stdout
    js = json.loads(subprocess.run([sys.executable, "-m", "cachecompile.cli.main", "ls", "--json",
                                    "--cache-dir", str(tmp_path / "s")], capture_output=True,
                                   text=True, timeout=60).stdout)
    assert js[0]["labels"]["group"] == "G" * 16


def test_physical_sizes_count_each_shared_blob_once() -> None:
    a, b, c = info("a", None, 1.0, size=110), info("b", None, 2.0, size=110), info("c", None, 3.0, size=5)
    blobs = {"a": {"w": 100, "x": 10}, "b": {"w": 100, "y": 10}, "c": {"z": 5}}
    assert physical_size([a, b, c], blobs) == 125
    assert physical_size([a, b, c]) == 225  # without blob maps: logical
    # Logically 225 > 200 would evict a; physically everything fits.
    assert lru_evictions([a, b, c], max_size=200, blobs=blobs) == []
    # Evicting a frees only its own 10 bytes: that is enough for a cap of 115.
    assert [e.key for e in lru_evictions([a, b, c], max_size=115, blobs=blobs)] == ["a"]
    assert [e.key for e in lru_evictions([a, b, c], max_size=100, blobs=blobs)] == ["a", "b"]


def test_split_pinned_keeps_whole_groups() -> None:
    a0, a1 = info("a0", "A", 1.0), info("a1", "A", 2.0, rank="1")
    b0 = info("b0", "B", 3.0)
    goes, kept = split_pinned([a0, a1, b0], pinned={"a1"})
    assert [e.key for e in goes] == ["b0"] and [e.key for e in kept] == ["a0", "a1"]


def test_purge_keeps_pinned_entries_and_their_group(tmp_path: Path) -> None:
    st = store.open_store(tmp_path / "s")
    assert isinstance(st, store.Store)
    ranks = [st.put(store.make_key({"f": "x", "rank": r}), {"k.bin": r.encode()},
                    labels={"group": "G" * 16, "group_size": "2", "global_rank": r})
             for r in ("0", "1")]
    other = st.put(store.make_key({"f": "y"}), {"k.bin": b"other"}, labels={"model": "other"})
    pin = st.pin(ranks[1])
    goes, kept = st.purge_plan(all=True)
    assert [i.key for i in goes] == [other.key]
    assert sorted(i.key for i in kept) == sorted(e.key for e in ranks)
    gone = st.purge(all=True)
    assert [i.key for i in gone] == [other.key]
    assert sorted(i.key for i in st.entries()) == sorted(e.key for e in ranks)
    gone = st.purge(keys=[ranks[0].key], include_pinned=True)
    assert sorted(i.key for i in gone) == sorted(e.key for e in ranks)
    assert list(st.entries()) == []
    pin.release()
