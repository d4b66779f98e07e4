"""The whole manifest is integrity-checked: meta, factors, labels and the file list.

A one-character edit in ``meta`` (which kernel serves which call, the guards) used to
pass ``cachectl verify`` and then break or mislead every warm process. Each edit here
is made on disk, then looked at as a fresh process would: a lookup in a subprocess
(the entry is corrupt, quarantined, one warning) and ``cachectl verify`` (non-zero).
The same digest travels inside signed remote records and bundles.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ccutil
import pytest

from cachecompile.store import Hit, Miss, ReadOnlyStore, Store, make_key, open_store, verification
from cachecompile.store.bundle import export_bundle, import_bundle
from cachecompile.store.errors import ManifestError, UnsafeArchiveError, UntrustedEntryError
from cachecompile.store.manifest import manifest_digest, parse_manifest
from cachecompile.store.signing import Trust, make_record, parse_record

KEY = {"model": "m", "fn": "forward"}
META = {"program": {"kernels": {"abc": "kernels/abc.so"}}, "guards": [{"text": "x == 1"}]}
FILES = {"kernels/abc.so": b"\x7fELF" * 64, "program.py": b"x = 1"}
LABELS = {"model": "m", "function": "forward"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_SIGNING_KEY", "CACHECOMPILE_TRUST_REMOTE",
                "CACHECOMPILE_DIR", "CACHECOMPILE_READONLY"):
        monkeypatch.delenv(var, raising=False)


# -- one-character edits, made to the parsed document and written back in the store's own
# -- layout, so that the file on disk differs from the original in exactly one character.
def _edit_meta(doc: dict[str, Any]) -> None:
    doc["meta"]["program"]["kernels"]["abc"] = "kernels/abd.so"


def _edit_meta_guard(doc: dict[str, Any]) -> None:
    doc["meta"]["guards"][0]["text"] = "x == 2"


def _edit_factors(doc: dict[str, Any]) -> None:
    doc["factors"]["fn"] = "forwarc"


def _edit_files(doc: dict[str, Any]) -> None:
    rec = doc["files"]["kernels/abc.so"]
    rec["xxh3_128"] = rec["xxh3_128"][:-1] + ("0" if rec["xxh3_128"][-1] != "0" else "1")


def _edit_labels(doc: dict[str, Any]) -> None:
    doc["labels"]["model"] = "n"


def _edit_created(doc: dict[str, Any]) -> None:
    doc["created"] = doc["created"] + 1.0


def _drop_file(doc: dict[str, Any]) -> None:
    # Not one character, but no file check can see it: the dropped file is still on disk.
    del doc["files"]["program.py"]


def _add_field(doc: dict[str, Any]) -> None:
    doc["extra"] = 1


ONE_CHAR = {_edit_meta, _edit_meta_guard, _edit_factors, _edit_files, _edit_labels}


def _dump(doc: dict[str, Any]) -> str:
    # As manifest.dump_manifest: canonical JSON.
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _tamper(mpath: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    before = mpath.read_text()
    doc = json.loads(before)
    assert _dump(doc) == before, "the test must write the store's own layout"
    edit(doc)
    after = _dump(doc)
    if edit in ONE_CHAR:
        assert len(after) == len(before)
        assert sum(a != b for a, b in zip(before, after, strict=True)) == 1
    mpath.chmod(0o600)
    mpath.write_text(after)


def _publish(root: Path) -> tuple[Store, Any, Any]:
    st = open_store(root)
    assert isinstance(st, Store)
    e = st.put(make_key(KEY), FILES, labels=LABELS, meta=META)
    other = st.put(make_key({"other": 1}), {"a": b"a"}, meta={"k": "v"})
    return st, e, other


LOOKUP = """
import json, sys, logging
logging.basicConfig(level=logging.WARNING)
from cachecompile.store import open_store, make_key, Hit
st = open_store(sys.argv[1])
out = st.get(make_key(json.loads(sys.argv[2])))
print(json.dumps({"hit": isinstance(out, Hit), "kind": getattr(out, "kind", None),
                  "reason": getattr(out, "reason", None),
                  "meta": out.entry.meta if isinstance(out, Hit) else None}))
"""


def _cachectl(env: dict[str, str], *args: str) -> ccutil.Ran:
    return ccutil.cachectl(*args, env=env)


def _lookup(env: dict[str, str], root: Path, key: dict[str, Any]
            ) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    look = subprocess.run([sys.executable, "-c", LOOKUP, str(root), json.dumps(key)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert look.returncode == 0, look.stderr
    return json.loads(look.stdout.strip().splitlines()[-1]), look


@pytest.mark.parametrize("edit", [_edit_meta, _edit_meta_guard, _edit_factors, _edit_files,
                                  _edit_labels, _edit_created, _drop_file, _add_field],
                         ids=["meta", "meta-guard", "factors", "files", "labels", "created",
                              "files-dropped", "added-field"])
def test_an_edited_manifest_is_corrupt(tmp_path: Path, child_env: dict[str, str],
                                       edit: Callable[[dict[str, Any]], None]) -> None:
    root = tmp_path / "cache"
    _, e, other = _publish(root)
    _tamper(e.path / "manifest.json", edit)

    verify = _cachectl(child_env, "verify", "--cache-dir", str(root))
    assert verify.returncode == 1, verify.stdout + verify.stderr
    problem = [ln for ln in verify.stdout.splitlines() if ln.startswith(e.key)]
    assert len(problem) == 1 and "corrupt" in problem[0] and "integrity" in problem[0], \
        verify.stdout
    assert other.key not in verify.stdout
    assert e.path.exists(), "verify without --fix changes nothing"

    res, look = _lookup(child_env, root, KEY)
    assert not res["hit"] and res["kind"] == "corrupt", res
    assert "integrity digest" in res["reason"], res
    assert look.stderr.count("quarantin") == 1, look.stderr
    assert look.stderr.count("WARNING") == 1, look.stderr
    assert not e.path.exists(), "the corrupt entry is quarantined"
    quarantined = [p for p in (root / "v1" / "quarantine").iterdir() if p.name.startswith(e.key)]
    assert {p.suffix for p in quarantined} >= {".reason"}
    assert isinstance(open_store(root).get(other.key), Hit), "other entries are untouched"

    # Quarantined: the store verifies again, and the next lookup is a plain absent miss.
    assert _cachectl(child_env, "verify", "--cache-dir", str(root)).returncode == 0
    res2, _ = _lookup(child_env, root, KEY)
    assert res2["kind"] == "absent", res2


def test_an_untouched_manifest_verifies_and_hits(tmp_path: Path,
                                                 child_env: dict[str, str]) -> None:
    root = tmp_path / "cache"
    st, e, _ = _publish(root)
    assert st.verify().ok
    hit = st.get(make_key(KEY))
    assert isinstance(hit, Hit) and hit.entry.meta == META and hit.entry.key == e.key
    verify = _cachectl(child_env, "verify", "--cache-dir", str(root))
    assert verify.returncode == 0 and "checked 2 entries: ok" in verify.stdout, verify.stdout
    res, look = _lookup(child_env, root, KEY)
    assert res["hit"] and res["meta"] == META, res
    assert "WARNING" not in look.stderr


def test_reformatting_a_manifest_changes_nothing(tmp_path: Path,
                                                 child_env: dict[str, str]) -> None:
    # The digest is over the canonical JSON of the parsed manifest, not its bytes.
    root = tmp_path / "cache"
    _, e, _ = _publish(root)
    mpath = e.path / "manifest.json"
    doc = json.loads(mpath.read_text())
    mpath.chmod(0o600)
    mpath.write_text(json.dumps(doc, indent=4))
    assert _cachectl(child_env, "verify", "--cache-dir", str(root)).returncode == 0
    res, _ = _lookup(child_env, root, KEY)
    assert res["hit"] and res["meta"] == META, res


def test_a_manifest_without_its_digest_is_corrupt(tmp_path: Path,
                                                  child_env: dict[str, str]) -> None:
    # What a format 1 manifest (before the digest) looks like.
    root = tmp_path / "cache"
    _, e, _ = _publish(root)
    mpath = e.path / "manifest.json"
    doc = json.loads(mpath.read_text())
    del doc["integrity"]
    doc["format"] = 1
    mpath.chmod(0o600)
    mpath.write_text(_dump(doc))
    verify = _cachectl(child_env, "verify", "--cache-dir", str(root))
    assert verify.returncode == 1 and e.key in verify.stdout
    assert "predates the integrity digest" in verify.stdout
    res, look = _lookup(child_env, root, KEY)
    assert res["kind"] == "corrupt" and look.stderr.count("quarantin") == 1, res
    assert not e.path.exists()


def test_an_edit_after_the_first_read_in_a_process(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The digest is checked once per process per manifest, like the files' checksums;
    a manifest that changes on disk (another inode, size or mtime) is checked again."""
    st, e, _ = _publish(tmp_path / "cache")
    assert isinstance(st.get(make_key(KEY)), Hit)  # verified and cached in this process
    mpath = e.path / "manifest.json"
    before = mpath.stat()
    _tamper(mpath, _edit_meta)
    # Same inode and size; an edit made within the clock's tick would keep the mtime too,
    # so give it the later mtime any real edit has.
    os.utime(mpath, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))

    # manifest(): refused, without side effects.
    with pytest.raises(ManifestError, match="integrity digest"):
        st.manifest(e.key)
    assert e.path.exists()
    ro = ReadOnlyStore(st)
    out = ro.get(make_key(KEY))
    assert isinstance(out, Miss) and out.kind == "corrupt" and e.path.exists()

    with caplog.at_level(logging.WARNING, logger="cachecompile.store"):
        out = st.get(make_key(KEY))
    assert isinstance(out, Miss) and out.kind == "corrupt", out
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert not e.path.exists()
    assert st.stats()["corruptions"] == 1
    # A fresh publish under the same key is whole again.
    st.put(make_key(KEY), FILES, labels=LABELS, meta=META)
    hit = st.get(make_key(KEY))
    assert isinstance(hit, Hit) and hit.entry.meta == META


PARSES = """
import json, sys
from cachecompile.store import manifest, verification
from cachecompile.store import open_store, make_key, Hit
calls = []
real = manifest.parse_manifest
def counting(*a, **k):
    calls.append(1)
    return real(*a, **k)
verification.parse_manifest = counting
st = open_store(sys.argv[1])
key = make_key(json.loads(sys.argv[2]))
m1 = st.manifest(key)
m2 = st.manifest(key)
hits = [isinstance(st.get(key), Hit) for _ in range(3)]
m3 = st.manifest(key)
print(json.dumps({"parses": len(calls), "hits": hits, "same": m1 is m2 is m3}))
"""


def test_the_digest_is_checked_once_per_process(tmp_path: Path,
                                                child_env: dict[str, str]) -> None:
    # cachecompile reads a variant's manifest, then gets it: one parse and digest for both.
    root = tmp_path / "cache"
    _publish(root)
    out = subprocess.run([sys.executable, "-c", PARSES, str(root), json.dumps(KEY)],
                         env=child_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"parses": 1, "hits": [True, True, True], "same": True}, res


def test_listings_do_not_hold_every_manifest(tmp_path: Path) -> None:
    st, e, other = _publish(tmp_path / "cache")
    verification._VERIFIED.clear()
    verification._PARSED.clear()
    assert st.reindex() == 2
    assert [i.state for i in st.entries()] == ["ok", "ok"]
    assert verification._PARSED == {}


# -- signed records (the remote tier) and bundles carry the same manifest, digest included.
def _record_doc(raw: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    outer = json.loads(raw)
    return outer, json.loads(outer["body"])


def _rewrite_record(raw: bytes, edit: Callable[[dict[str, Any]], None],
                    trust: Trust | None = None) -> bytes:
    """Edit the manifest inside a record; keep its signature, or re-sign with ``trust``."""
    outer, body = _record_doc(raw)
    edit(body["manifest"])
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    outer["body"] = text
    if trust is not None:
        outer["sig"] = trust.sign(text.encode("utf-8"))
    return json.dumps(outer).encode("utf-8")


def test_signed_records_cover_meta_and_check_the_digest(tmp_path: Path) -> None:
    st, e, _ = _publish(tmp_path / "cache")
    trust = Trust(key=b"fleet")
    sha = {n: "0" * 64 for n in e.files}
    rec = make_record(e.manifest, sha, {}, trust)
    _, body = _record_doc(rec.to_bytes())
    assert body["manifest"]["meta"] == META
    assert body["manifest"]["integrity"] == manifest_digest(e.manifest)
    ok = parse_record(rec.to_bytes(), e.key)
    trust.check(ok.body, ok.sig, e.key)
    assert ok.manifest == e.manifest

    # Meta edited, signature kept: the integrity digest refuses it on parse; with the
    # digest recomputed too, the signature does.
    bad = _rewrite_record(rec.to_bytes(), _edit_meta)
    with pytest.raises(ManifestError, match="integrity digest"):
        parse_record(bad, e.key)

    def meta_and_digest(m: dict[str, Any]) -> None:
        _edit_meta(m)
        m["integrity"] = manifest_digest(m)

    forged = parse_record(_rewrite_record(rec.to_bytes(), meta_and_digest), e.key)
    with pytest.raises(UntrustedEntryError, match="signature does not match"):
        trust.check(forged.body, forged.sig, e.key)
    # Someone holding the key who edits meta but not the digest: still refused.
    with pytest.raises(ManifestError, match="integrity digest"):
        parse_record(_rewrite_record(rec.to_bytes(), _edit_meta, trust=trust), e.key)


def _bundle_members(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    import zstandard

    raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb")).read()
    out = []
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m)
            out.append((m, f.read() if f else None))
    return out


def _write_bundle(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for m, data in members:
            if data is not None:
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return path


def test_bundles_keep_the_digest_valid(tmp_path: Path, child_env: dict[str, str]) -> None:
    src, e, other = _publish(tmp_path / "src")
    out = tmp_path / "warm.tar.zst"
    export_bundle(src, out, [e.key, other.key], trust=Trust())
    dst = open_store(tmp_path / "dst")
    assert sorted(import_bundle(dst, out, trust=Trust(accept_unsigned=True)).entries) == \
        sorted([e.key, other.key])
    assert dst.maintenance().verify().ok
    hit = dst.get(make_key(KEY))
    assert isinstance(hit, Hit) and hit.entry.meta == META and hit.entry.labels == LABELS
    m = dst.manifest(e.key)
    assert m["integrity"] == manifest_digest(m)
    assert _cachectl(child_env, "verify", "--cache-dir", str(tmp_path / "dst")).returncode == 0


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_bundle_with_edited_meta_is_refused_whole(tmp_path: Path, signed: bool) -> None:
    src, e, other = _publish(tmp_path / "src")
    good = tmp_path / "good.tar.zst"
    trust = Trust(key=b"k1") if signed else Trust(accept_unsigned=True)
    export_bundle(src, good, [e.key, other.key], trust=trust)
    members = _bundle_members(good)
    i = next(i for i, (m, _) in enumerate(members) if m.name == f"{e.key}/record.json")
    raw = members[i][1]
    assert raw is not None
    members[i] = (members[i][0], _rewrite_record(raw, _edit_meta))
    bad = _write_bundle(tmp_path / "bad.tar.gz", members)
    dst = open_store(tmp_path / "dst")
    with pytest.raises(UnsafeArchiveError, match="integrity digest"):
        import_bundle(dst, bad, trust=trust)
    assert list(dst.maintenance().digests()) == [], "nothing is imported, not even the good entry"


# -- the remote tier on a real redis-server (skips without one).
@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    from redis_util import RedisServer

    srv = RedisServer(tmp_path / "redis").start()
    try:
        yield srv.url(), srv.client()
    finally:
        srv.stop()


@pytest.mark.parametrize("signing", ["signed", "trusted-unsigned"])
def test_a_remote_record_with_edited_meta_is_refused(
        tmp_path: Path, redis_url: tuple[str, Any], signing: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from cachecompile.store.tiered import TieredStore

    url, client = redis_url
    if signing == "signed":
        monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", "fleet-secret-key")
    else:
        monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    a = open_store(tmp_path / "a", remote=url)
    assert isinstance(a, TieredStore)
    e = a.put(make_key(KEY), FILES, labels=LABELS, meta=META)
    assert a.flush(10)
    rkey = a.remote.key_of(e.key)  # type: ignore[attr-defined]

    # Untouched, another node gets the same meta, verified.
    b = open_store(tmp_path / "b", remote=url)
    hit = b.get(make_key(KEY))
    assert isinstance(hit, Hit) and hit.entry.meta == META
    assert b.maintenance().verify().ok

    client.set(rkey, _rewrite_record(client.get(rkey), _edit_meta))
    c = open_store(tmp_path / "c", remote=url)
    with caplog.at_level(logging.WARNING):
        out = c.get(make_key(KEY))
    assert isinstance(out, Miss), out
    warned = [r.getMessage() for r in caplog.records
              if r.name.startswith("cachecompile.store.") and r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "integrity digest" in warned[0], warned
    assert list((tmp_path / "c" / "v1" / "entries").rglob("manifest.json")) == []


def test_copying_an_entry_keeps_it_valid(tmp_path: Path) -> None:
    # The digest does not depend on where the entry lives (no path in it).
    st, e, _ = _publish(tmp_path / "a")
    doc = parse_manifest((e.path / "manifest.json").read_bytes(), expect_key=e.key)
    dst = open_store(tmp_path / "b")
    assert isinstance(dst, Store)
    target = dst.entry_dir(e.key)
    target.parent.mkdir(mode=0o700, parents=True)
    shutil.copytree(e.path, target)
    hit = dst.get(e.key)
    assert isinstance(hit, Hit) and hit.entry.manifest == doc


# -- the digest is checked over the bytes read (issue 53: no second serialization of a
# -- 200 KB manifest per entry of a warm start), and means what it always meant.
def _doc(meta: dict[str, Any] | None = None) -> bytes:
    from cachecompile.store.manifest import dump_manifest

    files = {"program.py": {"size": 5, "xxh3_128": "0" * 32}}
    return dump_manifest(key="k" * 32, factors=KEY, labels=LABELS, meta=meta or META,
                         created=1.0, files=files)


def test_a_written_manifest_is_checked_over_its_own_bytes(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from cachecompile.store import manifest

    raw = _doc()
    monkeypatch.setattr(manifest, "manifest_digest", lambda doc: pytest.fail("serialized"))
    assert parse_manifest(raw)["meta"] == META


@pytest.mark.parametrize("form", ["indented", "unsorted", "nested integrity key"])
def test_a_manifest_in_another_form_is_checked_as_before(form: str) -> None:
    raw = _doc({**META, "integrity": "x"} if form == "nested integrity key" else None)
    doc = json.loads(raw)
    if form == "indented":      # what earlier releases wrote
        raw = json.dumps(doc, indent=1, sort_keys=True).encode()
    elif form == "unsorted":
        raw = json.dumps(dict(reversed(list(doc.items())))).encode()
    assert parse_manifest(raw) == doc
    edited = raw.replace(b"forward", b"forwarc")
    with pytest.raises(ManifestError, match="integrity digest"):
        parse_manifest(edited)


def test_an_integrity_field_moved_into_the_body_is_refused() -> None:
    doc = json.loads(_doc())
    given = doc.pop("integrity")
    doc["labels"]["integrity"] = given     # the same bytes, nested: not the digest's field
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(ManifestError):
        parse_manifest(raw)
