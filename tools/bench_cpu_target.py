"""What a named CPU target costs: the same model's Inductor kernels built for a level
against native, called in turn in one process.

    python tools/bench_cpu_target.py          # --targets native,x86-64-v3 --reps 15

The model is the demo's 2-layer decoder (``cachecompile.demo.models``); its ``prefill``
is cached once per target (``CACHECOMPILE_CPU_TARGET`` set before each
``cache_compile``, a fresh store and Inductor cache for the run). Each round calls every
target's compiled prefill ``--iters`` times, the targets in turn, so that a busy machine
slows them alike; the median over ``--reps`` rounds of the time per call is reported,
with the median over rounds of its time against the first target's in the same
round (paired, so that load that comes and goes cancels out). The kernels of each target are disassembled
(objdump, if installed) and their vector registers counted: ymm (AVX) and zmm (AVX-512).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def _registers(libs: list[Path]) -> dict[str, int] | None:
    if shutil.which("objdump") is None:
        return None
    counts = {"ymm": 0, "zmm": 0}
    for lib in libs:
        asm = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True,
                             check=True).stdout
        for reg in counts:
            counts[reg] += len(re.findall(rf"%{reg}\d", asm))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="native,x86-64-v3",
                    help="comma list; the first is the baseline (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=15, help="timing rounds (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=30, help="calls per round and target")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the kernels, not the scheduler)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]

    work = Path(tempfile.mkdtemp(prefix="bench-cpu-target-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    import torch

    from cachecompile import cache_compile
    from cachecompile.demo.models import build_decoder, demo_config, make_inputs
    from cachecompile.key import cpu
    from cachecompile.store import Hit, open_store

    torch.set_num_threads(args.threads)
    cfg = demo_config()
    tokens = make_inputs(cfg, seq=args.seq)
    fns: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    for t in targets:
        cpu.require(t)  # a level this CPU lacks cannot run here
        os.environ[cpu.ENV] = t
        model = build_decoder(cfg)
        fn = cache_compile(model.prefill, dynamic=False, cache_dir=str(work / "store"))
        t0 = time.perf_counter()
        with torch.no_grad():
            want = model.prefill(tokens)
            got = fn(tokens)
        compile_s[t] = time.perf_counter() - t0
        assert torch.allclose(got, want, atol=1e-4), f"{t}: the compiled prefill differs"
        fns[t] = fn

    per_call: dict[str, list[float]] = {t: [] for t in targets}
    with torch.no_grad():
        for _ in range(args.reps):
            for t in targets:
                fn = fns[t]
                fn(tokens)  # warm the caches of this target's kernels
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn(tokens)
                per_call[t].append((time.perf_counter() - t0) / args.iters * 1e3)

    st = open_store(work / "store")
    libs: dict[str, list[Path]] = {t: [] for t in targets}
    for info in st.entries():
        hit = st.get(info.key)
        if isinstance(hit, Hit):
            target = hit.entry.factors["backend"]["cpu"].get("target", cpu.NATIVE)
            libs.setdefault(target, []).extend(
                p for n, p in hit.entry.files.items() if n.startswith("kernels/"))
    base = per_call[targets[0]]
    rows = [{"target": t, "median_ms": round(statistics.median(per_call[t]), 3),
             "min_ms": round(min(per_call[t]), 3),
             # Paired: each round's time against the baseline's in the same round, so that
             # a load that comes and goes between rounds cancels out.
             "ratio": round(statistics.median(a / b for a, b in zip(per_call[t], base,
                                                                      strict=True)), 3),
             "compile_s": round(compile_s[t], 1), "kernels": len(libs.get(t, [])),
             "registers": _registers(libs.get(t, []))} for t in targets]
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    flags = cpu.cpu_flags()
    print(f"CPU: {cpu.native_identity()['model']}; avx512f={'avx512f' in flags}, "
          f"avx2={'avx2' in flags}; torch threads {args.threads}; "
          f"{args.reps} rounds x {args.iters} calls, prefill of {tuple(tokens.shape)}")
    print(f"{'target':12s} {'median ms':>10s} {'min ms':>8s} {'vs ' + targets[0]:>12s} "
          f"{'kernels':>8s}  registers")
    for r in rows:
        print(f"{r['target']:12s} {r['median_ms']:10.3f} {r['min_ms']:8.3f} "
              f"{r['ratio']:11.3f}x {r['kernels']:8d}  {r['registers']}")


if __name__ == "__main__":
    main()
