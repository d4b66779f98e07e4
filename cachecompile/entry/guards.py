"""Dynamo's guards in a portable form, carried in an entry, and the words a miss is
reported in.

A compiled frame is right only while every fact Dynamo guarded at trace time still
holds: the globals and attributes it read, the functions and classes it inlined, the
global state, every tensor's metadata, the symbolic shape relations and input aliasing.
The cold process records those guards (``guard_capture``) in a portable form;
:mod:`cachecompile.entry.checker` turns that list back into plain Python functions over
the method's own arguments, built from the pieces here: the guard bodies
(:func:`guard_lines`, each object path bound once), the user's terms (:func:`user_text`)
and what a call had where a guard wanted another (:func:`describe`).

A portable guard is a dict ``{"kind", "expr", "value", "text", "args"}``: ``expr`` is
Dynamo's source expression (``L['self'].cfg.act``, ``G['CONST']``), ``value`` what it must
match, ``text`` the guard in the user's terms for logs and ``cachectl explain``, and
``args`` whether it reads the call's arguments. What Dynamo checks by object identity
(functions, classes, modules) is compared through :func:`cachecompile.key.identity.identity`: a qualified name
plus a code digest, with closure cells, defaults and partial arguments as values.

This module is on the warm path: it imports ``torch`` only.
"""

from __future__ import annotations

import ast
import enum
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cachecompile.entry import values
from cachecompile.entry.guard_kinds import TypeRef
from cachecompile.key.identity import qualified_name, type_value
from cachecompile.store import settings
from cachecompile.store.jsonvalue import JSON

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


class _PathSharer(ast.NodeTransformer):
    """Replaces each object path (attribute, constant subscript, ``___odict_getitem``) with
    a local bound the first time the path is seen; the bindings are emitted in order.

    One condition at a time, with names of its own (``__cc_L<i>__``): what a condition
    binds depends only on its text, so :func:`_shared_form` keeps it per text, and
    :func:`guard_lines` maps those names onto the body's shared ones."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}
        self.lines: list[tuple[str, str]] = []

    @staticmethod
    def _base_ok(node: ast.AST) -> bool:
        return isinstance(node, ast.Name)

    def _path(self, node: ast.expr) -> ast.expr:
        key = ast.unparse(node)
        name = self.bound.get(key)
        if name is None:
            name = f"__cc_L{len(self.bound)}__"
            self.bound[key] = name
            self.lines.append((name, key))
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


_LOCAL_NAME = re.compile(r"__cc_L(\d+)__")


@functools.lru_cache(maxsize=16384)
def _shared_form(cond: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """``cond`` with each object path bound to a name of its own, in the order a guard
    first reads them: the bindings ``(name, path)`` (a path may read an earlier name) and
    the condition over the names. Kept per text: a compiling process derives the same
    conditions again for each checker of a frame and across a model's frames (parsing
    was ~7% of a graph-breaking model's cold capture)."""
    sharer = _PathSharer()
    tree = sharer.visit(ast.parse(cond, mode="eval"))
    return tuple(sharer.lines), ast.unparse(tree)


def guard_lines(conds: Sequence[str], share_paths: bool) -> str:
    """``if not (cond): return False`` per guard; with ``share_paths`` each object path is
    bound to a local once, where a guard first reads it (this parses every guard)."""
    out = _shared_lines(conds) if share_paths else [f"if not ({c}): return False"
                                                     for c in conds]
    return "\n".join(out) + ("\n" if out else "")


def _shared_lines(conds: Sequence[str]) -> list[str]:
    """The body's lines with each object path bound once, over the conditions' kept
    forms (:func:`_shared_form`), their own names mapped onto the body's."""
    out: list[str] = []
    bound: dict[str, str] = {}   # path, over the body's names -> the body's name
    for cond in conds:
        bindings, text = _shared_form(cond)
        mine: dict[str, str] = {}   # the condition's own name -> the body's

        def body_name(m: re.Match[str], mine: dict[str, str] = mine) -> str:
            return mine.get(m.group(0), m.group(0))

        for name, path in bindings:
            key = _LOCAL_NAME.sub(body_name, path)
            shared = bound.get(key)
            if shared is None:
                shared = f"__cc_p{len(bound)}"
                bound[key] = shared
                out.append(f"{shared} = {key}")
            mine[name] = shared
        out.append(f"if not ({_LOCAL_NAME.sub(body_name, text)}): return False")
    return out


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


def compared_operand(expr: str) -> str | None:
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
