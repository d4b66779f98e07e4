"""Dynamo's guards, carried in an entry and checked in a warm process without Dynamo.

A compiled frame is right only while every fact Dynamo guarded at trace time still
holds: the globals and attributes it read, the functions and classes it inlined, the
global state, every tensor's metadata, the symbolic shape relations and input aliasing.
The cold process records those guards (``guard_capture``) in a portable form; this module
turns that list back into two plain Python functions over the method's own arguments:

* ``per_call``: the guards that read the call's arguments (tensor metadata of inputs,
  shape relations such as ``x.size(0) <= 8``, argument values Dynamo specialised on,
  aliasing between inputs). They run on every call, like Dynamo's.
* ``full``: every guard, including the module's attributes, globals, inlined functions
  and global state. With ``GuardMode.ALWAYS`` (the default) it runs on every call; with
  ``GuardMode.FIRST`` on each signature's first call in a process.

A portable guard is a dict ``{"kind", "expr", "value", "text", "args"}``: ``expr`` is
Dynamo's source expression (``L['self'].cfg.act``, ``G['CONST']``), ``value`` what it must
match, ``text`` the guard in the user's terms for logs and ``cachectl explain``, and
``args`` whether it reads the call's arguments. What Dynamo checks by object identity
(functions, classes, modules) is compared through :func:`cachecompile.key.identity.identity`: a qualified name
plus a code digest, with closure cells, defaults and partial arguments as values.

This module is on the warm path: it imports ``torch`` only (private names through
:mod:`cachecompile._torch.runtime`).
"""

from __future__ import annotations

import ast
import base64
import collections
import dataclasses
import enum
import functools
import inspect
import json
import logging
import math
import os
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import xxhash

from cachecompile._torch import runtime
from cachecompile._types import JSON
from cachecompile.entry import codeobj, values
from cachecompile.entry.guard_kinds import KINDS, TABLE, TypeRef
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key.identity import qualified_name, type_value
from cachecompile.store import settings

logger = logging.getLogger(__name__)

GuardDict = dict[str, JSON]

class GuardMode(enum.Enum):
    """When a loaded entry's guards run (``cache_compile(guards=...)``)."""

    # Every guard on every call, as torch.compile does (the default).
    ALWAYS = "always"
    # TorchAir's behaviour (opt-in): the argument guards on every call, the state guards
    # only on each signature's first call in a process (state changed later is not seen).
    FIRST = "first"

    @classmethod
    def from_env(cls) -> GuardMode:
        """``$CACHECOMPILE_GUARDS``, or ALWAYS; an unknown value warns (settings.py)."""
        return cls(settings.GUARDS.get())


LOCAL_RE = re.compile(r"\bL\[['\"]([A-Za-z_]\w*)['\"]\]")
GLOBAL_RE = re.compile(r"\bG\[['\"]([^'\"]+)['\"]\]")


# -- tensors ------------------------------------------------------------------------------
def tensor_facts(t: torch.Tensor, sizes: Sequence[int | None] | None = None,
                 strides: Sequence[int | None] | None = None) -> JSON:
    """What Dynamo's TENSOR_MATCH checks: class, dtype, device, grad, rank, static dims."""
    return {
        "type": type_value(type(t)),
        "dtype": str(t.dtype).replace("torch.", ""),
        "device": str(t.device),
        "requires_grad": bool(t.requires_grad),
        "sizes": list(t.shape) if sizes is None else list(sizes),
        "strides": list(t.stride()) if strides is None else list(strides),
    }


# -- rendering in the user's terms ----------------------------------------------------------
def user_text(expr: str, module_name: str = "") -> str:
    """``L['self'].cfg.act`` -> ``self.cfg.act``; ``G['CONST']`` -> ``module.CONST``."""
    out = LOCAL_RE.sub(lambda m: m.group(1), expr)
    prefix = f"{module_name}." if module_name else ""

    def name(m: re.Match[str]) -> str:
        # Names Dynamo generated for objects it installed in the frame's globals: said as
        # what they stand for, never as the generated name.
        n = m.group(1)
        if n.startswith("__builtins_dict___"):
            return "builtins"
        if n.startswith("___unnamed_scope"):
            return "<the globals of a traced function>"
        return prefix + n
    return GLOBAL_RE.sub(name, out)


# The pure helpers Dynamo's source expressions and shape guards may name
# (``___odict_getitem(L['self']._modules, 'lin')``, ``not __math_isnan(...)``).
_EXPR_HELPERS: dict[str, Any] = {
    "math": math, "torch": torch, "inf": float("inf"), "device": torch.device,
    "___odict_getitem": collections.OrderedDict.__getitem__,
    "___dict_contains": lambda a, b: dict.__contains__(b, a),
    "___namedtuple_fields": lambda x: x._fields,
    "___dataclass_fields": dataclasses.fields,
    "__math_isnan": math.isnan,
    "___as_tensor": runtime.as_tensor_fullprec,
    # Whether an environment variable is set (guard_capture: variables read while unset).
    "___environ_has": lambda name: name in os.environ,
    "___environ_get": lambda name: os.environ.get(name),
    # Whether a module defines a global (guard_capture: a builtin the method calls is not
    # shadowed by one); a module not in sys.modules has none we could see.
    "___module_has": lambda module, name: name in getattr(sys.modules.get(module), "__dict__", ()),
    "___module_get": lambda module, name: getattr(sys.modules.get(module), "__dict__", {})[name],
}


# -- checkers -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Parts:
    """What the checker was compiled from, for :mod:`cachecompile.entry.guard_tree`:
    the guards in check order, each one's Python condition, and the namespace and
    parameter text those conditions run in."""

    func: types.FunctionType
    guards: list[GuardDict]
    conds: list[str]
    env: dict[str, Any]
    params: str
    names: list[str]

    def function(self, name: str, src: str) -> Callable[..., Any]:
        """``src`` (defining ``name``) compiled in the checker's namespace."""
        exec(compile(src, f"<cachecompile {name} {self.func.__qualname__}>", "exec"),
             self.env)
        fn: Callable[..., Any] = self.env[name]
        return fn


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a kind's Python check is compiled with (guard_kinds.Source)."""

    const: Callable[[Any], str]
    rewrite: Callable[[str], str]


class Checker:
    """The compiled guard functions of one entry, bound to the live method."""

    def __init__(self, per_call: Callable[..., bool], full: Callable[..., bool],
                 explain: Callable[..., str | None], n_guards: int, n_per_call: int,
                 parts: Parts,
                 failure: Callable[..., tuple[str, str, str] | None] | None = None,
                 lines: Callable[[], dict[str, str]] | None = None) -> None:
        self.per_call = per_call
        # The bodies an entry stores so that a warm process parses no guard (computed
        # when asked: the compiling process asks once, at publish).
        self.lines = lines or (lambda: {})
        self.full = full
        self.explain = explain
        # The first failing guard, found once: (the explanation, what the guard is about:
        # ``input_ids``, ``self.n``, ``global state``, bounded by the code, not the values,
        # so counters can be kept per subject, and the value this entry was made for, as
        # text); None when every guard holds.
        self.failure = failure or (lambda *a, **k: None)
        self.n_guards = n_guards
        self.n_per_call = n_per_call
        self.parts = parts


def _params(func: types.FunctionType) -> tuple[str, list[str]]:
    """The parameter list text of ``func`` (defaults filled in afterwards) and its names."""
    sig = inspect.signature(func, follow_wrapped=False)
    parts: list[str] = []
    names: list[str] = []
    star_done = False
    for p in sig.parameters.values():
        names.append(p.name)
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star_done:
                parts.append("*")
                star_done = True
            parts.append(f"{p.name}=None" if p.default is not p.empty else p.name)
        elif p.kind is p.POSITIONAL_ONLY:
            parts.append(f"{p.name}=None" if p.default is not p.empty else p.name)
        else:
            parts.append(f"{p.name}=None" if p.default is not p.empty else p.name)
    if any(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values()):
        last = max(i for i, p in enumerate(sig.parameters.values()) if p.kind is p.POSITIONAL_ONLY)
        parts.insert(last + 1, "/")
    return ", ".join(parts), names


def build_checker(func: types.FunctionType, guards: Sequence[GuardDict],
                  globals_: Mapping[str, Any], *, every_call: bool = False,
                  lines: Mapping[str, Any] | None = None) -> Checker:
    """Compile ``guards`` into functions that take exactly the method's arguments.

    ``every_call``: ``full`` will run on every call (``guards="always"``), so its object
    paths are shared (see ``_guard_lines``). Otherwise it runs once per signature and is
    compiled as it is: sharing parses every guard, which costs a warm start more than
    the one check saves (~0.2 s for a decoder's few hundred guards on a slow core).

    ``lines``: the entry's stored :meth:`Checker.lines` (``meta["checker"]``), the shared
    bodies the compiling process derived from these very conditions: used only where
    their digest is that of the conditions derived here, so a warm process parses no
    guard (one ``compile`` per entry) and never runs a body made for other guards."""
    params, names = _params(func)
    freevars = func.__code__.co_freevars
    env: dict[str, Any] = {"__cc_G": globals_, "__cc_closure": func.__closure__ or (),
                           **_EXPR_HELPERS}
    conds: list[tuple[str, bool, str]] = []   # (python expression, per call, text)
    observed: list[tuple[str, str]] = []        # (guarded expression, kind), for explain

    def const(v: Any) -> str:
        name = f"__cc_c{len(env)}"
        env[name] = v
        return name

    known = (tuple(names), tuple(freevars))

    def rewrite(expr: str) -> str:
        return _rewrite(expr, known)

    ordered = sorted(guards, key=lambda g: _KIND_RANK.get(g["kind"], 99))
    src = _Source(const, rewrite)
    for g in ordered:
        kind, text = g["kind"], g.get("text", "")
        per_call = bool(g.get("args"))
        e = rewrite(g.get("expr", "")) if g.get("expr") else ""
        if kind not in TABLE:
            raise UnsupportedProgramError(f"entry holds a guard of unknown kind {kind!r}")
        cond = TABLE[kind].python(src, e, g.get("value"))
        conds.append((cond, per_call, text))
        observed.append((e, kind))

    every = "\n".join(c for c, _, _ in conds) if freevars else ""
    prologue = "".join(f"    {n} = __cc_closure[{i}].cell_contents\n"
                       for i, n in enumerate(freevars) if n in every)

    per = [c for c, p, _ in conds if p]

    def compiled(src: str, names: Sequence[str], where: str) -> list[Callable[..., Any]]:
        try:
            code = compile(src, f"<cachecompile {where} {func.__qualname__}>", "exec")
        except SyntaxError as err:
            raise UnsupportedProgramError(f"guards do not compile: {err}") from err
        return loaded(code, names)

    def loaded(code: types.CodeType, names: Sequence[str]) -> list[Callable[..., Any]]:
        exec(code, env)
        out: list[Callable[..., Any]] = []
        for n in names:
            f = env[n]
            f.__defaults__ = func.__defaults__
            f.__kwdefaults__ = func.__kwdefaults__
            out.append(f)
        return out

    all_conds = [c for c, _, _ in conds]
    digest = _conds_digest(conds, params, prologue)
    stored = lines if lines is not None and lines.get("digest") == digest else None
    shared: dict[str, str] = {}
    if stored is not None:
        shared["per_call"], shared["full"] = str(stored["per_call"]), str(stored["full"])

    def body(which: str, selected: list[str], share: bool) -> str:
        if not share:
            return guard_lines(selected, False)
        if which not in shared:
            shared[which] = guard_lines(selected, True)
        return shared[which]

    def fn(name: str, body_text: str) -> str:
        # Guards run in order and stop at the first that fails; with path sharing each
        # object path they read (``self.m._modules['h']...``) is evaluated once, where a
        # guard first needs it, as Dynamo's guard tree shares its accessors. A guard that
        # raises (a missing attribute, a wrong type) is a failed guard.
        return (f"def {name}({params}):\n    try:\n{indent(prologue)}{indent(indent(body_text))}"
                "        return True\n    except Exception:\n        return False\n")

    def source(share_full: bool) -> str:
        return (fn("__cc_per_call", body("per_call", per, True))
                + fn("__cc_full", body("full", all_conds, share_full)))

    names_ = ("__cc_per_call", "__cc_full")
    code = _stored_code(stored) if stored is not None and every_call else None
    if code is not None:
        # The code object the compiling process compiled from these very bodies: no
        # parse and no compile here (its constants are plain; codeobj checks them).
        per_call_fn, full_fn = loaded(code, names_)
    else:
        per_call_fn, full_fn = compiled(source(every_call), names_, "guards")

    def stored_lines() -> dict[str, str]:
        """What the entry stores so that a warm process builds this checker without
        parsing a guard or compiling (``meta["checker"]``): the shared bodies and their
        code object (marshal, base64), for ``guards="always"``."""
        out = {"digest": digest, "per_call": body("per_call", per, True),
               "full": body("full", all_conds, True)}
        data, consts = codeobj.dumps(compile(source(True), f"<cachecompile guards "
                                             f"{func.__qualname__}>", "exec"))
        if not consts:
            out["code"] = base64.b64encode(data).decode("ascii")
        return out
    texts = [t for _, _, t in conds]
    guards_by_index = ordered

    def first_failure(*args: Any, **kwargs: Any) -> int:
        # Only on a miss: which guard failed first, compiled when first needed (a warm hit
        # never pays for it). A guard that raises (it reads an attribute that is gone) is
        # that guard failing, named as such, not an anonymous error.
        if "__cc_first_failure" not in env:
            lines = [f"        try:\n            if not ({c}): return {i}\n"
                     f"        except Exception:\n            return {i}\n"
                     for i, (c, _, _) in enumerate(conds)]
            try:
                compiled(f"def __cc_first_failure({params}):\n    try:\n{indent(prologue)}"
                         + "".join(lines) + "    except Exception:\n        return -2\n"
                         "    return -1\n", ("__cc_first_failure",), "guard report")
            except UnsupportedProgramError:  # the same guards compiled as ``full``: unseen
                return -2
        return int(env["__cc_first_failure"](*args, **kwargs))

    def explain(*args: Any, **kwargs: Any) -> str | None:
        return _explain_at(first_failure(*args, **kwargs), args, kwargs)

    def _explain_at(i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        if i == -1:
            return None
        if i == -2:
            return "a guard raised while being checked"
        text = texts[i] or conds[i][0]
        expr, kind = observed[i]
        if kind == "global_state":
            # Say which setting changed (autocast, grad mode, threads, ...), with both values.
            diff = runtime.global_state_difference(str(guards_by_index[i].get("value")))
            return f"{text} (changed: {diff})" if diff else text
        if not expr:
            return text
        if kind == "expr":
            # ``n == 2`` failed: say what ``n`` was (3), not what the comparison was (False).
            expr = _compared_operand(expr) or expr
        # Only on a miss: evaluate the guarded expression to say what the call had.
        src = f"def __cc_observe({params}):\n{prologue}    return {expr}\n"
        try:
            scope = dict(env)
            exec(compile(src, "<cachecompile observe>", "exec"), scope)
            obs = scope["__cc_observe"]
            obs.__defaults__, obs.__kwdefaults__ = func.__defaults__, func.__kwdefaults__
            got = describe(obs(*args, **kwargs), kind, guards_by_index[i].get("value"))
        except AttributeError as e:  # the attribute is gone: say which
            got = f"no attribute {e.name!r}: it is gone" if e.name else f"nothing: {e}"
        except (KeyError, IndexError) as e:
            got = f"no item {e.args[0]!r}: it is gone" if e.args else "nothing: an item is gone"
        except Exception as e:  # the expression itself failed: say so
            got = f"the expression could not be read ({type(e).__name__}: {e})"
        return f"{text} (got {got})"

    def _subject_at(i: int) -> str:
        if i < 0:
            return "a guard that raised"
        g = guards_by_index[i]
        kind = str(g.get("kind"))
        if kind in ("global_state", "modes", "default_device"):
            return kind.replace("_", " ")
        expr = str(g.get("expr") or "")
        if kind == "expr":
            expr = _compared_operand(expr) or expr
        return user_text(expr) or kind

    def failure(*args: Any, **kwargs: Any) -> tuple[str, str, str] | None:
        i = first_failure(*args, **kwargs)
        if i == -1:
            return None
        wanted = "" if i < 0 else json.dumps(guards_by_index[i].get("value"), sort_keys=True,
                                               default=repr)
        return _explain_at(i, args, kwargs) or "a guard failed", _subject_at(i), wanted

    return Checker(per_call=per_call_fn, full=full_fn, explain=explain,
                   n_guards=len(conds), n_per_call=len(per), failure=failure,
                   lines=stored_lines,
                   parts=Parts(func=func, guards=list(ordered), conds=[c for c, _, _ in conds],
                               env=env, params=params, names=names))


# The order a checker runs the kinds in, by name.
_KIND_RANK = {k: i for i, k in enumerate(KINDS)}


@functools.lru_cache(maxsize=1 << 16)
def _rewrite(expr: str, known: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    """Dynamo's source expression in the checker's names (``L['x']`` -> ``x``,
    ``G['n']`` -> ``__cc_G['n']``); ``known``: the method's parameters and free
    variables, the only locals a guard may read. Cached: the entries of one method (its
    sizes, its variants) hold mostly the same expressions."""
    names, freevars = known

    def local(m: re.Match[str]) -> str:
        n = m.group(1)
        if n not in names and n not in freevars:
            raise UnsupportedProgramError(f"guard reads an unknown local {n!r}: {expr}")
        return n
    return GLOBAL_RE.sub(lambda m: f"__cc_G[{m.group(1)!r}]", LOCAL_RE.sub(local, expr))


def _stored_code(stored: Mapping[str, Any]) -> types.CodeType | None:
    """The checker's code object an entry stores (see ``Checker.lines``); None where it
    holds none or it does not load (then the bodies are compiled)."""
    data = stored.get("code")
    if not isinstance(data, str):
        return None
    try:
        return codeobj.loads(base64.b64decode(data, validate=True), [])
    except (UnsupportedProgramError, ValueError):
        logger.debug("stored guard code does not load: compiling its bodies", exc_info=True)
        return None


def _conds_digest(conds: Sequence[tuple[str, bool, str]], params: str, prologue: str) -> str:
    """What a stored body was derived from: the checker's parameters and closure prologue,
    every condition, in order, and which run per call."""
    h = xxhash.xxh3_128()
    h.update(f"{params}\0{prologue}\0".encode())
    for cond, per_call, _ in conds:
        h.update(f"{int(per_call)}{cond}\0".encode())
    return h.hexdigest()


class _PathSharer(ast.NodeTransformer):
    """Replaces each object path (attribute, constant subscript, ``___odict_getitem``) with
    a local bound the first time the path is seen; the bindings are emitted in order."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}
        self.lines: list[str] = []

    @staticmethod
    def _base_ok(node: ast.AST) -> bool:
        return isinstance(node, ast.Name)

    def _path(self, node: ast.expr) -> ast.expr:
        key = ast.unparse(node)
        name = self.bound.get(key)
        if name is None:
            name = f"__cc_p{len(self.bound)}"
            self.bound[key] = name
            self.lines.append(f"{name} = {key}")
        return ast.Name(id=name, ctx=ast.Load())

    def visit_Attribute(self, node: ast.Attribute) -> ast.expr:
        node = self.generic_visit(node)  # type: ignore[assignment]
        return self._path(node) if self._base_ok(node.value) else node

    def visit_Subscript(self, node: ast.Subscript) -> ast.expr:
        node = self.generic_visit(node)  # type: ignore[assignment]
        if self._base_ok(node.value) and isinstance(node.slice, ast.Constant):
            return self._path(node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.expr:
        node = self.generic_visit(node)  # type: ignore[assignment]
        if (isinstance(node.func, ast.Name) and node.func.id == "___odict_getitem"
                and len(node.args) == 2 and not node.keywords
                and self._base_ok(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            return self._path(node)
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.Lambda:
        return node  # its names are its own parameters: nothing to share


def guard_lines(conds: Sequence[str], share_paths: bool) -> str:
    """``if not (cond): return False`` per guard; with ``share_paths`` each object path is
    bound to a local once, where a guard first reads it (this parses every guard)."""
    sharer = _PathSharer() if share_paths else None
    out: list[str] = []
    for cond in conds:
        if sharer is not None:
            tree = sharer.visit(ast.parse(cond, mode="eval"))
            out.extend(sharer.lines)
            sharer.lines = []
            cond = ast.unparse(tree)
        out.append(f"if not ({cond}): return False")
    return "\n".join(out) + ("\n" if out else "")


def describe(v: Any, kind: str, expected: Any = None) -> str:
    """A value as a miss reports it: what the call had where a guard wanted another."""
    if kind == "type":
        v = type(v)
    if isinstance(v, torch.Tensor) and kind != "type":
        dims = ",".join(str(d) for d in v.shape)
        strides = ",".join(str(s) for s in v.stride())
        grad = ", requires_grad" if v.requires_grad else ""
        got = (f"{type(v).__name__} {str(v.dtype).replace('torch.', '')}[{dims}] on {v.device}"
               f", strides [{strides}]{grad}")
        differs = _tensor_differences(v, expected) if kind == "tensor" else []
        return f"{got}: {'; '.join(differs)}" if differs else got
    if isinstance(v, type):
        want = TypeRef(expected) if expected is not None else None
        if want is not None and qualified_name(v) == want.qual:
            return f"{qualified_name(v)} with other method code"
        return qualified_name(v)
    if kind == "ident":
        return qualified_name(v) if hasattr(v, "__qualname__") else values.short(v)
    if kind == "len":
        return f"length {len(v)}"
    if kind == "contains" and isinstance(expected, Mapping) and "key" in expected:
        key = values.decode_value(expected["key"])
        try:
            there = key in v
            return (f"{key!r} is there: {values.short(v[key])}" if there
                    else f"{key!r} is missing")
        except Exception:  # a container we cannot read: show it
            return values.short(v)
    return values.short(v)


# A membership helper of the guards and the one that reads what is there.
_HAS_TO_GET = {"___environ_has": "___environ_get", "___module_has": "___module_get"}


def _compared_operand(expr: str) -> str | None:
    """The left side of a one-operator comparison whose right side is a constant
    (``x.n == 2`` -> ``x.n``), the variable's value for ``not ___environ_has('X')``,
    else None."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None
    if (isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.Not)
            and isinstance(tree.operand, ast.Call)
            and isinstance(tree.operand.func, ast.Name)
            and tree.operand.func.id in _HAS_TO_GET):
        return ast.unparse(ast.Call(ast.Name(_HAS_TO_GET[tree.operand.func.id], ast.Load()),
                                    tree.operand.args, []))
    if (isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.Not)
            and isinstance(tree.operand, ast.Call) and len(tree.operand.args) == 1
            and not tree.operand.keywords):
        # not math.isnan(x): what x was, not False.
        return ast.unparse(tree.operand.args[0])
    if (isinstance(tree, ast.Compare) and len(tree.ops) == 1
            and isinstance(tree.comparators[0], (ast.Constant, ast.UnaryOp))
            and not isinstance(tree.left, ast.Constant)):
        return ast.unparse(tree.left)
    return None


def _tensor_differences(t: torch.Tensor, facts: Any) -> list[str]:
    """Which of a tensor guard's facts the call's tensor does not have, each with both
    values (``strides [1, 1], the entry's [8, 1]``). The twin of :func:`_tensor_check`'s
    closure, which stays a bare bool on the hot path; this one runs only on a miss."""
    if not isinstance(facts, Mapping):
        return []
    out: list[str] = []

    def differ(name: str, got: Any, want: Any) -> None:
        if got != want:
            out.append(f"{name} {got}, the entry's {want}")

    differ("dtype", str(t.dtype).replace("torch.", ""), facts.get("dtype"))
    differ("device", str(t.device), facts.get("device"))
    differ("requires_grad", bool(t.requires_grad), facts.get("requires_grad"))
    want_sizes = list(facts.get("sizes") or [])
    if t.dim() != len(want_sizes):
        out.append(f"rank {t.dim()}, the entry's {len(want_sizes)}")
        return out
    for name, got, want in (("sizes", list(t.shape), want_sizes),
                            ("strides", list(t.stride()), list(facts.get("strides") or []))):
        if any(w is not None and g != w for g, w in zip(got, want, strict=False)):
            differ(name, got, ["*" if w is None else w for w in want])
    return out


def indent(block: str) -> str:
    return "".join("    " + line + "\n" for line in block.splitlines())
