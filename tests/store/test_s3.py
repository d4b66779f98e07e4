"""The S3 tier against a real S3-compatible server (moto's server mode, tests/s3_util.py):
backfill, dedup, conditional record writes, racing uploaders, a server killed
mid-download, a bucket that refuses writes (IAM), cachectl's remote verbs, a missing
client library. tests/procs/test_remote_procs.py runs cache_compile across fresh
processes on it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import ccutil
import pytest
from s3_util import MotoServer

from cachecompile import store
from cachecompile.store import Hit, Miss, make_key
from cachecompile.store.errors import RemoteConfigError, RemoteError
from cachecompile.store.remote import RemoteConfig, S3Remote
from cachecompile.store.signing import Trust
from cachecompile.store.tiered import TieredStore

FLEET_KEY = "fleet-secret-key-s3"
FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 40, "code/out.py": b"x = 1\n",
         "empty": b""}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    srv = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield srv
    srv.stop()


@pytest.fixture
def bucket(server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_TRUST_REMOTE", "CACHECOMPILE_DIR",
                "CACHECOMPILE_READONLY", "CACHECOMPILE_VERIFY_KEYS", "AWS_ENDPOINT_URL_S3",
                "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
    return server.bucket()


def tiered(root: Path, url: str) -> TieredStore[store.Store]:
    st = store.open_store(root, remote=url)
    assert isinstance(st, TieredStore)
    return st


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("cachecompile.store") and r.levelno >= logging.WARNING]


def cachectl(*args: str, env: dict[str, str]) -> ccutil.Ran:
    return ccutil.cachectl(*args, env={**os.environ, **env})


def test_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    c = RemoteConfig.parse("s3://models-cache/team/a?mode=ro&lease=30")
    assert (c.kind, c.target, c.prefix, c.readonly, c.lease, c.timeout) == (
        "s3", "models-cache", "team/a", True, 30.0, 5.0)
    assert c.display == "s3://models-cache/team/a"
    assert RemoteConfig.parse("s3://models-cache").prefix == "cachecompile"
    for bad, why in (("s3://ab/p", "3 characters"), ("s3://bkt/p?region=x", "AWS_"),
                     ("s3://bkt/p?prefix=x", "URL's path"), ("s3://u:pw@bkt/p", "bucket"),
                     ("gs://bkt/p", "s3://")):
        with pytest.raises(RemoteConfigError, match=why) as e:
            RemoteConfig.parse(bad)
        assert "pw" not in str(e.value)


def test_publish_on_one_node_hits_on_another(tmp_path: Path, server: MotoServer,
                                             bucket: str) -> None:
    url = f"s3://{bucket}/fleet"
    a = tiered(tmp_path / "a", url)
    k1, k2 = make_key({"model": "m", "n": 1}), make_key({"model": "m", "n": 2})
    a.put(k1, FILES, labels={"model": "m"}, meta={"compile_s": 1.0})
    a.put(k2, {"same-bytes.so": FILES["kernel.so"], "small": b"s"})
    assert a.flush(20)
    objs = server.objects(bucket, "fleet/v1/")
    kinds = sorted(k.split("/")[2] for k in objs)
    # Two records; the kernel's bytes stored once for both entries (dedup by SHA-256).
    assert kinds.count("entry") == 2 and kinds.count("blob") == 4, objs
    assert f"fleet/v1/entry/{k1.digest}" in objs

    b = tiered(tmp_path / "b", url)
    hit = b.get(k1)
    assert isinstance(hit, Hit) and hit.entry.path.is_relative_to(tmp_path / "b")
    assert {n: p.read_bytes() for n, p in hit.entry.files.items()} == FILES
    assert hit.entry.labels == {"model": "m"} and hit.entry.meta == {"compile_s": 1.0}
    assert b.flush(5) and b.uploader is not None and b.uploader.uploaded == 0
    assert isinstance(b.get(make_key({"other": 1})), Miss)
    # A node that does not hold the fleet's key refuses the signed entry.
    os.environ["CACHECOMPILE_SIGNING_KEY"] = "another-fleet-key"
    assert isinstance(tiered(tmp_path / "c", url).get(k1), Miss)


def test_the_record_is_written_only_if_it_is_still_the_one_judged(bucket: str) -> None:
    r = S3Remote(f"s3://{bucket}/cas", trust=Trust(key=FLEET_KEY.encode()))
    assert r.write_record("d" * 32, b"first", None)
    assert not r.write_record("d" * 32, b"second", None)  # If-None-Match: * -> 412
    got = r.read_record("d" * 32)
    assert got is not None and got[0] == b"first"
    assert r.write_record("d" * 32, b"third", got[1])  # If-Match: the ETag judged
    assert not r.write_record("d" * 32, b"fourth", got[1])  # that ETag is stale now
    final = r.read_record("d" * 32)
    assert final is not None and final[0] == b"third"


def test_two_nodes_racing_to_upload_the_same_entries(tmp_path: Path, server: MotoServer,
                                                     bucket: str) -> None:
    url = f"s3://{bucket}/race"
    keys = [make_key({"race": i}) for i in range(24)]
    for node in ("a", "b"):
        local = store.open_store(tmp_path / node, remote="")
        for i, k in enumerate(keys):
            local.put(k, {"k.so": FILES["kernel.so"] + bytes([i]), "shared": b"common"})
    env = {**server.env(), "CACHECOMPILE_SIGNING_KEY": FLEET_KEY}
    procs = [subprocess.Popen([sys.executable, "-m", "cachecompile.cli.main", "push",
                               "--cache-dir", str(tmp_path / node), "--remote", url],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env}) for node in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    pushed = [int(o.split("pushed ")[1].split()[0]) for o, _ in outs]
    # Each record written exactly once: a node that lost a race read the winner's record
    # and kept it (a blind overwrite would count it twice).
    assert sum(pushed) == len(keys), outs
    r = S3Remote(url, trust=Trust(key=FLEET_KEY.encode()))
    assert sorted(rec.key for rec in r.records()) == sorted(k.digest for k in keys)
    c = tiered(tmp_path / "c", url)
    for i, k in enumerate(keys):
        hit = c.get(k)
        assert isinstance(hit, Hit) and hit.entry.files["k.so"].read_bytes()[-1] == i


def test_a_server_killed_mid_download_is_a_local_miss_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    srv = MotoServer(tmp_path / "moto").start()
    try:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
        url = f"s3://{srv.bucket()}/kill?timeout=10"
        key = make_key({"big": 1})
        a = tiered(tmp_path / "a", url)
        a.put(key, {"weights.bin": os.urandom(96 * 1024**2)})
        assert a.flush(60)

        b = tiered(tmp_path / "b", url)
        staging = tmp_path / "b" / "v1" / "tmp"
        killed = threading.Event()

        def kill_when_half_there() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not killed.is_set():
                for f in staging.rglob("*"):
                    try:
                        if f.is_file() and f.stat().st_size > 8 * 1024**2:
                            srv.kill()
                            killed.set()
                            return
                    except OSError:
                        pass
                time.sleep(0.002)

        watcher = threading.Thread(target=kill_when_half_there)
        watcher.start()
        with caplog.at_level(logging.WARNING):
            out = b.get(key)
        killed.set()
        watcher.join()
        assert srv.proc is None, "the download finished before the server was killed"
        assert isinstance(out, Miss)
        assert len(warnings_of(caplog)) == 1, warnings_of(caplog)
        assert "continuing local-only" in warnings_of(caplog)[0]
        # Nothing half-downloaded is left, and nothing was published.
        assert list(staging.iterdir()) == [] and list(b.entries()) == []
        t0 = time.monotonic()
        assert isinstance(b.get(key), Miss) and time.monotonic() - t0 < 0.5  # the breaker
    finally:
        srv.stop()


def test_a_bucket_that_refuses_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    # IAM is enforced after the 7 setup requests: a bucket, then two users (3 each).
    srv = MotoServer(tmp_path / "moto", auth_after=7).start()
    try:
        name = srv.bucket()
        writer = srv.user("writer", name, ["s3:*"])
        reader = srv.user("reader", name, ["s3:GetObject", "s3:ListBucket"])
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
        url = f"s3://{name}/team"
        for k, v in srv.env(writer).items():
            monkeypatch.setenv(k, v)
        key = make_key({"ro": 1})
        a = tiered(tmp_path / "a", url)
        a.put(key, FILES)
        assert a.flush(20) and a.uploader is not None and a.uploader.uploaded == 1

        for k, v in srv.env(reader).items():
            monkeypatch.setenv(k, v)
        b = tiered(tmp_path / "b", url)
        assert isinstance(b.get(key), Hit)  # reads are allowed
        with caplog.at_level(logging.WARNING):
            b.put(make_key({"ro": 2}), FILES)  # the local publish works ...
            assert b.flush(20) is False  # drained; the upload was refused
        # ... and the refused upload is one warning that says why; no raw exception.
        assert b.uploader is not None and b.uploader.failed == 1
        ws = warnings_of(caplog)
        assert len(ws) == 1 and "PermissionDenied" in ws[0], ws
        assert isinstance(b.get(make_key({"ro": 2})), Hit)
        p = cachectl("push", "--cache-dir", str(tmp_path / "b"), "--remote", url,
                     env={**srv.env(reader), "CACHECOMPILE_SIGNING_KEY": FLEET_KEY})
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        assert "PermissionDenied" in p.stderr, p.stderr
    finally:
        srv.stop()


def test_cachectl_push_pull_ls_stats_and_purge(tmp_path: Path, server: MotoServer,
                                               bucket: str) -> None:
    env = {**server.env(), "CACHECOMPILE_SIGNING_KEY": FLEET_KEY}
    local = store.open_store(tmp_path / "a", remote="")
    keys = [make_key({"cli": i}) for i in range(3)]
    for i, k in enumerate(keys):
        local.put(k, {"k.so": bytes([i]) * 1000, "shared": b"common"},
                  labels={"model": "m" if i else "other"})
    # A lease no loaded machine outruns between two commands: the test moves the clock.
    url = f"s3://{bucket}/cli?lease=600"
    p = cachectl("push", "--cache-dir", str(tmp_path / "a"), "--remote", url, env=env)
    assert p.returncode == 0 and "pushed 3 to" in p.stdout, p.stderr
    p = cachectl("push", "--cache-dir", str(tmp_path / "a"), "--remote", url, env=env)
    assert "pushed 0 to" in p.stdout and "3 were there already" in p.stdout, p.stdout
    p = cachectl("remote", "ls", "--json", "--remote", url, env=env)
    assert p.returncode == 0 and p.stdout.count('"key"') == 3, p.stdout + p.stderr
    p = cachectl("remote", "stats", "--remote", url, env=env)
    assert p.returncode == 0 and "stored objects" in p.stdout, p.stdout + p.stderr
    p = cachectl("pull", "--cache-dir", str(tmp_path / "c"), "--remote", url,
                 "--model", "m", env=env)
    assert p.returncode == 0 and "pulled 2 entries" in p.stdout, p.stdout + p.stderr
    assert len(list(store.open_store(tmp_path / "c", remote="").entries())) == 2

    # Purge right after an upload: the records go, the blobs stay while pinned.
    p = cachectl("push", "--force", "--cache-dir", str(tmp_path / "a"), "--remote", url,
                 env=env)
    assert "pushed 3 to" in p.stdout, p.stdout + p.stderr
    p = cachectl("remote", "purge", "--model", "other", "-y", "--remote", url, env=env)
    assert "removed 1 entry; swept 0" in p.stdout, p.stdout + p.stderr
    assert len([k for k in server.objects(bucket, "cli/v1/entry/")]) == 2
    # Once the pins' lease has run out (the remote's clock moved on, not slept through):
    # only the purged entry's own blob goes; "common" is still used by the
    # other two.
    later = tiered(tmp_path / "e", url).remote
    assert isinstance(later, S3Remote)
    later.clock = lambda: time.time() + 601
    assert later.sweep() == 1
    assert server.objects(bucket, "cli/v1/pin/") == {}  # stale pins are swept too
    hit = tiered(tmp_path / "d", url).get(keys[1])
    assert isinstance(hit, Hit)


def test_without_the_client_library_the_extra_is_named(
        tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    for mod in ("obstore", "obstore.store", "obstore.exceptions", "obstore._obstore"):
        monkeypatch.setitem(sys.modules, mod, None)
    from cachecompile.store.remote import s3

    monkeypatch.setattr(s3, "_native_mod", None)  # as in a process that never loaded it
    r = S3Remote(f"s3://{bucket}/x")
    with pytest.raises(RemoteError, match=r"pip install 'cachecompile\[s3\]'"):
        r.ping()
    caplog.clear()
    st = tiered(tmp_path / "a", f"s3://{bucket}/x")
    with caplog.at_level(logging.WARNING):
        assert isinstance(st.get(make_key({"n": 1})), Miss)
        st.put(make_key({"n": 1}), FILES)  # still publishes locally
    assert isinstance(st.get(make_key({"n": 1})), Hit)
    ws = warnings_of(caplog)
    assert len(ws) == 1 and "obstore" in ws[0], ws


@pytest.mark.parametrize("what", ["endpoint", "metadata service"])
def test_a_server_that_never_answers_costs_a_bounded_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        what: str) -> None:
    # Accepts connections and never answers: the S3 endpoint, or (no AWS keys set) the
    # instance metadata service the client asks for credentials. A first lookup took
    # minutes (245 s with the metadata service); now it gives up within 2 x timeout + 1 s,
    # once, with one warning; the breaker makes the next lookup quick.
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    hanging = f"http://127.0.0.1:{listener.getsockname()[1]}"
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    if what == "endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", hanging)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", hanging)
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    try:
        st = tiered(tmp_path / "a", "s3://hangs/x?timeout=1")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert isinstance(st.get(make_key({"n": 1})), Miss)
            assert isinstance(st.get(make_key({"n": 2})), Miss)  # the breaker: no wait
        assert time.monotonic() - t0 < 6, time.monotonic() - t0
        ws = warnings_of(caplog)
        assert len(ws) == 1 and "continuing local-only" in ws[0], ws
        if what == "metadata service":
            assert "no AWS credentials were found" in ws[0], ws
    finally:
        listener.close()


def test_a_missing_bucket_is_named(tmp_path: Path, server: MotoServer, bucket: str,
                                   caplog: pytest.LogCaptureFixture) -> None:
    st = tiered(tmp_path / "a", "s3://no-such-bucket-here/x")
    with caplog.at_level(logging.WARNING):
        assert isinstance(st.get(make_key({"n": 1})), Miss)
    ws = warnings_of(caplog)
    assert len(ws) == 1 and "bucket 'no-such-bucket-here' does not exist" in ws[0], ws
    p = cachectl("remote", "ls", "--remote", "s3://no-such-bucket-here/x",
                 env={**server.env(), "CACHECOMPILE_SIGNING_KEY": FLEET_KEY})
    # One line, as every cachectl error: no warning beside it, no XML.
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 7 and len(lines) == 1, p.stderr
    assert "does not exist" in lines[0] and "<?xml" not in lines[0], lines
