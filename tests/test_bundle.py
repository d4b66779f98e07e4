"""Bundles: export/import round trips, and malicious archives refused whole."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from store import Hit, Store, make_key, open_store
from store.bundle import export_bundle, import_bundle
from store.errors import CorruptEntryError, StoreError, UnsafeArchiveError, UntrustedEntryError
from store.signing import Trust

FILES = {"kernel.so": b"\x7fELF" + bytes(range(256)) * 64, "code/program.py": b"x = 1\n"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CACHECOMPILE_REMOTE", "CACHECOMPILE_SIGNING_KEY", "CACHECOMPILE_TRUST_REMOTE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def src(tmp_path: Path) -> Store:
    st = open_store(tmp_path / "src")
    assert isinstance(st, Store)
    st.put(make_key({"m": "llama", "sig": 1}), FILES, labels={"model": "llama"},
           meta={"compile_s": 3.0})
    st.put(make_key({"m": "mlp"}), {"a.bin": b"a" * 1000}, labels={"model": "mlp"})
    return st


def digests(st: Store) -> list[str]:
    return sorted(i.key for i in st.entries())


@pytest.mark.parametrize("name", ["warm.tar.zst", "warm.tar.gz"])
def test_round_trip(tmp_path: Path, src: Store, name: str) -> None:
    out = tmp_path / name
    rep = export_bundle(src, out, digests(src))
    assert len(rep.entries) == 2 and out.stat().st_size > 0
    dst = open_store(tmp_path / "dst")
    got = import_bundle(dst, out)
    assert sorted(got.entries) == digests(src) == digests(dst)  # type: ignore[arg-type]
    for d in digests(src):
        a, b = src.get(d), dst.get(d)
        assert isinstance(a, Hit) and isinstance(b, Hit)
        assert {n: p.read_bytes() for n, p in a.entry.files.items()} == \
               {n: p.read_bytes() for n, p in b.entry.files.items()}
        assert (a.entry.factors, a.entry.labels, a.entry.meta) == \
               (b.entry.factors, b.entry.labels, b.entry.meta)
    again = import_bundle(dst, out)
    assert again.entries == [] and len(again.skipped) == 2


def test_signed_bundles(tmp_path: Path, src: Store) -> None:
    out = tmp_path / "signed.tar.zst"
    export_bundle(src, out, digests(src), trust=Trust(key=b"k1"))
    import_bundle(open_store(tmp_path / "ok"), out, trust=Trust(key=b"k1"))
    with pytest.raises(UntrustedEntryError, match="signature does not match"):
        import_bundle(open_store(tmp_path / "bad"), out, trust=Trust(key=b"k2"))
    assert digests(open_store(tmp_path / "bad")) == []  # type: ignore[arg-type]
    unsigned = tmp_path / "unsigned.tar.zst"
    export_bundle(src, unsigned, digests(src), trust=Trust())
    with pytest.raises(UntrustedEntryError, match="not signed"):
        import_bundle(open_store(tmp_path / "bad2"), unsigned, trust=Trust(key=b"k1"))


def _members(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    import zstandard

    raw = zstandard.ZstdDecompressor().stream_reader(bundle.open("rb")).read()
    out = []
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m)
            out.append((m, f.read() if f else None))
    return out


def _write(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    m = tarfile.TarInfo(name)
    m.size = len(data)
    return m, data


def _special(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, None]:
    m = tarfile.TarInfo(name)
    m.type = kind
    m.linkname = link
    return m, None


@pytest.mark.parametrize("evil", ["dotdot", "absolute", "symlink", "hardlink", "device", "fifo",
                                  "tampered", "extra-file", "duplicate"])
def test_malicious_bundle_is_refused_whole(tmp_path: Path, src: Store, evil: str) -> None:
    good = tmp_path / "good.tar.zst"
    export_bundle(src, good, digests(src))
    members = _members(good)
    first = digests(src)[0]
    data_member = next(i for i, (m, _) in enumerate(members) if "/data/" in m.name)
    if evil == "dotdot":
        members.append(_file(f"{first}/data/../../../x", b"pwned"))
    elif evil == "absolute":
        members.append(_file("/tmp/cachecompile-pwned", b"pwned"))
    elif evil == "symlink":
        members.append(_special(f"{first}/data/evil", tarfile.SYMTYPE, "/etc/passwd"))
    elif evil == "hardlink":
        members.append(_special(f"{first}/data/evil", tarfile.LNKTYPE, "/etc/passwd"))
    elif evil == "device":
        members.append(_special(f"{first}/data/evil", tarfile.CHRTYPE))
    elif evil == "fifo":
        members.append(_special(f"{first}/data/evil", tarfile.FIFOTYPE))
    elif evil == "tampered":
        m, data = members[data_member]
        assert data
        members[data_member] = (m, bytes([data[0] ^ 1]) + data[1:])
    elif evil == "extra-file":
        members.append(_file(f"{first}/data/unlisted.py", b"import os"))
    elif evil == "duplicate":
        m, data = members[data_member]
        assert data
        members.append((m, b"y" * len(data)))
    bad = _write(tmp_path / "bad.tar.gz", members)
    dst = open_store(tmp_path / "dst")
    with pytest.raises((UnsafeArchiveError, CorruptEntryError)):
        import_bundle(dst, bad)
    assert digests(dst) == []  # type: ignore[arg-type]  # nothing, not even the good entries
    assert list((tmp_path / "dst" / "v1" / "tmp").iterdir()) == []
    assert not Path("/tmp/cachecompile-pwned").exists()
    assert not (tmp_path / "x").exists()


def test_not_a_bundle(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar.zst"
    junk.write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage" * 100)
    with pytest.raises(StoreError):
        import_bundle(open_store(tmp_path / "dst"), junk)
    plain = _write(tmp_path / "plain.tar.gz", [_file("readme.txt", b"hi")])
    with pytest.raises(UnsafeArchiveError, match="unexpected member"):
        import_bundle(open_store(tmp_path / "dst"), plain)


def test_cachectl_export_import(tmp_path: Path, src: Store, child_env: dict[str, str]) -> None:
    def cachectl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "store.cli", *args], env=child_env,
                              capture_output=True, text=True, timeout=60)

    out = tmp_path / "llama.tar.zst"
    p = cachectl("export", "--cache-dir", str(src.root), str(out), "--model", "llama")
    assert p.returncode == 0 and "exported 1 entries" in p.stdout, p.stderr
    p = cachectl("import", "--cache-dir", str(tmp_path / "dst"), str(out))
    assert p.returncode == 0 and "imported 1 entries" in p.stdout, p.stderr
    p = cachectl("ls", "--cache-dir", str(tmp_path / "dst"), "--json")
    assert [r["labels"]["model"] for r in json.loads(p.stdout)] == ["llama"]
    evil = _write(tmp_path / "evil.tar.gz", [_file("../evil", b"x")])
    p = cachectl("import", "--cache-dir", str(tmp_path / "dst2"), str(evil))
    assert p.returncode == 7 and "'..'" in p.stderr and "Traceback" not in p.stderr
    p = cachectl("export", "--cache-dir", str(src.root), str(tmp_path / "x.zip"))
    assert p.returncode == 2
