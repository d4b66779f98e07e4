"""Manifests: the truth about an entry, and the validation of every path in one.

A manifest is ``manifest.json`` in the entry directory::

    {"format": 2, "key": "<digest>", "factors": {...}, "labels": {...},
     "meta": {...}, "created": 1700000000.0,
     "files": {"<name>": {"size": 123, "xxh3_128": "<hex>"}, ...},
     "integrity": "<xxh3_128 of everything above, canonical JSON>"}

File names are relative POSIX paths below the entry's ``data/`` directory. The integrity
digest covers the whole manifest, ``meta`` included: a program's metadata (which kernel
file serves which kernel, the guards, the bytecode's constants) is as much code as the
files are, so a one-character edit anywhere makes the entry corrupt (quarantined, and
reported by ``cachectl verify``), never a wrong program.

Nothing is left out: a manifest is written once, at publish, and never rewritten. What
changes after publish (last use, hit counts) lives in the index, pins are files under
``pins/``; ``labels`` are fixed at publish and select entries for purge and export, so
they are covered too. ``created`` is covered as well (an import re-publishes and writes
a fresh manifest and digest). The digest is over the parsed document in canonical JSON
(sorted keys, no whitespace, ASCII), so re-indenting a manifest changes nothing, while
any change of a value, a key, or an added or removed field does. Like the files'
XXH3-128 it detects edits and damage, not an attacker who can write the cache (who could
recompute it; see the security model): remote records and bundles are signed (HMAC over
a body that holds this whole manifest, digest included).

Format 1 manifests (no digest) are refused as corrupt: such entries are quarantined
on their first lookup and compiled again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import xxhash

from .errors import ManifestError, UnsafePathError

__all__ = ["FORMAT", "check_names", "validate_name", "parse_manifest", "dump_manifest",
           "manifest_digest"]

# 2: the integrity digest over the whole manifest.
FORMAT = 2
_BAD_CHARS = ("\\", "\x00")


def validate_name(name: object) -> str:
    """Return ``name`` if it is a safe relative path, else raise UnsafePathError."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"file name must be a non-empty string, got {name!r}")
    if name.startswith("/"):
        raise UnsafePathError(f"absolute file name {name!r}")
    if any(c in name for c in _BAD_CHARS):
        raise UnsafePathError(f"file name {name!r} contains a backslash or NUL")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePathError(f"file name {name!r} has an empty, '.' or '..' component")
    return name


def check_names(names: list[str]) -> None:
    # "a" as a file and "a/b" as another would need "a" to be both file and dir.
    prefixes = set()
    for n in names:
        parts = n.split("/")
        for i in range(1, len(parts)):
            prefixes.add("/".join(parts[:i]))
    clash = prefixes.intersection(names)
    if clash:
        raise UnsafePathError(f"file name {sorted(clash)[0]!r} is also used as a directory")


def _canonical(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def manifest_digest(doc: Mapping[str, Any]) -> str:
    """XXH3-128 of the manifest's canonical JSON, without its own digest field."""
    body = {k: v for k, v in doc.items() if k != "integrity"}
    return xxhash.xxh3_128_hexdigest(_canonical(body).encode("utf-8"))


def _digest_holds(raw: bytes, doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` (parsed from ``raw``) matches its integrity digest.

    A manifest written by ``dump_manifest`` is its canonical JSON, so the text hashed is the
    file's own text without the integrity field: a hash of the bytes read, not a second
    serialization (a warm start's manifests carry their guards and checker, ~200 KB each,
    and dumping one again took 0.7 ms, per entry of every warm start; issue 53). A
    manifest in another form (an older writer's indented JSON, or an edit) is serialized
    again and hashed as before: the digest means what it always meant.
    """
    given = doc.get("integrity")
    if not isinstance(given, str):
        return False
    field = f'"integrity":{json.dumps(given)},'.encode("ascii")
    if raw.count(field) == 1 and xxhash.xxh3_128_hexdigest(raw.replace(field, b"")) == given:
        return True
    return given == manifest_digest(doc)


def parse_manifest(text: bytes | str, expect_key: str | None = None) -> dict[str, Any]:
    """Parse and validate manifest text; raise ManifestError / UnsafePathError."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    if doc.get("format") != FORMAT:
        old = " (it predates the integrity digest)" if doc.get("format") == 1 else ""
        raise ManifestError(f"unsupported manifest format {doc.get('format')!r}{old}")
    key = doc.get("key")
    if not isinstance(key, str) or (expect_key is not None and key != expect_key):
        raise ManifestError(f"manifest key {key!r} does not match its directory {expect_key!r}")
    for field in ("factors", "labels", "meta", "files"):
        if not isinstance(doc.get(field), dict):
            raise ManifestError(f"manifest field {field!r} is missing or not an object")
    if not isinstance(doc.get("created"), (int, float)):
        raise ManifestError("manifest field 'created' is missing or not a number")
    files = doc["files"]
    for name, rec in files.items():
        validate_name(name)
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("size"), int)
            or rec["size"] < 0
            or not isinstance(rec.get("xxh3_128"), str)
        ):
            raise ManifestError(f"manifest record for {name!r} is malformed")
    check_names(list(files))
    # Last: an unsafe path is reported as insecure even when the digest fails too.
    raw = text.encode("utf-8") if isinstance(text, str) else text
    if not _digest_holds(raw, doc):
        raise ManifestError("manifest does not match its integrity digest (edited or torn)")
    return doc


def dump_manifest(
    *,
    key: str,
    factors: Mapping[str, Any],
    labels: Mapping[str, str],
    meta: Mapping[str, Any],
    created: float,
    files: Mapping[str, Mapping[str, Any]],
) -> bytes:
    doc = {
        "format": FORMAT,
        "key": key,
        "factors": dict(factors),
        "labels": dict(labels),
        "meta": dict(meta),
        "created": created,
        "files": {n: dict(r) for n, r in sorted(files.items())},
    }
    doc["integrity"] = manifest_digest(doc)
    # Canonical JSON (no indentation): a reader checks the digest over these bytes without
    # serializing the manifest again (_digest_holds). `cachectl show KEY --json` indents it.
    return _canonical(doc).encode("ascii")
