"""The store in one process: publish, lookup, index, dedup, corruption, security."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cachecompile.store import (
    Hit,
    Miss,
    ReadOnlyStore,
    Store,
    errors,
    fsutil,
    make_key,
    open_store,
    verification,
)


@pytest.fixture
def st(tmp_path: Path) -> Store:
    s = open_store(tmp_path / "cache")
    assert isinstance(s, Store)
    return s


def _forget_verification() -> None:
    # As if a new process: the next get re-verifies checksums in full.
    verification._VERIFIED.clear()


def test_open_creates_private_versioned_root(tmp_path: Path) -> None:
    st = open_store(tmp_path / "a" / "cache")
    assert st.root == tmp_path / "a" / "cache"
    assert stat.S_IMODE(os.stat(st.root).st_mode) == 0o700
    assert (st.root / "v1" / "entries").is_dir()


def test_location_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_DIR", str(tmp_path / "env"))
    assert open_store().root == tmp_path / "env"
    monkeypatch.delenv("CACHECOMPILE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert open_store().root == tmp_path / "xdg" / "cachecompile"


def test_put_get_roundtrip(st: Store, tmp_path: Path) -> None:
    src = tmp_path / "k.so"
    src.write_bytes(b"\x7fELF" + os.urandom(1000))
    src.chmod(0o755)
    key = make_key({"model": "m", "n": 1})
    e = st.put(key, {"k.so": src, "py/code.py": b"x = 1\n"},
               labels={"model": "m", "function": "forward", "ranks": 0}, meta={"v": [1]})
    assert e.key == key.digest and e.labels == {"model": "m", "function": "forward", "ranks": "0"}
    _forget_verification()
    r = st.get(key)
    assert isinstance(r, Hit) and r
    assert r.entry.files["k.so"].read_bytes() == src.read_bytes()
    assert r.entry.files["py/code.py"].read_text() == "x = 1\n"
    assert r.entry.files["k.so"].stat().st_mode & stat.S_IXUSR  # loaders exec/dlopen it
    assert r.entry.factors == {"model": "m", "n": 1} and r.entry.meta == {"v": [1]}
    assert st.get(key.digest).entry.key == key.digest  # type: ignore[union-attr]
    assert st.contains(key) and st.contains(key.digest)
    info = st.stat(key)
    assert info is not None and info.hits == 2 and info.size_bytes == 1004 + 6


def test_a_miss_is_counted_by_the_caller_once(st: Store) -> None:
    # One user lookup may probe several keys (a frame's variants): get counts no miss;
    # the caller records what the lookup came to, once, with what it was about.
    for _ in range(3):
        r = st.get(make_key({"nothing": True}))
        assert isinstance(r, Miss) and not r and r.kind == "absent"
    assert st.stats()["misses"] == {}
    st.record_miss("absent")
    st.record_miss("stale")
    st.record_miss("guard", "input_ids")
    st.record_miss("guard", "input_ids")
    s = st.stats()
    assert s["misses"] == {"absent": 1, "stale": 1, "guard": 2} and s["hits"] == 0
    assert s["misses_about"] == {"guard": {"input_ids": 2}}


def test_put_existing_returns_winner_untouched(st: Store) -> None:
    key = make_key({"k": 1})
    first = st.put(key, {"a": b"one"})
    second = st.put(key, {"a": b"two"})
    assert second.files["a"].read_bytes() == b"one" and second.created == first.created
    assert st.stats()["publishes"] == 1


def test_put_rejects_unsafe_names(st: Store) -> None:
    for bad in ("../x", "/abs", "a/../../b"):
        with pytest.raises(errors.UnsafePathError):
            st.put(make_key({"bad": bad}), {bad: b"x"})
    assert list(st.digests()) == []


def test_entries_find_stats_delete(st: Store) -> None:
    k1, k2 = make_key({"i": 1}), make_key({"i": 2})
    st.put(k1, {"a": b"1" * 10}, labels={"model": "m", "function": "f"})
    st.put(k2, {"a": b"2" * 20}, labels={"model": "m", "function": "g"})
    assert {i.key for i in st.entries()} == {k1.digest, k2.digest}
    assert [i.key for i in st.find(function="g")] == [k2.digest]
    assert [i.key for i in st.find(model="m", function="f")] == [k1.digest]
    s = st.stats()
    assert (s["entries"], s["bytes"], s["publishes"]) == (2, 30, 2)
    assert st.delete(k1) and not st.delete(k1)
    assert isinstance(st.get(k1), Miss)
    assert st.resolve(k2.digest[:6]) == k2.digest


def test_resolve_prefix_errors(st: Store) -> None:
    with pytest.raises(errors.KeyNotFound):
        st.resolve("abc")
    keys = [make_key({"i": i}) for i in range(40)]
    for k in keys:
        st.put(k, {"a": b"x"})
    with pytest.raises(errors.KeyNotFound, match="hex"):
        st.resolve("")
    firsts = [k.digest[0] for k in keys]
    common = max(set(firsts), key=firsts.count)
    with pytest.raises(errors.AmbiguousKey):
        st.resolve(common)


def test_dedup_shares_one_inode(st: Store) -> None:
    blob = os.urandom(1 << 20)
    e1 = st.put(make_key({"i": 1}), {"w.bin": blob})
    e2 = st.put(make_key({"i": 2}), {"other/w.bin": blob})
    s1, s2 = os.stat(e1.files["w.bin"]), os.stat(e2.files["other/w.bin"])
    assert s1.st_ino == s2.st_ino and s1.st_nlink == 3  # two entries + the blob
    used = sum(os.lstat(p).st_blocks * 512 for p in {e1.files["w.bin"]})
    assert used < 1.1 * (1 << 20)
    # du-style: count each inode once over the whole root.
    seen, total = set(), 0
    for dirpath, _, names in os.walk(st.root / "v1" / "entries"):
        for n in names:
            s = os.lstat(os.path.join(dirpath, n))
            if s.st_ino not in seen:
                seen.add(s.st_ino)
                total += s.st_blocks * 512
    assert total < 1.1 * (1 << 20)


def test_second_read_checks_sizes_only(st: Store) -> None:
    key = make_key({"i": 1})
    e = st.put(key, {"a": b"abc"})
    p = e.files["a"]
    p.chmod(0o600)
    p.write_bytes(b"abd")  # same size, different bytes: invisible to a size check
    assert isinstance(st.get(key), Hit)  # verified at publish in this process
    _forget_verification()
    r = st.get(key)
    assert isinstance(r, Miss) and r.kind == "corrupt" and "checksum" in r.reason


# -- corruption: every kind is a Miss with a reason, quarantined, and reported by verify --
def _corrupt(e_path: Path, how: str) -> None:
    data = e_path / "data" / "big.bin"
    if how == "flip":
        data.chmod(0o600)
        b = bytearray(data.read_bytes())
        b[len(b) // 2] ^= 0xFF
        data.write_bytes(bytes(b))
    elif how == "truncate":
        data.chmod(0o600)
        with open(data, "r+b") as f:
            f.truncate(100)
    elif how == "delete":
        data.unlink()
    elif how == "manifest":
        (e_path / "manifest.json").chmod(0o600)
        (e_path / "manifest.json").write_text("{ not json")
    elif how == "traversal":
        m = e_path / "manifest.json"
        doc = json.loads(m.read_text())
        doc["files"]["../../../../etc/passwd"] = doc["files"].pop("big.bin")
        m.chmod(0o600)
        m.write_text(json.dumps(doc))
    elif how == "symlink":
        data.unlink()
        data.symlink_to("/etc/passwd")


@pytest.mark.parametrize("how,kind", [
    ("flip", "corrupt"), ("truncate", "corrupt"), ("delete", "corrupt"), ("manifest", "corrupt"),
    ("traversal", "insecure"), ("symlink", "insecure"),
])
def test_corruption_is_a_miss_and_quarantined(st: Store, how: str, kind: str) -> None:
    key = make_key({"how": how})
    e = st.put(key, {"big.bin": os.urandom(300_000), "small": b"s"})
    other = st.put(make_key({"other": 1}), {"x": b"fine"})
    _forget_verification()
    _corrupt(e.path, how)
    report = st.verify()
    assert not report.ok and [d for d, _ in report.problems] == [key.digest]
    r = st.get(key)
    assert isinstance(r, Miss) and r.kind == kind and r.reason
    assert not e.path.exists()
    q = list((st.root / "v1" / "quarantine").iterdir())
    assert any(p.name.startswith(key.digest) and p.is_dir() for p in q)  # kept, not deleted
    assert st.stats()["corruptions"] == 1 and st.stats()["misses"] == {}
    assert st.verify().ok and isinstance(st.get(other.key), Hit)
    # Publishing afresh works and does not reuse a damaged blob.
    st.put(key, {"big.bin": b"new", "small": b"s"})
    _forget_verification()
    assert isinstance(st.get(key), Hit)


def test_verify_fix_quarantines_and_reindexes(st: Store) -> None:
    good = st.put(make_key({"g": 1}), {"a": b"good"})
    bad = st.put(make_key({"b": 1}), {"a": b"bad!" * 100})
    _forget_verification()
    _corrupt_file = bad.files["a"]
    _corrupt_file.chmod(0o600)
    _corrupt_file.write_bytes(b"x")
    st.index.remove(good.key)  # index drift: the manifests are the truth
    r = st.verify()
    assert r.problems[0][0] == bad.key and r.index_missing == [good.key]
    fixed = st.verify(fix=True)
    assert fixed.quarantined == [bad.key] and fixed.reindexed
    after = st.verify()
    assert after.ok and after.checked == 1
    info = st.stat(good.key)
    assert info is not None and info.state == "ok"


# -- security ----------------------------------------------------------------------
def test_foreign_owned_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "foreign"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(errors.InsecureStoreError, match="CACHECOMPILE_SHARED_GROUP") as ei:
        open_store(root)
    assert ei.value.path == root and "owned by uid 65534" in str(ei.value)


def test_world_writable_root_is_refused_even_shared(tmp_path: Path) -> None:
    root = tmp_path / "ww"
    root.mkdir()
    root.chmod(0o777)
    for shared in (False, True):
        with pytest.raises(errors.InsecureStoreError, match="world-writable"):
            open_store(root, shared_group=shared)


def test_group_writable_root_needs_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Group-writable without setgid: not a team store, refused unless opted in.
    plain = tmp_path / "plain"
    plain.mkdir()
    plain.chmod(0o770)
    os.chown(plain, 65534, os.getegid())
    with pytest.raises(errors.InsecureStoreError, match="group"):
        open_store(plain)
    # A team store (cachectl init --shared: setgid, group-writable) is recognised as one,
    # but its owner must be a member of its group: nobody (65534) is not.
    team = tmp_path / "team"
    team.mkdir()
    os.chown(team, 65534, os.getegid())
    team.chmod(0o2770)
    with pytest.raises(errors.InsecureStoreError, match="not a member of group"):
        open_store(team)
    monkeypatch.setenv("CACHECOMPILE_SHARED_GROUP", "1")
    with pytest.raises(errors.InsecureStoreError, match="not a member of group"):
        open_store(team)
    # Owned by a member (here this user), it opens shared with no setting at all.
    monkeypatch.delenv("CACHECOMPILE_SHARED_GROUP")
    os.chown(team, os.geteuid(), os.getegid())
    st = open_store(team)
    assert isinstance(st, Store) and st.shared_group
    e = st.put(make_key({"shared": 1}), {"a": b"x"})
    assert isinstance(st.get(e.key), Hit)
    assert oct(e.path.stat().st_mode & 0o7777) == "0o2770"


def test_foreign_owned_entry_is_insecure(st: Store) -> None:
    e = st.put(make_key({"i": 1}), {"a": b"x"})
    os.chown(e.path, 65534, 65534)
    _forget_verification()
    r = st.get(e.key)
    assert isinstance(r, Miss) and r.kind == "insecure" and "65534" in r.reason


def test_readonly_wrapper(st: Store, caplog: pytest.LogCaptureFixture) -> None:
    key = make_key({"i": 1})
    st.put(key, {"a": b"x"})
    ro = open_store(st.root, readonly=True)
    assert isinstance(ro, ReadOnlyStore) and ro.root == st.root
    assert isinstance(ro.get(key), Hit)
    assert isinstance(ro.get(make_key({"no": 1})), Miss)
    with caplog.at_level(logging.WARNING, logger="cachecompile.store"):
        for _ in range(3):
            with pytest.raises(errors.ReadOnlyStoreError):
                ro.put(make_key({"j": 1}), {"a": b"y"})
    assert sum("read-only" in r.message for r in caplog.records) == 1  # one warning, not three
    for call in (lambda: ro.delete(key), lambda: ro.gc(), lambda: ro.purge(all=True)):
        with pytest.raises(errors.ReadOnlyStoreError):
            call()
    with ro.lock("k"), ro.pin(key):
        pass
    assert [i.key for i in ro.entries()] == [key.digest]


def test_a_read_only_index_missing_is_empty_and_unreadable_is_said_once(
        st: Store, caplog: pytest.LogCaptureFixture) -> None:
    """A read-only view reads its index on every miss's explanation (entries, stat):
    a database never made is an empty index, no warning; one that cannot be read is
    one warning for the view, not one per read."""
    key = make_key({"i": 1})
    st.put(key, {"a": b"x"})
    st.close()

    def warnings_after(ro: ReadOnlyStore) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cachecompile.store"):
            for _ in range(3):
                assert [i.key for i in ro.entries()] == [key.digest]  # the disk is the truth
                ro.stat(key)
        return [r.getMessage() for r in caplog.records]

    db = st.root / "v1" / "index" / "entries.db"
    assert db.is_file()
    db.rename(db.with_name("moved.db"))
    missing = open_store(st.root, readonly=True)
    assert isinstance(missing, ReadOnlyStore) and warnings_after(missing) == []
    db.write_bytes(b"not a database" * 100)
    broken = open_store(st.root, readonly=True)
    assert isinstance(broken, ReadOnlyStore)
    said = warnings_after(broken)
    assert len(said) == 1 and "said once" in said[0], said


def test_unwritable_root_opens_read_only(st: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Running as root, mode bits do not stop writes; the probe is what decides.
    from cachecompile import store as store_pkg

    monkeypatch.setattr(store_pkg, "_writable", lambda p: False)
    ro = open_store(st.root)
    assert isinstance(ro, ReadOnlyStore) and "write permission" in ro.why


def test_full_disk_leaves_no_half_entry(st: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    key = make_key({"full": 1})
    with pytest.raises(errors.StoreFullError):
        st.put(key, {"a": b"a" * 10, "b": b"b" * 10, "c": b"c" * 10})
    monkeypatch.setattr(os, "write", real_write)
    assert not st.contains(key) and isinstance(st.get(key), Miss)
    assert list((st.root / "v1" / "tmp").iterdir()) == []
    assert list((st.root / "v1" / "entries").rglob("*")) == []
    st.put(key, {"a": b"a" * 10})
    assert isinstance(st.get(key), Hit)


def test_lock_timeout_names_the_path(st: Store) -> None:
    with st.lock("compile:abc") as path:
        assert path.exists()
        import subprocess
        import sys

        code = (
            "import sys; from cachecompile.store import open_store, errors\n"
            f"st = open_store({str(st.root)!r})\n"
            "try:\n"
            "    with st.lock('compile:abc', timeout=0.2): sys.exit(0)\n"
            "except errors.LockTimeout as e:\n"
            "    print(e.path); sys.exit(3)\n"
        )
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert p.returncode == 3, p.stderr
        assert p.stdout.strip() == str(path)
    assert path.exists()  # never unlinked: others may wait on it


def test_a_symlinked_lock_file_names_itself_and_the_fix(st: Store, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    # A symlink in place of locks/gc.lock blocked every gc with a bare "Too many levels of
    # symbolic links" (and what it points at is never opened).
    target = tmp_path / "elsewhere"
    target.write_text("not the store's")
    lock_file = st.root / "v1" / "locks" / "gc.lock"
    lock_file.symlink_to(target)
    with pytest.raises(errors.InsecureStoreError) as caught:
        st.gc(max_size=0)
    assert caught.value.path == lock_file
    assert "symlink" in str(caught.value) and f"rm {lock_file}" in str(caught.value)
    assert target.read_text() == "not the store's"
    # cachectl says the same, as exit 3 (insecure), not a raw OSError.
    from click.testing import CliRunner

    from cachecompile.cli.main import cli

    r = CliRunner().invoke(cli, ["gc", "--cache-dir", str(st.root)])
    assert r.exit_code == 3, r.output
    assert f"rm {lock_file}" in r.output
    # A publish over the cap still publishes; its automatic gc warns once, with the fix.
    small = open_store(st.root, max_size=10)
    caplog.set_level(logging.WARNING, logger="cachecompile.store.disk")
    for i in range(3):
        small.put(make_key({"over": i}), {"a": b"x" * 100})
    warned = [r.getMessage() for r in caplog.records if "automatic gc" in r.getMessage()]
    assert len(warned) == 1 and f"rm {lock_file}" in warned[0], warned
    lock_file.unlink()
    assert len(st.gc(max_size=0).evicted) == 3


def test_sweep_removes_dead_and_old_temp_dirs(st: Store) -> None:
    tmp = st.root / "v1" / "tmp"
    from cachecompile.store.fsutil import HOST_TAG

    dead = tmp / f"put.{'0' * 32}.{HOST_TAG}.999999999.abcd"
    dead.mkdir()
    (dead / "junk").write_bytes(b"x")
    mine = tmp / f"put.{'1' * 32}.{HOST_TAG}.{os.getpid()}.abcd"
    mine.mkdir()
    old_foreign = tmp / "put.x.ffffffff.1.abcd"
    old_foreign.mkdir()
    os.utime(old_foreign, (1, 1))
    young_foreign = tmp / "put.x.ffffffff.1.abce"
    young_foreign.mkdir()
    assert st.sweep_temp() == 2
    assert sorted(p.name for p in tmp.iterdir()) == sorted([mine.name, young_foreign.name])


# -- symlinked directories inside the root -------------------------------------------
def _swap_for_link(real: Path, outside: Path) -> None:
    """Move ``real`` out of the cache (a whole, valid copy) and leave a symlink to it."""
    import shutil

    shutil.copytree(real, outside, symlinks=True)
    fsutil.rmtree_quiet(real)
    real.symlink_to(outside, target_is_directory=True)


@pytest.mark.parametrize("where", ["data", "shard", "entries"])
def test_lookup_through_a_symlinked_parent_is_refused(
        st: Store, tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture) -> None:
    key = make_key({"link": where})
    e = st.put(key, {"a": b"inside", "sub/b": b"more"})
    link = {"data": e.path / "data", "shard": e.path.parent,
            "entries": st.root / "v1" / "entries"}[where]
    outside = tmp_path / "elsewhere" / link.name
    outside.parent.mkdir()
    _swap_for_link(link, outside)
    # verify first (a fresh handle, as cachectl would be): a lookup quarantines a bad entry.
    report = open_store(st.root).maintenance().verify()
    assert not report.ok and any("symlink" in why for _, why in report.problems)
    _forget_verification()
    with caplog.at_level(logging.WARNING, logger="cachecompile.store"):
        r = st.get(key)
        assert isinstance(r, Miss) and r.kind == "insecure" and "symlink" in r.reason
        assert isinstance(st.peek(key), Miss)
    warned = [rec.getMessage() for rec in caplog.records]
    assert len(warned) == 1 and str(link) in warned[0], warned
    # Whatever lies behind the link is never moved, opened as an entry, or deleted.
    assert outside.is_dir() and any(p.is_file() for p in outside.rglob("*"))
    if where != "data":  # a link above the entry: the entry is not listed at all
        assert key.digest not in {i.key for i in st.entries()}


def test_a_symlinked_layout_dir_is_never_written_through(st: Store, tmp_path: Path) -> None:
    blobs = st.root / "v1" / "blobs"
    outside = tmp_path / "elsewhere"
    _swap_for_link(blobs, outside)
    with pytest.raises(errors.InsecureStoreError, match="symlink"):
        st.put(make_key({"w": 1}), {"a": b"never written outside"})
    assert list(outside.rglob("*")) == []
    (outside / "zz").mkdir()
    (outside / "zz" / "victim").write_bytes(b"not ours")
    st.gc(max_size=0)  # gc sweeps blobs: never through the link
    assert (outside / "zz" / "victim").exists()
    assert not st.verify().ok


def test_a_symlinked_v1_is_refused_at_open(st: Store, tmp_path: Path) -> None:
    _swap_for_link(st.root / "v1", tmp_path / "elsewhere")
    with pytest.raises(errors.InsecureStoreError, match="symlink"):
        open_store(st.root)


# -- physical sizes under dedup ------------------------------------------------------
def test_cap_counts_shared_blobs_once(st: Store) -> None:
    shared = os.urandom(10_000)
    a = st.put(make_key({"i": 1}), {"w.bin": shared, "own": b"a" * 100})
    b = st.put(make_key({"i": 2}), {"w.bin": shared, "own": b"b" * 100})
    s = st.stats()
    assert (s["bytes"], s["logical_bytes"]) == (10_200, 20_200)
    # Both fit in 12 kB on disk: nothing is evicted, although the logical sum is 20 kB.
    r = st.gc(max_size=12_000)
    assert r.evicted == [] and r.bytes_before == r.bytes_after == 10_200
    assert {i.key for i in st.entries()} == {a.key, b.key}
    # Below that, one goes, and only its own bytes are freed (the shared blob stays).
    r = st.gc(max_size=10_150)
    assert len(r.evicted) == 1 and r.freed_bytes == 100 and r.bytes_after == 10_100
    assert st.stats()["bytes"] == 10_100


def test_byte_counter_is_physical(st: Store) -> None:
    shared = os.urandom(5_000)
    st.put(make_key({"i": 1}), {"w.bin": shared})
    e2 = st.put(make_key({"i": 2}), {"w.bin": shared})
    assert st.index.counter("bytes") == 5_000
    st.delete(e2.key)
    assert st.index.counter("bytes") == 5_000  # the first entry still holds the blob


# -- the executable bit under dedup ------------------------------------------------------
def _source(tmp_path: Path, name: str, data: bytes, mode: int) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    p.chmod(mode)
    return p


def _cachectl_verify(root: Path, child_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachecompile.cli.main", "verify", "--cache-dir", str(root)],
                          env=child_env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("first_executable", [False, True])
def test_same_bytes_keep_each_entrys_mode(st: Store, tmp_path: Path, child_env: dict[str, str],
                                          first_executable: bool) -> None:
    # A launcher script and a plain copy of it: entries share a blob's inode and so its
    # mode, so the second must not get the first one's.
    data = b"#!/bin/sh\necho " + os.urandom(8).hex().encode() + b"\n"
    mode_a, mode_b = (0o755, 0o644) if first_executable else (0o644, 0o755)
    ka, kb = make_key({"exec": "a"}), make_key({"exec": "b"})
    st.put(ka, {"run.sh": _source(tmp_path, "a.sh", data, mode_a)})
    st.put(kb, {"run.sh": _source(tmp_path, "b.sh", data, mode_b)})
    _forget_verification()
    for key, mode in ((kb, mode_b), (ka, mode_a)):
        r = st.get(key)
        assert isinstance(r, Hit)
        f = r.entry.files["run.sh"]
        assert f.read_bytes() == data
        assert os.access(f, os.X_OK) == bool(mode & 0o100), (key.factors, oct(f.stat().st_mode))
        assert stat.S_IMODE(f.stat().st_mode) == (0o500 if mode & 0o100 else 0o400)
    p = _cachectl_verify(st.root, child_env)
    assert p.returncode == 0, (p.stdout, p.stderr)
    # Same content in both modes is two inodes; each mode still dedups on its own.
    kc = make_key({"exec": "c"})
    c = st.put(kc, {"again.sh": _source(tmp_path, "c.sh", data, mode_b)})
    assert os.path.samefile(c.files["again.sh"], st.entry_dir(kb.digest) / "data" / "run.sh")


def test_a_blob_from_before_the_mode_was_its_identity(st: Store, tmp_path: Path,
                                                      child_env: dict[str, str]) -> None:
    # Stores written before held one blob per content under its plain name, in the
    # mode of whichever entry stored it first: here an executable one.
    data = os.urandom(300)
    old = st.put(make_key({"old": 1}), {"tool": _source(tmp_path, "t", data, 0o755)})
    blob_dir = st.root / "v1" / "blobs"
    (blob,) = [b for b in blob_dir.rglob("*") if b.is_file()
               and os.path.samefile(b, old.files["tool"])]
    plain = blob.parent / blob.name.split(".")[0]
    os.rename(blob, plain)
    new = st.put(make_key({"new": 1}), {"tool": _source(tmp_path, "u", data, 0o644)})
    assert not os.access(new.files["tool"], os.X_OK)
    assert os.access(old.files["tool"], os.X_OK)  # the old entry keeps its own file
    _forget_verification()
    assert isinstance(st.get(make_key({"old": 1})), Hit)
    assert isinstance(st.get(make_key({"new": 1})), Hit)
    p = _cachectl_verify(st.root, child_env)
    assert p.returncode == 0, (p.stdout, p.stderr)


# -- CACHECOMPILE_READONLY -----------------------------------------------------------
def test_readonly_env_is_decided_by_open_store(st: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_key({"i": 1})
    st.put(key, {"a": b"x"})
    monkeypatch.setenv("CACHECOMPILE_READONLY", "1")
    ro = open_store(st.root)
    assert isinstance(ro, ReadOnlyStore) and "CACHECOMPILE_READONLY" in ro.why
    assert isinstance(ro.get(key), Hit)
    with pytest.raises(errors.ReadOnlyStoreError):
        ro.put(make_key({"i": 2}), {"a": b"y"})
    monkeypatch.setenv("CACHECOMPILE_READONLY", "0")
    assert isinstance(open_store(st.root), Store)


def test_missing_root_is_not_created_when_asked(tmp_path: Path) -> None:
    with pytest.raises(errors.StoreNotFound, match="no cache"):
        open_store(tmp_path / "typo", create=False)
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.StoreNotFound):
        open_store(tmp_path / "empty", create=False)
    assert list((tmp_path / "empty").iterdir()) == []
    open_store(tmp_path / "real")
    assert isinstance(open_store(tmp_path / "real", create=False), Store)


def test_hits_later_are_written_together_and_read_back_by_their_own_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A serving process (hits_later) does not open the index on a hit; its hits are
    # written in one transaction on a timer, before any read of its own, or at exit.
    from cachecompile.store import index as index_mod

    root = tmp_path / "cache"
    key = make_key({"n": 1})
    open_store(root).put(key, {"a": b"x"})
    serving = open_store(root, hits_later=True)
    other = open_store(root)                      # another process's view of the index
    monkeypatch.setattr(index_mod, "HITS_DELAY_S", 3600.0)
    assert serving.get(key) and serving.get(key)
    assert isinstance(serving, Store) and serving.index._con is None  # not opened
    assert other.stats()["hits"] == 0             # queued, not written yet
    assert serving.stats()["hits"] == 2           # its own read writes the queue first
    assert other.stats()["hits"] == 2
    info = other.stat(key)
    assert info is not None and info.hits == 2

    monkeypatch.setattr(index_mod, "HITS_DELAY_S", 0.01)
    assert serving.get(key)
    timer = serving.index._hits_timer
    assert timer is not None
    timer.join(30)                                # the timer writes it
    assert other.stats()["hits"] == 3

    code = ("import sys; from cachecompile.store import open_store\n"
            "assert open_store(sys.argv[1], hits_later=True).get(sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, str(root), key.digest], check=True,
                   timeout=120)                   # written at exit
    assert other.stats()["hits"] == 4
