"""Remote levels chained (``CACHECOMPILE_REMOTE="file:///...,redis://..."``), as sccache's
multilevel cache: the levels asked in turn, a hit backfilled into the nearer writable
levels, ``mode=ro`` levels only read, each level failing on its own, hits per level.

Real servers: a shared directory and a redis-server (and nginx where it is installed).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from ccutil import cachectl
from redis_util import RedisServer, free_port
from tier_util import clean_remote_env, store_warnings, tiered

from cachecompile import store
from cachecompile.store import Hit, Miss, make_key
from cachecompile.store.remote import FileRemote, RedisRemote
from cachecompile.store.signing import Trust

FILES = {"kernel.so": os.urandom(5000), "code/out.py": b"x = 1\n"}
TRUST = Trust(accept_unsigned=True)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_remote_env(monkeypatch)
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def share(tmp_path: Path, name: str) -> str:
    root = tmp_path / name
    root.mkdir(mode=0o700)
    return f"file://{root}"




def test_a_lower_hit_is_backfilled_into_the_nearer_levels(tmp_path: Path,
                                                          srv: RedisServer) -> None:
    rack_a, rack_b = share(tmp_path, "rack-a"), share(tmp_path, "rack-b")
    a = tiered(tmp_path / "a", f"{rack_a},{srv.url()}")
    assert [type(v.remote) for v in a.levels] == [FileRemote, RedisRemote]
    key = make_key({"chain": 1})
    a.put(key, FILES)
    assert a.flush(20)
    assert all(v.remote.contains(key.digest) for v in a.levels)  # written through
    # Node B, in another rack: its nearest level is empty; the fleet's Redis has it.
    b = tiered(tmp_path / "b", f"{rack_b}, {srv.url()}")
    hit = b.get(key)
    assert isinstance(hit, Hit) and {n: p.read_bytes() for n, p in hit.entry.files.items()} == FILES
    assert [v.hits for v in b.levels] == [0, 1]
    assert b.flush(20)
    assert FileRemote(rack_b, TRUST).contains(key.digest)  # backfilled into rack B
    s = b.stats()
    assert s["hits_remote"] == 1 and [lv["hits"] for lv in s["levels"]] == [0, 1]
    # Node C in rack B, with Redis gone: the nearer level serves it.
    srv.stop()
    c = tiered(tmp_path / "c", f"{rack_b},{srv.url()}")
    assert isinstance(c.get(key), Hit) and [v.hits for v in c.levels] == [1, 0]
    assert c.levels[1].remote.breaker.failures == 0  # a hit above: never asked


def test_read_only_levels_and_the_write_error_policy(tmp_path: Path, srv: RedisServer,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    mirror = share(tmp_path, "mirror")
    key = make_key({"ro": 1})
    writer = tiered(tmp_path / "w", srv.url())
    writer.put(key, FILES)
    assert writer.flush(20)
    # A read-only level is looked in, never written: not on a publish, not by a backfill.
    b = tiered(tmp_path / "b", f"{mirror}?mode=ro,{srv.url()}")
    assert b.levels[0].uploader is None and b.levels[1].uploader is not None
    assert isinstance(b.get(key), Hit)
    b.put(make_key({"ro": 2}), FILES)
    assert b.flush(20)
    assert not (tmp_path / "mirror" / "v1").exists()
    assert RedisRemote(srv.url(), TRUST).contains(make_key({"ro": 2}).digest)
    # A level that fails (its root is not mounted) warns once and is skipped; the
    # others and the local publish go on (each level has its own queue and breaker).
    dead = f"file://{tmp_path / 'not-mounted'}"
    c = tiered(tmp_path / "c", f"{dead},{srv.url()},redis://127.0.0.1:{free_port()}/0")
    with caplog.at_level(logging.WARNING):
        assert isinstance(c.get(key), Hit)
        for i in range(3):
            c.put(make_key({"policy": i}), FILES)
        assert c.flush(20) is False  # drained; two levels took nothing
    warned = store_warnings(caplog)
    assert len(warned) == 2, warned  # one per failing level, however many calls
    assert any("does not exist" in w for w in warned) and any("refused" in w for w in warned)
    assert [v.uploader.uploaded for v in c.levels if v.uploader] == [0, 3, 0]


def test_cachectl_with_a_chain(tmp_path: Path, srv: RedisServer) -> None:
    near = share(tmp_path, "near")
    chain = f"{near},{srv.url()}"
    env = {**os.environ, "CACHECOMPILE_REMOTE": chain}
    local = store.open_store(tmp_path / "local", remote="")
    for i in range(2):
        local.put(make_key({"cli": i}), FILES)
    r = cachectl("push", "--cache-dir", str(tmp_path / "local"), env=env)
    assert r.returncode == 0 and r.stdout.count("pushed 2 to") == 2, r
    r = cachectl("remote", "stats", "--json", env=env)
    assert r.returncode == 0 and [s["entries"] for s in json.loads(r.stdout)] == [2, 2], r
    r = cachectl("remote", "ls", env=env)
    assert r.returncode == 2 and "chain of levels" in r.stderr, r
    r = cachectl("remote", "ls", "--remote", near, env=env)
    assert r.returncode == 0, r
    # A node whose nearest level lacks one: the lookup hits below, cachectl stats says where.
    FileRemote(near, TRUST).delete(make_key({"cli": 0}).digest)
    node = tmp_path / "node"
    st = tiered(node, chain)
    assert isinstance(st.get(make_key({"cli": 0})), Hit)
    assert isinstance(st.get(make_key({"cli": 1})), Hit)
    assert isinstance(st.get(make_key({"cli": 9})), Miss)
    assert st.flush(20)
    r = cachectl("stats", "--cache-dir", str(node), env=env)
    assert r.returncode == 0, r
    lines = [ln.split() for ln in r.stdout.splitlines()]

    def shown(url: str) -> bool:
        # A level's row, its URL whole or cut with an ellipsis where the table is wider than
        # cachectl's 200 columns (a long TMPDIR: CI's tiers run in one of their own).
        return any(len(ln) == 2 and ln[1] == "1" and (
            ln[0] == url or (ln[0].endswith("…") and url.startswith(ln[0][:-1])))
            for ln in lines)

    assert ["remote", "2"] in lines and shown(near) and shown(srv.url()), r
