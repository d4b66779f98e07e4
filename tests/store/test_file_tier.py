"""The shared-filesystem tier (file://) between two "nodes": a tmpfs at two mount points
(tests/fs_util.py says why not NFS on this machine, and which stand-in ran).

No lock, no database on the share: blobs written once, records published by a
create-only link and replaced by one atomic rename; readers meet temp files of writers
midway and never see them. The other tiers' trust rules hold, plus the filesystem's own:
ownership, no link followed, every name checked.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ccutil import cachectl
from fs_util import SharedDir, shared_dir
from tier_util import clean_remote_env, store_warnings, tiered

from cachecompile import store
from cachecompile.store import Hit, Miss, make_key
from cachecompile.store.errors import CorruptEntryError
from cachecompile.store.remote import FileRemote
from cachecompile.store.signing import Trust, make_record

KEY = "fleet-secret-key-for-files"
FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 40, "code/out.py": b"x = 1\n",
         "empty": b""}
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another uid)")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_remote_env(monkeypatch)


@pytest.fixture
def share(tmp_path: Path) -> Iterator[SharedDir]:
    with shared_dir(tmp_path / "share") as s:
        logging.getLogger(__name__).warning("the share: %s", s.how)  # which stand-in ran
        yield s




def publish(share: SharedDir, root: Path, factors: dict[str, object],
            files: dict[str, bytes] = FILES) -> store.Key:
    a = tiered(root, share.url("a"))
    key = make_key(factors)
    a.put(key, files, labels={"model": "m"})
    assert a.flush(20) and a.uploader is not None and a.uploader.uploaded == 1
    return key


def test_two_nodes_share_entries_byte_exact(tmp_path: Path, share: SharedDir,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    key = publish(share, tmp_path / "a", {"model": "m", "n": 1})
    b = tiered(tmp_path / "b", share.url("b"))
    hit = b.get(key)
    assert isinstance(hit, Hit) and hit.entry.path.is_relative_to(tmp_path / "b")
    assert {n: p.read_bytes() for n, p in hit.entry.files.items()} == FILES
    assert os.access(hit.entry.files["kernel.so"], os.R_OK)
    s = b.stats()
    assert (s["hits_remote"], s["hits_remote_levels"]) == (1, {share.url("b"): 1})
    # The share holds files only: no lock, no database, nothing left in tmp/.
    names = [p.relative_to(share.a / "cc").as_posix() for p in (share.a / "cc").rglob("*")
             if p.is_file()]
    kinds = sorted(n.split("/")[1] for n in names)
    assert kinds == ["blob"] * 3 + ["entry"], names  # the upload ended: its pins went
    assert not any(n.endswith((".lock", ".db", ".sqlite")) for n in names)
    assert list((share.a / "cc" / "v1" / "tmp").iterdir()) == []
    # A second publish of the same entry by another node writes nothing new.
    c = tiered(tmp_path / "c", share.url("b"))
    c.put(key, FILES)
    assert c.flush(20) and c.uploader is not None and c.uploader.uploaded == 0


def test_unsigned_and_wrongly_signed_records_are_refused(
        tmp_path: Path, share: SharedDir, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    key = publish(share, tmp_path / "a", {"unsigned": 1})
    with caplog.at_level(logging.WARNING):
        assert isinstance(tiered(tmp_path / "b", share.url("b")).get(key), Miss)
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
        assert isinstance(tiered(tmp_path / "c", share.url("b")).get(key), Miss)
    warned = store_warnings(caplog)
    assert len(warned) == 2 and "TRUST_REMOTE" in warned[0] and "not signed" in warned[1]
    monkeypatch.delenv("CACHECOMPILE_SIGNING_KEY")
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    assert isinstance(tiered(tmp_path / "d", share.url("b")).get(key), Hit)


def _record_file(share: SharedDir, digest: str) -> Path:
    return share.a / "cc" / "v1" / "entry" / digest[:2] / digest


@ROOT_ONLY
def test_files_other_users_could_have_written_are_refused(
        tmp_path: Path, share: SharedDir, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    key = publish(share, tmp_path / "a", {"owner": 1})
    rec = _record_file(share, key.digest)
    os.chown(rec, 12345, 12345)  # another user's file, however well signed
    with caplog.at_level(logging.WARNING):
        assert isinstance(tiered(tmp_path / "b", share.url("b")).get(key), Miss)
    assert any("owned by uid 12345" in w for w in store_warnings(caplog)), store_warnings(caplog)
    os.chown(rec, 0, 0)
    # A directory others may write: nothing under it is believed.
    blob_dir = share.a / "cc" / "v1" / "blob"
    blob_dir.chmod(0o777)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert isinstance(tiered(tmp_path / "c", share.url("b")).get(key), Miss)
    assert any("world-writable" in w for w in store_warnings(caplog)), store_warnings(caplog)
    blob_dir.chmod(0o700)
    assert isinstance(tiered(tmp_path / "d", share.url("b")).get(key), Hit)


def test_no_symlink_is_followed_below_the_root(tmp_path: Path, share: SharedDir,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    key = publish(share, tmp_path / "a", {"links": 1})
    blobs = sorted((share.a / "cc" / "v1" / "blob").rglob("*"))
    victim = next(p for p in blobs if p.is_file() and p.stat().st_size > 100)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(victim.read_bytes())  # the same bytes, reached through a link
    victim.unlink()
    victim.symlink_to(outside)
    with caplog.at_level(logging.WARNING):
        assert isinstance(tiered(tmp_path / "b", share.url("b")).get(key), Miss)
    warned = store_warnings(caplog)
    assert len(warned) == 1 and "a symlink" in warned[0], warned
    victim.unlink()
    # A symlinked directory: the whole tier is refused (one warning), nothing followed.
    entry_dir = share.a / "cc" / "v1" / "entry"
    moved = tmp_path / "entries-elsewhere"
    shutil.move(entry_dir, moved)
    entry_dir.symlink_to(moved)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert isinstance(tiered(tmp_path / "c", share.url("b")).get(key), Miss)
    warned = store_warnings(caplog)
    assert len(warned) == 1 and "a symlink" in warned[0], warned


def test_every_name_is_checked_before_it_is_a_path(tmp_path: Path, share: SharedDir) -> None:
    r = FileRemote(share.url("b"), trust=Trust(accept_unsigned=True))
    for bad in ("../../etc/passwd", "A" * 32, "0" * 31, "0" * 32 + "/x"):
        with pytest.raises(CorruptEntryError):
            r.read_record(bad)
    # A record (trusted, even) whose blob address is a path, not a SHA-256.
    trust = Trust(accept_unsigned=True)
    src = store.open_store(tmp_path / "src", remote="")
    entry = src.put(make_key({"evil": 1}), {"a": b"x"})
    sneaky = ("../" * 21 + "etc")[:64].ljust(64, "/")
    rec = make_record(entry.manifest, {"a": sneaky}, {sneaky: 1}, trust)
    assert r.write_record(entry.key, rec.to_bytes(), None)
    with pytest.raises(CorruptEntryError, match="not a valid blob name"):
        r.download(entry.key, tmp_path / "dl")


def test_readers_never_see_a_writer_midway(tmp_path: Path, share: SharedDir,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    key = publish(share, tmp_path / "a", {"half": 1})
    # Writers killed midway leave temp files only (what a kill -9 of an upload leaves).
    tmp = share.a / "cc" / "v1" / "tmp"
    half_blob = tmp / "blob.-.00000000.999999.deadbeef"
    half_blob.write_bytes(FILES["kernel.so"][:100])
    half_rec = tmp / "record.-.00000000.999999.deadbeef"
    half_rec.write_bytes(b'{"body": "{\\"format\\": 1, \\"key')
    r = FileRemote(share.url("b", lease="60"), trust=Trust(accept_unsigned=True))
    assert [x.key for x in r.records()] == [key.digest]
    assert isinstance(tiered(tmp_path / "b", share.url("b")).get(key), Hit)
    # The sweep removes them once they are older than the lease (by the share's clock).
    assert r.sweep() == 0 and half_blob.exists()
    past = time.time() - 120
    for p in (half_blob, half_rec):
        os.utime(p, (past, past))
    assert r.sweep() == 0 and not half_blob.exists() and not half_rec.exists()
    assert isinstance(tiered(tmp_path / "c", share.url("b")).get(key), Hit)


def test_a_missing_root_is_one_warning_and_never_made(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    gone = tmp_path / "not-mounted" / "cc"
    st = tiered(tmp_path / "a", f"file://{gone}")
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            k = make_key({"i": i})
            assert isinstance(st.get(k), Miss)
            st.put(k, {"f": b"x"})
            assert isinstance(st.get(k), Hit)
        assert st.flush(5) is False  # drained; no upload reached the tier
    warned = store_warnings(caplog)
    assert len(warned) == 1 and "does not exist" in warned[0], warned
    assert not gone.parent.exists()


_RACER = """
import sys, time
from pathlib import Path
from cachecompile.store.remote import FileRemote
from cachecompile.store.signing import Trust
url, digest, mine, go = sys.argv[1:5]
r = FileRemote(url, trust=Trust(accept_unsigned=True))
judged = r.read_record(digest)[0]
Path(go + "." + mine).touch()  # judged: ready
while not Path(go).exists():
    time.sleep(0.001)
print("WON" if r.write_record(digest, mine.encode(), judged) else "LOST", flush=True)
"""


def test_a_record_is_replaced_by_exactly_one_of_racing_nodes(tmp_path: Path,
                                                             share: SharedDir) -> None:
    digest = make_key({"race": 1}).digest
    r = FileRemote(share.url("a"), trust=Trust(accept_unsigned=True))
    assert r.write_record(digest, b"first", None)
    assert not r.write_record(digest, b"second", None)  # create-only: it is there
    for rnd in range(3):
        go = tmp_path / f"go{rnd}"
        procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RACER),
                                   share.url("ab"[i % 2]), digest, f"writer-{rnd}-{i}", str(go)],
                                  stdout=subprocess.PIPE, text=True) for i in range(6)]
        # Every racer has judged the same record before any of them writes.
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob(f"go{rnd}.*"))) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
        assert outs.count("WON") == 1, outs
        got = r.read_record(digest)
        assert got is not None and got[0].decode() == f"writer-{rnd}-{outs.index('WON')}"
    assert list((share.a / "cc" / "v1" / "tmp").iterdir()) == []


_LEFT_FOR_EXIT = """
import atexit, logging, sys, threading
from cachecompile.store import make_key, open_store
from cachecompile.store.remote import FileRemote
logging.basicConfig(level=logging.WARNING)
url, root = sys.argv[1:3]
exiting = threading.Event()
real = FileRemote.upload
def upload(self, *args, **kwargs):
    exiting.wait(60)  # this upload runs in the interpreter's exit, from the flush
    return real(self, *args, **kwargs)
FileRemote.upload = upload
st = open_store(root, remote=url)
st.put(make_key({"left": "for exit"}), {"f": b"uploaded at exit"})
atexit.register(exiting.set)  # runs before the uploader's flush (atexit is last in, first out)
"""


def test_an_upload_left_for_the_exit_reaches_the_share(
        tmp_path: Path, share: SharedDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The uploader's exit flush runs after Python (3.12+) refuses new threads: a remote
    call then runs on a worker started earlier, or in the upload thread itself."""
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_LEFT_FOR_EXIT),
                          share.url("a"), str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    key = make_key({"left": "for exit"})
    hit = tiered(tmp_path / "b", share.url("b")).get(key)
    assert isinstance(hit, Hit), out.stderr
    assert hit.entry.files["f"].read_bytes() == b"uploaded at exit"


def test_a_remote_call_where_no_thread_can_start_still_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What Python 3.12 does at exit, on any Python: the call runs in the caller."""
    from cachecompile.store.remote import deadline

    def refuse(self: object) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(deadline, "_IDLE", [])
    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert deadline.call_with_deadline(lambda: 42, 5, "a call") == 42
    empty: dict[str, int] = {}
    with pytest.raises(KeyError):
        deadline.call_with_deadline(lambda: empty["x"], 5, "a call that raises")


def test_remote_calls_reuse_their_threads() -> None:
    from cachecompile.store.remote import deadline

    before = threading.active_count()
    for i in range(20):
        assert deadline.call_with_deadline(functools.partial(int, i), 5, "a call") == i
    assert threading.active_count() - before <= 1
    with pytest.raises(store.errors.RemoteError, match="no answer"):
        deadline.call_with_deadline(lambda: time.sleep(0.5), 0.05, "a stuck call")
    assert deadline.call_with_deadline(lambda: "next", 5, "the call after") == "next"


def test_the_sweep_keeps_pinned_and_referenced_blobs(tmp_path: Path, share: SharedDir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    keep = publish(share, tmp_path / "a", {"keep": 1}, {"k": b"kept bytes"})
    gone = publish(share, tmp_path / "a", {"gone": 1}, {"g": b"purged bytes"})
    r = FileRemote(share.url("b", lease="60"), trust=Trust(accept_unsigned=True))
    assert r.delete(gone.digest) and not r.delete(gone.digest)
    # The uploads ended, so they hold no pins: a purge of a full share frees their blobs
    # now, not a lease later (issue 62) ...
    pin_dir = share.a / "cc" / "v1" / "pin"
    assert [p for p in pin_dir.rglob("*") if p.is_file()] == []
    # ... but an upload in flight does: its fresh pin keeps a blob it may reuse.
    r._pin([hashlib.sha256(b"purged bytes").hexdigest()])
    assert r.sweep() == 0
    pins = list(pin_dir.rglob("*"))
    past = time.time() - 120
    for p in pins:
        if p.is_file():
            os.utime(p, (past, past))
    # A pin refreshed between the sweep's rename and its second look keeps the blob.
    real_rename = os.rename

    def rename_then_pin(src: object, dst: object) -> None:
        real_rename(src, dst)  # type: ignore[arg-type]
        if "/blob/" in str(src):
            r._pin([Path(str(src)).name])

    monkeypatch.setattr(os, "rename", rename_then_pin)
    assert r.sweep() == 0
    monkeypatch.setattr(os, "rename", real_rename)
    for p in (share.a / "cc" / "v1" / "pin").rglob("*"):
        if p.is_file():
            os.utime(p, (past, past))
    assert r.sweep() == 1
    assert isinstance(tiered(tmp_path / "b", share.url("b")).get(keep), Hit)
    assert isinstance(tiered(tmp_path / "c", share.url("b")).get(gone), Miss)


def test_an_upload_that_failed_leaves_no_pin(tmp_path: Path, share: SharedDir,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A full share: the upload fails after pinning; its pins go with it, so the
    operator's purge can free space at once."""
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")

    def full(self: FileRemote, *args: object, **kwargs: object) -> int:
        raise store.errors.RemoteError("No space left on device")

    monkeypatch.setattr(FileRemote, "put_blob", full)
    a = tiered(tmp_path / "a", share.url("a"))
    a.put(make_key({"full": 1}), {"f": b"bytes that do not fit"})
    assert a.flush(20) is False
    assert [p for p in (share.a / "cc" / "v1" / "pin").rglob("*") if p.is_file()] == []


def test_a_forked_child_uses_the_tier(tmp_path: Path, share: SharedDir,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    k1 = publish(share, tmp_path / "a", {"fork": 1})
    k2 = publish(share, tmp_path / "a", {"fork": 2})
    b = tiered(tmp_path / "b", share.url("b"))
    assert isinstance(b.get(k1), Hit)  # the parent's first calls: a lookup, an upload
    b.put(make_key({"from": "parent", "n": 0}), {"p": b"before the fork"})
    assert b.flush(20) and b.uploader is not None and b.uploader.uploaded == 1
    pid = os.fork()
    if pid == 0:  # the child: its first remote call must hit, and its upload must go up
        code = 1
        try:
            ok = isinstance(b.get(k2), Hit)
            b.put(make_key({"from": "child"}), {"c": b"child"})
            # The parent's uploader thread does not run here: the child starts its own.
            code = 0 if ok and b.flush(10) and b.uploader and b.uploader.uploaded == 2 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert isinstance(tiered(tmp_path / "c", share.url("a")).get(make_key({"from": "child"})),
                      Hit)
    b.put(make_key({"from": "parent"}), {"p": b"parent"})
    assert b.flush(20)


def test_cachectl_remote_verbs_on_a_share(tmp_path: Path, share: SharedDir) -> None:
    env = {**os.environ, "CACHECOMPILE_TRUST_REMOTE": "1", "CACHECOMPILE_REMOTE": share.url("a")}
    env.pop("CACHECOMPILE_SIGNING_KEY", None)
    local = store.open_store(tmp_path / "local", remote="")
    for i in range(3):
        local.put(make_key({"verb": i}), {"f": os.urandom(100)}, labels={"model": f"m{i}"})
    r = cachectl("push", "--cache-dir", str(tmp_path / "local"), env=env)
    assert r.returncode == 0 and "pushed 3 to" in r.stdout, r
    r = cachectl("remote", "ls", "--json", env=env)
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 3, r
    r = cachectl("remote", "stats", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["entries"] == 3, r
    r = cachectl("remote", "purge", "--model", "m0", "--yes", env=env)
    assert r.returncode == 0 and "removed 1 entry" in r.stdout, r
    r = cachectl("pull", "--cache-dir", str(tmp_path / "node"), env=env)
    assert r.returncode == 0 and "pulled 2 entries" in r.stdout, r
    r = cachectl("push", "--cache-dir", str(tmp_path / "local"),
                 env={**env, "CACHECOMPILE_REMOTE": share.url("b", mode="ro")})
    assert r.returncode == 5, r


def test_remote_ls_folds_a_signatures_variants_as_ls_does(tmp_path: Path, share: SharedDir,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`cachectl remote ls` listed every variant of a signature as a row of its own
    (issue 61) where `cachectl ls` folds them: now one row with its count."""
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    sig = {"model": "moe", "function": "forward", "signature_key": "ab" * 16}
    a = tiered(tmp_path / "a", share.url("a"))
    a.put(make_key({"sig": 1, "variant": 0}), {"f": b"x" * 10}, labels={**sig, "variant": "0"})
    for v in range(3):
        a.put(make_key({"sig": 1, "frame": v}), {"f": b"y" * v},
              labels={**sig, "dynamo_frame": "M.resume_at_7"})
    a.put(make_key({"other": 1}), {"f": b"z"}, labels={"model": "moe"})
    assert a.flush(20)
    env = {"CACHECOMPILE_REMOTE": share.url("b"), "CACHECOMPILE_SIGNING_KEY": KEY}
    r = cachectl("remote", "ls", env=env)
    rows = [ln for ln in r.stdout.splitlines() if "moe" in ln]
    assert r.returncode == 0 and len(rows) == 2, r.stdout
    assert any("4 (3 frame)" in ln for ln in rows), r.stdout
    assert "5 entries in 2 rows (--variants lists each)" in r.stdout, r.stdout
    r = cachectl("remote", "ls", "--variants", env=env)
    assert len([ln for ln in r.stdout.splitlines() if "moe" in ln]) == 5, r.stdout
