"""A directory in the OCI image layout as a remote: what ``cachectl export --oci DIR``
writes and ``cachectl import DIR`` reads, so that an init container (KServe's, GKM's) can
carry a slice of a store as an image: ``skopeo copy oci:DIR:cc-<digest> docker://...`` or
``oras cp --from-oci-layout`` pushes it to a registry, where the ``oci://`` tier
(:mod:`.oci`) serves it, and the other way round.

The layout is the image spec's: ``oci-layout``, ``index.json`` (one manifest per entry,
its tag in the ``org.opencontainers.image.ref.name`` annotation) and
``blobs/sha256/<digest>``; each manifest is :mod:`.oci_format`'s, byte for byte what the
registry tier pushes. Every path is built from a SHA-256 we check; ``blobs/`` and its
``sha256/`` must be real directories and each blob a regular file (no symlink is
followed out of the directory); a blob is written to a temporary name and renamed, and
``index.json`` is rewritten whole under a lock on ``oci-layout``, so two exports into one
directory never tear it. As on every tier, an entry is loaded only if its record is
trusted and every file matches its SHA-256.

``CACHECOMPILE_REMOTE=oci-layout:///abs/dir`` works as a tier too, but for a directory
many nodes share, ``file://`` is the tier made for it (pins, ownership checks).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from .. import errors
from ..fsutil import temp_name, write_new_file
from ..outcomes import Entry
from ..signing import Trust, parse_record
from .base import BlobRemote, RemoteConfig, refuse_readonly, register
from .oci_format import (
    ARTIFACT_TYPE,
    INDEX_TYPE,
    MANIFEST_TYPE,
    digest_of_tag,
    manifest_for,
    read_manifest,
    record_in,
    tag_of,
)
from .received import Received

logger = logging.getLogger(__name__)

__all__ = ["OciLayoutRemote"]

_HEX64 = re.compile(r"[0-9a-f]{64}")
_REF = "org.opencontainers.image.ref.name"
_MAX_INDEX = 64 * 1024**2
_MAX_SMALL = 64 * 1024**2
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
T = TypeVar("T")


@register
class OciLayoutRemote(BlobRemote):
    """One directory in the OCI image layout (see the module docstring)."""

    kind = "oci-layout"
    schemes = ("oci-layout",)
    default_timeout = 30.0
    default_prefix = ""
    credentials_elsewhere = "an OCI image layout is a directory: it has no password"

    @classmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        if rest or credentials:
            raise ValueError("oci-layout: takes a directory: oci-layout:///abs/dir")
        path = urllib.parse.unquote(parts.path)
        if parts.netloc or not os.path.isabs(path):
            raise ValueError("oci-layout: takes an absolute directory: oci-layout:///abs/dir")
        return os.path.normpath(path), ""

    @classmethod
    def display_of(cls, target: str, prefix: str) -> str:
        return f"oci-layout://{target}"

    @classmethod
    def of_dir(cls, path: str | Path, *, readonly: bool = False,
               trust: Trust | None = None) -> OciLayoutRemote:
        """The layout at ``path`` (a directory on this machine, made on first write)."""
        url = "oci-layout://" + urllib.parse.quote(os.path.abspath(path))
        return cls(RemoteConfig.parse(url + ("?mode=ro" if readonly else ""), env={}), trust)

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None) -> None:
        super().__init__(config, trust)
        self.root = Path(self.config.target)
        self.blobs = self.root / "blobs" / "sha256"

    # -- plumbing ------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        self.guard(what)
        try:
            out = fn()
        except OSError as e:
            err = errors.RemoteError(f"remote cache {self.config.display}: {what} failed: "
                                     f"{e.strerror or e}")
            self.breaker.failed(err)
            raise err from None
        self.breaker.ok()
        return out

    def _dirs(self, create: bool) -> bool:
        """Whether ``blobs/sha256`` is there (made if ``create``); OSError if a part of
        it is not a real directory (a symlink is not followed)."""
        for d in (self.root, self.root / "blobs", self.blobs):
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                if not create:
                    return False
                os.mkdir(d, 0o755)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, f"{d} is not a directory (a symlink is not "
                                             "followed)")
        if create and not os.path.lexists(self.root / "oci-layout"):
            tmp = self.root / temp_name("oci-layout")
            write_new_file(tmp, [b'{"imageLayoutVersion":"1.0.0"}'], 0o644)
            os.replace(tmp, self.root / "oci-layout")
        return True

    def _open(self, path: Path) -> int:
        """``path`` (in the layout) opened for reading, following no symlink below the
        root: each directory on the way is opened by itself with ``O_NOFOLLOW``."""
        parts = path.relative_to(self.root).parts
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            for part in parts[:-1]:
                inner = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = inner
            return os.open(parts[-1], flags, dir_fd=fd)
        finally:
            os.close(fd)

    def _read(self, path: Path, limit: int) -> bytes | None:
        try:
            fd = self._open(path)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{path} is far too big")
        return data

    def _blob_path(self, hexd: str) -> Path:
        if not _HEX64.fullmatch(hexd):
            raise OSError(errno.EINVAL, f"{hexd[:80]!r} is no SHA-256")
        return self.blobs / hexd

    def _index(self) -> list[dict[str, Any]]:
        """The manifests ``index.json`` lists (none if it is not there)."""
        raw = self._read(self.root / "index.json", _MAX_INDEX)
        if raw is None:
            return []
        try:
            doc = json.loads(raw)
            found = doc["manifests"]
            if not isinstance(found, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise OSError(errno.EINVAL, f"{self.root / 'index.json'} is no OCI index") from None
        return [d for d in found if isinstance(d, dict)]

    def _ours(self, listed: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Entry digest -> its manifest's descriptor, from the index (``listed``)."""
        out = {}
        for d in self._index() if listed is None else listed:
            digest = self._digest_of(d)
            if digest is not None:
                out[digest] = d
        return out

    def _digest_of(self, d: dict[str, Any]) -> str | None:
        """The entry an index descriptor names: by its ``cc-<key>`` reference, or, under
        any other reference or none (``skopeo copy ... oci:DIR`` without a tag), by the
        key its manifest carries when it is a cachecompile artifact."""
        digest = digest_of_tag(str((d.get("annotations") or {}).get(_REF, "")))
        if digest is not None or d.get("artifactType", ARTIFACT_TYPE) != ARTIFACT_TYPE:
            return digest
        hexd = str(d.get("digest", "")).partition("sha256:")[2]
        try:
            raw = self._read(self._blob_path(hexd), _MAX_SMALL)
            doc = json.loads(raw) if raw is not None else None
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("artifactType") != ARTIFACT_TYPE:
            return None
        key = (doc.get("annotations") or {}).get("org.cachecompile.key")
        return key if isinstance(key, str) and digest_of_tag(tag_of(key)) == key else None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._dirs(create=True)
        fd = os.open(self.root / "oci-layout", os.O_RDONLY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write_index(self, manifests: list[dict[str, Any]]) -> None:
        doc = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": manifests}
        tmp = self.root / temp_name("index.json")
        write_new_file(tmp, [json.dumps(doc, indent=1).encode()], 0o644)
        os.replace(tmp, self.root / "index.json")

    def _put_bytes(self, hexd: str, chunks: Iterable[bytes]) -> None:
        tmp = self.blobs / temp_name(hexd)
        write_new_file(tmp, chunks, 0o644)
        os.replace(tmp, self._blob_path(hexd))

    # -- reads ---------------------------------------------------------------------------
    def ping(self) -> bool:
        def go() -> bool:
            if not self._dirs(create=False) and self.config.readonly:
                raise FileNotFoundError(errno.ENOENT, f"no OCI image layout at {self.root}")
            return True

        return self._call("open the layout", go)

    def contains(self, digest: str) -> bool:
        return self._call("read index.json", lambda: digest in self._ours())

    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        def go() -> tuple[bytes, object] | None:
            desc = self._ours().get(digest)
            if desc is None:
                return None
            ref = str(desc.get("digest", ""))
            raw = self._read(self._blob_path(ref.partition("sha256:")[2]), _MAX_SMALL)
            if raw is None:
                return b"", ref  # the index names a manifest that is gone: malformed
            small = lambda h: self._read(self._blob_path(h), _MAX_SMALL)  # noqa: E731
            return record_in(raw, digest, small), ref

        return self._call("read a manifest", go)

    def raw_records(self) -> Iterator[tuple[str, bytes | None]]:
        for digest in sorted(self._call("read index.json", self._ours)):
            got = self.read_record(digest)
            yield digest, None if got is None else got[0]

    sizes_blobs = True

    def stored_size(self, sha: str) -> int | None:
        def go() -> int | None:
            try:
                fd = self._open(self._blob_path(sha))
            except FileNotFoundError:
                return None
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            return st.st_size if stat.S_ISREG(st.st_mode) else None

        return self._call("stat a blob", go)

    def fetch_blob(self, digest: str, name: str, sha: str, size: int, chunk: int,
                   target: Path, mode: int,
                   progress: Callable[[int], None] | None) -> tuple[int, str]:
        got = Received(progress)

        def go() -> None:
            try:
                fd = self._open(self._blob_path(sha))
            except OSError as e:
                raise errors.CorruptEntryError(digest, f"the blob of {name!r} is gone or "
                                                       f"no file ({e.strerror})") from None
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise errors.CorruptEntryError(digest, f"the blob of {name!r} is no file")
                write_new_file(target, got.passing(iter(lambda: f.read(1024**2), b"")), mode)

        self._call("read a blob", go)
        return got.result

    def info(self) -> dict[str, Any]:
        return {"objects": len(self._call("read index.json", self._ours))}

    # -- writes --------------------------------------------------------------------------
    def put_blob(self, path: Path, sha: str,
                 progress: Callable[[int], None] | None = None) -> int:
        size = os.path.getsize(path)

        def go() -> None:
            self._dirs(create=True)
            with open(path, "rb") as f:
                self._put_bytes(sha, iter(lambda: f.read(1024**2), b""))

        self._call("write a blob", go)
        if progress is not None:
            progress(size)
        self.bad_blobs.discard(sha)
        return max(size, 1)

    def put_blobs(self, entry: Entry, sha: dict[str, str],
                  progress: Callable[[int], None] | None) -> dict[str, int]:
        chunks: dict[str, int] = {}
        for n in sorted(sha):
            s = sha[n]
            if s in chunks:
                continue
            size = os.path.getsize(entry.files[n])
            there = self.stored_whole(s, size)
            chunks[s] = max(there, 1) if there is not None else self.put_blob(
                entry.files[n], s, progress)
        return chunks

    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        """Compare and set under the layout's lock: written if the manifest there is
        still the one ``tag`` names (None: still none)."""
        rec = parse_record(data, digest)
        manifest = manifest_for(data, rec)
        mhex = hashlib.sha256(manifest).hexdigest()

        def go() -> bool:
            with self._locked():
                listed = self._index()
                now = self._ours(listed).get(digest)
                if (None if now is None else str(now.get("digest"))) != tag:
                    return False
                self._put_bytes(hashlib.sha256(data).hexdigest(), [data])
                self._put_bytes(mhex, [manifest])
                # Every descriptor of this entry goes (an export again, a copy under
                # another reference): one manifest per entry, under its cc-<key> tag.
                keep = [d for d in listed if self._digest_of(d) != digest]
                keep.append({"mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
                             "digest": f"sha256:{mhex}", "size": len(manifest),
                             "annotations": {_REF: tag_of(digest)}})
                self._write_index(keep)
                return True

        return self._call("write a manifest", go)

    def delete(self, digest: str) -> bool:
        refuse_readonly(self.config)

        def go() -> bool:
            with self._locked():
                listed = self._index()
                keep = [d for d in listed if self._digest_of(d) != digest]
                if len(keep) == len(listed):
                    return False
                self._write_index(keep)
                return True

        return self._call("delete a manifest", go)

    def sweep(self) -> int:
        """Delete blobs older than ``lease`` that no manifest of the index references;
        nothing if the index lists anything but our entries (an image's blobs are
        reached through manifests this tier does not read)."""
        refuse_readonly(self.config)

        def go() -> int:
            with self._locked():
                listed = self._index()
                if any(d.get("artifactType") != ARTIFACT_TYPE for d in listed):
                    logger.info("%s holds more than cachecompile entries: not swept",
                                self.config.display)
                    return 0
                keep = set()
                for d in listed:
                    hexd = str(d.get("digest", "")).partition("sha256:")[2]
                    keep.add(hexd)
                    raw = self._read(self._blob_path(hexd), _MAX_SMALL)
                    if raw is None:
                        continue
                    with contextlib.suppress(errors.ManifestError):
                        described = read_manifest(raw, "?")
                        keep.add(described.record_digest.partition(":")[2])
                        keep.update(la.partition(":")[2] for la in described.layers)
                gone = 0
                now = time.time()
                for p in self.blobs.iterdir():
                    st = os.lstat(p)
                    if p.name not in keep and now - st.st_mtime >= self.config.lease:
                        os.unlink(p)
                        gone += 1
                return gone

        return self._call("sweep blobs", go)

    def close(self) -> None:
        pass
