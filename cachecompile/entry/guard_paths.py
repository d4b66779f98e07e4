"""Dynamo's source expressions as object paths, torch-free.

``L['self']._modules['lin'].weight`` is a path from the call's frame: the step to
``self``, then ``_modules``, then ``['lin']``, then ``weight``. The guard tree follows
these steps with one shared accessor each (:mod:`cachecompile.entry.guard_tree`), and
``cachectl program --tree`` prints an entry's guards the same way (:func:`render`).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

# A step: ("item", key) from a dict, list or tuple; ("attr", name); ("type", None) for
# type(x); ("dict", None) for dict(mapping proxy), which reads as the proxy itself;
# ("key", i) for list(dict.keys(d))[i] and ("value", i) for d's value at that key, as
# Dynamo names a dict it iterated.
Step = tuple[str, Any]
# The frame dict holds the replayed globals under this name (G['X'] is frame[G]['X']).
FRAME_GLOBALS = "__cc_G"

# The C++ leaf each guard kind becomes in the tree ("python": checked by one Python
# function on the tree's root); guard_kinds.TABLE reads its ``leaf`` from here.
LEAVES: Mapping[str, str] = {
    "global_state": "GLOBAL_STATE", "modes": "TORCH_FUNCTION_MODE_STACK",
    "default_device": "DEFAULT_DEVICE",
    "type": "TYPE_MATCH", "eq": "EQUALS_MATCH", "len": "DICT_LENGTH / LENGTH_CHECK",
    "keys": "keys ==", "hasattr": "NO_HASATTR / hasattr", "contains": "DICT_CONTAINS",
    "not_in_dict": "DICT_CONTAINS on __dict__", "ident": "ID_MATCH",
    "tensor": "TENSOR_MATCH", "alias": "NO_TENSOR_ALIASING + OBJECT_ALIASING",
    "overlap": "python", "expr": "python",
}
# Kinds that are leaves on the root, about the process or several paths at once.
ROOT_KINDS = ("global_state", "alias", "modes", "default_device")
# An expression the tree checks natively though it is no path: a variable read while
# unset, as a membership leaf on os.environ's own dict.
UNSET_ENV = re.compile(r"not ___environ_has\(('[A-Za-z_][A-Za-z0-9_]*')\)")
# A global a module must not define (it would shadow a builtin its code calls), as a
# membership leaf on the module's own dict: the method's module (G['__name__']) or one a
# function it inlines comes from (by name).
NO_GLOBAL = re.compile(r"not ___module_has\((G\['__name__'\]|'[A-Za-z_][\w.]*'), "
                       r"('[A-Za-z_][A-Za-z0-9_]*')\)")


@functools.lru_cache(maxsize=16384)
def path(expr: str) -> tuple[Step, ...] | None:
    """``L['self']._modules['lin'].weight`` -> steps from the frame dict; None if the
    expression is not a plain object path (a call, an operator).

    Cached, and a trailing ``.name``, ``['key']`` or ``[i]`` is split off the text and its
    prefix looked up the same way: an entry's guards share long prefixes, so most of a
    tree's paths cost a dict lookup instead of a parse."""
    m = _SUFFIX.match(expr)
    if m is not None and not _ROOT.fullmatch(m["base"]):
        base = path(m["base"])
        if base is not None:
            if m["attr"] is not None:
                return (*base, ("attr", m["attr"]))
            key: Any = m["key"] if m["key"] is not None else int(m["index"])
            return (*base, ("item", key))
        # The prefix is no path alone (list(dict.keys(d))[i]): the whole is parsed.
    return _parse(expr)


# A last step that needs no parse: .name, ['key'] (no quote or backslash in it), [i].
_SUFFIX = re.compile(r"(?P<base>.+?)(?:\.(?P<attr>[A-Za-z_]\w*)|\['(?P<key>[^'\\]*)'\]"
                     r"|\[(?P<index>0|[1-9]\d*)\])$", re.DOTALL)
# L['x'] and G['x'] themselves: parsed (they are where a path starts).
_ROOT = re.compile(r"[LG]\['[^'\\]*'\]")


def _parse(expr: str) -> tuple[Step, ...] | None:
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None
    steps: list[Step] = []
    while True:
        if (key := _indexed_key(node)) is not None:
            steps.append(("key", key[1]))
            node = key[0]
        elif isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
            node = node.value
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and isinstance(node.value, ast.Name) and node.value.id in ("L", "G")):
            steps.append(("item", node.slice.value))
            if node.value.id == "G":
                steps.append(("item", FRAME_GLOBALS))
            break
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            steps.append(("item", node.slice.value))
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("type", "dict") and len(node.args) == 1
              and not node.keywords):
            # type(x) is an accessor; dict(m) over a class's mapping proxy reads as m.
            steps.append((node.func.id, None))
            node = node.args[0]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "___odict_getitem" and len(node.args) == 2
              and isinstance(node.args[1], ast.Constant) and not node.keywords):
            steps.append(("item", node.args[1].value))
            node = node.args[0]
        elif (isinstance(node, ast.Call) and _is_name_attr(node.func, "dict", "__getitem__")
              and len(node.args) == 2 and not node.keywords
              and (key := _indexed_key(node.args[1])) is not None
              and ast.dump(key[0]) == ast.dump(node.args[0])):
            steps.append(("value", key[1]))
            node = node.args[0]
        else:
            return None
    return tuple(steps[::-1])


def _indexed_key(node: ast.expr) -> tuple[ast.expr, int] | None:
    """``list(dict.keys(X))[i]`` -> (X, i)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and type(node.slice.value) is int):
        return None
    inner = node.value
    if not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name)
            and inner.func.id == "list" and len(inner.args) == 1 and not inner.keywords):
        return None
    keys = inner.args[0]
    if not (isinstance(keys, ast.Call) and _is_name_attr(keys.func, "dict", "keys")
            and len(keys.args) == 1 and not keys.keywords):
        return None
    return keys.args[0], node.slice.value


def _is_name_attr(node: ast.expr, name: str, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr
            and isinstance(node.value, ast.Name) and node.value.id == name)


def label(step: Step) -> str:
    """A step as text: ``.name``, ``['key']``, ``.__dict__``, ``type()``."""
    how, key = step
    if how == "attr":
        return f".{key}"
    if how == "item":
        return f"[{key!r}]"
    if how == "__dict__":
        return ".__dict__"
    if how == "type_dict":
        return ".__dict__ (the class's own)"
    if how == "dict":
        return ""
    if how in ("key", "value"):
        return f".{how}s()[{key}]"
    return f"{how}()"


def _label(step: Step, depth: int) -> str:
    if depth == 0:
        return "G (globals)" if step[1] == FRAME_GLOBALS else str(step[1])
    return label(step)


def render(guards: Iterable[Mapping[str, Any]]) -> str:
    """The guards as the tree checks them: each object path once, indented by step, with
    the leaves on it; then what runs in Python on the root. The exact leaf for a length,
    key or equality test of an unusual type is chosen on the live object (and may be a
    Python check on that node), and so is what is skipped while unchanged: a leaf that
    the object's identity decides, on a path from a module through dict-held attributes,
    runs only once one of those dicts changed (entry/guard_tree.py)."""
    trie: dict[Step, Any] = {}
    leaves: dict[tuple[Step, ...], list[str]] = {}
    python: list[str] = []
    root: list[str] = []
    for g in guards:
        kind = str(g.get("kind"))
        leaf = LEAVES.get(kind, "python")
        text = str(g.get("text") or g.get("expr") or kind)
        steps = path(str(g["expr"])) if g.get("expr") else None
        if kind == "expr" and UNSET_ENV.fullmatch(str(g.get("expr") or "")):
            root.append(f"DICT_CONTAINS on os.environ  {text}")
            continue
        if leaf == "python" or steps is None and kind not in ROOT_KINDS:
            python.append(text)
            continue
        if steps is None:
            root.append(f"{leaf}  {text}")
            continue
        node = trie
        for s in steps:
            node = node.setdefault(s, {})
        leaves.setdefault(tuple(steps), []).append(f"{leaf}  {text}")
    out = ["frame"] + [f"  {x}" for x in root]

    def walk(node: dict[Step, Any], prefix: tuple[Step, ...], depth: int) -> None:
        for step, sub in node.items():
            here = (*prefix, step)
            out.append("  " * (depth + 1) + _label(step, depth))
            out.extend("  " * (depth + 2) + "- " + x for x in leaves.get(here, ()))
            walk(sub, here, depth + 1)

    walk(trie, (), 0)
    if python:
        out.append(f"python ({len(python)}, one function on the root)")
        out.extend(f"  {x}" for x in python)
    return "\n".join(out)
