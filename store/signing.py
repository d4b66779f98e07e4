"""Signed entry records: what a remote tier or a bundle carries besides the files.

Loading an entry runs its code, so an entry that arrives from elsewhere (Redis, a
bundle) must prove where it came from. A *record* is::

    {"body": "<canonical JSON text>", "sig": "<hex HMAC-SHA256>" | null}

and its body is ``{"format": 1, "key": <digest>, "manifest": {...}, "sha256": {name: hex},
"chunks": {sha256: chunk size}, "exec": [name, ...]}`` ("exec", the files that are
executable, is left out when there are none, so older records read the same). The manifest already holds each file's size and
XXH3-128, but XXH3 is not collision resistant, so the body adds a SHA-256 per file: the
HMAC covers the body, the body pins every byte of every file.

Policy (:class:`Trust`): with ``CACHECOMPILE_SIGNING_KEY`` set, records are signed on the
way out and a missing or wrong signature is refused on the way in; keys in
``CACHECOMPILE_VERIFY_KEYS`` are accepted on the way in too, so a fleet rotates its key
with no miss (add the new key everywhere, switch the signers, ``cachectl push
--resign``, retire the old one). Without a key, remote
records are accepted only if the user opts in with ``CACHECOMPILE_TRUST_REMOTE=1``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import settings
from .errors import ManifestError, RemoteConfigError, UntrustedEntryError
from .manifest import parse_manifest

logger = logging.getLogger(__name__)

__all__ = ["MIN_KEY_BYTES", "RECORD_FORMAT", "Record", "Trust", "make_record", "parse_record", "sha256_file"]

RECORD_FORMAT = 1
# Domain separation: an HMAC made for something else with the same key never verifies here.
_CONTEXT = b"cachecompile-entry-record-v1\n"


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# HMAC-SHA256 keys shorter than this can be guessed offline from one signed record.
MIN_KEY_BYTES = 16
_warned_short: set[str] = set()


def _check_length(name: str, key: bytes) -> None:
    """Warn (once per process and variable) that a key is too short; never show it.

    A warning, not a refusal: like every remote setting, a weak key must not turn the
    fleet's remote tier off on upgrade (signing still works, only weakly), and the
    variable and the fix are named."""
    if len(key) >= MIN_KEY_BYTES or name in _warned_short:
        return
    _warned_short.add(name)
    logger.warning("%s is %d bytes long: a signing key under %d bytes can be guessed from a "
                   "signed record; use 32 random bytes (openssl rand -hex 32), in a file "
                   "(file:PATH)", name, len(key), MIN_KEY_BYTES)


def _load_key(text: str) -> bytes:
    # "file:/run/secrets/cc-key" keeps the secret itself out of the environment.
    if text.startswith("file:"):
        return Path(text[5:]).expanduser().read_bytes().strip()
    return text.encode("utf-8")


def _load_keys(text: str) -> tuple[bytes, ...]:
    """``CACHECOMPILE_VERIFY_KEYS``: keys separated by commas, each a value or
    ``file:PATH`` (a key holding a comma goes in a file)."""
    return tuple(k for k in (_load_key(part.strip()) for part in text.split(",")
                             if part.strip()) if k)


@dataclass(frozen=True)
class Trust:
    """Who is believed: ``key`` signs and verifies; ``verify_keys`` verify too (a key being
    rotated in or out); ``accept_unsigned`` is the opt-in for unsigned records."""

    key: bytes | None = None
    accept_unsigned: bool = False
    verify_keys: tuple[bytes, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Trust:
        env = os.environ if env is None else env
        raw = settings.SIGNING_KEY.get(env)
        try:
            key = _load_key(raw) if raw else None
        except OSError as e:
            raise RemoteConfigError(f"CACHECOMPILE_SIGNING_KEY={raw}: cannot read the key "
                                    f"file ({e.strerror}); fix the path, or unset it") from None
        try:
            extra = _load_keys(settings.VERIFY_KEYS.get(env))
        except OSError as e:
            raise RemoteConfigError(f"CACHECOMPILE_VERIFY_KEYS: cannot read the key file "
                                    f"{e.filename} ({e.strerror})") from None
        if key:
            _check_length("CACHECOMPILE_SIGNING_KEY", key)
        for i, k in enumerate(extra, 1):
            _check_length(f"CACHECOMPILE_VERIFY_KEYS (key {i})", k)
        return cls(key=key or None, accept_unsigned=settings.TRUST_REMOTE.get(env),
                   verify_keys=tuple(k for k in extra if k != key))

    @property
    def keyed(self) -> bool:
        """Whether any key verifies here (then every record must be signed)."""
        return self.key is not None or bool(self.verify_keys)

    def sign(self, body: bytes) -> str | None:
        if self.key is None:
            return None
        return _mac(self.key, body)

    def signed_by_us(self, body: bytes, sig: str | None) -> bool:
        """True if ``sig`` is this node's signing key's signature of ``body``."""
        return self.key is not None and bool(sig) and hmac.compare_digest(
            _mac(self.key, body), str(sig))

    def verifies(self, body: bytes, sig: str | None) -> bool:
        """True if ``sig`` is a signature of ``body`` by a key we hold (False without one)."""
        if not sig:
            return False
        return any(hmac.compare_digest(_mac(k, body), str(sig))
                   for k in ((self.key,) if self.key else ()) + self.verify_keys)

    def check(self, body: bytes, sig: str | None, digest: str) -> None:
        """Raise UntrustedEntryError unless this record may be loaded."""
        if self.keyed:
            names = ("CACHECOMPILE_SIGNING_KEY" if self.key else "") + (
                (" or " if self.key else "") + "CACHECOMPILE_VERIFY_KEYS"
                if self.verify_keys else "")
            if not sig:
                raise UntrustedEntryError(digest, f"it is not signed and {names} is set")
            if not self.verifies(body, sig):
                raise UntrustedEntryError(digest, f"its signature does not match {names}")
            return
        if not self.accept_unsigned:
            raise UntrustedEntryError(
                digest, "no CACHECOMPILE_SIGNING_KEY to verify it with; loading an entry runs "
                        "its code, so set the key, or CACHECOMPILE_TRUST_REMOTE=1 to trust "
                        "this remote")


def _mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, _CONTEXT + body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Record:
    """A parsed, not yet trusted, record."""

    key: str
    manifest: dict[str, Any]
    sha256: dict[str, str]
    chunks: dict[str, int]
    body: bytes
    sig: str | None
    # Names of the files to restore executable (a .so or a launcher script must stay one).
    executable: frozenset[str] = frozenset()

    @property
    def size_bytes(self) -> int:
        return sum(int(r["size"]) for r in self.manifest["files"].values())

    def to_bytes(self) -> bytes:
        return json.dumps({"body": self.body.decode("utf-8"), "sig": self.sig}).encode("utf-8")


def make_record(manifest: Mapping[str, Any], sha256: Mapping[str, str],
                chunks: Mapping[str, int], trust: Trust,
                executable: Iterable[str] = ()) -> Record:
    exe = frozenset(executable)
    doc: dict[str, Any] = {"format": RECORD_FORMAT, "key": manifest["key"],
                           "manifest": dict(manifest), "sha256": dict(sha256),
                           "chunks": dict(chunks)}
    if exe:
        doc["exec"] = sorted(exe)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return Record(key=str(manifest["key"]), manifest=dict(manifest), sha256=dict(sha256),
                  chunks=dict(chunks), body=body, sig=trust.sign(body), executable=exe)


def parse_record(raw: bytes, expect_key: str) -> Record:
    """Parse a record (shape only: call ``Trust.check`` before believing it)."""
    try:
        outer = json.loads(raw)
        body = outer["body"].encode("utf-8")
        sig = outer.get("sig")
        doc = json.loads(body)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestError(f"entry record for {expect_key} is malformed: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        raise ManifestError(f"entry record for {expect_key} has an unknown format")
    if doc.get("key") != expect_key or not isinstance(doc.get("manifest"), dict):
        raise ManifestError(f"entry record for {expect_key} names another key")
    manifest = parse_manifest(json.dumps(doc["manifest"]), expect_key=expect_key)
    sha = doc.get("sha256")
    chunks = doc.get("chunks")
    if (not isinstance(sha, dict) or set(sha) != set(manifest["files"])
            or not all(isinstance(v, str) and len(v) == 64 for v in sha.values())):
        raise ManifestError(f"entry record for {expect_key} lacks a SHA-256 per file")
    if not isinstance(chunks, dict) or not all(
            isinstance(v, int) and v > 0 for v in chunks.values()):
        raise ManifestError(f"entry record for {expect_key} has malformed chunk sizes")
    exe = doc.get("exec", [])
    if (not isinstance(exe, list) or not all(isinstance(n, str) for n in exe)
            or not set(exe) <= set(manifest["files"])):
        raise ManifestError(f"entry record for {expect_key} names unknown executable files")
    if sig is not None and not isinstance(sig, str):
        raise ManifestError(f"entry record for {expect_key} has a malformed signature")
    return Record(key=expect_key, manifest=manifest, sha256=dict(sha), chunks=dict(chunks),
                  body=body, sig=sig, executable=frozenset(exe))
