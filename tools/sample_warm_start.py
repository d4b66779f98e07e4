"""Where a warm start's time goes beyond eager's, sampled from outside over whole processes
(issue 53): the child of tools/bench_entries.py (the demo decoder served at N batch sizes,
one entry each), eager and cache_compile warm in turn, each under ``py-spy record``.

cProfile (bench_entries' phase split) sees only the Python calls it wraps, and inflates
them. py-spy reads the interpreter's stack from outside at a fixed rate without stopping
it (``--nonblocking``), over the whole process: interpreter start, every import, every
call. Each sample of the main thread goes to the first bucket one of its frames is in:

  cachecompile  a frame of cachecompile or its store (their imports, lookups, checks, and
                what they call in torch)
  import        any other import (torch, the model, numpy)
  python        any other frame (building the model, its calls)

A sample is ``1000 / --rate`` ms. The garbage collector's time is counted in the child
itself (``gc.callbacks``, by generation): a collection runs inside whichever frame
triggered it, so its samples are in the buckets above too. Medians over ``--runs``
rounds, eager and cache_compile in turn within each; then cachecompile's samples by the
innermost frame of ours (its function and file), summed over the runs and divided by
them.

    python tools/sample_warm_start.py --entries 8 32 --runs 5

Needs py-spy (``pip install py-spy``; not a dependency of cachecompile) and the right to
trace a child process (root, or ``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_entries as be  # needs the path above

BUCKETS = ("cachecompile", "import", "python")
# A frame's file as py-spy prints it: relative to its sys.path entry where it can.
OURS = ("cachecompile/", "store/")


def _file(frame: str) -> str:
    """``func (path/file.py:12)`` -> ``path/file.py``."""
    return frame.rpartition(" (")[2].rpartition(":")[0]


def _ours(frame: str) -> bool:
    f = _file(frame)
    return f.startswith(OURS) or any(f"/{o}" in f for o in OURS)


def classify(stack: list[str]) -> tuple[str, str | None]:
    """A sample's bucket, and (if ours) its innermost frame of ours, without the line."""
    for frame in reversed(stack):                      # innermost first
        if _ours(frame):
            name, _, where = frame.rpartition(" (")
            return "cachecompile", f"{name} ({where.rpartition(':')[0]})"
    if any(f.startswith("_find_and_load ") for f in stack):
        return "import", None
    return "python", None


def tally(raw: Path) -> tuple[dict[str, int], collections.Counter[str]]:
    """Samples per bucket and ours per innermost frame, from py-spy's raw output (one
    line per distinct stack, outermost frame first, then its count)."""
    buckets = dict.fromkeys(BUCKETS, 0)
    mine: collections.Counter[str] = collections.Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        bucket, where = classify(stack_text.split(";"))
        buckets[bucket] += int(count)
        if where is not None:
            mine[where] += int(count)
    return buckets, mine


def sample(spy: str, mode: str, n: int, env: dict[str, str], raw: Path, rate: int
           ) -> dict[str, object]:
    """One child under py-spy; its RESULT (the child's own figures, the gc's among them)."""
    cmd = [spy, "record", "--nonblocking", "--rate", str(rate), "--format", "raw",
           "-o", str(raw), "--", sys.executable, be._child_file(), mode, str(n)]
    done = subprocess.run(cmd, env={**env, "BENCH_GC": "1"}, capture_output=True, text=True,
                          timeout=3600)
    return dict(be._result(mode, done.returncode, done.stdout, done.stderr))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rate", type=int, default=500, help="samples per second")
    ap.add_argument("--top", type=int, default=12, help="how many of our frames to list")
    a = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("needs py-spy: pip install py-spy")
    print("byte-compiled " + ", ".join(be.byte_compile()))
    work = Path(tempfile.mkdtemp(prefix="cc-sample-warm-"))
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_"))}
    ms = 1000 / a.rate
    try:
        for n in a.entries:
            store = work / f"store-{n}"

            def env(name: str, n: int = n, store: Path = store) -> dict[str, str]:
                d = work / f"{name}-{n}-{time.monotonic_ns()}"
                for sub in ("inductor", "tmp"):
                    (d / sub).mkdir(parents=True, exist_ok=True)
                return {**base, "CACHECOMPILE_DIR": str(store),
                        "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TMPDIR": str(d / "tmp")}

            be.run("cc_warm", n, {**env("build"), "BENCH_BUILD": "1"})  # cold: N entries
            modes = ("eager", "cc_warm")
            per: dict[str, list[dict[str, int]]] = {m: [] for m in modes}
            gcs: dict[str, list[dict[str, list[float]]]] = {m: [] for m in modes}
            firsts: dict[str, list[float]] = {m: [] for m in modes}
            mine: collections.Counter[str] = collections.Counter()
            for i in range(a.runs):
                for mode in modes:
                    raw = work / f"{mode}-{i}.txt"
                    result = sample(spy, mode, n, env(mode), raw, a.rate)
                    buckets, m = tally(raw)
                    per[mode].append(buckets)
                    gcs[mode].append(result["gc"])  # type: ignore[arg-type]
                    firsts[mode].append(float(result["last_first"]))  # type: ignore[arg-type]
                    if mode == "cc_warm":
                        mine.update(m)
            print(f"\n{n} entries: ms of the main thread by bucket, medians of {a.runs} runs "
                  f"({a.rate} Hz: a sample {ms:.1f} ms)")
            print("| bucket | eager | cache_compile warm | cc minus eager |")
            print("|---|---|---|---|")
            for b in (*BUCKETS, "total"):
                e, c = (statistics.median(sum(r.values()) if b == "total" else r[b]
                                          for r in per[mode]) * ms for mode in modes)
                print(f"| {b} | {e:.0f} | {c:.0f} | {c - e:+.0f} |")
            for g in range(3):
                e, c = (statistics.median(s["ms"][g] for s in gcs[mode]) for mode in modes)
                ne, nc = (statistics.median(s["n"][g] for s in gcs[mode]) for mode in modes)
                print(f"| gc generation {g} (inside the above): collections, ms | {ne:.0f}, "
                      f"{e:.1f} | {nc:.0f}, {c:.1f} | {c - e:+.1f} |")
            e, c = (statistics.median(firsts[mode]) for mode in modes)
            print(f"| last first output, s (sampled) | {e:.3f} | {c:.3f} | {c - e:+.3f} |")
            print(f"\ncachecompile's frames (innermost of ours), ms a run (mean of {a.runs}):")
            for where, k in mine.most_common(a.top):
                print(f"  {k / a.runs * ms:6.1f}  {where}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
