"""Prebuild benchmark: wall time of ``cachectl build`` with 1 compile slot vs 2.

Each run is ``cachectl build bench_factory:factory --jobs N`` with
``CACHECOMPILE_COMPILE_SLOTS=N`` into an EMPTY cachecompile store, an empty
``TORCHINDUCTOR_CACHE_DIR`` and an empty ``TMPDIR`` (Inductor's precompiled headers and
ISA probe live there): what an image build step on a fresh machine pays. Besides wall
time it reports the CPU seconds of each build (all its processes) and the load average
when it started, since on a shared machine other jobs decide how much CPU is left. The factory is
the demo decoder's ``decode`` with ``gears={"tokens": {0: [1, 2, 3, 4]}}``: four
independent static signatures, so up to four compiles can run at once. Runs of the two
settings alternate, so a busy machine slows both alike; the figure is the median.

    python tools/bench_prebuild.py --reps 3 [--gears 1,2,3,4] [--work DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FACTORY = '''
import torch
from cachecompile import cache_compile
from cachecompile.demo import models

GEARS = {gears!r}

class Served(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = models.build_decoder(models.demo_config(), seed=1)
        self.cached_decode = cache_compile(self.decode, dynamic=False,
                                           gears={{"tokens": {{0: GEARS}}}})

    def decode(self, tokens):
        return self.lm.decode(tokens)

def factory():
    m = Served().eval()
    return [(m.cached_decode, [models.make_inputs(m.lm, batch=1, seq=16, seed=3)])]
'''


def _cachectl() -> list[str]:
    # This checkout's cachectl: an installed script may belong to another checkout's install.
    return [sys.executable, "-m", "cachecompile.cli.main"]


def run_once(work: Path, slots: int, rep: int) -> dict[str, object]:
    base = work / f"slots{slots}-rep{rep}"
    shutil.rmtree(base, ignore_errors=True)
    dirs = {"CACHECOMPILE_DIR": base / "store", "TORCHINDUCTOR_CACHE_DIR": base / "inductor",
            "TRITON_CACHE_DIR": base / "triton", "TMPDIR": base / "tmp"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_"))}
    env.update({k: str(v) for k, v in dirs.items()})
    env["CACHECOMPILE_COMPILE_SLOTS"] = str(slots)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work), env.get("PYTHONPATH")) if p)
    load_before = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([*_cachectl(), "build", "bench_factory:factory", "--jobs", str(slots),
                        "--json"], env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if p.returncode != 0:
        raise SystemExit(f"cachectl build failed (slots={slots}):\n{p.stdout}\n{p.stderr[-4000:]}")
    results = json.loads(p.stdout)
    statuses = sorted({r["status"] for r in results})
    if statuses != ["built"]:
        raise SystemExit(f"expected every signature built, got {statuses}")
    shutil.rmtree(base, ignore_errors=True)
    return {"slots": slots, "rep": rep, "wall_s": round(wall, 2), "signatures": len(results),
            "per_signature_s": [round(r["seconds"], 2) for r in results],
            # CPU seconds of the build and all its processes (g++ included): what it cost,
            # beside what it took; and the machine's load when it started (others' jobs).
            "cpu_s": round(cpu, 1), "load_before": round(load_before, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gears", default="1,2,3,4")
    ap.add_argument("--work", default=None, help="work dir (default: a temp dir, removed)")
    ap.add_argument("--json", default=None, help="write all runs here")
    args = ap.parse_args()
    gears = [int(g) for g in args.gears.split(",")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-prebuild-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "bench_factory.py").write_text(FACTORY.format(gears=gears))
    runs: list[dict[str, object]] = []
    try:
        for rep in range(args.reps):
            for slots in (1, 2):
                r = run_once(work, slots, rep)
                runs.append(r)
                print(f"rep {rep} slots {slots}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.0f} s cpu, "
                      f"load {r['load_before']} (per signature {r['per_signature_s']})",
                      flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    med = {s: statistics.median(float(r["wall_s"]) for r in runs if r["slots"] == s)  # type: ignore[arg-type]
           for s in (1, 2)}
    print(f"\n{len(gears)} signatures, {args.reps} runs each, cpu_count={os.cpu_count()}")
    cpu = {s: statistics.median(float(r["cpu_s"]) for r in runs if r["slots"] == s)  # type: ignore[arg-type]
           for s in (1, 2)}
    print(f"median wall time: 1 slot {med[1]:.1f} s, 2 slots {med[2]:.1f} s, "
          f"speed-up {med[1] / med[2]:.2f}x; median cpu: {cpu[1]:.0f} s vs {cpu[2]:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median_s": med}, indent=1))


if __name__ == "__main__":
    main()
