"""Graph breaks: time to first output of WHOLE FRESH PROCESSES, and per-call cost.

The model breaks its graph twice in the middle of real work: a branch on ``.item()`` and a
``print`` (to the child's stdout; a print to a file object stops torch's caching precompile
itself: it cannot pickle the file in its guards), between blocks of an MLP stack (hidden 256, seq 128, batch 2),
then reads two module globals (an int and a function) after the breaks. Each row is a new
Python process; the parent times it from ``Popen`` to the child's line saying that the
first output was computed **and checked against eager** (both branches are called, in
that order, before the line). Each child also reports its per-call median (both
branches alternating, after warm-up), the per-call median of a tiny graph-breaking
function (4 floats: the frames' overhead, guards included), how many frames Dynamo
converted in it, and whether it imported ``torch._dynamo``.

Mechanisms (``--only``):
  eager               the model as written
  compile_cold        ``torch.compile`` (fullgraph=False), empty Inductor dirs
  compile_warm        the same, in the dirs ``compile_cold`` left
  precompile_save     ``TORCH_CACHING_PRECOMPILE=1``, ``torch.compile``, then
                      ``torch.compiler.save_cache_artifacts()`` to a file (empty dirs)
  precompile_warm     ``load_cache_artifacts`` of that file, then ``torch.compile``, in the
                      dirs ``precompile_save`` left
  precompile_empty    the same into empty dirs (a new container)
  cc_cold             ``cache_compile(fullgraph=False)``, empty dirs
  cc_warm             the same store, empty Inductor dirs
And, once per run, the anchor's case: the function global read after the breaks is
another one in a fresh process (``BENCH_ACT=sigmoid``): ``precompile_warm`` and
``cc_warm`` again, each checked against eager there (``ok``).

Usage:
  python tools/bench_graph_breaks.py --runs 3 --json bench-out/graph-breaks.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ORDER = ("eager", "compile_cold", "compile_warm", "precompile_save", "precompile_warm",
         "precompile_empty", "cc_cold", "cc_warm")
# The producer each consumer's dirs (or artifact, or store) come from.
DIRS_OF = {"compile_warm": "compile_cold", "precompile_warm": "precompile_save",
           "precompile_empty": "precompile_save", "cc_warm": "cc_cold"}
EMPTY_INDUCTOR = {"precompile_empty", "cc_warm"}

MODEL = '''
import os
import torch
from torch import nn

SCALE = 3
act = torch.tanh if os.environ.get("BENCH_ACT", "tanh") == "tanh" else torch.sigmoid


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, h):
        return self.norm(h + self.down(torch.nn.functional.gelu(self.up(h))))


class Breaking(nn.Module):
    """Two blocks, a branch on .item(), a print, two blocks, the globals."""

    def __init__(self, d=256):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(Block(d), Block(d))
        self.second = nn.Sequential(Block(d), Block(d))

    def forward(self, x):
        h = self.first(x)
        if x.mean().item() > 0:     # the input's: LayerNorm makes h's mean ~0
            h = h * 0.5
        else:
            h = h * 2.0
        print("between graphs", tuple(h.shape))
        return act(self.second(h)) * SCALE


class Tiny(nn.Module):
    """Three frames of a few float ops: what the frames cost per call, guards included.
    (No branch on .item() here: torch 2.13's caching precompile fails to save a resume
    function's second variant of so small a graph, "expected OutputCode, got method".)"""

    def forward(self, x):
        y = x + 1
        print("tiny")
        y = y * 2
        print("tiny")
        return y - 1
'''

CHILD = r'''
import os, sys, time, json, statistics
t0 = time.perf_counter()
import torch
t_import = time.perf_counter() - t0
sys.path.insert(0, os.environ["BENCH_WORK"])
import bench_model as bm
mech = os.environ["BENCH_MECH"]
art = os.environ["BENCH_ARTIFACT"]
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
model, tiny = bm.Breaking().eval(), bm.Tiny().eval()
g = torch.Generator().manual_seed(1)
pos = torch.randn(2, 128, 256, generator=g).abs() + 0.1
neg = -pos
small = (torch.ones(4), -torch.ones(4) * 10)
if mech.startswith("precompile"):
    if mech != "precompile_save":
        with open(art, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
if mech == "eager":
    run, run_tiny = model, tiny
elif mech.startswith("cc"):
    from cachecompile import cache_compile
    run = cache_compile(model, fullgraph=False)
    run_tiny = cache_compile(tiny, fullgraph=False)
else:
    run, run_tiny = torch.compile(model), torch.compile(tiny)
with torch.no_grad():
    ok = True
    for x in (pos, neg):
        ok = ok and bool(torch.allclose(run(x), model(x), rtol=1e-4, atol=1e-4))
    for x in small:
        ok = ok and bool(torch.allclose(run_tiny(x), tiny(x)))
    if not ok:
        print("MISMATCH", [float((run(x) - model(x)).abs().max()) for x in (pos, neg)],
              file=sys.stderr)
    print("FIRST_OUTPUT", flush=True)
    if mech == "precompile_save":
        data, _ = torch.compiler.save_cache_artifacts()
        with open(art, "wb") as f:
            f.write(data)
    def per_call(fn, inputs, n):
        for i in range(5):
            fn(inputs[i % 2])
        times = []
        for i in range(n):
            t = time.perf_counter()
            fn(inputs[i % 2])
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    call_ms = per_call(run, (pos, neg), 40) * 1e3
    tiny_us = per_call(run_tiny, small, 400) * 1e6
frames = 0
if "torch._dynamo" in sys.modules:
    from torch._dynamo.utils import counters
    frames = int(counters["frames"]["total"])
print("RESULT " + json.dumps({"ok": ok, "import_torch_s": t_import, "call_ms": call_ms,
                              "tiny_us": tiny_us, "frames": frames,
                              "dynamo": "torch._dynamo" in sys.modules}), flush=True)
'''


def _dirs(work: Path, name: str) -> dict[str, str]:
    base = work / name
    out = {"TORCHINDUCTOR_CACHE_DIR": base / "inductor", "TRITON_CACHE_DIR": base / "triton",
           "TMPDIR": base / "tmp"}
    for d in out.values():
        d.mkdir(parents=True, exist_ok=True)
    return {k: str(v) for k, v in out.items()}


def run_child(work: Path, mech: str, run: int, extra: dict[str, str]) -> dict[str, Any]:
    producer = DIRS_OF.get(mech)
    if producer is not None and mech not in EMPTY_INDUCTOR:
        dirs = _dirs(work, f"{producer}-{run}")          # the producer's warm dirs
    elif mech in DIRS_OF.values():
        dirs = _dirs(work, f"{mech}-{run}")              # a producer: its consumers' dirs
    else:
        dirs = _dirs(work, f"{mech}-{run}-{time.monotonic_ns()}")   # empty
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_", "TORCH_COMPILE"))}
    env.update(dirs)
    env.update({"BENCH_WORK": str(work), "BENCH_MECH": mech,
                "BENCH_ARTIFACT": str(work / f"artifact-{run}.bin"),
                "CACHECOMPILE_DIR": str(work / f"store-{run}"),
                "PYTHONPATH": str(REPO), **extra})
    if mech.startswith("precompile"):
        env["TORCH_CACHING_PRECOMPILE"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=str(work),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    result: dict[str, Any] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("FIRST_OUTPUT") and first is None:
            first = time.perf_counter() - t0
        elif line.startswith("RESULT "):
            result = json.loads(line[7:])
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0 or first is None:
        raise SystemExit(f"{mech} failed:\n{err[-3000:]}")
    return {"mechanism": mech, "first_output_s": first, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=list(ORDER))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="Keep the work dir.")
    ap.add_argument("--summary", type=Path, default=None,
                    help="Only print the summary of an earlier --json file.")
    args = ap.parse_args()
    if args.summary is not None:
        summary(json.loads(args.summary.read_text()))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-graph-breaks-"))
    (work / "bench_model.py").write_text(MODEL)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.runs):
            for mech in ORDER:
                if mech not in args.only and mech not in DIRS_OF.values():
                    continue
                row = run_child(work, mech, r, {})
                rows.append(row)
                print(json.dumps(row), flush=True)
            for mech in ("precompile_warm", "cc_warm"):
                row = run_child(work, mech, r, {"BENCH_ACT": "sigmoid"})
                row["mechanism"] = mech + " (global changed)"
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


def summary(rows: list[dict[str, Any]]) -> None:
    """Medians per mechanism. ``after import``: the first output less the child's own
    ``import torch``, which every row pays and which a loaded machine stretches most."""
    eager = statistics.median(r["first_output_s"] for r in rows if r["mechanism"] == "eager")
    print(f"\n{'mechanism':36s} {'first output':>22s} {'over eager':>10s} {'after import':>12s} "
          f"{'per call':>9s} {'tiny call':>10s} {'frames':>6s} {'dynamo':>6s} ok")
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    for name in names:
        rs = [r for r in rows if r["mechanism"] == name]
        fo = [r["first_output_s"] for r in rs]
        med = statistics.median(fo)
        after = statistics.median(r["first_output_s"] - r["import_torch_s"] for r in rs)
        print(f"{name:36s} {med:7.2f} s ({min(fo):.2f}-{max(fo):.2f}) {med - eager:+9.2f}s "
              f"{after:10.2f} s "
              f"{statistics.median(r['call_ms'] for r in rs):7.2f}ms "
              f"{statistics.median(r['tiny_us'] for r in rs):8.1f}us "
              f"{max(r['frames'] for r in rs):6d} {str(any(r['dynamo'] for r in rs)):>6s} "
              f"{all(r['ok'] for r in rs)}")


if __name__ == "__main__":
    main()
