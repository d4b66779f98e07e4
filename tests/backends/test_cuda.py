"""CUDA: the same cold/warm contract on a GPU. Skipped cleanly where there is none.

Not exercised on the CI machine (no GPU). On CUDA the warm path loads Triton kernels
through Inductor's own AsyncCompile, so it is correct but imports torch._inductor and
relies on Triton's cache for binaries; this test checks hits and results, not imports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ccutil import Sandbox

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

SCRIPT = """
import torch
from cachecompile import cache_compile
from cachecompile.demo import models
m = models.MLP().cuda().eval()
cached = cache_compile(m.forward_impl)
x = models.make_mlp_input().cuda()
out = cached(x)
report({"event": cached.events[-1][0],
        "ok": bool(torch.allclose(out, m.forward_impl(x), rtol=1e-3, atol=1e-3))})
"""


def test_cuda_cold_then_warm(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    cold = box.run(SCRIPT)
    assert (cold["event"], cold["ok"]) == ("miss", True)
    warm = box.run(SCRIPT)
    assert (warm["event"], warm["ok"]) == ("hit", True)
