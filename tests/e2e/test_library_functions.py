"""A frame that calls numpy, ``math`` or ``operator`` is served warm (issue 61).

Dynamo guards the identity of a numpy ufunc it traces (``ID_MATCH`` on ``np.tanh``). It had
no process-independent form, so such a method was compiled live in every process. A
callable that its module names (``numpy.tanh``: found again by importing ``numpy`` and
reading ``tanh``) now has one, checked on every call like any identity guard.
"""

from __future__ import annotations

import math
import operator
from pathlib import Path

import numpy as np
import pytest
import torch
from ccutil import Sandbox

from cachecompile.key.identity import identity, importable_name

MODEL = '''
import math, operator, os
import numpy as np
import torch
import torch
from torch import nn

act = np.tanh if os.environ.get("ACT", "tanh") == "tanh" else np.sin


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > -1e9:           # a graph break: what follows is a resume frame
            y = y + 1
        a = act(np.float32(0.5))
        return y * float(a) + math.sqrt(2.0) + operator.mul(2.0, 3.0)
'''

RUN = '''
import sys, torch, warnings
import model
from cachecompile import cache_compile
m = model.Net().eval()
c = cache_compile(m, backend="inductor", fullgraph=False)
x = torch.ones(2, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        got, want = c(x), m(x)
report({"ok": bool(torch.allclose(got, want)), "events": [e[0] for e in c._class_cached.events],
        "dynamo": "torch._dynamo" in sys.modules,
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]})
'''


def test_named_callables_have_an_identity() -> None:
    assert importable_name(np.tanh) == "numpy.tanh"
    assert identity(np.tanh) == "named:numpy.tanh"
    assert identity(math.sqrt) and identity(operator.mul)
    assert identity(np.tanh) != identity(np.sin)

    class Local:
        def __call__(self) -> None: ...

    assert importable_name(Local()) is None           # no module attribute of that name
    assert importable_name(lambda: 0) is None
    assert importable_name(3) is None                  # not callable


@pytest.mark.slow
def test_a_frame_calling_numpy_math_and_operator_is_served_warm(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    (box.root / "model.py").write_text(MODEL)
    cold = box.run(RUN)
    assert cold["ok"] and cold["events"] == ["miss"] and not cold["warnings"], cold.value
    box.reset_compiler_log()
    warm = box.run(RUN, fresh_inductor=True)
    assert warm["ok"] and warm["events"] == ["hit"], warm.value
    assert warm["dynamo"] is False and not warm["warnings"], warm.value
    assert box.compiler_calls() == 0, box.gxx_log.read_text()
    # Another ufunc there: its identity guard fails, eager's result, never the stored one.
    other = box.run(RUN, ACT="sin")
    assert other["ok"], other.value


class NumpyArg(torch.nn.Module):
    """Takes a numpy array (BigBird's block-sparse attention makes its random blocks so):
    Dynamo guards it as ``___from_numpy(L['a'])``, a tensor made anew at each read."""

    def forward(self, x: torch.Tensor, a: np.ndarray) -> torch.Tensor:
        return x * np.sum(a) + torch.from_numpy(np.tanh(a)).float()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_numpy_array_argument_is_cached(tmp_path: Path, backend: str) -> None:
    """torch's own guard builder fails on it whenever guards are built twice (any
    guard_filter_fn: ``torch.compile(f, options={"guard_filter_fn": ...})`` raises
    InternalTorchDynamoError, "Boolean value of Tensor ... is ambiguous"), which every
    capture is. A capture must bear it: compiled, stored, then served, as torch.compile."""
    from cachecompile import cache_compile

    m = NumpyArg()
    x = torch.randn(3)
    for want_event in ("miss", "hit"):
        c = cache_compile(m, backend=backend, cache_dir=tmp_path / "cc")
        with torch.no_grad():
            for a in (np.arange(3.0), np.arange(3.0) + 1):
                torch.testing.assert_close(c(x, a), m(x, a))
        assert [e for e, _ in c.events] == [want_event], c.events
