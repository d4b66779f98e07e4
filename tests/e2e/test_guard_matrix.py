"""The guard matrix: one cross-process case per kind of fact Dynamo guards.

Each case is a small module whose method reads one kind of state (a constant in another
module, a private attribute, a dict value, a function attribute, autocast, a tensor
subclass, a shape relation, ...). ``GM_CHANGE=1`` changes exactly that state before
the first call. The processes, each fresh and over one store:

1. cold, unchanged: every case compiles and publishes;
2. warm, unchanged: every case hits;
3. warm, changed: every case misses, the log names the guard that failed in the user's
   terms, and the output equals eager (a second variant is published);
4. warm, changed again: every case hits the second variant;
5. warm, unchanged: every case still hits the first.

Every call's output is compared with eager in the same process. The matrix runs on
``aot_eager`` and on the default backend, ``inductor``: the guards are Dynamo's either
way, but what a backend makes of one graph may differ (autocast: the same graph, another
program), and so may what is shared between variants.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from ccutil import Sandbox

pytestmark = [pytest.mark.slow, pytest.mark.longest]

HELPER = """
K = 3
"""

CASES = r'''
import dataclasses, functools, os, types, typing
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
import gm_helper

CHANGED = os.environ.get("GM_CHANGE") == "1"
if CHANGED:
    gm_helper.K = 4

ACT = "relu"
if CHANGED:
    ACT = "tanh"          # a module global reassigned before the first call
SCALE = float(os.environ.get("GM_SCALE", "2.0"))


class Base(nn.Module):
    dynamic = True
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
    def inputs(self):
        return (torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),)


class OtherModuleConst(Base):
    """an int constant read from another module"""
    expect = "gm_helper.K"
    def run(self, x):
        return self.lin(x) * gm_helper.K


class GlobalReassigned(Base):
    """a module global (str) reassigned before the first call"""
    expect = "ACT"
    def run(self, x):
        return getattr(torch, ACT)(self.lin(x))


class GlobalFromEnv(Base):
    """a float global computed from an env var"""
    expect = "SCALE"
    dynamic = False
    def run(self, x):
        return self.lin(x) * SCALE


class EnvReadWhileUnset(Base):
    """an environment variable read in the method, unset when traced and set later"""
    expect = "environment variable GM_FLAG is unset (got '1')"
    def run(self, x):
        if os.environ.get("GM_FLAG") == "1":
            return self.lin(x) * 2
        return self.lin(x)


class PrivateAttr(Base):
    expect = "self._k"
    def __init__(self):
        super().__init__()
        self._k = 3 if CHANGED else 2
    def run(self, x):
        return self.lin(x) * self._k


class DictValue(Base):
    expect = "self.opts['mode']"
    def __init__(self):
        super().__init__()
        self.opts = {"mode": "b" if CHANGED else "a"}
    def run(self, x):
        y = self.lin(x)
        return y + 1 if self.opts["mode"] == "a" else y - 1


class ListOfLists(Base):
    expect = "self.table"
    def __init__(self):
        super().__init__()
        self.table = [[1, 2], [3, 5 if CHANGED else 4]]
    def run(self, x):
        return self.lin(x) * self.table[1][1]


class NamespaceConfig(Base):
    expect = "self.cfg.act"
    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(act="silu" if CHANGED else "relu")
    def run(self, x):
        return F.relu(self.lin(x)) if self.cfg.act == "relu" else F.silu(self.lin(x))


class PlainCfg:
    def __init__(self, width):
        self.width = width


class PlainObjectConfig(Base):
    expect = "self.cfg.width"
    def __init__(self):
        super().__init__()
        self.cfg = PlainCfg(2 if CHANGED else 3)
    def run(self, x):
        return self.lin(x)[:, : self.cfg.width]


@dataclasses.dataclass
class DCfg:
    eps: float = 1e-5
    act: str = "gelu"


class DataclassConfig(Base):
    expect = "self.cfg.act"
    def __init__(self):
        super().__init__()
        self.cfg = DCfg(act="tanh" if CHANGED else "gelu")
    def run(self, x):
        return getattr(F, self.cfg.act)(self.lin(x)) if self.cfg.act == "gelu" else torch.tanh(self.lin(x))


class ClassAttr(Base):
    expect = "FLAG"
    FLAG = False
    def run(self, x):
        return self.lin(x) + (1 if type(self).FLAG else 0)


if CHANGED:
    ClassAttr.FLAG = True


class DtypeAttr(Base):
    expect = "self.out_dtype"
    def __init__(self):
        super().__init__()
        self.out_dtype = torch.float64 if CHANGED else torch.float32
    def run(self, x):
        return self.lin(x).to(self.out_dtype)


class FunctionAttr(Base):
    expect = "self.act"
    def __init__(self):
        super().__init__()
        self.act = F.silu if CHANGED else F.relu
    def run(self, x):
        return self.act(self.lin(x))


class PartialKeywords(Base):
    expect = "self.clip"
    # A float keyword: some releases and backends (torch 2.15 with Inductor) lift it into
    # a graph input instead of specialising on it, so the changed value may hit the same
    # entry and be read live: right, as the output check shows.
    may_lift = True
    def __init__(self):
        super().__init__()
        self.clip = functools.partial(torch.clamp, min=-0.1 if CHANGED else 0.0)
    def run(self, x):
        return self.clip(self.lin(x))


class InstanceMethodPatched(Base):
    expect = "helper"
    def helper(self, y):
        return y * 2
    def run(self, x):
        return self.helper(self.lin(x))


class ClassMethodPatched(Base):
    # The code of the module's classes is a key factor (module.classes), so a patched class
    # method misses by the key, named as that factor, before any guard is checked.
    expect = "module.classes"
    def helper(self, y):
        return y * 2
    def run(self, x):
        return self.helper(self.lin(x))


if CHANGED:
    ClassMethodPatched.helper = lambda self, y: y * 3


class UnderAutocast(Base):
    expect = "global torch state"
    ctx = "autocast"
    def run(self, x):
        return self.lin(x)


class Doubler(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.Tensor.add else out


class UnderFunctionMode(Base):
    expect = "torch function modes"
    ctx = "mode"
    def run(self, x):
        return self.lin(x).add(1)


class SubclassInput(Base):
    """a tensor-subclass input (a Parameter) where a plain tensor was traced"""
    expect = "(got Parameter float32[3,4]"
    def inputs(self):
        x = super().inputs()[0]
        return (nn.Parameter(x, requires_grad=False) if CHANGED else x,)
    def run(self, x):
        return self.lin(x) + 1


class AliasedInputs(Base):
    expect = "alias"
    def inputs(self):
        a = torch.ones(3, 4)
        return (a, a) if CHANGED else (a, torch.ones(3, 4))
    def run(self, a, b):
        a.add_(1)
        return a + b


class OverlappingViews(Base):
    """two views of one buffer, both written: Dynamo's identity guard passes them"""
    expect = "share memory"
    def inputs(self):
        if CHANGED:
            buf = torch.zeros(6)
            return (buf[0:4], buf[2:6])
        return (torch.zeros(4), torch.zeros(4))
    def run(self, a, b):
        a.add_(1)
        b.mul_(2)
        return a + b


class EqualSizesThenNot(Base):
    expect = "size()"
    def inputs(self):
        g = torch.Generator().manual_seed(2)
        return (torch.randn(3, 4, generator=g), torch.randn(5 if CHANGED else 3, 4, generator=g))
    def run(self, a, b):
        return self.lin(a).sum(0) + self.lin(b).sum(0)


class ShapeBranch(Base):
    expect = "size()[0]"
    def inputs(self):
        return (torch.randn(12 if CHANGED else 3, 4, generator=torch.Generator().manual_seed(3)),)
    def run(self, x):
        return self.lin(x) + 1 if x.shape[0] > 8 else self.lin(x) - 1


class TensorAttrReshaped(Base):
    expect = "self.table"
    def __init__(self):
        super().__init__()
        self.table = torch.ones(2, 4) if CHANGED else torch.ones(1, 4)
    def run(self, x):
        return self.lin(x) + self.table.sum(0)


class KVState:
    """state on a non-module object (a KV-cache-like holder)"""
    def __init__(self, n):
        self.keys = torch.zeros(n, 4)


class NonModuleTensorState(Base):
    # Static: under dynamic=True Dynamo makes the rows symbolic and reuses the graph.
    expect = "self.kv.keys"
    dynamic = False
    def __init__(self):
        super().__init__()
        self.kv = KVState(6 if CHANGED else 5)
    def run(self, x):
        self.kv.keys[: x.shape[0]] = x
        return self.lin(self.kv.keys)


def scaled(mode):
    """A functools.wraps decorator whose closure holds a value (as HF's decorators do)."""
    def deco(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            return out * 2 if mode == "double" else out * 3
        return inner
    return deco


class DecoratedMethod(Base):
    """a decorated method whose wrapper's closure value changed"""
    expect = "mode"
    @scaled("triple" if CHANGED else "double")
    def run(self, x):
        return self.lin(x)


@dataclasses.dataclass
class AttnMeta:
    lengths: torch.Tensor
    mode: str


class DataclassArgument(Base):
    """a dataclass argument: its tensor is a graph input, its str field is keyed"""
    expect = "signature"   # strings are values in the signature, so the key differs
    def inputs(self):
        x = super().inputs()[0]
        return (x, AttnMeta(torch.tensor([1.0, 2.0, 3.0]), "b" if CHANGED else "a"))
    def run(self, x, meta):
        y = self.lin(x) * meta.lengths[:, None]
        return y + 1 if meta.mode == "a" else y - 1


class Pos(typing.NamedTuple):
    offset: torch.Tensor
    scale: int


class NamedTupleArgument(Base):
    """a NamedTuple argument whose int field (dynamic) the method branches on"""
    expect = "pos.scale"
    def inputs(self):
        x = super().inputs()[0]
        return (x, Pos(torch.ones(4), 3 if CHANGED else 2))
    def run(self, x, pos):
        y = (self.lin(x) + pos.offset) * pos.scale
        return y + 1 if pos.scale > 2 else y - 1


class ScaledBase(Base):
    K = 2.0


class SubclassShadowsBase(ScaledBase):
    """a class attribute a subclass sets over its base's (absent when traced)"""
    # torch 2.15's Dynamo guards the subclass's dict itself ("'K' not in dict(...)"), which
    # fails before ours ("... has no class attribute 'K'"): either names the attribute.
    expect = "'K'"
    def run(self, x):
        return self.lin(x) * self.K


if CHANGED:
    SubclassShadowsBase.K = 5.0


class ActBase:
    act = "relu"


class ActConfig(ActBase):
    pass


if CHANGED:
    ActConfig.act = "tanh"


class ConfigClassShadows(Base):
    """a config object's class gains an attribute its base held (absent when traced)"""
    expect = "'act'"   # as above: Dynamo's guard on 2.15, ours on 2.13 and 2.14
    def __init__(self):
        super().__init__()
        self.cfg = ActConfig()
    def run(self, x):
        return getattr(torch, self.cfg.act)(self.lin(x))


if CHANGED:
    def abs(x):           # a module global that shadows the builtin the method calls
        return x * 100


class BuiltinShadowed(Base):
    """a builtin the method calls, shadowed by a module global (absent when traced)"""
    expect = "abs is not defined"
    def run(self, x):
        return abs(self.lin(x))


ALL = [OtherModuleConst, GlobalReassigned, GlobalFromEnv, EnvReadWhileUnset, PrivateAttr,
       DictValue, ListOfLists, NamespaceConfig, PlainObjectConfig, DataclassConfig, ClassAttr,
       DtypeAttr, FunctionAttr, PartialKeywords, InstanceMethodPatched, ClassMethodPatched,
       UnderAutocast, UnderFunctionMode, SubclassInput, AliasedInputs, OverlappingViews,
       EqualSizesThenNot,
       ShapeBranch, TensorAttrReshaped, NonModuleTensorState, DecoratedMethod,
       DataclassArgument, NamedTupleArgument, SubclassShadowsBase, ConfigClassShadows,
       BuiltinShadowed]
'''

DRIVER = r'''
import contextlib, logging, os, types, warnings
import torch
import gm_cases
from cachecompile import cache_compile

records = []
class H(logging.Handler):
    def emit(self, r):
        records.append(r.getMessage())
logging.getLogger("cachecompile").addHandler(H())
logging.getLogger("cachecompile").setLevel(logging.INFO)
changed = gm_cases.CHANGED
out = {}
before = set(vars(gm_cases))
for cls in gm_cases.ALL:
    m = cls().eval()
    if changed and cls.__name__ == "InstanceMethodPatched":
        m.helper = types.MethodType(lambda self, y: y * 5, m)
    cached = cache_compile(m.run, backend=os.environ["GM_BACKEND"], dynamic=cls.dynamic)
    ctx = contextlib.nullcontext()
    if getattr(cls, "ctx", None) == "autocast" and changed:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    elif getattr(cls, "ctx", None) == "mode" and changed:
        ctx = gm_cases.Doubler()
    n0 = len(records)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), ctx:
        warnings.simplefilter("always")
        got = cached(*m.inputs())
        want = getattr(m, "run")(*m.inputs())
    ok = (got.dtype == want.dtype and got.shape == want.shape
          and torch.allclose(got.float(), want.float(), atol=1e-5) and type(got) is type(want))
    out[cls.__name__] = {"event": cached.events[-1][0], "ok": bool(ok), "expect": cls.expect,
                         "may_lift": getattr(cls, "may_lift", False),
                         "log": records[n0:], "warnings": [str(w.message) for w in caught]}
# Names added to the user's module globals (Dynamo adds its own when it compiles live;
# a process that only hits must add none).
out["__leaked__"] = sorted(set(vars(gm_cases)) - before)
report(out)
'''


def _run(box: Sandbox, changed: bool, backend: str) -> dict[str, dict]:
    env = {"GM_CHANGE": "1" if changed else "0", "GM_BACKEND": backend}
    if changed:
        env["GM_SCALE"] = "3.0"
        env["GM_FLAG"] = "1"
    return box.run(DRIVER, environ=env).value


CASE_NAMES = [
    "OtherModuleConst", "GlobalReassigned", "GlobalFromEnv", "EnvReadWhileUnset",
    "PrivateAttr", "DictValue",
    "ListOfLists", "NamespaceConfig", "PlainObjectConfig", "DataclassConfig", "ClassAttr",
    "DtypeAttr", "FunctionAttr", "PartialKeywords", "InstanceMethodPatched",
    "ClassMethodPatched", "UnderAutocast", "UnderFunctionMode", "SubclassInput",
    "AliasedInputs", "OverlappingViews", "EqualSizesThenNot", "ShapeBranch", "TensorAttrReshaped",
    "NonModuleTensorState", "DecoratedMethod", "DataclassArgument", "NamedTupleArgument",
    "SubclassShadowsBase", "ConfigClassShadows", "BuiltinShadowed",
]


def _build(root: Path, backend: str) -> dict[str, dict[str, dict]]:
    (root / "gm_helper.py").write_text(textwrap.dedent(HELPER))
    (root / "gm_cases.py").write_text(CASES)
    box = Sandbox(root)
    return {phase: _run(box, changed, backend) for phase, changed in (
        ("cold", False), ("warm", False), ("changed", True), ("changed2", True),
        ("back", False))}


def _case_problems(matrix: dict[str, dict[str, dict]], case: str) -> list[str]:
    """What is wrong with one case across the five processes (empty: it holds)."""
    cold, warm = matrix["cold"][case], matrix["warm"][case]
    changed, changed2, back = (matrix["changed"][case], matrix["changed2"][case],
                               matrix["back"][case])
    bad = [f"{name}: output differs from eager: {r}" for name, r in (
        ("cold", cold), ("warm", warm), ("changed", changed), ("changed2", changed2),
        ("back", back)) if not r["ok"]]
    if cold["event"] not in ("miss", "shared"):
        bad.append(f"cold: {cold}")
    if warm["event"] != "hit":
        bad.append(f"warm: not a hit: {warm}")
    if changed["event"] == "hit" and changed["may_lift"]:
        # The value is a graph input here: the same entry serves both, read live (the
        # outputs equal eager's, checked above).
        if not (changed2["event"] == "hit" and back["event"] == "hit"):
            bad.append(f"lifted value: {changed2} {back}")
        return bad
    # A real change is a miss (compiled again, or live where it is not cacheable) ...
    if changed["event"] not in ("miss", "shared"):
        bad.append(f"changed: not a miss: {changed}")
    # ... whose log line names the guard that failed (or the key factor that differs).
    failed = [line for line in changed["log"]
              if "guard failed" in line or "differs in: " in line]
    if not any(changed["expect"] in line for line in failed):
        bad.append(f"changed: no log line names {changed['expect']!r}: {failed or changed['log']}")
    if back["event"] != "hit":
        bad.append(f"back: not a hit: {back}")
    if changed2["event"] != "hit" and not any("not cacheable" in w for w in changed["warnings"]):
        # Only where the changed state cannot be cached (aliased inputs change the graph's
        # inputs) may the second changed process compile again; it must say why.
        bad.append(f"changed2: compiled again without saying why: {changed2}")
    return bad


# One test per backend: its five processes serve every case. (One test per case made
# each xdist worker build the whole matrix for itself: twice the work.)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_guard_matrix(tmp_path: Path, backend: str) -> None:
    matrix = _build(tmp_path, backend)
    assert sorted(k for k in matrix["cold"] if k != "__leaked__") == sorted(CASE_NAMES)
    problems = {case: p for case in CASE_NAMES if (p := _case_problems(matrix, case))}
    assert not problems, "\n".join(f"{case}: {'; '.join(p)}" for case, p in problems.items())
    # A process that only hits adds no name to the user's module globals (Dynamo adds its
    # own when it compiles live).
    assert matrix["warm"]["__leaked__"] == [], matrix["warm"]["__leaked__"]
    assert matrix["cold"]["__leaked__"], "the cold process compiles live (Dynamo's names)"
