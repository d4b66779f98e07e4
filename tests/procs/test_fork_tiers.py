"""Every remote tier survives a fork (issue 50): a process that used the tier, then
forks, keeps working, and so does each child. On each tier (redis-server, moto, s3rver, a
shared directory, nginx's WebDAV) and on a chain of two levels (nginx in front of moto:
every level's client and upload queue must be the child's own).

A serving process P (its own empty store, read-only, so that every process's remote hits
land in a scratch store of its own and each child's lookup goes to the remote) loads an
Inductor entry from the remote: its client is started. Then, round after round, it forks
the three ways servers do: a ``multiprocessing`` Process with the ``fork`` start method, a
forked worker Pool (a new worker per task), and a pre-forking server's workers
(``os.fork()``, each serving and leaving through ``sys.exit`` as gunicorn's do, so every
exit hook runs). Each child makes a new cached method (a signature its parent never
loaded) and calls it once: that call must be a remote hit, with no compile (a logging
g++ on empty Inductor dirs counts every one). P must live (no SIGSEGV), its client must
still answer after the children, and its scratch store must survive their exits.

Every process runs one OpenMP thread (``OMP_NUM_THREADS=1``, the builder too: the count is
a key factor): torch's GNU OpenMP hangs a forked child's first parallel region once its
parent ran one with several threads, whatever the cache does (docs/remote.md, "Forks").

Before the fix, on S3 (obstore's runtime, documented upstream as not fork-safe) each
child waited its whole deadline and went local-only, and P died of SIGSEGV in 5 of 8
runs: the child's requests ran on the runtime, and the epoll instance, it shares with
its parent.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from ccutil import Sandbox, cachectl
from tier_util import TIERS, remote_tier

from cachecompile.store.remote import split_levels

pytestmark = pytest.mark.slow

FLEET_KEY = "fleet-secret-for-forks"
ROUNDS = 3
WORKERS = 2  # per pool and per pre-forking server, each round
# A chain: the nearest level (nginx) never has the entry, so every child's lookup uses
# both levels' clients, a miss in the first and a hit in the second (moto).
CHAIN = "http,moto"

BUILD = """
import torch
from cachecompile import cache_compile
from cachecompile.demo import models
m = models.MLP().eval()
f = cache_compile(m.forward_impl)
f(models.make_mlp_input())
report({"event": f.events[-1][0]})
"""

SERVE = """
import torch
import json, multiprocessing as mp, os, sys, time
from pathlib import Path
from cachecompile import cache_compile
from cachecompile.demo import models
from cachecompile.store.tiered import scratch_parent
from cachecompile.warm.state import store_for

OUT = Path(os.environ["TEST_OUT"])
ROUNDS, WORKERS = int(os.environ["TEST_ROUNDS"]), int(os.environ["TEST_WORKERS"])
m = models.MLP().eval()
x = models.make_mlp_input()
want = m.forward_impl(x)
st = store_for(None)


def serve(tag):
    # A worker meeting a signature its parent never loaded: a new cached method, and
    # its first call looks the entry up (local: empty; then the remote).
    before = st.remote_hits
    t0 = time.monotonic()
    f = cache_compile(m.forward_impl)
    out = f(x)
    got = {"tag": tag, "pid": os.getpid(), "event": f.events[-1][0],
           "remote": st.remote_hits - before, "seconds": round(time.monotonic() - t0, 3),
           "ok": bool(torch.allclose(out, want, rtol=1e-4, atol=1e-5))}
    (OUT / f"{tag}.json").write_text(json.dumps(got))
    return got


first = cache_compile(m.forward_impl)
first(x)
assert first.events[-1][0] == "hit" and st.remote_hits == 1, (first.events, st.remote_hits)
fork = mp.get_context("fork")
codes = {}
for r in range(ROUNDS):
    p = fork.Process(target=serve, args=(f"process{r}",))
    p.start()
    p.join(120)
    if p.exitcode is None:
        p.kill()
    codes[f"process{r}"] = p.exitcode
    with fork.Pool(WORKERS, maxtasksperchild=1) as pool:
        pool.map_async(serve, [f"pool{r}.{i}" for i in range(WORKERS)],
                       chunksize=1).get(timeout=120)
    pids = {}
    for i in range(WORKERS):
        tag = f"prefork{r}.{i}"
        pid = os.fork()
        if pid == 0:
            serve(tag)
            sys.exit(0)  # as gunicorn's workers leave: every exit hook runs
        pids[pid] = tag
    deadline = time.monotonic() + 120
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for pid, tag in pids.items():  # hung: say so, and leave nothing behind
        os.kill(pid, 9)
        codes[tag] = "hung"
    # The parent's own clients between rounds, while nothing of them was used in a child.
    assert all(level.remote.ping() for level in st.levels)
records = sum(1 for level in st.levels for _ in level.remote.records())
again = first(x)
mine = [d for d in scratch_parent().iterdir() if f".{os.getpid()}." in d.name]
report({"codes": codes, "records": records, "event": first.events[-1][0],
        "ok": bool(torch.allclose(again, want, rtol=1e-4, atol=1e-5)),
        "scratch": [str(d) for d in mine if (d / "v1").is_dir()]})
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding the MLP's Inductor entries, compiled once for every tier."""
    root = tmp_path_factory.mktemp("fork-built")
    box = Sandbox(root / "box")
    res = box.run(BUILD, CACHECOMPILE_DIR=str(root / "store"), OMP_NUM_THREADS="1")
    assert res["event"] == "miss", res.value
    return root / "store"


@contextlib.contextmanager
def tier(tmp_path: Path, kind: str) -> Iterator[dict[str, str]]:
    """A real server of the tier on loopback; the environment a node uses to reach it."""
    with remote_tier(tmp_path, kind) as (_, env):
        yield {**env, "CACHECOMPILE_SIGNING_KEY": FLEET_KEY}


@pytest.mark.parametrize("kind", [*TIERS, CHAIN])
def test_forked_children_hit_and_the_parent_lives(tmp_path: Path, built: Path,
                                                  kind: str) -> None:
    with tier(tmp_path, kind) as env:
        # Into the farthest level only (of a chain: the nearer one misses in every child).
        farthest = split_levels(env["CACHECOMPILE_REMOTE"])[-1]
        pushed = cachectl("push", "--cache-dir", str(built), "--remote", farthest,
                          env={**_plain_env(), **env})
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        out = tmp_path / "out"
        out.mkdir()
        box = Sandbox(tmp_path / "box", fresh_inductor=True)  # any compile calls g++
        res = box.run(SERVE, check=False, timeout=600, CACHECOMPILE_DIR=str(tmp_path / "p"),
                      CACHECOMPILE_READONLY="1", OMP_NUM_THREADS="1", TEST_OUT=str(out),
                      TEST_ROUNDS=str(ROUNDS), TEST_WORKERS=str(WORKERS), environ=env)
        assert res.rc == 0, f"the parent exited {res.rc}:\n{res.stderr[-4000:]}"
        children = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
        want = {f"{how}{r}" + (f".{i}" if how != "process" else "")
                for r in range(ROUNDS) for how in ("process", "pool", "prefork")
                for i in (range(WORKERS) if how != "process" else [0])}
        assert set(children) == want, (sorted(children), res.stderr[-4000:])
        # Each child's first call a remote hit, and right.
        bad = {tag: c for tag, c in sorted(children.items())
               if (c["event"], c["remote"], c["ok"]) != ("hit", 1, True)}
        assert not bad, bad
        assert len({c["pid"] for c in children.values()}) == len(children)
        assert set(res["codes"].values()) == {0}, res["codes"]
        assert box.compiler_calls() == 0, box.gxx_log.read_text()
        assert (res["event"], res["ok"]) == ("hit", True)
        assert res["records"] >= 1 and res["scratch"], res.value
        failed = [ln for ln in res.stderr.splitlines() if "remote cache" in ln]
        assert failed == [], res.stderr[-4000:]


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("CACHECOMPILE_", "AWS_"))}


UPLOAD = """
import multiprocessing as mp, os, sys, time
from cachecompile.store import make_key, open_store

st = open_store(os.environ["TEST_STORE"])
FILES = {"kernel.so": b"\\x7fELF" + bytes(range(256)) * 4}


def publish(tag):
    # A child publishes what it compiled, and leaves as each kind of child does: a
    # multiprocessing child through os._exit (no atexit hook), a pre-forked worker
    # through sys.exit; neither flushes by hand.
    st.put(make_key({"fork-upload": tag}), {**FILES, "tag": tag.encode()})


publish("parent")
assert st.flush(60)  # the parent's client is started, and its uploader thread
fork = mp.get_context("fork")
p = fork.Process(target=publish, args=("process",))
p.start()
p.join(60)
with fork.Pool(2, maxtasksperchild=1) as pool:
    pool.map(publish, ["pool0", "pool1"], chunksize=1)
    pool.close()
    pool.join()  # the workers leave by themselves (terminate() would SIGTERM them)
pid = os.fork()
if pid == 0:
    publish("prefork")
    sys.exit(0)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
tags = ["parent", "process", "pool0", "pool1", "prefork"]
report({"process": p.exitcode, "prefork": code,
        "remote": {t: all(level.remote.contains(make_key({"fork-upload": t}).digest)
                          for level in st.levels) for t in tags}})
"""


@pytest.mark.parametrize("kind", [*TIERS, CHAIN])
def test_forked_children_upload_what_they_publish(tmp_path: Path, kind: str) -> None:
    """A forked child's publishes reach the remote, every level of a chain: its uploaders
    are its own (the parent's threads are not in it), and a multiprocessing child, which
    leaves through os._exit without atexit hooks, flushes through multiprocessing's
    finalizers."""
    with tier(tmp_path, kind) as env:
        box = Sandbox(tmp_path / "box")
        res = box.run(UPLOAD, timeout=300, TEST_STORE=str(tmp_path / "node"),
                      CACHECOMPILE_REMOTE_FLUSH_TIMEOUT="60", environ=env)
        assert (res["process"], res["prefork"]) == (0, 0), res.value
        assert res["remote"] == dict.fromkeys(res["remote"], True), (res.value, res.stderr)
