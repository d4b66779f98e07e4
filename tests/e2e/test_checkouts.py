"""Two checkouts of the same model at different paths share one cache, and an edit in
one checkout's helper module is a miss there (dependencies are keyed by module name,
not by absolute path, so each checkout checks its own files). Neither evicts the other's
entry: each hits the variant its own files match."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

HELPER = "def act(x):\n    return x.tanh()\n"
MODEL = """
import torch
from torch import nn
import cohelper

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
    def run(self, x):
        return cohelper.act(self.lin(x))
"""
RUN = """
import sys, torch
sys.path.insert(0, {src!r})
import comodel
from cachecompile import cache_compile
m = comodel.Net().eval()
cached = cache_compile(m.run, backend="aot_eager")
x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out = cached(x)
    ok = bool(torch.allclose(out, m.run(x)))
report({{"event": cached.events[-1][0], "ok": ok}})
"""


def test_second_checkout_checks_its_own_helper(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    a, b = tmp_path / "checkout_a", tmp_path / "checkout_b"
    for d in (a, b):
        d.mkdir()
        (d / "cohelper.py").write_text(HELPER)
        (d / "comodel.py").write_text(MODEL)
    assert box.run(RUN.format(src=str(a)))["event"] == "miss"
    same = box.run(RUN.format(src=str(b)))
    assert same.value == {"event": "hit", "ok": True}, "an identical checkout shares entries"
    (b / "cohelper.py").write_text(HELPER.replace("tanh", "sigmoid"))
    shutil.rmtree(b / "__pycache__", ignore_errors=True)
    edited = box.run(RUN.format(src=str(b)))
    assert edited["ok"] and edited["event"] in ("miss", "shared"), edited.value
    # Both stay: each checkout hits the variant its own files match.
    assert box.run(RUN.format(src=str(a)))["event"] == "hit"
    assert box.run(RUN.format(src=str(b)))["event"] == "hit"
