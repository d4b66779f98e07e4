"""Cold start of a multi-rank job on one node: cooperating cache_compile vs plain compile.

Each measurement is a whole ``torchrun --standalone --nproc-per-node N`` job on a
brand-new cache (fresh CACHECOMPILE_DIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
and TMPDIR, shared by the job's ranks as they would be on a node). Every rank builds
the demo decoder (same weights: a replicated model, so all ranks have the same graph)
and runs its first prefill. Reported: wall time from launch to the job's exit, and
the CPU seconds of the whole process tree (RUSAGE_CHILDREN of this process).

Usage:
  python tools/bench_ranks.py                 # 1, 2, 4 cooperating ranks; 4 plain ranks
  python tools/bench_ranks.py --runs 3 --json bench-out/ranks.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

RANK_SCRIPT = r'''
import os, sys, torch
from cachecompile import cache_compile
from cachecompile.demo import models
mode = sys.argv[1]
lm = models.build_decoder(models.demo_config(), seed=0)
fn = cache_compile(lm.prefill, dynamic=False) if mode == "cache_compile" else \
    torch.compile(lm.prefill, fullgraph=True, dynamic=False)
toks = models.make_inputs(lm, batch=2, seq=32, seed=1)
with torch.no_grad():
    out = fn(toks)
    assert torch.allclose(out, lm.prefill(toks), rtol=1e-4, atol=1e-4)
events = [e[0] for e in fn.events] if mode == "cache_compile" else ["compiled"]
with open(os.path.join(os.environ["RESULT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    f.write(" ".join(events))
'''


def cpu_children() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one_job(mode: str, nproc: int, base: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"{mode}-{nproc}-", dir=base))
    env = dict(os.environ, PYTHONPATH=str(REPO), CACHECOMPILE_DIR=str(work / "store"),
               RESULT_DIR=str(work))
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                     ("TMPDIR", "tmp")):
        (work / sub).mkdir()
        env[var] = str(work / sub)
    # The script gets a directory of its own: its directory goes first on sys.path, and a
    # cache dir named "triton" there would be imported as the triton package.
    (work / "job").mkdir()
    script = work / "job" / "rank.py"
    script.write_text(RANK_SCRIPT)
    cpu0 = cpu_children()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(script), mode], env=env,
                          capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    cpu = cpu_children() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} x{nproc} failed:\n{proc.stderr[-3000:]}")
    events = sorted((work / f"rank{r}.json").read_text() for r in range(nproc))
    return {"mode": mode, "nproc": nproc, "wall_s": wall, "cpu_s": cpu, "events": events}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    plan = [("cache_compile", 1), ("cache_compile", 2), ("cache_compile", 4),
            ("torch.compile", 4)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        for run in range(args.runs):
            for mode, n in plan:  # interleaved, so drifting machine load hits all alike
                r = one_job(mode, n, Path(tmp))
                r["run"] = run
                rows.append(r)
                print(f"run {run}: {mode} x{n}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
                      f"events {r['events']}", flush=True)
    med: dict[tuple[str, int], tuple[float, float]] = {}
    for mode, n in plan:
        sel = [r for r in rows if r["mode"] == mode and r["nproc"] == n]
        med[(mode, n)] = (statistics.median(r["wall_s"] for r in sel),
                          statistics.median(r["cpu_s"] for r in sel))
    one = med[("cache_compile", 1)][0]
    print(f"\nmedians of {args.runs} (cpus: {os.cpu_count()})\n")
    print("| job | wall (median) | vs 1 rank | CPU seconds (median) |")
    print("|---|---|---|---|")
    for mode, n in plan:
        wall, cpu = med[(mode, n)]
        label = f"{n} rank{'s' if n > 1 else ''}, {mode}" + (" (cooperating)"
                                                            if mode == "cache_compile" else "")
        print(f"| {label} | {wall:.1f} s | {wall / one:.2f}x | {cpu:.1f} s |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
