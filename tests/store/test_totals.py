"""The totals the index keeps (entries, shared graphs, logical bytes, the physical
``bytes`` counter) stay equal to a full recount whatever the store goes through, so
that ``stats`` can read them instead of every record."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from cachecompile import store
from cachecompile.store import Store, maintenance, make_key
from cachecompile.store.index import TOTALS, Index

_SUMS = ("entries", "bytes", "logical_bytes")


def _kept_and_recounted(st: Store) -> tuple[dict, dict]:
    # The totals as summed straight from the index's own table.
    with sqlite3.connect(st.index.db) as con:
        row = con.execute("SELECT COUNT(*), SUM(graph), TOTAL(size_bytes) FROM entries").fetchone()
    raw = {n: int(v or 0) for n, v in zip(TOTALS, row, strict=True)}
    kept = st.stats()
    full = st.stats(recount=True)
    assert raw == {"entries": full["entries"] + full["shared_graphs"]["entries"],
                   "graphs": full["shared_graphs"]["entries"],
                   "logical_bytes": full["logical_bytes"]}
    pick = lambda s: {**{k: s[k] for k in _SUMS},  # noqa: E731
                      "graphs": s["shared_graphs"]["entries"]}
    return pick(kept), pick(full)


def test_totals_equal_a_recount_after_random_operations(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(maintenance, "GC_BATCH", 3)  # gc evicts in several batches
    rng = random.Random(32)
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    live: list[str] = []
    shared = b"s" * 3000  # content several entries hold: physical bytes count it once
    for step in range(300):
        op = rng.random()
        if op < 0.6 or not live:
            n = rng.randrange(10_000)
            files = {"a.bin": bytes([n % 251]) * rng.randrange(1, 2000)}
            if rng.random() < 0.3:
                files["shared.bin"] = shared
            labels = {"kind": "graph"} if rng.random() < 0.2 else {"model": f"m{n % 3}"}
            live.append(st.put(make_key({"n": n}), files, labels=labels).key)
        elif op < 0.8:
            st.delete(live.pop(rng.randrange(len(live))))
        elif op < 0.9:
            d = live.pop(rng.randrange(len(live)))
            assert st.quarantine(d, "test") is not None
        else:
            st.gc(max_size=rng.randrange(5_000, 60_000))
            live = list(st.digests())
        if step % 50 == 0:
            kept, full = _kept_and_recounted(st)
            assert kept == full, step
    kept, full = _kept_and_recounted(st)
    assert kept == full
    assert kept["entries"] + kept["graphs"] == len(list(st.digests())) > kept["graphs"]
    assert kept["graphs"] > 0


def test_totals_follow_rows_written_behind_the_store(tmp_path: Path) -> None:
    """The totals are aggregates of the entries table: a row another process (of any
    version) adds or removes moves them, with no kept total to drift."""
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    for i in range(5):
        st.put(make_key({"i": i}), {"f": b"x" * (i + 1)}, labels={"model": "m"})
    assert (st.stats()["entries"], st.stats()["logical_bytes"]) == (5, 15)
    with sqlite3.connect(st.index.db) as con:
        con.execute("DELETE FROM entries WHERE size_bytes = 5")
        con.execute("UPDATE entries SET graph = 1, labels = '{\"kind\":\"graph\"}' "
                    "WHERE size_bytes = 1")
    s = st.stats()
    assert (s["entries"], s["shared_graphs"]["entries"], s["logical_bytes"]) == (3, 1, 10)


def test_stats_reads_no_record_and_ls_no_manifest(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """stats reads the kept totals (no listing, no record); listing the entries reads the
    index's records, not one manifest per entry."""
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    for i in range(30):
        st.put(make_key({"i": i}), {"f": b"x" * 10}, labels={"kind": "graph"} if i < 4 else {})
    st.stats()  # totals checked once

    def no(*_: object, **__: object) -> None:
        raise AssertionError("read every record")

    with monkeypatch.context() as m:
        m.setattr(maintenance, "listing", no)
        m.setattr(Index, "items", no)
        s = st.stats()
    assert (s["entries"], s["shared_graphs"]["entries"], s["logical_bytes"]) == (26, 4, 300)
    reads: list[str] = []
    real = maintenance.read_manifest
    monkeypatch.setattr(maintenance, "read_manifest",
                        lambda layout, d, **kw: reads.append(d) or real(layout, d, **kw))  # type: ignore[func-returns-value]
    assert len(list(st.entries())) == 30 and reads == []
    with sqlite3.connect(st.index.db) as con:  # unindexed: its manifest says
        con.execute("DELETE FROM entries WHERE digest = ?", (make_key({"i": 7}).digest,))
    assert {i.state for i in st.entries()} == {"ok", "unindexed"} and len(reads) == 1


def test_gc_puts_back_an_entry_pinned_in_its_batch(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry pinned between gc's plan and its batch's renames is put back whole."""
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    keys = [st.put(make_key({"i": i}), {"f": bytes([i]) * 1000}).key for i in range(6)]
    from cachecompile.store import publishing
    real_pinned = publishing.pinned
    monkeypatch.setattr(publishing, "pinned", lambda layout: real_pinned(layout) | {keys[0]})
    report = st.gc(max_size=1)
    assert keys[0] not in {i.key for i in report.evicted} and len(report.evicted) == 5
    assert st.get(keys[0]) and list(st.digests()) == [keys[0]]
    kept, full = _kept_and_recounted(st)
    assert kept == full and kept["entries"] == 1


def test_cachectl_stats_recount_reads_the_same_totals(tmp_path: Path) -> None:
    """``stats --recount`` stays accepted; both read the aggregates of the records."""
    import json

    from click.testing import CliRunner

    from cachecompile.cli.main import cli

    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    for i in range(3):
        st.put(make_key({"i": i}), {"f": b"x" * 100})

    def stats(*args: str) -> dict:
        r = CliRunner().invoke(cli, ["stats", "--json", "--cache-dir", str(st.root), *args],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    assert stats()["logical_bytes"] == stats("--recount")["logical_bytes"] == 300
    assert stats()["entries"] == 3

def test_gc_in_batches_leaves_nothing_behind(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """gc deletes trees and freed blobs in threads while it takes the next batch away
    (issue 32): when it returns, tmp/ is empty, every blob left is still linked by an
    entry, content shared with a kept entry survives, and the counts add up."""
    monkeypatch.setattr(maintenance, "GC_BATCH", 4)
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    shared = b"shared" * 500
    for i in range(23):
        files = {"own.bin": bytes([i]) * 700, "x/deep.bin": bytes([i, 1]) * 50}
        if i % 3 == 1:
            files["shared.bin"] = shared
        st.put(make_key({"i": i}), files)
    newest = make_key({"i": 22})   # holds the shared content, and is kept
    blobs = st.root / "v1" / "blobs"
    before = {p for p in blobs.rglob("*") if p.is_file()}
    report = st.gc(max_size=12_000)   # of about 21,400: some shared holders go too
    gone = {i.key for i in report.evicted}
    assert len(gone) >= 9 and newest.digest not in gone
    assert list((st.root / "v1" / "tmp").iterdir()) == []
    after = {p for p in blobs.rglob("*") if p.is_file()}
    assert all(p.stat().st_nlink >= 2 for p in after), "a blob nobody links was left"
    assert report.blobs_removed == len(before - after) == 2 * len(gone)
    hit = st.get(newest)
    assert isinstance(hit, store.Hit) and hit.entry.files["shared.bin"].read_bytes() == shared
    kept, full = _kept_and_recounted(st)
    assert kept == full and full["bytes"] == report.bytes_after
