"""The HTTP tier (bazel-remote's /ac/ + /cas/ layout) against real servers on loopback:
nginx with its WebDAV modules and WsgiDAV (tests/http_util.py).

Gradle's rules for answers: GET 200/404, PUT 2xx/413; anything else turns the tier off
for the process with one warning (the breaker every tier has). A password never shows.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ccutil import cachectl
from http_util import NginxServer, WsgiDavServer
from tier_util import clean_remote_env, store_warnings, tiered

from cachecompile import store
from cachecompile.store import Hit, Miss, make_key
from cachecompile.store.remote import HttpRemote
from cachecompile.store.remote.http import ac_name
from cachecompile.store.signing import Trust
from cachecompile.store.tiered import TieredStore

KEY = "fleet-secret-key-for-http"
SECRET = "S3cret/Pa#ss?w@rd"
FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 40, "code/out.py": b"x = 1\n",
         "empty": b""}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_remote_env(monkeypatch)


@pytest.fixture(params=["nginx", "wsgidav"])
def srv(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    s = (NginxServer if request.param == "nginx" else WsgiDavServer)(tmp_path / "srv").start()
    yield s
    s.stop()




def test_two_nodes_share_entries_byte_exact(tmp_path: Path, srv: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    url = srv.url("team/cc")
    a = tiered(tmp_path / "a", url)
    key = make_key({"model": "m", "n": 1})
    a.put(key, FILES, labels={"model": "m"})
    assert a.flush(20) and a.uploader is not None and a.uploader.uploaded == 1
    # bazel-remote's layout: the record under /ac/, every file under /cas/<its SHA-256>.
    assert (srv.data / "team" / "cc" / "ac" / ac_name(key.digest)).is_file()
    assert len(list((srv.data / "team" / "cc" / "cas").iterdir())) == 3
    b = tiered(tmp_path / "b", url)
    hit = b.get(key)
    assert isinstance(hit, Hit) and hit.entry.path.is_relative_to(tmp_path / "b")
    assert {n: p.read_bytes() for n, p in hit.entry.files.items()} == FILES
    assert b.stats()["hits_remote_levels"] == {url: 1}
    assert isinstance(b.get(make_key({"other": 1})), Miss)  # a 404 is a plain miss
    assert not b.remote.breaker.down
    c = tiered(tmp_path / "c", url)
    c.put(key, FILES)
    assert c.flush(20) and c.uploader is not None and c.uploader.uploaded == 0


def test_unsigned_records_need_an_opt_in_and_are_never_replaced(
        tmp_path: Path, srv: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    url = srv.url()
    a = tiered(tmp_path / "a", url)
    key = make_key({"unsigned": 1})
    a.put(key, FILES)
    assert a.flush(20)
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    k = tiered(tmp_path / "k", url)
    with caplog.at_level(logging.WARNING):
        assert isinstance(k.get(key), Miss)
    assert [w for w in store_warnings(caplog) if "not signed" in w]
    # HTTP has no compare-and-set: the keyed node's upload keeps the record (and says why).
    k.put(key, FILES)
    assert k.flush(20) and k.uploader is not None and k.uploader.uploaded == 0
    monkeypatch.delenv("CACHECOMPILE_SIGNING_KEY")
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    assert isinstance(tiered(tmp_path / "t", url).get(key), Hit)


def test_cachectl_remote_verbs(tmp_path: Path, srv: Any) -> None:
    env = {**os.environ, "CACHECOMPILE_TRUST_REMOTE": "1", "CACHECOMPILE_REMOTE": srv.url()}
    local = store.open_store(tmp_path / "local", remote="")
    for i in range(3):
        local.put(make_key({"verb": i}), {"f": os.urandom(100)}, labels={"model": f"m{i}"})
    r = cachectl("push", "--cache-dir", str(tmp_path / "local"), env=env)
    assert r.returncode == 0 and "pushed 3 to" in r.stdout, r
    r = cachectl("remote", "ls", "--json", env=env)  # WebDAV PROPFIND
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 3, r
    r = cachectl("remote", "stats", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["entries"] == 3, r
    r = cachectl("remote", "purge", "--model", "m0", "--yes", env=env)  # WebDAV DELETE
    assert r.returncode == 0 and "removed 1 entry" in r.stdout, r
    r = cachectl("pull", "--cache-dir", str(tmp_path / "node"), env=env)
    assert r.returncode == 0 and "pulled 2 entries" in r.stdout, r


def test_413_skips_one_entry_and_any_other_answer_turns_the_tier_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    small = NginxServer(tmp_path / "small", max_body="2k").start()
    try:
        st = tiered(tmp_path / "a", small.url())
        with caplog.at_level(logging.WARNING):
            st.put(make_key({"big": 1}), {"w.bin": os.urandom(8192)})
            st.put(make_key({"small": 1}), {"w.bin": b"fits"})
            assert st.flush(20) is False  # drained, but one entry is not shared
        assert st.uploader is not None and (st.uploader.failed, st.uploader.uploaded) == (1, 1)
        assert store_warnings(caplog) == [] and not st.remote.breaker.down
    finally:
        small.stop()
    guarded = NginxServer(tmp_path / "guarded", password=SECRET).start()
    try:
        caplog.clear()
        anonymous = tiered(tmp_path / "b", guarded.url())
        with caplog.at_level(logging.DEBUG):
            for i in range(5):
                assert isinstance(anonymous.get(make_key({"i": i})), Miss)
        warned = store_warnings(caplog)
        assert len(warned) == 1 and "401" in warned[0], warned
        assert anonymous.remote.breaker.down and anonymous.remote.breaker.failures == 1
        # With the password (Basic, from the variable), the same server serves.
        monkeypatch.setenv("CACHECOMPILE_REMOTE_PASSWORD", SECRET)
        user_url = guarded.url().replace("http://", "http://fleet@")
        w = tiered(tmp_path / "w", user_url)
        w.put(make_key({"auth": 1}), FILES)
        assert w.flush(20) and w.uploader is not None and w.uploader.uploaded == 1
        assert isinstance(tiered(tmp_path / "r", user_url).get(make_key({"auth": 1})), Hit)
        env = {**os.environ, "CACHECOMPILE_REMOTE": user_url}
        for verb in (["remote", "ls"], ["remote", "stats"]):
            r = cachectl(*verb, env=env)
            assert r.returncode == 0 and SECRET not in r.stdout + r.stderr, r
        r = cachectl("remote", "ls", env={**env, "CACHECOMPILE_REMOTE_PASSWORD": "wrong"})
        assert r.returncode == 7 and "401" in r.stderr and "wrong" not in r.stderr, r
    finally:
        guarded.stop()
    assert SECRET not in caplog.text and "wrong" not in caplog.text


def test_a_forked_child_makes_its_own_connection(tmp_path: Path, srv: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    url = srv.url()
    a = tiered(tmp_path / "a", url)
    keys = [make_key({"fork": i}) for i in range(3)]
    for k in keys:
        a.put(k, {"f": os.urandom(3000)})
    assert a.flush(20)
    remote = HttpRemote(url, trust=Trust(accept_unsigned=True))
    want = {k.digest: remote.read_record(k.digest) for k in keys}  # the parent's connection
    b = tiered(tmp_path / "b", url)
    assert isinstance(b.get(keys[0]), Hit)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # Parent and child both talk at once: on a shared socket the answers would
            # interleave; each must get its own, whole.
            ok = all(remote.read_record(d) == want[d] for _ in range(30) for d in want)
            ok = ok and isinstance(b.get(keys[1]), Hit)
            code = 0 if ok else 1
        finally:
            os._exit(code)
    ok = all(remote.read_record(d) == want[d] for _ in range(30) for d in want)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and ok
    assert isinstance(b.get(keys[2]), Hit)


def test_https_with_the_fleets_own_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    srv = NginxServer(tmp_path / "tls", tls=True).start()
    try:
        url = srv.url("cc")
        assert url.startswith("https://")
        # Not trusted yet: the certificate is refused (one warning), nothing sent.
        with caplog.at_level(logging.WARNING):
            assert isinstance(tiered(tmp_path / "x", url).get(make_key({"tls": 0})), Miss)
        warned = store_warnings(caplog)
        assert len(warned) == 1 and "CERTIFICATE_VERIFY_FAILED" in warned[0], warned
        monkeypatch.setenv("SSL_CERT_FILE", str(srv.cert))
        a = tiered(tmp_path / "a", url)
        key = make_key({"tls": 1})
        a.put(key, FILES)
        assert a.flush(20) and a.uploader is not None and a.uploader.uploaded == 1
        hit = tiered(tmp_path / "b", url).get(key)
        assert isinstance(hit, Hit)
        assert {n: p.read_bytes() for n, p in hit.entry.files.items()} == FILES
    finally:
        srv.stop()


_POOL_TIER: TieredStore | None = None


def _pool_lookup(digest: str) -> bool:
    assert _POOL_TIER is not None
    return isinstance(_POOL_TIER.get(digest), Hit)


def test_a_forked_pool_after_a_first_call(tmp_path: Path, srv: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    global _POOL_TIER
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    url = srv.url()
    a = tiered(tmp_path / "a", url)
    keys = [make_key({"pool": i}) for i in range(6)]
    for k in keys:
        a.put(k, {"f": os.urandom(2000)})
    assert a.flush(20)
    _POOL_TIER = tiered(tmp_path / "b", url)
    try:
        assert _pool_lookup(keys[0].digest)  # the parent's first call opens its connection
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map(_pool_lookup, [k.digest for k in keys[1:]]) == [True] * 5
        assert _pool_lookup(keys[1].digest) and not _POOL_TIER.remote.breaker.down
    finally:
        _POOL_TIER = None


class _Trickle(http.server.BaseHTTPRequestHandler):
    """Answers every request at once, then its body a byte every 0.3 s (a server behind a
    failing link, or one that means harm): each read is quick, the whole is not."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "677")
        self.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(677):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.3)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("scheme", ["http", "oci"])
def test_a_trickling_server_costs_a_lookup_its_timeout_and_trips_the_breaker(
        tmp_path: Path, scheme: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The timeout bounds every socket read; a record sent a byte every 0.3 s kept a lookup
    (and the first cache_compile call on its thread) waiting minutes (issue 62). The whole
    request is bounded by ``timeout``; then the breaker keeps the process local. The OCI
    registry tier shares the HTTP tier's requests: the same bound."""
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        st = tiered(tmp_path / "a",
                    f"{scheme}://127.0.0.1:{server.server_address[1]}/cc?timeout=1")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert isinstance(st.get(make_key({"slow": 1})), Miss)
            assert isinstance(st.get(make_key({"slow": 2})), Miss)  # the breaker: no wait
        took = time.monotonic() - t0
        assert took < 5, took
        warned = store_warnings(caplog)
        assert len(warned) == 1 and "no whole answer in 1 s" in warned[0], warned
        assert st.remote.breaker.down
    finally:
        server.shutdown()
        server.server_close()
