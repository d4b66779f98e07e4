"""A frame that calls numpy, ``math`` or ``operator`` is served warm (issue 61).

Dynamo guards the identity of a numpy ufunc it traces (``ID_MATCH`` on ``np.tanh``). It had
no process-independent form, so such a method was compiled live in every process. A
callable that its module names (``numpy.tanh``: found again by importing ``numpy`` and
reading ``tanh``) now has one, checked on every call like any identity guard.

So has a callable object without a name of its own that its module binds at top level:
transformers 5.25 (with ``kernels``) turns ``apply_rotary_pos_emb`` into an instance of a
class made inside a decorator, and its attention's ``forward`` reads that instance's id()
through a closure. Every Llama-family model was compiled live in every process until the
object was named by the module global that holds it.
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


def test_a_callable_object_its_module_binds_is_named_by_that_global(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    (tmp_path / "hub_like.py").write_text(HUB_LIKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import hub_like

    assert importable_name(hub_like.rotate) == "hub_like.rotate"
    assert identity(hub_like.scale) == "named:hub_like.scale"
    assert identity(hub_like.rotate) != identity(hub_like.scale)
    # An alias binds the same object: the first name, sorted, whichever was read.
    monkeypatch.setattr(hub_like, "a_rotate", hub_like.rotate, raising=False)
    assert importable_name(hub_like.rotate) == "hub_like.a_rotate"
    # One the module does not bind (made at run time, or its global rebound): no name.
    assert importable_name(hub_like.as_module(lambda x: x)) is None
    old = hub_like.scale
    monkeypatch.setattr(hub_like, "scale", hub_like.as_module(lambda x: x))
    assert importable_name(old) is None


# A library's decorators as kernels' (transformers 5.25) are: a function made into an
# instance of a class defined inside the decorator, and a class whose forward reads that
# instance's id() through a closure, as a key into a global it sets and then clears. The
# frame reaches such objects four ways: a closure cell, a module global, a default
# argument and a class attribute.
HUB_LIKE = """
import torch
from torch import nn


def as_module(fn):
    class Func(nn.Module):
        def forward(self, *args):
            return fn(*args)

    Func.__module__ = fn.__module__
    return Func()


@as_module
def rotate(x):
    return torch.cat((-x[..., 2:], x[..., :2]), dim=-1)


@as_module
def scale(x):
    return x * 3


@as_module
def shift(x):
    return x + 0.5


ACTIVE = {}


def kernelized(*fns):
    def deco(cls):
        orig = cls.forward

        def forward(self, x):
            for fn in fns:
                ACTIVE[id(fn)] = fn
            try:
                return orig(self, x)
            finally:
                ACTIVE.clear()

        cls.forward = forward
        return cls
    return deco


@kernelized(rotate)
class Attn(nn.Module):
    post = shift

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x, act=scale):
        y = self.lin(x)
        return ACTIVE[id(rotate)](y) + act(y) + scale(y) + Attn.post(y)
"""

HUB_RUN = """
import sys, torch, warnings
import hub_like
from cachecompile import cache_compile

m = hub_like.Attn().eval()
c = cache_compile(m.forward, backend={backend!r})
x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
ref = torch.compile(m.forward, backend={backend!r})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        rows = [(c(x), m(x), ref(x))]
        if {change!r}:
            # After the first call, in the process that loaded the entry: the function
            # class of every such object gets another forward, as kernelize() would swap in.
            Func = type(hub_like.rotate)
            orig = Func.forward
            Func.forward = lambda self, *a: orig(self, *a) * 2
            rows.append((c(x), m(x), ref(x)))
report({{"ok": [bool(torch.allclose(g, w)) and bool(torch.allclose(r, w)) for g, w, r in rows],
        "events": [e[0] for e in c.events], "dynamo": "torch._dynamo" in sys.modules,
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]}})
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_hub_kernel_style_module_object_is_served_warm(tmp_path: Path, backend: str) -> None:
    box = Sandbox(tmp_path)
    (box.root / "hub_like.py").write_text(HUB_LIKE)
    cold = box.run(HUB_RUN.format(backend=backend, change=False))
    assert cold["ok"] == [True] and cold["events"] == ["miss"], cold.value
    assert not cold["warnings"], cold.value
    warm = box.run(HUB_RUN.format(backend=backend, change=True))
    # The change after the hit is a miss (its forward's code is guarded), eager's result.
    assert warm["ok"] == [True, True] and warm["events"][0] == "hit", warm.value
    assert warm["events"][1:] == ["miss"], warm.value


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
