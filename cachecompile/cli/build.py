"""``cachectl build module:factory``: fill the cache before serving (registered in cachecompile.cli.main).

For an image build step: ``factory()`` returns ``[(cached_fn, [example, ...]), ...]`` or
``{name: (cached_fn, [example, ...])}``; every distinct signature (every gear of a method
with gears) is compiled and published, ``--jobs`` worker processes at a time (default:
the node's compile slots, ``CACHECOMPILE_COMPILE_SLOTS``), for each ``--cpu-target`` in
turn, of ``--shard``'s part only. See docs/deploy.md.

This module imports neither torch nor cachecompile.build: ``cachectl`` stays torch-free
(the build's parent side, cachecompile.procs.builders, is torch-free too: only the
workers that import the factory import torch).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import click
from click.core import ParameterSource
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cachecompile.errors import ContractError, CpuTargetError
from cachecompile.key import cpu, shards
from cachecompile.procs.builders import (
    BuildError,
    BuildEvent,
    BuildResult,
    Cause,
    Checked,
    check_factory,
    prebuild_factory,
    push_results,
)
from cachecompile.store import settings

from .common import EXIT_PROBLEMS, EXIT_USAGE, CliError, _console, cache_dir_option
from .readable import factor_text

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
            return shards.parse(str(value), os.environ, _given_by(param, ctx))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _given_by(param: click.Parameter | None, ctx: click.Context | None) -> str:
    """Where click read the option's value: its environment variable, else the option
    (click records the source before it converts the value)."""
    if param is None or ctx is None or param.name is None:
        return shards.GIVEN
    envvar = param.envvar if isinstance(param.envvar, str) else None
    if envvar and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
        return f"${envvar}"
    return shards.GIVEN


def _env_target() -> tuple[str | None, ...]:
    """Without --cpu-target: what a serving process with $CACHECOMPILE_CPU_TARGET compiles
    on a miss (its best candidate this CPU has), checked like an option's value. The
    workers inherit the variable; a check or a build for a level this CPU lacks would
    key native compiles instead (a --check that passed on entries nobody asked for)."""
    value = settings.CPU_TARGET.get()
    if not value:
        return (None,)
    best = cpu.plan(cpu.parse(value))
    if best.build is None:
        raise CpuTargetError(f"${cpu.ENV}={value!r}: {best.why_none()}")
    return (None,) if best.build == cpu.NATIVE else (best.build,)


@click.command("build", short_help="Compile every signature a FACTORY lists, before serving")
@cache_dir_option
@click.argument("factory", metavar="MODULE:FACTORY")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Worker processes (default: $CACHECOMPILE_COMPILE_SLOTS, else cores/2).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--shard", type=ShardParam(), default=None, envvar=settings.BUILD_SHARD.name,
              help="Build shard I of N (0 <= I < N) of the signatures, split by a stable "
                   "hash; 'auto' or 'auto/N' takes it from a Kubernetes Indexed Job, a "
                   "Slurm job array or torchrun (default: $CACHECOMPILE_BUILD_SHARD). "
                   "With --cpu-target, the same signatures for every target.")
@click.option("--check", is_flag=True,
              help="Compile nothing: list the signatures the remote tier "
                   "($CACHECOMPILE_REMOTE; else the local store) lacks, for every "
                   "--cpu-target. Exit 1 if any.")
@click.option("--cpu-target", "cpu_targets", multiple=True, metavar="TARGET",
              help="Build for this CPU target (native, x86-64-v2/-v3/-v4, or auto: every "
                   "level this CPU has); repeat it or give a comma list to build several. "
                   "Default: the target $CACHECOMPILE_CPU_TARGET serves with on this CPU "
                   "(its best candidate this CPU has), else native.")
def build_cmd(cache_dir: str | None, factory: str, jobs: int | None, as_json: bool,  # noqa: C901 (today's exception: CLI: option checks and each report form)
              shard: shards.Shard | None, check: bool, cpu_targets: tuple[str, ...]) -> None:
    """Compile and publish every signature FACTORY lists, before serving.

    FACTORY is module:callable (the module is found from the current directory); it
    returns [(cached_fn, [example, ...]), ...] or {name: (cached_fn, examples)}. An
    example is a tuple of positional arguments, a cachecompile.Call(*args, **kwargs),
    or one argument; a method with gears is built at every gear of each example.
    With --shard I/N, only the signatures of shard I (each signature is in exactly one
    of the N shards). With --cpu-target, each target in turn (the same signatures for
    each; a target this CPU lacks is exit 2 before anything runs). With a remote tier, every entry built or found is in the remote
    when the build ends. Exit 0 when every signature is served from the cache, 1
    otherwise; with --check, 0 when the tier has every signature, 1 otherwise.
    """
    # Each target checked against this CPU before any worker starts (CpuTargetError: exit
    # 2, by the group's mapping): a build for a level it lacks could neither verify its
    # program nor load it, and a check could not compute its keys (this CPU would key a
    # native compile instead).
    targets: tuple[str | None, ...] = cpu.build_targets(cpu_targets) if cpu_targets \
        else _env_target()
    try:
        # Under torchrun (WORLD_SIZE > 1) its ranks split the shard (or the whole matrix):
        # each signature is built once, keyed without the launcher's rank.
        shard = shards.within_launcher(shard, os.environ)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if check:
        _check(cache_dir, factory, shard, targets, as_json)
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
            if bar:  # the next CPU target: the same bar, from zero
                progress.reset(bar[0], total=e.total)
            else:
                bar.append(progress.add_task("building", total=e.total))
            if not as_json:
                con.print(escape(f"{e.total} signature(s) to build" + _of_shard(shard)))
            if e.total == 0 and shard is not None:
                click.echo(_empty(shard, e.declared, factory), err=True)
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

    results: list[BuildResult] = []
    built_for: list[str | None] = []  # each result's CPU target (None: not named)
    try:
        with progress:
            for target in targets:
                if target is not None and not as_json:
                    con.print(f"CPU target {target}")
                # Each target builds the same signatures (with --shard, this shard's: a
                # signature's shard does not depend on the target), in workers of its
                # own (the target is in their environment).
                got = prebuild_factory(factory, jobs=jobs, cache_dir=cache_dir,
                                       on_event=on_event, shard=shard, cpu_target=target)
                results.extend(got)
                built_for.extend([target] * len(got))
    except ContractError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except BuildError as e:
        raise CliError(str(e), EXIT_PROBLEMS) from None
    # The workers have exited (their uploads flushed, or timed out): what the remote lacks
    # of this build's entries goes up now, waited for, so that --check can count on it.
    pushed = push_results(results, cache_dir=cache_dir)
    bad = [r for r in results if not r.ok]
    if as_json:
        click.echo(json.dumps([_result_json(r, t) for r, t in
                               zip(results, built_for, strict=True)], indent=1))
    else:
        built = sum(r.status == "built" for r in results)
        present = sum(r.status == "present" for r in results)
        con.print(f"{built} built, {present} present, {len(bad)} not served from the cache")
        if pushed is not None:
            click.echo(f"remote {pushed.remote}: {pushed.sent} entries uploaded now, "
                       f"{pushed.there} there already"
                       + (f", {len(pushed.not_taken)} refused (the remote kept its own "
                          "record)" if pushed.not_taken else "")
                       + (f", {len(pushed.failed)} failed" if pushed.failed else ""))
    if pushed is not None:
        for why in pushed.not_taken:
            click.echo(f"refused by the remote: {why}", err=True)
        for why in pushed.failed:
            click.echo(f"not uploaded: {why}", err=True)
    if bad or (pushed is not None and pushed.failed):
        sys.exit(EXIT_PROBLEMS)


def _of_shard(shard: shards.Shard | None) -> str:
    if shard is None:
        return ""
    if shard.count == 1:  # torchrun's ranks split the whole matrix
        return f" ({shard.part} of the whole matrix)" if shard.part else ""
    # What the user typed needs no source; a variable or an engine is named.
    where = "" if shard.origin == shards.GIVEN else f", from {shard.origin}"
    return f" (shard {shard}{where}" + (f"; {shard.part}" if shard.part else "") + ")"


def _empty(shard: shards.Shard, declared: int | None, factory: str) -> str:
    """What a shard (or a rank's part) with no signatures says: why, and that it is no
    failure (more shards than signatures leave some empty)."""
    of = f"the {declared} signature(s)" if declared is not None else "the signatures"
    what = f"shard {shard}" if shard.count > 1 else "this part of the matrix"
    part = f" ({shard.part})" if shard.part else ""
    return (f"{what}{part} holds none of {of} {factory} declares: nothing to do here "
            "(a split into more parts than signatures leaves some empty)")


def _result_json(r: BuildResult, target: str | None) -> dict[str, Any]:
    return {"name": r.name, "signature": r.signature, "status": r.status,
            "seconds": round(r.seconds, 3), "detail": r.detail, "worker": r.worker,
            "entries": list(r.entries), **({"cpu_target": target} if target else {})}


def _differ_text(differ: Mapping[str, Any]) -> list[str]:
    """``{factor: [here, there]}`` (:class:`~cachecompile.procs.builders.Checked`'s
    ``nearest["differ"]``, a :class:`~cachecompile.procs.builders.Cause`'s ``differ``) as
    ``factor (here's value here, there's there)``, values as ``cachectl explain`` prints
    them; a factor one side lacks is ``unset`` there."""
    def value(name: str, v: Any) -> str:
        return "unset" if v is None else factor_text(name, v)

    return [f"{n} ({value(n, v[0])} here, {value(n, v[1])} there)"
            if isinstance(v, (list, tuple)) and len(v) == 2 else n for n, v in differ.items()]


def _missing_line(t: Mapping[str, Any], target: str | None) -> str:
    """One ``missing`` line of ``build --check``; where the check found the entry nearest
    to the signature's key (``t["nearest"] = {"key", "differ": {factor: [here, there]}}``),
    the factors it differs in, with both values."""
    line = (f"missing  {t['name']} [{t['signature']}]  {t['key'][:12] or '(no key)'}"
            + (f"  ({target})" if target else ""))
    near = t.get("nearest")
    if not isinstance(near, Mapping) or not near.get("key"):
        return line
    named = _differ_text(near.get("differ") or {})
    more = f" and {len(named) - 3} more" if len(named) > 3 else ""
    return (f"{line}\n         nearest entry {str(near['key'])[:12]} differs in "
            f"{', '.join(named[:3]) or 'nothing keyed'}{more}")


def _cause_text(c: Cause) -> str:
    """A likely cause of the misses, as ``likely cause: ...`` and the JSON's
    ``likely_causes`` say it: the advice, how many missing signatures it sets apart, and
    its factors' values as the missing lines print them."""
    return (f"{c.advice}. It sets {c.count} of the {c.of} missing signatures apart: "
            f"{', '.join(_differ_text(c.differ))}")


def _check(cache_dir: str | None, factory: str, shard: shards.Shard | None,
           targets: tuple[str | None, ...], as_json: bool) -> None:
    """``build --check``: which declared signatures the tier lacks, for every CPU target
    asked for (each target's entries have keys of their own); exit 1 if any."""
    found: list[tuple[str | None, Checked]] = []
    try:
        for target in targets:
            found.append((target, check_factory(factory, cache_dir=cache_dir, shard=shard,
                                                cpu_target=target)))
    except ContractError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except BuildError as e:
        raise CliError(str(e), EXIT_PROBLEMS) from None
    missing = [(target, t) for target, c in found for t in c.missing]
    causes = list(dict.fromkeys(_cause_text(why) for _, c in found for why in c.causes))
    if as_json:
        named = [t for t in targets if t is not None]
        click.echo(json.dumps({
            "tier": found[0][1].tier, "shard": str(shard) if shard else None,
            **({"part": shard.part} if shard is not None and shard.part else {}),
            **({"cpu_targets": named} if named else {}),
            "declared": sum(len(c.present) + len(c.missing) for _, c in found),
            "present": sum(len(c.present) for _, c in found),
            "missing": [{**{k: t[k] for k in ("name", "signature", "key")},
                         **({"cpu_target": target} if target else {}),
                         **({"nearest": t["nearest"]} if "nearest" in t else {})}
                        for target, t in missing],
            "likely_causes": causes}, indent=1))
    else:
        for target, t in missing:
            click.echo(_missing_line(t, target))
        for target, c in found:
            where = ", ".join(w for w in (f"shard {shard}" if shard and shard.count > 1
                                          else "", shard.part if shard else "",
                                          target or "") if w)
            click.echo(f"{f'{where}: ' if where else ''}"
                       f"{len(c.present) + len(c.missing)} signatures declared; "
                       f"{c.tier} has {len(c.present)}, lacks {len(c.missing)}")
            if shard is not None and not (c.present or c.missing):
                click.echo(_empty(shard, c.declared, factory), err=True)
        for why in causes:
            click.echo(f"likely cause: {why}")
    if missing:
        sys.exit(EXIT_PROBLEMS)
