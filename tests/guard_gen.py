"""A seeded generator of guard cases: small modules whose method reads state in one of the
ways Python looks names up, and one change to that state (tests/e2e/test_guard_sweep.py).

A case is a module file ``<name>.py`` (and a helper module ``<name>_helper.py`` it
imports): a chain of ``nn.Module`` classes ``C0 <- C1 <- ...`` (the last is the one
instantiated), optionally with a metaclass, whose ``run(self, x)`` applies one transform
of ``y`` per *access*, and a function ``change(m)`` that changes the state one access
reads, so that ``run`` computes something else. Each access kind is one entry of
:data:`KINDS`: the code it puts where (module, helper, a class body, the metaclass,
``__init__``), the transform it adds to ``run``, and the changes that alter what it reads,
each tagged with what it changes (``value``: a value found; ``absence``: a name added where
the lookup found none).

Same seed, same cases: ``cases(seed, n)`` is deterministic, so a failure names a seed and
a case that reproduce it (``python -c 'import guard_gen; print(guard_gen.case(SEED, I).source)'``).
"""

from __future__ import annotations

import dataclasses
import random
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol


@dataclasses.dataclass
class Parts:
    """Where one access puts its code (``{a}`` in each snippet is the access's suffix)."""

    module: list[str] = dataclasses.field(default_factory=list)
    helper: list[str] = dataclasses.field(default_factory=list)
    classes: dict[int, list[str]] = dataclasses.field(default_factory=dict)   # depth -> body
    meta: list[str] = dataclasses.field(default_factory=list)
    init: list[str] = dataclasses.field(default_factory=list)
    getattr_names: dict[str, str] = dataclasses.field(default_factory=dict)   # name -> value
    helper_getattr: dict[str, str] = dataclasses.field(default_factory=dict)
    transform: str = ""
    changes: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (what, code)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The class chain a case's accesses are placed on."""

    depth: int        # classes C0..C{depth-1}; the last is instantiated
    meta: bool        # C0 has the metaclass Meta


Kind = Callable[[str, Shape, random.Random], Parts]


def _class_attr(a: str, s: Shape, r: random.Random) -> Parts:
    """``self.K`` on a class of the chain; shadowed nearer, on the instance, or changed."""
    at = r.randrange(s.depth)
    p = Parts(classes={at: [f"K{a} = 2.0"]}, transform=f"y = y * self.K{a}")
    p.changes.append(("value", f"mod.C{at}.K{a} = 5.0"))
    p.changes.append(("absence", f"m.K{a} = 5.0"))
    if at < s.depth - 1:
        p.changes.append(("absence", f"mod.C{r.randrange(at + 1, s.depth)}.K{a} = 5.0"))
    return p


def _type_attr(a: str, s: Shape, r: random.Random) -> Parts:
    """``type(self).K`` on a class of the chain."""
    at = r.randrange(s.depth)
    p = Parts(classes={at: [f"T{a} = 2.0"]}, transform=f"y = y * type(self).T{a}")
    p.changes.append(("value", f"mod.C{at}.T{a} = 5.0"))
    if at < s.depth - 1:
        p.changes.append(("absence", f"mod.C{s.depth - 1}.T{a} = 5.0"))
    return p


def _meta_attr(a: str, s: Shape, r: random.Random) -> Parts:
    """``type(self).K`` found on the metaclass: a class of the chain gains it."""
    p = Parts(meta=[f"M{a} = 2.0"], transform=f"y = y * type(self).M{a}")
    p.changes.append(("absence", f"mod.C{r.randrange(s.depth)}.M{a} = 5.0"))
    p.changes.append(("value", f"mod.Meta.M{a} = 5.0"))
    return p


def _getattr_hook(a: str, s: Shape, r: random.Random) -> Parts:
    """``self.K`` served by the module's own ``__getattr__``: the instance or a class gains it."""
    p = Parts(getattr_names={f"H{a}": "2.0"}, transform=f"y = y * self.H{a}")
    p.changes.append(("absence", f"m.H{a} = 5.0"))
    p.changes.append(("absence", f"mod.C{r.randrange(s.depth)}.H{a} = 5.0"))
    return p


def _slots(a: str, s: Shape, r: random.Random) -> Parts:
    """A ``__slots__`` object's field."""
    p = Parts(module=[f"class Slot{a}:", '    __slots__ = ("k",)', "    def __init__(self):",
                      "        self.k = 2.0"],
              init=[f"self.slot{a} = Slot{a}()"], transform=f"y = y * self.slot{a}.k")
    p.changes.append(("value", f"m.slot{a}.k = 5.0"))
    return p


def _property(a: str, s: Shape, r: random.Random) -> Parts:
    """A property on a class of the chain, reading an instance attribute."""
    at = r.randrange(s.depth)
    p = Parts(classes={at: ["@property", f"def P{a}(self):", f"    return self._p{a} * 2"]},
              init=[f"self._p{a} = 1.0"], transform=f"y = y * self.P{a}")
    p.changes.append(("value", f"m._p{a} = 2.5"))
    return p


def _descriptor(a: str, s: Shape, r: random.Random) -> Parts:
    """A non-data descriptor on a class: the instance shadows it, or its state changes."""
    at = r.randrange(s.depth)
    p = Parts(module=[f"class Const{a}:", "    def __init__(self, v):", "        self.v = v",
                      "    def __get__(self, obj, owner=None):", "        return self.v"],
              classes={at: [f"D{a} = Const{a}(2.0)"]}, transform=f"y = y * self.D{a}")
    p.changes.append(("absence", f"m.__dict__['D{a}'] = 5.0"))
    p.changes.append(("value", f"mod.C{at}.__dict__['D{a}'].v = 5.0"))
    return p


def _module_global(a: str, s: Shape, r: random.Random) -> Parts:
    p = Parts(module=[f"G{a} = 2.0"], transform=f"y = y * G{a}")
    p.changes.append(("value", f"mod.G{a} = 5.0"))
    return p


def _builtin(a: str, s: Shape, r: random.Random) -> Parts:
    """A builtin the method calls: its module defines one of that name."""
    name = r.choice(["abs", "max"])
    call = "abs(y)" if name == "abs" else "y * max(2.0, 1.5)"
    p = Parts(transform=f"y = {call}")
    p.changes.append(("absence", f"mod.{name} = lambda *t: t[0] * 3"))
    return p


def _inlined_builtin(a: str, s: Shape, r: random.Random) -> Parts:
    """A builtin called by a function the method inlines from its helper module."""
    p = Parts(helper=[f"def mag{a}(t):", "    return abs(t) + 1"],
              transform=f"y = helper.mag{a}(y)")
    p.changes.append(("absence", "helper.abs = lambda t: t * 3"))
    return p


def _getattr_default(a: str, s: Shape, r: random.Random) -> Parts:
    """``getattr(helper, NAME, default)``: the helper module gains NAME."""
    p = Parts(transform=f'y = y * getattr(helper, "N{a}", 2.0)')
    p.changes.append(("absence", f"helper.N{a} = 5.0"))
    return p


def _hasattr(a: str, s: Shape, r: random.Random) -> Parts:
    """A branch on ``hasattr(self, ...)``: the instance or a class gains the name."""
    p = Parts(transform=f'y = y * 3.0 if hasattr(self, "flag{a}") else y * 2.0')
    p.changes.append(("absence", f"m.flag{a} = True"))
    p.changes.append(("absence", f"mod.C{r.randrange(s.depth)}.flag{a} = True"))
    return p


def _closure(a: str, s: Shape, r: random.Random) -> Parts:
    p = Parts(module=[f"def make{a}(k):", "    def f(t):", "        return t * k",
                      "    return f"],
              init=[f"self.f{a} = make{a}(2.0)"], transform=f"y = self.f{a}(y)")
    p.changes.append(("value", f"m.f{a} = mod.make{a}(5.0)"))
    return p


def _defaults(a: str, s: Shape, r: random.Random) -> Parts:
    p = Parts(module=[f"def scale{a}(t, k=2.0):", "    return t * k"],
              init=[f"self.g{a} = scale{a}"], transform=f"y = self.g{a}(y)")
    p.changes.append(("value", f"mod.scale{a}.__defaults__ = (5.0,)"))
    return p


def _partial(a: str, s: Shape, r: random.Random) -> Parts:
    p = Parts(module=[f"def mul{a}(t, k):", "    return t * k"],
              init=[f"self.p{a} = functools.partial(mul{a}, k=2.0)"],
              transform=f"y = self.p{a}(y)")
    p.changes.append(("value", f"m.p{a} = functools.partial(mod.mul{a}, k=5.0)"))
    return p


def _enum(a: str, s: Shape, r: random.Random) -> Parts:
    p = Parts(module=[f"class Mode{a}(enum.Enum):", "    A = 1", "    B = 2"],
              init=[f"self.mode{a} = Mode{a}.A"],
              transform=f"y = y * 2.0 if self.mode{a} is Mode{a}.A else y * 5.0")
    p.changes.append(("value", f"m.mode{a} = mod.Mode{a}.B"))
    return p


def _dataclass(a: str, s: Shape, r: random.Random) -> Parts:
    p = Parts(module=["@dataclasses.dataclass", f"class Cfg{a}:", "    k: float = 2.0"],
              init=[f"self.cfg{a} = Cfg{a}()"], transform=f"y = y * self.cfg{a}.k")
    p.changes.append(("value", f"m.cfg{a}.k = 5.0"))
    p.changes.append(("value", f"m.cfg{a} = mod.Cfg{a}(k=5.0)"))
    return p


def _module_getattr(a: str, s: Shape, r: random.Random) -> Parts:
    """A name served by the helper module's ``__getattr__`` (PEP 562): the module gains it."""
    p = Parts(helper_getattr={f"L{a}": "2.0"}, transform=f"y = y * helper.L{a}")
    p.changes.append(("absence", f"helper.L{a} = 5.0"))
    return p


def _super_attr(a: str, s: Shape, r: random.Random) -> Parts:
    """``super().K`` in the method: a class between gains K, or K changes."""
    p = Parts(classes={0: [f"S{a} = 2.0"]}, transform=f"y = y * super().S{a}")
    p.changes.append(("value", f"mod.C0.S{a} = 5.0"))
    if s.depth > 2:
        p.changes.append(("absence", f"mod.C{r.randrange(1, s.depth - 1)}.S{a} = 5.0"))
    return p


def _submodule_attr(a: str, s: Shape, r: random.Random) -> Parts:
    """A class attribute of a child module: the child instance or its class changes."""
    p = Parts(module=[f"class Sub{a}(nn.Module):", "    K = 2.0"],
              init=[f"self.sub{a} = Sub{a}()"], transform=f"y = y * self.sub{a}.K")
    p.changes.append(("absence", f"m.sub{a}.K = 5.0"))
    p.changes.append(("value", f"mod.Sub{a}.K = 5.0"))
    return p


def _instance_attr(a: str, s: Shape, r: random.Random) -> Parts:
    p = Parts(init=[f"self.v{a} = 2.0"], transform=f"y = y * self.v{a}")
    p.changes.append(("value", f"m.v{a} = 5.0"))
    return p


KINDS: dict[str, Kind] = {
    "class_attr": _class_attr, "type_attr": _type_attr, "meta_attr": _meta_attr,
    "getattr_hook": _getattr_hook, "slots": _slots, "property": _property,
    "descriptor": _descriptor, "module_global": _module_global, "builtin": _builtin,
    "inlined_builtin": _inlined_builtin, "getattr_default": _getattr_default,
    "hasattr": _hasattr, "closure": _closure, "defaults": _defaults, "partial": _partial,
    "enum": _enum, "dataclass": _dataclass, "module_getattr": _module_getattr,
    "super_attr": _super_attr, "submodule_attr": _submodule_attr,
    "instance_attr": _instance_attr,
}
# At most one of these per case (one __getattr__ per class, one builtin shadowed per module).
_ONCE = {"getattr_hook", "module_getattr", "builtin", "inlined_builtin"}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kinds: tuple[str, ...]
    changed: str          # the access whose state changes
    what: str             # "value" or "absence"
    backend: str
    source: str
    helper: str


def case(seed: int, i: int, inductor_every: int = 8) -> Case:
    """The ``i``-th case of ``seed``: 1-3 accesses on a chain of 1-3 classes; one change."""
    r = random.Random(f"{seed}:{i}")
    # The first access goes round the kinds (any len(KINDS) cases in a row cover them all);
    # the others are drawn.
    names = sorted(KINDS)
    kinds: list[str] = [names[(i + seed) % len(names)]]
    for _ in range(r.choice([0, 0, 1, 1, 2])):
        k = r.choice(sorted(KINDS))
        if k in kinds or (k in _ONCE and any(x in _ONCE for x in kinds)):
            continue
        kinds.append(k)
    shape = Shape(depth=r.choice([1, 2, 3]) if "super_attr" not in kinds else r.choice([2, 3]),
                  meta="meta_attr" in kinds or r.random() < 0.2)
    parts = [KINDS[k](f"_{j}", shape, r) for j, k in enumerate(kinds)]
    target = r.randrange(len(parts))
    what, change = r.choice(parts[target].changes)
    name = f"gen_{seed}_{i:04d}"
    backend = "inductor" if inductor_every and i % inductor_every == inductor_every - 1 \
        else "aot_eager"
    return Case(name, tuple(kinds), kinds[target], what, backend,
                _module_source(name, shape, parts, change), _helper_source(parts))


def cases(seed: int, n: int, inductor_every: int = 8) -> list[Case]:
    return [case(seed, i, inductor_every) for i in range(n)]


def _module_source(name: str, s: Shape, parts: list[Parts], change: str) -> str:
    out = ["import dataclasses, enum, functools, sys", "import torch", "from torch import nn",
           f"import {name}_helper as helper", ""]
    for p in parts:
        out += p.module
    meta = [x for p in parts for x in p.meta]
    out += ["", "class Meta(type):", *(["    " + x for x in meta] or ["    pass"]), ""]
    getattr_names = {k: v for p in parts for k, v in p.getattr_names.items()}
    for d in range(s.depth):
        base = "nn.Module" if d == 0 else f"C{d - 1}"
        meta_kw = ", metaclass=Meta" if d == 0 and s.meta else ""
        body = [x for p in parts for x in p.classes.get(d, [])]
        if d == s.depth - 1:
            body += ["def __init__(self):", "    super().__init__()",
                     *("    " + x for p in parts for x in p.init)]
            if getattr_names:
                body += ["def __getattr__(self, name):"]
                for k, v in getattr_names.items():
                    body += [f"    if name == {k!r}:", f"        return {v}"]
                body += ["    return super().__getattr__(name)"]
            body += ["def run(self, x):", "    y = x + 1.0",
                     *("    " + p.transform for p in parts), "    return y"]
        out += [f"class C{d}({base}{meta_kw}):", *("    " + x for x in body or ["pass"]), ""]
    out += [f"Net = C{s.depth - 1}", "", "", "def change(m):",
            "    mod = sys.modules[__name__]", f"    {change}", ""]
    return "\n".join(out)


def _helper_source(parts: list[Parts]) -> str:
    out = [x for p in parts for x in p.helper]
    names = {k: v for p in parts for k, v in p.helper_getattr.items()}
    if names:
        out += ["def __getattr__(name):"]
        for k, v in names.items():
            out += [f"    if name == {k!r}:", f"        return {v}"]
        out += ["    raise AttributeError(name)"]
    return "\n".join(out) + "\n"


class Written(Protocol):
    """A generated case as files: this module's and write_gen's."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def helper(self) -> str: ...


def write(root: Path, batch: Sequence[Written]) -> None:
    """Each case's module ``<name>.py`` and helper module ``<name>_helper.py`` into ``root``."""
    for c in batch:
        (root / f"{c.name}.py").write_text(c.source)
        (root / f"{c.name}_helper.py").write_text(c.helper)


# The child's driver: PHASE "cold" publishes every case, "changed" changes each case's
# state before its first call, "loaded" changes it after a first call that loaded the entry,
# "armed" after the calls that built its guard tree and made it the first one tried.
DRIVER = textwrap.dedent('''
    import importlib, json, os, torch, warnings
    from cachecompile import cache_compile
    warnings.simplefilter("ignore")
    phase = os.environ["SWEEP_PHASE"]
    names = json.loads(os.environ["SWEEP_CASES"])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)) - 0.3
    out = {}

    def same(a, b):
        return bool(a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5))

    for name, backend in names:
        r = out[name] = {}
        try:
            mod = importlib.import_module(name)
            m = mod.Net().eval()
            with torch.no_grad():
                if phase == "changed":
                    mod.change(m)
                cached = cache_compile(m.run, backend=backend)
                got = cached(x)
                r["event"] = cached.events[-1][0]
                r["eager"] = same(got, m.run(x))
                if phase == "changed":
                    # The spec: a fresh torch.compile of the method in this state.
                    r["torch_compile"] = same(got, torch.compile(m.run, backend=backend,
                                                                 fullgraph=True)(x))
                if phase in ("loaded", "armed"):
                    before = m.run(x)
                    if phase == "armed":
                        # Until the guard tree is built and the call goes straight to it
                        # (the variant that served the last calls, by its tree alone).
                        for _ in range(2000):
                            if cached._last is not None:
                                break
                            cached(x)
                        r["armed"] = cached._last is not None
                    mod.change(m)
                    n = len(cached.events)
                    got = cached(x)
                    r["after"] = same(got, m.run(x))
                    r["matters"] = not same(before, m.run(x))
                    r["looked_up"] = len(cached.events) > n
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"[:300]
            try:    # this torch's Dynamo cannot compile it at all: not a case here
                with torch.no_grad():
                    torch.compile(mod.Net().eval().run, backend=backend, fullgraph=True)(x)
            except Exception:
                r["unsupported"] = True
    report(out)
''')
