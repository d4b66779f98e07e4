"""The index owns its schema: an index of the old layout (diskcache's ``Cache`` table,
pickled records) is migrated once on the first writable open, never read wrong."""

from __future__ import annotations

import pickle
import sqlite3
import threading
from pathlib import Path

from cachecompile import store
from cachecompile.store import Store, make_key
from cachecompile.store.index import DB_NAME, OLD_DB_NAME, SCHEMA_VERSION, Index


def _old_index(path: Path, rows: dict[str, object]) -> None:
    """An index as the previous version wrote it (diskcache 5.6's table, values pickled
    inline: mode 4; integers stored as themselves: mode 0)."""
    path.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path / OLD_DB_NAME) as con:
        con.execute("CREATE TABLE Cache (rowid INTEGER PRIMARY KEY, key BLOB, raw INTEGER, "
                    "store_time REAL, expire_time REAL, access_time REAL, access_count "
                    "INTEGER DEFAULT 0, tag BLOB, size INTEGER DEFAULT 0, mode INTEGER "
                    "DEFAULT 0, filename TEXT, value BLOB)")
        for k, v in rows.items():
            mode, value = (0, v) if isinstance(v, int) else (4, pickle.dumps(v))
            con.execute("INSERT INTO Cache (key, raw, mode, value) VALUES (?, 1, ?, ?)",
                        (k, mode, value))


def test_an_old_layout_index_is_migrated_once_by_concurrent_openers(tmp_path: Path) -> None:
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    digests = [st.put(make_key({"i": i}), {"f": b"x" * (i + 1)},
                      labels={"kind": "graph"} if i == 0 else {"model": "m"}).key
               for i in range(3)]
    st.close()
    idx = st.index.path
    for f in idx.iterdir():
        f.unlink()
    rec = {"size_bytes": 2, "created": 1.0, "last_used": 50.0, "hits": 7,
           "labels": {"model": "m"}, "blobs": {"abc": 2}}
    _old_index(idx, {"e:" + digests[1]: rec,
                     "e:" + digests[0]: {**rec, "size_bytes": 1, "labels": {"kind": "graph"}},
                     "c:hits": 41, "v:" + digests[1]: (False, (("a",), b"s"))})
    # A read-only view of a store not yet migrated reads an empty index (the disk is
    # listed: unindexed entries), not the old table as something it is not.
    ro = Index(idx, readonly=True)
    assert ro.safely("list", lambda: list(ro.records())) is None

    opened = [Index(idx) for _ in range(4)]
    errs: list[BaseException] = []

    def first_use(i: Index) -> None:
        try:
            i.counters()
        except BaseException as e:  # reported below
            errs.append(e)

    threads = [threading.Thread(target=first_use, args=(i,)) for i in opened]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errs == []
    for i in opened:
        assert i.counters()["hits"] == 41   # once, not once per opener
        i.close()
    with sqlite3.connect(idx / DB_NAME) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    st2 = store.open_store(tmp_path / "c")
    assert isinstance(st2, Store)
    got = {i.key: i for i in st2.entries()}
    assert got[digests[1]].hits == 7 and got[digests[1]].last_used == 50.0
    assert got[digests[1]].state == "ok" and got[digests[2]].state == "unindexed"
    assert set(st2.index.stamps()) == {digests[1]}
    s = st2.stats()
    assert (s["entries"], s["shared_graphs"]["entries"]) == (1, 1)


def test_an_old_layout_index_at_a_path_with_uri_syntax_is_migrated(tmp_path: Path) -> None:
    """The old index is read through a ``file:`` URI: a store under a directory whose name
    has "?", "#" or "%" lost its records (read as another file, the migration warned and
    started empty)."""
    idx = tmp_path / "a?b#c%20d" / "index"
    _old_index(idx, {"c:hits": 41})
    assert Index(idx).counters()["hits"] == 41


def test_openers_of_a_new_index_all_wait_for_the_switch_to_wal(tmp_path: Path) -> None:
    """Ranks opening one fresh store at once: SQLite's switch into WAL takes its lock
    without the busy timeout, and failed at once ("database is locked") in 5-10% of rounds
    of six openers; each opener now waits like any other statement. Many rounds, since
    one round rarely races."""
    errs: list[str] = []

    def first_use(i: Index, start: threading.Barrier, rnd: int) -> None:
        try:
            start.wait()
            i.incr("hits")
        except BaseException as e:  # reported below
            errs.append(f"round {rnd}: {e!r}")

    for rnd in range(80):
        start = threading.Barrier(6)
        opened = [Index(tmp_path / str(rnd)) for _ in range(6)]
        threads = [threading.Thread(target=first_use, args=(i, start, rnd)) for i in opened]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            assert errs == []
            assert opened[0].counter("hits") == 6, rnd
        finally:
            for i in opened:
                i.close()


def test_ls_order_and_gc_order_are_sql(tmp_path: Path) -> None:
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    keys = [st.put(make_key({"i": i}), {"f": bytes([i]) * 10}).key for i in range(5)]
    assert st.get(keys[0])   # the most recently used
    lru = [i.key for i, _ in st.index.items(order="last_used", blobs=False)]
    assert lru[-1] == keys[0] and sorted(lru) == sorted(keys)
    assert [i.key for i, _ in st.index.items()] == sorted(keys)


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("the old index ran code",))


def test_an_old_row_that_names_a_callable_is_skipped_not_run(tmp_path: Path,
                                                              capsys: object) -> None:
    st = store.open_store(tmp_path / "c")
    assert isinstance(st, Store)
    digest = st.put(make_key({"i": 1}), {"f": b"x"}, labels={"model": "m"}).key
    st.close()
    idx = st.index.path
    for f in idx.iterdir():
        f.unlink()
    _old_index(idx, {"e:" + digest: {"size_bytes": 1, "created": 1.0, "labels": _Boom()},
                     "c:hits": 3})
    i = Index(idx)
    assert i.counters()["hits"] == 3   # the plain rows are migrated ...
    i.close()
    assert "ran code" not in capsys.readouterr().out  # type: ignore[attr-defined]
    st2 = store.open_store(tmp_path / "c")
    assert isinstance(st2, Store)
    assert {e.key: e.state for e in st2.entries()} == {digest: "unindexed"}  # ... that one not
