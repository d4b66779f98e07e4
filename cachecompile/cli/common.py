"""What every ``cachectl`` verb shares: exit codes, ``CliError``, the common options,
opening the store, sizes and durations, and the entries table.

Exit codes: 0 ok; 1 problems found (verify); 2 usage error, unknown key,
ambiguous prefix or no store at the cache dir; 3 insecure store; 4 lock timeout;
5 read-only store; 6 store full; 7 any other store error.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cachecompile._version import code_label
from cachecompile.entry import frame_records
from cachecompile.entry.frame_records import FrameRecord
from cachecompile.entry.meta import EntryMeta
from cachecompile.errors import UnsupportedProgramError
from cachecompile.store import Maintenance, OpenStore, errors, open_store, settings
from cachecompile.store.outcomes import EntryInfo

EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INSECURE = 3
EXIT_LOCK = 4
EXIT_READONLY = 5
EXIT_FULL = 6
EXIT_STORE = 7

# Which store error exits with which code (the first match; cachecompile.cli.main).
ERROR_CODES: list[tuple[type[BaseException], int]] = [
    (errors.KeyNotFound, EXIT_USAGE),  # AmbiguousKey included
    (errors.StoreNotFound, EXIT_USAGE),  # a mistyped --cache-dir
    (errors.RemoteConfigError, EXIT_USAGE),  # a malformed CACHECOMPILE_REMOTE / --remote
    (errors.StoreInputError, EXIT_USAGE),  # a size, a variable's number, a bundle's name
    (errors.InsecureStoreError, EXIT_INSECURE),
    (errors.LockTimeout, EXIT_LOCK),
    (errors.ReadOnlyStoreError, EXIT_READONLY),
    (errors.StoreFullError, EXIT_FULL),
    (errors.StoreError, EXIT_STORE),
]

F = TypeVar("F", bound=Callable[..., Any])


class CliError(click.ClickException):
    """One clear line on stderr and a chosen exit code; no traceback."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares a ClassVar


def cache_dir_option(f: F) -> F:
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False),
        default=None,
        envvar=settings.DIR.name,
        help="Store root (default: $CACHECOMPILE_DIR, else $XDG_CACHE_HOME/cachecompile).",
    )(f)


def _open(cache_dir: str | None, **kw: Any) -> OpenStore:
    # Never create: on a mistyped path, `ls` saying "no entries" and `verify` saying
    # "ok" would hide the typo (and leave a stray cache behind). The remote named here:
    # a malformed one is this command's error (exit 2), not a warning it goes on past.
    kw.setdefault("remote", settings.REMOTE.get())
    return open_store(cache_dir, create=False, **kw)


def _open_local(cache_dir: str | None) -> Maintenance:
    # The store on this node's disk, which the verbs read and maintain: a remote tier
    # behind it is the remote verbs' business (cachecompile.cli.remote).
    return _open(cache_dir).maintenance()


class _Console(Console):
    """rich's Console, but a reader gone away is a BrokenPipeError (rich exits 1), which
    cachectl takes as a success (cli.main's group: `cachectl ls | head -1`)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError()


def _console() -> Console:
    # Wide enough that 32-hex keys are never folded when stdout is a pipe.
    return _Console(width=None if sys.stdout.isatty() else 200, highlight=False)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    m = _DURATION.match(text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_MINUTES: dict[int, str] = {}


def _when(ts: float) -> str:
    # Memoised by the minute (time zones shift whole minutes): ls at 100,000 entries
    # formatted 200,000 dates, most of them in a few minutes.
    if not ts:
        return "-"
    minute = int(ts // 60)
    text = _MINUTES.get(minute)
    if text is None:
        text = _MINUTES[minute] = datetime.fromtimestamp(minute * 60).strftime("%Y-%m-%d %H:%M")
    return text


def _parse_labels(pairs: Iterable[str], model: str | None, function: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in pairs:
        if "=" not in p:
            raise click.BadParameter(f"--label wants k=v, got {p!r}")
        k, v = p.split("=", 1)
        out[k] = v
    if model is not None:
        out["model"] = model
    if function is not None:
        out["function"] = function
    return out


def label_options(f: F) -> F:
    f = click.option("--function", default=None, help="Only entries with labels['function'].")(f)
    f = click.option("--model", default=None, help="Only entries with labels['model'].")(f)
    f = click.option("--label", "label", multiple=True, metavar="K=V",
                     help="Only entries with this label (repeatable).")(f)
    return f


RICH_MAX_ROWS = 500
SIGNATURE_WIDTH = 40  # the full signature is in `cachectl show` and `ls --json`
_COLUMNS = (("key", "left"), ("model", "left"), ("function", "left"), ("ranks", "left"),
            ("group", "left"), ("dynamic", "left"), ("signature", "left"), ("frames", "right"),
            ("variants", "right"), ("size", "right"), ("created", "left"), ("last used", "left"), ("hits", "right"),
            ("state", "left"), ("code", "left"))


def group_status(infos: Iterable[EntryInfo]) -> dict[str, str]:
    """Group id -> "id n/N" (ranks published / world size), "incomplete" when short."""
    ranks: dict[str, set[str]] = {}
    size: dict[str, str] = {}
    for i in infos:
        g = i.labels.get("group")
        if g:
            ranks.setdefault(g, set()).add(i.labels.get("global_rank", i.key))
            size[g] = i.labels.get("group_size", "?")
    out = {}
    for g, members in ranks.items():
        n, total = len(members), size[g]
        done = total.isdigit() and n >= int(total)
        out[g] = f"{g[:8]} {n}/{total}" + ("" if done else " incomplete")
    return out


@dataclass(frozen=True)
class Folded:
    """``ls``'s rows: a signature's variant entries folded into one row (its first
    entry's labels and key, the sizes and hits summed, the newest use), and each row's
    variants cell by key: how many entries the row stands for."""

    rows: list[EntryInfo]
    variants: dict[str, str]


def fold_variants(infos: Iterable[EntryInfo]) -> Folded:
    """One row per signature: a signature's variant entries (a guard set of the method's
    own, label ``variant``) and the frame variants published after it (label
    ``dynamo_frame``) share the label ``signature_key``; an entry without it (a shared
    graph, an entry of another release) is a row of its own. A row whose entries are not
    all ``ok`` shows the first state that is not."""
    by_sig: dict[str, list[EntryInfo]] = {}
    for i in infos:
        by_sig.setdefault(i.labels.get("signature_key") or i.key, []).append(i)
    rows: list[EntryInfo] = []
    variants: dict[str, str] = {}
    for members in by_sig.values():
        # The signature's own entry first (a frame variant holds one frame), lowest slot.
        members.sort(key=lambda i: ("dynamo_frame" in i.labels, _slot(i), i.key))
        head = members[0]
        if len(members) == 1:
            rows.append(head)
            continue
        frames = sum("dynamo_frame" in i.labels for i in members)
        bad = [i.state for i in members if i.state != "ok"]
        rows.append(EntryInfo(key=head.key, size_bytes=sum(i.size_bytes for i in members),
                              created=min(i.created for i in members),
                              last_used=max(i.last_used for i in members),
                              hits=sum(i.hits for i in members), labels=head.labels,
                              state=bad[0] if bad else head.state))
        variants[head.key] = f"{len(members)}" + (f" ({frames} frame)" if frames else "")
    return Folded(rows, variants)


def _slot(i: EntryInfo) -> int:
    v = i.labels.get("variant", "")
    return int(v) if v.isdigit() else 0


def _row(i: EntryInfo, groups: dict[str, str] | None = None,
         variants: Mapping[str, str] | None = None) -> list[str]:
    ranks = i.labels.get("ranks") or i.labels.get("rank", "")
    g = i.labels.get("group", "")
    group = (groups or {}).get(g, g[:8])
    sig = i.labels.get("signature", "")
    if len(sig) > SIGNATURE_WIDTH:
        sig = sig[:SIGNATURE_WIDTH - 1] + "…"
    return [i.key[:12], i.labels.get("model", ""), i.labels.get("function", ""), ranks,
            group, i.labels.get("dynamic", ""), sig, _frames(i.labels),
            (variants or {}).get(i.key, ""), human_size(i.size_bytes), _when(i.created), _when(i.last_used), str(i.hits), i.state,
            _code(i)]


def _frames(labels: Mapping[str, str]) -> str:
    """How many of Dynamo's frames an entry holds: a method's entry (1 unless its graph
    breaks), ``+1`` for a frame variant published after it, nothing for a shared graph."""
    return labels.get("frames") or ("1" if labels.get("signature") else "")


def read_meta(manifest: Mapping[str, Any]) -> EntryMeta:
    """A manifest's meta as the typed record, whatever its format (cachectl shows entries
    of every release); one whose fields have the wrong types reads as an empty record of
    its adapter (cachectl still shows its factors and files)."""
    raw = manifest.get("meta") or {}
    try:
        return EntryMeta.from_json(raw, any_format=True)
    except UnsupportedProgramError:
        got = raw if isinstance(raw, Mapping) else {}
        adapter, fmt = got.get("adapter"), got.get("format")
        return EntryMeta(adapter=adapter if isinstance(adapter, str) else "",
                         format=fmt if isinstance(fmt, int) else -1)


def read_frames(meta: EntryMeta) -> list[FrameRecord]:
    """An entry's frames besides the method's own (a graph break's); none where the record
    does not read (another format: cachectl still shows the rest)."""
    try:
        return list(frame_records.read_frames(meta.frames))
    except UnsupportedProgramError:
        return []


def frame_summary(r: FrameRecord) -> str:
    """One frame in a line: what it is, and what a warm process does with it."""
    kind = {"resume": "resume function", "callee": "called function"}.get(r.kind, r.kind)
    if r.live:
        what = f"compiled live in every process ({r.live})"
    elif r.as_written:
        what = "runs as written (Dynamo skips it too)"
    elif not r.variants:
        what = "no variant stored here (compiled where first reached, then published)"
    else:
        n = len(r.variants)
        what = (f"{n} variant{'s' if n > 1 else ''}, "
                f"{', '.join(str(len(v.guards)) for v in r.variants)} guards, "
                f"{sum(len(v.graphs) for v in r.variants)} graph(s)")
    return f"{kind}: {r.name}: {what}"


def _code(i: EntryInfo) -> str:
    """"this" for an entry this cachecompile code wrote; else "other" (it never hits here:
    ``cachectl gc --other-versions`` retires it)."""
    return "this" if i.labels.get("code") == code_label() else "other"


def _entries_table(infos: list[EntryInfo], title: str | None = None,
                   groups: dict[str, str] | None = None,
                   variants: Mapping[str, str] | None = None) -> Table:
    t = Table(title=title, box=None, pad_edge=False)
    for col, just in _COLUMNS:
        t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for i in infos:
        # Labels are user data: "[2,n]" must not be read as rich markup.
        t.add_row(*(escape(c) for c in _row(i, groups, variants)))
    return t


def _plain_table(infos: list[EntryInfo], groups: dict[str, str] | None = None) -> str:
    return "\n".join(_plain_lines(infos, groups))


def _plain_lines(infos: list[EntryInfo], groups: dict[str, str] | None = None,
                 variants: Mapping[str, str] | None = None) -> Iterator[str]:
    """The lines of a plain aligned table, header first: each row as :func:`_row` makes
    it. Widths need every row, so the cells are made first, a column at a time (a list
    per column, equal cells shared: a tuple per row was 30 MB and a third of ``ls`` at
    100,000 entries), then formatted with one format string."""
    head = [c for c, _ in _COLUMNS]
    cols = _columns(infos, groups, variants or {})
    widths = [max(len(h), max(map(len, col), default=0)) for h, col in zip(head, cols,
                                                                            strict=True)]
    # %-formatting of the row tuple zip makes: the same text as "{:<w}".format for
    # strings, in 60% of the time.
    fmt = "  ".join(f"%{'' if just == 'right' else '-'}{w}s"
                    for w, (_, just) in zip(widths, _COLUMNS, strict=True))
    yield (fmt % tuple(head)).rstrip()
    for r in zip(*cols, strict=True):
        yield (fmt % r).rstrip()


def _columns(infos: list[EntryInfo], groups: dict[str, str] | None,
             variants: Mapping[str, str]) -> list[list[str]]:
    """The cells of :func:`_row`, a column at a time (tests/cli check they are the same)."""
    groups = groups or {}
    labels = [i.labels for i in infos]
    sizes: dict[int, str] = {}
    counts: dict[int, str] = {}
    mine = code_label()

    def size(n: int) -> str:
        text = sizes.get(n)
        if text is None:
            text = sizes[n] = human_size(n)
        return text

    def count(n: int) -> str:
        text = counts.get(n)
        if text is None:
            text = counts[n] = str(n)
        return text

    def signature(sig: str) -> str:
        return sig if len(sig) <= SIGNATURE_WIDTH else sig[:SIGNATURE_WIDTH - 1] + "…"

    def group(g: str) -> str:
        return groups.get(g, g[:8])

    return [
        [i.key[:12] for i in infos],
        [lab.get("model", "") for lab in labels],
        [lab.get("function", "") for lab in labels],
        [lab.get("ranks") or lab.get("rank", "") for lab in labels],
        [group(lab.get("group", "")) for lab in labels],
        [lab.get("dynamic", "") for lab in labels],
        [signature(lab.get("signature", "")) for lab in labels],
        [_frames(lab) for lab in labels],
        [variants.get(i.key, "") for i in infos],
        [size(i.size_bytes) for i in infos],
        [_when(i.created) for i in infos],
        [_when(i.last_used) for i in infos],
        [count(i.hits) for i in infos],
        [i.state for i in infos],
        ["this" if lab.get("code") == mine else "other" for lab in labels],
    ]
