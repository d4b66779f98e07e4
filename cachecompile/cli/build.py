"""``cachectl build module:factory``: fill the cache before serving (registered in cachecompile.cli.main).

For an image build step: ``factory()`` returns ``[(cached_fn, [example, ...]), ...]`` or
``{name: (cached_fn, [example, ...])}``; every distinct signature (every gear of a method
with gears) is compiled and published, ``--jobs`` worker processes at a time (default:
the node's compile slots, ``CACHECOMPILE_COMPILE_SLOTS``). See docs/deploy.md.

This module imports neither torch nor cachecompile.build: ``cachectl`` stays torch-free
until the verb runs (cachecompile.build does the work).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .common import EXIT_PROBLEMS, EXIT_USAGE, CliError, _console, cache_dir_option

_MARKS = {"built": "[green]built[/green]", "present": "[cyan]present[/cyan]",
          "not cached": "[yellow]not cached[/yellow]", "failed": "[red]failed[/red]"}


def _line(r: Any) -> str:
    where = f"  (worker {r.worker})" if r.worker is not None else ""
    text = f"{r.status:10s} {r.seconds:7.1f}s  {r.name} [{r.signature}]{where}"
    return text + (f"\n           {r.detail}" if r.detail else "")


@click.command("build")
@cache_dir_option
@click.argument("factory", metavar="MODULE:FACTORY")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Worker processes (default: $CACHECOMPILE_COMPILE_SLOTS, else cores/2).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--cpu-target", "cpu_targets", multiple=True, metavar="TARGET",
              help="Build for this CPU target (native, x86-64-v2/-v3/-v4, or auto: every "
                   "level this CPU has); repeat it or give a comma list to build several. "
                   "Default: $CACHECOMPILE_CPU_TARGET, else native.")
def build_cmd(cache_dir: str | None, factory: str, jobs: int | None, as_json: bool,
              cpu_targets: tuple[str, ...]) -> None:
    """Compile and publish every signature FACTORY lists, before serving.

    FACTORY is module:callable (the module is found from the current directory); it
    returns [(cached_fn, [example, ...]), ...] or {name: (cached_fn, examples)}. An
    example is a tuple of positional arguments, a cachecompile.Call(*args, **kwargs),
    or one argument; a method with gears is built at every gear of each example.
    Exit 0 when every signature is served from the cache, 1 otherwise.
    """
    # torch, and the model's code, only now.
    from cachecompile.build import BuildError, BuildEvent, prebuild_factory
    from cachecompile.errors import ContractError, CpuTargetError
    from cachecompile.key import cpu

    try:
        # Each target checked against this CPU first: a build for a level it lacks could
        # neither verify its program nor load it.
        targets: tuple[str | None, ...] = cpu.build_targets(cpu_targets) if cpu_targets \
            else (None,)
    except CpuTargetError as e:
        raise CliError(str(e), EXIT_USAGE) from None

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
                con.print(f"{e.total} signature(s) to build")
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

    results: list[Any] = []
    built_for: list[str | None] = []
    try:
        with progress:
            for target in targets:
                if target is not None and not as_json:
                    con.print(f"CPU target {target}")
                got = prebuild_factory(factory, jobs=jobs, cache_dir=cache_dir,
                                       on_event=on_event, cpu_target=target)
                results.extend(got)
                built_for.extend([target] * len(got))
    except ContractError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except BuildError as e:
        raise CliError(str(e), EXIT_PROBLEMS) from None
    bad = [r for r in results if not r.ok]
    if as_json:
        click.echo(json.dumps([{"name": r.name, "signature": r.signature,
                                "status": r.status, "seconds": round(r.seconds, 3),
                                "detail": r.detail, "worker": r.worker,
                                **({"cpu_target": t} if t is not None else {})}
                               for r, t in zip(results, built_for, strict=True)], indent=1))
    else:
        built = sum(r.status == "built" for r in results)
        present = sum(r.status == "present" for r in results)
        con.print(f"{built} built, {present} present, {len(bad)} not served from the cache")
    if bad:
        sys.exit(EXIT_PROBLEMS)
