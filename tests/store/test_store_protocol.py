"""The storage protocols are what the stores implement and what the features wrap:
a disk store, its read-only view and a remote tier over either are all a Storage (and a
LocalStorage, what cachecompile types against), and a wrapper holds its inner store."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cachecompile.store import (
    Catalog,
    DiskStorage,
    Hit,
    LocalStorage,
    Locking,
    Maintenance,
    Miss,
    OpenStore,
    ReadOnlyStore,
    Storage,
    Store,
    errors,
    make_key,
    open_store,
)
from cachecompile.store.remote import RedisRemote
from cachecompile.store.tiered import TieredStore


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def down() -> str:
    """A remote nobody listens on: lookups stay local, uploads are dropped."""
    return f"redis://127.0.0.1:{_closed_port()}/0?backoff=60"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_READONLY", "CACHECOMPILE_DIR"):
        monkeypatch.delenv(var, raising=False)


def test_every_store_implements_the_protocols(tmp_path: Path, down: str) -> None:
    plain = open_store(tmp_path / "a", remote="")
    ro = open_store(tmp_path / "a", readonly=True, remote="")
    tiered = open_store(tmp_path / "b", remote=down)
    ro_tiered = open_store(tmp_path / "b", readonly=True, remote=down)
    assert (type(plain), type(ro), type(tiered), type(ro_tiered)) == (
        Store, ReadOnlyStore, TieredStore, TieredStore)
    assert isinstance(ro_tiered, TieredStore) and isinstance(ro_tiered.local, ReadOnlyStore)  # a tier over the read-only view
    for st in (plain, ro, tiered, ro_tiered):
        for proto in (Storage, Catalog, Locking, LocalStorage, DiskStorage, OpenStore):
            assert isinstance(st, proto), (st, proto)
        # Maintenance is the local store's, one protocol for all four.
        assert isinstance(st.maintenance(), Maintenance), st
        assert st.maintenance().maintenance() is st.maintenance()
    assert isinstance(tiered, TieredStore)
    assert tiered.maintenance() is tiered.local and ro_tiered.maintenance() is ro_tiered.local
    assert not isinstance(tiered, Maintenance)  # a tier has no gc of its own
    # Writable is a capability, not a class to test for: the protocol's default on a
    # Store, the refusal (saying why) on the read-only view, before any work.
    plain.maintenance().require_writable("purge entries")
    tiered.maintenance().require_writable("purge entries")
    for st in (ro, ro_tiered):
        with pytest.raises(errors.ReadOnlyStoreError,
                           match=r"cannot purge entries: .* is read-only \(opened with readonly"):
            st.maintenance().require_writable("purge entries")


def test_a_tier_wraps_its_local_store_and_uploads_only_its_own_puts(
        tmp_path: Path, down: str) -> None:
    local = open_store(tmp_path / "a", remote="")
    assert isinstance(local, Store)
    tier = TieredStore(local, RedisRemote(down))
    assert tier.local is local and tier.inner is local and tier.root == local.root
    key = make_key({"wrapped": 1})
    entry = tier.put(key, {"f": b"x"})
    assert tier.uploader is not None and tier.uploader.pending() <= 1  # queued, not waited on
    assert isinstance(local.get(key), Hit)  # the tier published through the local store
    local.put(make_key({"beside": 1}), {"f": b"y"})  # a local put: nothing to upload
    assert {i.key for i in tier.entries()} == {entry.key, make_key({"beside": 1}).digest}
    # The local store's own operations are reached through maintenance(), never by name.
    assert tier.maintenance().gc().evicted == [] and tier.maintenance().verify().ok
    assert not hasattr(tier, "gc") and not hasattr(tier, "verify")
    tier.close()


def test_a_tier_over_a_read_only_store_never_writes_it(
        tmp_path: Path, down: str) -> None:
    open_store(tmp_path / "ro", remote="")
    ro = open_store(tmp_path / "ro", readonly=True, remote="")
    assert isinstance(ro, ReadOnlyStore)
    tier = TieredStore(ro, RedisRemote(down))
    assert tier.readonly and tier.uploader is None  # nothing leaves a read-only node
    key = make_key({"absent": 1})
    assert isinstance(tier.get(key), Miss)
    with pytest.raises(errors.ReadOnlyStoreError):
        tier.put(key, {"f": b"x"})
    with tier.lock("anything") as held:  # a read-only store has nothing to lock
        assert held is None
