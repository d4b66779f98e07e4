"""A seeded generator of *write* cases: small modules whose cached code writes state (a
global stored or deleted, an attribute set on a module or on ``self``, a list or a dict
mutated) and reads it back, across graph breaks (tests/e2e/test_write_sweep.py).

The sibling of :mod:`guard_gen`, which only reads. Each case is a module ``<name>.py`` and
a helper ``<name>_helper.py``. Its code is a chain of *segments* split by graph breaks
(``torch._dynamo.graph_break()``; none: ``fullgraph=True``, the default). Each *write*
(one entry of :data:`WRITES`) is placed:

* ``where``: in the method's own frame (segment 0, before any break), in a resume frame
  (a later segment), or in a *callee* (a module function the method calls, which breaks
  itself when the case breaks: its write is then before or after its own break);
* a read of the same state after the write, in the same segment or a later one, and
  sometimes one before it, so that what the write left changes the output.

Values are of every kind a serving loop keeps: str, int, bool, None, a tensor, a
function's identity, a name present or deleted. Every case is written in one of the
:data:`FORMS` ``cache_compile`` takes. The state has two settings, ``A`` (the module as
written) and ``B`` (``set_state(m, "B")``); the driver sets one before each call, so a
process can go A -> B -> A, and compares the output **and** the state after the call
(``state(m)``) with eager's and with a fresh ``torch.compile``'s, each from the same
state before.

Same seed, same cases: ``case(seed, i)`` is deterministic.
"""

from __future__ import annotations

import dataclasses
import random
import textwrap
from collections.abc import Callable
from pathlib import Path

import guard_gen


@dataclasses.dataclass
class Write:
    """One written state (``{a}`` in each snippet is the write's suffix)."""

    module: list[str]           # module-level lines (the state as written: A)
    helper: list[str]           # helper-module lines
    init: list[str]             # __init__ lines (self state)
    names: list[str]            # globals the writing frame declares
    write: list[str]            # the write (statements; may read and transform y)
    read: str                   # a transform of y that reads the state
    state: str                  # an expression of the state (mod, helper, m), comparable
    set_a: list[str]            # statements that set state A (mod, helper, m)
    set_b: list[str]            # ... and B
    needs_self: bool = False


W = Callable[[str], Write]


def _g_str(a: str) -> Write:
    return Write([f'S{a} = "a"'], [], [], [f"S{a}"], [f'S{a} = "w"'],
                 f'y = y * 2.0 if S{a} == "w" else (y * 3.0 if S{a} == "a" else y * 5.0)',
                 f"mod.S{a}", [f'mod.S{a} = "a"'], [f'mod.S{a} = "b"'])


def _g_int(a: str) -> Write:
    return Write([f"N{a} = 0"], [], [], [f"N{a}"], [f"N{a} += 1"], f"y = y + N{a}",
                 f"mod.N{a}", [f"mod.N{a} = 0"], [f"mod.N{a} = 10"])


def _g_bool(a: str) -> Write:
    return Write([f"F{a} = False"], [], [], [f"F{a}"], [f"F{a} = True"],
                 f"y = y * 2.0 if F{a} else y - 1.0", f"mod.F{a}",
                 [f"mod.F{a} = False"], [f"mod.F{a} = True"])


def _g_none(a: str) -> Write:
    return Write([f'L{a} = "x"'], [], [], [f"L{a}"], [f"L{a} = None"],
                 f"y = y + (1.0 if L{a} is None else 2.0)", f"mod.L{a}",
                 [f'mod.L{a} = "x"'], [f"mod.L{a} = None"])


def _g_tensor(a: str) -> Write:
    return Write([f"T{a} = torch.zeros(1)"], [], [], [f"T{a}"], [f"T{a} = y.sum().reshape(1)"],
                 f"y = y + T{a}", f"mod.T{a}",
                 [f"mod.T{a} = torch.zeros(1)"], [f"mod.T{a} = torch.ones(1)"])


def _g_fn(a: str) -> Write:
    return Write([f"FN{a} = torch.tanh"], [], [], [f"FN{a}"], [f"FN{a} = torch.sigmoid"],
                 f"y = FN{a}(y)", f"mod.FN{a}.__name__",
                 [f"mod.FN{a} = torch.tanh"], [f"mod.FN{a} = torch.relu"])


def _g_del(a: str) -> Write:
    """A global set then deleted: read back through the module (present or not)."""
    return Write([f"D{a} = 2.0"], [], [], [f"D{a}"], [f"D{a} = 3.0", f"y = y * D{a}", f"del D{a}"],
                 f'y = y * getattr(_self, "D{a}", 7.0)',
                 f'vars(mod).get("D{a}", "<absent>")',
                 [f"mod.D{a} = 2.0"], [f'vars(mod).pop("D{a}", None)'])


def _helper_attr(a: str) -> Write:
    return Write([], [f"A{a} = 2.0"], [], [], [f"helper.A{a} = 3.0"], f"y = y * helper.A{a}",
                 f"helper.A{a}", [f"helper.A{a} = 2.0"], [f"helper.A{a} = 5.0"])


def _module_attr(a: str) -> Write:
    """An attribute of the case's own module, set through its module object."""
    return Write([f"M{a} = 2.0"], [], [], [], [f"_self.M{a} = 3.0"], f"y = y * _self.M{a}",
                 f"mod.M{a}", [f"mod.M{a} = 2.0"], [f"mod.M{a} = 5.0"])


def _list_append(a: str) -> Write:
    return Write([f"SEEN{a} = []"], [], [], [], [f"SEEN{a}.append(1)"],
                 f"y = y + len(SEEN{a})", f"list(mod.SEEN{a})",
                 [f"mod.SEEN{a}.clear()"], [f"mod.SEEN{a}[:] = [7, 7]"])


def _dict_set(a: str) -> Write:
    return Write([f"CACHE{a} = {{}}"], [], [], [], [f'CACHE{a}["k"] = "v"'],
                 f'y = y * 2.0 if CACHE{a}.get("k") == "v" else y - 2.0', f"dict(mod.CACHE{a})",
                 [f"mod.CACHE{a}.clear()"], [f'mod.CACHE{a}.update(k="old")'])


def _self_attr(a: str) -> Write:
    return Write([], [], [f"self.calls{a} = 0"], [], [f"self.calls{a} += 1"],
                 f"y = y + self.calls{a}", f"m.calls{a}",
                 [f"m.calls{a} = 0"], [f"m.calls{a} = 5"], needs_self=True)


WRITES: dict[str, W] = {
    "global_str": _g_str, "global_int": _g_int, "global_bool": _g_bool,
    "global_none": _g_none, "global_tensor": _g_tensor, "global_fn": _g_fn,
    "global_del": _g_del, "helper_attr": _helper_attr, "module_attr": _module_attr,
    "list_append": _list_append, "dict_set": _dict_set, "self_attr": _self_attr,
}
PLACES = ("root", "resume", "callee")
# How the case is cached (what the driver does for each: DRIVER).
FORMS = ("method", "module", "decorated_forward", "class_decorator", "function",
         "repeated_blocks")


@dataclasses.dataclass(frozen=True)
class Placed:
    kind: str
    where: str          # root | resume | callee
    callee_after: bool  # callee: the write after the callee's own break
    read_after: int     # segments after the write's segment where it is read back
    read_before: bool


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    form: str
    backend: str
    breaks: int               # 0: fullgraph=True
    writes: tuple[Placed, ...]
    source: str
    helper: str

    @property
    def fullgraph(self) -> bool:
        return self.breaks == 0

    def describe(self) -> str:
        w = ", ".join(f"{p.kind}@{p.where}{'+after' if p.callee_after else ''}"
                      f"/read+{p.read_after}{'/before' if p.read_before else ''}"
                      for p in self.writes)
        return f"{self.name} {self.form} {self.backend} breaks={self.breaks} [{w}]"


def case(seed: int, i: int, inductor_every: int = 4) -> Case:
    """The ``i``-th case of ``seed``: 1-2 writes, 0-2 breaks, one form."""
    r = random.Random(f"write:{seed}:{i}")
    names = sorted(WRITES)
    form = FORMS[(i + seed) % len(FORMS)]
    kinds = [names[(i + seed) % len(names)]]
    if r.random() < 0.4:
        k = r.choice(names)
        if k not in kinds:
            kinds.append(k)
    if form == "function":     # no self: a write to self has no place there
        kinds = [k for k in kinds if not WRITES[k]("").needs_self] or ["global_str"]
    # Dynamo has no handler for DELETE_GLOBAL: with fullgraph=True torch.compile itself
    # refuses it, so a deleted global comes with a break (fullgraph=False).
    breaks = r.choice([1, 2, 2] if "global_del" in kinds else [0, 1, 2, 2])
    placed = []
    for k in kinds:
        where = r.choice(["root", "callee"] if breaks == 0 else list(PLACES))
        seg = 0 if where == "root" else (r.randrange(1, breaks + 1) if where == "resume"
                                         else r.randrange(breaks + 1))
        placed.append((k, where, seg, breaks > 0 and where == "callee" and r.random() < 0.5,
                       r.randrange(breaks - seg + 1), r.random() < 0.4))
    writes = tuple(Placed(k, w, after, ra, rb) for k, w, _, after, ra, rb in placed)
    name = f"wgen_{seed}_{i:04d}"
    backend = "inductor" if inductor_every and i % inductor_every == inductor_every - 1 \
        else "aot_eager"
    source, helper = _sources(name, form, breaks, [(WRITES[k](f"_{j}"), s, p) for j, (
        (k, _, s, *_), p) in enumerate(zip(placed, writes, strict=True))])
    return Case(name, form, backend, breaks, writes, source, helper)


def cases(seed: int, n: int, inductor_every: int = 4) -> list[Case]:
    return [case(seed, i, inductor_every) for i in range(n)]


_BREAK = "torch._dynamo.graph_break()"


def _sources(name: str, form: str, breaks: int,
             ws: list[tuple[Write, int, Placed]]) -> tuple[str, str]:
    segments: list[list[str]] = [[] for _ in range(breaks + 1)]
    callees: list[str] = []
    self_arg = form != "function"
    for j, (w, seg, p) in enumerate(ws):
        if p.read_before:
            segments[seg].append(w.read)
        if p.where == "callee":
            fn = f"w_{j}"
            body = [*w.write]
            if breaks:
                body = ([_BREAK, *body] if p.callee_after else [*body, _BREAK])
            args = "self, y" if self_arg else "y"
            callees += [f"def {fn}({args}):",
                        *([f"    global {', '.join(w.names)}"] if w.names else []),
                        *("    " + x for x in body), "    return y", ""]
            segments[seg].append(f"y = {fn}({args})")
        else:
            segments[seg] += w.write
        segments[seg + p.read_after].append(w.read)
    body = ["y = x + 1.0"]
    for s, lines in enumerate(segments):
        if s:
            body += [_BREAK, f"y = y + 0.{s}"]     # a graph in every resume frame
        body += lines
    body.append("return y")
    declared = sorted({n for w, _, p in ws if p.where != "callee" for n in w.names})
    glob = [f"global {', '.join(declared)}"] if declared else []
    run_body = [*glob, *body]
    out = ["import sys", "import torch", "from torch import nn", "import cachecompile",
           f"import {name}_helper as helper", f"import {name} as _self",
           "BK = 'aot_eager'", ""]
    for w, _, _ in ws:
        out += w.module
    out += ["", *callees]
    init = [x for w, _, _ in ws for x in w.init]
    out += ["class Net(nn.Module):", "    def __init__(self):", "        super().__init__()",
            "        torch.manual_seed(0)", "        self.lin = nn.Linear(4, 4)",
            *("        " + x for x in init),
            "    def forward(self, x):", "        x = self.lin(x)",
            *("        " + x for x in run_body), ""]
    # The same body under the decorated forms (their eager run is Net.forward's).
    out += ["class NetDec(Net):", "    @cachecompile.cache_compile(fullgraph=FULLGRAPH, "
            "backend=BK)", "    def forward(self, x):", "        x = self.lin(x)",
            *("        " + x for x in run_body), ""]
    out += ["@cachecompile.cache_compile(fullgraph=FULLGRAPH, backend=BK)",
            "class NetCls(Net):", "    def forward(self, x):", "        x = self.lin(x)",
            *("        " + x for x in run_body), ""]
    out += ["class Outer(nn.Module):", "    def __init__(self):", "        super().__init__()",
            "        self.blocks = nn.ModuleList([Net(), Net()])",
            "    def forward(self, x):", "        for b in self.blocks:", "            x = b(x)",
            "        return x", ""]
    out += ["def step(x):", *("    " + x for x in run_body), ""]
    out += ["def state(m):", "    mod = sys.modules[__name__]",
            "    blocks = list(m.blocks) if isinstance(m, Outer) else [m]",
            "    out = {}", "    for i, m in enumerate(blocks):"]
    for j, (w, _, _) in enumerate(ws):
        key = f"{j}:{w.state}"
        out.append(f"        out[f'{{i}}:{key}'] = _plain({w.state})")
    out += ["    return out", "", "def set_state(m, which):", "    mod = sys.modules[__name__]",
            "    for m in (list(m.blocks) if isinstance(m, Outer) else [m]):"]
    for w, _, _ in ws:
        out += ["        if which == 'A':", *("            " + x for x in w.set_a),
                "        else:", *("            " + x for x in w.set_b)]
    out += ["", "def _plain(v):", "    if isinstance(v, torch.Tensor):",
            "        return {'tensor': [float(t) for t in v.flatten()]}",
            "    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) "
            "else repr(v)", ""]
    src = "\n".join(out)
    # The decorators read FULLGRAPH at class creation: set it before them.
    src = src.replace("BK = 'aot_eager'",
                      f"import os\nBK = os.environ.get('WGEN_BACKEND', 'aot_eager')\n"
                      f"FULLGRAPH = {breaks == 0}")
    helper = "\n".join(x for w, _, _ in ws for x in w.helper) + "\n"
    return src, helper


def write(root: Path, batch: list[Case]) -> None:
    """Each case's module and helper module into ``root`` (as guard_gen writes its own)."""
    guard_gen.write(root, batch)


# The child's driver. SWEEP_SEQ: the states set before each call ("AABA"); per call, the
# state is set, eager runs, the state is set again, a fresh torch.compile (one per case and
# process) runs, the state is set again, the cached form runs; outputs and the state after
# each are compared.
DRIVER = textwrap.dedent('''
    import importlib, json, os, sys, warnings
    import torch
    import cachecompile
    from cachecompile import cache_compile
    warnings.simplefilter("ignore")
    seq = os.environ["SWEEP_SEQ"]
    names = json.loads(os.environ["SWEEP_CASES"])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    out = {}

    def same(a, b):
        return bool(a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5))

    def same_state(a, b):
        """Equal, but for tensors' values (within the outputs' tolerance)."""
        if isinstance(a, dict) and isinstance(b, dict):
            if set(a) != set(b):
                return False
            if set(a) == {"tensor"}:
                return same(torch.tensor(a["tensor"]), torch.tensor(b["tensor"]))
            return all(same_state(a[k], b[k]) for k in a)
        return a == b

    def forms(mod, form, fullgraph, backend):
        """(model, eager, torch.compile, cached) for the form."""
        kw = dict(fullgraph=fullgraph, backend=backend)
        if form == "function":
            return (None, mod.step, torch.compile(mod.step, **kw), cache_compile(mod.step, **kw))
        if form == "repeated_blocks":
            o = mod.Outer().eval()
            plain = [b.forward for b in o.blocks]
            tcs = [torch.compile(f, **kw) for f in plain]
            cachecompile.compile_repeated_blocks(o, blocks=[mod.Net], **kw)
            def chain(fs):
                def run(x):
                    for f in fs:
                        x = f(x)
                    return x
                return run
            return o, chain(plain), chain(tcs), o
        if form == "decorated_forward":
            m = mod.NetDec().eval()
        elif form == "class_decorator":
            m = mod.NetCls().eval()
        else:
            m = mod.Net().eval()
        def eager(x):
            return mod.Net.forward(m, x)
        if form == "method":
            return m, eager, torch.compile(m.forward, **kw), cache_compile(m.forward, **kw)
        if form == "module":
            return m, eager, torch.compile(m, **kw), cache_compile(m, **kw)
        # The decorated forms: torch.compile of the same body (each case its own code:
        # Dynamo's cache and recompile limit are per code object).
        plain = torch.compile(mod.Net.forward, **kw)
        return m, eager, (lambda x: plain(m, x)), m

    def events(form, cached, m):
        if form == "repeated_blocks":
            return [e[0] for b in m.blocks for e in b.forward.events]
        if form in ("decorated_forward", "class_decorator"):
            return [e[0] for e in m.forward.events]
        if form == "module":
            return [e[0] for e in cached._class_cached.events]
        return [e[0] for e in cached.events]

    for name, backend, form, fullgraph in names:
        r = out[name] = {"calls": []}
        os.environ["WGEN_BACKEND"] = backend
        try:
            mod = importlib.import_module(name)
            m, eager, tc, cached = forms(mod, form, fullgraph, backend)
            holder = m if m is not None else None
            with torch.no_grad():
                for which in seq:
                    mod.set_state(holder, which)
                    want = eager(x)
                    want_state = mod.state(holder)
                    mod.set_state(holder, which)
                    t = tc(x)
                    t_state = mod.state(holder)
                    mod.set_state(holder, which)
                    got = cached(x)
                    got_state = mod.state(holder)
                    r["calls"].append({
                        "which": which,
                        "out": same(got, want), "state": same_state(got_state, want_state),
                        "tc_out": same(got, t), "tc_state": same_state(got_state, t_state),
                        "tc_eager": same(t, want) and same_state(t_state, want_state),
                        "got_state": got_state, "want_state": want_state})
            r["events"] = events(form, cached, m)
        except Exception as e:
            import traceback
            r["error"] = (f"{type(e).__name__}: {e}"[:300] + " | "
                          + traceback.format_exc()[-600:])
    report(out)
''')
