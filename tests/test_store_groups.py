"""Rank groups: eviction and purge take whole groups; ls marks incomplete ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import store
from store.cli import group_status
from store.outcomes import EntryInfo
from store.policy import expand_groups, lru_evictions, older_than


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
    gone = st.purge(labels={"global_rank": "1"})
    assert sorted(i.labels.get("global_rank", "") for i in gone) == ["0", "1"]
    assert [i.labels.get("model") for i in st.entries()] == ["other"]


def test_cachectl_ls_shows_groups(tmp_path: Path) -> None:
    st = store.open_store(tmp_path / "s")
    st.put(store.make_key({"f": "x", "rank": "0"}), {"k.bin": b"x"},
           labels={"group": "G" * 16, "group_size": "4", "global_rank": "0"})
    out = subprocess.run([sys.executable, "-m", "store.cli", "ls", "--cache-dir",
                          str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "GGGGGGGG 1/4 incomplete" in out.stdout
    js = json.loads(subprocess.run([sys.executable, "-m", "store.cli", "ls", "--json",
                                    "--cache-dir", str(tmp_path / "s")], capture_output=True,
                                   text=True, timeout=60).stdout)
    assert js[0]["labels"]["group"] == "G" * 16
