"""Signed records: what is covered by the HMAC, and the trust policy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cachecompile.store.errors import ManifestError, UntrustedEntryError
from cachecompile.store.manifest import dump_manifest
from cachecompile.store.signing import Trust, make_record, parse_record

DIGEST = "0" * 32
SHA = "a" * 64


def _manifest() -> dict[str, object]:
    return json.loads(dump_manifest(key=DIGEST, factors={"f": 1}, labels={}, meta={},
                                    created=1.0,
                                    files={"k.so": {"size": 3, "xxh3_128": "b" * 32}}))


def test_signature_round_trip_and_forgeries() -> None:
    rec = make_record(_manifest(), {"k.so": SHA}, {SHA: 1024}, Trust(key=b"secret"))
    parsed = parse_record(rec.to_bytes(), DIGEST)
    Trust(key=b"secret").check(parsed.body, parsed.sig, DIGEST)
    with pytest.raises(UntrustedEntryError, match="does not match"):
        Trust(key=b"other").check(parsed.body, parsed.sig, DIGEST)
    # Any change to the body (here: a file's SHA-256) breaks the signature.
    outer = json.loads(rec.to_bytes())
    outer["body"] = outer["body"].replace(SHA, "c" * 64)
    forged = parse_record(json.dumps(outer).encode(), DIGEST)
    with pytest.raises(UntrustedEntryError, match="does not match"):
        Trust(key=b"secret").check(forged.body, forged.sig, DIGEST)
    # A record cannot be moved under another key.
    with pytest.raises(ManifestError):
        parse_record(rec.to_bytes(), "1" * 32)


def test_policy_without_a_key() -> None:
    rec = make_record(_manifest(), {"k.so": SHA}, {}, Trust())
    assert rec.sig is None
    with pytest.raises(UntrustedEntryError, match="TRUST_REMOTE"):
        Trust().check(rec.body, rec.sig, DIGEST)
    Trust(accept_unsigned=True).check(rec.body, rec.sig, DIGEST)
    with pytest.raises(UntrustedEntryError, match="not signed"):
        Trust(key=b"k", accept_unsigned=True).check(rec.body, rec.sig, DIGEST)


def test_trust_from_env(tmp_path: Path) -> None:
    keyfile = tmp_path / "key"
    keyfile.write_text("from-a-file\n")
    assert Trust.from_env({"CACHECOMPILE_SIGNING_KEY": f"file:{keyfile}"}).key == b"from-a-file"
    assert Trust.from_env({"CACHECOMPILE_TRUST_REMOTE": "1"}).accept_unsigned
    assert Trust.from_env({}) == Trust()


def test_malformed_records_are_manifest_errors() -> None:
    for raw in (b"not json", b'{"body": "{}"}', b'{"body": 3}'):
        with pytest.raises(ManifestError):
            parse_record(raw, DIGEST)


def test_executable_names_are_signed() -> None:
    rec = make_record(_manifest(), {"k.so": SHA}, {SHA: 1024}, Trust(key=b"secret"), ["k.so"])
    parsed = parse_record(rec.to_bytes(), DIGEST)
    assert parsed.executable == frozenset({"k.so"})
    assert Trust(key=b"secret").verifies(parsed.body, parsed.sig)
    # Dropping the bit (or adding one) is a change to the body: the signature breaks.
    outer = json.loads(rec.to_bytes())
    outer["body"] = outer["body"].replace(',"exec":["k.so"]', "")
    stripped = parse_record(json.dumps(outer).encode(), DIGEST)
    assert stripped.executable == frozenset()
    assert not Trust(key=b"secret").verifies(stripped.body, stripped.sig)
    # Records without executables read as before (no "exec" in the body).
    plain = make_record(_manifest(), {"k.so": SHA}, {SHA: 1024}, Trust())
    assert b"exec" not in plain.body
    outer = json.loads(rec.to_bytes())
    outer["body"] = outer["body"].replace('"exec":["k.so"]', '"exec":["other"]')
    with pytest.raises(ManifestError, match="executable"):
        parse_record(json.dumps(outer).encode(), DIGEST)


def test_verifies_needs_our_key_and_signature() -> None:
    rec = make_record(_manifest(), {"k.so": SHA}, {}, Trust(key=b"secret"))
    assert Trust(key=b"secret").verifies(rec.body, rec.sig)
    assert not Trust(key=b"other").verifies(rec.body, rec.sig)
    assert not Trust().verifies(rec.body, rec.sig)
    assert not Trust(key=b"secret").verifies(rec.body, None)


def test_verify_keys_verify_and_only_the_signing_key_signs(tmp_path: Path) -> None:
    (tmp_path / "old.key").write_bytes(b"old-key,with-a-comma\n")
    t = Trust.from_env({"CACHECOMPILE_SIGNING_KEY": "new",
                        "CACHECOMPILE_VERIFY_KEYS": f"file:{tmp_path / 'old.key'}, other ,new"})
    assert t.key == b"new" and t.verify_keys == (b"old-key,with-a-comma", b"other")
    body = b'{"x":1}'
    by_old = Trust(key=b"old-key,with-a-comma").sign(body)
    assert t.verifies(body, by_old) and not t.signed_by_us(body, by_old)
    assert t.signed_by_us(body, t.sign(body))
    t.check(body, by_old, "d" * 32)
    with pytest.raises(UntrustedEntryError, match="VERIFY_KEYS"):
        t.check(body, Trust(key=b"stranger").sign(body), "d" * 32)
    # Verify keys alone (a consumer that never signs) still demand a signature.
    consumer = Trust.from_env({"CACHECOMPILE_VERIFY_KEYS": "other"})
    assert consumer.keyed and consumer.sign(body) is None
    with pytest.raises(UntrustedEntryError, match="not signed"):
        consumer.check(body, None, "d" * 32)


def test_a_short_key_is_warned_about_once_and_never_shown(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cachecompile.store import signing

    monkeypatch.setattr(signing, "_warned_short", set())
    caplog.set_level(logging.WARNING, logger="cachecompile.store.signing")
    short = "9bytesKey"
    key_file = tmp_path / "key"
    key_file.write_text("0123456789abcdef\n")          # 16 bytes: enough
    for _ in range(2):
        trust = Trust.from_env({"CACHECOMPILE_SIGNING_KEY": short,
                                "CACHECOMPILE_VERIFY_KEYS": f"file:{key_file},tiny-old"})
    assert trust.key == short.encode()                 # still signs: a warning, no refusal
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs                        # once per key, not per call
    assert "CACHECOMPILE_SIGNING_KEY is 9 bytes" in msgs[0] and "16" in msgs[0]
    assert "CACHECOMPILE_VERIFY_KEYS (key 2) is 8 bytes" in msgs[1]
    assert all(short not in m and "tiny-old" not in m for m in msgs)
    caplog.clear()
    Trust.from_env({"CACHECOMPILE_SIGNING_KEY": "a-key-of-32-bytes-is-what-we-ask"})
    assert caplog.records == []
