"""``cachectl build module:factory``: fill the cache before serving (registered in cachecompile.cli.main).

For an image build step: ``factory()`` returns ``[(cached_fn, [example, ...]), ...]`` or
``{name: (cached_fn, [example, ...])}``; every distinct signature (every gear of a method
with gears) is compiled and published, ``--jobs`` worker processes at a time (default:
the node's compile slots, ``CACHECOMPILE_COMPILE_SLOTS``). See docs/deploy.md.

This module imports neither torch nor cachecompile.build: ``cachectl`` stays torch-free
(the build's parent side, cachecompile.procs.builders, is torch-free too: only the
workers that import the factory import torch).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cachecompile.errors import ContractError
from cachecompile.key import shards
from cachecompile.procs.builders import (
    BuildError,
    BuildEvent,
    BuildResult,
    check_factory,
    prebuild_factory,
    push_results,
)

from .common import EXIT_PROBLEMS, EXIT_USAGE, CliError, _console, cache_dir_option

_MARKS = {"built": "[green]built[/green]", "present": "[cyan]present[/cyan]",
          "not cached": "[yellow]not cached[/yellow]", "failed": "[red]failed[/red]"}


def _line(r: Any) -> str:
    where = f"  (worker {r.worker})" if r.worker is not None else ""
    text = f"{r.status:10s} {r.seconds:7.1f}s  {r.name} [{r.signature}]{where}"
    return text + (f"\n           {r.detail}" if r.detail else "")


class ShardParam(click.ParamType):
    """``I/N``, ``auto`` or ``auto/N`` (the index, and the count, from the engine)."""

    name = "I/N|auto[/N]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> shards.Shard:
        if isinstance(value, shards.Shard):
            return value
        try:
            return shards.parse(str(value), os.environ)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@click.command("build")
@cache_dir_option
@click.argument("factory", metavar="MODULE:FACTORY")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Worker processes (default: $CACHECOMPILE_COMPILE_SLOTS, else cores/2).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--shard", type=ShardParam(), default=None, envvar="CACHECOMPILE_BUILD_SHARD",
              help="Build shard I of N (0 <= I < N) of the signatures, split by a stable "
                   "hash; 'auto' or 'auto/N' takes it from a Kubernetes Indexed Job, a "
                   "Slurm job array or torchrun (default: $CACHECOMPILE_BUILD_SHARD).")
@click.option("--check", is_flag=True,
              help="Compile nothing: list the signatures the remote tier "
                   "($CACHECOMPILE_REMOTE; else the local store) lacks. Exit 1 if any.")
def build_cmd(cache_dir: str | None, factory: str, jobs: int | None, as_json: bool,
              shard: shards.Shard | None, check: bool) -> None:
    """Compile and publish every signature FACTORY lists, before serving.

    FACTORY is module:callable (the module is found from the current directory); it
    returns [(cached_fn, [example, ...]), ...] or {name: (cached_fn, examples)}. An
    example is a tuple of positional arguments, a cachecompile.Call(*args, **kwargs),
    or one argument; a method with gears is built at every gear of each example.
    With --shard I/N, only the signatures of shard I (each signature is in exactly one
    of the N shards). With a remote tier, every entry built or found is in the remote
    when the build ends. Exit 0 when every signature is served from the cache, 1
    otherwise; with --check, 0 when the tier has every signature, 1 otherwise.
    """
    if check:
        _check(cache_dir, factory, shard, as_json)
        return
    # The workers import torch and the model's code; this process neither.
    con = _console()
    tty = sys.stdout.isatty() and not as_json
    progress = Progress(TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=con,
                        disable=not tty)
    bar: list[Any] = []

    def on_event(e: BuildEvent) -> None:
        if e.kind == "planned":
            bar.append(progress.add_task("building", total=e.total))
            if not as_json:
                con.print(f"{e.total} signature(s) to build" + _of_shard(shard))
        elif e.kind == "started" and e.task is not None and bar:
            progress.update(bar[0], description=escape(f"{e.task['name']} "
                                                       f"[{e.task['signature']}]"))
        elif e.kind == "finished" and e.result is not None:
            if bar:
                progress.advance(bar[0])
            if not as_json:
                r = e.result
                text = escape(_line(r)).replace(r.status, _MARKS.get(r.status, r.status), 1)
                if tty:
                    progress.console.print(text)
                else:
                    click.echo(_line(r))

    try:
        with progress:
            results = prebuild_factory(factory, jobs=jobs, cache_dir=cache_dir,
                                       on_event=on_event, shard=shard)
    except ContractError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except BuildError as e:
        raise CliError(str(e), EXIT_PROBLEMS) from None
    # The workers have exited (their uploads flushed, or timed out): what the remote lacks
    # of this build's entries goes up now, waited for, so that --check can count on it.
    pushed = push_results(results, cache_dir=cache_dir)
    bad = [r for r in results if not r.ok]
    if as_json:
        click.echo(json.dumps([_result_json(r) for r in results], indent=1))
    else:
        built = sum(r.status == "built" for r in results)
        present = sum(r.status == "present" for r in results)
        con.print(f"{built} built, {present} present, {len(bad)} not served from the cache")
        if pushed is not None:
            click.echo(f"remote {pushed.remote}: {pushed.sent} entries uploaded now, "
                       f"{pushed.there} there already"
                       + (f", {len(pushed.failed)} failed" if pushed.failed else ""))
    if pushed is not None:
        for why in pushed.failed:
            click.echo(f"not uploaded: {why}", err=True)
    if bad or (pushed is not None and pushed.failed):
        sys.exit(EXIT_PROBLEMS)


def _of_shard(shard: shards.Shard | None) -> str:
    if shard is None:
        return ""
    return f" (shard {shard})" if shard.source == shards.GIVEN else \
        f" (shard {shard}, from the {shard.source})"


def _result_json(r: BuildResult) -> dict[str, Any]:
    return {"name": r.name, "signature": r.signature, "status": r.status,
            "seconds": round(r.seconds, 3), "detail": r.detail, "worker": r.worker,
            "entries": list(r.entries)}


def _check(cache_dir: str | None, factory: str, shard: shards.Shard | None,
           as_json: bool) -> None:
    """``build --check``: which declared signatures the tier lacks; exit 1 if any."""
    try:
        found = check_factory(factory, cache_dir=cache_dir, shard=shard)
    except ContractError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except BuildError as e:
        raise CliError(str(e), EXIT_PROBLEMS) from None
    n = len(found.present) + len(found.missing)
    if as_json:
        click.echo(json.dumps({"tier": found.tier, "shard": str(shard) if shard else None,
                               "declared": n, "present": len(found.present),
                               "missing": [{k: t[k] for k in ("name", "signature", "key")}
                                           for t in found.missing]}, indent=1))
    else:
        for t in found.missing:
            click.echo(f"missing  {t['name']} [{t['signature']}]  {t['key'][:12]}")
        click.echo(f"{f'shard {shard}: ' if shard else ''}{n} signatures declared; "
                   f"{found.tier} has {len(found.present)}, lacks {len(found.missing)}")
    if found.missing:
        sys.exit(EXIT_PROBLEMS)
