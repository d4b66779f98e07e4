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
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ccutil import Sandbox

from cachecompile.key.identity import global_name, identity, importable_name

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
    (tmp_path / "made.py").write_text(MADE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import made

    assert global_name(made.rotate) == "made.rotate"
    assert identity(made.scale, matched=True) == "named:made.scale"
    assert identity(made.rotate, matched=True) != identity(made.scale, matched=True)
    # Only the object a guard matches: in a closure or a default (a key's token) nothing
    # guards its state, so it stays keyed by its type there.
    assert identity(made.scale) is None and importable_name(made.scale) is None
    # One the module does not bind (made at run time, or its global rebound): no name.
    assert global_name(made.as_module(lambda x: x)) is None
    old = made.scale
    monkeypatch.setattr(made, "scale", made.as_module(lambda x: x))
    assert global_name(old) is None
    # An odd key in the namespace is passed over; one bound twice (an alias, or another
    # global rebound to it) has no name: the name alone would not tell them apart.
    monkeypatch.setitem(vars(made), 7, made.rotate)
    assert global_name(made.rotate) == "made.rotate"
    monkeypatch.setattr(made, "a_rotate", made.rotate, raising=False)
    assert global_name(made.rotate) is None
    # A namespace we cannot read: no name, no exception.
    monkeypatch.setitem(sys.modules, "made", object())
    assert global_name(made.rotate) is None


MADE = """
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
"""

# The real ``kernels`` decorators transformers 5.25 puts on every Llama-family attention:
# a function made into a hub ``Func`` module, and a class whose forward keys it by id().
# The frame reaches such an object four ways: through kernels' closure, a module global,
# a default argument and a class attribute.
HUB = """
import torch
from kernels import use_kernel_forward_from_hub, use_kernelized_func
from torch import nn


@use_kernel_forward_from_hub("CcRotate")
def rotate(x):
    return torch.cat((-x[..., 2:], x[..., :2]), dim=-1)


@use_kernel_forward_from_hub("CcScale")
def scale(x):
    return x * 3


@use_kernel_forward_from_hub("CcShift")
def shift(x):
    return x + 0.5


@use_kernelized_func(rotate)
class Attn(nn.Module):
    post = shift

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x, act=scale):
        y = self.lin(x)
        return rotate(y) + act(y) + scale(y) + Attn.post(y)
"""

HUB_RUN = """
import sys, torch, warnings
import hub
from cachecompile import cache_compile

m = hub.Attn().eval()
c = cache_compile(m.forward, backend={backend!r})
x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
ref = torch.compile(m.forward, backend={backend!r})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        if {change!r} == "global first":
            # Before the first call, a global the frame reads binds another hub object:
            # the spec is a fresh torch.compile, which traces it.
            hub.scale = hub.shift
        rows = [(c(x), m(x), ref(x))]
        # After the first call, in the process that loaded the entry: the function class
        # of the hub objects gets another forward (under compile kernels dispatches to the
        # function it wrapped, so torch.compile is not eager there: the spec is
        # torch.compile), or a global the frame reads binds another hub object (which
        # torch.compile's own cache serves stale, and a fresh compile as eager).
        if {change!r} == "forward":
            Func = type(hub.rotate)
            orig = Func.forward
            Func.forward = lambda self, *a: orig(self, *a) * 2
            rows.append((c(x), m(x), ref(x)))
        elif {change!r} == "global":
            hub.scale = hub.shift
            rows.append((c(x), m(x), ref(x)))
report({{"tc": [bool(torch.allclose(g, r)) for g, w, r in rows],
        "eager": [bool(torch.allclose(g, w)) for g, w, r in rows],
        "events": [e[0] for e in c.events], "dynamo": "torch._dynamo" in sys.modules,
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]}})
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_hub_kernel_module_object_is_served_warm(tmp_path: Path, backend: str) -> None:
    pytest.importorskip("kernels")
    box = Sandbox(tmp_path)
    (box.root / "hub.py").write_text(HUB)
    cold = box.run(HUB_RUN.format(backend=backend, change=""))
    assert cold["tc"] == cold["eager"] == [True] and cold["events"] == ["miss"], cold.value
    assert not cold["warnings"], cold.value
    # A hit, then torch.compile's result after the new forward (a miss: its code is
    # guarded), or a fresh compile's (eager's) once the global binds another object.
    warm = box.run(HUB_RUN.format(backend=backend, change="forward"))
    assert warm["tc"] == [True, True] and warm["eager"][0], warm.value
    assert warm["events"] == ["hit", "miss"], warm.value
    warm = box.run(HUB_RUN.format(backend=backend, change="global"))
    assert warm["tc"][0] and warm["eager"][0] and warm["events"][0] == "hit", warm.value
    assert warm["tc"][1] or warm["eager"][1], warm.value
    warm = box.run(HUB_RUN.format(backend=backend, change="global first"))
    assert warm["tc"] == warm["eager"] == [True] and "hit" not in warm["events"], warm.value


# An id() that reaches the result or the module's state, generated: what the id is of (a
# named function, a module's callable object, a class), and where the number goes (the
# result, a global dict's key, an attribute). Dynamo bakes the number into the program;
# another process's object has another, so none of these may be served from a store.
ID_OF = {"function": "plain", "object": "made.rotate", "class": "torch.nn.Linear"}
ID_GOES = {"result": "return x + (id({o}) % 997)",
           "key": "SEEN[id({o})] = 1\n    return x + 1",
           "attr": "STATE.last = id({o})\n    return x * 2"}
# The cases live in a module (a function of ``__main__`` is not cacheable for another
# reason: the builtins it reads could be shadowed there unguarded).
ESCAPE_CASES = """
import types
import torch
import made

SEEN = {{}}


class State:
    last = 0


STATE = State()


def plain(x):
    return x

{functions}

CASES = {{n: f for n, f in dict(globals()).items() if n.startswith("fn_")}}
"""

ESCAPE = """
import torch, warnings
import escape
from cachecompile import cache_compile

x = torch.ones(2)
out = {}
for name, fn in sorted(escape.CASES.items()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = cache_compile(fn, backend="aot_eager")
        got = c(x)
        state = (dict(escape.SEEN), escape.STATE.last)
        escape.SEEN.clear()
        escape.STATE.last = 0
        want = fn(x)
    out[name] = {"ok": bool(torch.equal(got, want))
                       and state == (dict(escape.SEEN), escape.STATE.last),
                 "events": [e[0] for e in c.events],
                 "said": any("reads its id()" in str(w.message) for w in caught)}
    escape.SEEN.clear()
    escape.STATE.last = 0
report(out)
"""


@pytest.mark.slow
def test_an_id_that_leaves_the_frame_is_never_served_from_the_store(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    (box.root / "made.py").write_text(MADE)
    functions = "\n".join(
        f"def fn_{of}_{goes}(x):\n    {body.format(o=obj)}\n"
        for of, obj in ID_OF.items() for goes, body in ID_GOES.items())
    (box.root / "escape.py").write_text(ESCAPE_CASES.format(functions=functions))
    for phase in ("cold", "warm"):
        res = box.run(ESCAPE).value
        assert len(res) == len(ID_OF) * len(ID_GOES), res
        bad = {n: r for n, r in res.items()
               if not r["ok"] or "hit" in r["events"] or not r["said"]}
        assert not bad, (phase, bad)


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
