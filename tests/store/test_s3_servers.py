"""S3 servers that differ (issue 32): the tier probes, once per process and bucket, that
the server refuses a conditional put that does not hold, and refuses to replace records
where it does not; the bucket check needs no LIST. moto (tests/s3_util.py) is the server
that does everything right; s3rver (npm) is the one that does not: it accepts every
conditional put and fails a LIST of more than 1000 keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from s3_util import MotoServer, S3rver

from cachecompile import store
from cachecompile.store import Hit, make_key
from cachecompile.store.remote import S3Remote, s3
from cachecompile.store.signing import Trust
from cachecompile.store.tiered import TieredStore

FLEET_KEY = "fleet-secret-key-s3-servers"
FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 8, "out.py": b"x = 1\n"}


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_TRUST_REMOTE", "CACHECOMPILE_DIR",
                "CACHECOMPILE_READONLY", "CACHECOMPILE_VERIFY_KEYS", "AWS_ENDPOINT_URL_S3",
                "AWS_PROFILE", "AWS_SESSION_TOKEN", "CACHECOMPILE_SIGNING_KEY"):
        monkeypatch.delenv(var, raising=False)
    # Each test is a fresh process as far as the probe goes.
    monkeypatch.setattr(s3, "_CAS", {})


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every probe this test runs."""
    seen: list[str] = []
    real = s3._probe

    def counted(ob: Any, st: Any) -> str:
        seen.append("probe")
        return real(ob, st)

    monkeypatch.setattr(s3, "_probe", counted)
    return seen


@pytest.fixture(scope="module")
def s3rver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3rver]:
    srv = S3rver(tmp_path_factory.mktemp("s3rver")).start()
    yield srv
    srv.stop()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("cachecompile.store") and r.levelno >= logging.WARNING]


def tiered(root: Path, url: str) -> TieredStore[Any]:
    st = store.open_store(root, remote=url)
    assert isinstance(st, TieredStore)
    return st


def use(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_moto_honours_conditional_puts_and_is_probed_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probes: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    srv = MotoServer(tmp_path / "moto").start()
    try:
        use(monkeypatch, srv.env())
        bucket = srv.bucket()
        # What a writer without s3:DeleteObject leaves: the sweep takes it after lease.
        srv.client().put_object(Bucket=bucket, Key="fleet/v1/probe/left", Body=b"probe")
        keyless = S3Remote(f"s3://{bucket}/fleet", trust=Trust(key=None))
        keyed = S3Remote(f"s3://{bucket}/fleet", trust=Trust(key=FLEET_KEY.encode()))
        k = make_key({"m": 1})
        local = store.open_store(tmp_path / "a", remote="")
        entry = local.put(k, FILES)
        with caplog.at_level(logging.WARNING):
            assert keyless.upload(entry).found == "absent"
            # The keyed node repairs the unsigned record: a replacement, allowed here.
            done = keyed.upload(entry)
        assert done and done.found == "unsigned" and not done.refused
        assert keyed.replace_refused() == "" and warnings_of(caplog) == []
        assert probes == ["probe"]  # once per process and bucket, for both remotes
        rec = keyed.record(k.digest)
        assert rec is not None and rec.sig
        # The probe object is gone again; the one left over goes with the sweep.
        assert [k for k in srv.objects(bucket, "fleet/v1/probe/")] == ["fleet/v1/probe/left"]
        # Past the lease by the sweeper's clock (S3's Last-Modified has whole seconds: a
        # sleep of one lease left a pin written in the same second behind, now and then).
        sweeper = S3Remote(f"s3://{bucket}/fleet?lease=1", trust=Trust(key=None))
        sweeper.clock = lambda: time.time() + 10
        sweeper.sweep()
        kinds = {key.split("/")[2] for key in srv.objects(bucket, "fleet/v1/")}
        assert kinds == {"entry", "blob"}, kinds
    finally:
        srv.stop()


def test_a_node_without_list_bucket_still_serves(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Before, the once-per-process bucket check was a LIST: denied, it left the node
    # local-only although every GET it needs was allowed.
    srv = MotoServer(tmp_path / "moto", auth_after=7).start()
    try:
        name = srv.bucket()
        writer = srv.user("writer", name, ["s3:*"])
        reader = srv.user("reader", name, ["s3:GetObject"])
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
        url = f"s3://{name}/team"
        use(monkeypatch, srv.env(writer))
        key = make_key({"nolist": 1})
        a = tiered(tmp_path / "a", url)
        a.put(key, FILES)
        assert a.flush(20) and a.uploader is not None and a.uploader.uploaded == 1

        use(monkeypatch, srv.env(reader))
        b = tiered(tmp_path / "b", url)
        with caplog.at_level(logging.WARNING):
            hit = b.get(key)
        assert isinstance(hit, Hit), hit
        assert warnings_of(caplog) == []
        assert hit.entry.files["kernel.so"].read_bytes() == FILES["kernel.so"]
    finally:
        srv.stop()


def test_a_server_that_ignores_conditional_puts_never_has_a_record_replaced(
        tmp_path: Path, s3rver: S3rver, monkeypatch: pytest.MonkeyPatch, probes: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    use(monkeypatch, s3rver.env())
    url = f"s3://{s3rver.bucket}/cas"
    keyless = S3Remote(url, trust=Trust(key=None))
    keyed = S3Remote(url, trust=Trust(key=FLEET_KEY.encode()))
    local = store.open_store(tmp_path / "a", remote="")
    keys = [make_key({"cas": i}) for i in range(3)]
    entries = [local.put(k, {**FILES, "n": bytes([i])}) for i, k in enumerate(keys)]
    with caplog.at_level(logging.WARNING):
        assert keyless.upload(entries[0]).found == "absent"  # creating is still allowed
        # On moto the keyed node would replace the unsigned record (see above); here a
        # replacement would be a blind overwrite, racing any other writer.
        kept = [keyed.upload(e, overwrite=True) for e in entries[:1]]
        assert keyless.write_record(keys[1].digest, b"raw", None)
        assert not keyless.write_record(keys[1].digest, b"blind", None)  # a HEAD saw it
    assert [bool(u) for u in kept] == [False] and kept[0].found == "unsigned"
    assert "does not honour conditional puts" in kept[0].refused
    rec = keyless.record(keys[0].digest)
    assert rec is not None and not rec.sig  # still the keyless node's record
    got = keyless.read_record(keys[1].digest)
    assert got is not None and got[0] == b"raw"
    # One warning for the process and bucket, saying what the server did and what
    # follows; no exception text.
    ws = warnings_of(caplog)
    assert len(ws) == 1 and probes == ["probe"], ws
    assert "If-None-Match" in ws[0] and "never replace" in ws[0], ws
    assert "Traceback" not in ws[0] and "<?xml" not in ws[0]
    import obstore

    objs = [m["path"] for b in obstore.list(s3rver.store("cas"), "v1/") for m in b]
    assert not [p for p in objs if "/probe/" in p], objs  # the probe object is gone

    # cachectl push --force says, per entry, why it kept the record.
    from cachecompile.cli.main import cli

    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
    r = CliRunner().invoke(cli, ["push", "--force", "--cache-dir", str(tmp_path / "a"),
                                 "--remote", url])
    assert r.exit_code == 0, r.output
    assert "kept: the server does not honour conditional puts" in r.output, r.output
    # Entry 0's record is there, unsigned: kept. Entry 1's is b"raw", which no node can
    # load: a keyed push proves it malformed and writes over it (issue 50; the window
    # that leaves is docs/remote.md's). Entry 2 was absent: created.
    assert "pushed 2 to" in r.output and "1 record not replaced" in r.output, r.output
    assert "replaced 1 record that did not verify" in r.output, r.output
    rec = keyed.record(keys[1].digest)
    assert rec is not None and keyed.trust.verifies(rec.body, rec.sig)
    rec = keyless.record(keys[0].digest)
    assert rec is not None and not rec.sig  # never a blind write over a loadable record


def test_a_server_that_fails_big_lists_still_serves(
        tmp_path: Path, s3rver: S3rver, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    use(monkeypatch, s3rver.env())
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", FLEET_KEY)
    url = f"s3://{s3rver.bucket}/big"
    st = s3rver.store("big")
    import obstore

    # More than 1000 keys under the entry prefix: s3rver answers a LIST there with 500.
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: obstore.put(st, f"v1/entry/{i:032x}", b"{}"), range(1001)))
    key = make_key({"big": 1})
    a = tiered(tmp_path / "a", url)
    a.put(key, FILES)
    assert a.flush(30) and a.uploader is not None and a.uploader.uploaded == 1

    b = tiered(tmp_path / "b", url)
    caplog.clear()  # node a's upload warned that this server ignores conditional puts
    with caplog.at_level(logging.WARNING):
        hit = b.get(key)
    assert isinstance(hit, Hit), hit
    assert warnings_of(caplog) == []  # a reader never probes, and lists nothing
    # The verbs that list do fail, one line each: the server's fault, said as such.
    from cachecompile.cli.main import cli

    r = CliRunner().invoke(cli, ["remote", "ls", "--remote", url])
    assert r.exit_code == 7 and "Traceback" not in r.output, r.output
    assert "500" in r.output or "InternalError" in r.output, r.output
