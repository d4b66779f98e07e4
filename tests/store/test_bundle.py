"""Bundles: export/import round trips, and malicious archives refused whole."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ccutil
import pytest

from cachecompile.store import Hit, Store, bundle, make_key, open_store
from cachecompile.store.bundle import export_bundle, import_bundle
from cachecompile.store.errors import (
    CorruptEntryError,
    StoreError,
    StoreFullError,
    UnsafeArchiveError,
    UntrustedEntryError,
)
from cachecompile.store.signing import Trust

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


@pytest.mark.parametrize("name", ["a\nb.py", "code/x\ry.py", "esc\x1b[31m.py", "del\x7f"])
def test_a_control_character_in_a_file_name_is_refused(tmp_path: Path, name: str) -> None:
    # The store takes such a name (put validates paths, not characters); a bundle may not
    # carry it into another store: a newline forges lines wherever names are listed.
    st = open_store(tmp_path / "src")
    e = st.put(make_key({"nl": name}), {name: b"x", "ok.py": b"y"})
    out = tmp_path / "b.tar.zst"
    export_bundle(st, out, [e.key])
    dst = open_store(tmp_path / "dst")
    with pytest.raises(UnsafeArchiveError, match="control character"):
        import_bundle(dst, out)
    assert list(dst.maintenance().digests()) == []


@pytest.mark.parametrize("name", ["warm.tar.zst", "warm.tar.gz", "warm.tar"])
def test_a_truncated_bundle_says_it_is_truncated(tmp_path: Path, name: str) -> None:
    st = open_store(tmp_path / "src")
    keys = [st.put(make_key({"t": i}), {"big.bin": bytes(range(256)) * 2000 + bytes([i])}).key
            for i in range(3)]
    out = tmp_path / name
    export_bundle(st, out, keys)
    whole = out.read_bytes()
    # Cut anywhere before the last entry's data ends (a cut in the end-of-archive padding
    # leaves every entry whole and verified, and imports).
    for n in (1, 10, 200, len(whole) // 3, len(whole) // 2, len(whole) * 9 // 10):
        cut = tmp_path / f"cut-{n}-{name}"
        cut.write_bytes(whole[:n])
        dst = open_store(tmp_path / f"dst-{n}-{name}")
        with pytest.raises(UnsafeArchiveError) as caught:
            import_bundle(dst, cut)
        assert "truncated" in str(caught.value), (n, str(caught.value))
        assert list(dst.maintenance().digests()) == []
    empty = tmp_path / f"empty-{name}"
    empty.write_bytes(b"")
    with pytest.raises(UnsafeArchiveError, match="empty \\(0 bytes\\)"):
        import_bundle(open_store(tmp_path / "dst-empty"), empty)


def test_cachectl_export_import(tmp_path: Path, src: Store, child_env: dict[str, str]) -> None:
    def cachectl(*args: str) -> ccutil.Ran:
        return ccutil.cachectl(*args, env=child_env)

    out = tmp_path / "llama.tar.zst"
    p = cachectl("export", "--cache-dir", str(src.root), str(out), "--model", "llama")
    assert p.returncode == 0 and "exported 1 entry" in p.stdout, p.stderr
    p = cachectl("import", "--cache-dir", str(tmp_path / "dst"), str(out))
    assert p.returncode == 0 and "imported 1 entry" in p.stdout, p.stderr
    p = cachectl("ls", "--cache-dir", str(tmp_path / "dst"), "--json")
    assert [r["labels"]["model"] for r in json.loads(p.stdout)] == ["llama"]
    evil = _write(tmp_path / "evil.tar.gz", [_file("../evil", b"x")])
    p = cachectl("import", "--cache-dir", str(tmp_path / "dst2"), str(evil))
    assert p.returncode == 7 and "'..'" in p.stderr and "Traceback" not in p.stderr
    p = cachectl("export", "--cache-dir", str(src.root), str(tmp_path / "x.zip"))
    assert p.returncode == 2


# -- deduplicated blobs ---------------------------------------------------------------
def test_entries_sharing_blobs_round_trip(tmp_path: Path) -> None:
    """The store keeps one blob per content (hard links). Four rank entries with the same
    kernels used to be exported as tar hard links, which import refuses."""
    st = open_store(tmp_path / "src")
    for rank in range(4):
        st.put(make_key({"m": "llama", "rank": rank}), FILES, labels={"rank": str(rank)})
    links = [p for p in (tmp_path / "src").rglob("kernel.so") if p.stat().st_nlink > 1]
    assert links, "the store is expected to dedup identical files"
    out = tmp_path / "ranks.tar.zst"
    export_bundle(st, out, digests(st))  # type: ignore[arg-type]
    assert all(m.isreg() for m, _ in _members(out) if "/data/" in m.name)
    dst = open_store(tmp_path / "dst")
    assert len(import_bundle(dst, out).entries) == 4
    for d in digests(dst):  # type: ignore[arg-type]
        hit = dst.get(d)
        assert isinstance(hit, Hit)
        assert hit.entry.files["kernel.so"].read_bytes() == FILES["kernel.so"]


# -- what an import may write ---------------------------------------------------------
class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def _bomb(tmp_path: Path, src: Store, how: str) -> Path:
    """A small .tar.zst that would expand to 1 GiB: valid index and records, then a
    member that lies about (or pads) its size."""
    import zstandard

    good = tmp_path / "good.tar.zst"
    export_bundle(src, good, digests(src))
    members = _members(good)
    first_data = next(i for i, (m, _) in enumerate(members) if "/data/" in m.name)
    name = members[first_data][0].name
    out = tmp_path / f"bomb-{how}.tar.zst"
    with open(out, "wb") as fh, zstandard.ZstdCompressor(level=1).stream_writer(fh) as zw, \
            tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        for m, data in members[:first_data]:
            tf.addfile(m, io.BytesIO(data or b""))
        if how == "data":    # the file, 1 GiB where its manifest says a few KiB
            big = tarfile.TarInfo(name)
            big.size = 1 << 30
            tf.addfile(big, _Zeros(big.size))
        elif how == "pax":   # a 4 MiB PAX header, which tarfile would read into memory
            m, data = members[first_data]
            m.pax_headers = {"comment": "x" * (4 << 20)}
            tf.addfile(m, io.BytesIO(data or b""))
        elif how == "unlisted":  # an entry the index does not list
            big = tarfile.TarInfo(f"{'f' * 32}/data/x")
            big.size = 1 << 30
            tf.addfile(big, _Zeros(big.size))
    assert out.stat().st_size < 2 << 20, out.stat().st_size
    return out


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every byte any store module writes into a file (staging and blobs alike)."""
    from cachecompile.store import blobs, fsutil, publishing

    written: list[int] = []
    real = fsutil.write_new_file

    def counting(path: Path, chunks: Any, mode: int) -> None:
        def counted() -> Any:
            for c in chunks:
                written.append(len(c))
                yield c
        real(path, counted(), mode)

    for mod in (bundle, blobs, publishing):
        monkeypatch.setattr(mod, "write_new_file", counting)
    return written


@pytest.mark.parametrize("how", ["data", "pax", "unlisted"])
@pytest.mark.parametrize("key", [None, b"k1"])
def test_a_decompression_bomb_writes_nothing(tmp_path: Path, src: Store, how: str,
                                             key: bytes | None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = _bomb(tmp_path, src, how)
    written = _count_writes(monkeypatch)
    dst = open_store(tmp_path / "dst")
    trust = Trust(key=key, accept_unsigned=key is None)
    with pytest.raises(StoreError) as err:
        import_bundle(dst, bomb, trust=trust)
    assert sum(written) < 1 << 20, f"an import of a refused bundle wrote {sum(written)} bytes"
    if key is not None:
        assert isinstance(err.value, UntrustedEntryError), err.value  # refused at its record
    assert digests(dst) == []  # type: ignore[arg-type]
    assert list((tmp_path / "dst" / "v1" / "tmp").iterdir()) == []


def test_import_refuses_when_the_disk_would_fill(tmp_path: Path, src: Store,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "b.tar.zst"
    export_bundle(src, out, digests(src))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(bundle.shutil, "disk_usage",
                        lambda p: usage._replace(free=(64 << 20) + 100))
    with pytest.raises(StoreFullError, match="free"):
        import_bundle(open_store(tmp_path / "dst"), out)


def test_a_bundle_with_every_record_first_cannot_fill_the_disk(
        tmp_path: Path, src: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each record alone fits in what is free; all of them together do not. Before the
    # fix, the check saw one record at a time and the files then filled the disk.
    src.put(make_key({"m": "big"}), {"w.bin": b"w" * 60_000}, labels={"model": "big"})
    src.put(make_key({"m": "big2"}), {"w.bin": b"v" * 60_000}, labels={"model": "big2"})
    good = tmp_path / "b.tar.zst"
    export_bundle(src, good, digests(src))
    members = _members(good)
    index = [mb for mb in members if "/" not in mb[0].name and not mb[0].isdir()]
    records = [mb for mb in members if mb[0].isdir() or mb[0].name.endswith("/record.json")]
    files = [mb for mb in members if mb not in index and mb not in records]
    assert len(index) == 1 and len(records) >= 4 and files
    reordered = _write(tmp_path / "records-first.tar.gz", index + records + files)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(bundle.shutil, "disk_usage",
                        lambda p: usage._replace(free=(64 << 20) + 80_000))
    dst = open_store(tmp_path / "dst")
    with pytest.raises(StoreFullError, match="nothing was imported"):
        import_bundle(dst, reordered)
    assert digests(dst) == []  # type: ignore[arg-type]
    assert list((tmp_path / "dst" / "v1" / "tmp").iterdir()) == []


def test_disk_full_during_import_is_exit_6(tmp_path: Path, src: Store,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from click.testing import CliRunner

    from cachecompile.cli.main import cli

    out = tmp_path / "b.tar.zst"
    export_bundle(src, out, digests(src))
    open_store(tmp_path / "dst")

    def full(path: Path, chunks: Any, mode: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(bundle, "write_new_file", full)
    r = CliRunner().invoke(cli, ["import", "--cache-dir", str(tmp_path / "dst"), str(out)])
    assert r.exit_code == 6, r.output
    assert "filled up" in r.output


# -- one copy on disk, all or nothing -------------------------------------------------
def test_an_import_writes_its_files_once(tmp_path: Path, src: Store,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, the staged copy was copied again into tmp/blob.* by put: twice the bytes,
    # and the free space check counted only one of them.
    out = tmp_path / "b.tar.zst"
    export_bundle(src, out, digests(src))
    dst = open_store(tmp_path / "dst")
    written = _count_writes(monkeypatch)
    rep = import_bundle(dst, out)
    manifests = sum((tmp_path / "dst" / "v1" / "entries" / d[:2] / d / "manifest.json")
                    .stat().st_size for d in rep.entries)
    assert len(rep.entries) == 2 and sum(written) == rep.bytes + manifests, (
        f"{sum(written)} bytes written for {rep.bytes} bytes of files")
    for d in rep.entries:
        hit = dst.get(d)
        assert isinstance(hit, Hit)
        for p in hit.entry.files.values():
            assert p.stat().st_nlink == 2  # the blob and this entry: the staged inode
            assert p.stat().st_mode & 0o777 in (0o400, 0o500)
    assert list((tmp_path / "dst" / "v1" / "tmp").iterdir()) == []


def test_a_put_failing_mid_import_leaves_nothing_published(
        tmp_path: Path, src: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from cachecompile.store import publishing

    out = tmp_path / "b.tar.zst"
    export_bundle(src, out, digests(src))
    dst = open_store(tmp_path / "dst")
    real = publishing.publish
    calls: list[str] = []

    def second_fills_the_disk(*a: Any, **kw: Any) -> Any:
        calls.append("put")
        if len(calls) == 2:  # the disk filled from elsewhere between the two puts
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(publishing, "publish", second_fills_the_disk)
    with pytest.raises(StoreFullError, match="nothing was imported"):
        import_bundle(dst, out)
    assert len(calls) == 2  # the first entry was published, then taken back
    assert digests(dst) == []  # type: ignore[arg-type]
    assert list((tmp_path / "dst" / "v1" / "tmp").iterdir()) == []


@contextlib.contextmanager
def _tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A real file system of ``size_mib`` MiB (root only; the test skips otherwise)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the one-copy import is also "
                    "checked by test_an_import_writes_its_files_once)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs",
                        str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_an_import_fits_a_small_disk_with_one_copy(tmp_path: Path) -> None:
    """The issue's case, on a real 150 MiB file system: an 80 MiB entry passes the check
    (80 + 64 MiB reserve <= 150) and then needs no second copy (160 would not fit); a
    bundle of two such entries is refused before anything is published."""
    mib = 1 << 20
    st = open_store(tmp_path / "src")
    big = (bytes(range(256)) * 4096) * 80  # 80 MiB that zstd makes small
    st.put(make_key({"m": "big"}), {"w.bin": big})
    one = tmp_path / "one.tar.zst"
    export_bundle(st, one, digests(st))  # type: ignore[arg-type]
    st.put(make_key({"m": "big2"}), {"w.bin": big[:-1] + b"!"})
    two = tmp_path / "two.tar.zst"
    export_bundle(st, two, digests(st))  # type: ignore[arg-type]
    assert two.stat().st_size < mib
    with _tmpfs(tmp_path / "disk", 150) as disk:
        dst = open_store(disk / "cache")
        with pytest.raises(StoreFullError, match="nothing was imported"):
            import_bundle(dst, two)
        assert digests(dst) == []  # type: ignore[arg-type]
        assert shutil.disk_usage(disk).used < 2 * mib
        rep = import_bundle(dst, one)
        assert len(rep.entries) == 1
        used = shutil.disk_usage(disk).used
        assert 80 * mib <= used < 82 * mib, f"{used / mib:.1f} MiB used for 80 MiB"
        hit = dst.get(rep.entries[0])
        assert isinstance(hit, Hit) and hit.entry.files["w.bin"].stat().st_size == 80 * mib
