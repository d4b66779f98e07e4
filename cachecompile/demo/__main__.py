"""The main job: compile a bundled decoder LM cold, then warm in a fresh process.

    python -m cachecompile.demo

Three fresh processes run the same script: eager (no compile), cache_compile cold
(empty cachecompile store, empty Inductor cache and TMPDIR: nothing compiled on disk)
and cache_compile warm (the cold run's store, but again EMPTY Inductor cache and
TMPDIR, so the warm process can only have its kernels from cachecompile). Each one
caches ``prefill`` (dynamic shapes) and ``decode`` (static shapes) separately, checks
its outputs against eager, and reports; this parent prints the comparison.

Time to first output is measured by this parent from spawning the child to the child's
"first output ready" line, so it includes interpreter start and ``import torch``.
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

from cachecompile.store import settings

FIRST = "cachecompile-demo: first output"
DONE = "cachecompile-demo: result "


def _child(mode: str, calls: int) -> None:
    import torch

    from cachecompile import cache_compile
    from cachecompile._torch import runtime
    from cachecompile.demo import models

    class Served(torch.nn.Module):
        """How a serving stack uses cache_compile: cached prefill and decode methods."""

        def __init__(self, cached: bool) -> None:
            super().__init__()
            self.lm = models.build_decoder(models.demo_config(), seed=0)
            self.cached_prefill: Any
            self.cached_decode: Any
            if cached:
                self.cached_prefill = cache_compile(self.prefill, dynamic=True)
                self.cached_decode = cache_compile(self.decode, dynamic=False)
            else:
                self.cached_prefill = self.prefill
                self.cached_decode = self.decode

        def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.lm.prefill(tokens)

        def decode(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.lm.decode(tokens)

    model = Served(cached=mode != "eager").eval()
    prompt = models.make_inputs(model.lm, batch=2, seq=32, seed=1)
    with torch.inference_mode():
        logits = model.cached_prefill(prompt)
        nxt = model.cached_decode(prompt)
    print(FIRST, flush=True)

    with torch.inference_mode():
        ref_prefill = model.prefill(prompt)
        ref_decode = model.decode(prompt)
        diff = max(float((logits - ref_prefill).abs().max()), float((nxt - ref_decode).abs().max()))
        ok = bool(torch.allclose(logits, ref_prefill, rtol=1e-4, atol=1e-4)
                  and torch.allclose(nxt, ref_decode, rtol=1e-4, atol=1e-4))
        # A second prefill length: dynamic=True serves it from the same entry.
        other = models.make_inputs(model.lm, batch=2, seq=48, seed=2)
        ok = ok and bool(torch.allclose(model.cached_prefill(other), model.prefill(other),
                                        rtol=1e-4, atol=1e-4))

        def per_call(fn: Any, arg: torch.Tensor) -> float:
            for _ in range(3):
                fn(arg)
            samples = []
            for _ in range(calls):
                t = time.perf_counter()
                fn(arg)
                samples.append(time.perf_counter() - t)
            return statistics.median(samples)

        result = {"mode": mode, "ok": ok, "max_abs_diff": diff,
                  "prefill_ms": per_call(model.cached_prefill, prompt) * 1e3,
                  "decode_ms": per_call(model.cached_decode, prompt) * 1e3,
                  "events": {n: [e[0] for e in getattr(model, n).events]
                             for n in ("cached_prefill", "cached_decode")
                             if hasattr(getattr(model, n), "events")},
                  "dynamo_imported": runtime.dynamo_imported()}
    print(DONE + json.dumps(result), flush=True)


def _run(mode: str, env: dict[str, str], calls: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "cachecompile.demo", "--child", mode,
                             "--calls", str(calls)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first: float | None = None
    result: dict[str, Any] | None = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(FIRST) and first is None:
            first = time.perf_counter() - t0
        elif line.startswith(DONE):
            result = json.loads(line[len(DONE):])
    stderr = proc.stderr.read() if proc.stderr else ""
    rc = proc.wait()
    if rc != 0 or result is None or first is None:
        raise SystemExit(f"demo child '{mode}' failed (exit {rc}):\n{stderr[-4000:]}")
    result["first_output_s"] = first
    return result


def _fresh_env(base: Path, name: str, store: Path) -> dict[str, str]:
    env = dict(os.environ)
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                     ("TMPDIR", "tmp")):
        d = base / name / sub
        d.mkdir(parents=True, exist_ok=True)
        env[var] = str(d)
    env[settings.DIR.name] = str(store)
    env.pop(settings.DISABLE.name, None)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=["eager", "cold", "warm"], help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=50, help="calls per latency sample")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to keep the store and scratch dirs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.calls)
        return 0

    with tempfile.TemporaryDirectory(prefix="cachecompile-demo-") as tmp:
        base = args.workdir or Path(tmp)
        store = base / "store"
        print(f"cachecompile demo: bundled TinyDecoderLM, prefill (dynamic) + decode (static); "
              f"store {store}", flush=True)
        rows = []
        for mode in ("eager", "cold", "warm"):
            print(f"  running {mode} in a fresh process ...", flush=True)
            rows.append(_run(mode, _fresh_env(base, mode, store), args.calls))
        eager_first = rows[0]["first_output_s"]
        print()
        print("| run | time to first output | overhead over eager | prefill / call | "
              "decode / call | matches eager | cache events |")
        print("|---|---|---|---|---|---|---|")
        labels = {"eager": "eager (no compile)", "cold": "cache_compile cold",
                  "warm": "cache_compile warm (fresh process)"}
        for r in rows:
            events = ", ".join(f"{k.removeprefix('cached_')}: {'/'.join(v)}"
                               for k, v in r["events"].items()) or "-"
            print(f"| {labels[r['mode']]} | {r['first_output_s']:.2f} s | "
                  f"{r['first_output_s'] - eager_first:+.2f} s | {r['prefill_ms']:.2f} ms | "
                  f"{r['decode_ms']:.2f} ms | {'yes' if r['ok'] else 'NO'} "
                  f"(max diff {r['max_abs_diff']:.1e}) | {events} |")
        cold, warm = rows[1], rows[2]
        saved = cold["first_output_s"] - warm["first_output_s"]
        print()
        print(f"The warm process reached its first output {saved:.1f} s sooner than the cold one "
              f"({cold['first_output_s'] / warm['first_output_s']:.1f}x), "
              f"{warm['first_output_s'] - eager_first:+.2f} s from eager; it imported "
              f"torch._dynamo: {'yes' if warm['dynamo_imported'] else 'no'}.")
        ok = all(r["ok"] for r in rows) and all(
            v and set(v) == {"hit"} for v in warm["events"].values())
        if not ok:
            print("FAILED: outputs differ from eager or the warm run missed the cache",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
