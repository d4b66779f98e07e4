"""``cachectl`` verbs of the remote tier and of bundles (registered in cachecompile.cli.main).

    cachectl remote ls | stats | purge        the remote tier itself (Redis, S3, file://, HTTP)
    cachectl push [KEY...]   /  pull [KEY...] copy entries local -> remote / remote -> local
    cachectl export OUT.tar.zst [KEY...]      entries, manifests, signatures in one file
    cachectl export --oci DIR [KEY...]        the same as an OCI image layout (skopeo, oras)
    cachectl import IN.tar.zst | DIR          verify, then publish (a bundle: all or none)
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from cachecompile.store import Maintenance, open_store, settings
from cachecompile.store.bundle import export_bundle, import_bundle
from cachecompile.store.keys import match_prefix
from cachecompile.store.outcomes import EntryInfo, Hit
from cachecompile.store.policy import has_labels
from cachecompile.store.remote import Listed, OciLayoutRemote, Remote, open_levels, split_levels
from cachecompile.store.remote.push import push_entries
from cachecompile.store.signing import Trust
from cachecompile.store.tiered import TieredStore

from .common import (
    EXIT_STORE,
    CliError,
    Folded,
    _console,
    _entries_table,
    _parse_labels,
    cache_dir_option,
    fold_variants,
    human_size,
    label_options,
)
from .readable import entries, plural, split_graphs, were

F = TypeVar("F", bound=Callable[..., Any])


def remote_option(f: F) -> F:
    return click.option(
        "--remote", "remote_url", envvar=settings.REMOTE.name, default=None, metavar="URL",
        help="redis://host:port/db, s3://bucket/prefix, file:///shared/dir, "
             "http(s)://host/prefix or oci://registry/repository, [?mode=ro], or a chain of them separated by commas, "
             "nearest first (default: $CACHECOMPILE_REMOTE). A password is best given in "
             "$CACHECOMPILE_REMOTE_PASSWORD or $CACHECOMPILE_REMOTE_PASSWORD_FILE; it is "
             "never printed.")(f)


def _levels(url: str | None) -> list[Remote]:
    """Every level the URL names (one, or a chain), each checked now: a failure is one
    clear line, rather than one per entry."""
    if not url:
        raise click.UsageError("no remote: pass --remote redis://host:port/db, "
                               "s3://bucket/prefix, file:///dir, http://host/prefix or "
                               "oci://registry/repository, or set CACHECOMPILE_REMOTE")
    levels = open_levels(url)
    for r in levels:
        r.breaker.quiet = True  # a failure is this command's error line, not a warning too
        r.ping()
    return levels


def _remote(url: str | None) -> Remote:
    """The one remote of a verb that works on one level (a chain is refused, naming its
    levels: pick one with --remote)."""
    if url and len(split_levels(url)) > 1:
        shown = ", ".join(r.config.display for r in open_levels(url))
        raise click.UsageError(f"--remote names a chain of levels ({shown}): this verb works "
                               "on one level; pass that level's URL with --remote")
    return _levels(url)[0]


def _local(cache_dir: str | None, *, create: bool) -> Maintenance:
    # The local store alone: these verbs move entries between the tiers explicitly.
    # Verbs that only read it never create it (as the store verbs do): on a mistyped
    # --cache-dir, "pushed 0 entries" would hide the typo and leave a stray cache behind.
    return open_store(cache_dir, remote="", create=create).maintenance()


@contextlib.contextmanager
def _progress(label: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A rich transfer bar on a terminal (stderr); silent otherwise."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _info(row: Listed) -> EntryInfo:
    """A remote record as a row of the tables ``cachectl ls`` prints: a malformed one
    with its key and its own size, and nothing else (nothing in it can be read)."""
    rec = row.record
    if rec is None:
        return EntryInfo(key=row.key, size_bytes=row.size, created=0.0, last_used=0.0,
                         hits=0, state=row.state)
    m = rec.manifest
    return EntryInfo(key=rec.key, size_bytes=rec.size_bytes, created=float(m["created"]),
                     last_used=float(m["created"]), hits=0,
                     labels={str(k): str(v) for k, v in m["labels"].items()},
                     state=row.state)


def _rows(r: Remote) -> tuple[list[EntryInfo], dict[str, str]]:
    """Every remote record as a row, malformed ones included; what is wrong with each
    malformed one, by key."""
    rows = list(r.listing())
    return [_info(x) for x in rows], {x.key: x.problem for x in rows if x.record is None}


def _states(malformed: bool, unsigned: bool) -> set[str]:
    """The states ``--malformed`` / ``--unsigned`` select (both: either); none: every state."""
    return {s for s, on in (("malformed", malformed), ("unsigned", unsigned)) if on}


def state_options(f: F) -> F:
    f = click.option("--unsigned", is_flag=True,
                     help="Records without a signature (left by a node without "
                          "CACHECOMPILE_SIGNING_KEY; keyed nodes refuse them).")(f)
    return click.option("--malformed", is_flag=True,
                        help="Records that cannot be read (a torn or garbage write, or a "
                             "format this version does not know): no node can load "
                             "them.")(f)


def _selected(infos: list[EntryInfo], keys: tuple[str, ...], want: dict[str, str],
              resolve: Callable[[str], str],
              states: set[str] | None = None) -> list[EntryInfo]:
    """The rows KEY... (prefixes) and the label filters select, and of ``states`` if any."""
    if keys:
        chosen = {resolve(k) for k in keys}
        infos = [i for i in infos if i.key in chosen]
    return [i for i in infos if has_labels(i.labels, want)
            and (not states or i.state in states)]


@click.group("remote", short_help="The remote tiers: ls, stats, purge")
def remote_group() -> None:
    """The remote tier (Redis, S3, a shared directory, an HTTP cache): list, statistics,
    purge."""


@remote_group.command("ls", short_help="List the remote's entries (signed or unsigned)")
@remote_option
@label_options
@state_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array, one object per entry.")
@click.option("--variants", "each", is_flag=True,
              help="A row per variant entry (default: a signature's variants fold into one).")
def remote_ls(remote_url: str | None, label: tuple[str, ...], model: str | None,
              function: str | None, malformed: bool, unsigned: bool, as_json: bool,
              each: bool) -> None:
    """List the remote's records (state: signed, unsigned or malformed), a signature's
    variants folded into one row as `cachectl ls` does (--variants: one each)."""
    r = _remote(remote_url)
    want = _parse_labels(label, model, function)
    rows, problems = _rows(r)
    infos = sorted(_selected(rows, (), want, str, _states(malformed, unsigned)),
                   key=lambda i: i.created, reverse=True)
    if as_json:
        click.echo(json.dumps([{**i.to_json(), **({"problem": problems[i.key]}
                                                  if i.key in problems else {})}
                               for i in infos], indent=1))
        return
    if not infos:
        click.echo(f"no entries in {r.config.display}")
        return
    bad = [i for i in infos if i.key in problems]
    folded = Folded(infos, {}) if each else fold_variants(infos)
    shown = sorted(folded.rows, key=lambda i: i.created, reverse=True)
    _console().print(_entries_table(shown, variants=folded.variants))
    if folded.variants:
        click.echo(f"{entries(len(infos))} in {plural(len(shown), 'row')} (--variants lists "
                   "each)")
    for i in bad:
        click.echo(f"malformed {i.key}: {problems[i.key]}", err=True)
    if bad:
        click.echo(f"{plural(len(bad), 'malformed record')}, which no node can load. "
                   "`cachectl remote purge --malformed` removes them; a `cachectl push` of "
                   "the entry with the fleet's key replaces one", err=True)


@remote_group.command("stats", short_help="Entries, bytes and the server's space used")
@remote_option
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
def remote_stats(remote_url: str | None, as_json: bool) -> None:
    """Entries, bytes (logical), signed entries and the server's space: Redis's memory
    use, or the bucket prefix's objects and bytes."""
    levels = _levels(remote_url)
    all_stats = [_level_stats(r) for r in levels]
    if as_json:
        # One level: its numbers; a chain: a list of them, nearest first.
        out: Any = all_stats[0] if len(all_stats) == 1 else all_stats
        click.echo(json.dumps(out, indent=1, sort_keys=True))
        return
    for i, s in enumerate(all_stats):
        if len(all_stats) > 1:
            click.echo(("" if i == 0 else "\n") + f"level {i + 1} of {len(all_stats)}")
        _print_level_stats(s)


def _level_stats(r: Remote) -> dict[str, Any]:
    rows = list(r.listing())
    recs = [x.record for x in rows if x.record is not None]
    return {"remote": r.config.display, "readonly": r.readonly, "entries": len(recs),
            "bytes": sum(x.size_bytes for x in recs), "signed": sum(1 for x in recs if x.sig),
            "malformed": len(rows) - len(recs), **r.info()}


def _print_level_stats(s: dict[str, Any]) -> None:
    for k in ("remote", "entries", "signed", "malformed"):
        click.echo(f"{k:<16} {s[k]}")
    click.echo(f"{'size':<16} {human_size(s['bytes'])}")
    if "used_memory" in s:
        cap = human_size(s["maxmemory"]) if s["maxmemory"] else "no limit"
        click.echo(f"{'server memory':<16} {human_size(s['used_memory'])} of {cap} "
                   f"({s['maxmemory_policy'] or '-'})")
    if "stored_bytes" in s:
        click.echo(f"{'stored objects':<16} {s['objects']} "
                   f"({human_size(s['stored_bytes'])} stored, blobs shared)")
    if s["readonly"]:
        click.echo(f"{'read-only':<16} yes")


@remote_group.command("purge", short_help="Remove remote entries; sweep unreferenced blobs")
@remote_option
@click.argument("keys", nargs=-1)
@label_options
@state_options
@click.option("--all", "purge_all", is_flag=True, help="Every record, malformed ones too.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="Only show what would go.")
def remote_purge(remote_url: str | None, keys: tuple[str, ...], label: tuple[str, ...],
                 model: str | None, function: str | None, malformed: bool, unsigned: bool,
                 purge_all: bool, yes: bool, dry_run: bool) -> None:
    """Remove remote records by KEY, label, state (--malformed, --unsigned) or --all; then
    sweep unreferenced blobs. The filters given all apply (--unsigned --model M: M's
    unsigned records); a malformed record has no labels, so name it by KEY or
    --malformed."""
    want = _parse_labels(label, model, function)
    states = _states(malformed, unsigned)
    if not (keys or want or states or purge_all):
        raise click.UsageError("say what to purge: KEY..., --label, --malformed, --unsigned "
                               "or --all")
    r = _remote(remote_url)
    infos, _ = _rows(r)
    goes = _selected(infos, keys, want,
                     lambda k: match_prefix(k, [i.key for i in infos], "remote entry"),
                     states)
    if goes:
        _console().print(_entries_table(
            goes, title=f"remote: {entries(*split_graphs(i.labels for i in goes))}, "
                        f"{human_size(sum(i.size_bytes for i in goes))}"))
    if dry_run:
        click.echo("dry run: nothing removed")
        return
    if goes and not yes and not click.confirm(
            f"remove {entries(*split_graphs(i.labels for i in goes))}?", default=False):
        click.echo("aborted")
        return
    for i in goes:
        r.delete(i.key)
    swept = r.sweep()
    click.echo(f"removed {entries(*split_graphs(i.labels for i in goes))}; swept "
               f"{plural(swept, 'unreferenced blob key')}")


@click.command("push", short_help="Upload local entries to the remote tier")
@cache_dir_option
@remote_option
@click.argument("keys", nargs=-1)
@label_options
@click.option("--force", is_flag=True,
              help="Overwrite entries the remote has already (never a signed record "
                   "with an unsigned one).")
@click.option("--resign", is_flag=True,
              help="Re-sign, with CACHECOMPILE_SIGNING_KEY, the remote records signed with "
                   "another key this node verifies (CACHECOMPILE_VERIFY_KEYS): the step "
                   "before retiring an old key.")
def push_cmd(cache_dir: str | None, remote_url: str | None, keys: tuple[str, ...],
             label: tuple[str, ...], model: str | None, function: str | None,
             force: bool, resign: bool) -> None:
    """Upload local entries to the remote: all, or those KEY... and filters select.

    With CACHECOMPILE_SIGNING_KEY set, a remote record that does not verify under it
    (unsigned, malformed, or signed with another key) is replaced: run push with the
    fleet's key to repair such records. Without a key, signed records stay as they are.
    """
    levels = _levels(remote_url)
    if resign and levels[0].trust.key is None:
        raise click.UsageError("--resign signs with CACHECOMPILE_SIGNING_KEY, which is not set")
    st = _local(cache_dir, create=False)
    infos = _selected(list(st.entries()), keys, _parse_labels(label, model, function),
                      st.resolve)
    # A chain: every level that takes writes (a mode=ro level is skipped, unless it is
    # the only one named: then pushing is the error it is).
    writable = [r for r in levels if not r.readonly] or levels[:1]
    for r in writable:
        _push_to(r, st, infos, force, resign)


def _push_to(r: Remote, st: Maintenance, infos: list[EntryInfo], force: bool,
             resign: bool) -> None:
    with _progress("push", sum(i.size_bytes for i in infos)) as advance:
        # repair (push_entries' default): the operator who pushes with a key vouches
        # that it is the fleet's.
        done = push_entries(r, st, [i.key for i in infos], overwrite=force, resign=resign,
                            progress=advance,
                            on_note=lambda d, text: click.echo(f"{d[:12]}  {text}", err=True))
    click.echo(f"{entries(*split_graphs(i.labels for i in infos))}: pushed {done.sent} to "
               f"{r.config.display}; {were(done.there)} there already"
               + (f"; replaced {plural(done.repaired, 'record')} that did not verify"
                  if done.repaired else "")
               + (f"; re-signed {plural(done.resigned, 'record')} with the current key"
                  if done.resigned else "")
               + (f"; kept {plural(len(done.kept), 'signed record')}" if done.kept else "")
               + (f"; {plural(len(done.refused), 'record')} not replaced (the server cannot "
                  "do it safely)" if done.refused else ""))


@click.command("pull", short_help="Download remote entries into the local store")
@cache_dir_option
@remote_option
@click.argument("keys", nargs=-1)
@label_options
def pull_cmd(cache_dir: str | None, remote_url: str | None, keys: tuple[str, ...],
             label: tuple[str, ...], model: str | None, function: str | None) -> None:
    """Download remote entries (verified, then published): all, or those selected."""
    levels = _levels(remote_url)
    local = _local(cache_dir, create=True)  # pulling into a new node's cache makes it
    local.require_writable("pull entries")
    st = TieredStore(local, levels)  # a chain: nearest level first, nearer ones backfilled
    infos = list({i.key: i for r in reversed(levels)
                  for i in (_info(Listed(rec.key, 0, rec)) for rec in r.records())}.values())
    todo = _selected(infos, keys, _parse_labels(label, model, function),
                     lambda k: match_prefix(k, [i.key for i in infos], "remote entry"))
    got: list[EntryInfo] = []
    have = failed = 0
    for i in todo:
        if isinstance(st.peek(i.key), Hit):
            have += 1
            continue
        # pull, not get: a prefetch is not a hit (cachectl stats counts it as a pull).
        if isinstance(st.pull(i.key), Hit):
            got.append(i)
        else:
            failed += 1  # cachecompile.store.tiered logged why
    st.flush()  # what a chain's lower levels gave goes up to the nearer ones now
    shown = ", ".join(r.config.display for r in levels)
    click.echo(f"pulled {entries(*split_graphs(i.labels for i in got))} from "
               f"{shown}; {were(have)} here already"
               + (f"; {failed} refused or failed" if failed else ""))
    if failed:
        raise CliError(f"{entries(failed)} could not be pulled", EXIT_STORE)


@click.command("export", short_help="Write entries to a bundle or an OCI image layout")
@cache_dir_option
@click.argument("out", type=click.Path())
@click.argument("keys", nargs=-1)
@label_options
@click.option("--oci", is_flag=True,
              help="OUT is a directory in the OCI image layout, one artifact per entry "
                   "tagged cc-<key>: push it with skopeo or oras to a registry the oci:// "
                   "tier serves")
def export_cmd(cache_dir: str | None, out: str, keys: tuple[str, ...],
               label: tuple[str, ...], model: str | None, function: str | None,
               oci: bool) -> None:
    """Write entries to a bundle OUT: .tar.zst, .tar.gz or .tar; all, or those selected.
    With --oci, OUT is a directory in the OCI image layout."""
    st = _local(cache_dir, create=False)
    infos = _selected(list(st.entries()), keys, _parse_labels(label, model, function),
                      st.resolve)
    if not infos:
        raise click.UsageError("no entries match: nothing to export")
    if oci:
        _export_oci(st, out, infos)
        return
    if Path(out).is_dir():
        raise click.UsageError(f"{out} is a directory: a bundle is a file (for an OCI image "
                               "layout, pass --oci)")
    with _progress("export", sum(i.size_bytes for i in infos)) as advance:
        rep = export_bundle(st, out, [i.key for i in infos], progress=advance)
    labels = {i.key: i.labels for i in infos}
    click.echo(f"exported {entries(*split_graphs(labels.get(d, {}) for d in rep.entries))} "
               f"({human_size(rep.bytes)}) to {out} "
               f"({human_size(Path(out).stat().st_size)} on disk) in {rep.seconds:.1f} s")


def _export_oci(st: Maintenance, out: str, infos: list[EntryInfo]) -> None:
    if Path(out).exists() and not Path(out).is_dir():
        raise click.UsageError(f"{out} is a file: --oci writes a directory")
    layout = OciLayoutRemote.of_dir(out)
    layout.breaker.quiet = True
    with _progress("export", sum(i.size_bytes for i in infos)) as advance:
        done = push_entries(layout, st, [i.key for i in infos], progress=advance,
                            on_note=lambda d, text: click.echo(f"{d[:12]}  {text}", err=True))
    click.echo(f"exported {entries(*split_graphs(i.labels for i in infos))} to {out} (OCI "
               f"image layout; {done.sent} written, {done.there} there already"
               + (f", {len(done.not_taken)} kept as they were" if done.not_taken else "")
               + "). To a "
               f"registry: skopeo copy oci:{out}:cc-<key> docker://REGISTRY/REPO:cc-<key> "
               "for each tag in its index.json")


@click.command("import", short_help="Verify a bundle or an OCI image layout, then publish it")
@cache_dir_option
@click.argument("src", type=click.Path(exists=True))
def import_cmd(cache_dir: str | None, src: str) -> None:
    """Verify every entry of SRC, then publish them all (nothing if anything fails).
    SRC a directory in the OCI image layout (cachectl export --oci, skopeo copy ...
    oci:DIR): each entry is verified (signature, every file's SHA-256) and published."""
    if Path(src).is_dir():
        if not (Path(src) / "oci-layout").is_file():
            raise click.UsageError(f"{src} is a directory with no oci-layout file: not an "
                                   "OCI image layout")
        _import_oci(_local(cache_dir, create=True), src)
        return
    st = _local(cache_dir, create=True)  # importing into a new cache makes it
    with _progress("import", Path(src).stat().st_size) as advance:
        rep = import_bundle(st, src, progress=advance)
    found = [st.stat(d) for d in rep.entries]
    click.echo(f"imported {entries(*split_graphs(i.labels for i in found if i is not None))} "
               f"({human_size(rep.bytes)}) into {st.root}; {were(len(rep.skipped))} there "
               "already")


def _import_oci(st: Maintenance, src: str) -> None:
    # As for a bundle: you chose the directory, so unsigned entries are taken; with
    # CACHECOMPILE_SIGNING_KEY set, every entry must verify under it.
    env = Trust.from_env()
    layout = OciLayoutRemote.of_dir(src, readonly=True,
                                    trust=Trust(key=env.key, accept_unsigned=env.key is None))
    layout.breaker.quiet = True
    tiers = TieredStore(st, [layout])
    got: list[EntryInfo] = []
    have = 0
    failed: list[str] = []
    rows = list(layout.listing())
    if not rows:
        raise CliError(f"{src} holds no cachecompile entry (an OCI image layout of other "
                       "images, or an empty one): nothing imported", EXIT_STORE)
    for row in rows:
        if row.record is None:
            failed.append(f"{row.key[:12]} ({row.problem})")
        elif isinstance(tiers.peek(row.key), Hit):
            have += 1
        elif isinstance(tiers.pull(row.key), Hit):
            got.append(_info(row))
        else:
            failed.append(row.key[:12])  # cachecompile.store.tiered logged why
    click.echo(f"imported {entries(*split_graphs(i.labels for i in got))} into {st.root} "
               f"from {src}; {were(have)} there already"
               + (f"; {len(failed)} refused: {', '.join(failed)}" if failed else ""))
    if failed:
        raise CliError(f"{entries(len(failed))} of {src} could not be imported", EXIT_STORE)
