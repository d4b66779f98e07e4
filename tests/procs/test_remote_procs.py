"""A fleet in miniature: nodes are fresh processes with their own CACHECOMPILE_DIR that
share one redis-server. Node A compiles and publishes; node B loads with zero compiles.
A server killed mid-transfer or absent costs a warning and a compile, never a result.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ccutil import Sandbox
from redis_util import RedisServer, free_port
from tier_util import remote_tier

from cachecompile.store import Hit, make_key, open_store
from cachecompile.store.remote import RedisRemote
from cachecompile.store.signing import Trust
from cachecompile.store.tiered import TieredStore

pytestmark = pytest.mark.slow

FLEET_KEY = "fleet-secret"

CODE = """
import os, sys, torch, warnings
from cachecompile import cache_compile
from cachecompile.demo import models
from cachecompile.store.remote import RedisRemote

KILL = os.environ.get("TEST_KILL_REDIS")   # "<pid>:<command>:<n>": SIGKILL redis on the nth
if KILL:
    pid, what, n = KILL.split(":")
    real, seen = RedisRemote._cmd, []
    def _cmd(self, w, *args):
        if w == what:
            seen.append(w)
            if len(seen) == int(n):
                os.kill(int(pid), 9)
                import time; time.sleep(0.2)   # let it die before our next command
        return real(self, w, *args)
    RedisRemote._cmd = _cmd

m = models.MLP().eval()
cached = cache_compile(m.forward_impl{backend})
x = models.make_mlp_input()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = cached(x)
dynamo = "torch._dynamo" in sys.modules
report({{"event": cached.events[-1][0], "dynamo": dynamo,
        "ok": bool(torch.allclose(out, m.forward_impl(x), rtol=1e-4, atol=1e-5)),
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]}})
"""
AOT = CODE.format(backend=', backend="aot_eager"')
INDUCTOR = CODE.format(backend="")


def manifests(root: Path) -> list[Path]:
    return list(root.rglob("manifest.json"))


def remote_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "remote" in ln.lower()]


@contextlib.contextmanager
def remote_server(tmp_path: Path, tier: str) -> Iterator[dict[str, str]]:
    """A real server of the tier on loopback; the environment a node uses to reach it."""
    with remote_tier(tmp_path, tier) as (srv, env):
        if tier == "file":
            # Node A writes through one mount point; the others read through the other.
            env["NODE_B_REMOTE"] = srv.url("b")
        yield {**env, "CACHECOMPILE_SIGNING_KEY": FLEET_KEY}


def node_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a node other than A: on a share, through the other mount point."""
    out = {k: v for k, v in env.items() if k != "NODE_B_REMOTE"}
    if "NODE_B_REMOTE" in env:
        out["CACHECOMPILE_REMOTE"] = env["NODE_B_REMOTE"]
    return out


@pytest.mark.parametrize("tier", ["redis", "s3", "file", "http", "oci"])
def test_node_b_loads_node_a_entry_with_zero_compiles(tmp_path: Path, tier: str) -> None:
    with remote_server(tmp_path, tier) as both:
        env = node_env({**both, "NODE_B_REMOTE": both["CACHECOMPILE_REMOTE"]})
        box = Sandbox(tmp_path / "box", fresh_inductor=True)  # g++ calls are counted
        a = box.run(INDUCTOR, CACHECOMPILE_DIR=str(tmp_path / "a"), environ=env)
        assert (a["event"], a["ok"], a["warnings"]) == ("miss", True, []), a.value
        assert box.compiler_calls() > 0
        # The shared graph (the compiled program) names its model: purge --model finds it.
        graphs = [i for i in open_store(tmp_path / "a", remote="").entries()
                  if i.labels.get("kind") == "graph"]
        assert graphs and all(g.labels.get("model") == "MLP" for g in graphs), graphs
        box.reset_compiler_log()
        # Node B: its own empty store, empty Inductor dirs; the entry comes from the tier.
        b = box.run(INDUCTOR, CACHECOMPILE_DIR=str(tmp_path / "b"), environ=node_env(both))
        assert (b["event"], b["ok"], b["warnings"]) == ("hit", True, []), b.value
        assert box.compiler_calls() == 0, box.gxx_log.read_text()
        assert b["dynamo"] is False, "a remote hit must not import torch._dynamo"
        assert remote_lines(b.stderr) == [], b.stderr
        assert manifests(tmp_path / "b")  # backfilled locally


def test_killed_server_mid_download_and_mid_upload(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        box = Sandbox(tmp_path / "box")
        env = {"CACHECOMPILE_REMOTE": srv.url(chunk="512"), "CACHECOMPILE_TRUST_REMOTE": "1"}
        a = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "a"), environ=env)
        assert (a["event"], a["ok"]) == ("miss", True)
        n = len(manifests(tmp_path / "a"))  # the method's entry (and any it shares)
        client = srv.client()
        assert len(client.keys("cachecompile:v1:entry:*")) == n  # type: ignore[attr-defined]

        assert srv.proc is not None
        b = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "b"),
                    TEST_KILL_REDIS=f"{srv.proc.pid}:get chunk:2", environ=env)
        # The download died midway: B compiled for itself, right result, one warning.
        assert (b["event"], b["ok"]) == ("miss", True), b.value
        assert len(remote_lines(b.stderr)) == 1, b.stderr
        # Only complete entries (its own compile's), no download leftovers.
        assert len(manifests(tmp_path / "b")) == n
        assert open_store(tmp_path / "b", remote="").maintenance().verify().ok
        assert list((tmp_path / "b" / "v1" / "tmp").iterdir()) == []

        srv.start()  # the append-only file brings A's entry back
        srv.client().flushall()  # type: ignore[attr-defined]
        assert srv.proc is not None
        c = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "c"),
                    TEST_KILL_REDIS=f"{srv.proc.pid}:set chunk:2", environ=env)
        assert (c["event"], c["ok"], c.rc) == ("miss", True, 0), c.value
        assert len(remote_lines(c.stderr)) == 1, c.stderr
        srv.start()
        client = srv.client()
        assert client.keys("cachecompile:v1:chunk:*"), "the upload should have begun"  # type: ignore[attr-defined]
        # Every record that is visible is whole: each downloads and verifies; the entry
        # whose upload was cut is not visible at all.
        remote = RedisRemote(srv.url(), trust=Trust(accept_unsigned=True))
        records = list(remote.records())
        assert len(records) < n, "the cut upload's entry is visible"
        for i, rec in enumerate(records):
            assert remote.download(rec.key, tmp_path / f"check{i}") is not None
    finally:
        srv.stop()


def test_unreachable_remote_at_start_is_one_warning(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "box")
    res = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "a"),
                  CACHECOMPILE_REMOTE=f"redis://127.0.0.1:{free_port()}/0")
    assert (res["event"], res["ok"], res["warnings"]) == ("miss", True, []), res.value
    lines = remote_lines(res.stderr)
    assert len(lines) == 1 and "Connection refused" in lines[0], res.stderr
    assert manifests(tmp_path / "a")  # local-only, but fully working


def _all_verify(srv: RedisServer, key: str) -> bool:
    remote = RedisRemote(srv.url(), trust=Trust(key=key.encode()))
    recs = list(remote.records())
    return bool(recs) and all(remote.trust.verifies(r.body, r.sig) for r in recs)


def test_nodes_without_the_fleet_key_cannot_spoil_signed_entries(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis").start()
    try:
        box = Sandbox(tmp_path / "box")
        # A loaded machine must not cut an exiting node's upload short (default 5 s).
        env = {"CACHECOMPILE_REMOTE": srv.url(), "CACHECOMPILE_REMOTE_FLUSH_TIMEOUT": "60"}
        a = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "a"), environ=env,
                    CACHECOMPILE_SIGNING_KEY=FLEET_KEY)
        assert (a["event"], a["ok"]) == ("miss", True), a.value
        assert _all_verify(srv, FLEET_KEY)
        # A node with no key and one with the wrong key refuse the entries, compile,
        # publish locally and try to upload: the signed records must stay.
        for name, extra in (("u", {}), ("w", {"CACHECOMPILE_SIGNING_KEY": "wrong-key"})):
            r = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / name), environ={**env, **extra})
            assert (r["event"], r["ok"], r.rc) == ("miss", True, 0), r.value
            assert _all_verify(srv, FLEET_KEY), name
        b = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "b"), environ=env,
                    CACHECOMPILE_SIGNING_KEY=FLEET_KEY)
        assert (b["event"], b["ok"]) == ("hit", True), b.value
        assert remote_lines(b.stderr) == [], b.stderr
    finally:
        srv.stop()


def test_unsigned_entry_is_refused_once_and_replaced_by_a_keyed_node(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis").start()
    try:
        box = Sandbox(tmp_path / "box")
        env = {"CACHECOMPILE_REMOTE": srv.url(), "CACHECOMPILE_REMOTE_FLUSH_TIMEOUT": "60"}
        p = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "p"), environ=env,
                    CACHECOMPILE_TRUST_REMOTE="1")
        assert (p["event"], p["ok"]) == ("miss", True), p.value
        assert not _all_verify(srv, FLEET_KEY)
        k = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "k"), environ=env,
                    CACHECOMPILE_SIGNING_KEY=FLEET_KEY)
        assert (k["event"], k["ok"]) == ("miss", True), k.value
        refused = [ln for ln in remote_lines(k.stderr) if "not signed" in ln]
        # One line per refused entry, however often the process looked it up.
        n = len(manifests(tmp_path / "p"))
        assert len(refused) == len(set(refused)) == n, k.stderr
        assert _all_verify(srv, FLEET_KEY)  # the keyed node's upload signed them
        k2 = box.run(AOT, CACHECOMPILE_DIR=str(tmp_path / "k2"), environ=env,
                     CACHECOMPILE_SIGNING_KEY=FLEET_KEY)
        assert (k2["event"], k2["ok"]) == ("hit", True), k2.value
        assert remote_lines(k2.stderr) == [], k2.stderr
    finally:
        srv.stop()



def _entry_bytes(root: Path) -> dict[str, dict[str, bytes]]:
    """Every entry of a node's store: digest -> file name -> bytes."""
    st = open_store(root, remote="")
    out: dict[str, dict[str, bytes]] = {}
    for info in st.entries():
        hit = st.peek(info.key)
        assert isinstance(hit, Hit), (info.key, hit)
        out[info.key] = {n: p.read_bytes() for n, p in hit.entry.files.items()}
    return out


@pytest.mark.parametrize("tier", ["file", "http"])
def test_two_nodes_serve_byte_exact_under_a_concurrent_gc_and_purge(tmp_path: Path,
                                                                    tier: str) -> None:
    """Done-when of issue 50: node A compiles; nodes B and C, sharing the tier with it,
    load at the same time with zero g++ while `cachectl gc` runs on their stores and
    `cachectl remote purge` sweeps other entries off the tier; their entries are A's,
    byte for byte."""
    with remote_server(tmp_path, tier) as both:
        box = Sandbox(tmp_path / "box", fresh_inductor=True)
        a = box.run(INDUCTOR, CACHECOMPILE_DIR=str(tmp_path / "a"), environ=node_env(
            {k: v for k, v in both.items() if k != "NODE_B_REMOTE"}))
        assert (a["event"], a["ok"], a["warnings"]) == ("miss", True, []), a.value
        env = node_env(both)
        # Other entries on the tier, unreferenced blobs included: what the purge removes.
        junk = open_store(tmp_path / "junk", remote=env["CACHECOMPILE_REMOTE"])
        for i in range(12):
            junk.put(make_key({"junk": i}), {"blob.bin": os.urandom(20_000)},
                     labels={"model": "Junk"})
        assert isinstance(junk, TieredStore) and junk.flush(60)
        junk.close()
        stop = tmp_path / "stop"
        cli = [sys.executable, "-m", "cachecompile.cli.main"]
        loop = (f"while [ ! -e {stop} ]; do "
                f"{shlex.join(cli)} gc --cache-dir {tmp_path / 'b'} >/dev/null 2>&1; "
                f"{shlex.join(cli)} gc --cache-dir {tmp_path / 'c'} >/dev/null 2>&1; "
                f"{shlex.join(cli)} remote purge --model Junk --yes "
                f"--remote {shlex.quote(env['CACHECOMPILE_REMOTE'] + '?lease=1')} "
                f">>{tmp_path / 'purge.log'} 2>&1; done")
        chaos = subprocess.Popen(["bash", "-c", loop], env={**os.environ, **env})
        try:
            boxes = {n: Sandbox(tmp_path / f"box-{n}", fresh_inductor=True) for n in "bc"}
            results: dict[str, Any] = {}

            def node(n: str) -> None:
                results[n] = boxes[n].run(INDUCTOR, CACHECOMPILE_DIR=str(tmp_path / n), environ=env)

            threads = [threading.Thread(target=node, args=(n,)) for n in "bc"]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
        finally:
            stop.touch()
            chaos.wait(120)
        for n in "bc":
            r = results[n]
            assert (r["event"], r["ok"], r["warnings"]) == ("hit", True, []), (n, r.value)
            assert boxes[n].compiler_calls() == 0, (n, boxes[n].gxx_log.read_text())
            assert remote_lines(r.stderr) == [], (n, r.stderr)
        purged = (tmp_path / "purge.log").read_text()
        assert "removed 12 entries" in purged and "Error" not in purged, purged
        # What each serving node holds is A's, byte for byte: the method's entry (a warm
        # node never needs the shared graph's, which A's compile published beside it).
        mine = _entry_bytes(tmp_path / "a")
        for n in "bc":
            theirs = _entry_bytes(tmp_path / n)
            assert theirs and all(mine.get(d) == files for d, files in theirs.items()), n
