"""The C++ guard tree a loaded entry checks on every call (entry/guard_tree.py).

The tree is built from the same guards as the Python checker, on the objects a passing
Python check just saw. What it must keep: it never passes where the Python check fails
(each change below, to the very objects it was built on), and where it fails on state the
Python check accepts (an equal replacement object) the Python check decides and the tree
is built again. Building it imports no Dynamo.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import types
from typing import Any

import pytest
import test_guards_checker as checker_models  # the same module and config, extended
import torch
import torch.nn.functional as F
from torch import nn

from cachecompile._torch import guard_tree as native
from cachecompile._torch import runtime
from cachecompile.entry import guard_tree, values
from cachecompile.entry import guards as g
from cachecompile.entry.checker import Checker, build_checker
from cachecompile.key.identity import identity, type_value


class Cfg(checker_models.Cfg):
    def __init__(self) -> None:
        super().__init__()
        self.dims = (2, 3)


class M(checker_models.M):
    """The checker tests' module, with a dtype attribute and a second argument."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = Cfg()
        self.dtype = torch.float32

    def run(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x


def _guard(kind: str, expr: str, value: Any, args: bool = False) -> dict[str, Any]:
    return {"kind": kind, "expr": expr, "value": value, "text": g.user_text(expr), "args": args}


LIN = "___odict_getitem(L['self']._modules, 'lin')"


def _guards(m: M, x: torch.Tensor, y: torch.Tensor) -> list[dict[str, Any]]:
    return [
        _guard("global_state", "", None),   # value filled in below
        _guard("type", "L['self']", type_value(M)),
        _guard("type", "L['self'].cfg", type_value(Cfg)),
        _guard("eq", "L['self'].cfg.act", values.encode_value("relu")),
        _guard("eq", "L['self'].cfg.width", values.encode_value(3)),
        _guard("eq", "L['self'].cfg.dims", values.encode_value((2, 3))),
        _guard("eq", "L['self'].dtype", values.encode_value(torch.float32)),
        _guard("len", "L['self'].cfg.table", 2),
        _guard("eq", "L['self'].cfg.table[1]", values.encode_value([3, 4])),
        _guard("eq", "L['self'].opts['mode']", values.encode_value("a")),
        _guard("keys", "L['self'].opts", [values.encode_value("mode")]),
        _guard("contains", "L['self'].opts", {"key": values.encode_value("extra"),
                                             "present": False}),
        _guard("hasattr", "L['self']", {"attr": "cfg", "present": True}),
        _guard("hasattr", "L['self']", {"attr": "mask", "present": False}),
        _guard("not_in_dict", "L['self']", "run"),
        _guard("len", f"{LIN}._forward_hooks", 0),
        _guard("len", f"{LIN}._forward_pre_hooks", 0),
        _guard("eq", f"{LIN}.training", values.encode_value(True)),
        _guard("ident", "dict(type(L['self']).__dict__)['run']", identity(M.run)),
        _guard("ident", "L['self'].fn", identity(F.relu)),
        _guard("ident", "L['self'].helper", identity(m.helper)),
        _guard("ident", "dict(type(L['self']).__mro__[1].__dict__)['helper'].__code__",
               identity(M.helper.__code__)),
        _guard("tensor", f"{LIN}._parameters['weight']", g.tensor_facts(m.lin.weight)),
        _guard("tensor", f"{LIN}._parameters['bias']", g.tensor_facts(m.lin.bias)),
        _guard("tensor", "L['x']", g.tensor_facts(x, sizes=[None, 4]), args=True),
        _guard("tensor", "L['y']", g.tensor_facts(y), args=True),
        {"kind": "alias", "expr": "", "args": True, "text": "inputs alias as at trace time",
         "value": {"exprs": ["L['x']", "L['y']"], "groups": [[0], [1]]}},
        {"kind": "overlap", "expr": "", "args": True, "text": "no shared memory",
         "value": {"exprs": ["L['x']", "L['y']"], "groups": []}},
        _guard("expr", "L['x'].size()[0] <= 8", None, args=True),
    ]


def _checker(m: M, x: torch.Tensor, y: torch.Tensor) -> Checker:
    guards = _guards(m, x, y)
    guards[0]["value"] = runtime.global_state()
    return build_checker(M.run, guards, {}, every_call=True)  # type: ignore[arg-type]


def _tree(c: Checker, m: M, x: torch.Tensor, y: torch.Tensor) -> guard_tree.Tree:
    assert c.parts is not None and c.full(m, x, y)
    tree = guard_tree.build(c.parts, (m, x, y), {})
    assert tree is not None
    return tree


CHANGES = {
    "cfg.act": lambda m: setattr(m.cfg, "act", "silu"),
    "cfg.width": lambda m: setattr(m.cfg, "width", 2),
    "cfg.width bool": lambda m: setattr(m.cfg, "width", 3.0),
    "tuple": lambda m: setattr(m.cfg, "dims", (2, 4)),
    "dtype": lambda m: setattr(m, "dtype", torch.float16),
    "table in place": lambda m: m.cfg.table[1].__setitem__(1, 5),
    "table len": lambda m: m.cfg.table.append([0]),
    "dict value": lambda m: m.opts.__setitem__("mode", "b"),
    "dict key added": lambda m: m.opts.__setitem__("extra", 1),
    "function attr": lambda m: setattr(m, "fn", F.silu),
    "partial attr": lambda m: setattr(m, "fn", functools.partial(F.relu)),
    "instance method": lambda m: setattr(m, "helper", types.MethodType(lambda s, y: y, m)),
    "class method code": lambda m: setattr(type(m), "helper", lambda s, y: y),
    "method of another": lambda m: setattr(m, "helper", M().helper),
    "attribute added": lambda m: setattr(m, "mask", 1),
    "method shadowed": lambda m: m.__dict__.__setitem__("run", None),
    "forward hook": lambda m: m.lin.register_forward_hook(lambda *a: None),
    "pre hook": lambda m: m.lin.register_forward_pre_hook(lambda *a: None),
    "weight dtype": lambda m: setattr(m.lin, "weight", nn.Parameter(m.lin.weight.double())),
    "weight requires_grad in place": lambda m: m.lin.weight.requires_grad_(False),
    "bias data replaced": lambda m: setattr(m.lin.bias, "data", torch.zeros(5)),
    "missing attr": lambda m: delattr(m, "cfg"),
    "cfg replaced": lambda m: setattr(m, "cfg", object()),
    "class swapped": lambda m: setattr(m, "__class__", type("M2", (M,), {})),
    "submodule eval": lambda m: m.lin.eval(),
    "class attribute patched": lambda m: setattr(type(m), "run", lambda s, x, y: y),
    # Changes no dict a skipped subtree records: the object's __dict__ itself replaced.
    "cfg __dict__ replaced": lambda m: setattr(m.cfg, "__dict__", {**vars(m.cfg), "act": "silu"}),
    "submodule __dict__ replaced": lambda m: object.__setattr__(
        m.lin, "__dict__", {**vars(m.lin), "training": False}),
}
_RUN = M.run


@pytest.mark.parametrize("what", list(CHANGES))
def test_the_tree_never_passes_where_the_python_check_fails(what: str) -> None:
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    try:
        m = M()
        c = _checker(m, x, y)
        tree = _tree(c, m, x, y)
        assert tree.n_native >= 20, (tree.n_native, tree.n_python)
        # Most of the module's guards are skipped while its dicts are unchanged, so each
        # change below happens under that skipping, after calls that used it.
        assert tree.skipped >= 10, tree.skipped
        assert tree.check(m, x, y) and tree.check(m, x, y)
        CHANGES[what](m)
        assert not tree.check(m, x, y), f"{what}: the tree passed a changed call"
        every = guard_tree.EveryCall(c.parts, c.full)
        # The Python check decides: a portable identity accepts another instance's bound
        # method of the same function (the tree, matching ids, is stricter); every other
        # change fails it.
        assert every(m, x, y) is c.full(m, x, y) is (what == "method of another"), what
    finally:
        if "helper" in vars(M):   # "class method code" patched it onto M
            del M.helper
        M.run = _RUN              # type: ignore[method-assign]


@pytest.mark.parametrize("what", ["bigger", "dtype", "rank", "aliased", "overlapping",
                                  "too long", "grad mode", "autocast"])
def test_argument_and_global_changes_fail_the_tree(what: str) -> None:
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    c = _checker(m, x, y)
    tree = _tree(c, m, x, y)
    assert tree.check(m, torch.randn(5, 4), torch.randn(2, 3)), "a dynamic size still fits"
    buf = torch.zeros(20)
    calls = {
        "bigger": (torch.randn(3, 5), y), "dtype": (x.double(), y), "rank": (x[None], y),
        "aliased": (x, x), "overlapping": (buf[:12].view(3, 4), buf[6:12].view(2, 3)),
        "too long": (torch.randn(9, 4), y),
    }
    if what in calls:
        args = calls[what]
        assert not c.full(m, *args) and not tree.check(m, *args), what
        return
    ctx = (torch.set_grad_enabled(not torch.is_grad_enabled()) if what == "grad mode"
           else torch.autocast("cpu", dtype=torch.bfloat16))
    with ctx:
        assert not c.full(m, x, y) and not tree.check(m, x, y), what


ACT = "relu"


class Globals(dict):
    """Like the warm path's replay globals: Dynamo's names, then the module's."""

    def __missing__(self, key: str) -> Any:
        return globals()[key]


def test_module_globals_read_through_a_dict_with_missing() -> None:
    global ACT
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    guards = [_guard("eq", "G['ACT']", values.encode_value("relu")),
              _guard("ident", "G['F'].relu", identity(F.relu))]
    c = build_checker(M.run, guards, Globals(), every_call=True)  # type: ignore[arg-type]
    tree = _tree(c, m, x, y)
    assert tree.n_native == 2 and tree.check(m, x, y)
    try:
        ACT = "silu"
        assert not c.full(m, x, y) and not tree.check(m, x, y)
    finally:
        ACT = "relu"
    assert tree.check(m, x, y)


def test_equal_replacements_rebuild_the_tree_a_bounded_number_of_times() -> None:
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    c = _checker(m, x, y)
    assert c.parts is not None
    every = guard_tree.EveryCall(c.parts, c.full)
    assert every(m, x, y) and every.tree is not None        # the first pass builds it
    first = every.tree
    assert first.skipped > 0 and first.frontier > 0
    assert every(m, x, y) and every.tree is first            # and then checks by it
    # A skipping tree checks a pinned object by identity: an equal replacement is a
    # rebuild, and after SKIPPING_BUILDS of them the trees check every leaf instead.
    for i in range(guard_tree.SKIPPING_BUILDS):
        before = every.tree
        m.cfg = Cfg()
        assert every(m, x, y) and every.tree is not before
        assert every.tree is not None
        assert (every.tree.skipped > 0) is (i + 2 <= guard_tree.SKIPPING_BUILDS)
    plain = every.tree
    m.cfg = Cfg()               # read through its attributes: a plain tree holds
    assert every(m, x, y) and every.tree is plain
    m.fn = _copy(F.relu)        # the same function by identity, another object
    assert every(m, x, y) and every.tree is not plain        # Python passes: rebuilt
    for _ in range(guard_tree.MAX_BUILDS + 3):
        m.fn = _copy(F.relu)
        assert every(m, x, y)
    assert every.tree is None                                # past the limit: Python decides
    m.fn = F.silu
    assert not every(m, x, y)
    m.fn = _copy(F.relu)
    assert every(m, x, y)


def test_a_priced_tree_waits_for_its_rent_and_every_call_is_checked_until_then() -> None:
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    c = _checker(m, x, y)
    assert c.parts is not None
    calls = []

    def python(*args: Any, **kwargs: Any) -> bool:
        calls.append(1)
        return c.full(*args, **kwargs)

    cost = guard_tree.BuildCost()
    cost.ms_per_guard = 1e9                 # a build never pays off: the Python check runs
    every = guard_tree.EveryCall(c.parts, python, cost)
    for i in range(5):
        assert every(m, x, y) and every.tree is None and len(calls) == i + 1
        assert not every.fast(m, x, y)      # no tree answers alone
    m.fn = F.silu                           # checked on the very next call
    assert not every(m, x, y) and every.tree is None
    m.fn = F.relu
    assert every(m, x, y)
    cost.ms_per_guard = 0.0                 # the rent now covers the price: built
    assert every(m, x, y) and every.tree is not None
    n = len(calls)
    assert every(m, x, y) and len(calls) == n   # the tree answers; Python is not called
    assert cost.ms_per_guard > 0            # the build priced the method's next variants
    m.fn = F.silu
    assert not every(m, x, y)


def _copy(fn: Any) -> Any:
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    out.__qualname__, out.__module__ = fn.__qualname__, fn.__module__
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def test_building_imports_no_dynamo_and_dynamo_still_works_after() -> None:
    src = textwrap.dedent("""
        import sys, torch
        from torch import nn
        from cachecompile._torch import guard_tree as native
        from cachecompile.entry import guard_tree, guards as g
        from cachecompile.entry.checker import build_checker
        class N(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(2, 2)
            def run(self, x):
                return self.lin(x)
        m, x = N(), torch.randn(3, 2)
        guards = [{"kind": "len", "expr": "___odict_getitem(L['self']._modules, 'lin')._forward_hooks",
                   "value": 0, "text": "hooks", "args": False},
                  {"kind": "tensor", "expr": "L['x']", "value": g.tensor_facts(x), "text": "x",
                   "args": True}]
        c = build_checker(N.run, guards, {}, every_call=True)
        tree = guard_tree.build(c.parts, (m, x), {})
        assert native.available() and tree is not None and tree.n_native == 2
        assert tree.check(m, x) and not tree.check(m, torch.randn(3, 3))
        assert "torch._dynamo" not in sys.modules, sorted(k for k in sys.modules if "dynamo" in k)
        out = torch.compile(m.run, backend="eager")(x)
        assert torch.allclose(out, m.run(x))
        assert tree.check(m, x)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_this_torch_has_the_tree() -> None:
    """The probe holds on every torch of the matrix: a tree build that silently fell back
    would make every warm call pay the Python check."""
    assert native.available()


def test_a_tree_is_dropped_when_an_object_it_matched_by_id_is_freed() -> None:
    """An id is that object's only while it lives: once a matched object is freed (a
    swapped-out function, whose id a new object may take), the tree is not used again;
    the Python check decides and a new tree is built. The tree does not keep it alive."""
    import gc
    import weakref

    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    m.fn = _copy(F.relu)
    c = _checker(m, x, y)
    assert c.parts is not None
    every = guard_tree.EveryCall(c.parts, c.full)
    assert every(m, x, y) and every.tree is not None
    first = every.tree
    old = weakref.ref(m.fn)
    m.fn = _copy(F.relu)
    gc.collect()
    assert old() is None, "the tree kept a replaced function alive"
    assert not first.held.alive
    assert every(m, x, y) and every.tree is not first and every.tree is not None
    assert every.tree.held.alive and every.tree.check(m, x, y)


def test_a_changed_anchor_is_checked_leaf_by_leaf_then_skips_again_in_a_new_tree() -> None:
    """State the guards do not read changes under the module (an attribute set on it):
    its dicts are no longer what the tree recorded, so the tree checks that subtree leaf
    by leaf (and still passes), and the next call gets a tree that skips again."""
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    c = _checker(m, x, y)
    assert c.parts is not None
    every = guard_tree.EveryCall(c.parts, c.full)
    assert every(m, x, y) and every.tree is not None
    first = every.tree
    assert every(m, x, y) and not first.rearm.due
    m.unrelated = 1  # type: ignore[assignment]
    assert every(m, x, y) and every.tree is first            # leaf by leaf, still passes
    assert every(m, x, y) and every.tree is not first and every.tree is not None
    assert every.tree.skipped > 0 and every(m, x, y) and not every.tree.rearm.due
    m.cfg.act = "silu"                                       # and a real change still fails
    assert not every(m, x, y)


def test_a_small_changed_anchor_is_not_worth_a_new_tree() -> None:
    """A Python module whose own globals change as it runs: its few guards are checked leaf
    by leaf from then on, in the same tree."""
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    mod = types.ModuleType("cc_tree_test_mod")
    mod.ACT = "relu"  # type: ignore[attr-defined]
    env = Globals(mod=mod)
    guards = [_guard("eq", "G['mod'].ACT", values.encode_value("relu")),
              _guard("eq", "L['self'].cfg.act", values.encode_value("relu"))]
    c = build_checker(M.run, guards, env, every_call=True)  # type: ignore[arg-type]
    assert c.parts is not None
    every = guard_tree.EveryCall(c.parts, c.full)
    assert every(m, x, y) and every(m, x, y)
    tree = every.tree
    assert tree is not None and tree.n_python == 0
    mod.calls = 1  # type: ignore[attr-defined]
    assert every(m, x, y) and every.tree is tree and not tree.rearm.due
    mod.ACT = "silu"  # type: ignore[attr-defined]
    assert not tree.check(m, x, y) and not every(m, x, y)


def test_process_state_guards_are_native() -> None:
    """Function modes, the default device and an environment variable read while unset
    are leaves of the tree (no Python on the root), and each change fails it."""
    import os

    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    name = "CACHECOMPILE_TREE_TEST_UNSET"
    os.environ.pop(name, None)
    guards = [_guard("modes", "", []), _guard("default_device", "", None),
              _guard("expr", f"not ___environ_has({name!r})", None),
              _guard("eq", "L['self'].cfg.act", values.encode_value("relu"))]
    c = build_checker(M.run, guards, {}, every_call=True)  # type: ignore[arg-type]
    tree = _tree(c, m, x, y)
    assert tree.n_python == 0 and tree.n_native == 4 and tree.check(m, x, y)
    with torch.overrides.TorchFunctionMode():
        assert not c.full(m, x, y) and not tree.check(m, x, y)
    with torch.device("meta"):
        assert not c.full(m, x, y) and not tree.check(m, x, y)
    os.environ[name] = "1"
    try:
        assert not c.full(m, x, y) and not tree.check(m, x, y)
    finally:
        del os.environ[name]
    assert tree.check(m, x, y)


class _Meta(type):
    K = 2.0


class _MetaBase(nn.Module, metaclass=_Meta):
    pass


class _MetaLeaf(_MetaBase):
    def run(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x


class _MetaBase2(nn.Module, metaclass=_Meta):
    K = 5.0


@pytest.mark.parametrize("change", ["class", "base", "instance", "module", "builtin", "bases"])
def test_absence_guards_are_native_and_fail_when_the_name_is_added(
        change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guards cold/lookups.py derives (a class's own dict, an instance dict, a
    module's dict, a module's globals before a builtin) are native leaves, the class dicts
    read through the C++ class-dict accessor; adding the name fails the tree."""
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = _MetaLeaf()
    mod = types.ModuleType("cc_tree_test_absent")
    sys.modules[mod.__name__] = mod
    no = {"key": values.encode_value("K"), "present": False}
    guards = [_guard("contains", "type(L['self']).__mro__[0].__dict__", no),
              _guard("contains", "type(L['self']).__mro__[1].__dict__", no),
              _guard("not_in_dict", "L['self']", "K"),
              _guard("not_in_dict", "G['mod']", "NAME"),
              _guard("expr", f"not ___module_has({mod.__name__!r}, 'abs')", None)]
    try:
        c = build_checker(_MetaLeaf.run, guards, Globals(mod=mod),  # type: ignore[arg-type]
                            every_call=True)
        lambdas: list[str] = []
        predicate = native.predicate
        def recording(mgr: Any, fn: Any, text: str) -> Any:
            lambdas.append(text)
            return predicate(mgr, fn, text)

        monkeypatch.setattr(native, "predicate", recording)
        tree = _tree(c, m, x, y)  # type: ignore[arg-type]
        assert tree.n_python == 0 and tree.n_native == len(guards), (tree.n_python,
                                                                      tree.n_native)
        # None of them is a Python lambda on its node.
        texts = {gd["text"] for gd in guards}
        assert [t for t in lambdas if t in texts] == [], lambdas
        # The class dicts and the instance dict hang off the module: skipped while its
        # dicts (the classes' own included) are unchanged; each change is seen under that.
        assert tree.skipped >= 4, tree.skipped
        assert tree.check(m, x, y) and tree.check(m, x, y)
        {"class": lambda: setattr(_MetaLeaf, "K", 5.0),
         "base": lambda: setattr(_MetaBase, "K", 5.0),
         "instance": lambda: setattr(m, "K", 5.0),
         "module": lambda: setattr(mod, "NAME", 5.0),
         "builtin": lambda: setattr(mod, "abs", len),
         "bases": lambda: setattr(_MetaLeaf, "__bases__", (_MetaBase2,))}[change]()
        assert not c.full(m, x, y) and not tree.check(m, x, y)
    finally:
        _MetaLeaf.__bases__ = (_MetaBase,)
        for cls in (_MetaLeaf, _MetaBase):
            if "K" in vars(cls):
                delattr(cls, "K")
        del sys.modules[mod.__name__]


def test_a_dict_read_by_position() -> None:
    """Dynamo names what it read from a dict it iterated by position
    (``list(dict.keys(d))[i]``, ``dict.__getitem__(d, ...)``): native leaves, skipped with
    their module; reordering the dict or changing a value fails the tree."""
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    mod = types.ModuleType("cc_tree_test_registry")
    mod.REG = {"a": {"k": 1}, "b": {"k": 2}}  # type: ignore[attr-defined]
    reg = "G['mod'].REG"
    guards = [_guard("eq", f"list(dict.keys({reg}))[0]", values.encode_value("a")),
              _guard("len", f"dict.__getitem__({reg}, list(dict.keys({reg}))[1])", 1),
              _guard("eq", f"dict.__getitem__({reg}, list(dict.keys({reg}))[1])['k']",
                     values.encode_value(2))]
    c = build_checker(M.run, guards, Globals(mod=mod), every_call=True)  # type: ignore[arg-type]
    tree = _tree(c, m, x, y)
    assert tree.n_python == 0 and tree.skipped >= 4 and tree.check(m, x, y)
    mod.REG["b"]["k"] = 3
    assert not c.full(m, x, y) and not tree.check(m, x, y)
    mod.REG["b"]["k"] = 2
    assert c.full(m, x, y) and tree.check(m, x, y)
    mod.REG = {"b": {"k": 2}, "a": {"k": 1}}  # type: ignore[attr-defined]  # reordered
    assert not c.full(m, x, y) and not tree.check(m, x, y)


def test_past_the_build_budget_a_tree_that_still_holds_is_kept() -> None:
    """A tree whose skipping turned off (an unread attribute set on the model) still
    checks every guard; past the build budget it stays, rather than the Python check."""
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    m = M()
    c = _checker(m, x, y)
    assert c.parts is not None
    every = guard_tree.EveryCall(c.parts, c.full)
    assert every(m, x, y)
    every._builds = guard_tree.MAX_BUILDS       # the budget spent (equal replacements)
    tree = every.tree
    m.unrelated = 2  # type: ignore[assignment]
    for _ in range(3):
        assert every(m, x, y) and every.tree is tree
    m.cfg.act = "silu"
    assert not every(m, x, y)


def test_the_stand_in_reads_of_dynamo_sources_agree_with_a_parse() -> None:
    """guard_tree reads GuardManagerType and three config defaults from Dynamo's source
    text with regular expressions (a parse of guards.py cost a warm start ~55 ms): on this
    torch they agree with what ast.parse finds."""
    import ast

    from cachecompile._torch import guard_tree as native

    tree = ast.parse(native._module_source("torch._dynamo.guards") or "")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GuardManagerType")
    parsed = {t.id: a.value.value for a in cls.body if isinstance(a, ast.Assign)
              for t in a.targets if isinstance(t, ast.Name) and isinstance(a.value, ast.Constant)}
    stand_in = native._manager_type()
    assert stand_in is not None and {m.name: m.value for m in stand_in} == parsed
    config = ast.parse(native._module_source("torch._dynamo.config") or "")
    values = {}
    for node in config.body:
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value  # type: ignore[attr-defined]
    defaults = native._config_defaults()
    assert defaults is not None
    for name, value in defaults.items():
        if name != "verbose":
            assert values[name] == value, name


class _UsesHFConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig

        self.config = LlamaConfig(hidden_size=8, num_attention_heads=2, rms_norm_eps=1e-6)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.config.rms_norm_eps


_HF_CHANGES = {
    "value": lambda m: setattr(m.config, "rms_norm_eps", 1e-5),
    "mapped on the class": lambda m: type(m.config).attribute_map.__setitem__("rms_norm_eps",
                                                                               "hidden_size"),
    "map replaced": lambda m: setattr(type(m.config), "attribute_map",
                                      {"rms_norm_eps": "hidden_size"}),
    "instance map": lambda m: m.config.__dict__.__setitem__("attribute_map",
                                                            {"rms_norm_eps": "hidden_size"}),
    "getattribute patched": lambda m: setattr(type(m.config), "__getattribute__",
                                              lambda s, k: 0.5 if k == "rms_norm_eps"
                                              else object.__getattribute__(s, k)),
}


@pytest.mark.parametrize("change", sorted(_HF_CHANGES))
def test_a_transformers_config_read_is_pinned_by_its_dicts(change: str) -> None:
    """transformers' PretrainedConfig.__getattribute__ maps a name through the class's
    attribute_map, then reads as Python does: the tree reads such an attribute from the
    instance dict (skipped while unchanged), and checks on every call what makes that the
    same read. Each way of changing the read fails the tree (issue 33's decision)."""
    from transformers import LlamaConfig

    saved = {k: LlamaConfig.__dict__[k] for k in ("attribute_map",) if k in LlamaConfig.__dict__}
    saved_ga = "__getattribute__" in LlamaConfig.__dict__
    m, x = _UsesHFConfig(), torch.randn(2, 8)
    amap = dict(type(m.config).attribute_map)
    guards = [_guard("type", "L['self'].config", type_value(type(m.config))),
              _guard("eq", "L['self'].config.rms_norm_eps", values.encode_value(1e-6))]
    c = build_checker(_UsesHFConfig.run, guards, {}, every_call=True)  # type: ignore[arg-type]
    tree = guard_tree.build(c.parts, (m, x), {})
    assert tree is not None and tree.n_python == 0
    assert tree.check(m, x) and tree.check(m, x)
    try:
        _HF_CHANGES[change](m)
        assert c.full(m, x) is False, "the Python check sees it"
        assert tree.check(m, x) is False, f"the tree missed: {change}"
    finally:
        for k, v in saved.items():
            setattr(LlamaConfig, k, v)
        type(m.config).attribute_map.clear()
        type(m.config).attribute_map.update(amap)
        if not saved_ga and "__getattribute__" in LlamaConfig.__dict__:
            delattr(LlamaConfig, "__getattribute__")
        m.config.__dict__.pop("attribute_map", None)


def test_a_transformers_config_read_is_skipped_while_unchanged(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """The read above sits in the module's skipped subtree (it no longer calls the config's
    __getattribute__ on every call); unrecognised, it is checked on every call."""
    from cachecompile.entry import guard_kinds

    if not native.tags_available():
        pytest.skip("this torch does not skip unchanged subtrees")
    m, x = _UsesHFConfig(), torch.randn(2, 8)
    guards = [_guard("type", "L['self'].config", type_value(type(m.config))),
              _guard("eq", "L['self'].config.rms_norm_eps", values.encode_value(1e-6))]

    def skipped() -> int:
        c = build_checker(_UsesHFConfig.run, guards, {}, every_call=True)  # type: ignore[arg-type]
        tree = guard_tree.build(c.parts, (m, x), {})
        assert tree is not None and tree.check(m, x)
        return tree.skipped

    pinned = skipped()
    monkeypatch.setattr(guard_kinds, "_config_getattribute", lambda: None)
    assert pinned > skipped()
