"""Repeated blocks: cold and warm, cached per block against the whole model, torch's
regional compilation and eager (docs/performance.md, "Repeated blocks").

Each run is a fresh process. ``cold`` starts from an empty cachecompile store and empty
Inductor caches; ``warm`` is the next process on the same store with new, empty Inductor
caches (what it does not load, it must compile, and g++ counts it). torch's regional
compilation (``block.compile()`` on each block) has no store: its "warm" run is a second
process on the same Inductor caches (FX graph and AOTAutograd caches), which still traces.

    python tools/bench_repeated_blocks.py --layers 8 32

Columns: time from the compile call to the first output (model built and eager output
computed before), the steady per-call time (median of 20), g++ invocations, and for the
cached runs the entries in the store and, for ``compile_repeated_blocks``, the entries
loaded from the store against the block instances served by one another's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

GXX = """#!/bin/sh
echo x >> "{log}"
exec g++ "$@"
"""


def child(kind: str, layers: int) -> None:
    import torch

    from cachecompile.demo import models

    torch.manual_seed(0)
    cfg = models.DecoderConfig(vocab=512, hidden=128, layers=layers, heads=4, seq=64, batch=2)
    m = models.build_decoder(cfg)
    toks = models.make_inputs(m)
    with torch.no_grad():
        want = m.prefill(toks)
    extra: dict[str, object] = {}
    t0 = time.perf_counter()
    if kind == "eager":
        run = m.prefill
    elif kind == "whole":
        from cachecompile import cache_compile

        run = cache_compile(m.prefill)
    elif kind == "blocks":
        from cachecompile import compile_repeated_blocks

        group = compile_repeated_blocks(m, blocks=["DecoderBlock"])
        run = m.prefill
    elif kind == "torch_regional":
        for blk in m.blocks:
            blk.compile(fullgraph=True)
        run = m.prefill
    else:
        raise SystemExit(f"unknown kind {kind}")
    with torch.no_grad():
        got = run(toks)
    first = time.perf_counter() - t0
    times = []
    with torch.no_grad():
        for _ in range(20):
            t = time.perf_counter()
            run(toks)
            times.append(time.perf_counter() - t)
    if kind == "blocks":
        extra = {"loads": group.loads, "reuses": group.reuses}
    print("RESULT " + json.dumps({
        "first_s": first, "call_ms": statistics.median(times) * 1e3,
        "ok": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4)), **extra}), flush=True)


def run_child(kind: str, layers: int, env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, str(layers)], env=env,
                          capture_output=True, text=True, check=False)
    lines = [x[7:] for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} {layers} failed:\n{proc.stderr[-4000:]}")
    out: dict[str, object] = json.loads(lines[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8])
    ap.add_argument("--child", nargs=2, metavar=("KIND", "LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]))
        return
    rows: list[tuple[str, Any, str, dict[str, object], int, int | str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n = 0

        def env(store: Path, log: Path, inductor: Path | None = None) -> dict[str, str]:
            nonlocal n
            n += 1
            base = inductor or root / f"inductor{n}"
            # One g++ wrapper per store: CXX (its path, size, mtime) is a key factor.
            gxx = store.parent / f"gxx-{store.name}"
            if not gxx.exists():  # written once: its mtime is keyed too
                gxx.write_text(GXX.format(log=root / "gxx.log"))
                gxx.chmod(0o755)
            (root / "gxx.log").unlink(missing_ok=True)
            e = {k: v for k, v in os.environ.items()
                 if not k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_"))}
            e.update(PYTHONPATH=str(REPO), CACHECOMPILE_DIR=str(store), CXX=str(gxx),
                     TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"),
                     TRITON_CACHE_DIR=str(base / "triton"), TMPDIR=str(base / "tmp"))
            for d in ("inductor", "triton", "tmp"):
                (base / d).mkdir(parents=True, exist_ok=True)
            return e

        def gxx_calls(log: Path) -> int:
            log = root / "gxx.log"
            return len(log.read_text().splitlines()) if log.exists() else 0

        def entries(store: Path) -> int:
            from cachecompile import store as store_mod

            return len(list(store_mod.open_store(store).entries())) if store.exists() else 0

        for layers in a.layers:
            rows.append(("eager", layers, "-", run_child("eager", layers,
                                                         env(root / "none", root / "none.log")),
                         0, "-"))
            for kind in ("whole", "blocks", "torch_regional"):
                store = root / f"store-{kind}-{layers}"
                shared = root / f"ind-{kind}-{layers}"
                for phase in ("cold", "warm"):
                    log = root / f"{kind}-{layers}-{phase}.log"
                    ind = shared if kind == "torch_regional" or phase == "cold" else None
                    r = run_child(kind, layers, env(store, log, ind))
                    rows.append((kind, layers, phase, r, gxx_calls(log),
                                 entries(store) if kind != "torch_regional" else "-"))
    print("| layers | how | run | first output | per call | g++ | entries | blocks loaded / reused |")
    print("|---|---|---|---|---|---|---|---|")
    names = {"eager": "eager", "whole": "cache_compile(model.prefill)",
             "blocks": "compile_repeated_blocks(model)",
             "torch_regional": "torch: block.compile() each"}
    for kind, layers, phase, r, g, ent in rows:
        lr = f"{r['loads']} / {r['reuses']}" if "loads" in r else "-"
        ok = "" if r["ok"] else " (WRONG)"
        print(f"| {layers} | {names[kind]} | {phase} | {r['first_s']:.2f} s{ok} | "
              f"{r['call_ms']:.2f} ms | {g} | {ent} | {lr} |")


if __name__ == "__main__":
    main()
