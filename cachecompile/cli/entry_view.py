"""What ``cachectl show`` and ``explain`` print of an entry's guards and a graph break's
frames: the value guards (what tells variants apart), each frame's variants, and how
many variants of a frame were published after the entry."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from cachecompile.entry.frame_records import FrameRecord
from cachecompile.entry.meta import EntryMeta
from cachecompile.store.explain import guard_diff

from .common import frame_summary, read_frames, read_meta
from .readable import demangle, fold_hooks

if TYPE_CHECKING:
    from cachecompile.store import OpenStore

__all__ = ["VALUE_GUARDS", "entry_guards", "explain_frames", "print_frames",
           "print_value_guards", "published_frames"]


# Guards that say what a call (and the state it runs in) must be: the ones that tell
# variants apart. The rest check that the code and objects the method reads are the same
# ones (types, identities, hook dicts, keys): many, and alike in every entry of a method.
VALUE_GUARDS = ("global_state", "modes", "default_device", "eq", "expr", "tensor", "len")


def entry_guards(m: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(g) for g in read_meta(m).guards if isinstance(g, Mapping)]


def print_value_guards(con: Console, m: dict[str, Any], every: bool) -> None:
    gs = entry_guards(m)
    shown = [g for g in gs if every or g.get("kind") in VALUE_GUARDS]
    if not gs:
        return
    con.print(f"[bold]guards[/bold]   {len(gs)}" + ("" if every else
              f"; what a call and its state must be ({len(shown)}); the other "
              f"{len(gs) - len(shown)} check that the code and objects the method reads are "
              "the same (--guards lists all)"))
    texts = [demangle(str(g.get("text") or g.get("expr") or g.get("kind"))) for g in shown]
    for _, line in fold_hooks(texts):   # Dynamo's names as what they hold, hooks folded
        con.print("  " + escape(line), soft_wrap=True)


def published_frames(st: OpenStore, labels: Mapping[str, str], meta: EntryMeta
                      ) -> Counter[str]:
    """How many variants of each of an entry's frames were published after it (entries of
    its signature with the label ``dynamo_frame``), by frame name."""
    sig = labels.get("signature_key")
    if not (sig and meta.frames):
        return Counter()
    return Counter(i.labels["dynamo_frame"] for i in st.entries()
                   if "dynamo_frame" in i.labels and i.labels.get("signature_key") == sig)


def print_frames(con: Console, meta: EntryMeta, every: bool,
                  published: Mapping[str, int]) -> None:
    """A graph break's frames: the method's own, then every other one the entry holds,
    each with what a warm process does with it (and its value guards), and how many
    variants of it were published after the entry (``published``, by frame name)."""
    frames = read_frames(meta)
    if not frames:
        return
    if meta.head:
        con.print(f"[bold]frame[/bold]    a variant of one frame, published after the "
                  f"signature's entry: {escape(frame_summary(frames[0]))}")
        _print_variant_guards(con, frames[0], every)
        rest = frames[1:]
        if rest:
            con.print(f"         and {len(rest)} resume function(s) it calls (their variants "
                      "are entries of their own)")
        return
    con.print(f"[bold]frames[/bold]   {1 + len(frames)}: the method's own (above), then "
              "every other frame Dynamo compiled for the call")
    for i, r in enumerate(frames, 1):
        more = published.get(r.name[:200], 0)
        con.print(f"  {i:3d}  {escape(frame_summary(r))}"
                  + (f" (+{more} published after it: `cachectl ls --variants`)" if more else ""),
                  soft_wrap=True)
        _print_variant_guards(con, r, every)


def _print_variant_guards(con: Console, r: FrameRecord, every: bool) -> None:
    """Each variant's value guards (every guard with ``every``), hook checks folded as
    the method's are: ``[0] ___stack0 == 2.0``."""
    for j, v in enumerate(r.variants):
        texts = [demangle(str(g.get("text") or g.get("expr") or g.get("kind")))
                 for g in v.guards if every or g.get("kind") in VALUE_GUARDS]
        for _, line in fold_hooks(texts):
            con.print(f"         [{j}] " + escape(line), soft_wrap=True)


def explain_frames(con: Console, ma: EntryMeta, mb: EntryMeta, a: str, b: str) -> None:
    """A graph break's frames of two entries: those only one holds, and, for a frame both
    hold, the guards its first variants differ in."""
    fa = {r.id: r for r in read_frames(ma)}
    fb = {r.id: r for r in read_frames(mb)}
    if not fa and not fb:
        return
    con.print(f"frames: {1 + len(fa)} vs {1 + len(fb)} (the method's own, compared above, "
              "and the others)")
    for fid in sorted(set(fa) | set(fb), key=lambda f: (fa.get(f) or fb[f]).name):
        ra, rb = fa.get(fid), fb.get(fid)
        if ra is None or rb is None:
            r = ra or rb
            assert r is not None
            con.print(f"  only {(a if ra else b)[:12]}: {escape(frame_summary(r))}",
                      soft_wrap=True)
            continue
        if not ra.variants or not rb.variants:
            if frame_summary(ra) != frame_summary(rb):
                con.print(f"  {escape(ra.name)}: {escape(frame_summary(ra))} vs "
                          f"{escape(frame_summary(rb))}", soft_wrap=True)
            continue
        diff = guard_diff({"meta": {"guards": [dict(g) for g in ra.variants[0].guards]}},
                          {"meta": {"guards": [dict(g) for g in rb.variants[0].guards]}})
        if diff.rows:
            con.print(f"  {escape(ra.name)}: {len(diff.rows)} guards differ", soft_wrap=True)
            for ta, tb in diff.rows:
                con.print(f"    {escape(ta)}  |  {escape(tb)}", soft_wrap=True)
