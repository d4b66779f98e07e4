"""What a record found on a remote is to this node, and whether an upload may take its
place: the judgement every upload makes first (``BlobRemote.upload``)."""

from __future__ import annotations

import json
from typing import Literal

from .. import errors
from ..signing import Trust, parse_record

__all__ = ["RecordState", "may_replace", "record_state"]

# What a remote record is, as this node sees it: "ours" verifies under our signing key;
# "trusted" under one of our other verify keys (an old key, while it is rotated out);
# "foreign" is signed but not verifiable here (another key, tampered, or we have none).
RecordState = Literal["absent", "malformed", "unsigned", "ours", "trusted", "foreign"]


def record_state(trust: Trust, digest: str, raw: bytes | None) -> RecordState:
    """What the record ``raw`` of ``digest`` is to this node (see :data:`RecordState`)."""
    if raw is None:
        return "absent"
    try:
        rec = parse_record(raw, digest)
        body, sig = rec.body, rec.sig
    except errors.ManifestError:
        # Not a record this version reads (garbage, or a newer format): signed is
        # still signed, and only a key that verifies it may replace it.
        body, sig = _lenient_signed(raw, digest)
        if not sig:
            return "malformed"
    if not sig:
        return "unsigned"
    if trust.signed_by_us(body, sig):
        return "ours"
    return "trusted" if trust.verifies(body, sig) else "foreign"


def may_replace(trust: Trust, found: RecordState, *, overwrite: bool, repair: bool,
                resign: bool = False) -> bool:
    """Whether our upload may take the place of a record in state ``found``.

    The record is what every node loads, so a node that cannot vouch for a signed
    record never replaces it: without a key ours would be unsigned, and keyed nodes
    refuse that fleet-wide; with another key we cannot tell whose key is the wrong
    one, unless the caller says ours is right (``repair``: ``cachectl push``).
    """
    if found in ("absent", "malformed"):
        return True  # nobody can load it: anything well-formed is better
    if found == "ours":
        return overwrite  # same signer: only to replace damaged blobs, or --force
    if found == "trusted":
        # Signed with a key being rotated out: every node that loads it now may also
        # load ours; re-signing it with the current key is what ``push --resign`` asks.
        return resign or overwrite
    if trust.key is None:
        return found == "unsigned" and overwrite
    if found == "unsigned":
        return True  # signing it only adds trust: keyed nodes refuse it as it is
    return repair


def _lenient_signed(raw: bytes, digest: str) -> tuple[bytes, str | None]:
    """(body, signature) of a record we cannot parse, if it has that much shape.

    A body that names another key is no signed record of ``digest`` (a copy moved here).
    """
    try:
        outer = json.loads(raw)
        body, sig = outer["body"], outer["sig"]
        doc = json.loads(body)
    except (ValueError, KeyError, TypeError):
        return b"", None
    if (not isinstance(sig, str) or not sig or not isinstance(doc, dict)
            or doc.get("key") != digest):
        return b"", None
    return body.encode("utf-8"), sig
