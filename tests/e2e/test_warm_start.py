"""A warm process neither traces nor compiles, and gives the cold process's results.

Real torch.compile with Inductor, in fresh processes. Each process gets new, empty
Inductor and Triton cache dirs and TMPDIR, so any kernel the warm process needed would
have to be compiled; a logging g++ (via CXX) counts compiler invocations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

SCRIPT = """
import sys, time, warnings
import torch
from cachecompile import cache_compile
from cachecompile.backends import inductor as inductor_adapter
from cachecompile.demo import models

# Programs compiled from source: at capture; never in a warm process (it loads the
# compiled program the entry stores).
compiled_sources = []
_compile_program = inductor_adapter._compile_program
def counting_compile(src, filename):
    compiled_sources.append(filename)
    return _compile_program(src, filename)
inductor_adapter._compile_program = counting_compile

class Served(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = models.build_decoder(models.demo_config(), seed=1)
        self.cached_prefill = cache_compile(self.prefill, dynamic=True)
        self.cached_decode = cache_compile(self.decode, dynamic=False)
    def prefill(self, tokens):
        return self.lm.prefill(tokens)
    def decode(self, tokens):
        return self.lm.decode(tokens)

torch.manual_seed(0)
served = Served().eval()
mlp = models.MLP().eval()
mlp_cached = cache_compile(mlp.forward_impl)
buf = models.BufferModule().eval()
buf_cached = cache_compile(buf.run, dynamic=False)

toks = models.make_inputs(served.lm, batch=2, seq=16, seed=3)
toks2 = models.make_inputs(served.lm, batch=2, seq=24, seed=4)
x = models.make_mlp_input()
xb = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))

results = {}
def check(name, got, want):
    results[name] = float((got - want).abs().max())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), name

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check("prefill16", served.cached_prefill(toks), served.prefill(toks))
    check("prefill24", served.cached_prefill(toks2), served.prefill(toks2))
    check("decode", served.cached_decode(toks), served.decode(toks))
    check("mlp", mlp_cached(x), mlp.forward_impl(x))
    check("buffer_kw", buf_cached(xb, scale=0.5, flag=True), buf.run(xb, scale=0.5, flag=True))
    check("buffer_default", buf_cached(xb), buf.run(xb))
events = {}
for name, fn in [("prefill", served.cached_prefill), ("decode", served.cached_decode),
                 ("mlp", mlp_cached), ("buffer", buf_cached)]:
    events[name] = [e[0] for e in fn.events]
report({"events": events, "diffs": results,
        "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
        "program_compiles": len(compiled_sources),
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]})
"""


def test_cold_then_warm_compiles_nothing(tmp_path: Path) -> None:
    # The compiler is the subject: empty Inductor dirs for both runs (ccutil.py).
    box = Sandbox(tmp_path, fresh_inductor=True)
    cold = box.run(SCRIPT)
    assert cold["events"] == {"prefill": ["miss"], "decode": ["miss"], "mlp": ["miss"],
                              "buffer": ["miss", "miss"]}, cold.value
    assert cold["warnings"] == []
    assert box.compiler_calls() > 0, "the cold run should have built kernels with g++"
    assert cold["program_compiles"] > 0

    box.reset_compiler_log()
    warm = box.run(SCRIPT)  # new empty Inductor/Triton/tmp dirs, same cachecompile store
    assert warm["events"] == {"prefill": ["hit"], "decode": ["hit"], "mlp": ["hit"],
                              "buffer": ["hit", "hit"]}, warm.value
    assert warm["warnings"] == []
    assert box.compiler_calls() == 0, box.gxx_log.read_text()
    assert warm["dynamo"] is False, "a warm process must not import torch._dynamo"
    assert warm["inductor"] is False, "a warm process must not import torch._inductor"
    assert warm["program_compiles"] == 0, "the warm process compiled a program's source"
    # Same kernels, same program: the warm results are the cold results.
    assert warm["diffs"] == cold["diffs"]


def test_inherited_kernel_env_pointer_does_not_crash(tmp_path: Path) -> None:
    """Inductor's kernels find a helper through an env var holding a pointer. A parent
    that loaded kernels passes its own value down; the warm child must not use it."""
    box = Sandbox(tmp_path)
    code = """
import torch
from cachecompile import cache_compile
from cachecompile.demo import models
m = models.MLP().eval()
out = cache_compile(m.forward_impl)(models.make_mlp_input())
report({"ok": bool(torch.allclose(out, m.forward_impl(models.make_mlp_input()), atol=1e-5))})
"""
    assert box.run(code)["ok"]
    stale = {"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "140000000000000"}
    res = box.run(code, check=False, environ=stale)
    assert res.rc == 0, f"warm child crashed with an inherited pointer (rc={res.rc})"
    assert res["ok"]
