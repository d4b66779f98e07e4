"""Dynamo's source expressions as object paths, torch-free.

``L['self']._modules['lin'].weight`` is a path from the call's frame: the step to
``self``, then ``_modules``, then ``['lin']``, then ``weight``. The guard tree follows
these steps with one shared accessor each (:mod:`cachecompile.entry.guard_tree`), and
``cachectl program --tree`` prints an entry's guards the same way (:func:`render`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from typing import Any

# A step: ("item", key) from a dict, list or tuple; ("attr", name); ("type", None) for
# type(x); ("dict", None) for dict(mapping proxy), which reads as the proxy itself.
Step = tuple[str, Any]
# The frame dict holds the replayed globals under this name (G['X'] is frame[G]['X']).
FRAME_GLOBALS = "__cc_G"

# The C++ leaf each guard kind becomes in the tree ("python": checked by one Python
# function on the tree's root); guard_kinds.TABLE reads its ``leaf`` from here.
LEAVES: Mapping[str, str] = {
    "global_state": "GLOBAL_STATE", "modes": "python", "default_device": "python",
    "type": "TYPE_MATCH", "eq": "EQUALS_MATCH", "len": "DICT_LENGTH / LENGTH_CHECK",
    "keys": "keys ==", "hasattr": "NO_HASATTR / hasattr", "contains": "DICT_CONTAINS",
    "not_in_dict": "DICT_CONTAINS on __dict__", "ident": "ID_MATCH",
    "tensor": "TENSOR_MATCH", "alias": "NO_TENSOR_ALIASING + OBJECT_ALIASING",
    "overlap": "python", "expr": "python",
}


def path(expr: str) -> list[Step] | None:
    """``L['self']._modules['lin'].weight`` -> steps from the frame dict; None if the
    expression is not a plain object path (a call, an operator)."""
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None
    steps: list[Step] = []
    while True:
        if isinstance(node, ast.Attribute):
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
        else:
            return None
    return steps[::-1]


def _label(step: Step, depth: int) -> str:
    how, key = step
    if depth == 0:
        return "G (globals)" if key == FRAME_GLOBALS else str(key)
    if how == "attr":
        return f".{key}"
    if how == "item":
        return f"[{key!r}]"
    return f"{how}()"


def render(guards: Iterable[Mapping[str, Any]]) -> str:
    """The guards as the tree checks them: each object path once, indented by step, with
    the leaves on it; then what runs in Python on the root. The exact leaf for a length,
    key or equality test of an unusual type is chosen on the live object (and may be a
    Python check on that node)."""
    trie: dict[Step, Any] = {}
    leaves: dict[tuple[Step, ...], list[str]] = {}
    python: list[str] = []
    root: list[str] = []
    for g in guards:
        kind = str(g.get("kind"))
        leaf = LEAVES.get(kind, "python")
        text = str(g.get("text") or g.get("expr") or kind)
        steps = path(str(g["expr"])) if g.get("expr") else None
        if leaf == "python" or steps is None and kind not in ("global_state", "alias"):
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
