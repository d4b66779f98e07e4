"""Defects a fleet operator found (issue 21), each reproduced as it happened.

Every test here failed before its fix: a pin racing gc's sweep of empty pin dirs, a
malformed remote URL that printed the Redis password and broke the first cached call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecompile.store import Store, errors, make_key, open_store, pins
from cachecompile.store.remote import RemoteConfig

SECRET = "s3cret-pa55"


def _fds(under: Path) -> list[str]:
    """This process's open files under ``under``: only the store's own (a count of every
    fd failed once in the suite, when another test's background thread opened one)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # the listing's own fd, closed by now
            continue
        if target.startswith(str(under) + os.sep):
            found.append(target)
    return sorted(found)


def test_a_pin_survives_gc_removing_its_empty_pins_dir(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    st = open_store(tmp_path / "s")
    assert isinstance(st, Store)  # the disk store: its pins and layout
    entry = st.put(make_key({"k": 1}), {"a.bin": b"x"})
    real_rename = os.rename
    raced: list[str] = []

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # gc's pinned() removes a pins dir it finds empty: here, between pin()'s mkdir and
        # its rename (what a concurrent `cachectl gc` did).
        if not raced and "/pins/" in str(dst):
            raced.append(str(dst))
            os.rmdir(os.path.dirname(dst))
        real_rename(src, dst)

    monkeypatch.setattr(pins.os, "rename", rename)
    before = _fds(tmp_path)
    held = st.pin(entry)
    assert raced and held.held
    assert entry.key in st.pinned()
    held.release()
    assert _fds(tmp_path) == before
    assert list(st.layout.tmp.iterdir()) == []   # no tmp/pin.* left behind


def test_pinning_an_entry_gc_took_is_key_not_found_and_leaves_nothing(tmp_path: Path) -> None:
    st = open_store(tmp_path / "s")
    assert isinstance(st, Store)  # the disk store: its pins and layout
    entry = st.put(make_key({"k": 2}), {"a.bin": b"y"})
    assert st.delete(entry.key)
    before = _fds(tmp_path)
    with pytest.raises(errors.KeyNotFound):
        st.pin(entry)
    assert _fds(tmp_path) == before
    assert list(st.layout.tmp.iterdir()) == []


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}@localhost:notaport/0",
    f"redis://user:{SECRET}@localhost:6379/0?mode=sometimes",
    f"redis://:{SECRET}@localhost:6379/0?chunk=1T",
    f"redis://:{SECRET}@localhost:6379/0?timeout=soon",
    f"ftp://:{SECRET}@localhost:6379/0",
])
def test_a_malformed_remote_url_never_shows_the_password(url: str) -> None:
    with pytest.raises(errors.RemoteConfigError) as caught:
        RemoteConfig.parse(url)
    assert SECRET not in str(caught.value) and "***" in str(caught.value)
    assert isinstance(caught.value, ValueError)   # what wrap() always promised


def test_cachectl_with_a_malformed_remote_exits_2_without_the_password(tmp_path: Path) -> None:
    open_store(tmp_path / "s", remote="")
    env = dict(os.environ, CACHECOMPILE_DIR=str(tmp_path / "s"),
               CACHECOMPILE_REMOTE=f"redis://:{SECRET}@localhost:notaport/0")
    p = subprocess.run([sys.executable, "-m", "cachecompile.cli.main", "ls"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert SECRET not in p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "CACHECOMPILE_REMOTE" in p.stderr


@pytest.fixture
def readonly_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A store, and the same store through a read-only bind mount (as a fleet mounts a
    baked cache). Needs mount privileges: skipped where there are none."""
    src, mnt = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    for cmd in (["mount", "--bind", str(src), str(mnt)],
                ["mount", "-o", "remount,ro,bind", str(mnt)]):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            subprocess.run(["umount", str(mnt)], capture_output=True)
            pytest.skip(f"cannot make a read-only bind mount here: {p.stderr.strip()}")
    try:
        yield src, mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_broken_remote_setting_is_one_warning_and_the_local_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """An unreadable signing-key file (or a malformed $CACHECOMPILE_REMOTE) raised
    RemoteConfigError out of open_store() (issue 62): the local entries must still serve,
    as they do when the remote is down. A remote passed as an argument still raises."""
    for var in ("CACHECOMPILE_REMOTE_PASSWORD", "CACHECOMPILE_VERIFY_KEYS"):
        monkeypatch.delenv(var, raising=False)
    key = make_key({"local": 1})
    open_store(tmp_path / "st", remote="").put(key, {"f": b"local bytes"})
    monkeypatch.setenv("CACHECOMPILE_REMOTE", f"file://{tmp_path / 'share'}")
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", f"file:{tmp_path / 'no-such-key'}")
    for broken in ({}, {"CACHECOMPILE_SIGNING_KEY": "", "CACHECOMPILE_REMOTE": "ftp://x/y"}):
        for k, v in broken.items():
            monkeypatch.setenv(k, v)
        caplog.clear()
        st = open_store(tmp_path / "st")
        assert isinstance(st, Store) and st.get(key).found
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and "using the local store" in warned[0], warned
    with pytest.raises(errors.RemoteConfigError):
        open_store(tmp_path / "st", remote="ftp://x/y")


def test_verify_and_stats_on_a_read_only_file_system(readonly_mount: tuple[Path, Path]) -> None:
    src, mnt = readonly_mount
    st = open_store(src)
    key = make_key({"k": 3})
    st.put(key, {"a.bin": b"z"}, labels={"model": "m", "function": "f"})
    st.get(key)
    st.record_miss("absent")
    env = dict(os.environ, CACHECOMPILE_DIR=str(mnt))
    env.pop("CACHECOMPILE_REMOTE", None)
    cli = [sys.executable, "-m", "cachecompile.cli.main"]
    verify = subprocess.run([*cli, "verify"], env=env, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "not in the index" not in verify.stdout and "checked 1 entry: ok" in verify.stdout
    stats = subprocess.run([*cli, "stats", "--json"], env=env, capture_output=True, text=True)
    s = json.loads(stats.stdout)
    assert (s["entries"], s["hits"], s["misses"]) == (1, 1, {"absent": 1}), s
    ls = subprocess.run([*cli, "ls", "--json"], env=env, capture_output=True, text=True)
    assert [r["key"] for r in json.loads(ls.stdout)] == [key.digest]


def test_a_killed_read_only_nodes_scratch_store_is_swept(tmp_path: Path) -> None:
    # A read-only node with a remote downloads hits into a private scratch store removed
    # at exit; one SIGKILLed kept it (41 MB per process) and nothing ever removed it.
    code = ("import sys, time\n"
            "from cachecompile.store.tiered import scratch_store\n"
            "st = scratch_store(1 << 30)()\n"
            "(st.root / 'kernel.so').write_bytes(b'k' * 4096)\n"
            "print(st.root, flush=True)\n"
            "time.sleep(60)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    left = Path(child.stdout.readline().strip())
    child.kill()
    child.wait()
    assert left.is_dir()               # no exit hook ran
    nxt = subprocess.run([sys.executable, "-c", code.replace("time.sleep(60)", "")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert nxt.returncode == 0, nxt.stderr
    assert not left.exists(), "the dead process's scratch store is still there"
    assert not Path(nxt.stdout.strip()).exists()   # and the live one's went at its exit
    assert oct(left.parent.stat().st_mode & 0o777) == "0o700"


def test_a_scratch_parent_made_by_someone_else_is_refused(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from cachecompile.store import tiered

    monkeypatch.setattr(tiered.tempfile, "tempdir", str(tmp_path))
    parent = tmp_path / f"cachecompile-{os.getuid()}-remote"
    parent.mkdir(mode=0o777)
    parent.chmod(0o777)   # open to others: an attacker's dir, or a link to one
    with pytest.raises(errors.InsecureStoreError, match="remove it"):
        tiered.scratch_store(1 << 20)()
