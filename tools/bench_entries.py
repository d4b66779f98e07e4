"""A warm start with many entries (issue 33): time to the LAST first output of a fresh
process that serves the demo decoder at N batch sizes (``dynamic=False``: one entry each),
against eager and torch.compile with its own caches warm, as whole fresh processes,
interleaved; and where each entry's load goes, phase by phase.

The verdict is read from paired differences: each round runs every mechanism once, in
turn, so a round's eager and cache_compile processes share that moment's load; the tool
prints, per mechanism, the min and median of its first output and of its second round,
and the median (and min, max) of its per-round difference to eager (cc minus eager in the
same round), which is what the budgets compare. On a loaded machine eager's own median
moves by more than the effect measured; the paired difference moves much less. Most of what
still moves it is ``import torch`` (about 1 s, the same work in both, spread by ±0.2 s on a
shared VM), so the same difference is also given from the end of each process's own
``import torch`` ("after import torch"), and how many full collections had run by the last
first output (``gc.get_stats()``, read once there).

Mechanisms, each a fresh process over the same N batch sizes:
  eager       the model as it is
  cc_warm     cache_compile(m.forward, dynamic=False), every entry in the store (built once
              beforehand by a cold process), empty Inductor dirs
  tc_warm     torch.compile(m.forward, dynamic=False), in the dirs of an earlier run (its FX
              graph and kernel caches warm; Dynamo traces every batch size again); one of
              --others ("tc"), as it takes 25 s a process at 32 entries
  mega        torch.compiler.load_cache_artifacts of what an earlier torch.compile process
              saved (save_cache_artifacts, every batch size), empty dirs, then torch.compile
  cc_nowindow cc_warm with the collector's pause off (cachecompile.warm.collector): young
              collections inside cachecompile's import and loads promote their temporaries,
              which can set off a full collection before the first outputs, as before
              issue 53; one of --others ("nowindow")
  aot         AOT precompile: one aot_compile + save_compiled_function per batch size by an
              earlier process; here load_compiled_function of each, empty dirs (a caller
              dispatches by batch size itself: AOT precompile keeps one artifact per shape)

The phase split runs one more cc_warm process under cProfile and reports, per entry, the
cumulative time of each step of a lookup: reading the manifest, building the guard checker,
verifying the files (store get), loading the program, rebuilding the method, and the C++
guard tree (built once a variant's Python checks have taken as long as a build would:
not within the two calls a size gets here, so 0).

    python tools/bench_entries.py --entries 8 --runs 5
    python tools/bench_entries.py --entries 8 32 --runs 5 --others ''
    python tools/bench_entries.py --entries 8 --runs 5 --others '' --workers 2 4
    python tools/bench_entries.py --entries 8 32 --runs 5 --others '' --gc-freeze

``--workers N``: N workers start at once on this node, as a server starts its workers after
a restart (each a fresh process of the mechanism, all reading one store; each its own
Inductor and temporary dirs). Measured from the launch (the parent's clock) to the moment
the last worker has served its last first output, per round, eager's N workers and
cache_compile's N workers in turn, so contention is measured rather than guessed: whatever a
warm start does beyond eager's work, N workers on fewer cores pay it N times over.

cachecompile's own modules are byte-compiled first (``compileall``, as ``pip install``
does for a wheel; with the code digest's cache beside them), so that a warm process reads them as an installed package's: an
editable checkout under ``PYTHONDONTWRITEBYTECODE=1`` otherwise compiles its ~70 modules
from source in every process, about 0.15-0.2 s that eager never pays (torch's own are
compiled at install). ``--source-only`` measures that case.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import os, sys, time
t0 = time.perf_counter()
gc_stats = None
if os.environ.get("BENCH_GC"):   # the garbage collector's time, by generation
    import gc
    gc_stats = {"n": [0, 0, 0], "ms": [0.0, 0.0, 0.0]}
    def _collected(phase, info, _start=[0.0]):
        if phase == "start":
            _start[0] = time.perf_counter()
        else:
            gc_stats["n"][info["generation"]] += 1
            gc_stats["ms"][info["generation"]] += (time.perf_counter() - _start[0]) * 1e3
    gc.callbacks.append(_collected)
import torch
t_torch = time.perf_counter() - t0
from cachecompile.demo.models import build_decoder
mode, n = sys.argv[1], int(sys.argv[2])
if mode not in ("eager", "cc_warm", "cc_nowindow") or os.environ.get("BENCH_BUILD"):
    # N static batch sizes are N compiles, past Dynamo's recompile limit (8) at 32: a
    # server that serves them raises it (the limit is no key factor). Left at 8, the build
    # ran 24 of 32 sizes eagerly and cached none. A warm cache_compile process that only
    # hits imports no Dynamo, and is left so.
    import torch._dynamo
    torch._dynamo.config.recompile_limit = 64
m = build_decoder().eval()
if os.environ.get("BENCH_GC_FREEZE"):
    # What Python advises a server: what is alive after start-up (torch, the model) is
    # moved out of the collector's sight, so no full collection walks it again.
    import gc
    gc.freeze()
fn = m.forward
art = os.environ.get("BENCH_ARTIFACTS", "")
def inputs(b):
    return torch.randint(0, 100, (b, 4), generator=torch.Generator().manual_seed(b))
if mode in ("cc_warm", "cc_nowindow"):
    if mode == "cc_nowindow":
        # As before issue 53: the collector runs inside cachecompile's import and loads.
        import contextlib
        from cachecompile.warm import collector
        collector.paused = contextlib.nullcontext
    from cachecompile import cache_compile
    # N static sizes: past cache_compile's default of 8 cached signatures per method
    # (max_signatures, a SignatureLimitWarning), as a server declaring them would raise it.
    fn = cache_compile(m.forward, dynamic=False, max_signatures=max(n, 8))
elif mode in ("tc_warm", "mega_save"):
    fn = torch.compile(m.forward, dynamic=False)
elif mode == "mega":
    with open(os.path.join(art, "mega.bin"), "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
    fn = torch.compile(m.forward, dynamic=False)
elif mode == "aot_save":
    with torch.no_grad():
        for b in range(1, n + 1):
            c = torch.compile(m.forward, dynamic=False, fullgraph=True).aot_compile(
                ((inputs(b),), {}))
            c.save_compiled_function(os.path.join(art, f"aot-{b}.bin"))
    fn = m.forward
elif mode == "aot":
    loaded = {}
    def fn(x):
        b = x.shape[0]
        if b not in loaded:
            with open(os.path.join(art, f"aot-{b}.bin"), "rb") as f:
                loaded[b] = torch.compiler.load_compiled_function(f)
        return loaded[b](m, x)
first = {}
with torch.no_grad():
    for b in range(1, n + 1):
        x = inputs(b)
        out = fn(x)
        first[b] = time.perf_counter() - t0
    served = time.time()   # wall clock: --workers compares it with the launch
    # Full collections so far, read once here (gc.callbacks, BENCH_GC, allocate inside
    # every collection and move the next full one: a count they give can differ).
    import gc
    full_by_first = gc.get_stats()[2]["collections"]
    for b in range(1, n + 1):     # second calls: cache_compile builds each entry's C++ tree
        fn(inputs(b))
    second = time.perf_counter() - t0
if mode == "mega_save":
    with open(os.path.join(art, "mega.bin"), "wb") as f:
        f.write(torch.compiler.save_cache_artifacts()[0])
events = [e for e, _ in getattr(fn, "events", [])]
import json
print("RESULT " + json.dumps({"last_first": first[n], "second_round": second - first[n],
                              "served": served,
                              "misses": sum(e != "hit" for e in events) if events else None,
                              "gc": gc_stats, "full_by_first": full_by_first,
                              "after_torch": first[n] - t_torch}))
"""

PHASES = {
    "manifest": "_variant_meta", "checker": "build_checker", "verify (store get)": "get",
    "program load": "load", "rebuild": "rebuild", "tree (if built)": "build",
}
PHASE_FILES = {"_variant_meta": "lookup.py", "build_checker": "checker.py", "get": "disk.py",
               "load": "backends", "rebuild": "replay.py", "build": "entry/guard_tree.py"}


def report(rows: dict[str, list[dict[str, float]]]) -> list[str]:
    """Per mechanism: min and median of the first output and the second round, and the
    per-round difference to eager (same round, so the same moment's load), its median
    with min and max. Rows are in run order: round i of each mechanism ran together."""
    eager = [r["last_first"] for r in rows["eager"]]
    lines = []
    for mode, rs in rows.items():
        first = [r["last_first"] for r in rs]
        second = [r["second_round"] * 1e3 for r in rs]
        full = sorted({int(r.get("full_by_first", -1)) for r in rs})
        line = (f"  {mode:8s} first output min {min(first):6.3f} s, median "
                f"{statistics.median(first):6.3f} s; second round min {min(second):7.1f} ms, "
                f"median {statistics.median(second):7.1f} ms; full collections by the last "
                f"first output {'/'.join(map(str, full))}")
        if mode != "eager":
            diff = [f - e for f, e in zip(first, eager, strict=True)]
            line += (f"; minus eager, paired: median {statistics.median(diff):+.3f} s "
                     f"(min {min(diff):+.3f}, max {max(diff):+.3f})")
            beyond = [r["after_torch"] - e["after_torch"]
                      for r, e in zip(rs, rows["eager"], strict=True)]
            line += (f"; after import torch, paired: median {statistics.median(beyond):+.3f} s "
                     f"(min {min(beyond):+.3f}, max {max(beyond):+.3f})")
            if rs[-1].get("misses") is not None:
                line += f"; misses {rs[-1]['misses']}"
        lines.append(line)
    return lines


def run_workers(mode: str, n: int, envs: list[dict[str, str]]) -> float:
    """Start one worker per environment at once; seconds from the launch until every worker
    has served its last first output (the slowest worker's)."""
    launch = time.time()
    procs = [subprocess.Popen([sys.executable, _child_file(), mode, str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]
    served = []
    for p in procs:
        out, err = p.communicate(timeout=3600)
        served.append(_result(f"{mode} worker", p.returncode, out, err)["served"] - launch)
    return max(served)


def _result(what: str, returncode: int, stdout: str, stderr: str) -> dict[str, float]:
    """A child's RESULT line, parsed; a failed child stops the benchmark with its stderr."""
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if returncode != 0 or not line:
        raise SystemExit(f"{what} failed:\n{stderr[-3000:]}")
    return dict(json.loads(line[-1][7:]))


def workers_report(n_workers: int, rows: dict[str, list[float]]) -> str:
    eager, cc = rows["eager"], rows["cc_warm"]
    diff = [c - e for c, e in zip(cc, eager, strict=True)]
    return (f"  {n_workers} workers at once: every worker's first output, eager median "
            f"{statistics.median(eager):.3f} s (min {min(eager):.3f}), cache_compile median "
            f"{statistics.median(cc):.3f} s (min {min(cc):.3f}); minus eager, paired: median "
            f"{statistics.median(diff):+.3f} s (min {min(diff):+.3f}, max {max(diff):+.3f})")


def run(mode: str, n: int, env: dict[str, str], profile: Path | None = None) -> dict[str, float]:
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    out = subprocess.run([*cmd, _child_file(), mode, str(n)], env=env, capture_output=True,
                         text=True, timeout=3600)
    return _result(mode, out.returncode, out.stdout, out.stderr)


def _child_file() -> str:
    path = Path(tempfile.gettempdir()) / "cachecompile_bench_entries_child.py"
    path.write_text(CHILD)
    return str(path)


def phases(profile: Path, n: int) -> dict[str, float]:
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for label, func in PHASES.items():
        total = sum(ct for (file, _, name), (_, _, _, ct, _) in stats.items()
                    if name == func and PHASE_FILES[func] in file)
        out[label] = total / n * 1e3
    return out


def byte_compile() -> list[str]:
    """Byte-compile cachecompile and its store as an install does (see the module doc);
    the folders compiled."""
    import cachecompile

    dirs = [os.path.dirname(os.path.abspath(cachecompile.__file__))]
    spec = importlib.util.find_spec("cachecompile.store")
    if spec is not None and spec.origin:
        store = os.path.dirname(os.path.abspath(spec.origin))
        if not store.startswith(dirs[0] + os.sep):
            dirs.append(store)
    for d in dirs:
        compileall.compile_dir(d, quiet=1)
    from cachecompile._version import save_code_digest

    save_code_digest()   # the code digest's cache beside the bytecode, as for an install
    return dirs


def main() -> None:  # noqa: C901 (today's exception: the benchmark's options and phases)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=5,
                    help="interleaved rounds: each runs every mechanism once, in turn")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--others", default="tc,mega,aot",
                    help="torch's own mechanisms to compare too (comma list of tc, mega, "
                         "aot; '' for none: eager and cache_compile only. Each recompiles or "
                         "retraces every entry, minutes at 32 entries); and nowindow: "
                         "cache_compile with the collector's pause off (warm.collector)")
    ap.add_argument("--workers", type=int, nargs="*", default=[],
                    help="also start N workers at once (each N given), eager's and "
                         "cache_compile's in turn, and time the last one's first output")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="every child calls gc.freeze() once its model is built, as Python "
                         "advises servers (both mechanisms alike)")
    ap.add_argument("--source-only", action="store_true",
                    help="do not byte-compile cachecompile first: measure an editable "
                         "checkout under PYTHONDONTWRITEBYTECODE=1, which compiles its "
                         "modules from source in every process")
    a = ap.parse_args()
    others = [o for o in a.others.split(",") if o]
    if not a.source_only:
        print("byte-compiled " + ", ".join(byte_compile()))
    work = Path(tempfile.mkdtemp(prefix="cc-bench-entries-"))
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_"))}
    if a.gc_freeze:
        base["BENCH_GC_FREEZE"] = "1"
    print(f"torch {__import__('torch').__version__}; {os.cpu_count()} cores; work {work}"
          + ("; gc.freeze() after the model is built" if a.gc_freeze else ""))
    try:
        for n in a.entries:
            summary_workers: dict[int, float] = {}
            store = work / f"store-{n}"

            def env(name: str, warm_tc: bool = False, n: int = n,
                    store: Path = store) -> dict[str, str]:
                d = work / (f"tc-{n}" if warm_tc else f"{name}-{n}-{time.monotonic_ns()}")
                for sub in ("inductor", "tmp"):
                    (d / sub).mkdir(parents=True, exist_ok=True)
                return {**base, "CACHECOMPILE_DIR": str(store),
                        "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TMPDIR": str(d / "tmp")}

            art = work / f"artifacts-{n}"
            art.mkdir()
            run("cc_warm", n, {**env("build"), "BENCH_BUILD": "1"})  # cold: builds N entries
            modes = ["eager", "cc_warm"] + (["cc_nowindow"] if "nowindow" in others else [])
            if "tc" in others:
                run("tc_warm", n, env("tc", warm_tc=True))  # fills torch.compile's caches
                modes.append("tc_warm")
            for mode, made in (("mega", "mega_save"), ("aot", "aot_save")):
                if mode not in others:
                    continue
                try:                                   # the producers, in empty dirs
                    run(made, n, {**env(made), "BENCH_ARTIFACTS": str(art)})
                    modes.append(mode)
                except SystemExit as e:
                    print(f"  {mode}: could not package this model: {str(e)[-300:]}")
            rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for _ in range(a.runs):                    # interleaved
                for mode in rows:
                    rows[mode].append(run(mode, n, {**env(mode, warm_tc=mode == "tc_warm"),
                                                    "BENCH_ARTIFACTS": str(art)}))
            eager = statistics.median(r["last_first"] for r in rows["eager"])
            print(f"\n{n} entries, {a.runs} interleaved rounds (fresh processes each)")
            for line in report(rows):
                print(line)
            for k in a.workers:
                wrows: dict[str, list[float]] = {"eager": [], "cc_warm": []}
                for _ in range(a.runs):                # interleaved, as above
                    for mode in wrows:
                        wrows[mode].append(run_workers(mode, n, [env(f"{mode}-w{i}")
                                                                 for i in range(k)]))
                print(workers_report(k, wrows))
                summary_workers[k] = statistics.median(
                    c - e for c, e in zip(wrows["cc_warm"], wrows["eager"], strict=True))
            prof = work / f"profile-{n}.out"
            run("cc_warm", n, env("prof"), profile=prof)
            print("  per entry, cc_warm under cProfile (inflated): " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in phases(prof, n).items()))
            print(json.dumps({"entries": n, "eager": eager, "cc_minus_eager": statistics.median(
                c["last_first"] - e["last_first"]
                for c, e in zip(rows["cc_warm"], rows["eager"], strict=True)),
                "workers_cc_minus_eager": summary_workers}))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
