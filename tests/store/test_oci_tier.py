"""The OCI registry tier (``oci://``) and the OCI image layout (``cachectl export --oci``,
``import``) against the real distribution registry on loopback (tests/oci_util.py),
with htpasswd (Basic) and Bearer-token auth, and skopeo reading and writing what we do.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from ccutil import cachectl
from oci_util import Registry, TokenFront, skopeo
from tier_util import clean_remote_env, store_warnings, tiered

from cachecompile.store import Hit, Miss, make_key, open_store
from cachecompile.store.remote import OciRemote, open_remote
from cachecompile.store.remote.oci_format import RECORD_TYPE, tag_of

KEY = "fleet-secret-key-for-oci"
SECRET = "Reg1stry/Pa#ss?w@rd"
FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 40, "code/out.py": b"x = 1\n",
         "same.py": b"x = 1\n", "empty": b""}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_remote_env(monkeypatch)


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(tmp_path / "registry").start()
    yield r
    r.stop()


def _files(hit: object) -> dict[str, bytes]:
    assert isinstance(hit, Hit), hit
    return {n: p.read_bytes() for n, p in hit.entry.files.items()}


def _skopeo(*args: str) -> str:
    return subprocess.run([skopeo(), *args], check=True, capture_output=True, text=True,
                          timeout=120).stdout


def test_two_nodes_share_entries_through_a_registry_byte_exact(
        tmp_path: Path, reg: Registry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    url = reg.url()
    a = tiered(tmp_path / "a", url)
    key = make_key({"model": "m", "n": 1})
    a.put(key, FILES, labels={"model": "m"})
    assert a.flush(20) and a.uploader is not None and a.uploader.uploaded == 1
    b = tiered(tmp_path / "b", url)
    with caplog.at_level(logging.WARNING):
        assert _files(b.get(key)) == FILES
        assert isinstance(b.get(make_key({"other": 1})), Miss)  # a 404 is a plain miss
    assert store_warnings(caplog) == [] and not b.remote.breaker.down
    # What skopeo reads: one artifact per entry, its record the config, its distinct
    # files the layers, each under its SHA-256 (same.py and out.py are one blob).
    raw = _skopeo("inspect", "--raw", "--tls-verify=false",
                  f"docker://{reg.address}/team/cc:{tag_of(key.digest)}")
    doc = json.loads(raw)
    assert doc["artifactType"] == "application/vnd.cachecompile.entry.v1"
    assert doc["config"]["mediaType"] == RECORD_TYPE
    assert {la["digest"] for la in doc["layers"]} == {
        "sha256:" + hashlib.sha256(v).hexdigest() for v in FILES.values()}
    assert doc["annotations"]["org.cachecompile.label.model"] == "m"
    # A second publisher of the same entry sends nothing: the record is there.
    c = tiered(tmp_path / "c", url)
    c.put(key, FILES)
    assert c.flush(20) and c.uploader is not None and c.uploader.uploaded == 0
    # cachectl sees it, and purge deletes it (the registry's delete, by digest).
    env = {"CACHECOMPILE_DIR": str(tmp_path / "a"), "CACHECOMPILE_SIGNING_KEY": KEY}
    ls = cachectl("remote", "ls", "--remote", url, env=env)
    assert ls.returncode == 0 and key.digest[:12] in ls.stdout, ls
    remote = open_remote(url)
    assert remote.delete(key.digest) and not remote.contains(key.digest)
    assert remote.delete(key.digest) is False
    remote.close()


@pytest.mark.parametrize("front", ["htpasswd", "token"])
def test_registry_auth_basic_and_bearer_without_a_secret_shown(
        tmp_path: Path, front: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """htpasswd: Basic on every request. A token service: the 401's challenge names a
    realm, which grants a token for this repository (pull,push; pull under mode=ro)."""
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    reg = Registry(tmp_path / "registry", password=SECRET if front == "htpasswd" else None)
    reg.start()
    tok = TokenFront(reg, SECRET).start() if front == "token" else None
    base = tok.url() if tok is not None else reg.url()
    try:
        monkeypatch.setenv("CACHECOMPILE_REMOTE_PASSWORD", SECRET)
        good = base.replace("oci://", "oci://fleet@")
        key = make_key({"auth": front})
        with caplog.at_level(logging.DEBUG):
            a = tiered(tmp_path / "a", good)
            a.put(key, FILES)
            assert a.flush(20) and a.uploader is not None and a.uploader.uploaded == 1
            assert _files(tiered(tmp_path / "b", good + "?mode=ro").get(key)) == FILES
        if tok is not None:
            assert any("scope=repository%3Ateam%2Fcc%3Apull%2Cpush" in g for g in tok.grants)
            assert any(g.endswith("scope=repository%3Ateam%2Fcc%3Apull&service=test-registry")
                       for g in tok.grants), tok.grants
        # Wrong credentials, and none: one warning each, a miss, no secret anywhere.
        monkeypatch.setenv("CACHECOMPILE_REMOTE_PASSWORD", "wrong-" + SECRET)
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            bad = tiered(tmp_path / "c", good)
            assert isinstance(bad.get(key), Miss) and isinstance(bad.get(key), Miss)
        warned = store_warnings(caplog)
        assert len(warned) == 1 and "refused our credentials" in warned[0], warned
        assert SECRET not in caplog.text and "wrong-" not in caplog.text
        monkeypatch.delenv("CACHECOMPILE_REMOTE_PASSWORD")
        for i, (url, says) in enumerate(((base, "wants a user name and password"),
                                         (good, "refused our credentials" if tok else
                                          "wants a password for user 'fleet'"))):
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                assert isinstance(tiered(tmp_path / f"d{i}", url).get(key), Miss)
            warned = store_warnings(caplog)
            assert len(warned) == 1 and "401" in warned[0] and says in warned[0], warned
    finally:
        if tok is not None:
            tok.stop()
        reg.stop()


def test_a_registry_that_is_down_costs_one_warning(tmp_path: Path, reg: Registry,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CACHECOMPILE_TRUST_REMOTE", "1")
    url = reg.url()
    reg.stop()
    st = tiered(tmp_path / "a", url)
    key = make_key({"down": 1})
    with caplog.at_level(logging.WARNING):
        assert isinstance(st.get(key), Miss) and isinstance(st.get(key), Miss)
        st.put(key, FILES)  # still served locally
        assert isinstance(st.get(key), Hit)
    assert len(store_warnings(caplog)) == 1 and st.remote.breaker.down


def test_export_oci_layout_pushed_with_skopeo_serves_a_fresh_node_and_back(
        tmp_path: Path, reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cachectl export --oci DIR``; ``skopeo copy oci:DIR:tag docker://...``; a fresh
    node hits through oci://. Then the other way: skopeo copies the registry's artifact
    into a layout, ``cachectl import`` publishes it; a tampered blob is refused."""
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    key = make_key({"export": 1})
    src = open_store(tmp_path / "src", remote="")  # no remote: a plain local store
    src.put(key, FILES, labels={"model": "m"})
    env = {"CACHECOMPILE_DIR": str(tmp_path / "src"), "CACHECOMPILE_SIGNING_KEY": KEY}
    out = cachectl("export", "--oci", str(tmp_path / "layout"), env=env)
    assert out.returncode == 0 and "OCI image layout" in out.stdout, out
    tag = tag_of(key.digest)
    index = json.loads((tmp_path / "layout" / "index.json").read_text())
    assert [m["annotations"]["org.opencontainers.image.ref.name"]
            for m in index["manifests"]] == [tag]
    _skopeo("copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'layout'}:{tag}",
            f"docker://{reg.address}/team/cc:{tag}")
    assert _files(tiered(tmp_path / "fresh", reg.url()).get(key)) == FILES

    _skopeo("copy", "--src-tls-verify=false", f"docker://{reg.address}/team/cc:{tag}",
            f"oci:{tmp_path / 'back'}:{tag}")
    into = {"CACHECOMPILE_DIR": str(tmp_path / "imported"), "CACHECOMPILE_SIGNING_KEY": KEY}
    got = cachectl("import", str(tmp_path / "back"), env=into)
    assert got.returncode == 0 and "imported 1 entry" in got.stdout, got
    assert _files(open_store(tmp_path / "imported", remote="").get(key)) == FILES
    again = cachectl("import", str(tmp_path / "back"), env=into)
    assert again.returncode == 0 and "1 was there already" in again.stdout, again

    blob = tmp_path / "back" / "blobs" / "sha256" / hashlib.sha256(FILES["kernel.so"]).hexdigest()
    blob.chmod(0o644)
    blob.write_bytes(b"\x7fELF" + b"\0" * 100)
    bad = cachectl("import", str(tmp_path / "back"),
                   env={**into, "CACHECOMPILE_DIR": str(tmp_path / "tampered")})
    assert bad.returncode != 0 and "refused" in bad.stdout, bad
    assert isinstance(open_store(tmp_path / "tampered", remote="").get(key), Miss)


def test_a_malformed_manifest_is_a_miss_and_a_keyed_push_repairs_it(
        tmp_path: Path, reg: Registry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A tag whose manifest leads to no record (its config blob is garbage) is a
    malformed entry, as a torn record is elsewhere: nodes miss; the fleet's keyed
    ``cachectl push`` writes over it; a fresh node then hits."""
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    key = make_key({"torn": 1})
    r = open_remote(reg.url())
    assert isinstance(r, OciRemote)
    garbage = b"not a record"
    sha = hashlib.sha256(garbage).hexdigest()
    r._upload(io.BytesIO(garbage), len(garbage), sha, "put garbage")
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.cachecompile.entry.v1",
        "config": {"mediaType": RECORD_TYPE, "digest": f"sha256:{sha}", "size": len(garbage)},
        "layers": []}).encode()
    conn = __import__("http.client").client.HTTPConnection("127.0.0.1", reg.port, timeout=10)
    conn.request("PUT", f"/v2/team/cc/manifests/{tag_of(key.digest)}", manifest,
                 {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert conn.getresponse().status == 201
    conn.close()
    with caplog.at_level(logging.WARNING):
        assert isinstance(tiered(tmp_path / "a", reg.url()).get(key), Miss)
    assert any("malformed" in w or "corrupt" in w for w in store_warnings(caplog)), \
        store_warnings(caplog)
    open_store(tmp_path / "src", remote="").put(key, FILES)
    env = {"CACHECOMPILE_DIR": str(tmp_path / "src"), "CACHECOMPILE_SIGNING_KEY": KEY}
    pushed = cachectl("push", "--remote", reg.url(), env=env)
    assert pushed.returncode == 0, pushed
    assert _files(tiered(tmp_path / "fresh", reg.url()).get(key)) == FILES


def test_oci_urls_parse_as_docker_reads_them() -> None:
    shown = {u: open_remote(u).config.display for u in (
        "oci://registry.example.com/team/cc", "oci://localhost:5000/a/b",
        "oci+http://10.0.0.5:5000/cc", "oci+https://127.0.0.1:5000/cc")}
    assert shown == {"oci://registry.example.com/team/cc": "oci://registry.example.com/team/cc",
                     "oci://localhost:5000/a/b": "oci://localhost:5000/a/b",
                     "oci+http://10.0.0.5:5000/cc": "oci+http://10.0.0.5:5000/cc",
                     "oci+https://127.0.0.1:5000/cc": "oci+https://127.0.0.1:5000/cc"}
    targets = {u: open_remote(u).config.target for u in shown}
    assert targets["oci://registry.example.com/team/cc"].startswith("https://")
    assert targets["oci://localhost:5000/a/b"].startswith("http://")
    from cachecompile.store import errors

    for bad, why in (("oci://reg/Team/CC", "not a repository name"),
                     ("oci:///cc", "takes a registry"),
                     ("oci://reg/cc?chunk=8M", "blobs go whole"),
                     ("oci://reg/cc?tls=off", "unknown parameters")):
        with pytest.raises(errors.RemoteConfigError, match=why):
            open_remote(bad)


def test_an_image_layout_follows_no_symlink_out(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout one was handed is read as a bundle is: a blob that is a symlink (even to
    the right bytes) is refused, and so is a ``blobs/`` that is one; nothing is published."""
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    key = make_key({"links": 1})
    open_store(tmp_path / "src", remote="").put(key, FILES)
    env = {"CACHECOMPILE_DIR": str(tmp_path / "src"), "CACHECOMPILE_SIGNING_KEY": KEY}
    assert cachectl("export", "--oci", str(tmp_path / "lay"), env=env).returncode == 0
    blob = tmp_path / "lay" / "blobs" / "sha256" / hashlib.sha256(FILES["kernel.so"]).hexdigest()
    outside = tmp_path / "outside.so"
    outside.write_bytes(FILES["kernel.so"])
    blob.unlink()
    blob.symlink_to(outside)
    into = {**env, "CACHECOMPILE_DIR": str(tmp_path / "got")}
    ran = cachectl("import", str(tmp_path / "lay"), env=into)
    assert ran.returncode != 0 and "refused" in ran.stdout, ran
    assert isinstance(open_store(tmp_path / "got", remote="").get(key), Miss)
    # blobs/ itself a link to a copy elsewhere: the layout is refused as a whole.
    blob.unlink()
    blob.write_bytes(FILES["kernel.so"])
    (tmp_path / "lay" / "blobs").rename(tmp_path / "real-blobs")
    (tmp_path / "lay" / "blobs").symlink_to(tmp_path / "real-blobs")
    ran = cachectl("import", str(tmp_path / "lay"), env=into)
    assert ran.returncode != 0, ran
    assert isinstance(open_store(tmp_path / "got", remote="").get(key), Miss)


def test_an_image_layout_keeps_one_manifest_per_entry_and_import_counts_what_it_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a new user's trial: a second export appended every tag again; a layout
    copied without a tag imported nothing and exited 0; so did one whose record blob was
    tampered with; and a directory that is no layout still made the store."""
    monkeypatch.setenv("CACHECOMPILE_SIGNING_KEY", KEY)
    key = make_key({"layout": 1})
    open_store(tmp_path / "src", remote="").put(key, FILES)
    env = {"CACHECOMPILE_DIR": str(tmp_path / "src"), "CACHECOMPILE_SIGNING_KEY": KEY}
    lay = tmp_path / "lay"
    for signing in (KEY, KEY + "-rotated", KEY + "-rotated"):
        out = cachectl("export", "--oci", str(lay), env={**env, "CACHECOMPILE_SIGNING_KEY": signing})
        assert out.returncode == 0, out
        refs = [m["annotations"]["org.opencontainers.image.ref.name"]
                for m in json.loads((lay / "index.json").read_text())["manifests"]]
        assert refs == [tag_of(key.digest)], refs  # once, whatever was exported before
    assert "1 there already" in out.stdout, out  # the third: nothing to rewrite
    into = {**env, "CACHECOMPILE_SIGNING_KEY": KEY + "-rotated"}

    # Copied with no tag: found by the key its manifest carries.
    _skopeo("copy", f"oci:{lay}:{tag_of(key.digest)}", f"oci:{tmp_path / 'untagged'}")
    got = cachectl("import", str(tmp_path / "untagged"),
                   env={**into, "CACHECOMPILE_DIR": str(tmp_path / "a")})
    assert got.returncode == 0 and "imported 1 entry" in got.stdout, got

    # A record kept out of the manifest (as a big one is), then a byte of it flipped.
    index = json.loads((lay / "index.json").read_text())
    desc = index["manifests"][0]
    blobs = lay / "blobs" / "sha256"
    manifest = json.loads((blobs / desc["digest"].split(":")[1]).read_bytes())
    del manifest["config"]["data"]
    raw = json.dumps(manifest).encode()
    (blobs / hashlib.sha256(raw).hexdigest()).write_bytes(raw)
    desc.update(digest="sha256:" + hashlib.sha256(raw).hexdigest(), size=len(raw))
    (lay / "index.json").write_text(json.dumps(index))
    record = blobs / manifest["config"]["digest"].split(":")[1]
    record.write_bytes(record.read_bytes().replace(b'"', b"'", 1))
    bad = cachectl("import", str(lay), env={**into, "CACHECOMPILE_DIR": str(tmp_path / "b")})
    assert bad.returncode == 7 and f"1 refused: {key.digest[:12]}" in bad.stdout, bad

    # A directory that is no layout: a usage error, and no store made for it.
    (tmp_path / "plain").mkdir()
    no = cachectl("import", str(tmp_path / "plain"),
                  env={**into, "CACHECOMPILE_DIR": str(tmp_path / "c")})
    assert no.returncode == 2 and not (tmp_path / "c").exists(), no
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (empty / "index.json").write_text('{"schemaVersion":2,"manifests":[]}')
    none = cachectl("import", str(empty), env={**into, "CACHECOMPILE_DIR": str(tmp_path / "d")})
    assert none.returncode == 7 and "no cachecompile entry" in none.stderr, none
