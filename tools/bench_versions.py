"""Warm-start table per torch release: the same bench_compile.py mechanisms, one venv each.

Each ``--python`` is the interpreter of a venv with one torch release and cachecompile
installed (``pip install torch==X -e .``). For each, in turn, this runs
``tools/bench_compile.py`` (whole fresh processes, see its docstring) with the warm-start
mechanisms and the per-call micro-benchmark, then prints one table with a column group per
release, so the releases are compared in one run on one machine.

Usage:
  python tools/bench_versions.py --runs 3 \\
      --python .venv/bin/python --python .venv-torch-2.14.1/bin/python \\
      --python .venv-torch-2.15.0/bin/python --json bench-out/versions.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE / "bench_compile.py"

STARTUP = ("eager", "compile_cold", "compile_warm", "aot_precompile", "cc_cold", "cc_warm")
MICRO = ("compile", "aot_precompile", "cc_warm", "cc_warm_always")
LABELS = {
    "eager": "eager",
    "compile_cold": "torch.compile, empty dirs",
    "compile_warm": "torch.compile, warm Inductor dir",
    "aot_precompile": "AOT precompile, warm dir",
    "cc_cold": "cache_compile cold",
    "cc_warm": "**cache_compile warm**, empty Inductor dirs",
}
MICRO_LABELS = {
    "compile": "torch.compile (guarded call)",
    "aot_precompile": "AOT precompile, guards checked",
    "cc_warm": "cache_compile warm (argument guards per call)",
    "cc_warm_always": "cache_compile warm, guards=\"always\"",
}


def _firsts(row: dict[str, Any]) -> list[float]:
    return [r["first_output_s"] for r in row["runs"] if r["ok"] and r["first_output_s"] is not None]


def _per_call(row: dict[str, Any]) -> float | None:
    vals = [float(r["result"]["per_call_us"]) for r in row["runs"]
            if r["ok"] and r["result"].get("per_call_us") is not None]
    return statistics.median(vals) if vals else None


def _status(row: dict[str, Any]) -> str | None:
    for r in row["runs"]:
        if r.get("unavailable"):
            return "n/a"
    if not _firsts(row) and _per_call(row) is None:
        return "failed"
    return None


def run_release(python: str, model: str, runs: int, timeout: float, out: Path,
                only: tuple[str, ...]) -> dict[str, Any]:
    micro = any(m in MICRO for m in only)
    cmd = [python, str(BENCH), "--model", model, "--runs", str(runs),
           *(["--micro"] if micro else []), "--only", ",".join(only),
           "--timeout", str(timeout), "--json", str(out)]
    print(f"== {python}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if not out.exists():
        raise SystemExit(f"{python}: bench_compile.py wrote no results (rc={proc.returncode})")
    return json.loads(out.read_text())


def table(results: list[dict[str, Any]], model: str, only: tuple[str, ...]) -> str:
    heads = [f"torch {r['torch']}" for r in results]
    lines = [f"### {model} model: time to first output (median), overhead over eager\n",
             "| mechanism | " + " | ".join(heads) + " |",
             "|---|" + "---|" * len(heads)]
    eager: list[float | None] = []
    by_release: list[dict[str, dict[str, Any]]] = []
    for r in results:
        rows = {row["mechanism"]: row for row in r["rows"] if row["model"] == model}
        by_release.append(rows)
        e = _firsts(rows["eager"]) if "eager" in rows else []
        eager.append(statistics.median(e) if e else None)
    for mech in (m for m in STARTUP if m in only):
        cells = []
        for rows, base in zip(by_release, eager, strict=True):
            row = rows.get(mech)
            if row is None:
                cells.append("-")
                continue
            status = _status(row)
            firsts = _firsts(row)
            if status or not firsts:
                cells.append(status or "failed")
                continue
            med = statistics.median(firsts)
            over = "" if base is None or mech == "eager" else f" ({med - base:+.2f} s)"
            cells.append(f"{med:.2f} s{over}")
        lines.append(f"| {LABELS[mech]} | " + " | ".join(cells) + " |")
    if not any(m in MICRO for m in only):
        return "\n".join(lines) + "\n"
    lines += ["", "Per-call overhead, `x + 1` on 4 floats through a module method:\n",
              "| mechanism | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for mech in (m for m in MICRO if m in only):
        cells = []
        for r in results:
            row = next((x for x in r["rows"] if x["model"] == "micro" and x["mechanism"] == mech),
                       None)
            v = None if row is None else _per_call(row)
            cells.append("-" if v is None else f"{v:.1f} us")
        lines.append(f"| {MICRO_LABELS[mech]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", action="append", required=True,
                   help="a venv's python (one torch release each); repeat")
    p.add_argument("--model", choices=("demo", "anchor", "hf"), default="demo")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--only", default="",
                   help="comma-separated mechanisms (default: all of "
                        f"{', '.join(dict.fromkeys(STARTUP + MICRO))}); cc_warm needs no "
                        "cc_cold row: its cache is produced first either way")
    args = p.parse_args(argv)
    only = tuple(dict.fromkeys(args.only.split(","))) if args.only else \
        tuple(dict.fromkeys(STARTUP + MICRO))
    unknown = [m for m in only if m not in STARTUP + MICRO]
    if unknown:
        p.error(f"unknown mechanisms: {', '.join(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="bench_versions-"))
    results = [run_release(py, args.model, args.runs, args.timeout, work / f"{i}.json", only)
               for i, py in enumerate(args.python)]
    print(table(results, args.model, only))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
