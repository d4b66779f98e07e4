"""One upload loop (store/remote/push.py) behind ``cachectl push`` and ``cachectl build``'s
closing upload: an entry the remote did not take is refused, with its reason, never
counted as there already."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from memory_remote import MemoryRemote
from redis_util import RedisServer

from cachecompile.procs.builders import BUILT, BuildResult, push_results
from cachecompile.store import Entry, Maintenance, make_key, open_store
from cachecompile.store.remote import RedisRemote
from cachecompile.store.remote.push import FOREIGN_KEPT, push_entries
from cachecompile.store.signing import Trust

FLEET_KEY = b"fleet-secret-key-for-push-tests-1"
NO_CAS = "the server does not honour conditional puts"


class NoCompareAndSet(MemoryRemote):
    """A server that cannot replace a record safely (as s3rver: no conditional puts)."""

    def replace_refused(self) -> str:
        return NO_CAS


def _share(a: MemoryRemote, b: MemoryRemote) -> MemoryRemote:
    b.records_, b.blobs = a.records_, a.blobs  # two nodes, one server
    return b


def _local(root: Path, n: int) -> tuple[Maintenance, list[Entry]]:
    st = open_store(root, remote="").maintenance()
    return st, [st.put(make_key({"push": i}), {"f": bytes([i]) * 100}) for i in range(n)]


def test_push_counts_sent_there_kept_refused_and_failed_apart(tmp_path: Path) -> None:
    st, e = _local(tmp_path / "a", 4)
    signer = MemoryRemote(Trust(key=FLEET_KEY))
    assert signer.upload(e[0])                                   # signed with the fleet's key
    unkeyed = _share(signer, NoCompareAndSet(Trust()))
    assert unkeyed.upload(e[1])                                  # unsigned
    notes: list[tuple[str, str]] = []
    got = push_entries(unkeyed, st, [x.key for x in e[:3]] + ["0" * 32],
                       keep_going=True, on_note=lambda d, t: notes.append((d, t)))
    # e0: a signed record this node cannot vouch against (kept); e1: there; e2: sent;
    # the fourth is not in the local store.
    assert (got.sent, got.there, got.kept, got.refused) == (
        1, 1, [f"{e[0].key[:12]}: {FOREIGN_KEPT}"], [])
    assert len(got.failed) == 1 and "not in the local store" in got.failed[0]
    assert (e[0].key, f"kept: {FOREIGN_KEPT}") in notes

    # A node with the key would repair e1's unsigned record, but this server cannot
    # replace one safely: refused, with the server's reason; not "there already".
    keyed = _share(signer, NoCompareAndSet(Trust(key=FLEET_KEY)))
    got = push_entries(keyed, st, [e[1].key, e[3].key])
    assert (got.sent, got.there, got.kept) == (1, 0, [])
    assert got.refused == [f"{e[1].key[:12]}: {NO_CAS}"] and got.not_taken == got.refused


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def test_a_build_reports_the_entries_the_remote_refused(
        tmp_path: Path, srv: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CACHECOMPILE_SIGNING_KEY", "CACHECOMPILE_VERIFY_KEYS",
                "CACHECOMPILE_TRUST_REMOTE", "CACHECOMPILE_READONLY"):
        monkeypatch.delenv(var, raising=False)
    st, e = _local(tmp_path / "build", 3)
    # The fleet published e0 signed; this builder has no key, so it may not replace it.
    assert RedisRemote(srv.url(), Trust(key=FLEET_KEY)).upload(e[0])
    RedisRemote(srv.url(), Trust()).upload(e[1])
    monkeypatch.setenv("CACHECOMPILE_REMOTE", srv.url())
    results = [BuildResult("m.f", "[2]", BUILT, 0.1, entries=(e[0].key, e[1].key)),
               BuildResult("m.f", "[4]", BUILT, 0.1, entries=(e[2].key,))]
    pushed = push_results(results, cache_dir=str(tmp_path / "build"))
    assert pushed is not None
    # Before: 2 "there already" (the refused record counted as there).
    assert (pushed.sent, pushed.there, len(pushed.not_taken), pushed.failed) == (1, 1, 1, [])
    assert pushed.not_taken[0].startswith(e[0].key[:12])
