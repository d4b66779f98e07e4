"""A loaded entry's guards as Dynamo's C++ guard tree: every guard on every call, fast.

The Python checker (:mod:`cachecompile.entry.guards`) is the truth: it compares what the
entry was traced against in portable terms (a function by qualified name and code, a
tensor by its facts). Once it has passed on a call, this module builds a tree of Dynamo's
own C++ guard managers from the same guards and the live objects it just verified:

* each object path (``L['self']._modules['lin'].weight``) becomes a chain of accessors,
  shared between guards as Dynamo shares them;
* a portable identity becomes an identity match on the object that passed (held strongly,
  so its id cannot be reused), a class a type match, a value an equality match, a tensor
  Dynamo's TENSOR_MATCH, aliasing its aliasing guards, the global state its own guard;
* what has no native leaf (shape relations, environment reads, memory overlap, function
  modes) runs as one Python function on the tree's root, the checker's own conditions.

Every native leaf is at least as strict as its Python guard, so a tree that passes means
the Python check would. When the tree fails, the Python check decides
(:class:`EveryCall`): an equal replacement object (a new config with the same values)
passes it and the tree is built again, up to :data:`MAX_BUILDS` times.
"""

from __future__ import annotations

import ast
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from cachecompile._torch import guard_tree as native
from cachecompile.entry import values
from cachecompile.entry.guards import Parts, guard_lines, indent

logger = logging.getLogger(__name__)

# Builds per loaded variant: past this many (state replaced by equal objects call after
# call), the variant keeps the Python check.
MAX_BUILDS = 8
_FRAME_GLOBALS = "__cc_G"

Step = tuple[str, Any]


def _path(expr: str) -> list[Step] | None:
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
            key = node.slice.value
            steps.append(("item", key))
            if node.value.id == "G":
                steps.append(("item", _FRAME_GLOBALS))
            break
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            steps.append(("item", node.slice.value))
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("type", "dict") and len(node.args) == 1
              and not node.keywords):
            # type(x) is an accessor; dict(m) over a class's mapping proxy reads as m.
            steps.append(("type", None) if node.func.id == "type" else ("dict", None))
            node = node.args[0]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "___odict_getitem" and len(node.args) == 2
              and isinstance(node.args[1], ast.Constant) and not node.keywords):
            steps.append(("item", node.args[1].value))
            node = node.args[0]
        else:
            return None
    return steps[::-1]


class _Builder:
    def __init__(self, frame: dict[str, Any], enum_: Any) -> None:
        self.frame = frame
        self.enum = enum_
        self.root = native.root()
        self.nodes: dict[tuple[Step, ...], tuple[Any, Any]] = {(): (self.root, frame)}
        self.keep: list[Any] = []     # objects matched by id: held so the id stays theirs
        self.native = 0

    def node(self, expr: str) -> tuple[Any, Any] | None:
        """(manager, live value) for an object path, accessors shared; None if it is not
        one or cannot be read now."""
        steps = _path(expr)
        if steps is None:
            return None
        mgr, obj = self.root, self.frame
        for i in range(len(steps)):
            key = tuple(steps[: i + 1])
            hit = self.nodes.get(key)
            if hit is None:
                how, name = steps[i]
                if how == "dict":
                    # dict(proxy)[k] is proxy[k]: the same node, for a class's __dict__ only.
                    if not isinstance(obj, types.MappingProxyType):
                        return None
                    hit = (mgr, obj)
                else:
                    try:
                        value = (type(obj) if how == "type" else
                                 getattr(obj, name) if how == "attr" else obj[name])
                    except Exception:  # noqa: BLE001 - not readable now: Python checks it
                        return None
                    hit = (native.child(mgr, obj, steps[i], value, expr, self.enum), value)
                self.nodes[key] = hit
            mgr, obj = hit
        return mgr, obj

    def leaf(self, g: dict[str, Any], text: str) -> bool:
        """A native leaf for guard ``g``; False if it has none (it stays Python)."""
        kind = g["kind"]
        value: Any = g.get("value")
        if kind == "global_state":
            native.global_state(self.root, text)
            return True
        if kind == "alias":
            return self.alias(value, text)
        if kind not in _PATH_KINDS or not g.get("expr"):
            return False
        expr = str(g["expr"])
        found = self.node(expr)
        if found is None:
            return False
        mgr, obj = found
        if isinstance(obj, types.MappingProxyType) and kind not in ("len", "contains"):
            return False    # the guard reads dict(proxy) itself: Python checks it
        if kind == "type":
            self.keep.append(type(obj))
            native.type_match(mgr, type(obj), text)
        elif kind == "ident":
            if type(obj) is types.MethodType:   # a new object on every access: match its parts
                for part in ("__func__", "__self__"):
                    sub = getattr(obj, part)
                    self.keep.append(sub)
                    native.id_match(native.child(mgr, obj, ("attr", part), sub, part, self.enum),
                                    sub, text)
            else:
                self.keep.append(obj)
                native.id_match(mgr, obj, text)
        elif kind == "eq":
            expected = values.decode_value(value)
            if type(expected) is type(obj) and isinstance(expected, _IMMUTABLE):
                native.equals(mgr, expected, text)
            elif not isinstance(expected, (bool, int, float)):
                # Python's own comparison, against the decoded value (a fresh object: the
                # live one would follow its own later in-place changes).
                native.predicate(mgr, _equals(expected), text)
            else:
                return False
        elif kind == "len":
            n = int(value)
            if not native.length(mgr, obj, n, text):
                native.predicate(mgr, lambda o: len(o) == n, text)
        elif kind == "keys":
            keys = [values.decode_value(k) for k in value]
            native.predicate(mgr, lambda o: list(o.keys()) == keys, text)
        elif kind == "hasattr":
            attr, present = str(value["attr"]), bool(value["present"])
            if present:
                native.predicate(mgr, lambda o: hasattr(o, attr), text)
            else:
                native.no_hasattr(mgr, attr, text)
        elif kind == "contains":
            key, present = values.decode_value(value["key"]), bool(value["present"])
            if not native.dict_contains(mgr, obj, present, key, text):
                native.predicate(mgr, lambda o: (key in o) is present, text)
        elif kind == "not_in_dict":
            d = getattr(obj, "__dict__", None)
            if type(d) is not dict:
                return False
            where = (*(_path(expr) or ()), ("__dict__", None))
            sub = self.nodes.get(where)
            if sub is None:
                sub = (native.child(mgr, obj, ("__dict__", None), d, expr, self.enum), d)
                self.nodes[where] = sub
            native.dict_contains(sub[0], d, False, value, text)
        elif kind == "tensor":
            if not isinstance(obj, torch.Tensor):
                return False
            native.tensor(mgr, obj, value["sizes"], value["strides"], str(g["expr"]), text)
        else:
            return False
        return True

    def alias(self, value: dict[str, Any], text: str) -> bool:
        found = [self.node(x) for x in value["exprs"]]
        if any(f is None for f in found):
            return False
        mgrs = [f[0] for f in found if f is not None]
        groups = value["groups"]
        if len(groups) > 1:
            native.distinct([mgrs[grp[0]] for grp in groups],
                            [value["exprs"][grp[0]] for grp in groups], text)
        for grp in groups:
            for i in grp[1:]:
                native.same_object(mgrs[grp[0]], mgrs[i], text)
        return True


def _equals(expected: Any) -> Callable[[Any], bool]:
    return lambda o: bool(o == expected)


_PATH_KINDS = ("type", "ident", "eq", "len", "keys", "hasattr", "contains", "not_in_dict",
               "tensor")
# Values an equality leaf may hold as they are (their type is checked, then ==).
_IMMUTABLE = (bool, int, float, str, bytes, type(None), torch.device, torch.dtype)


def _frame_source(parts: Parts) -> str:
    """``{'self': self, 'x': x, ..., '__cc_G': __cc_G, 'n': <closure cell>}``."""
    items = [f"{n!r}: {n}" for n in parts.names]
    items.append(f"{_FRAME_GLOBALS!r}: {_FRAME_GLOBALS}")
    items += [f"{n!r}: __cc_closure[{i}].cell_contents"
              for i, n in enumerate(parts.func.__code__.co_freevars)]
    return "{" + ", ".join(items) + "}"


class Tree:
    """A built tree as a check over the method's own arguments."""

    def __init__(self, check: Callable[..., bool], n_native: int, n_python: int,
                 keep: list[Any], build_ms: float) -> None:
        self.check = check
        self.n_native = n_native
        self.n_python = n_python
        self.keep = keep
        self.build_ms = build_ms


def build(parts: Parts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tree | None:
    """The tree for ``parts``'s guards on the objects of this call (whose Python check
    just passed); None if this torch cannot build one or it does not pass here."""
    if not native.available():
        return None
    t0 = time.perf_counter()
    frame_src = _frame_source(parts)
    n = len(parts.guards)
    try:
        make_frame = parts.function("__cc_frame", f"def __cc_frame({parts.params}):\n"
                                    f"    return {frame_src}\n")
        _defaults(make_frame, parts)
        frame = make_frame(*args, **kwargs)
        rest: list[str] = []
        with native.building() as enum_:
            b = _Builder(frame, enum_)
            for g, cond in zip(parts.guards, parts.conds, strict=True):
                if not b.leaf(g, str(g.get("text") or cond)):
                    rest.append(cond)
            if rest:
                native.predicate(b.root, _python_rest(parts, rest), "the guards checked in Python")
        root = b.root
        env_name = f"__cc_tree_root_{id(root)}"
        parts.env[env_name] = root
        check = parts.function(f"__cc_tree_{id(root)}",
                               f"def __cc_tree_{id(root)}({parts.params}):\n"
                               f"    return {env_name}.check({frame_src})\n")
        _defaults(check, parts)
        if not check(*args, **kwargs):
            logger.debug("guard tree for %s fails where the Python check passed: not used",
                         parts.func.__qualname__)
            return None
    except Exception:  # noqa: BLE001 - a tree is an optimisation: the Python check stays
        logger.debug("building the guard tree for %s failed", parts.func.__qualname__,
                     exc_info=True)
        return None
    ms = (time.perf_counter() - t0) * 1e3
    logger.debug("guard tree for %s: %d guards native, %d in Python, built in %.1f ms",
                 parts.func.__qualname__, n - len(rest), len(rest), ms)
    return Tree(check, n - len(rest), len(rest), b.keep, ms)


def _defaults(fn: Callable[..., Any], parts: Parts) -> None:
    fn.__defaults__ = parts.func.__defaults__  # type: ignore[attr-defined]
    fn.__kwdefaults__ = parts.func.__kwdefaults__  # type: ignore[attr-defined]


def _python_rest(parts: Parts, conds: list[str]) -> Callable[[dict[str, Any]], bool]:
    """The guards with no native leaf, as one function of the frame dict."""
    names = [*parts.names, *parts.func.__code__.co_freevars]
    unpack = "".join(f"{n} = __cc_d[{n!r}]\n" for n in names)
    src = (f"def __cc_rest(__cc_d):\n    try:\n{indent(indent(unpack))}"
           f"{indent(indent(guard_lines(conds, True)))}        return True\n"
           "    except Exception:\n        return False\n")
    name = f"__cc_rest_{len(parts.env)}"
    return parts.function(name, src.replace("__cc_rest(", f"{name}(", 1))


class EveryCall:
    """``guards="always"``: the tree when it holds, the Python check when it does not.

    Bound to the module as the variant's check. The Python check decides every failure of
    the tree, so the tree only ever makes a passing call cheaper."""

    def __init__(self, parts: Parts, python: Callable[..., bool]) -> None:
        self._parts = parts
        self._python = python
        self._tree: Tree | None = None
        self._builds = 0

    @property
    def tree(self) -> Tree | None:
        return self._tree

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        tree = self._tree
        if tree is not None:
            try:
                if tree.check(*args, **kwargs):
                    return True
            except Exception:  # noqa: BLE001 - the Python check decides
                logger.debug("guard tree raised", exc_info=True)
        if not self._python(*args, **kwargs):
            return False
        if self._builds < MAX_BUILDS:
            self._builds += 1
            self._tree = build(self._parts, args, kwargs)
        return True

