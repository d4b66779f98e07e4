"""Training: time to the first optimizer step of WHOLE FRESH PROCESSES, and the step time.

Each row is a new Python process. The parent times it from ``Popen`` to the child's line
saying that its first optimizer step is done (forward, ``loss.backward()``, AdamW); the
child then runs more steps and reports their median, its losses (as hex floats: the
mechanisms that compile the same programs must give the same bits), how many graphs
Dynamo traced and whether it imported Inductor's compiler.

Models (``--models``), tiny configs built in code, random weights, no downloads:
  lm     transformers Llama (hidden 256, 4 layers, seq 64, batch 2), next-token loss
  vit    transformers ViT (hidden 128, 4 layers, 32x32 images, patch 8), cross entropy
  unet   diffusers UNet2DConditionModel (tests/zoo's), MSE against the noise

Mechanisms, in this order, per model (``--only``; D: True for lm and vit, False for
the UNet, see DYNAMIC):
  eager          the step as written
  compile_cold   ``torch.compile(model.forward, dynamic=D)``, empty Inductor dirs
  compile_warm   the same, in the dirs compile_cold left (FX graph and AOTAutograd caches)
  cc_cold        ``cache_compile(model.forward, dynamic=D)``, empty dirs and store
  cc_warm        the store cc_cold left, empty Inductor dirs

Usage:
  python tools/bench_training.py --runs 2 --json bench-out/training.json
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
ORDER = ("eager", "compile_cold", "compile_warm", "cc_cold", "cc_warm")
DIRS_OF = {"compile_warm": "compile_cold", "cc_warm": "cc_cold"}
EMPTY_INDUCTOR = {"cc_warm"}
MODELS = ("lm", "vit", "unet")
# dynamic= per model, the same for torch.compile and cache_compile: the UNet's backward
# fails in Inductor with dynamic shapes (torch 2.13: "cannot determine truth value of
# Relational"), in plain torch.compile as in cache_compile.
DYNAMIC = {"lm": True, "vit": True, "unet": False}

CHILD = r'''
import os, sys, time, json, statistics
import torch
sys.path.insert(0, os.path.join(os.environ["BENCH_REPO"], "tests"))
mech, kind = os.environ["BENCH_MECH"], os.environ["BENCH_MODEL"]
dynamic = os.environ["BENCH_DYNAMIC"] == "1"
torch.manual_seed(0)
if kind == "lm":
    from zoo.models import LlmRunner, tokens
    model = LlmRunner("llama", hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4).model.train()
    ids = tokens(2, 64)
    args, kwargs = (), {"input_ids": ids, "labels": ids, "use_cache": False}
    loss_of = lambda out: out.loss
elif kind == "vit":
    import transformers
    cfg = transformers.ViTConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=256, image_size=32, patch_size=8,
                                 num_labels=10)
    model = transformers.ViTForImageClassification(cfg).train()
    g = torch.Generator().manual_seed(1)
    kwargs = {"pixel_values": torch.randn(8, 3, 32, 32, generator=g),
              "labels": torch.randint(0, 10, (8,), generator=g)}
    args = ()
    loss_of = lambda out: out.loss
else:
    from zoo.models import UNetRunner, unet_inputs
    model = UNetRunner().unet.train()
    latents, t, context = unet_inputs(2)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(5))
    args, kwargs = (latents, t), {"encoder_hidden_states": context}
    loss_of = lambda out: (out.sample - noise).square().mean()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
if mech == "eager":
    fn = model.forward
elif mech.startswith("cc"):
    from cachecompile import cache_compile
    fn = cache_compile(model.forward, dynamic=dynamic)
else:
    fn = torch.compile(model.forward, dynamic=dynamic)

def step():
    opt.zero_grad()
    loss = loss_of(fn(*args, **kwargs))
    loss.backward()
    opt.step()
    return float(loss)

losses = [step()]
print("FIRST_STEP", flush=True)
times = []
for _ in range(int(os.environ.get("BENCH_STEPS", "5"))):
    t0 = time.perf_counter()
    losses.append(step())
    times.append(time.perf_counter() - t0)
frames = 0   # graphs Dynamo captured (its "frames" counter misses fullgraph's)
utils = sys.modules.get("torch._dynamo.utils")
if utils is not None:
    frames = int(utils.counters["stats"]["unique_graphs"])
print("RESULT " + json.dumps({"step_ms": 1000 * statistics.median(times),
                              "losses": [x.hex() for x in losses], "frames": frames,
                              "inductor": "torch._inductor.compile_fx" in sys.modules}),
      flush=True)
'''


def run_child(mech: str, model: str, work: Path, producer_dirs: Path, steps: int,
              timeout: float) -> dict[str, Any]:
    dirs = work / f"dirs-{model}-{mech}-{time.monotonic_ns()}"
    base = producer_dirs if mech in DIRS_OF and mech not in EMPTY_INDUCTOR else dirs
    for sub in ("inductor", "triton", "tmp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_"))}
    env.update(BENCH_MECH=mech, BENCH_MODEL=model, BENCH_REPO=str(REPO),
               BENCH_DYNAMIC="1" if DYNAMIC[model] else "0",
               BENCH_STEPS=str(steps), PYTHONPATH=str(REPO),
               TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"),
               TRITON_CACHE_DIR=str(base / "triton"), TMPDIR=str(base / "tmp"),
               CACHECOMPILE_DIR=str(work / f"store-{model}"))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = None
    result: dict[str, Any] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("FIRST_STEP") and first is None:
            first = time.perf_counter() - t0
        elif line.startswith("RESULT "):
            result = json.loads(line[7:])
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{model}/{mech} failed (rc {proc.returncode}):\n{err[-3000:]}")
    return {"first_step_s": first, "dirs": str(base), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="steps timed after the first")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--only", default=",".join(ORDER))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    mechs = [m for m in ORDER if m in a.only.split(",")]
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for model in a.models.split(","):
        rows[model] = {m: [] for m in mechs}
        for _ in range(a.runs):
            work = Path(tempfile.mkdtemp(prefix="bench-training-"))
            made: dict[str, Path] = {}
            try:
                for mech in mechs:
                    producer = made.get(DIRS_OF.get(mech, ""), work / "none")
                    r = run_child(mech, model, work, producer, a.steps, a.timeout)
                    made[mech] = Path(r["dirs"])
                    rows[model][mech].append(r)
                    print(f"{model:5} {mech:13} first step {r['first_step_s']:7.2f} s  "
                          f"step {r['step_ms']:8.2f} ms  frames {r['frames']}", flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    print()
    print("| model | mechanism | first step (median, min-max) | step | graphs traced | Inductor "
          "imported | losses as torch.compile's |")
    print("|---|---|---|---|---|---|---|")
    for model, by in rows.items():
        ref = [r["losses"] for r in by.get("compile_cold", [])]
        for mech, rs in by.items():
            firsts = [r["first_step_s"] for r in rs]
            same = "" if mech == "eager" or not ref else \
                ("yes" if all(r["losses"] == ref[0] for r in rs) else "**no**")
            print(f"| {model} | {mech} | {statistics.median(firsts):.2f} s "
                  f"({min(firsts):.2f}-{max(firsts):.2f}) | "
                  f"{statistics.median(r['step_ms'] for r in rs):.1f} ms | "
                  f"{rs[0]['frames']} | {'yes' if rs[0]['inductor'] else 'no'} | {same} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
