"""``cachectl import-torchair DIR``: list an existing TorchAir cache (migration aid).

TorchAir's ``cache_compile`` writes (torchair/inference/_cache_compiler.py)::

    {cache_dir}/{Class}_{dynamic|static}[_aclgraphcache][_gecache]_{md5}/
        [world{W}global_rank{R}][_tp_rank{t}][_pp_rank{p}]/{func_name}/compiled_module

with GE's ``.om`` / ``.idx`` files beside ``compiled_module`` when ``ge_cache=True``.
This command reads only paths and file stats: it never unpickles ``compiled_module``
(a pickle is code execution), never imports torch, and converts nothing. TorchAir's
entries are keyed on the module's repr and the config alone, so they cannot be proven
to fit our key factors; the supported migration is to let ``cache_compile`` rebuild
them (one compile per method and signature).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from datetime import datetime
from pathlib import Path

import click

ENTRY_FILE = "compiled_module"
_TOP_RE = re.compile(r"^(?P<cls>.+?)_(?P<mode>dynamic|static)(?P<acl>_aclgraphcache)?"
                     r"(?P<ge>_gecache)?_(?P<md5>[0-9a-f]{32})$")
_RANK_RE = re.compile(r"^(?:world(?P<world>\d+)global_rank(?P<rank>\d+))?"
                      r"(?:_?tp_rank(?P<tp>\d+))?(?:_?pp_rank(?P<pp>\d+))?$")


@dataclasses.dataclass
class TorchairEntry:
    model: str
    mode: str                  # dynamic | static
    aclgraph: bool
    ge_cache: bool
    md5: str
    world_size: int | None
    global_rank: int | None
    tp_rank: int | None
    pp_rank: int | None
    function: str
    path: str
    size: int                  # compiled_module plus the GE files beside it
    ge_files: int
    mtime: float


def _int(v: str | None) -> int | None:
    return int(v) if v is not None else None


def scan(root: Path) -> tuple[list[TorchairEntry], list[str]]:
    """Entries under ``root`` and the paths that do not fit TorchAir's layout."""
    entries: list[TorchairEntry] = []
    odd: list[str] = []
    for cm in sorted(root.rglob(ENTRY_FILE)):
        if not cm.is_file() or cm.is_symlink():
            odd.append(str(cm))
            continue
        rel = cm.relative_to(root).parts
        # top / [ranks] / func / compiled_module
        if len(rel) not in (3, 4):
            odd.append(str(cm))
            continue
        top = _TOP_RE.match(rel[0])
        ranks = _RANK_RE.match(rel[1] if len(rel) == 4 else "")
        if top is None or ranks is None:
            odd.append(str(cm))
            continue
        func_dir = cm.parent
        size, ge_files = 0, 0
        for f in func_dir.iterdir():
            if f.is_file() and not f.is_symlink():
                size += f.stat().st_size
                if f.suffix in (".om", ".idx"):
                    ge_files += 1
        entries.append(TorchairEntry(
            model=top["cls"], mode=top["mode"], aclgraph=bool(top["acl"]), ge_cache=bool(top["ge"]),
            md5=top["md5"], world_size=_int(ranks["world"]), global_rank=_int(ranks["rank"]),
            tp_rank=_int(ranks["tp"]), pp_rank=_int(ranks["pp"]), function=rel[-2],
            path=str(func_dir), size=size, ge_files=ge_files, mtime=cm.stat().st_mtime))
    return entries, odd


def _ranks(e: TorchairEntry) -> str:
    parts = []
    if e.global_rank is not None:
        parts.append(f"g{e.global_rank}/{e.world_size}")
    if e.tp_rank is not None:
        parts.append(f"tp{e.tp_rank}")
    if e.pp_rank is not None:
        parts.append(f"pp{e.pp_rank}")
    return " ".join(parts) or "-"


def _size(n: int) -> str:
    x = float(n)
    for unit in ("B", "K", "M", "G"):
        if x < 1024 or unit == "G":
            return f"{x:.0f}{unit}" if unit == "B" else f"{x:.1f}{unit}"
        x /= 1024
    return f"{n}B"


@click.command("import-torchair", short_help="List a TorchAir cache_compile cache (read-only)")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path),
                required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry.")
def import_torchair(directory: Path | None, as_json: bool) -> None:
    """List a TorchAir cache_compile cache (default $TORCHAIR_CACHE_HOME or ./.torchair_cache).

    Read-only: nothing is unpickled, imported or converted; cache_compile rebuilds
    these entries under its own key on first use.
    """
    if directory is None:
        directory = Path(os.environ.get("TORCHAIR_CACHE_HOME", ".torchair_cache"))
        if not directory.is_dir():
            raise click.ClickException(f"no TorchAir cache at {directory}")
    entries, odd = scan(directory)
    if as_json:
        for e in entries:
            click.echo(json.dumps(dataclasses.asdict(e), sort_keys=True))
    else:
        header = ("model", "mode", "md5", "ranks", "function", "size", "ge", "mtime")
        rows = [(e.model, e.mode + ("+acl" if e.aclgraph else "") + ("+ge" if e.ge_cache else ""),
                 e.md5[:12], _ranks(e), e.function, _size(e.size), str(e.ge_files),
                 datetime.fromtimestamp(e.mtime).strftime("%Y-%m-%d %H:%M"))
                for e in entries]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
        click.echo("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
        for r in rows:
            click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        click.echo(f"{len(entries)} TorchAir entries, {_size(sum(e.size for e in entries))}; "
                   "not imported: cache_compile rebuilds them under its own key")
    for p in odd:
        click.echo(f"not in TorchAir's layout: {p}", err=True)
