"""The tier's own logic (backfill, degrade, refusal, read-only nodes) over an in-memory
remote: no server, so each rule is checked in milliseconds; test_remote.py and
test_s3.py check the same flow against a real redis-server and a real S3 server."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from memory_remote import MemoryRemote, tamper

from cachecompile import store
from cachecompile.store import Hit, Miss, ReadOnlyStore, make_key
from cachecompile.store.remote import RedisRemote, Remote, S3Remote
from cachecompile.store.signing import Trust
from cachecompile.store.tiered import TieredStore, wrap

FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 4, "code/out.py": b"x = 1\n",
         "empty": b""}
TRUST = Trust(key=b"fleet-key")


def node(root: Path, remote: MemoryRemote) -> TieredStore[store.Store]:
    local = store.open_store(root, remote="")
    assert isinstance(local, store.Store)
    return wrap(local, remote)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("cachecompile.store") and r.levelno >= logging.WARNING]


def test_every_remote_implements_the_protocol() -> None:
    for r in (MemoryRemote(TRUST), RedisRemote("redis://127.0.0.1:1/0", trust=TRUST),
              S3Remote("s3://bucket/prefix", trust=TRUST)):
        assert isinstance(r, Remote)


def test_a_remote_hit_is_backfilled_locally_and_not_uploaded_back(tmp_path: Path) -> None:
    remote = MemoryRemote(TRUST)
    a = node(tmp_path / "a", remote)
    key = make_key({"model": "m"})
    a.put(key, FILES, labels={"model": "m"})
    assert a.flush(5) and list(remote.records_) == [key.digest]
    assert len(remote.blobs) == 3

    b = node(tmp_path / "b", remote)
    hit = b.get(key)
    assert isinstance(hit, Hit) and hit.entry.path.is_relative_to(tmp_path / "b")
    assert {n: p.read_bytes() for n, p in hit.entry.files.items()} == FILES
    calls = remote.calls
    assert isinstance(b.get(key), Hit) and remote.calls == calls  # local now
    assert b.flush(5) and b.uploader is not None and b.uploader.uploaded == 0
    assert b.stats()["hits_remote"] == 1


def test_flush_says_whether_every_upload_since_the_last_reached_the_remote(
        tmp_path: Path) -> None:
    """flush() was True after failed uploads (issue 62): a caller that must know its
    entries are shared (a build, an image's last step) could not tell. Now False when
    one failed or was dropped since the last flush, True again after a clean round."""
    remote = MemoryRemote(TRUST)
    a = node(tmp_path / "a", remote)
    remote.down = True
    a.put(make_key({"n": 1}), FILES)
    assert a.flush(5) is False and remote.records_ == {}
    remote.down = False
    a.remote.breaker.clock = lambda: 1e12  # the backoff has passed
    a.put(make_key({"n": 2}), FILES)
    assert a.flush(5) is True and len(remote.records_) == 1
    assert a.flush(5) is True  # nothing new since


def test_a_dead_remote_is_a_local_miss_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    remote = MemoryRemote(TRUST)
    a = node(tmp_path / "a", remote)
    a.put(make_key({"n": 1}), FILES)
    assert a.flush(5)
    b = node(tmp_path / "b", remote)
    remote.down = True
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            assert isinstance(b.get(make_key({"n": 1})), Miss)
    assert len(warnings_of(caplog)) == 1 and "continuing local-only" in warnings_of(caplog)[0]
    remote.down = False
    remote.breaker.retry_at = 0.0  # the backoff has passed
    assert isinstance(b.get(make_key({"n": 1})), Hit)


def test_a_damaged_remote_entry_is_refused_once_and_repaired_by_the_next_upload(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    remote = MemoryRemote(TRUST)
    key = make_key({"n": 2})
    a = node(tmp_path / "a", remote)
    a.put(key, FILES)
    assert a.flush(5)
    rec = remote.record(key.digest)
    assert rec is not None
    tamper(remote, rec.sha256["kernel.so"])
    b = node(tmp_path / "b", remote)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert isinstance(b.get(key), Miss)
    refused = [w for w in warnings_of(caplog) if "refused" in w]
    assert len(refused) == 1 and "SHA-256" in refused[0], warnings_of(caplog)
    # b compiles it itself and publishes: its upload replaces the damaged blob.
    b.put(key, FILES)
    assert b.flush(5) and b.uploader is not None and b.uploader.uploaded == 1
    assert isinstance(node(tmp_path / "c", remote).get(key), Hit)


def test_a_read_only_node_downloads_into_scratch_and_uploads_nothing(tmp_path: Path) -> None:
    remote = MemoryRemote(TRUST)
    key = make_key({"n": 3})
    a = node(tmp_path / "a", remote)
    a.put(key, FILES)
    assert a.flush(5)
    store.open_store(tmp_path / "ro")
    view = store.open_store(tmp_path / "ro", readonly=True, remote="")
    assert isinstance(view, ReadOnlyStore)
    ro = wrap(view, remote)
    assert type(ro) is TieredStore and ro.readonly and ro.uploader is None
    hit = ro.get(key)
    assert isinstance(hit, Hit) and not hit.entry.path.is_relative_to(tmp_path / "ro")
    with pytest.raises(store.errors.ReadOnlyStoreError):
        ro.put(make_key({"n": 4}), FILES)
    assert len(remote.records_) == 1


def test_a_read_only_remote_is_consumed_never_written(tmp_path: Path) -> None:
    shared = MemoryRemote(TRUST)
    a = node(tmp_path / "a", shared)
    a.put(make_key({"n": 5}), FILES)
    assert a.flush(5)  # the upload is in the background
    ro = MemoryRemote(TRUST, readonly=True)
    ro.records_, ro.blobs = shared.records_, shared.blobs
    b = node(tmp_path / "b", ro)
    assert b.uploader is None and isinstance(b.get(make_key({"n": 5})), Hit)
    b.put(make_key({"n": 6}), FILES)
    assert len(shared.records_) == 1
    with pytest.raises(store.errors.ReadOnlyStoreError):
        ro.delete(make_key({"n": 5}).digest)
