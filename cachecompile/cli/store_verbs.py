"""The store's own ``cachectl`` verbs: ls, show, explain, purge, stats, gc, verify.

Torch-free: they read and maintain the local store through cachecompile.store. The
command group that holds them is cachecompile.cli.main.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cachecompile._version import code_label
from cachecompile.store import default_root, open_store, parse_size, settings
from cachecompile.store.errors import StoreNotFound
from cachecompile.store.explain import (
    NOT_COMPARED,
    SPECIALISED,
    differing,
    flatten,
    guard_diff,
    nearest,
)
from cachecompile.store.metrics import read_counters, stats_dir
from cachecompile.store.outcomes import EntryInfo
from cachecompile.store.policy import has_labels, is_shared_graph

from .common import (
    EXIT_PROBLEMS,
    RICH_MAX_ROWS,
    Folded,
    _console,
    _entries_table,
    _open,
    _open_local,
    _parse_labels,
    _plain_lines,
    _when,
    cache_dir_option,
    fold_variants,
    group_status,
    human_size,
    label_options,
    parse_duration,
    read_meta,
)
from .entry_view import (
    VALUE_GUARDS,
    entry_guards,
    explain_frames,
    print_frames,
    print_value_guards,
    published_frames,
)
from .json_out import Chunked, echo_json_array
from .readable import count, demangle, entries, factor_text, plural, split_graphs

if TYPE_CHECKING:
    from cachecompile.store import OpenStore

_SORTS: dict[str, Callable[[EntryInfo], Any]] = {
    "key": lambda i: i.key,
    "size": lambda i: i.size_bytes,
    "created": lambda i: i.created,
    "last_used": lambda i: i.last_used,
    "hits": lambda i: i.hits,
    "model": lambda i: i.labels.get("model", ""),
    "function": lambda i: i.labels.get("function", ""),
}


# A tensor guard's text with an exact size: "x is a float32[3,4] Tensor".
_SIZED = re.compile(r"\[[^\]]*\d[^\]]*\] Tensor")


@click.command("ls", short_help="List entries, one row each")
@cache_dir_option
@label_options
@click.option("--sort", type=click.Choice(sorted(_SORTS)), default="last_used", show_default=True)
@click.option("--reverse/--no-reverse", default=True, show_default=True,
              help="Largest / newest first.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--graphs", is_flag=True,
              help="Also list shared-graph entries (programs ranks share; label kind=graph).")
@click.option("--variants", "each", is_flag=True,
              help="A row per variant entry (default: a signature's variants fold into one).")
def ls_cmd(cache_dir: str | None, label: tuple[str, ...], model: str | None,
           function: str | None, sort: str, reverse: bool, as_json: bool,
           graphs: bool, each: bool) -> None:
    """List entries: one row per signature, its variants folded (--variants: one each)."""
    st = _open(cache_dir)
    want = _parse_labels(label, model, function)
    everything = list(st.entries())
    if want:
        infos = [i for i in everything if has_labels(i.labels, want)
                 and (graphs or want.get("kind") == "graph" or not is_shared_graph(i.labels))]
    else:   # no label to match: no has_labels per entry (100,000 calls)
        infos = list(everything) if graphs else [i for i in everything
                                                 if not is_shared_graph(i.labels)]
    groups = group_status(everything)
    if as_json:  # every entry: what a script reads, whatever the table folds
        echo_json_array(i.to_json() for i in sorted(infos, key=_SORTS[sort], reverse=reverse))
        return
    folded = Folded(infos, {}) if each else fold_variants(infos)
    infos = sorted(folded.rows, key=_SORTS[sort], reverse=reverse)
    if not infos:
        click.echo(f"no entries in {st.root}")
        return
    # The count every verb gives: the user's entries, and the shared graphs apart.
    matching = [i for i in everything if has_labels(i.labels, want)] if want else everything
    user, shared = split_graphs(i.labels for i in matching)
    footer = entries(user, shared) + (", the shared graphs not listed (--graphs lists them)"
                                      if shared and not graphs else "") + (
        f", in {plural(len(infos), 'row')} (--variants lists each)" if folded.variants else "")
    if len(infos) > RICH_MAX_ROWS:
        # rich lays out ~1,500 rows/s; a plain aligned table keeps 10,000 entries well under 1 s.
        out = Chunked()
        for line in _plain_lines(infos, groups, folded.variants):   # written as made
            out.write(line + "\n")
        out.write(footer + "\n")
        out.flush()
        return
    _console().print(_entries_table(infos, groups=groups, variants=folded.variants))
    click.echo(footer)


_SHOWN_META = ("adapter", "signature", "compile_seconds", "first_call_seconds", "format")


@click.command("show", short_help="Show an entry: what it serves, guards, factors")
@cache_dir_option
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--guards", "all_guards", is_flag=True, help="List every guard, not only the "
              "ones on values.")
def show_cmd(cache_dir: str | None, key: str, as_json: bool, all_guards: bool) -> None:
    """Show an entry: what it serves, its guards, factors and files (KEY may be a
    unique prefix). The raw manifest (the program's metadata, every guard as stored)
    is behind --json."""
    st = _open_local(cache_dir)
    digest = st.resolve(key)
    m = st.manifest(digest)
    if as_json:
        click.echo(json.dumps(m, indent=1, sort_keys=True))
        return
    info = st.stat(digest)
    con = _console()
    labels = m.get("labels") or {}
    meta = read_meta(m)
    con.print(f"[bold]key[/bold]      {digest}")
    if labels.get("model") or labels.get("function"):
        con.print(f"[bold]serves[/bold]   {escape(labels.get('model', '?'))}."
                  f"{escape(labels.get('function', '?'))} [{escape(labels.get('signature', ''))}]"
                  + (f" variant {escape(labels['variant'])}" if "variant" in labels else ""))
    con.print(f"[bold]path[/bold]     {st.entry_dir(digest)}")
    code = labels.get("code")
    con.print(f"[bold]code[/bold]     written by cachecompile "
              f"{escape(str(((m.get('factors') or {}).get('versions') or {}).get('cachecompile', '?')))}"
              f", code {escape(code or 'before code labels')}"
              + (" (this code)" if code == code_label() else
                 " (other code: it never hits here; `cachectl gc --other-versions` retires it)"))
    con.print(f"[bold]created[/bold]  {_when(m['created'])}")
    if info is not None:
        con.print(f"[bold]used[/bold]     {_when(info.last_used)}  ({info.hits} hits)")
    con.print("[bold]labels[/bold]   " + escape(", ".join(
        f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("model", "function",
                                                                     "signature"))))
    con.print("[bold]meta[/bold]     " + escape(", ".join(
        f"{k}={getattr(meta, k)}" for k in _SHOWN_META
        if getattr(meta, k) not in (None, ""))))
    if meta.cold_phases:
        con.print("[bold]cold[/bold]     " + escape(", ".join(
            f"{k} {v:.2f}s" for k, v in meta.cold_phases.items()
            if isinstance(v, (int, float)))))
    print_value_guards(con, m, all_guards)
    print_frames(con, meta, all_guards, published_frames(st, labels, meta))
    ft = Table(title="factors", box=None, pad_edge=False, title_justify="left")
    ft.add_column("factor")
    ft.add_column("value", overflow="fold")
    for k, v in flatten(m["factors"]).items():
        ft.add_row(escape(k), escape(factor_text(k, v)))
    con.print(ft)
    fl = Table(title="files", box=None, pad_edge=False, title_justify="left")
    fl.add_column("name")
    fl.add_column("size", justify="right")
    fl.add_column("xxh3_128")
    for name, rec in sorted(m["files"].items()):
        fl.add_row(name, human_size(rec["size"]), rec["xxh3_128"])
    con.print(fl)


@click.command("explain", short_help="Why two entries differ, or what one needs to serve")
@cache_dir_option
@click.argument("key")
@click.argument("key2", required=False)
@click.option("--all", "show_all", is_flag=True, help="Also list the factors that are equal.")
@click.option("--json", "as_json", is_flag=True, help="Print the differing factors as JSON.")
def explain_cmd(cache_dir: str | None, key: str, key2: str | None, show_all: bool,  # noqa: C901 (today's exception: CLI: one key or two, text or JSON)
                as_json: bool) -> None:
    """Compare the factors and guards of two entries; with one KEY, against its nearest
    entry (same model and function). Guards that differ in value come first; guards that
    differ only by a global Dynamo renamed are folded. An entry with no sibling is
    explained alone: what a call must be for it to serve."""
    st = _open_local(cache_dir)
    a = st.resolve(key)
    ma = st.manifest(a)
    if key2 is None:
        # Same function and model (where the entry has them), fewest factors apart.
        same = {k: ma["labels"][k] for k in ("function", "model") if k in ma["labels"]}
        near = nearest(st, ma["factors"], same, exclude=a)
        if near is None:
            if as_json:
                click.echo(json.dumps({"a": a, "b": None, "guards": [
                    g.get("text") for g in entry_guards(ma) if g.get("kind") in VALUE_GUARDS]},
                    indent=1))
                return
            con = _console()
            labels = ma.get("labels") or {}
            meta = read_meta(ma)
            published = published_frames(st, labels, meta)
            con.print(f"{a[:12]} is the only entry of {escape(labels.get('model', '?'))}."
                      f"{escape(labels.get('function', '?'))}"
                      + (" but for the frame variants published after it" if published
                         else "")
                      + f"; it serves calls [{escape(labels.get('signature', ''))}] while "
                      "these hold:")
            print_value_guards(con, ma, show_all)
            print_frames(con, meta, show_all, published)
            return
        b = near.key
    else:
        b = st.resolve(key2)
    mb = st.manifest(b)
    fa, fb = flatten(ma["factors"]), flatten(mb["factors"])
    names = sorted(set(fa) | set(fb))
    # The variant index is the slot an entry took, not what it was compiled for.
    diff = differing(ma["factors"], mb["factors"], ignore=NOT_COMPARED)
    guards = guard_diff(ma, mb)
    if as_json:
        click.echo(json.dumps({"a": a, "b": b, "differ": {
            n: [fa.get(n), fb.get(n)] for n in diff}, "guards": guards.rows,
            "guards_changed": guards.changed, "guards_renamed": guards.renamed}, indent=1))
        return
    con = _console()
    con.print(f"{a[:12]} vs {b[:12]}: {len(diff)} of {len(names)} factors differ")
    t = Table(box=None, pad_edge=False)
    t.add_column("factor", no_wrap=True)
    t.add_column(a[:12], overflow="fold")
    t.add_column(b[:12], overflow="fold")
    for n in names:
        va = factor_text(n, fa[n]) if n in fa else "(absent)"
        vb = factor_text(n, fb[n]) if n in fb else "(absent)"
        if n in diff:
            t.add_row(Text("* " + n, style="bold red"), Text(va, style="red"), Text(vb, style="red"))
        elif show_all:
            t.add_row(escape("  " + n), escape(va), escape(vb))
    if diff:
        con.print(t)
    for title, rows in ((f"{len(guards.changed)} guards differ in value", guards.changed),
                        (f"{len(guards.only)} guards only one entry has", guards.only)):
        if not rows:
            continue
        con.print(f"{title} (Dynamo's, as each entry was compiled):")
        g = Table(box=None, pad_edge=False)
        g.add_column(a[:12], overflow="fold")
        g.add_column(b[:12], overflow="fold")
        for ta, tb in rows:
            g.add_row(escape(demangle(ta)), escape(demangle(tb)))
        con.print(g)
    if any((m.get("labels") or {}).get("dynamic") == "true" for m in (ma, mb)) and any(
            _SIZED.search(t) for row in guards.changed for t in row):
        con.print(f"An exact size in a tensor guard is one Dynamo specialised: {SPECIALISED}, "
                  "or it is 0 or 1.")
    if guards.renamed:
        con.print(f"({guards.renamed} guards differ only by a global Dynamo renamed, such as "
                  "__builtins_dict___N: the same check, folded)")
    explain_frames(con, read_meta(ma), read_meta(mb), a, b)


@click.command("purge", short_help="Remove entries by key, label, age or --all")
@cache_dir_option
@click.argument("keys", nargs=-1)
@label_options
@click.option("--older-than", default=None, metavar="AGE", help="Not used for AGE (30m, 12h, 7d, 2w).")
@click.option("--all", "purge_all", is_flag=True, help="Every entry.")
@click.option("--include-pinned", is_flag=True,
              help="Also remove entries a live process has pinned (and their groups).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="Only show what would go.")
def purge_cmd(cache_dir: str | None, keys: tuple[str, ...], label: tuple[str, ...],
              model: str | None, function: str | None, older_than: str | None,
              purge_all: bool, include_pinned: bool, yes: bool, dry_run: bool) -> None:
    """Remove entries by KEY (prefixes), label, age, or --all (pinned ones stay)."""
    want = _parse_labels(label, model, function)
    age = parse_duration(older_than) if older_than is not None else None
    if not (keys or want or age is not None or purge_all):
        raise click.UsageError("say what to purge: KEY..., --label, --older-than or --all")
    st = _open_local(cache_dir)
    if not dry_run:
        st.require_writable("purge entries")  # before showing a list that cannot go
    digests = [st.resolve(k) for k in keys]
    goes, kept = st.purge_plan(keys=digests or None, labels=want or None, older_than=age,
                               all=purge_all, include_pinned=include_pinned)
    if kept:
        click.echo(f"kept {len(kept)} pinned entries (a live process uses them or their "
                   "group; --include-pinned removes them too): "
                   + ", ".join(i.key[:12] for i in kept))
    if not goes:
        click.echo("nothing to purge")
        return
    _console().print(_entries_table(goes, title=f"{entries(*split_graphs(i.labels for i in goes))}, "
                                                f"{human_size(sum(i.size_bytes for i in goes))}"))
    if dry_run:
        click.echo("dry run: nothing removed")
        return
    if not yes and not click.confirm(f"remove {entries(*split_graphs(i.labels for i in goes))}?",
                                     default=False):
        click.echo("aborted")
        return
    gone = st.purge(keys=[i.key for i in goes], include_pinned=include_pinned)
    click.echo(f"removed {entries(*split_graphs(i.labels for i in gone))} "
               f"({human_size(sum(i.size_bytes for i in gone))})"
               + (f"; {len(goes) - len(gone)} kept (pinned meanwhile)"
                  if len(gone) < len(goes) else ""))


# What each miss kind means, as `cachectl stats` prints it.
_MISS_KINDS = {
    "absent": "no entry for the call's key",
    "guard": "an entry was there; a guard failed",
    "stale": "the entry's source files changed",
    "corrupt": "the entry failed its checksums",
    "insecure": "the entry's files are not trusted",
    "unloadable": "the entry did not load",
    "operator": "the program calls an operator not registered",
    "format": "another format or backend",
}


def _open_counted(cache_dir: str | None) -> tuple[OpenStore, StoreNotFound | None]:
    """The store at ``cache_dir`` for ``stats``; where there is none but read-only
    processes counted lookups of that path (a consumer of a store nothing was published
    to, docs/store.md), a read-only view of the empty path, with why there is no store."""
    try:
        return _open(cache_dir), None
    except StoreNotFound as e:
        root = default_root() if cache_dir is None else e.path
        if not read_counters(root):
            raise  # a mistyped path stays an error
        return open_store(root, readonly=True, remote=settings.REMOTE.get()), e


@click.command("stats", short_help="Entries, size, hits, misses by reason, evictions")
@cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@click.option("--zero", is_flag=True, help="Reset the counters (hits, misses, ...).")
@click.option("--recount", is_flag=True,
              help="Recount entries and sizes from every record and the disk (and correct "
                   "the totals the index keeps) instead of reading those totals.")
def stats_cmd(cache_dir: str | None, as_json: bool, zero: bool, recount: bool) -> None:  # noqa: C901 (today's exception: CLI: text and JSON forms)
    """Entries, bytes, cap, hits, misses by reason, evictions, corruptions."""
    st, missing = _open_counted(cache_dir)
    if zero:
        st.maintenance().zero_stats()
        if st.readonly and not as_json:
            click.echo("read-only store: zeroed the counters of read-only processes; the "
                       "store's own counters stay", err=True)
    s = st.stats(recount=recount)  # with a remote tier behind the store, it names the remote
    s["readonly_stats_dir"] = str(stats_dir(st.root))
    if missing is not None:
        s["no_store"] = missing.problem
    if as_json:
        click.echo(json.dumps(s, indent=1, sort_keys=True))
        return
    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column("stat")
    t.add_column("value", justify="right")
    t.add_row("root", s["root"])
    if missing is not None:
        t.add_row("store", "none at this path (nothing was published here): the counts "
                           "are its read-only processes'")
    g = s.get("shared_graphs") or {}
    # The count every verb gives (ls, export, verify...): "3 (+3 shared graphs)".
    t.add_row("entries", count(s["entries"], g.get("entries", 0)))
    # Physical: content shared by entries (dedup) counts once, as it does against the cap.
    t.add_row("size", f"{human_size(s['bytes'])} of {human_size(s['cap'])} "
                      f"({100 * s['bytes'] / max(s['cap'], 1):.1f}%)"
                      + (f", {human_size(s['logical_bytes'])} logical"
                         if s.get("logical_bytes", s["bytes"]) != s["bytes"] else ""))
    # A frame compiled live inside a hit (a graph break's frame no stored variant served)
    # is no lookup of a signature: counted apart, so that two processes that both hit
    # read as 100% hits, with their live frames beside.
    misses = {k: n for k, n in s["misses"].items() if k != "frame"}
    total_misses = sum(misses.values())
    lookups = s["hits"] + total_misses  # each miss is one lookup that found nothing to use
    t.add_row("hits", f"{s['hits']}" + (f" ({100 * s['hits'] / lookups:.1f}%)" if lookups else ""))
    t.add_row("  local", str(s["hits_local"]))
    t.add_row("  remote", str(s["hits_remote"]))
    # A chain of remote levels (or one level): what each served, nearest first; levels
    # no longer configured that served hits before are listed after them.
    shown = [lv["remote"] for lv in s.get("levels") or []]
    by_level = s.get("hits_remote_levels") or {}
    for name in shown + sorted(set(by_level) - set(shown)):
        if len(shown) > 1 or by_level.get(name):
            t.add_row(escape(f"    {name}"), str(by_level.get(name, 0)))
    t.add_row("misses", str(total_misses))
    about = s.get("misses_about") or {}
    for kind, n in sorted(misses.items()):
        t.add_row(f"  {kind}", str(n) + f"  ({_MISS_KINDS.get(kind, kind)})")
        # What the misses were about (which guard failed), the most frequent first.
        subjects = sorted((about.get(kind) or {}).items(), key=lambda kv: (-kv[1], kv[0]))
        for subject, m in subjects[:10]:
            t.add_row(escape(f"    {subject}"), str(m))
        if len(subjects) > 10:
            t.add_row(f"    ... {len(subjects) - 10} more", "")
    if s["misses"].get("frame"):
        t.add_row("frames compiled live", f"{s['misses']['frame']}  (graph breaks' frames "
                                          "no stored variant served, inside hits)")
        frames = sorted((about.get("frame") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
        for subject, m in frames[:10]:
            t.add_row(escape(f"    {subject}"), str(m))
    ro = s.get("readonly_processes") or {}
    if ro.get("hits") or ro.get("misses"):
        t.add_row("read-only processes", f"{ro['hits']} hits, {ro['misses']} misses "
                                         f"(counted above; from {s['readonly_stats_dir']})")
    if g.get("entries") or g.get("hits") or g.get("misses"):
        # Internal entries (ls --graphs): their lookups counted apart, so the numbers
        # above are the user's.
        t.add_row("shared graphs", f"{g['hits']} hits, {sum(g['misses'].values())} misses "
                                   "(their lookups, not counted above)")
    t.add_row("publishes", count(s["publishes"], g.get("publishes", 0)))
    for k in ("evictions", "corruptions", "quarantined"):
        t.add_row(k, str(s[k]))
    if s.get("pulls"):
        t.add_row("pulled", f"{s['pulls']} (cachectl pull; not hits)")
    if s.get("readonly"):
        t.add_row("read-only", "yes")
    _console().print(t)


@click.command("gc", short_help="Enforce the size cap now (LRU; pinned entries stay)")
@cache_dir_option
@click.option("--max-size", default=None, metavar="SIZE", help="Cap for this run (e.g. 5G).")
@click.option("--other-versions", is_flag=True,
              help="First retire every entry written by other cachecompile code (another "
                   "release or a local edit: its `code` label is not this code's); they can "
                   "never hit here. Pinned entries stay.")
def gc_cmd(cache_dir: str | None, max_size: str | None, other_versions: bool) -> None:
    """Enforce the size cap now (LRU; pinned entries skipped); sweep stale temp dirs."""
    st = _open_local(cache_dir)
    cap = parse_size(max_size) if max_size is not None else None
    if other_versions:
        st.require_writable("retire entries")
        mine = code_label()
        others = [i.key for i in st.entries() if i.labels.get("code") != mine]
        gone = st.purge(keys=others) if others else []
        click.echo(f"retired {len(gone)} entries written by other cachecompile code "
                   f"(this code: {mine}; {len(others) - len(gone)} pinned, kept)")
    r = st.gc(cap)
    click.echo(f"evicted {entries(*split_graphs(i.labels for i in r.evicted))} "
               f"({human_size(r.freed_bytes)}); "
               f"{human_size(r.bytes_after)} of {human_size(r.max_size)} used; "
               f"{len(r.pinned_skipped)} pinned; {r.temp_swept} temp dirs and "
               f"{r.blobs_removed} unused blobs swept")


@click.command("verify", short_help="Check checksums and the index (exit 1 on problems)")
@cache_dir_option
@click.option("--fix", is_flag=True, help="Quarantine bad entries and rebuild the index.")
@click.option("--full", is_flag=True,
              help="Read every entry's checksums, also those unchanged since their last "
                   "full check (what only a failing disk changes without a write).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report (checked, problems, fixed) as one JSON object.")
def verify_cmd(cache_dir: str | None, fix: bool, full: bool, as_json: bool) -> None:
    """Check the entries' checksums and the index against the disk (exit 1 on problems).

    Each entry is read in full the first time; after that only entries whose files
    changed (inode, size, mtime or ctime) are read again, unless --full."""
    st = _open_local(cache_dir)
    r = st.verify(fix=fix, full=full)
    if as_json:
        click.echo(json.dumps({"checked": r.checked, "unchanged": r.unchanged,
                               "shared_graphs": r.shared_graphs,
                               "problems": [list(p) for p in r.problems],
                               "index_missing": r.index_missing, "index_stale": r.index_stale,
                               "quarantined": r.quarantined, "ok": r.ok}, indent=1))
    else:
        for d, reason in r.problems:
            click.echo(f"{d}  {reason}" + ("  -> quarantined" if d in r.quarantined else ""))
        for d in r.index_missing:
            click.echo(f"{d}  on disk but not in the index" + ("  -> reindexed" if fix else ""))
        for d in r.index_stale:
            click.echo(f"{d}  in the index but not on disk" + ("  -> reindexed" if fix else ""))
        # Said only when some were skipped: "checked N entries: ok" stays as it was.
        same = (f", {r.unchanged} unchanged since their last full check (--full reads "
                "them too)") if r.unchanged else ""
        click.echo(f"checked {entries(r.checked - r.shared_graphs, r.shared_graphs)}{same}: "
                   + ("ok" if r.ok else f"{len(r.problems)} bad, "
                      f"{len(r.index_missing) + len(r.index_stale)} index mismatches"))
    if not r.ok:
        sys.exit(EXIT_PROBLEMS)


@click.command("init", short_help="Make a team store a group reads and writes")
@cache_dir_option
@click.option("--shared", "group", metavar="GROUP", required=True,
              help="The OS group whose members share the store.")
def init_cmd(cache_dir: str | None, group: str) -> None:
    """Make a team store: every member of GROUP reads and writes it, whatever their umask."""
    from cachecompile.store import default_root, init_shared

    st = init_shared(cache_dir if cache_dir is not None else default_root(), group)
    click.echo(f"{st.root}: a store shared by group {group} (mode 2770, setgid); members "
               "open it as it is, with no setting")
