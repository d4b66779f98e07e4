"""Explaining a miss: which key factors (and which guards) set two entries apart.

Keys are named factors stored readable in every manifest, so a miss is explained by
comparing factors leaf by leaf. ``cachectl explain`` and cachecompile's miss log line
both use :func:`nearest`, so they name the same entry and the same factors; ``cachectl
build --check`` picks among a remote tier's records by the same rule (:func:`closest`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import StoreError
from .protocol import Catalog

logger = logging.getLogger(__name__)

__all__ = ["SPECIALISED", "GuardDiff", "Nearest", "closest", "differing", "flatten",
           "guard_diff", "nearest"]

# Why an entry compiled with dynamic=True holds an exact size in a tensor guard: the miss
# reason (cachecompile.warm.lookup) and ``cachectl explain`` say it in these words.
SPECIALISED = ("the entry was compiled with dynamic=True, yet Dynamo specialised these sizes:"
               " the code reads them as Python numbers (a branch or a comparison on a size,"
               " an op that needs its value; TORCH_LOGS=dynamic names the line)")

# The variant index is the slot an entry took among a frame's entries, not a property
# of what was compiled: it never makes one entry more or less like another.
NOT_COMPARED = ("variant",)
# Factors that make a key another kind of entry (a graph break's frame variant, beside the
# method's entries): an entry of another kind is never the nearest one.
KIND_FACTORS = ("dynamo_frame",)


@dataclass(frozen=True)
class Nearest:
    """The entry most like a key, and the factors (dotted paths) it differs in."""

    key: str
    differ: list[str]


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested factors as dotted paths, so two keys can be compared leaf by leaf."""
    if isinstance(obj, Mapping) and obj:
        out: dict[str, Any] = {}
        for k in sorted(obj):
            out.update(flatten(obj[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix or "<root>": obj}


def differing(a: Mapping[str, Any], b: Mapping[str, Any], *,
              ignore: Collection[str] = ()) -> list[str]:
    """The dotted factor names whose values differ (or that one side lacks), sorted."""
    fa = {k: v for k, v in flatten(a).items() if k.split(".")[0] not in ignore}
    fb = {k: v for k, v in flatten(b).items() if k.split(".")[0] not in ignore}
    missing = object()
    return [n for n in sorted(set(fa) | set(fb)) if fa.get(n, missing) != fb.get(n, missing)]


def nearest(st: Catalog, factors: Mapping[str, Any], labels: Mapping[str, str], *,
            exclude: str | None = None, limit: int | None = None) -> Nearest | None:
    """The entry most like ``factors``: among those with ``labels`` (e.g. the same
    function and model), the one with the fewest differing factors; the first on a tie.

    Reads manifests only (a ``get`` would hash every file and count a hit). ``limit``
    bounds how many candidates are read; ``exclude`` is a digest to pass over (the
    entry being explained).
    """
    def candidates() -> Iterator[tuple[str, Mapping[str, Any]]]:
        seen = 0
        for info in st.find(**labels):
            if info.key == exclude:
                continue
            if limit is not None and seen >= limit:
                return
            seen += 1
            try:
                yield info.key, st.manifest(info.key)["factors"]
            except (StoreError, OSError, KeyError):
                continue  # a manifest that went away or fails its digest: not a candidate

    return closest(factors, candidates())


def closest(factors: Mapping[str, Any],
            candidates: Iterable[tuple[str, Mapping[str, Any]]]) -> Nearest | None:
    """Of the (key, factors) ``candidates``, the one with the fewest factors that differ
    from ``factors``; the first on a tie; None if there is none."""
    best: Nearest | None = None
    for key, other in candidates:
        if any((k in other) != (k in factors) for k in KIND_FACTORS):
            continue
        diff = differing(factors, other, ignore=NOT_COMPARED)
        if best is None or len(diff) < len(best.differ):
            best = Nearest(key, diff)
    return best


# Dynamo names the globals it installs for a frame with a counter
# (``__builtins_dict___16``, ``___18``): the same guard reads another name in each trace.
_RENAMED = re.compile(r"___\d+")


def _plain(expr: str) -> str:
    return _RENAMED.sub("___#", expr)


@dataclass(frozen=True)
class GuardDiff:
    """How two entries' guards differ: ``changed`` (one guard, two values: what tells
    variants apart, first), ``only`` (a guard one side has), ``renamed`` (how many
    differed only by a global Dynamo renamed: folded, not shown)."""

    changed: list[tuple[str, str]]
    only: list[tuple[str, str]]
    renamed: int

    @property
    def rows(self) -> list[tuple[str, str]]:
        return self.changed + self.only


def guard_diff(ma: Mapping[str, Any], mb: Mapping[str, Any]) -> GuardDiff:
    """The guards two entries of one method disagree on, in the user's terms.

    Variants of one frame share every factor; what tells them apart is the state each was
    compiled for, which Dynamo's guards (carried in ``meta.guards``) record.
    """
    def by_expr(m: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        gs = m.get("meta", {}).get("guards") or []
        return {(str(g.get("kind")), _plain(str(g.get("expr", "")))): g for g in gs
                if isinstance(g, dict)}

    ga, gb = by_expr(ma), by_expr(mb)
    changed: list[tuple[str, str]] = []
    only: list[tuple[str, str]] = []
    renamed = 0
    for k in sorted(set(ga) | set(gb)):
        a, b = ga.get(k), gb.get(k)
        if a is not None and b is not None:
            if a.get("value") != b.get("value"):
                changed.append((str(a.get("text")), str(b.get("text"))))
            elif a.get("expr") != b.get("expr"):
                renamed += 1
            continue
        only.append((str(a.get("text")) if a else "(not guarded)",
                     str(b.get("text")) if b else "(not guarded)"))
    return GuardDiff(changed, only, renamed)
