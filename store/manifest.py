"""Manifests: the truth about an entry, and the validation of every path in one.

A manifest is ``manifest.json`` in the entry directory::

    {"format": 1, "key": "<digest>", "factors": {...}, "labels": {...},
     "meta": {...}, "created": 1700000000.0,
     "files": {"<name>": {"size": 123, "xxh3_128": "<hex>"}, ...}}

File names are relative POSIX paths below the entry's ``data/`` directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .errors import ManifestError, UnsafePathError

__all__ = ["FORMAT", "check_names", "validate_name", "parse_manifest", "dump_manifest"]

FORMAT = 1
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


def parse_manifest(text: bytes | str, expect_key: str | None = None) -> dict[str, Any]:
    """Parse and validate manifest text; raise ManifestError / UnsafePathError."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"unsupported manifest format {doc.get('format')!r}")
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
    return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8")
