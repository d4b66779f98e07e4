"""The Redis tier against a real redis-server: backfill, chunking, signing, faults.

Each test starts its own server on a free loopback port (tests/redis_util.py) and
uses the store API in this process; tests/procs/test_remote_procs.py runs cache_compile
across fresh processes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ccutil
import pytest
from redis_util import RedisServer, free_port

from cachecompile import store
from cachecompile.store import Hit, Miss, ReadOnlyStore, Store, make_key
from cachecompile.store.errors import UntrustedEntryError
from cachecompile.store.remote import RedisRemote, RemoteConfig
from cachecompile.store.remote.base import may_replace, record_state
from cachecompile.store.signing import Trust, make_record, parse_record
from cachecompile.store.tiered import TieredStore

KEY_A = "fleet-secret-key-1"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_SIGNING_KEY", "CACHECOMPILE_TRUST_REMOTE",
                "CACHECOMPILE_DIR", "CACHECOMPILE_READONLY", "CACHECOMPILE_VERIFY_KEYS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def tiered(root: Path, url: str) -> TieredStore:
    st = store.open_store(root, remote=url)
    assert isinstance(st, TieredStore)
    return st


def keys_of(srv: RedisServer, kind: str) -> list[bytes]:
    return sorted(srv.client().keys(f"cachecompile:v1:{kind}:*"))  # type: ignore[attr-defined]


def local_manifests(root: Path) -> list[Path]:
    return list((root / "v1" / "entries").rglob("manifest.json"))


def remote_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("cachecompile.store.") and r.levelno >= logging.WARNING]


FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 40, "code/out.py": b"x = 1\n",
         "empty": b""}


def test_publish_on_one_node_hits_on_another(tmp_path: Path, srv: RedisServer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    a = tiered(tmp_path / "a", srv.url())
    key = make_key({"model": "m", "n": 1})
    a.put(key, FILES, labels={"model": "m"}, meta={"compile_s": 1.0})
    assert a.flush(10)
    assert len(keys_of(srv, "entry")) == 1

    b = tiered(tmp_path / "b", srv.url())
    hit = b.get(key)
    assert isinstance(hit, Hit)
    # A Hit of B's LOCAL entry (backfilled), same manifest content as A's.
    assert hit.entry.path.is_relative_to(tmp_path / "b")
    assert {n: p.read_bytes() for n, p in hit.entry.files.items()} == FILES
    assert hit.entry.labels == {"model": "m"} and hit.entry.meta == {"compile_s": 1.0}
    assert hit.entry.factors == {"model": "m", "n": 1}
    # The backfill is not uploaded back, and a second lookup is local.
    assert b.uploader is not None and b.uploader.pending() == 0
    assert isinstance(b.get(key), Hit)
    s = b.stats()
    assert (s["hits_local"], s["hits_remote"], s["misses"].get("absent", 0)) == (1, 1, 0)
    # Misses on both tiers are plain misses.
    assert isinstance(b.get(make_key({"other": 1})), Miss)


def test_chunks_are_bounded_and_blobs_deduplicated(tmp_path: Path, srv: RedisServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    big = os.urandom(10_000)
    a = tiered(tmp_path / "a", srv.url(chunk="1K"))
    k1, k2 = make_key({"e": 1}), make_key({"e": 2})
    a.put(k1, {"w.bin": big, "copy.bin": big})
    a.put(k2, {"other-name.bin": big, "small": b"s"})
    assert a.flush(10)
    chunks = keys_of(srv, "chunk")
    # One copy of the 10,000 bytes in ten 1 KiB chunks, shared by both entries, plus "s".
    assert len(chunks) == 10 + 1
    client: Any = srv.client()
    assert max(client.strlen(k) for k in chunks) == 1024
    b = tiered(tmp_path / "b", srv.url())
    for k in (k1, k2):
        hit = b.get(k)
        assert isinstance(hit, Hit)
    assert b.get(k1).entry.files["copy.bin"].read_bytes() == big  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="64M"):
        RemoteConfig.parse(srv.url(chunk="65M"))


def _publish_signed(tmp_path: Path, srv: RedisServer, key_text: str | None,
                    monkeypatch: pytest.MonkeyPatch) -> store.Key:
    if key_text is None:
        monkeypatch.delenv("CACHECOMPILE_SIGNING_KEY", raising=False)
    else:
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", key_text)
    a = tiered(tmp_path / "a", srv.url(chunk="512"))
    key = make_key({"signed": key_text})
    a.put(key, FILES)
    assert a.flush(10)
    return key


@pytest.mark.parametrize("consumer", ["wrong-key", "no-key-no-opt-in"])
def test_signed_entries_need_the_right_key(tmp_path: Path, srv: RedisServer, consumer: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    key = _publish_signed(tmp_path, srv, KEY_A, monkeypatch)
    if consumer == "wrong-key":
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", "not-the-fleet-key")
    else:
        monkeypatch.delenv("CACHECOMPILE_SIGNING_KEY")
    b = tiered(tmp_path / "b", srv.url())
    with caplog.at_level(logging.WARNING):
        assert isinstance(b.get(key), Miss)
    warned = remote_warnings(caplog)
    assert len(warned) == 1, warned
    assert ("signature does not match" if consumer == "wrong-key" else "TRUST_REMOTE") in warned[0]
    assert local_manifests(tmp_path / "b") == []
    # The right key loads it.
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    assert isinstance(tiered(tmp_path / "c", srv.url()).get(key), Hit)


def test_unsigned_entries_need_an_opt_in(tmp_path: Path, srv: RedisServer,
                                         monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    key = _publish_signed(tmp_path, srv, None, monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert isinstance(tiered(tmp_path / "b", srv.url()).get(key), Miss)
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)  # a key makes signing mandatory
        assert isinstance(tiered(tmp_path / "c", srv.url()).get(key), Miss)
    warned = remote_warnings(caplog)
    assert len(warned) == 2 and "TRUST_REMOTE" in warned[0] and "not signed" in warned[1]
    monkeypatch.delenv("CACHECOMPILE_SIGNING_KEY")
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    assert isinstance(tiered(tmp_path / "d", srv.url()).get(key), Hit)


def test_tampered_blob_is_refused(tmp_path: Path, srv: RedisServer,
                                  monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    key = _publish_signed(tmp_path, srv, KEY_A, monkeypatch)
    client: Any = srv.client()
    victim = keys_of(srv, "chunk")[0]
    data = bytearray(client.get(victim))
    data[0] ^= 0x01
    client.set(victim, bytes(data))  # the signed record is untouched; a blob is not
    b = tiered(tmp_path / "b", srv.url())
    with caplog.at_level(logging.WARNING):
        assert isinstance(b.get(key), Miss)
    warned = remote_warnings(caplog)
    assert len(warned) == 1 and "SHA-256" in warned[0], warned
    assert local_manifests(tmp_path / "b") == []
    assert list((tmp_path / "b" / "v1" / "tmp").iterdir()) == []  # staging removed
    # B compiles and publishes its own copy: it replaces the bad remote one.
    b.put(key, FILES)
    assert b.flush(10)
    assert isinstance(tiered(tmp_path / "c", srv.url()).get(key), Hit)


def test_read_only_remote_consumes_but_never_publishes(tmp_path: Path, srv: RedisServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    ro = tiered(tmp_path / "ro", srv.url(mode="ro"))
    assert ro.remote.readonly and ro.uploader is None
    ro.put(make_key({"from": "ro"}), FILES)  # local publish works; nothing goes up
    assert srv.client().dbsize() == 0  # type: ignore[attr-defined]
    rw = tiered(tmp_path / "rw", srv.url())
    key = make_key({"from": "rw"})
    rw.put(key, FILES)
    assert rw.flush(10)
    assert isinstance(ro.get(key), Hit)


def test_read_only_local_root_with_a_remote(tmp_path: Path, srv: RedisServer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    rw = tiered(tmp_path / "rw", srv.url())
    key = make_key({"image": "layer"})
    rw.put(key, FILES)
    assert rw.flush(10)
    store.open_store(tmp_path / "ro")  # exists, empty
    st = store.open_store(tmp_path / "ro", readonly=True, remote=srv.url())
    # The tier composed with the read-only view: no subclass, the same class.
    assert type(st) is TieredStore and isinstance(st.local, ReadOnlyStore) and st.readonly
    assert st.uploader is None
    hit = st.get(key)
    assert isinstance(hit, Hit) and not hit.entry.path.is_relative_to(tmp_path / "ro")
    assert local_manifests(tmp_path / "ro") == []


def test_connection_refused_warns_once_and_stays_local(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    st = tiered(tmp_path / "a", url)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        for i in range(20):
            k = make_key({"i": i})
            assert isinstance(st.get(k), Miss)
            st.put(k, {"f": b"x"})
            assert isinstance(st.get(k), Hit)
        assert st.flush(5) is False  # drained; nothing was shared
    assert time.monotonic() - t0 < 5
    warned = remote_warnings(caplog)
    assert len(warned) == 1 and "Connection refused" in warned[0], warned
    # Backoff, not per call: one failed attempt in the whole loop.
    assert st.remote.breaker.failures == 1


def test_remote_comes_back_after_backoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    srv = RedisServer(tmp_path / "redis")
    # A backoff no loaded machine outruns; the breaker's clock moves past it instead.
    st = tiered(tmp_path / "a", srv.url(backoff="60"))
    key = make_key({"late": 1})
    assert isinstance(st.get(key), Miss) and st.remote.breaker.down
    srv.start()
    try:
        other = tiered(tmp_path / "b", srv.url())
        other.put(key, FILES)
        assert other.flush(10)
        assert isinstance(st.get(key), Miss)  # still inside the backoff: no network call
        st.remote.breaker.clock = lambda: time.monotonic() + 61
        assert isinstance(st.get(key), Hit) and not st.remote.breaker.down
    finally:
        srv.stop()


def _kill_after(monkeypatch: pytest.MonkeyPatch, srv: RedisServer, what: str, n: int) -> None:
    real = RedisRemote._cmd
    seen = {"n": 0}

    def cmd(self: RedisRemote, w: str, *args: Any) -> Any:
        if w == what:
            seen["n"] += 1
            if seen["n"] == n:
                srv.kill()
        return real(self, w, *args)

    monkeypatch.setattr(RedisRemote, "_cmd", cmd)


def test_killed_server_mid_upload_leaves_no_partial_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    srv = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        big = os.urandom(1 << 20)
        a = tiered(tmp_path / "a", srv.url(chunk="64K", lease="1"))
        _kill_after(monkeypatch, srv, "set chunk", 5)
        key = make_key({"upload": "killed"})
        with caplog.at_level(logging.WARNING):
            a.put(key, {"w.bin": big})
            assert a.flush(10) is False  # drained; the upload died
        assert isinstance(a.get(key), Hit)  # the local side never noticed
        assert len(remote_warnings(caplog)) == 1
        srv.start()  # same port and dir: the append-only file replays what was acked
        assert len(keys_of(srv, "chunk")) == 4  # the upload really was cut midway...
        assert keys_of(srv, "entry") == [] and keys_of(srv, "blob") == []  # ...and invisible
        b = tiered(tmp_path / "b", srv.url())
        assert isinstance(b.get(key), Miss) and local_manifests(tmp_path / "b") == []
        # cachectl remote purge clears the leftovers, once the dead upload's pins expired.
        assert b.remote.sweep() == 0 and len(keys_of(srv, "chunk")) == 4
        time.sleep(1.2)
        assert b.remote.sweep() == 4 and keys_of(srv, "chunk") == []
    finally:
        srv.stop()


def test_killed_server_mid_download_leaves_no_partial_entry(
        tmp_path: Path, srv: RedisServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    a = tiered(tmp_path / "a", srv.url(chunk="64K"))
    key = make_key({"download": "killed"})
    a.put(key, {"w.bin": os.urandom(1 << 20)})
    assert a.flush(10)
    b = tiered(tmp_path / "b", srv.url())
    _kill_after(monkeypatch, srv, "get chunk", 5)
    with caplog.at_level(logging.WARNING):
        assert isinstance(b.get(key), Miss)
        assert isinstance(b.get(key), Miss)  # no second try, no second warning
    assert len(remote_warnings(caplog)) == 1
    assert local_manifests(tmp_path / "b") == []
    assert list((tmp_path / "b" / "v1" / "tmp").iterdir()) == []


def test_out_of_memory_degrades(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    srv = RedisServer(tmp_path / "redis", maxmemory="3mb").start()
    try:
        a = tiered(tmp_path / "a", srv.url(chunk="256K"))
        key = make_key({"too": "big"})
        with caplog.at_level(logging.WARNING):
            a.put(key, {"w.bin": os.urandom(8 << 20)})
            assert a.flush(10) is False  # drained; the upload failed
        warned = remote_warnings(caplog)
        assert len(warned) == 1 and "OutOfMemory" in warned[0], warned
        assert keys_of(srv, "entry") == []
        assert isinstance(a.get(key), Hit)
    finally:
        srv.stop()


def test_plain_store_without_remote(tmp_path: Path) -> None:
    assert type(store.open_store(tmp_path / "x")) is Store
    assert type(store.open_store(tmp_path / "y", remote="")) is Store


# -- cachectl --------------------------------------------------------------------------
def cachectl(env: dict[str, str], *args: str) -> ccutil.Ran:
    return ccutil.cachectl(*args, env=env)


def test_cachectl_push_pull_remote_verbs_and_stats(tmp_path: Path, srv: RedisServer,
                                                   child_env: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(child_env, CACHECOMPILE_REMOTE=srv.url(), CACHECOMPILE_SIGNING_KEY=KEY_A)
    a = store.open_store(tmp_path / "a")
    ka, kb = make_key({"m": "llama"}), make_key({"m": "mlp"})
    a.put(ka, FILES, labels={"model": "llama", "function": "forward"})
    a.put(kb, {"f": b"1"}, labels={"model": "mlp", "function": "forward"})
    p = cachectl(env, "push", "--cache-dir", str(tmp_path / "a"), "--model", "llama")
    assert p.returncode == 0 and "1 entry: pushed 1 to" in p.stdout, p.stderr
    p = cachectl(env, "push", "--cache-dir", str(tmp_path / "a"))
    assert p.returncode == 0 and "pushed 1 to" in p.stdout and "1 was there" in p.stdout
    p = cachectl(env, "remote", "ls", "--json")
    rows = json.loads(p.stdout)
    assert sorted(r["labels"]["model"] for r in rows) == ["llama", "mlp"]
    assert {r["state"] for r in rows} == {"signed"}
    p = cachectl(env, "remote", "stats", "--json")
    assert json.loads(p.stdout)["entries"] == 2
    p = cachectl(env, "pull", "--cache-dir", str(tmp_path / "b"), ka.digest[:8])
    assert p.returncode == 0 and "pulled 1 entry" in p.stdout, p.stderr
    assert [i.key for i in store.open_store(tmp_path / "b").entries()] == [ka.digest]
    # A hit through the tier counts as remote in cachectl stats.
    assert isinstance(store.open_store(tmp_path / "c", remote=srv.url()).get(kb), Miss)
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    assert isinstance(store.open_store(tmp_path / "c", remote=srv.url()).get(kb), Hit)
    p = cachectl(env, "stats", "--cache-dir", str(tmp_path / "c"), "--json")
    s = json.loads(p.stdout)
    assert (s["hits_local"], s["hits_remote"]) == (0, 1), s
    p = cachectl(env, "remote", "purge", "--model", "mlp", "--yes")
    assert p.returncode == 0 and "removed 1 entry" in p.stdout, p.stderr
    p = cachectl(env, "remote", "ls", "--json")
    assert [r["labels"]["model"] for r in json.loads(p.stdout)] == ["llama"]
    p = cachectl(dict(env, CACHECOMPILE_REMOTE=f"redis://127.0.0.1:{free_port()}/0"),
                 "remote", "ls")
    assert p.returncode == 7 and "Connection refused" in p.stderr and "Traceback" not in p.stderr


def test_cachectl_pull_is_counted_as_a_pull_not_a_hit(tmp_path: Path, srv: RedisServer,
                                                       child_env: dict[str, str]) -> None:
    env = dict(child_env, CACHECOMPILE_REMOTE=srv.url(), CACHECOMPILE_SIGNING_KEY=KEY_A)
    a = store.open_store(tmp_path / "a")
    key = make_key({"m": "llama"})
    a.put(key, FILES, labels={"model": "llama"})
    assert cachectl(env, "push", "--cache-dir", str(tmp_path / "a")).returncode == 0
    p = cachectl(env, "pull", "--cache-dir", str(tmp_path / "b"))
    assert p.returncode == 0 and "pulled 1 entry" in p.stdout, p.stderr

    s = json.loads(cachectl(env, "stats", "--cache-dir", str(tmp_path / "b"), "--json").stdout)
    assert (s["hits"], s["hits_remote"]) == (0, 0), s
    assert s.get("pulls") == 1, s
    # Nor is the entry's own hit count (gc's LRU reads it) moved by the prefetch.
    b = store.open_store(tmp_path / "b")
    info = b.stat(key)
    assert info is not None and info.hits == 0
    p = cachectl(env, "stats", "--cache-dir", str(tmp_path / "b"))
    assert "pulled" in p.stdout and "not hits" in p.stdout, p.stdout
    # A second pull finds it here: nothing downloaded, nothing counted.
    p = cachectl(env, "pull", "--cache-dir", str(tmp_path / "b"))
    assert "pulled 0 entries" in p.stdout and "1 was here already" in p.stdout, p.stdout
    # The first real lookup is a local hit.
    assert isinstance(b.get(key), Hit)
    s = json.loads(cachectl(env, "stats", "--cache-dir", str(tmp_path / "b"), "--json").stdout)
    assert (s["hits"], s["hits_local"], s["hits_remote"], s["pulls"]) == (1, 1, 0, 1), s


@pytest.mark.parametrize("verb", [("push",), ("export", "out.tar")])
def test_cachectl_verbs_that_read_the_local_store_never_create_it(
        tmp_path: Path, srv: RedisServer, child_env: dict[str, str], verb: tuple[str, ...]) -> None:
    env = dict(child_env, CACHECOMPILE_REMOTE=srv.url(), CACHECOMPILE_SIGNING_KEY=KEY_A)
    typo = tmp_path / "cahce"
    args = [str(tmp_path / a) if a.endswith(".tar") else a for a in verb]
    p = cachectl(env, *args, "--cache-dir", str(typo))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"no cache at {typo}" in p.stderr and "Traceback" not in p.stderr
    assert not typo.exists() and not (tmp_path / "out.tar").exists()


# -- signed records are never replaced by a node that cannot vouch for them -------------
def _record_bytes(srv: RedisServer, key: store.Key) -> bytes | None:
    client: Any = srv.client()
    raw = client.get(f"cachecompile:v1:entry:{key.digest}")
    return None if raw is None else bytes(raw)


def _verifies(srv: RedisServer, key: store.Key, secret: str) -> bool:
    raw = _record_bytes(srv, key)
    assert raw is not None
    rec = parse_record(raw, key.digest)
    try:
        Trust(key=secret.encode()).check(rec.body, rec.sig, key.digest)
    except UntrustedEntryError:
        return False
    return True


@pytest.mark.parametrize("node", ["no-key", "wrong-key", "no-key-trusting"])
def test_signed_record_survives_a_node_that_cannot_sign_it(
        tmp_path: Path, srv: RedisServer, node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    key = _publish_signed(tmp_path, srv, KEY_A, monkeypatch)
    before = _record_bytes(srv, key)
    monkeypatch.delenv("CACHECOMPILE_SIGNING_KEY")
    if node == "wrong-key":
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", "not-the-fleet-key")
    if node == "no-key-trusting":
        monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    u = tiered(tmp_path / "u", srv.url())
    got = u.get(key)
    if node != "no-key-trusting":
        # Refused, so the node compiles and publishes its own copy: it must not go up.
        assert isinstance(got, Miss)
        u.put(key, FILES)
        assert u.flush(10)
        assert _record_bytes(srv, key) == before
    # Even an explicit overwrite (cachectl push --force) cannot replace a signed record
    # with an unsigned or differently signed one.
    hit = u.peek(key)
    assert isinstance(hit, Hit)
    assert not u.remote.upload(hit.entry, overwrite=True)
    assert _record_bytes(srv, key) == before
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    assert isinstance(tiered(tmp_path / "b", srv.url()).get(key), Hit)


def _pause_after(monkeypatch: pytest.MonkeyPatch, what: str
                 ) -> tuple[threading.Event, threading.Event]:
    """Block the first ``what`` command (after it ran) until ``go`` is set."""
    real = RedisRemote._cmd
    reached, go = threading.Event(), threading.Event()

    def cmd(self: RedisRemote, w: str, *args: Any) -> Any:
        out = real(self, w, *args)
        if w == what and not reached.is_set():
            reached.set()
            assert go.wait(30)
        return out

    monkeypatch.setattr(RedisRemote, "_cmd", cmd)
    return reached, go


def test_unsigned_upload_racing_a_signed_one_does_not_win(
        tmp_path: Path, srv: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # The unkeyed node checks first (nothing there), uploads its blobs, and only then
    # writes its record: by then the keyed node has published. The check must hold.
    key = make_key({"race": "sign"})
    u = tiered(tmp_path / "u", srv.url())
    reached, go = _pause_after(monkeypatch, "set marker")
    u.put(key, FILES)
    assert reached.wait(10)
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    k = tiered(tmp_path / "k", srv.url())
    k.put(key, FILES)
    assert k.flush(10)
    signed = _record_bytes(srv, key)
    go.set()
    assert u.flush(10)
    assert _record_bytes(srv, key) == signed and _verifies(srv, key, KEY_A)


def test_keyed_node_replaces_an_unsigned_record(tmp_path: Path, srv: RedisServer,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    key = _publish_signed(tmp_path, srv, None, monkeypatch)
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    k = tiered(tmp_path / "k", srv.url())
    with caplog.at_level(logging.WARNING):
        assert isinstance(k.get(key), Miss)
    k.put(key, FILES)
    assert k.flush(10)
    assert _verifies(srv, key, KEY_A)
    assert isinstance(tiered(tmp_path / "c", srv.url()).get(key), Hit)


def test_refusal_is_warned_once_per_entry_per_process(tmp_path: Path, srv: RedisServer,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    key = _publish_signed(tmp_path, srv, None, monkeypatch)
    other = make_key({"another": "unsigned"})
    plain = tiered(tmp_path / "p", srv.url())
    plain.put(other, {"f": b"other"})
    assert plain.flush(10)
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    with caplog.at_level(logging.WARNING):
        for root in ("b", "c"):  # two stores, as two cache_compile'd functions open them
            st = tiered(tmp_path / root, srv.url())
            for _ in range(3):
                assert isinstance(st.get(key), Miss)
                assert isinstance(st.get(other), Miss)
    warned = remote_warnings(caplog)
    assert len(warned) == 2, warned
    assert all("not signed" in w for w in warned)
    assert {key.digest in w for w in warned} == {True, False}


def test_executable_bit_survives_the_remote(tmp_path: Path, srv: RedisServer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    src = tmp_path / "src"
    src.mkdir()
    (src / "run.sh").write_bytes(b"#!/bin/sh\necho " + os.urandom(8).hex().encode() + b"\n")
    (src / "run.sh").chmod(0o755)
    (src / "data.bin").write_bytes(os.urandom(100))
    (src / "data.bin").chmod(0o644)
    a = tiered(tmp_path / "a", srv.url(chunk="16"))
    key = make_key({"exec": 1})
    entry = a.put(key, {"bin/run.sh": src / "run.sh", "data.bin": src / "data.bin"})
    assert entry.files["bin/run.sh"].stat().st_mode & 0o777 == 0o500
    assert a.flush(10)
    hit = tiered(tmp_path / "b", srv.url()).get(key)
    assert isinstance(hit, Hit)
    assert hit.entry.files["bin/run.sh"].stat().st_mode & 0o777 == 0o500
    assert hit.entry.files["data.bin"].stat().st_mode & 0o777 == 0o400
    assert os.access(hit.entry.files["bin/run.sh"], os.X_OK)


def test_a_remote_hit_on_a_shared_graph_moves_the_graph_counters(
        tmp_path: Path, srv: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # Shared graphs (key factor and label kind=graph) are counted apart from the user's
    # entries; a hit one tier down must take back the graph's miss, not the user's.
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    a = tiered(tmp_path / "a", srv.url())
    user = make_key({"model": "M", "fn": "forward"})
    graph = make_key({"kind": "graph", "graph": "g" * 32})
    a.put(user, {"a": b"user"}, labels={"model": "M", "function": "forward"})
    a.put(graph, {"p": b"graph"}, labels={"kind": "graph", "function": "(shared graph)"})
    assert a.flush(10)
    b = tiered(tmp_path / "b", srv.url())
    assert isinstance(b.get(graph), Hit)
    s = b.stats()
    assert s["misses"].get("absent", 0) == 0, s
    assert s["shared_graphs"]["misses"].get("absent", 0) == 0, s
    assert s["shared_graphs"]["hits"] == 1
    # Nor is the download one of the user's remote hits (hits_local = hits - remote).
    assert (s["hits"], s["hits_local"], s["hits_remote"]) == (0, 0, 0), s
    assert isinstance(b.get(user), Hit)
    s = b.stats()
    assert (s["hits"], s["hits_local"], s["hits_remote"]) == (1, 0, 1), s
    assert s["misses"].get("absent", 0) == 0, s


def test_a_symlinked_local_tmp_refuses_downloads(tmp_path: Path, srv: RedisServer,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY_A)
    key = make_key({"staged": 1})
    a = tiered(tmp_path / "a", srv.url())
    a.put(key, FILES)
    assert a.flush(10)
    b = tiered(tmp_path / "b", srv.url())
    tmp = b.root / "v1" / "tmp"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    tmp.rmdir()
    tmp.symlink_to(outside, target_is_directory=True)
    downloads: list[str] = []
    real_download = b.remote.download

    def spy(digest: str, dest: Path, *args: Any, **kw: Any) -> Any:
        downloads.append(str(dest))
        return real_download(digest, dest, *args, **kw)

    monkeypatch.setattr(b.remote, "download", spy)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            r = b.get(key)
            assert isinstance(r, Miss) and r.kind == "absent"
    # Refused before anything is fetched or written through the link...
    assert downloads == [] and list(outside.iterdir()) == []
    # ... said once, naming the link; the remote entry is not at fault, so this node
    # does not take it as refused (its own upload gets no right to replace it).
    warned = remote_warnings(caplog)
    assert len(warned) == 1 and str(tmp) in warned[0] and "symlink" in warned[0], warned
    assert "not downloading" in warned[0]
    assert key.digest not in b._replace
    assert b.stats()["misses"] == {}  # get counts no miss: its caller does, once a lookup


def test_purge_keeps_the_chunks_of_an_upload_in_flight(
        tmp_path: Path, srv: RedisServer, child_env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    old = make_key({"purged": "old"})
    shared = os.urandom(5000)
    a = tiered(tmp_path / "a", srv.url(chunk="1K"))
    a.put(old, {"w.bin": shared})
    assert a.flush(10)
    # The new upload shares a blob with an entry the purge removes (dedup: no chunks of
    # its own for it) and writes a blob of its own; it stops before its record.
    key = make_key({"upload": "in flight"})
    reached, go = _pause_after(monkeypatch, "set marker")
    a.put(key, {"own.bin": os.urandom(5000), "shared.bin": shared})
    assert reached.wait(10)
    env = dict(child_env, CACHECOMPILE_REMOTE=srv.url(), CACHECOMPILE_TRUST_REMOTE="1")
    p = cachectl(env, "remote", "purge", "--all", "--yes")  # a second process
    assert p.returncode == 0 and "removed 1 entry" in p.stdout, (p.stdout, p.stderr)
    go.set()
    assert a.flush(10)
    hit = tiered(tmp_path / "b", srv.url()).get(key)
    assert isinstance(hit, Hit)
    assert hit.entry.files["shared.bin"].read_bytes() == shared


def test_push_repairs_with_the_right_key_only(tmp_path: Path, srv: RedisServer,
                                              child_env: dict[str, str]) -> None:
    local = store.open_store(tmp_path / "a")
    unsigned, wrong, good = (make_key({"push": n}) for n in ("unsigned", "wrong", "good"))
    entries = {k: local.put(k, {"f": k.digest.encode()}) for k in (unsigned, wrong, good)}
    RedisRemote(srv.url(), trust=Trust()).upload(entries[unsigned])
    RedisRemote(srv.url(), trust=Trust(key=b"not-the-fleet-key")).upload(entries[wrong])
    RedisRemote(srv.url(), trust=Trust(key=KEY_A.encode())).upload(entries[good])
    kept = _record_bytes(srv, good)
    env = dict(child_env, CACHECOMPILE_REMOTE=srv.url())
    # Without the key, even --force leaves signed records alone.
    p = cachectl(env, "push", "--cache-dir", str(tmp_path / "a"), "--force")
    assert p.returncode == 0 and "kept 2 signed records" in p.stdout, (p.stdout, p.stderr)
    assert _verifies(srv, wrong, "not-the-fleet-key") and _record_bytes(srv, good) == kept
    # With the key, push repairs what does not verify under it, without --force.
    p = cachectl(dict(env, CACHECOMPILE_SIGNING_KEY=KEY_A), "push", "--cache-dir",
                 str(tmp_path / "a"))
    assert p.returncode == 0, p.stderr
    assert all(_verifies(srv, k, KEY_A) for k in (unsigned, wrong, good))
    assert _record_bytes(srv, good) == kept
    assert "pushed 2 to" in p.stdout and "replaced 2 records" in p.stdout, p.stdout


def test_record_states_and_who_may_replace_them(tmp_path: Path, srv: RedisServer) -> None:
    entry = store.open_store(tmp_path / "a").put(make_key({"states": 1}), {"f": b"states"})
    d = entry.key
    keyed = RedisRemote(srv.url(), trust=Trust(key=KEY_A.encode()))
    other = RedisRemote(srv.url(), trust=Trust(key=b"not-the-fleet-key"))
    plain = RedisRemote(srv.url(), trust=Trust(accept_unsigned=True))
    signed = make_record(entry.manifest, {"f": "a" * 64}, {}, keyed.trust).to_bytes()
    unsigned = make_record(entry.manifest, {"f": "a" * 64}, {}, plain.trust).to_bytes()
    # A newer format we cannot parse is still signed; a signed record moved here from
    # another key is not a record of this entry.
    newer = json.loads(signed)
    newer["body"] = newer["body"].replace('"format":1', '"format":2')
    newer["sig"] = keyed.trust.sign(newer["body"].encode())
    moved = json.loads(signed)
    moved["body"] = moved["body"].replace(d, "f" * 32)
    moved["sig"] = keyed.trust.sign(moved["body"].encode())
    cases = {"absent": None, "garbage": b"\x00 not json", "unsigned": unsigned,
             "signed": signed, "newer": json.dumps(newer).encode(),
             "moved": json.dumps(moved).encode()}
    seen = {name: (record_state(keyed.trust, d, raw), record_state(other.trust, d, raw), record_state(plain.trust, d, raw))
            for name, raw in cases.items()}
    assert seen == {"absent": ("absent",) * 3, "garbage": ("malformed",) * 3,
                    "unsigned": ("unsigned",) * 3, "signed": ("ours", "foreign", "foreign"),
                    "newer": ("ours", "foreign", "foreign"), "moved": ("malformed",) * 3}
    for r in (keyed, other, plain):
        assert may_replace(r.trust, "absent", overwrite=False, repair=False)
        assert may_replace(r.trust, "malformed", overwrite=False, repair=False)
        assert not may_replace(r.trust, "ours", overwrite=False, repair=True)
        assert may_replace(r.trust, "ours", overwrite=True, repair=False)
    assert may_replace(keyed.trust, "unsigned", overwrite=False, repair=False)
    assert not may_replace(plain.trust, "unsigned", overwrite=False, repair=False)
    assert may_replace(plain.trust, "unsigned", overwrite=True, repair=False)
    assert not may_replace(keyed.trust, "foreign", overwrite=True, repair=False)
    assert may_replace(keyed.trust, "foreign", overwrite=False, repair=True)
    assert not may_replace(plain.trust, "foreign", overwrite=True, repair=True)


def test_a_key_rotation_loses_no_hit(tmp_path: Path, srv: RedisServer,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet signs with OLD. Step 1: every node adds NEW to its verify keys. Step 2:
    # the signers switch to NEW (OLD still verifies). Step 3: `cachectl push --resign`
    # re-signs what OLD signed. Step 4: OLD is retired. No node misses at any step.
    old, new = "fleet-signing-key-2025", "fleet-signing-key-2026"
    key = make_key({"model": "m", "rot": 1})
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", old)
    a = tiered(tmp_path / "a", srv.url())
    a.put(key, FILES, labels={"model": "m"})
    assert a.flush(10)

    def node(name: str, signing: str, verify: str = "") -> TieredStore:
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", signing)
        monkeypatch.setenv("CACHECOMPILE_VERIFY_KEYS", verify)
        return tiered(tmp_path / name, srv.url())

    assert isinstance(node("step1", old, new).get(key), Hit)
    switched = node("step2", new, old)
    assert isinstance(switched.get(key), Hit)          # OLD's record, verified by OLD
    raw = switched.remote.read_record(key.digest)  # type: ignore[attr-defined]
    assert raw is not None and record_state(switched.remote.trust, key.digest, raw[0]) \
        == "trusted"
    # Without the old key a node on NEW alone misses: what the rotation must avoid.
    assert isinstance(node("too-early", new).get(key), Miss)

    env = dict(os.environ, CACHECOMPILE_SIGNING_KEY=new, CACHECOMPILE_VERIFY_KEYS=old,
               CACHECOMPILE_REMOTE=srv.url(), CACHECOMPILE_DIR=str(tmp_path / "step2"))
    p = subprocess.run([sys.executable, "-m", "cachecompile.cli.main", "push", "--resign"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "re-signed 1 record" in p.stdout, p.stdout + p.stderr
    # Step 4: OLD retired everywhere; a fresh node on NEW alone hits.
    assert isinstance(node("step4", new).get(key), Hit)
    # A node that still has only OLD now refuses the record: retire OLD everywhere first.
    assert isinstance(node("straggler", old).get(key), Miss)


class _TrickleProxy:
    """A TCP proxy to a real server that sends the server's answers on a byte every
    0.2 s (a failing link, a server that means harm); requests go through at once."""

    def __init__(self, port: int) -> None:
        import socket

        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0.2), daemon=True).start()

    def _pipe(self, src: Any, dst: Any, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if not delay:
                    dst.sendall(data)
                    continue
                for i in range(len(data)):
                    if self.stop.is_set():
                        return
                    dst.sendall(data[i:i + 1])
                    time.sleep(delay)
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_trickling_redis_costs_a_lookup_its_deadline_and_trips_the_breaker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A socket timeout bounds each read, so answers trickled a byte at a time kept a
    lookup waiting as long as the server liked (issue 62): the whole command is bounded
    now, and the breaker keeps the process local after it."""
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    srv = RedisServer(tmp_path / "redis").start()
    proxy = _TrickleProxy(srv.port)
    try:
        st = tiered(tmp_path / "a", f"redis://127.0.0.1:{proxy.port}/0?timeout=1")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert isinstance(st.get(make_key({"slow": 1})), Miss)
            assert isinstance(st.get(make_key({"slow": 2})), Miss)  # the breaker: no wait
        took = time.monotonic() - t0
        assert took < 8, took
        warned = remote_warnings(caplog)
        assert len(warned) == 1 and "no answer in" in warned[0], warned
    finally:
        proxy.close()
        srv.stop()
