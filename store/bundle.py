"""Bundles: entries, manifests and signatures in one ``.tar.zst`` (or ``.tar.gz``) file,
so that a container image can ship a warm cache.

Archive layout (members in this order)::

    cachecompile-bundle.json          {"format": 1, "entries": [<digest>, ...]}
    <digest>/record.json              the signed record (cachecompile.store.signing), as the remote keeps it
    <digest>/data/<name>              the entry's files

Every file is a regular member, even where the store shares one blob between entries
(export never writes tar hard links).

Import is all or nothing: every member is checked as it streams in (a relative path
without ``..``, a regular file or directory: no symlink, hard link, device or FIFO, no
name twice), staged under the store's ``tmp/``, then every entry is verified (record,
signature policy, exact file set, size, SHA-256 and XXH3-128). Only when all of them pass
is anything published, each entry through the store's normal atomic ``put``, which takes
the staged files by hard link (:class:`~cachecompile.store.protocol.Owned`): the import
holds one copy of the bundle's files on disk, never two. Should a put fail after all
(the disk filled from elsewhere, an I/O error), the entries this import already
published are deleted again before the error is raised: an import leaves all its
entries or none.

What an import writes is bounded before it is written: the index comes first and lists
the entries; each entry's record comes before its files and is parsed and its signature
checked first; a file is written only if its manifest lists it, at exactly the declared
size, and only while the store's file system keeps 64 MiB free once every accepted
record's files are written (StoreFullError otherwise); publishing adds no second copy. The decompressed stream
itself may not run past what the accepted members declare (headers included), so a
small archive cannot expand into gigabytes on disk or in memory.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import xxhash

from . import errors
from .fsutil import FULL_ERRNOS, rmtree_quiet, temp_name, write_new_file
from .keys import Key, is_digest
from .manifest import validate_name
from .outcomes import Hit
from .protocol import DiskStorage, Owned
from .signing import Record, Trust, make_record, parse_record, sha256_file

logger = logging.getLogger(__name__)

__all__ = ["BundleReport", "export_bundle", "import_bundle", "compression_of"]

INDEX = "cachecompile-bundle.json"
BUNDLE_FORMAT = 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"

Progress = Callable[[int], None]


@dataclass
class BundleReport:
    entries: list[str] = field(default_factory=list)
    bytes: int = 0  # logical bytes of the entries' files
    skipped: list[str] = field(default_factory=list)  # already present (import)
    seconds: float = 0.0


def compression_of(path: Path | str) -> str:
    """``zstd``, ``gzip`` or ``none`` from the file name (export)."""
    name = str(path).lower()
    if name.endswith((".tar.zst", ".tzst", ".tar.zstd")):
        return "zstd"
    if name.endswith((".tar.gz", ".tgz")):
        return "gzip"
    if name.endswith(".tar"):
        return "none"
    raise errors.StoreInputError(f"{path}: name the bundle .tar.zst, .tar.gz or .tar")


class _Counting(io.RawIOBase):
    """A read-only file wrapper that reports bytes read (progress over the compressed file)."""

    def __init__(self, f: IO[bytes], progress: Progress | None) -> None:
        self._f = f
        self._progress = progress

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        if self._progress is not None and n:
            self._progress(n)
        return n


# -- export ----------------------------------------------------------------------------
def export_bundle(st: DiskStorage, out: Path | str, digests: Iterable[str], *,
                  trust: Trust | None = None, progress: Progress | None = None,
                  level: int = 3) -> BundleReport:
    """Write the entries ``digests`` of ``st`` to ``out`` (atomically: temp file, rename).

    ``progress`` gets the number of file bytes added as they are added.
    """
    out = Path(out)
    comp = compression_of(out)
    trust = trust if trust is not None else Trust.from_env()
    report = BundleReport()
    t0 = time.perf_counter()
    todo = list(dict.fromkeys(digests))
    tmp = out.with_name(f".{out.name}.{temp_name('export')}")
    try:
        with open(tmp, "xb") as fh:
            with _tar_writer(fh, comp, level) as tf:
                _add_bytes(tf, INDEX, json.dumps(
                    {"format": BUNDLE_FORMAT, "entries": todo}, indent=1).encode())
                for d in todo:
                    hit = st.peek(d)
                    if not isinstance(hit, Hit):
                        raise errors.KeyNotFound(f"cannot export {d}: {hit.reason}")
                    entry = hit.entry
                    names = sorted(entry.files)
                    sha = {n: sha256_file(entry.files[n]) for n in names}
                    rec = make_record(entry.manifest, sha, {}, trust)
                    _add_bytes(tf, f"{d}/record.json", rec.to_bytes())
                    for n in names:
                        # A regular member for every file, never a tar hard link: the
                        # store dedups blobs by hard link, and import refuses links.
                        with open(entry.files[n], "rb") as f:
                            fst = os.fstat(f.fileno())
                            info = tarfile.TarInfo(f"{d}/data/{n}")
                            info.size = fst.st_size
                            info.mtime = int(fst.st_mtime)
                            info.mode = 0o500 if fst.st_mode & 0o100 else 0o400
                            tf.addfile(info, _Counting(f, progress))
                    report.entries.append(d)
                    report.bytes += entry.size_bytes
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    report.seconds = time.perf_counter() - t0
    return report


@contextlib.contextmanager
def _tar_writer(fh: IO[bytes], comp: str, level: int) -> Iterator[tarfile.TarFile]:
    if comp == "zstd":
        import zstandard  # deferred: only bundle users pay for it

        cctx = zstandard.ZstdCompressor(level=level, threads=-1)
        with cctx.stream_writer(fh, closefd=False) as zw:
            with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                yield tf
    elif comp == "gzip":
        with tarfile.open(fileobj=fh, mode="w|gz", format=tarfile.PAX_FORMAT) as tf:
            yield tf
    else:
        with tarfile.open(fileobj=fh, mode="w|", format=tarfile.PAX_FORMAT) as tf:
            yield tf


def _add_bytes(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o400
    info.mtime = int(time.time())
    tf.addfile(info, io.BytesIO(data))


# -- import ----------------------------------------------------------------------------
def _safe_member(m: tarfile.TarInfo) -> tuple[str, str, str]:  # noqa: C901 (today's exception: one refusal per kind of unsafe member)
    """(digest, kind, rest) of an allowed member, else UnsafeArchiveError.

    kind is "index", "record", "data" or "dir".
    """
    name = m.name
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        raise errors.UnsafeArchiveError(f"member {name!r} has an absolute or odd path")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        # A newline or escape in a name forges lines in logs and listings, and no entry
        # cachecompile writes has one.
        raise errors.UnsafeArchiveError(f"member {name!r} has a control character in its name")
    parts = name.rstrip("/").split("/") if m.isdir() else name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise errors.UnsafeArchiveError(f"member {name!r} has an empty, '.' or '..' component")
    if m.issym() or m.islnk():
        raise errors.UnsafeArchiveError(f"member {name!r} is a link (to {m.linkname!r})")
    if m.ischr() or m.isblk() or m.isfifo() or m.isdev():
        raise errors.UnsafeArchiveError(f"member {name!r} is a device or FIFO")
    if m.isdir():
        if not is_digest(parts[0]) or len(parts) > 1 and parts[1] != "data":
            raise errors.UnsafeArchiveError(f"unexpected directory {name!r}")
        return parts[0], "dir", ""
    if not m.isreg():
        raise errors.UnsafeArchiveError(f"member {name!r} is not a regular file")
    if parts == [INDEX]:
        return "", "index", ""
    if len(parts) >= 2 and is_digest(parts[0]):
        if parts[1:] == ["record.json"]:
            return parts[0], "record", ""
        if parts[1] == "data" and len(parts) >= 3:
            rest = "/".join(parts[2:])
            try:
                validate_name(rest)
            except errors.UnsafePathError as e:
                raise errors.UnsafeArchiveError(f"member {name!r}: {e}") from None
            return parts[0], "data", rest
    raise errors.UnsafeArchiveError(f"unexpected member {name!r}")


# What an import may read, beyond the files its records declare: the index, each
# record, and tar headers (PAX headers included) with their block padding.
_INDEX_MAX = 1 << 20
_RECORD_MAX = 16 << 20
_HEADER_ALLOWANCE = 64 << 10
# Free space an import leaves on the store's file system.
_FREE_RESERVE = 64 << 20


class _Bounded(io.RawIOBase):
    """The decompressed tar stream, refused once it runs past ``allowance`` bytes.

    The allowance grows only as members are accepted (by their checked sizes), so a
    small archive cannot expand into gigabytes: not in a member's data, and not in a
    header that tarfile would read into memory.
    """

    def __init__(self, f: IO[bytes], src: str) -> None:
        self._f = f
        self._src = src
        self.used = 0
        self.allowance = _INDEX_MAX + _HEADER_ALLOWANCE

    def readable(self) -> bool:
        return True

    def grant(self, n: int) -> None:
        self.allowance += -(-n // 512) * 512 + _HEADER_ALLOWANCE

    def readinto(self, b: Any) -> int:
        # Read at most one byte past the allowance: enough to prove the excess.
        want = min(len(b), self.allowance - self.used + 1)
        data = self._f.read(want) if want > 0 else b""
        n = len(data)
        self.used += n
        if self.used > self.allowance:
            raise errors.UnsafeArchiveError(
                f"{self._src} expands beyond what its manifests declare (refused after "
                f"{self.used} bytes)")
        b[:n] = data
        return n


def _decompressed(fh: IO[bytes], head: bytes) -> IO[bytes]:
    """The tar stream inside ``fh``; the compression comes from the magic bytes ``head``."""
    if head.startswith(_ZSTD_MAGIC):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(fh, closefd=False)
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    return fh


@dataclass
class _Staged:
    record: Record | None = None
    files: dict[str, Path] = field(default_factory=dict)


def _stage(tf: tarfile.TarFile, staging: Path, bound: _Bounded,  # noqa: C901 (today's exception: the bundle's order checks, member by member)
           trust: Trust) -> tuple[list[str] | None, dict[str, _Staged]]:
    """Stream members into ``staging``. The index comes first, each entry's record
    before its files; a record is parsed and its signature checked before any of its
    files is written, and a file is written only at the size its manifest declares."""
    seen: set[str] = set()
    index: list[str] | None = None
    listed: set[str] = set()
    staged: dict[str, _Staged] = {}
    n = 0
    # Bytes the accepted records declare that are not written yet: the free space check
    # counts them, or a bundle with every record before every file would pass each
    # record's check alone and then fill the disk.
    promised = 0
    for m in tf:
        digest, kind, rest = _safe_member(m)
        key = m.name.rstrip("/")
        if key in seen:
            raise errors.UnsafeArchiveError(f"member {m.name!r} appears twice")
        seen.add(key)
        if kind == "dir":
            bound.grant(0)
            continue
        if kind != "index" and digest not in listed:
            raise errors.UnsafeArchiveError(
                f"member {m.name!r} is not an entry listed by a preceding {INDEX}")
        if kind == "index":
            limit = _INDEX_MAX
        elif kind == "record":
            limit = _RECORD_MAX
        else:
            limit = _declared_size(staged.get(digest), digest, rest)
            if m.size != limit:
                raise errors.UnsafeArchiveError(
                    f"member {m.name!r} is {m.size} bytes; its manifest says {limit}")
        if m.size > limit:
            raise errors.UnsafeArchiveError(
                f"member {m.name!r} is {m.size} bytes; at most {limit} expected")
        bound.grant(m.size)
        src = tf.extractfile(m)
        if src is None:
            raise errors.UnsafeArchiveError(f"member {m.name!r} has no data")
        if kind == "index":
            try:
                doc = json.loads(src.read(_INDEX_MAX))
                index = [str(d) for d in doc["entries"]]
                if doc.get("format") != BUNDLE_FORMAT:
                    raise ValueError(f"format {doc.get('format')!r}")
            except (ValueError, KeyError, TypeError) as e:
                raise errors.UnsafeArchiveError(f"{INDEX} is malformed: {e}") from None
            listed = set(index)
            continue
        s = staged.setdefault(digest, _Staged())
        if kind == "record":
            if s.record is not None or s.files:
                raise errors.UnsafeArchiveError(f"entry {digest}: record out of order")
            try:
                rec = parse_record(src.read(_RECORD_MAX), digest)
            except errors.ManifestError as e:
                raise errors.UnsafeArchiveError(f"entry {digest}: {e}") from None
            # Refused before a byte of its files is written (with a key set: signed only).
            trust.check(rec.body, rec.sig, digest)
            _check_space(staging, promised + rec.size_bytes)
            promised += rec.size_bytes
            s.record = rec
            continue
        # Our own flat file names: the archive's names never become paths on disk.
        n += 1
        target = staging / f"f{n}"
        # Keep the executable bit (put() carries it into the store), nothing else.
        mode = 0o700 if m.mode & 0o100 else 0o600
        write_new_file(target, iter(functools.partial(src.read, 1 << 20), b""), mode)
        promised -= m.size
        s.files[rest] = target
    return index, staged


# What tarfile says when its stream stops short. A compressed bundle cut anywhere in its
# first block decompresses to nothing at all: tarfile's "empty file".
_SHORT = ("empty file", "unexpected end of data", "truncated header")


def _unreadable(src: Path | str, e: BaseException) -> str:
    """Why the bundle ``src`` cannot be read, in words that say what to do."""
    try:
        size = os.path.getsize(src)
    except OSError:
        size = -1
    if size == 0:
        return f"{src} is empty (0 bytes): not a bundle"
    if isinstance(e, EOFError) or str(e) in _SHORT:
        return (f"{src} is truncated or corrupt: it ends before the bundle does ({e}, after "
                f"{size} bytes); copy or export it again")
    return f"{src} is not a readable bundle: {e}"


def _declared_size(s: _Staged | None, digest: str, name: str) -> int:
    if s is None or s.record is None:
        raise errors.UnsafeArchiveError(f"entry {digest}: file {name!r} comes before its record")
    frec = s.record.manifest["files"].get(name)
    if frec is None:
        raise errors.UnsafeArchiveError(f"entry {digest}: file {name!r} is not in its manifest")
    return int(frec["size"])


def _check_space(staging: Path, need: int) -> None:
    """StoreFullError unless ``need`` more bytes leave the reserve free."""
    free = shutil.disk_usage(staging).free
    if need + _FREE_RESERVE > free:
        raise errors.StoreFullError(
            f"the bundle's entries need {need} more bytes; {free} are free under "
            f"{staging.parent} (an import leaves {_FREE_RESERVE >> 20} MiB free); nothing "
            "was imported")


def _verify(digest: str, s: _Staged) -> Record:
    rec = s.record
    if rec is None:
        raise errors.UnsafeArchiveError(f"entry {digest} has no record.json")
    want = set(rec.manifest["files"])
    if set(s.files) != want:
        extra = sorted(set(s.files) - want)
        missing = sorted(want - set(s.files))
        raise errors.UnsafeArchiveError(f"entry {digest}: files do not match its manifest "
                                        f"(extra {extra}, missing {missing})")
    for name, frec in rec.manifest["files"].items():
        path = s.files[name]
        sha = hashlib.sha256()
        xx = xxhash.xxh3_128()
        size = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
                xx.update(chunk)
                size += len(chunk)
        if (size != frec["size"] or sha.hexdigest() != rec.sha256[name]
                or xx.hexdigest() != frec["xxh3_128"]):
            raise errors.CorruptEntryError(digest, f"file {name!r} fails its checksums")
    return rec


def import_bundle(st: DiskStorage, src: Path | str, *, trust: Trust | None = None,
                  progress: Progress | None = None) -> BundleReport:
    """Verify every entry of the bundle ``src``, then publish them all into ``st``.

    Raises UnsafeArchiveError, CorruptEntryError or UntrustedEntryError (nothing is
    published then). Without ``CACHECOMPILE_SIGNING_KEY`` unsigned bundles are accepted
    (you chose the file); with it, every entry must carry a valid signature.
    ``progress`` gets compressed bytes read.
    """
    if st.readonly:
        raise errors.ReadOnlyStoreError(f"cannot import into {st.root}: it is read-only")
    if trust is None:
        env = Trust.from_env()
        trust = Trust(key=env.key, accept_unsigned=True)
    report = BundleReport()
    t0 = time.perf_counter()
    # Through the store's check: a symlinked tmp/ would stage the archive outside it.
    staging = st.staging_dir("import", mode=0o700)
    try:
        with open(src, "rb") as raw:
            head = raw.read(4)
            raw.seek(0)
            try:
                stream = _decompressed(_Counting(raw, progress), head)  # type: ignore[arg-type]
                bound = _Bounded(stream, str(src))
                with tarfile.open(fileobj=bound, mode="r|") as tf:
                    index, staged = _stage(tf, staging, bound, trust)
            except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise errors.UnsafeArchiveError(_unreadable(src, e)) from None
            except OSError as e:
                if e.errno in FULL_ERRNOS:
                    raise errors.StoreFullError(
                        f"the disk under {st.root} filled up while importing {src} "
                        f"({e.strerror}); nothing was imported") from None
                raise
            except Exception as e:
                if type(e).__module__.startswith("zstandard"):  # ZstdError: not importable up front
                    raise errors.UnsafeArchiveError(f"{src} is corrupt: {e}") from None
                raise
        if index is None:
            raise errors.UnsafeArchiveError(f"{src} has no {INDEX}: not a cachecompile bundle")
        if sorted(index) != sorted(staged):
            if set(staged) < set(index):
                raise errors.UnsafeArchiveError(
                    f"{src} is truncated: it ends before {len(set(index) - set(staged))} of "
                    f"the {len(index)} entries its index lists; export it again")
            raise errors.UnsafeArchiveError(f"{src}: its index does not list exactly the "
                                            "entries it holds")
        records = {d: _verify(d, staged[d]) for d in index}
        _publish(st, src, index, records, staged, report)
    finally:
        rmtree_quiet(staging)
    report.seconds = time.perf_counter() - t0
    logger.info("imported %d entries (%d skipped) from %s", len(report.entries),
                len(report.skipped), src)
    return report


def _publish(st: DiskStorage, src: Path | str, index: list[str], records: dict[str, Record],
             staged: dict[str, _Staged], report: BundleReport) -> None:
    """Publish every verified entry, or none: a failing put takes back the entries this
    import published before it. The staged files are handed over as :class:`Owned`, so a
    put links them into the store instead of copying them (the free space the staging
    checked is all the import needs)."""
    try:
        for d in index:
            rec = records[d]
            m = rec.manifest
            if st.contains(d) and st.peek(d):
                report.skipped.append(d)
                continue
            st.put(Key(digest=d, factors=m["factors"]),
                   {n: Owned(p) for n, p in staged[d].files.items()},
                   labels=m["labels"], meta=m["meta"])
            report.entries.append(d)
            report.bytes += rec.size_bytes
    except BaseException as e:
        for d in report.entries:
            try:
                st.delete(d)
            except (OSError, errors.StoreError) as undo:
                logger.warning("import of %s failed and entry %s it published could not be "
                               "removed again: %s", src, d, undo)
        report.entries.clear()
        if isinstance(e, errors.StoreFullError) or (isinstance(e, OSError)
                                                    and e.errno in FULL_ERRNOS):
            raise errors.StoreFullError(f"the disk under {st.root} filled up while "
                                        f"publishing {src} ({e}); nothing was imported") from e
        raise
