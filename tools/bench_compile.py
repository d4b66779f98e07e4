"""Start-up benchmark: time to first output of WHOLE FRESH PROCESSES, per mechanism.

Every measurement is a new Python process (tools/bench_compile_child.py). The
parent takes ``time.perf_counter()`` right before ``Popen`` and again when the
child prints ``FIRST_OUTPUT`` -- which it does once the first output has been
computed AND checked against eager (``assert_close``) -- so the figure includes
interpreter start, ``import torch``, model construction, compile or load, the
first call and the check. The child also reports its own ``import torch`` time
and the median per-call latency (after warm-up).

Directories. Each process gets its own ``TMPDIR``, ``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR`` and ``CACHECOMPILE_DIR`` under the work dir; a mechanism
that needs a warm dir reuses the ones of its "produce" run. Inductor keeps its
precompiled headers and ISA-probe builds in ``default_cache_dir()``
(``$TMPDIR/torchinductor_$USER``), not under ``TORCHINDUCTOR_CACHE_DIR``, so a
fresh ``TMPDIR`` is what makes "cold" truly cold.

"cold" / "empty dir" here means: nothing from torch.compile on disk at all (as on
a brand-new machine or container); only the OS page cache (torch's shared
libraries, gcc) is warm, because earlier processes ran.

Mechanisms (``--only``):
  eager                  plain ``model.prefill(tokens)``
  compile_cold           ``torch.compile(fullgraph=True)``, empty dirs
  compile_warm           same, second run in the dirs of a first run
  artifacts              ``save_cache_artifacts`` in one process, ``load_cache_artifacts``
                         into empty dirs in another, then ``torch.compile``
  aot_precompile         ``torch.compile(...).aot_compile(((args,), {}))`` +
                         ``save_compiled_function``; ``torch.compiler.load_compiled_function``
                         in the producer's (warm) dirs
  aot_precompile_empty   same artifact, loaded into empty dirs
  aoti                   ``torch.export`` + ``aoti_compile_and_package``; ``aoti_load_package``
                         in a fresh process with empty dirs
  cc_cold                ``cache_compile(m.prefill, dynamic=False, cache_dir=...)``, empty dirs
  cc_warm                same CACHECOMPILE_DIR as a first run, empty Inductor/Triton/TMPDIR

Cold profile (``--profile``): ``compile_cold`` and ``cc_cold`` as pairs of fresh
processes (the order alternates from pair to pair, so drift and load fall on both), each
with its wall time to first output, its CPU seconds (its own and its children's: g++,
compile workers) and where the time went: torch's own compile timers for both, and
cachecompile's cold phases (key, lookup, torch imports, lock, dynamo, backend, guards,
capture, verify, run, deps, entry, publish) from the entry. Prints medians and the median
of the per-pair ratios.

Micro-benchmark (``--micro``): per-call time of ``x + 1`` on 4 floats through a
module method (``AddOne.add``) for eager, torch.compile, AOT precompiled (with and
without guard checks) and cache_compile (warm).

Usage:
  python tools/bench_compile.py --quick
  python tools/bench_compile.py --model both --runs 5 --json bench-out/startup.json
  python tools/bench_compile.py --profile --model demo --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = HERE / "bench_compile_child.py"

MECHANISMS: tuple[str, ...] = (
    "eager",
    "compile_cold",
    "compile_warm",
    "artifacts",
    "aot_precompile",
    "aot_precompile_empty",
    "aoti",
    "cc_cold",
    "cc_warm",
)

MICRO_MECHANISMS: tuple[str, ...] = (
    "eager",
    "compile",
    "aot_precompile",
    "aot_precompile_noguard",
    "cc_warm",
    "cc_warm_always",
)

LABELS: dict[str, str] = {
    "eager": "eager",
    "compile_cold": "torch.compile, cold (empty dirs)",
    "compile_warm": "torch.compile, warm Inductor dir",
    "artifacts": "save/load_cache_artifacts into empty dirs",
    "aot_precompile": "AOT precompile (aot_compile + load_compiled_function), warm dir",
    "aot_precompile_empty": "AOT precompile, empty dirs",
    "aoti": "AOTInductor .pt2 (aoti_load_package), empty dirs",
    "cc_cold": "cache_compile, cold (empty dirs)",
    "cc_warm": "cache_compile, warm entry, empty Inductor/Triton/TMPDIR",
}

MICRO_LABELS: dict[str, str] = {
    "eager": "eager",
    "compile": "torch.compile (bound method)",
    "aot_precompile": "AOT precompile, loaded, guards checked",
    "aot_precompile_noguard": "AOT precompile, loaded, disable_guard_check()",
    "cc_warm": "cache_compile, warm entry (argument guards per call)",
    "cc_warm_always": "cache_compile, warm entry, guards=\"always\" (every guard per call)",
}

# Which produced artifact a mechanism needs, and whether its timed runs reuse the
# producer's directories (warm) or get empty ones.
PRODUCER: dict[str, str] = {
    "compile_warm": "compile_warm",
    "artifacts": "artifacts",
    "aot_precompile": "aot_precompile",
    "aot_precompile_empty": "aot_precompile",
    "aoti": "aoti",
    "cc_warm": "cc_cold",
}
REUSES_PRODUCER_DIRS = {"compile_warm", "aot_precompile"}
# cc_warm keeps only CACHECOMPILE_DIR from its producer.
KEEPS_CC_DIR = {"cc_warm"}


@dataclass
class Run:
    ok: bool
    first_output_s: float | None = None
    cpu_s: float | None = None   # the child's CPU, its own and its waited-for children's
    child: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    unavailable: str | None = None
    error: str | None = None


@dataclass
class Row:
    model: str
    mechanism: str
    runs: list[Run] = field(default_factory=list)
    produce: Run | None = None

    def firsts(self) -> list[float]:
        return [r.first_output_s for r in self.runs if r.ok and r.first_output_s is not None]

    def median_first(self) -> float | None:
        values = self.firsts()
        return statistics.median(values) if values else None

    def median_of(self, where: str, key: str) -> float | None:
        values = [
            float(getattr(r, where)[key])
            for r in self.runs
            if r.ok and getattr(r, where).get(key) is not None
        ]
        return statistics.median(values) if values else None

    def status(self) -> str | None:
        for r in self.runs:
            if r.unavailable:
                return f"n/a ({r.unavailable})"
        if self.produce is not None and self.produce.unavailable:
            return f"n/a ({self.produce.unavailable})"
        if self.produce is not None and not self.produce.ok:
            return f"failed (produce: {self.produce.error})"
        errors = [r.error for r in self.runs if r.error]
        if errors and not self.firsts():
            return f"failed ({errors[0]})"
        return None


@dataclass
class Dirs:
    root: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            "TMPDIR": str(self.root / "tmp"),
            "TORCHINDUCTOR_CACHE_DIR": str(self.root / "inductor"),
            "TRITON_CACHE_DIR": str(self.root / "triton"),
            "CACHECOMPILE_DIR": str(self.root / "cc"),
        }

    def create(self) -> Dirs:
        for path in self.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        return self


def child_env(dirs: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    # Knobs that would change what is measured.
    for key in list(env):
        if key.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCH_LOGS", "TORCHDYNAMO_")):
            del env[key]
    env.pop("TORCH_CACHING_PRECOMPILE", None)
    env.update(dirs)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_child(
    model: str,
    mech: str,
    phase: str,
    work: Path,
    dirs: dict[str, str],
    log: Path,
    timeout: float,
    calls: int,
) -> Run:
    cmd = [
        sys.executable,
        str(CHILD),
        "--model",
        model,
        "--mech",
        mech,
        "--phase",
        phase,
        "--work",
        str(work),
        "--calls",
        str(calls),
    ]
    run = Run(ok=False)
    # Children run one at a time, so the growth of RUSAGE_CHILDREN across one is its CPU.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=child_env(dirs), text=True, cwd=REPO
        )
        assert proc.stdout is not None
        deadline = t0 + timeout
        try:
            for line in proc.stdout:
                now = time.perf_counter()
                tag, _, payload = line.strip().partition(" ")
                if tag == "FIRST_OUTPUT":
                    run.first_output_s = now - t0
                    run.child = json.loads(payload)
                elif tag == "RESULT":
                    run.result = json.loads(payload)
                elif tag == "UNAVAILABLE":
                    run.unavailable = json.loads(payload)["reason"]
                if now > deadline:
                    proc.kill()
                    break
            rc = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -9
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run.cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if run.unavailable:
        return run
    if rc != 0 or run.first_output_s is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        run.error = f"exit {rc}: " + " | ".join(tail)[-300:]
        return run
    run.ok = True
    return run


def fresh_dirs(work: Path, name: str) -> Dirs:
    return Dirs(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))).create()


def bench_model(
    model: str, mechs: list[str], runs: int, work: Path, timeout: float, calls: int
) -> list[Row]:
    rows: list[Row] = []
    produced: dict[str, tuple[Run, Dirs, Path]] = {}
    model_work = work / model
    model_work.mkdir(parents=True, exist_ok=True)

    def progress(msg: str) -> None:
        print(f"[{model}] {msg}", file=sys.stderr, flush=True)

    for mech in mechs:
        row = Row(model, mech)
        rows.append(row)
        producer = PRODUCER.get(mech)
        pdirs: Dirs | None = None
        art_dir = model_work
        if producer is not None:
            if producer not in produced:
                pdirs = fresh_dirs(model_work, f"produce-{producer}")
                art_dir = pdirs.root
                progress(f"produce {producer} ...")
                prun = run_child(
                    model,
                    producer,
                    "produce",
                    art_dir,
                    pdirs.env,
                    pdirs.root / "child.log",
                    timeout,
                    calls,
                )
                progress(f"produce {producer}: {_fmt_run(prun)}")
                produced[producer] = (prun, pdirs, art_dir)
            prun, pdirs, art_dir = produced[producer]
            row.produce = prun
            if not prun.ok:
                continue
        for i in range(runs):
            if mech in REUSES_PRODUCER_DIRS and pdirs is not None:
                env = pdirs.env
                log = pdirs.root / f"{mech}-{i}.log"
            else:
                dirs = fresh_dirs(model_work, f"{mech}-{i}")
                env = dirs.env
                if mech in KEEPS_CC_DIR and pdirs is not None:
                    env = {**env, "CACHECOMPILE_DIR": pdirs.env["CACHECOMPILE_DIR"]}
                log = dirs.root / "child.log"
            r = run_child(model, mech, "run", art_dir, env, log, timeout, calls)
            row.runs.append(r)
            progress(f"{mech} run {i + 1}/{runs}: {_fmt_run(r)}")
            if r.unavailable or (r.error and i == 0):
                break
    return rows


# cachecompile's cold phases in the order they run (cold.compiling.Phases).
PHASES = ("key", "lookup", "torch_imports", "lock", "dynamo", "backend", "guards", "capture",
          "verify", "run", "deps", "entry")


def bench_profile(model: str, runs: int, work: Path, timeout: float) -> list[Row]:
    """Paired cold runs of torch.compile and cache_compile (see ``--profile``)."""
    pair = ("compile_cold", "cc_cold")
    rows = {mech: Row(model, mech) for mech in pair}
    model_work = work / model
    model_work.mkdir(parents=True, exist_ok=True)
    for i in range(runs):
        for mech in pair if i % 2 == 0 else pair[::-1]:
            dirs = fresh_dirs(model_work, f"{mech}-{i}")
            r = run_child(model, mech, "run", dirs.root, dirs.env, dirs.root / "child.log",
                          timeout, 1)
            rows[mech].runs.append(r)
            print(f"[{model} profile] {mech} pair {i + 1}/{runs}: {_fmt_run(r)}, "
                  f"cpu {_s(r.cpu_s)} s", file=sys.stderr, flush=True)
    return list(rows.values())


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _timer_median(runs: list[Run], field: str, name: str) -> float | None:
    """The median of one timer (``torch_phases`` or ``cold_phases``) over the runs."""
    return _median([r.result[field][name] for r in runs if name in r.result.get(field, {})])


def profile_markdown(rows: list[Row], runs: int) -> str:
    """Medians per mechanism, median per-pair ratios, and the phases of both."""
    out: list[str] = []
    for model in dict.fromkeys(r.model for r in rows):
        tc = next(r for r in rows if r.model == model and r.mechanism == "compile_cold")
        cc = next(r for r in rows if r.model == model and r.mechanism == "cc_cold")
        pairs = [(a, b) for a, b in zip(tc.runs, cc.runs, strict=False) if a.ok and b.ok]
        wall_ratio = _median([b.first_output_s / a.first_output_s for a, b in pairs
                              if a.first_output_s and b.first_output_s])
        cpu_ratio = _median([b.cpu_s / a.cpu_s for a, b in pairs if a.cpu_s and b.cpu_s])
        out.append(f"### {model} model: cold, empty dirs, {len(pairs)} of {runs} pairs\n")
        out.append("| | torch.compile cold | cache_compile cold | cc / tc (median of pairs) |")
        out.append("|---|---|---|---|")
        out.append(f"| wall to first output s | {_s(tc.median_first())} | {_s(cc.median_first())} "
                   f"| {_s(wall_ratio)} |")
        out.append(f"| CPU s (self + children) | {_s(_median([r.cpu_s for r in tc.runs if r.ok and r.cpu_s]))} "
                   f"| {_s(_median([r.cpu_s for r in cc.runs if r.ok and r.cpu_s]))} | {_s(cpu_ratio)} |")
        out.append("")
        names = list(dict.fromkeys(k for r in (*tc.runs, *cc.runs)
                                   for k in r.result.get("torch_phases", {})))
        if names:
            out.append("torch's compile timers of 0.1 s or more (median s; the same compiler "
                       "under both):\n")
            out.append("| timer | torch.compile | cache_compile |")
            out.append("|---|---|---|")
            for k in names:
                a = _timer_median(tc.runs, "torch_phases", k)
                b = _timer_median(cc.runs, "torch_phases", k)
                if max(a or 0.0, b or 0.0) >= 0.1:
                    out.append(f"| {k} | {_s(a)} | {_s(b)} |")
            out.append("")
        seen = {k for r in cc.runs for k in r.result.get("cold_phases", {})}
        phases = [k for k in PHASES if k in seen] + sorted(seen - set(PHASES))
        if phases:
            out.append("cache_compile's cold phases (median s, from the entry's `cold_phases`):\n")
            out.append("| phase | s |")
            out.append("|---|---|")
            for k in phases:
                out.append(f"| {k} | {_s(_timer_median(cc.runs, 'cold_phases', k))} |")
            out.append("")
    return "\n".join(out)


def bench_micro(mechs: list[str], work: Path, timeout: float) -> list[Row]:
    rows: list[Row] = []
    micro_work = work / "micro"
    micro_work.mkdir(parents=True, exist_ok=True)
    for mech in mechs:
        row = Row("micro", mech)
        rows.append(row)
        dirs = fresh_dirs(micro_work, mech)
        if mech in ("cc_warm", "cc_warm_always"):
            row.produce = run_child(
                "micro", mech, "produce", dirs.root, dirs.env, dirs.root / "p.log", timeout, 0
            )
            if not row.produce.ok:
                continue
        r = run_child("micro", mech, "run", dirs.root, dirs.env, dirs.root / "r.log", timeout, 0)
        row.runs.append(r)
        print(f"[micro] {mech}: {_fmt_run(r)}", file=sys.stderr, flush=True)
    return rows


def _fmt_run(r: Run) -> str:
    if r.unavailable:
        return f"n/a ({r.unavailable})"
    if not r.ok:
        return f"FAILED {r.error}"
    us = r.result.get("per_call_us")
    return f"first output {r.first_output_s:.2f} s" + (f", {us:.1f} us/call" if us else "")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.0f} KiB"
    return f"{int(n)} B"


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f} us" if x < 1000 else f"{x / 1000:.2f} ms"


def markdown(rows: list[Row], runs: int) -> str:
    out: list[str] = []
    models = list(dict.fromkeys(r.model for r in rows if r.model != "micro"))
    for model in models:
        mrows = [r for r in rows if r.model == model]
        eager = next((r.median_first() for r in mrows if r.mechanism == "eager"), None)
        out.append(f"### {model} model (time to first output from process spawn, n={runs})\n")
        out.append(
            "| mechanism | median s | min s | max s | overhead over eager s | x eager "
            "| import torch s | per-call | artifact bytes | produce s |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in mrows:
            label = LABELS.get(r.mechanism, r.mechanism)
            status = r.status()
            if status is not None:
                out.append(f"| {label} | {status} |  |  |  |  |  |  |  |  |")
                continue
            firsts = r.firsts()
            med = r.median_first()
            over = None if med is None or eager is None else med - eager
            ratio = "-" if med is None or not eager else f"{med / eager:.1f}"
            art = r.median_of("result", "artifact_bytes")
            if art is None and r.produce is not None:
                art = r.produce.result.get("artifact_bytes")
            prod = r.produce.first_output_s if r.produce is not None else None
            fails = len(r.runs) - len(firsts)
            note = f" ({fails} failed)" if fails else ""
            out.append(
                f"| {label}{note} | {_s(med)} | {_s(min(firsts))} | {_s(max(firsts))} "
                f"| {_s(over)} | {ratio} | {_s(r.median_of('child', 'import_torch_s'))} "
                f"| {_us(r.median_of('result', 'per_call_us'))} | {_bytes(art)} | {_s(prod)} |"
            )
        out.append("")
    micro = [r for r in rows if r.model == "micro"]
    if micro:
        out.append("### per-call overhead: `x + 1` on 4 floats via `AddOne.add` (no_grad)\n")
        out.append("| mechanism | per call |")
        out.append("|---|---|")
        for r in micro:
            status = r.status()
            value = status if status else _us(r.median_of("result", "per_call_us"))
            out.append(f"| {MICRO_LABELS.get(r.mechanism, r.mechanism)} | {value} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="timed processes per mechanism")
    parser.add_argument("--model", choices=("demo", "anchor", "hf", "both"), default="demo",
                        help="hf: a transformers Llama (needs the test extras)")
    parser.add_argument("--only", default="", help="comma-separated mechanisms (see above)")
    parser.add_argument("--quick", action="store_true", help="runs=1, demo model")
    parser.add_argument("--micro", action="store_true", help="also run the x+1 micro-benchmark")
    parser.add_argument("--micro-only", action="store_true", help="only the micro-benchmark")
    parser.add_argument("--profile", action="store_true",
                        help="paired cold runs of torch.compile and cache_compile, with phases")
    parser.add_argument("--calls", type=int, default=200, help="calls for per-call latency")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--work", default=None, help="work dir (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    parser.add_argument("--json", dest="json_path", default=None, help="write raw results here")
    args = parser.parse_args(argv)

    runs = 1 if args.quick else args.runs
    models = (
        ["demo"] if args.quick else (["demo", "anchor"] if args.model == "both" else [args.model])
    )
    only = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = [m for m in only if m not in MECHANISMS and m not in MICRO_MECHANISMS]
    if unknown:
        parser.error(f"unknown mechanism(s): {', '.join(unknown)}")
    mechs = [m for m in MECHANISMS if not only or m in only]
    if "eager" not in mechs and not args.micro_only:
        mechs.insert(0, "eager")  # the baseline for "overhead over eager"
    micro_mechs = [m for m in MICRO_MECHANISMS if not only or m in only]

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_compile-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir: {work}", file=sys.stderr)
    rows: list[Row] = []
    if args.profile:
        try:
            for model in models:
                rows += bench_profile(model, runs, work, args.timeout)
        finally:
            if not args.keep and args.work is None:
                shutil.rmtree(work, ignore_errors=True)
        print(profile_markdown(rows, runs))
        if args.json_path:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps([asdict(r) for r in rows], indent=2))
        return 0 if all(r.ok for row in rows for r in row.runs) else 1
    try:
        if not args.micro_only:
            for model in models:
                rows += bench_model(model, mechs, runs, work, args.timeout, args.calls)
        if args.micro or args.micro_only:
            rows += bench_micro(micro_mechs, work, args.timeout)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    import torch  # only for the header; children do the measuring

    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}; runs={runs}\n"
    )
    print(markdown(rows, runs))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "runs": runs,
            "rows": [asdict(r) for r in rows],
        }
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
    failed = [r for r in rows if (s := r.status()) is not None and s.startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
