"""Training steps cached like inference calls (issue 64): forward and backward compiled
once, served by a fresh process that neither traces nor compiles.

The spec is torch.compile itself: each test runs the same steps three times, in fresh
processes over one store, on one thread (torch.compile repeats its bits there): plain ``torch.compile`` (the reference), cachecompile cold (it
compiles and stores), cachecompile warm (it loads). Losses and every parameter after each
optimizer step are compared bit for bit, as hex floats and SHA-256 of the bytes.

* a tiny Llama (transformers, one decoder layer: a second is the same kernels again),
  5 AdamW steps on Inductor, data parallel on two ranks under torchrun: one compile for
  the job; the restarted job runs no g++, traces no graph and never imports Inductor's
  compiler;
* the forms a training step takes (a graph break, activation checkpointing, dropout,
  bf16 autocast), on aot_eager;
* state changed after the first call in a process that loaded the entries, on Inductor
  and aot_eager: a parameter frozen and thawed, eval under no_grad, an input that
  requires grad, and one change the cold process never saw (a miss that compiles);
* what is not cached yet (a training graph that mutates a buffer) runs with
  torch.compile and says so.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ccutil import GXX_LOG_ENV, Sandbox

from cachecompile import CacheFaultWarning, cache_compile

HELPERS = r'''
import hashlib, os, sys, torch
from cachecompile import cache_compile

# One thread: Inductor's parallel scatter-add (an embedding's backward) sums in a
# different order from run to run, so torch.compile itself would not repeat its bits.
torch.set_num_threads(1)

def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

def gxx_calls():
    log = os.environ.get({log_env!r}, "")
    return len(open(log).read().splitlines()) if log and os.path.exists(log) else 0

def traced():
    """Graphs Dynamo captured in this process (its "frames" counter misses fullgraph's)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0

def step(fn, model, opt, *args, **kwargs):
    opt.zero_grad()
    loss = fn(*args, **kwargs)
    loss.backward()
    opt.step()
    return [float(loss).hex(), digest(model)]
'''


def _run(sb: Sandbox, driver: str, phase: str, **kw: Any) -> dict[str, Any]:
    code = HELPERS.format(log_env=GXX_LOG_ENV) + driver.replace("@PHASE@", repr(phase))
    out: dict[str, Any] = sb.run(code, **kw).value
    return out


FORMS = r'''
from torch.utils.checkpoint import checkpoint

class Net(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.25)

    def block(self, h):
        return torch.tanh(self.a(h))

    def forward(self, x):
        if self.form == "checkpoint":
            h = checkpoint(self.block, x, use_reentrant=False)
        else:
            h = self.block(x)
        if self.form == "break":
            torch._dynamo.graph_break()
            h = h * 2
        if self.form == "dropout":
            h = self.drop(h)
        return self.b(h).square().mean()

phase = @PHASE@
x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
out, events = {}, {}
for form in ("break", "checkpoint", "dropout", "autocast"):
    net = Net(form)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    fn = torch.compile(net, backend="aot_eager") if phase == "plain" else \
        cache_compile(net, backend="aot_eager")
    torch.manual_seed(2)   # dropout's masks: the same draws in every process
    rows = []
    for _ in range(3):
        if form == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rows.append(step(fn, net, opt, x))
        else:
            rows.append(step(fn, net, opt, x))
    out[form] = rows
    events[form] = [e for e, _ in fn.cached_forward.events] if phase != "plain" else []
report({"steps": out, "events": events, "traced": traced()})
'''


def test_training_forms_served_warm_as_torch_compile_runs_them(tmp_path: Path) -> None:
    sb = Sandbox(tmp_path)
    plain = _run(sb, FORMS, "plain")
    cold = _run(sb, FORMS, "cold")
    warm = _run(sb, FORMS, "warm")
    for form, rows in plain["steps"].items():
        assert cold["steps"][form] == rows, f"{form}: cold differs from torch.compile"
        assert warm["steps"][form] == rows, f"{form}: warm differs from torch.compile"
        assert cold["events"][form] == ["miss"], (form, cold["events"])
        assert warm["events"][form] == ["hit"], (form, warm["events"])
    assert cold["traced"] > 0 and warm["traced"] == 0, "the warm process traced"


STATES = r'''
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).square().mean()

phase, backend = @PHASE@, BACKEND
net = Net()
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
fn = torch.compile(net.forward, backend=backend, dynamic=False, fullgraph=True) \
    if phase == "plain" else cache_compile(net.forward, backend=backend, dynamic=False)
x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
rows, gxx = [], []
g0 = gxx_calls()

def grads():
    return [p.grad is not None for p in net.parameters()]

def record(what):
    rows.append(what)
    gxx.append(gxx_calls() - g0)

record(step(fn, net, opt, x))
record(step(fn, net, opt, x))
net.a.weight.requires_grad_(False)           # frozen after a training call
record(step(fn, net, opt, x) + grads())
net.a.weight.requires_grad_(True)            # and thawed
record(step(fn, net, opt, x) + grads())
net.eval()
with torch.no_grad():                        # inference, under no_grad
    out = fn(x)
record([float(out).hex(), out.requires_grad])
net.train()
xg = x.clone().requires_grad_()              # an input that requires grad
loss = fn(xg)
loss.backward()
record([float(loss).hex(), xg.grad.sum().item().hex(), grads()])
if phase != "cold":                          # what the cold process never saw: a miss
    net.b.bias.requires_grad_(False)
    record(step(fn, net, opt, x) + grads())
report({"rows": rows, "gxx": gxx, "events": [e for e, _ in getattr(fn, "events", [])]})
'''


@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=pytest.mark.slow),
                                     "aot_eager"])
def test_state_changed_after_training_hits_is_torch_compiles(tmp_path: Path,
                                                              backend: str) -> None:
    """Every guard the entries rely on, changed in a process that loaded them: each call
    is served by the variant whose guards hold (requires_grad of each parameter and
    input, grad mode, train/eval), equal to torch.compile on the same steps."""
    driver = STATES.replace("BACKEND", repr(backend))
    sb = Sandbox(tmp_path)
    plain = _run(sb, driver, "plain")
    cold = _run(sb, driver, "cold")
    warm = _run(sb, driver, "warm", fresh_inductor=True)
    assert cold["rows"] == plain["rows"][:-1], "the cold process differs from torch.compile"
    assert warm["rows"] == plain["rows"], "the warm process differs from torch.compile"
    assert plain["rows"][2][-4:] == [False, True, True, True], "a.weight had no grad"
    assert set(cold["events"]) == {"miss"}, cold["events"]
    # Every variant the cold process stored is a hit; the new state a miss that compiles.
    assert warm["events"] == ["hit"] * (len(cold["events"])) + ["miss"], warm["events"]
    if backend == "inductor":
        assert warm["gxx"][-2] == 0 and warm["gxx"][-1] > 0, warm["gxx"]


class BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)).square().mean()


def test_a_training_graph_that_mutates_a_buffer_runs_with_torch_compile(cache_dir: Path) -> None:
    """BatchNorm in training updates its running stats (an input mutated): not cached
    yet; the call runs with torch.compile, says why once, and trains as eager does."""
    net, ref = BatchNormNet(), BatchNormNet()
    cached = cache_compile(net.forward, backend="aot_eager", cache_dir=cache_dir)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = cached(x)
    faults = [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)]
    assert len(faults) == 1 and "mutates an input" in faults[0], faults
    loss.backward()
    want = ref(x)
    want.backward()
    assert torch.allclose(loss, want)
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    mean, want_mean = net.bn.running_mean, ref.bn.running_mean
    assert mean is not None and want_mean is not None and torch.equal(mean, want_mean)
    assert not list(cache_dir.rglob("manifest.json")), "nothing was stored"


DP_JOB = r'''
import json
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

import transformers
torch.manual_seed(0)                         # every rank starts from the same weights
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, attn_implementation="sdpa")
net = transformers.LlamaForCausalLM(cfg).train()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
fn = torch.compile(net.forward, dynamic=True, fullgraph=True) \
    if os.environ["PHASE"] == "plain" else cache_compile(net.forward)   # TorchAir's default
g0 = gxx_calls()
g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the data
rows = []
for _ in range(5):
    ids = torch.randint(0, 128, (2, 16), generator=g)
    opt.zero_grad()
    loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    for p in net.parameters():               # data parallel: the mean gradient
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    rows.append([float(loss).hex(), digest(net)])
fx = {}
if "torch._dynamo.utils" in sys.modules:   # torch.optim imports Dynamo itself
    from torch._dynamo.utils import counters
    fx = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache_")}
with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "rows": rows, "fx": fx, "frames": traced(),
               "gxx": gxx_calls() - g0,
               "events": [e for e, _ in getattr(fn, "events", [])],
               "inductor": "torch._inductor.compile_fx" in sys.modules}, f)
dist.destroy_process_group()
os._exit(0)   # as tests/procs/test_ranks.py: gloo's teardown may abort after a clean run
'''


def _dp_job(sb: Sandbox, phase: str, **kw: Any) -> list[dict[str, Any]]:
    import json
    import subprocess
    import sys
    import time

    script = sb.root / "dp_job.py"
    # HELPERS: one thread (bit-equal runs), digest(), traced(), gxx_calls().
    script.write_text(HELPERS.format(log_env=GXX_LOG_ENV) + DP_JOB)
    out = sb.root / f"results{time.monotonic_ns()}"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(script)],
                          env=sb.env(RESULT_DIR=str(out), PHASE=phase, **kw),
                          capture_output=True, text=True, timeout=600, cwd=sb.root)
    results = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    assert proc.returncode == 0 and len(results) == 2, proc.stdout + proc.stderr[-5000:]
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.longest
def test_a_data_parallel_llama_job_compiles_once_and_its_restart_nothing(tmp_path: Path) -> None:
    """Issue 64's first two checks in one job: a tiny Llama (transformers) on two ranks under
    torchrun (gloo), data parallel, 5 AdamW steps with TorchAir's default (dynamic=True,
    fullgraph). One rank compiles its forward and backward, the other loads them (one
    compile for the job); the restarted job, in empty Inductor dirs, runs no g++, traces
    no graph and never imports Inductor's compiler; every loss and every parameter after
    every step, on each rank, bit-equal to torch.compile's job. (The single-process run of
    the same Llama was a test of its own: its checks are these, on one rank of two.)

    The cold job compiles in empty Inductor dirs; torch.compile's job runs after it on the
    same dirs, as a user's second job would: each of its ranks traces the graphs again and
    takes Inductor's programs from its FX graph cache. Run first, its two ranks each built
    every kernel at once, both cores for ~40 s (issue 65: ~23 s of CPU less this way)."""
    sb = Sandbox(tmp_path)
    dirs = sb.fresh_inductor_dirs()
    cold = _dp_job(sb, "cold", **dirs)
    assert sorted(e for r in cold for e in r["events"]) == ["miss", "shared"], cold
    assert sum(sum(r["fx"].values()) for r in cold) == 2, "one forward and one backward for the job"
    assert all(r["frames"] > 0 for r in cold), "the count of traced graphs counts"
    assert sum(r["gxx"] for r in cold) > 0, "the count of g++ calls counts"
    plain = _dp_job(sb, "plain", **dirs)
    # Each rank compiled its forward and backward, both from the cold job's FX graph cache
    # (were they misses, the reference would still hold, at twice the CPU).
    assert all(r["fx"] == {"fxgraph_cache_hit": 2} for r in plain), plain
    warm = _dp_job(sb, "warm", fresh_inductor=True)
    assert all(r["events"] == ["hit"] and r["frames"] == 0 and not r["inductor"]
               and r["gxx"] == 0 for r in warm), warm
    for ref, c, w in zip(plain, cold, warm, strict=True):
        assert c["rows"] == ref["rows"] and w["rows"] == ref["rows"], (ref, c, w)
    assert len({row[0] for row in plain[0]["rows"]}) == 5, "the loss moved every step"
    assert plain[0]["rows"][-1][1] == plain[1]["rows"][-1][1], "the ranks stay in step"


class Cubic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).pow(3).sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_retain_graph_create_graph_and_double_backward_on_a_hit(cache_dir: Path,
                                                                 backend: str) -> None:
    """On a loaded entry (a second cached function over the store: a hit), as
    torch.compile's first backward allows them: retain_graph=True twice, create_graph=True,
    and a double backward refused in torch's words."""
    m = Cubic()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    cache_compile(m.forward, backend=backend, cache_dir=cache_dir)(x).backward()
    fn = cache_compile(m.forward, backend=backend, cache_dir=cache_dir)
    (want,) = torch.autograd.grad(m(x), x)

    y = fn(x)
    assert [e for e, _ in fn.events] == ["hit"]
    x.grad = None
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad is not None and torch.allclose(x.grad, 2 * want, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(fn(x), x, create_graph=True)
    assert g.requires_grad and torch.allclose(g, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        g.sum().backward()
