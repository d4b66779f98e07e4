"""Guard cost on a warm call, side by side in one process: eager, torch.compile (warm),
cache_compile with every guard on every call (``guards="always"``, the default) and with
``guards="first"``.

Each model's entry is compiled once (cold) into a temporary store; the cache_compile
mechanisms are then fresh wrappers that load it (a hit, as in a new process). Timings are
interleaved rounds of single calls, medians in microseconds, so that a loaded machine
slows every mechanism alike. Besides the whole call, the guard check alone: Dynamo's own
guard tree for torch.compile's entry against cache_compile's per-call check.

    python tools/bench_guards.py [--models gpt2,llama,decoder8,add] [--rounds 15] [--calls 200]
                                 [--dynamic]

"program alone" is the compiled graph by itself (Inductor's program, the same kernels both
mechanisms run), so that the last column compares what each call costs beyond it.

Prints a markdown table (the one in docs/performance.md, "Guards on every call"), and one
of each model's guard tree: guards, native leaves, managers skipped while the state is
unchanged, objects checked on every call, and the build time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo.models import LlmRunner, tokens  # needs the path above

from cachecompile import cache_compile


class AddOne(nn.Module):
    def add(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _timed(call: Callable[[], Any], n: int, reset: Callable[[], Any]) -> float:
    """Median of ``n`` single calls, ``reset()`` (untimed) every BLOCK calls."""
    samples = []
    for i in range(n):
        if i % BLOCK == 0:
            reset()
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


# Each decode call fills the next slot of the StaticCache (transformers counts the filled
# ones, and GPT-2's positions end at 64): empty it every BLOCK calls.
BLOCK = 24


def _dynamo_check(method: Any, frame_locals: dict[str, Any]) -> Callable[[], Any] | None:
    """Dynamo's own guard tree of ``method``'s compiled entry, as a callable."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(method.__func__.__code__)
        gm = entries[0].guard_manager
    except Exception:  # a release without it: the column says n/a
        return None
    if not gm.check(frame_locals):
        return None
    return lambda: gm.check(frame_locals)


def _cc_check(fn: Any, args: tuple[Any, ...]) -> Callable[[], Any] | None:
    """The check cache_compile runs on each call of ``fn``'s loaded variant."""
    variants = [v for vs in fn._runners.values() for v in vs]
    if not variants or variants[0].check is None:
        return None
    check = variants[0].check
    return lambda: check(*args)


def _program(fn: Any, args: tuple[Any, ...]) -> Callable[[], Any] | None:
    """The compiled graph alone (Inductor's program: its kernels and its own wrapper code),
    called with the inputs the loaded variant's bytecode passed it on one call. Both
    mechanisms run these kernels; what a call costs beyond them is each one's own path."""
    variants = [v for vs in fn._runners.values() for v in vs]
    g = getattr(getattr(variants[0].run, "__func__", None), "__globals__", None) \
        if variants else None
    names = [k for k in (dict.keys(g) if isinstance(g, dict) else ())
             if k.startswith("__compiled_fn")]
    if len(names) != 1:
        return None
    assert isinstance(g, dict)
    name = names[0]
    real = g[name]
    seen: list[tuple[Any, ...]] = []

    def spy(*a: Any) -> Any:
        seen.append(a)
        return real(*a)

    g[name] = spy
    try:
        fn(*args)
    finally:
        g[name] = real
    inputs = seen[0]
    return lambda: real(*inputs)


def model(name: str) -> tuple[Any, str, tuple[Any, ...], dict[str, Any], Any]:
    """(module, method name, args, the frame's locals by parameter name, a reset)."""
    if name == "add":
        m = AddOne()
        x = torch.zeros(4)
        return m, "add", (x,), {"self": m, "x": x}, lambda: None
    if name.startswith("decoder"):
        # A decoder of our own (cachecompile.demo), decoderN: N layers (decoder2: the
        # demo's size); its decode step on one token.
        from cachecompile.demo.models import DecoderConfig, build_decoder

        d = build_decoder(DecoderConfig(vocab=512, hidden=128, layers=int(name[7:]), heads=4,
                                        seq=64, batch=1)).eval()
        t = torch.randint(0, 512, (1, 1), generator=torch.Generator().manual_seed(0))
        return d, "decode", (t,), {"self": d, "tokens": t}, lambda: None
    r = LlmRunner(name).eval()
    cache = r.static_cache(BLOCK + 8, early=1)
    ids, pos = tokens(1, 1), torch.tensor([3])
    return r, "decode", (ids, pos, cache), {"self": r, "input_ids": ids,
                                            "cache_position": pos,
                                            "past_key_values": cache}, cache.reset


def _tree_facts(fn: Any) -> dict[str, Any]:
    """The loaded variant's guard tree: guards, native leaves, managers skipped while
    unchanged, objects checked on every call, build time."""
    variants = [v for vs in fn._runners.values() for v in vs]
    every = getattr(variants[0].check, "__func__", None) if variants else None
    tree = getattr(every, "tree", None)
    if tree is None:
        return {}
    return {"guards": tree.n_native + tree.n_python, "native": tree.n_native,
            "skipped managers": tree.skipped, "frontier": tree.frontier,
            "build ms": round(tree.build_ms, 1),
            # More than one: state changed under the tree during the run (a re-arm).
            "builds": getattr(every, "_builds", "n/a")}


def bench(name: str, rounds: int, calls: int, store: Path, dynamic: bool = False
          ) -> tuple[dict[str, float | None], dict[str, Any]]:
    """Medians per mechanism (us), and the facts of cache_compile's guard tree. Both
    mechanisms compile with the same ``dynamic``."""
    m, meth, args, frame_locals, reset = model(name)
    method = getattr(m, meth)
    with torch.no_grad():
        compiled = torch.compile(method, fullgraph=True, dynamic=dynamic)
        compiled(*args)
        cache_compile(method, dynamic=dynamic, cache_dir=store)(*args)  # cold: publishes
        first = cache_compile(method, dynamic=dynamic, cache_dir=store, guards="first")
        always = cache_compile(method, dynamic=dynamic, cache_dir=store, guards="always")
        first(*args)
        always(*args)
        assert [e for e, _ in first.events] == ["hit"] == [e for e, _ in always.events]
        reset()
        mechs: dict[str, Callable[[], Any] | None] = {
            "eager": lambda: method(*args),
            "torch.compile": lambda: compiled(*args),
            "cc always": lambda: always(*args),
            "cc first": lambda: first(*args),
            "guards: Dynamo tree": _dynamo_check(method, frame_locals),
            "guards: cc always": _cc_check(always, args),
            "program alone": _program(always, args),
        }
        samples: dict[str, list[float]] = {k: [] for k, v in mechs.items() if v is not None}
        for _ in range(rounds):
            for k, call in mechs.items():
                if call is not None:
                    samples[k].append(_timed(call, calls, reset))
        facts = _tree_facts(always)
    return {k: (statistics.median(samples[k]) if k in samples else None) for k in mechs}, facts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,llama,decoder8,add")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--dynamic", action="store_true",
                   help="compile both with dynamic=True (as a prefill is cached): Dynamo then "
                        "passes a module's float attributes to the graph as tensors")
    p.add_argument("--config-reads-exact", action="store_true",
                   help="as before issue 33's decision: transformers' config reads are "
                        "checked by calling PretrainedConfig.__getattribute__ on every call, "
                        "not pinned by the dicts that decide them (the 'before' column)")
    a = p.parse_args()
    if a.config_reads_exact:
        from cachecompile.entry import guard_kinds

        guard_kinds._config_getattribute = lambda: None
    rows = []
    trees: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-guards-") as d:
        for name in a.models.split(","):
            times, facts = bench(name, a.rounds, a.calls, Path(d) / name, a.dynamic)
            rows.append((name, times))
            trees.append((name, facts))
    cols = list(rows[0][1])
    print(f"torch {torch.__version__}; dynamic={a.dynamic}; medians of {a.rounds} "
          f"interleaved rounds of {a.calls} calls, us")
    print("| model | " + " | ".join(cols) + " | cc always / torch.compile | "
          "cc guards / Dynamo's | beyond the program: cc always / torch.compile |")
    print("|---" * (len(cols) + 4) + "|")
    for name, r in rows:
        def us(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1f}"

        tc, al = r.get("torch.compile"), r.get("cc always")
        gd, gc = r.get("guards: Dynamo tree"), r.get("guards: cc always")
        ratio = f"{al / tc:.2f}" if tc and al else "n/a"
        gratio = f"{gc / gd:.2f}" if gd and gc else "n/a"
        pr = r.get("program alone")
        beyond = (f"{al - pr:.1f} / {tc - pr:.1f} = {(al - pr) / (tc - pr):.2f}"
                  if tc and al and pr and tc > pr else "n/a")
        print(f"| {name} | " + " | ".join(us(r[c]) for c in cols)
              + f" | {ratio} | {gratio} | {beyond} |")
    keys = next((list(f) for _, f in trees if f), [])
    if keys:
        print()
        print("| model | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for name, f in trees:
            print(f"| {name} | " + " | ".join(str(f.get(k, "n/a")) for k in keys) + " |")


if __name__ == "__main__":
    main()
