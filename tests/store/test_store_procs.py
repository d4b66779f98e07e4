"""Real processes: racing writers, gc during publishes, SIGKILLed writers, pins, eviction."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachecompile.store import Hit, Miss, Store, make_key, open_store, verification


def _spawn(code: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(p: subprocess.Popen[str], timeout: float = 60) -> str:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return out


PUBLISH_SAME = """
import sys, time, hashlib
from cachecompile.store import open_store, make_key
root, go = sys.argv[1], float(sys.argv[2])
st = open_store(root)
key = make_key({"race": 1})
payload = hashlib.sha256(str(__import__("os").getpid()).encode()).digest() * 40000
while time.time() < go:
    pass
e = st.put(key, {"a.bin": payload, "sub/b.txt": b"pid-specific " + payload[:8]})
print(e.files["a.bin"].read_bytes().hex()[:64], e.files["sub/b.txt"].read_bytes().hex())
"""


def test_eight_writers_same_key_one_winner(tmp_path: Path, child_env: dict[str, str]) -> None:
    root = tmp_path / "cache"
    open_store(root)
    go = time.time() + 1.5  # all start publishing at the same moment
    procs = [_spawn(PUBLISH_SAME, child_env, str(root), str(go)) for _ in range(8)]
    outs = {_finish(p) for p in procs}
    assert len(outs) == 1  # every writer got the same (winner's) bytes
    st = open_store(root)
    assert len(list(st.maintenance().digests())) == 1
    assert list((root / "v1" / "tmp").iterdir()) == []
    verification._VERIFIED.clear()
    r = st.get(make_key({"race": 1}))
    assert isinstance(r, Hit)
    assert st.maintenance().verify().ok


PUBLISH_MANY = """
import sys, os
from cachecompile.store import open_store, make_key
root, me = sys.argv[1], int(sys.argv[2])
st = open_store(root, max_size=10**12)
for i in range(15):
    st.put(make_key({"w": me, "i": i}), {"a": os.urandom(20000), "same": b"shared" * 1000})
print("ok")
"""

GC_LOOP = """
import sys, time
from cachecompile.store import open_store
st = open_store(sys.argv[1])
end = time.time() + float(sys.argv[2])
n = 0
while time.time() < end:
    st.gc(max_size=300_000)
    n += 1
print(n)
"""


def test_writers_with_concurrent_gc(tmp_path: Path, child_env: dict[str, str]) -> None:
    root = tmp_path / "cache"
    open_store(root)
    gc = _spawn(GC_LOOP, child_env, str(root), "4")
    writers = [_spawn(PUBLISH_MANY, child_env, str(root), str(i)) for i in range(8)]
    for w in writers:
        assert _finish(w, timeout=120).strip() == "ok"
    assert int(_finish(gc)) >= 1
    st = open_store(root)
    verification._VERIFIED.clear()
    rep = st.maintenance().verify()
    assert rep.problems == [], rep.problems  # gc never left a half entry behind
    # Whatever survived is whole and loadable.
    for d in st.maintenance().digests():
        assert isinstance(st.get(d), Hit)
    st.maintenance().gc(max_size=300_000)
    assert st.stats()["bytes"] <= 300_000
    assert list((root / "v1" / "tmp").iterdir()) == []


CRASH_WRITER = """
import sys, os
from cachecompile.store import open_store, make_key
st = open_store(sys.argv[1])
payload = os.urandom(4 << 20)
print("ready", flush=True)
for i in range(1000):
    st.put(make_key({"crash": int(sys.argv[2]), "i": i}),
           {"big.bin": payload + i.to_bytes(4, "little"), "dir/small.py": b"x = %d" % i})
"""


@pytest.mark.slow
def test_sigkilled_writers_leave_nothing_loadable_broken(tmp_path: Path, child_env: dict[str, str]) -> None:
    root = tmp_path / "cache"
    open_store(root)
    rng = random.Random(1234)
    mid_publish = 0
    for trial in range(24):
        p = _spawn(CRASH_WRITER, child_env, str(root), str(trial))
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.15))
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.communicate()
        mid_publish += any(n.name.startswith(("put.", "blob.")) for n in (root / "v1" / "tmp").iterdir())
    assert mid_publish >= 3  # the kills really landed inside publishes
    st = open_store(root)  # sweeps temp dirs of dead writers on open
    assert list((root / "v1" / "tmp").iterdir()) == []
    verification._VERIFIED.clear()
    n = 0
    for d in st.maintenance().digests():
        r = st.get(d)
        assert isinstance(r, Hit), r  # everything visible is whole
        assert r.entry.files["big.bin"].stat().st_size == (4 << 20) + 4
        n += 1
    st.maintenance().gc()
    rep = st.maintenance().verify()
    assert rep.ok, rep
    assert rep.checked == n


PIN_HOLDER = """
import sys, time
from cachecompile.store import open_store
st = open_store(sys.argv[1])
r = st.get(sys.argv[2])
pin = st.pin(r.entry)
f = open(r.entry.files["a"], "rb")
print("pinned", flush=True)
sys.stdin.readline()
print(len(f.read()), flush=True)
"""


def test_gc_skips_entry_pinned_by_live_process(tmp_path: Path, child_env: dict[str, str]) -> None:
    st = open_store(tmp_path / "cache")
    assert isinstance(st, Store)
    old = st.put(make_key({"old": 1}), {"a": b"o" * 1000})
    time.sleep(0.01)
    new = st.put(make_key({"new": 1}), {"a": b"n" * 1000})
    st.get(new.key)  # more recently used
    holder = subprocess.Popen([sys.executable, "-c", PIN_HOLDER, str(st.root), old.key],
                              env=child_env, text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "pinned"
    rep = st.gc(max_size=1000)
    assert [e.key for e in rep.evicted] == [new.key] and rep.pinned_skipped == [old.key]
    assert st.contains(old.key)
    holder.stdin.write("\n")  # type: ignore[union-attr]
    holder.stdin.flush()  # type: ignore[union-attr]
    assert holder.stdout.readline().strip() == "1000"
    holder.wait(timeout=30)
    # The holder is gone: its pin is dead and the entry can go now.
    rep = st.gc(max_size=0)
    assert [e.key for e in rep.evicted] == [old.key]
    assert not list((st.root / "v1" / "pins").iterdir())


def test_evicted_entry_stays_readable_for_open_reader(tmp_path: Path) -> None:
    st = open_store(tmp_path / "cache")
    e = st.put(make_key({"e": 1}), {"a": b"payload" * 1000})
    with open(e.files["a"], "rb") as f:
        head = f.read(7)
        rep = st.maintenance().gc(max_size=0)
        assert [x.key for x in rep.evicted] == [e.key]
        assert not e.path.exists()
        assert head + f.read() == b"payload" * 1000
    assert isinstance(st.get(e.key), Miss)
    assert st.stats()["evictions"] == 1


def test_pin_in_process_and_release(tmp_path: Path) -> None:
    st = open_store(tmp_path / "cache")
    assert isinstance(st, Store)
    e = st.put(make_key({"p": 1}), {"a": b"x" * 10})
    with st.pin(e) as pin:
        assert pin.held and st.pinned() == {e.key}
        assert st.gc(max_size=0).evicted == []
    assert not pin.held and st.pinned() == set()
    assert len(st.gc(max_size=0).evicted) == 1


def test_put_over_cap_collects_automatically(tmp_path: Path) -> None:
    st = open_store(tmp_path / "cache", max_size=2500)
    keys = [make_key({"i": i}) for i in range(5)]
    for k in keys:
        st.put(k, {"a": os.urandom(1000)})
        time.sleep(0.005)
    s = st.stats()
    assert s["bytes"] <= 2500 and s["evictions"] == 3
    assert st.contains(keys[-1]) and not st.contains(keys[0])


def test_purge_by_label_age_and_all(tmp_path: Path) -> None:
    st = open_store(tmp_path / "cache")
    a = st.put(make_key({"i": 1}), {"a": b"1"}, labels={"model": "m1"})
    b = st.put(make_key({"i": 2}), {"a": b"2"}, labels={"model": "m2"})
    c = st.put(make_key({"i": 3}), {"a": b"3"}, labels={"model": "m2"})
    assert st.maintenance().purge() == []
    assert [i.key for i in st.maintenance().purge(labels={"model": "m1"}, dry_run=True)] == [a.key]
    assert st.contains(a.key)
    assert [i.key for i in st.maintenance().purge(labels={"model": "m1"})] == [a.key]
    assert st.maintenance().purge(older_than=3600) == []
    time.sleep(0.05)
    st.get(c.key)
    assert [i.key for i in st.maintenance().purge(older_than=0.04)] == [b.key]
    assert [i.key for i in st.maintenance().purge(all=True)] == [c.key]
    assert list(st.maintenance().digests()) == []


FORK_WHILE_WRITING = """
import os, sys, threading, time
from cachecompile.store import Hit, make_key, open_store
st = open_store(sys.argv[1], hits_later=sys.argv[3] == "later")
key = make_key({"fork": "index"})
st.put(key, {"f": b"x"})
other = make_key({"fork": "other"})
st.put(other, {"g": b"y"})
stop = False


def writer():
    # Another thread of the serving process inside SQLite most of the time: its hits
    # (as the hits timer, gc's deleters and a garbage-collected store's close are).
    while not stop:
        st.get(other)
        st.index.flush_hits()


threading.Thread(target=writer, daemon=True).start()
hung = bad = 0
for i in range(int(sys.argv[2])):
    time.sleep(0.01)
    pid = os.fork()
    if pid == 0:  # a forked worker's first lookup, and a publish of its own
        code = 1
        try:
            ok = isinstance(st.get(key), Hit)
            st.put(make_key({"fork": "child", "n": i}), {"c": b"child"})
            st.index.flush_hits()
            code = 0 if ok else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            bad += os.waitstatus_to_exitcode(status) != 0
            break
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
stop = True
print(hung, bad, sum(1 for i in st.entries() if i.key))
"""


@pytest.mark.parametrize("hits", ["now", "later"])
def test_a_fork_while_another_thread_writes_the_index(tmp_path: Path,
                                                      child_env: dict[str, str],
                                                      hits: str) -> None:
    """A pre-forking server whose other threads use the index (the hits timer, gc's
    deleters...): every forked child's first lookup hits and its publish lands, and none
    waits on a lock a thread of its parent held at the fork (11 of 20 children hung
    before: the index's lock and SQLite's mutexes, held by no thread in the child)."""
    forks = 20
    out = _finish(_spawn(FORK_WHILE_WRITING, child_env, str(tmp_path / "cc"), str(forks),
                         hits), timeout=600)
    hung, bad, entries = map(int, out.split())
    assert (hung, bad) == (0, 0), out
    assert entries == 2 + forks
