"""Defects a fleet operator found (issue 21), each reproduced as it happened.

Every test here failed before its fix: a pin racing gc's sweep of empty pin dirs, a
malformed remote URL that printed the Redis password and broke the first cached call.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachecompile.store import errors, make_key, open_store, pins
from cachecompile.store.remote import RemoteConfig

SECRET = "s3cret-pa55"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_pin_survives_gc_removing_its_empty_pins_dir(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    st = open_store(tmp_path / "s")
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
    before = _fds()
    held = st.pin(entry)
    assert raced and held.held
    assert entry.key in st.pinned()
    held.release()
    assert _fds() == before
    assert list(st.layout.tmp.iterdir()) == []   # no tmp/pin.* left behind


def test_pinning_an_entry_gc_took_is_key_not_found_and_leaves_nothing(tmp_path: Path) -> None:
    st = open_store(tmp_path / "s")
    entry = st.put(make_key({"k": 2}), {"a.bin": b"y"})
    assert st.delete(entry.key)
    before = _fds()
    with pytest.raises(errors.KeyNotFound):
        st.pin(entry)
    assert _fds() == before
    assert list(st.layout.tmp.iterdir()) == []


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}@localhost:notaport/0",
    f"redis://user:{SECRET}@localhost:6379/0?mode=sometimes",
    f"redis://:{SECRET}@localhost:6379/0?chunk=1T",
    f"redis://:{SECRET}@localhost:6379/0?timeout=soon",
    f"http://:{SECRET}@localhost:6379/0",
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
