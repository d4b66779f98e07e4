"""What each kind of backend gets from the cache: first output of a fresh process.

    python tools/bench_backends.py            # --reps 3 --layers 4

A transformers Llama (tiny config, random weights, no download) whose whole forward is
cached. Each run is a whole fresh process, timed from spawn to the first output (import,
build the model, first call), each with its own empty Inductor/tmp dirs:

* eager: no compile;
* a bare backend callable (a vendor-style FX pass, then the graph as it is): plain
  ``torch.compile(backend=fn)``, then ``cache_compile(backend=fn)`` cold (empty store)
  and warm (the store holds the entry: Dynamo's half is loaded, the backend runs);
* a registered adapter (``aot_eager``): ``cache_compile`` cold and warm (nothing traced,
  nothing compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
t0 = float(os.environ["BENCH_T0"])
import torch, transformers
from cachecompile import cache_compile

def silu_as_sigmoid_mul(gm, example_inputs):
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in (torch.nn.functional.silu,
                                                      torch._C._nn.silu):
            with gm.graph.inserting_before(n):
                sig = gm.graph.call_function(torch.sigmoid, (n.args[0],))
                mul = gm.graph.call_function(torch.mul, (n.args[0], sig))
            n.replace_all_uses_with(mul)
            gm.graph.erase_node(n)
    gm.recompile()
    return gm.forward

MODE = os.environ["BENCH_MODE"]

class Serve(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256,
                                       intermediate_size=512,
                                       num_hidden_layers=int(os.environ["BENCH_LAYERS"]),
                                       num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=256)
        self.lm = transformers.LlamaForCausalLM(cfg).eval()
        if MODE == "eager":
            self.fn = self._logits
        elif MODE == "compile-bare":
            self.fn = torch.compile(self._logits, backend=silu_as_sigmoid_mul, dynamic=True,
                                    fullgraph=True)
        elif MODE == "cache-bare":
            self.fn = cache_compile(self._logits, backend=silu_as_sigmoid_mul)
        else:
            self.fn = cache_compile(self._logits, backend="aot_eager")
    def _logits(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits

s = Serve()
ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out = s.fn(ids)
first = time.time() - t0
events = [e for e, _ in getattr(s.fn, "events", [])]
print("RESULT " + json.dumps({"first_s": first, "events": events}))
"""


def run(mode: str, store: Path, layers: int, base: Path) -> dict[str, object]:
    import time

    tmp = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=base))
    env = {**os.environ, "BENCH_MODE": mode, "BENCH_LAYERS": str(layers),
           "CACHECOMPILE_DIR": str(store), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
           "TMPDIR": str(tmp), "BENCH_T0": repr(time.time())}
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                       check=True)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return dict(json.loads(line[7:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as t:
        base = Path(t)
        for i in range(args.reps):
            order = [("eager", "eager", None), ("torch.compile(backend=fn)", "compile-bare", None),
                     ("cache_compile(backend=fn), cold", "cache-bare", "cold"),
                     ("cache_compile(backend=fn), warm", "cache-bare", "warm"),
                     ("cache_compile(backend='aot_eager'), cold", "cache-aot", "cold"),
                     ("cache_compile(backend='aot_eager'), warm", "cache-aot", "warm")]
            for name, mode, phase in order:
                store = base / f"store-{mode}-{i}"
                r = run(mode, store, args.layers, base)
                if phase == "warm":
                    assert r["events"] == ["hit"], (name, r)
                elif phase == "cold":
                    assert r["events"] == ["miss"], (name, r)
                rows.setdefault(name, []).append(float(r["first_s"]))  # type: ignore[arg-type]
    eager = statistics.median(rows["eager"])
    print(f"first output of a fresh process, tiny Llama ({args.layers} layers), "
          f"median of {args.reps}:")
    for name, xs in rows.items():
        med = statistics.median(xs)
        print(f"  {name:<42} {med:6.2f} s  ({med / eager:.2f}x eager)  "
              f"[{', '.join(f'{x:.2f}' for x in xs)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
