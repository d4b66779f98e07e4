"""The main job: compile a bundled decoder LM cold, then warm in a fresh process.

    python -m cachecompile.demo [--keep | --workdir DIR]

Three fresh processes run the same script: eager (no compile), cache_compile cold
(empty cachecompile store, empty Inductor cache and TMPDIR: nothing compiled on disk)
and cache_compile warm (the cold run's store, but again EMPTY Inductor cache and
TMPDIR, so the warm process can only have its kernels from cachecompile). Each one
caches ``prefill`` (dynamic shapes) and ``decode`` (static shapes) separately, checks
its outputs against eager, and reports; this parent prints the comparison.

Time to first output is measured by this parent from spawning the child to the child's
"first output ready" line, so it includes interpreter start and ``import torch``.

Per-call latency is measured in the warm process, each cached call beside the same
method run eagerly, one after the other (eager, cached, eager, cached...), so that a
machine busy with other work slows both alike; it is reported as the fastest call (min)
and the 90th percentile (p90). When p90 is far above the min, the machine was busy while
timing: the demo says so, and the min is the number to compare.

While a child works the parent prints what it is doing (compiling takes minutes on a
busy machine). With ``--keep`` (or ``--workdir``) the store stays, and the demo ends
with the ``cachectl`` commands to look at it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachecompile.store import settings

FIRST = "cachecompile-demo: first output"
DONE = "cachecompile-demo: result "
PHASE = "cachecompile-demo: phase "

# p90 over min past this: the machine was busy while the demo timed the calls.
BUSY_SPREAD = 1.5
# How often a progress line is repeated when stdout is not a terminal (seconds).
PROGRESS_EVERY = 15.0


def _phase(text: str) -> None:
    print(PHASE + text, flush=True)


def _timed(calls: int, pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]]
           ) -> dict[str, dict[str, float]]:
    """Per name, (cached, eager) timed one after the other ``calls`` times after a warm-up:
    min and p90 of each, in milliseconds."""
    out: dict[str, dict[str, float]] = {}
    for name, (cached, eager) in pairs.items():
        for _ in range(3):
            cached()
            eager()
        samples: dict[str, list[float]] = {"cached": [], "eager": []}
        for _ in range(calls):
            for which, fn in (("eager", eager), ("cached", cached)):
                t = time.perf_counter()
                fn()
                samples[which].append((time.perf_counter() - t) * 1e3)
        out[name] = {f"{which}_{stat}": value for which, s in samples.items()
                     for stat, value in (("min", min(s)), ("p90", _p90(s)))}
    return out


def _p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10, method="inclusive")[-1] if len(samples) > 1 \
        else samples[0]


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
    doing = {"eager": "running", "cold": "compiling (Dynamo, Inductor, g++)",
             "warm": "loading from the cache"}[mode]
    with torch.inference_mode():
        _phase(f"{doing}: prefill")
        logits = model.cached_prefill(prompt)
        _phase(f"{doing}: decode")
        nxt = model.cached_decode(prompt)
    print(FIRST, flush=True)

    with torch.inference_mode():
        _phase("checking the outputs against eager")
        ref_prefill = model.prefill(prompt)
        ref_decode = model.decode(prompt)
        diff = max(float((logits - ref_prefill).abs().max()), float((nxt - ref_decode).abs().max()))
        ok = bool(torch.allclose(logits, ref_prefill, rtol=1e-4, atol=1e-4)
                  and torch.allclose(nxt, ref_decode, rtol=1e-4, atol=1e-4))
        # A second prefill length: dynamic=True serves it from the same entry.
        other = models.make_inputs(model.lm, batch=2, seq=48, seed=2)
        ok = ok and bool(torch.allclose(model.cached_prefill(other), model.prefill(other),
                                        rtol=1e-4, atol=1e-4))
        per_call: dict[str, dict[str, float]] = {}
        if mode == "warm":
            _phase(f"timing {calls} calls of each, beside eager")
            per_call = _timed(calls, {
                "prefill": (lambda: model.cached_prefill(prompt), lambda: model.prefill(prompt)),
                "decode": (lambda: model.cached_decode(prompt), lambda: model.decode(prompt))})
        result = {"mode": mode, "ok": ok, "max_abs_diff": diff, "per_call": per_call,
                  "events": {n: [e[0] for e in getattr(model, n).events]
                             for n in ("cached_prefill", "cached_decode")
                             if hasattr(getattr(model, n), "events")},
                  "dynamo_imported": runtime.dynamo_imported()}
    print(DONE + json.dumps(result), flush=True)


class _Progress:
    """One status line per child: rewritten in place on a terminal, else printed when
    the phase changes and every ``PROGRESS_EVERY`` seconds while it does not."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.tty = sys.stdout.isatty()
        self.t0 = time.perf_counter()
        self.phase = "starting Python and importing torch"
        self._said = ""
        self._said_at = 0.0

    def set(self, phase: str) -> None:
        self.phase = phase
        self.show(force=True)

    def show(self, force: bool = False) -> None:
        now = time.perf_counter()
        line = f"  {self.mode}: {self.phase} ... {now - self.t0:.0f} s"
        if self.tty:
            sys.stdout.write("\r" + line.ljust(len(self._said)))
            sys.stdout.flush()
            self._said = line
        elif force or now - self._said_at >= PROGRESS_EVERY:
            print(line, flush=True)
            self._said, self._said_at = line, now

    def done(self) -> None:
        line = f"  {self.mode}: done in {time.perf_counter() - self.t0:.1f} s"
        if self.tty:
            sys.stdout.write("\r" + line.ljust(len(self._said)) + "\n")
            sys.stdout.flush()
        else:
            print(line, flush=True)


def _run(mode: str, env: dict[str, str], calls: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "cachecompile.demo", "--child", mode,
                             "--calls", str(calls)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump(stream: Any) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout,), daemon=True).start()
    errors: list[str] = []
    drain = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    drain.start()
    first: float | None = None
    result: dict[str, Any] | None = None
    progress = _Progress(mode)
    progress.show(force=True)
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            progress.show()
            continue
        if line is None:
            break
        if line.startswith(PHASE):
            progress.set(line[len(PHASE):].strip())
        elif line.startswith(FIRST) and first is None:
            first = time.perf_counter() - t0
        elif line.startswith(DONE):
            result = json.loads(line[len(DONE):])
    rc = proc.wait()
    drain.join(timeout=5)
    if rc != 0 or result is None or first is None:
        raise SystemExit(f"demo child '{mode}' failed (exit {rc}):\n{''.join(errors)[-4000:]}")
    progress.done()
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


LABELS = {"eager": "eager (no compile)", "cold": "cache_compile cold",
          "warm": "cache_compile warm (fresh process)"}


def report(rows: list[dict[str, Any]]) -> list[str]:
    """The demo's tables and notes, as lines: the same rows and columns whatever the
    numbers (two runs on a busy machine differ in their numbers only)."""
    eager_first = rows[0]["first_output_s"]
    out = ["| run | time to first output | overhead over eager | matches eager | cache events |",
           "|---|---|---|---|---|"]
    for r in rows:
        events = ", ".join(f"{k.removeprefix('cached_')}: {'/'.join(v)}"
                           for k, v in r["events"].items()) or "-"
        out.append(f"| {LABELS[r['mode']]} | {r['first_output_s']:.2f} s | "
                   f"{r['first_output_s'] - eager_first:+.2f} s | "
                   f"{'yes' if r['ok'] else 'NO'} (max diff {r['max_abs_diff']:.1e}) | {events} |")
    warm = next(r for r in rows if r["mode"] == "warm")
    cold = next(r for r in rows if r["mode"] == "cold")
    per_call = warm["per_call"]
    out += ["", "Per call in the warm process, each cached call beside the same method run "
                "eagerly (ms):", "",
            "| call | cached min | cached p90 | eager min | eager p90 | cached / eager (min) |",
            "|---|---|---|---|---|---|"]
    spread = 1.0
    for name in ("prefill", "decode"):
        t = per_call[name]
        out.append(f"| {name} | {t['cached_min']:.2f} | {t['cached_p90']:.2f} | "
                   f"{t['eager_min']:.2f} | {t['eager_p90']:.2f} | "
                   f"{t['cached_min'] / t['eager_min']:.2f}x |")
        spread = max(spread, t["cached_p90"] / t["cached_min"], t["eager_p90"] / t["eager_min"])
    out.append("")
    saved = cold["first_output_s"] - warm["first_output_s"]
    out.append(f"The warm process reached its first output {saved:.1f} s sooner than the cold "
               f"one ({cold['first_output_s'] / warm['first_output_s']:.1f}x), "
               f"{warm['first_output_s'] - eager_first:+.2f} s from eager; it imported "
               f"torch._dynamo: {'yes' if warm['dynamo_imported'] else 'no'}.")
    if spread > BUSY_SPREAD:
        out.append(f"Note: the machine was busy while timing (p90 up to {spread:.1f}x the min"
                   f"{_load()}): compare the min columns, and time again on an idle "
                   "machine for steady numbers.")
    return out


def _load() -> str:
    try:
        one, _, _ = os.getloadavg()
    except OSError:
        return ""
    return f"; load average {one:.1f} on {os.cpu_count() or '?'} cores"


def _try_cachectl(store: Path, temp: bool) -> list[str]:
    """The cachectl commands to try on the kept store, with the demo's own keys."""
    from cachecompile.store import open_store

    keys = {i.labels.get("function", ""): i.key[:12]
            for i in open_store(store, remote="", create=False).entries()}
    prefill = keys.get("prefill", "KEY")
    d = f"--cache-dir {store}"
    return [f"The store is kept at {store}. Try:",
            f"  cachectl ls {d}",
            f"  cachectl show {prefill} {d}      # what the prefill entry serves, its guards",
            f"  cachectl explain {prefill} {d}   # what a call must be for it to serve",
            f"  cachectl program {prefill} {d}   # its guards, bytecode and program",
            f"  cachectl stats {d}",
            *([f"Remove it with: rm -rf {store.parent}"] if temp else [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachecompile.demo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=["eager", "cold", "warm"], help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=50,
                        help="timed calls of each method, cached and eager (default 50)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the store (in a temp dir) and print the cachectl commands "
                             "to look at it")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to keep the store and scratch dirs (kept; implies --keep)")
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.calls)
        return 0

    keep = args.keep or args.workdir is not None
    base = args.workdir or Path(tempfile.mkdtemp(prefix="cachecompile-demo-"))
    store = base / "store"
    try:
        print(f"cachecompile demo: bundled TinyDecoderLM, prefill (dynamic) + decode (static); "
              f"store {store}", flush=True)
        rows = [_run(mode, _fresh_env(base, mode, store), args.calls)
                for mode in ("eager", "cold", "warm")]
        print()
        for line in report(rows):
            print(line)
        print()
        if keep:
            for line in _try_cachectl(store, temp=args.workdir is None):
                print(line)
        else:
            print("Run with --keep (or --workdir DIR) to keep the store and try cachectl on it.")
        warm = rows[2]
        ok = all(r["ok"] for r in rows) and all(
            v and set(v) == {"hit"} for v in warm["events"].values())
        if not ok:
            print("FAILED: outputs differ from eager or the warm run missed the cache",
                  file=sys.stderr)
            return 1
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
