"""``verify`` reads an entry in full once, then only when it changed (issue 32, item 5).

A full check stamps what it read (inode, mode, owner, size, mtime, ctime of each path);
an entry that still matches is not read again. Every tampering a user can do moves a
ctime, so each one here must still be caught without ``--full``; ``--full`` reads
everything (what a failing disk changes without a write).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachecompile.cli.main import cli
from cachecompile.store import Entry, Store, make_key, open_store, verification


@pytest.fixture
def st(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    # Entries here are milliseconds old: trust their times (the default waits 2 s, for
    # file systems whose clocks tick coarsely); the tests sleep a tick before editing.
    monkeypatch.setattr(verification, "RACY_NS", 0)
    s = open_store(tmp_path / "cache")
    assert isinstance(s, Store)
    return s


def _fill(st: Store, n: int = 4) -> list[Entry]:
    return [st.put(make_key({"i": i}), {"a.bin": os.urandom(64 + i), "sub/b": b"b" * i},
                   labels={"kind": "graph"} if i == 0 else {"model": "m"})
            for i in range(n)]


def _stamped(st: Store, n: int) -> None:
    first = st.verify()
    assert first.ok and first.checked == n and first.unchanged == 0
    again = st.verify()
    assert again.ok and again.checked == n and again.unchanged == n
    assert again.shared_graphs == first.shared_graphs == 1
    time.sleep(0.02)  # a later edit gets a later ctime on any clock


def _flip(e: Entry) -> None:
    f = e.files["a.bin"]
    f.chmod(0o600)
    b = bytearray(f.read_bytes())
    b[0] ^= 0xFF
    f.write_bytes(bytes(b))


def _flip_keeping_times(e: Entry) -> None:
    f = e.files["a.bin"]
    before = os.lstat(f)
    _flip(e)
    os.chmod(f, before.st_mode)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # ctime moves all the same


def _edit_manifest_keeping_times(e: Entry) -> None:
    m = e.path / "manifest.json"
    before = os.lstat(m)
    doc = json.loads(m.read_text())
    doc["labels"]["model"] = "other"
    m.chmod(0o600)
    m.write_text(json.dumps(doc))
    os.chmod(m, before.st_mode)
    os.utime(m, ns=(before.st_atime_ns, before.st_mtime_ns))


def _swap_for_symlink(e: Entry) -> None:
    f = e.files["sub/b"]
    f.unlink()
    f.symlink_to("/etc/hostname")


def _replace_same_bytes_size(e: Entry) -> None:
    f = e.files["a.bin"]
    tmp = f.with_name("x")
    tmp.write_bytes(b"\0" * f.stat().st_size)
    os.replace(tmp, f)


@pytest.mark.parametrize("edit,kind", [
    (_flip, "corrupt"), (_flip_keeping_times, "corrupt"),
    (_edit_manifest_keeping_times, "corrupt"), (_swap_for_symlink, "insecure"),
    (_replace_same_bytes_size, "corrupt"),
], ids=["flip", "flip-keeping-times", "manifest-keeping-times", "symlink", "replaced"])
def test_a_change_after_the_last_check_is_caught_without_full(
        st: Store, edit: Callable[[Entry], None], kind: str) -> None:
    es = _fill(st)
    _stamped(st, len(es))
    edit(es[2])
    r = st.verify()
    assert [d for d, _ in r.problems] == [es[2].key], r
    assert r.problems[0][1].startswith(kind), r.problems
    assert r.unchanged == len(es) - 1   # only the changed one was read again
    assert not st.verify().ok, "a bad entry is never stamped"


def test_full_reads_what_no_stamp_shows(st: Store) -> None:
    # Bytes changed with no trace in any inode's times (a failing disk): only --full sees
    # it. Simulated by stamping the entry as it is after the change.
    es = _fill(st)
    _stamped(st, len(es))
    _flip(es[1])
    records = [verification._record(n, os.lstat(es[1].path / n)) for n in
               (".", "manifest.json", "data", "data/sub", "data/a.bin", "data/sub/b")]
    st.index.set_stamps({es[1].key: (False, verification._seal(records))})
    assert st.verify().ok, "unchanged since its stamp: not read (the documented limit)"
    full = st.verify(full=True)
    assert [d for d, _ in full.problems] == [es[1].key] and full.unchanged == 0


def test_recent_entries_are_read_again(tmp_path: Path) -> None:
    # The default: an entry changed within RACY_NS of the check gets no stamp.
    st = open_store(tmp_path / "cache")
    assert isinstance(st, Store)
    es = _fill(st, 2)
    assert st.verify().ok
    again = st.verify()
    assert again.ok and again.checked == len(es) and again.unchanged == 0


def test_stamps_of_gone_entries_are_dropped(st: Store) -> None:
    es = _fill(st)
    _stamped(st, len(es))
    assert set(st.index.stamps()) == {e.key for e in es}
    st.delete(make_key({"i": 3}))
    assert st.verify().ok
    assert set(st.index.stamps()) == {e.key for e in es[:3]}
    # Published again under the same key: a new directory, read in full.
    st.put(make_key({"i": 3}), {"a.bin": b"new"})
    r = st.verify()
    assert r.ok and r.unchanged == 3


def test_cachectl_verify_says_what_it_skipped(st: Store) -> None:
    es = _fill(st)
    run = CliRunner()
    first = run.invoke(cli, ["verify", "--cache-dir", str(st.root)])
    # _fill's first entry is a shared graph: counted apart (one rule across verbs).
    assert first.exit_code == 0 and f"checked {len(es) - 1} entries (+1 shared graph)" in \
        first.output, first.output
    assert "unchanged" not in first.output
    again = run.invoke(cli, ["verify", "--cache-dir", str(st.root)])
    assert again.exit_code == 0 and f"{len(es)} unchanged" in again.output, again.output
    full = run.invoke(cli, ["verify", "--full", "--json", "--cache-dir", str(st.root)])
    doc = json.loads(full.output)
    assert full.exit_code == 0 and doc["unchanged"] == 0 and doc["checked"] == len(es)
