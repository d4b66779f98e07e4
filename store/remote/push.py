"""Upload local entries to a remote and say what became of each: the one loop behind
``cachectl push`` and ``cachectl build``'s closing upload
(:func:`cachecompile.procs.builders.push_results`).

An entry the remote did not take is never counted as "there already": a record kept
because it is signed with a key this node lacks, or because the server cannot replace
one safely, is *refused*, with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from .. import errors
from ..outcomes import Hit
from ..protocol import DiskStorage
from .base import Remote

logger = logging.getLogger(__name__)

__all__ = ["Pushed", "push_entries"]

# Why a record that is there and signed with another key stays (no key to vouch with).
FOREIGN_KEPT = "the remote record is signed and CACHECOMPILE_SIGNING_KEY is not set"


@dataclasses.dataclass
class Pushed:
    """What :func:`push_entries` did, entry by entry counted once.

    ``sent``: records written (``repaired`` of them replaced one that did not verify,
    ``resigned`` re-signed one under another trusted key); ``there``: the remote had the
    entry already; ``kept``: a signed record stays because this node has no signing key
    to vouch with; ``refused``: a record we would have replaced stays because the
    server cannot replace it safely; ``failed``: not in the local store, or the upload
    failed (only with ``keep_going``). The lists hold ``"<digest[:12]>: <why>"``.
    """

    remote: str
    sent: int = 0
    there: int = 0
    repaired: int = 0
    resigned: int = 0
    kept: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)

    @property
    def not_taken(self) -> list[str]:
        """Entries the remote has some other record of, and kept it: kept + refused."""
        return self.kept + self.refused


def push_entries(
    remote: Remote,
    local: DiskStorage,
    digests: Iterable[str],
    *,
    overwrite: bool = False,
    repair: bool | None = None,
    resign: bool = False,
    keep_going: bool = False,
    progress: Callable[[int], None] | None = None,
    on_note: Callable[[str, str], None] | None = None,
) -> Pushed:
    """Upload each of ``digests`` from ``local`` (checked with ``peek``) to ``remote``.

    ``repair`` (default: whether this node has a signing key): replace a remote record
    that does not verify under our key; the operator or builder who pushes with a key
    vouches that it is the fleet's. ``keep_going``: a failed upload is listed in
    ``failed`` and the next entry goes on; otherwise its StoreError is raised.
    ``progress`` gets bytes as they go (and an entry's size when it is not sent);
    ``on_note(digest, text)`` hears why an entry was skipped or kept, as it happens.
    """
    if repair is None:
        repair = remote.trust.key is not None
    out = Pushed(remote.config.display)
    note = on_note or (lambda digest, text: None)
    advance = progress or (lambda n: None)
    for digest in digests:
        hit = local.peek(digest)
        if not isinstance(hit, Hit):
            out.failed.append(f"{digest[:12]}: not in the local store ({hit.reason})")
            note(digest, f"skipped: {hit.reason}")
            continue
        try:
            done = remote.upload(hit.entry, overwrite=overwrite, repair=repair, resign=resign,
                                 progress=progress)
        except errors.StoreError as e:
            if not keep_going:
                raise
            out.failed.append(f"{digest[:12]}: {e}")
            continue
        if done:
            out.sent += 1
            out.repaired += done.found in ("unsigned", "malformed", "foreign")
            out.resigned += done.found == "trusted"
            continue
        advance(hit.entry.size_bytes)
        if done.refused:
            out.refused.append(f"{digest[:12]}: {done.refused}")
            note(digest, f"kept: {done.refused}")
        elif done.found == "foreign":
            out.kept.append(f"{digest[:12]}: {FOREIGN_KEPT}")
            note(digest, f"kept: {FOREIGN_KEPT}")
        else:
            out.there += 1
    logger.debug("pushed to %s: %s", out.remote, out)
    return out
