"""Records an operator can repair (issue 50): a torn or malformed record, and unsigned
ones, are rows of ``cachectl remote ls``, and one ``cachectl`` command removes them; a
keyed ``push`` writes over a record it proves malformed, even on a server without
conditional puts (s3rver), never over one a node could load.

On each tier (redis-server, moto, s3rver, a shared directory, nginx's WebDAV), the
garbage is written to the record's key, object or file directly, as a torn write, a tool
or a bug leaves it. Where a server cannot compare and set (s3rver, HTTP), only a keyed
push writes over a malformed record (after reading it again); on the others (Redis's
script, S3's conditional put, file://'s atomic rename) any upload replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ccutil import cachectl
from tier_util import remote_tier, tiered

from cachecompile import store
from cachecompile.store import Hit, make_key
from cachecompile.store.remote import open_remote
from cachecompile.store.remote.http import ac_name
from cachecompile.store.signing import Trust

FLEET_KEY = "fleet-secret-key-for-repairs"
FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 8, "out.py": b"x = 1\n"}
GARBAGE = "0f" * 16  # a record under a digest no entry has: b"\x00garbage"
# Servers that cannot compare and set: only a keyed push writes over a malformed record.
NO_CAS = ("s3rver", "http")


class Server:
    """One real server of a tier, its URL, and a way to write a record's raw bytes."""

    def __init__(self, kind: str, srv: Any, env: dict[str, str]) -> None:
        self.kind = kind
        self.srv = srv
        self.url = env.pop("CACHECOMPILE_REMOTE")
        self.env = env
        self.bucket = self.url[len("s3://"):].split("/")[0] if kind != "redis" else ""
        self.kind = "http" if kind == "wsgidav" else kind  # the same tier, another server

    def write_raw(self, digest: str, data: bytes) -> None:
        """Put ``data`` where the record of ``digest`` lives, with no check at all."""
        if self.kind == "redis":
            self.srv.client().set(f"cachecompile:v1:entry:{digest}", data)
            return
        if self.kind == "file":
            where = self.srv.a / "cc" / "v1" / "entry" / digest[:2]
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
            (where / digest).write_bytes(data)
            (where / digest).chmod(0o600)
            return
        if self.kind == "http":
            req = urllib.request.Request(f"{self.url}/ac/{ac_name(digest)}", data=data,
                                         method="PUT")
            urllib.request.urlopen(req, timeout=10).close()
            return
        self._s3_put(f"v1/entry/{digest}", data)

    def write_blob(self, sha: str, data: bytes) -> None:
        """Put ``data`` where blob ``sha`` lives, as a PUT cut short or a tool leaves it."""
        if self.kind == "file":
            (path,) = [p for p in (self.srv.a / "cc").rglob(sha) if p.parent.parent.name == "blob"]
            path.write_bytes(data)
        elif self.kind == "http":
            req = urllib.request.Request(f"{self.url}/cas/{sha}", data=data, method="PUT")
            urllib.request.urlopen(req, timeout=10).close()
        else:
            self._s3_put(f"v1/blob/{sha}", data)

    def _s3_put(self, key: str, data: bytes) -> None:
        import obstore
        from obstore.store import S3Store

        keys = self.env
        st = S3Store(self.bucket, prefix="fleet", endpoint=keys["AWS_ENDPOINT_URL"],
                     region="us-east-1", access_key_id=keys["AWS_ACCESS_KEY_ID"],
                     secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
                     client_options={"allow_http": True})
        obstore.put(st, key, data)

    def raw(self, digest: str) -> bytes | None:
        got = open_remote(self.url, Trust(accept_unsigned=True)).read_record(digest)  # type: ignore[attr-defined]
        return None if got is None else bytes(got[0])

    def row(self, digest: str, data: bytes) -> str:
        """The key ``cachectl remote ls`` lists the malformed record ``data`` of
        ``digest`` under: its digest, but on HTTP (whose record names are hashes of the
        digest) only where the bytes still hold it, else the record's ``/ac/`` name."""
        if self.kind == "http" and digest.encode() not in data:
            return ac_name(digest)
        return digest


@pytest.fixture(params=["redis", "moto", "s3rver", "file", "http", "wsgidav"])
def server(request: pytest.FixtureRequest, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_TRUST_REMOTE", "CACHECOMPILE_SIGNING_KEY",
                "CACHECOMPILE_VERIFY_KEYS", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE",
                "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    kind = str(request.param)
    with remote_tier(tmp_path, kind) as (srv, env):
        server = Server(kind, srv, env)
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        yield server


def ctl(srv: Server, *args: str, key: bool = True) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECOMPILE_")}
    env.update(srv.env, CACHECOMPILE_REMOTE=srv.url)
    if key:
        env["CACHECOMPILE_SIGNING_KEY"] = FLEET_KEY
    r = cachectl(*args, env=env)
    return r.returncode, r.stdout, r.stderr


def rows(srv: Server, *flags: str) -> dict[str, dict[str, Any]]:
    rc, out, err = ctl(srv, "remote", "ls", "--json", *flags)
    assert rc == 0, out + err
    return {r["key"]: r for r in json.loads(out)}


def test_torn_malformed_and_unsigned_records_are_listed_and_purged(
        tmp_path: Path, server: Server) -> None:
    local = store.open_store(tmp_path / "a", remote="")
    keys = [make_key({"repair": i}) for i in range(3)]
    entries = [local.put(k, {**FILES, "n": bytes([i])}) for i, k in enumerate(keys)]
    keyed = open_remote(server.url, Trust(key=FLEET_KEY.encode()))
    keyless = open_remote(server.url, Trust(key=None))
    assert keyed.upload(entries[0]) and keyed.upload(entries[1])
    assert keyless.upload(entries[2])  # a racing keyless node's record: unsigned
    whole = server.raw(keys[0].digest)
    assert whole is not None
    server.write_raw(keys[0].digest, whole[: len(whole) // 2])  # torn mid-write
    server.write_raw(GARBAGE, b"\x00garbage")
    torn, garbage = (server.row(keys[0].digest, whole[: len(whole) // 2]),
                     server.row(GARBAGE, b"\x00garbage"))

    got = rows(server)
    assert {k: r["state"] for k, r in got.items()} == {
        torn: "malformed", garbage: "malformed", keys[1].digest: "signed",
        keys[2].digest: "unsigned"}
    assert got[garbage]["size_bytes"] == len(b"\x00garbage") and got[garbage]["problem"]
    assert set(rows(server, "--malformed")) == {torn, garbage}
    assert set(rows(server, "--unsigned")) == {keys[2].digest}
    rc, out, err = ctl(server, "remote", "ls")
    assert rc == 0 and "malformed" in out and "purge --malformed" in err, out + err
    rc, out, _ = ctl(server, "remote", "stats", "--json")
    assert rc == 0 and json.loads(out)["malformed"] == 2

    # One command removes both malformed records, and nothing else.
    rc, out, err = ctl(server, "remote", "purge", "--malformed", "--yes")
    assert rc == 0 and "removed 2 entries" in out, out + err
    assert {k: r["state"] for k, r in rows(server).items()} == {
        keys[1].digest: "signed", keys[2].digest: "unsigned"}
    # The unsigned record: one command too.
    rc, out, err = ctl(server, "remote", "purge", "--unsigned", "--yes")
    assert rc == 0 and "removed 1 entry" in out, out + err
    assert set(rows(server)) == {keys[1].digest}

    # A malformed record named by its key (a prefix of it), as `remote ls` shows it.
    server.write_raw(keys[1].digest, b"{\"body\": ")
    shown = server.row(keys[1].digest, b"{\"body\": ")
    assert rows(server)[shown]["state"] == "malformed"
    rc, out, err = ctl(server, "remote", "purge", shown[:12], "--yes")
    assert rc == 0 and "removed 1 entry" in out, out + err
    assert rows(server) == {}
    # The blobs no record references went with the sweep: a purge --all now finds nothing.
    rc, out, err = ctl(server, "remote", "purge", "--all", "--yes")
    assert rc == 0 and "removed 0 entries" in out, out + err


def test_a_keyed_push_replaces_a_record_it_proves_malformed(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """On every server, s3rver (no conditional puts) and HTTP included: a keyed ``cachectl
    push`` writes over a torn record; there a keyless one, and a serving node's upload,
    never do; a record a node could load (unsigned) stays there, as before."""
    local = store.open_store(tmp_path / "a", remote="")
    keys = [make_key({"push-repair": i}) for i in range(2)]
    entries = [local.put(k, {**FILES, "n": bytes([i])}) for i, k in enumerate(keys)]
    keyed = open_remote(server.url, Trust(key=FLEET_KEY.encode()))
    assert keyed.upload(entries[0])
    whole = server.raw(keys[0].digest)
    assert whole is not None
    torn = whole[: len(whole) // 3]
    server.write_raw(keys[0].digest, torn)

    # A serving node's background upload (no repair) never writes blind over it.
    node = open_remote(server.url, Trust(key=FLEET_KEY.encode()))
    done = node.upload(entries[0], repair=False)
    if server.kind in NO_CAS:
        assert not done and done.refused, done  # kept, saying why
        assert server.raw(keys[0].digest) == torn
    else:
        assert done and done.found == "malformed"  # compare-and-set: safe for anyone
        server.write_raw(keys[0].digest, torn)

    rc, out, err = ctl(server, "push", "--cache-dir", str(tmp_path / "a"), keys[0].digest,
                       key=False)
    assert rc == 0, out + err
    if server.kind in NO_CAS:
        # Without the key nothing is proven: the record stays (and is said to).
        assert "not replaced" in out and server.raw(keys[0].digest) == torn, out

    rc, out, err = ctl(server, "push", "--cache-dir", str(tmp_path / "a"), keys[0].digest)
    assert rc == 0 and "pushed 1 to" in out, out + err
    assert "replaced 1 record that did not verify" in out, out
    rec = keyed.record(keys[0].digest)
    assert rec is not None and keyed.trust.verifies(rec.body, rec.sig)
    # A keyed node now loads it.
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
    got = store.open_store(tmp_path / "b", remote=server.url).get(keys[0])
    assert isinstance(got, Hit), got


def test_a_damaged_blob_is_healed_by_the_next_node_that_publishes_the_entry(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blob cut short under its final name (a node killed mid-PUT on a server that
    writes in place, a hand-truncated file) broke the entry for the whole fleet: every
    later publisher saw the blob there and counted it stored (issue 62). The next node
    that publishes the entry compares sizes and stores the right bytes again, whether it
    downloaded the damage first or not; a fresh node then hits, byte-exact."""
    if server.kind == "redis":
        pytest.skip("a Redis blob is whole once its marker is set, which is written last")
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
    key = make_key({"heal": 1})
    entry = store.open_store(tmp_path / "a", remote="").put(key, FILES)
    assert open_remote(server.url, Trust(key=FLEET_KEY.encode())).upload(entry)
    kernel = hashlib.sha256(FILES["kernel.so"]).hexdigest()
    for rnd, downloads_first in enumerate((True, False)):
        server.write_blob(kernel, FILES["kernel.so"][: len(FILES["kernel.so"]) // 2])
        node = tiered(tmp_path / f"node{rnd}", server.url)
        if downloads_first:  # it refuses the entry, compiles its own, publishes it
            assert not isinstance(node.get(key), Hit)
        published = node.put(key, FILES)
        assert node.flush(20), "the upload did not finish"
        assert published is not None
        fresh = store.open_store(tmp_path / f"fresh{rnd}", remote=server.url).get(key)
        assert isinstance(fresh, Hit), (rnd, fresh)
        assert {n: p.read_bytes() for n, p in fresh.entry.files.items()} == FILES


def test_in_a_chain_the_damaged_level_is_healed_from_the_level_that_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """file:// (nearest) holds a blob cut short; http:// behind it holds the entry whole.
    A node refuses the near copy, hits the far one, and its backfill rewrites the near
    level's damaged blob: a fresh node reading the near level alone then hits."""
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_TRUST_REMOTE", "CACHECOMPILE_VERIFY_KEYS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
    with remote_tier(tmp_path, "file,http") as (servers, env):
        near, far = env["CACHECOMPILE_REMOTE"].split(",")
        key = make_key({"chain-heal": 1})
        entry = store.open_store(tmp_path / "a", remote="").put(key, FILES)
        trust = Trust(key=FLEET_KEY.encode())
        assert open_remote(near, trust).upload(entry) and open_remote(far, trust).upload(entry)
        kernel = hashlib.sha256(FILES["kernel.so"]).hexdigest()
        (path,) = [p for p in (servers[0].a / "cc").rglob(kernel)
                   if p.parent.parent.name == "blob"]
        path.write_bytes(FILES["kernel.so"][:100])
        assert not isinstance(store.open_store(tmp_path / "n0", remote=near).get(key), Hit)
        node = tiered(tmp_path / "node", env["CACHECOMPILE_REMOTE"])
        hit = node.get(key)
        assert isinstance(hit, Hit) and node.flush(20)
        fresh = store.open_store(tmp_path / "fresh", remote=near).get(key)
        assert isinstance(fresh, Hit), fresh
        assert {n: p.read_bytes() for n, p in fresh.entry.files.items()} == FILES
