"""An entry as an OCI artifact: the one mapping between cachecompile's signed record and an
OCI image manifest, which the registry tier (:mod:`.oci`) and the image-layout directory
(:mod:`.oci_layout`, ``cachectl export --oci``) both read and write.

One entry is one manifest (OCI image spec 1.1, an *artifact*), tagged ``cc-<digest>``::

    mediaType     application/vnd.oci.image.manifest.v1+json
    artifactType  application/vnd.cachecompile.entry.v1
    config        the signed record (application/vnd.cachecompile.record.v1+json), its
                  bytes also inline as the descriptor's ``data`` (a lookup is one GET)
    layers        one per distinct file: application/vnd.cachecompile.file.v1, digest
                  sha256:<the file's SHA-256>, titled with its first file name
    annotations   org.cachecompile.key, org.cachecompile.label.<name>, created

The record stays the authority: a reader checks its signature and every file's SHA-256
exactly as on every other tier, and never trusts a layer's title or an annotation. The
layers are there so the registry keeps the blobs (its garbage collection follows them)
and so tools (``skopeo inspect --raw``, ``oras manifest fetch``) show what an entry holds.
Signatures are ours (HMAC over the record); a registry's cosign or notation signature
over the manifest may sit beside them (a referrer), and checks a different thing: who
pushed the artifact, not whether this process may load it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..signing import Record

__all__ = ["ARTIFACT_TYPE", "FILE_TYPE", "MANIFEST_TYPE", "RECORD_TYPE", "Described",
           "digest_of_tag", "manifest_for", "read_manifest", "record_in", "tag_of"]

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
ARTIFACT_TYPE = "application/vnd.cachecompile.entry.v1"
RECORD_TYPE = "application/vnd.cachecompile.record.v1+json"
FILE_TYPE = "application/vnd.cachecompile.file.v1"
TAG_PREFIX = "cc-"
_TAG = re.compile(r"cc-([0-9a-f]{32})")
_SHA = re.compile(r"sha256:([0-9a-f]{64})")
# Larger inline records are fetched as the config blob (registries cap a manifest's size:
# distribution at 4 MiB; 1 MiB is 1.4 MiB of base64).
_MAX_INLINE = 1024**2
_MAX_MANIFEST = 4 * 1024**2


def tag_of(digest: str) -> str:
    """The tag of an entry's manifest."""
    return TAG_PREFIX + digest


def digest_of_tag(tag: str) -> str | None:
    """The entry digest a tag names; None for a tag that is not ours."""
    m = _TAG.fullmatch(tag)
    return m.group(1) if m else None


def blob_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_for(record: bytes, rec: Record) -> bytes:
    """The manifest of the entry whose record is ``record`` (``rec``: it, parsed)."""
    layers: dict[str, dict[str, Any]] = {}
    for name in sorted(rec.manifest["files"]):
        sha = rec.sha256[name]
        if sha not in layers:
            layers[sha] = {"mediaType": FILE_TYPE, "digest": "sha256:" + sha,
                           "size": int(rec.manifest["files"][name]["size"]),
                           "annotations": {"org.opencontainers.image.title": name}}
    config: dict[str, Any] = {"mediaType": RECORD_TYPE, "digest": blob_digest(record),
                              "size": len(record)}
    if len(record) <= _MAX_INLINE:
        config["data"] = base64.b64encode(record).decode("ascii")
    notes = {"org.cachecompile.key": rec.key}
    for k, v in sorted(rec.manifest.get("labels", {}).items()):
        notes[f"org.cachecompile.label.{k}"] = str(v)
    doc = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
           "config": config, "layers": list(layers.values()), "annotations": notes}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Described:
    """What a manifest says: its record's digest (``sha256:...``), the record's bytes if
    they were inline (checked against that digest), and its layers' digests."""

    record_digest: str
    record: bytes | None
    layers: tuple[str, ...]


def read_manifest(raw: bytes, digest: str) -> Described:
    """Parse the manifest of entry ``digest``; ManifestError names what is wrong. Nothing in it is trusted but the shape: the record it leads to is
    checked by its signature, as on every tier."""
    try:
        if len(raw) > _MAX_MANIFEST:
            raise ValueError("far too big")
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
            raise ValueError("not an OCI manifest")
        if doc.get("artifactType") != ARTIFACT_TYPE:
            raise ValueError(f"not a cachecompile entry (artifactType "
                             f"{doc.get('artifactType')!r})")
        config = doc["config"]
        if config.get("mediaType") != RECORD_TYPE or not _SHA.fullmatch(config["digest"]):
            raise ValueError("its config is no cachecompile record")
        inline: bytes | None = None
        if "data" in config:
            inline = base64.b64decode(config["data"], validate=True)
            if blob_digest(inline) != config["digest"]:
                raise ValueError("its inline record does not match its digest")
        layers = tuple(str(la["digest"]) for la in doc.get("layers", []))
        if not all(_SHA.fullmatch(d) for d in layers):
            raise ValueError("a layer's digest is not sha256")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise errors.ManifestError(f"the OCI manifest of {digest} is malformed: {e}") from None
    return Described(str(config["digest"]), inline, layers)


def record_in(raw: bytes, digest: str, blob: Callable[[str], bytes | None]) -> bytes:
    """The record the manifest ``raw`` of entry ``digest`` leads to: inline, or the
    config blob ``blob(sha256 hex)`` reads. Bytes that are no record where it leads to
    none (the manifest itself when it is malformed, b"" when its record is gone or not
    what its digest says): the entry is then malformed, as a torn record is on every
    other tier (a miss; ``cachectl push`` with the fleet's key repairs it)."""
    try:
        described = read_manifest(raw, digest)
    except errors.ManifestError:
        return raw
    if described.record is not None:
        return described.record
    data = blob(described.record_digest.partition(":")[2])
    return data if data is not None and blob_digest(data) == described.record_digest else b""
