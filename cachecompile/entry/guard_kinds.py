"""Every guard kind in one table: where it comes from, its Python check, its C++ leaf.

An entry carries Dynamo's guards in a portable form (``{"kind", "expr", "value", "text",
"args"}``, see :mod:`cachecompile.entry.guards`). Each kind has one :class:`Kind` entry:

* ``dynamo``: the Dynamo guard types :mod:`cachecompile.cold.guard_capture` turns into it;
* ``python``: its condition as Python source over the method's arguments, which the
  checker compiles (the truth: it decides whether a variant fits);
* ``native``: the C++ leaf Dynamo's guard tree checks it with on every call
  (:mod:`cachecompile.entry.guard_tree`), or None where it stays Python; ``leaf`` names it
  for ``cachectl program --tree``.

A torch release that changes a guard touches one entry here (and its capture), and the
order of :data:`KINDS` is the order a checker evaluates them (cheap ones first).
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from cachecompile._torch import guard_tree as native
from cachecompile._torch import runtime
from cachecompile.entry import values
from cachecompile.entry.guard_paths import LEAVES
from cachecompile.key.identity import class_digest, identity, qualified_name

JSON = Any


class Source(Protocol):
    """What a kind's ``python`` gets from the checker it is compiled into."""

    def const(self, value: Any) -> str:
        """A name in the checker's namespace bound to ``value``."""
        ...

    def rewrite(self, expr: str) -> str:
        """A Dynamo source expression as Python over the method's arguments."""
        ...


class Tree(Protocol):
    """What a kind's ``native`` gets from the tree being built."""

    root: Any
    enum: Any

    def node(self, expr: str) -> tuple[Any, Any] | None:
        """(manager, live value) for an object path; None if it is not one or unreadable."""
        ...

    def child(self, mgr: Any, obj: Any, step: tuple[str, Any], value: Any, source: str) -> Any:
        """A manager for one more step from ``mgr`` (shared with other guards)."""
        ...

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` for the tree's life (its id is matched)."""
        ...


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    dynamo: tuple[str, ...]
    python: Callable[[Source, str, Any], str]
    native: Callable[[Tree, str, Any, str], bool] | None = None

    @property
    def leaf(self) -> str:
        """The C++ leaf it becomes ("python": one Python function on the root)."""
        return LEAVES[self.name]


# -- the Python checks' helpers ---------------------------------------------------------
class _IdentMatch:
    """An identity guard: ``identity(obj) == value``, remembered per object.

    Dynamo's ID_MATCH / FUNCTION_MATCH compare ``id(obj)`` in its process; once an object
    has matched the portable identity, the same object matches again (what it reads, such
    as closure cells, is guarded on its own), so later checks are one ``is``. Bound methods
    are new objects on every attribute access: they are remembered by function and self.
    Remembered weakly where the object allows it: a replaced function is freed, not kept
    alive by a guard it no longer passes.
    """

    __slots__ = ("value", "_last", "_last_self")

    def __init__(self, value: str) -> None:
        self.value = value
        self._last: Callable[[], Any] = _NOTHING     # nothing matched yet
        self._last_self: Callable[[], Any] = _NOTHING

    def __call__(self, obj: Any) -> bool:
        if type(obj) is types.MethodType:
            if obj.__func__ is self._last() and obj.__self__ is self._last_self():
                return True
            if identity(obj) != self.value:
                return False
            self._last, self._last_self = _remember(obj.__func__), _remember(obj.__self__)
            return True
        if obj is self._last():
            return True
        if identity(obj) != self.value:
            return False
        self._last = _remember(obj)
        return True


def _NOTHING() -> Any:
    return _NOTHING   # a value no guarded object is


def _remember(obj: Any) -> Callable[[], Any]:
    """``obj`` back while it lives (a weak reference), or always if it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class TypeRef:
    """A class to compare with: same qualified name and same method code.

    The first class that matches is remembered, so later checks are one ``is``.
    """

    __slots__ = ("qual", "code", "_cls")

    def __init__(self, value: JSON) -> None:
        if isinstance(value, str):
            value = {"qual": value, "code": None}
        self.qual: str = value["qual"]
        self.code: str | None = value.get("code")
        self._cls: Any = None

    def matches(self, cls: type) -> bool:
        if cls is self._cls:
            return True
        if qualified_name(cls) != self.qual or class_digest(cls) != self.code:
            return False
        if self._cls is None:
            self._cls = cls
        return True


def _tensor_check(facts: Mapping[str, JSON]) -> Callable[[Any], bool]:
    tref = TypeRef(facts["type"])
    dtype = getattr(torch, facts["dtype"])
    device = torch.device(facts["device"])
    rg = bool(facts["requires_grad"])
    sizes = [(i, s) for i, s in enumerate(facts["sizes"]) if s is not None]
    strides = [(i, s) for i, s in enumerate(facts["strides"]) if s is not None]
    ndim = len(facts["sizes"])

    def check(t: Any) -> bool:
        if not tref.matches(type(t)):
            return False
        if t.dtype is not dtype or t.device != device or t.requires_grad is not rg:
            return False
        if t.dim() != ndim:
            return False
        shape = t.shape
        for i, s in sizes:
            if shape[i] != s:
                return False
        if strides:
            st = t.stride()
            for i, s in strides:
                if st[i] != s:
                    return False
        return True

    return check


# -- memory overlap between input tensors ---------------------------------------------------
def overlap_groups(tensors: Sequence[Any]) -> list[list[int]]:
    """Which of ``tensors`` may share memory: groups (two or more indices) of tensors whose
    byte ranges in one storage intersect, chained; tensors alone are left out.

    A program traced with distinct inputs assumes that a write to one is not seen through
    another (AOTAutograd builds a synthetic base only for inputs that overlapped at trace
    time, and Dynamo's own identity guard passes two views of one buffer). Intersecting
    ranges is conservative (interleaved strided views count as overlapping), which is safe
    because the same rule runs at trace time and at the check.
    """
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.layout is torch.strided:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    if all(len(v) < 2 for v in by_storage.values()):
        return []           # the common case: every tensor has its own storage
    groups: list[list[int]] = []
    for members in by_storage.values():
        if len(members) < 2:
            continue
        spans = sorted((_byte_span(tensors[i]), i) for i in members)
        current: list[int] = []
        end = -1
        for (lo, hi), i in spans:
            if current and lo < end:
                current.append(i)
                end = max(end, hi)
                continue
            if len(current) > 1:
                groups.append(sorted(current))
            current, end = [i], hi
        if len(current) > 1:
            groups.append(sorted(current))
    return sorted(groups)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor can reach: [start, end)."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    if t.numel() == 0:
        return start, start
    extent = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride(),
                                                                 strict=True))
    return start, start + extent * size


def _overlap_check(groups: JSON) -> Callable[..., bool]:
    expected = sorted(sorted(grp) for grp in groups)

    def check(*tensors: Any) -> bool:
        return overlap_groups(tensors) == expected

    return check


# -- global state ---------------------------------------------------------------------------
def function_modes() -> list[str]:
    """The active torch function modes, innermost last, by class."""
    return [qualified_name(type(mode)) for mode in runtime.function_modes()]


# -- the table ---------------------------------------------------------------------------
# Each ``python`` gets the guard's expression already rewritten (``self.cfg.act``) and its
# stored value; each ``native`` gets the tree, the raw expression (``L['self'].cfg.act``),
# the value and the text, and returns False where that guard has no native form here.

def _on_path(build: Callable[[Tree, Any, Any, JSON, str], bool], *, proxy_ok: bool = False
             ) -> Callable[[Tree, str, JSON, str], bool]:
    """A native leaf on the object an expression names. ``dict(proxy)`` is walked as the
    proxy itself, which only a length or membership test reads the same (``proxy_ok``)."""
    def native_(tree: Tree, expr: str, value: JSON, text: str) -> bool:
        found = tree.node(expr) if expr else None
        if found is None:
            return False
        mgr, obj = found
        if isinstance(obj, types.MappingProxyType) and not proxy_ok:
            return False    # the guard reads dict(proxy) itself: Python checks it
        return build(tree, mgr, obj, value, text)
    return native_


def _global_state_leaf(tree: Tree, expr: str, value: JSON, text: str) -> bool:
    native.global_state(tree.root, text)   # the state now: the Python check just passed
    return True


def _type_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    tree.keep(type(obj))
    native.type_match(mgr, type(obj), text)
    return True


def _eq_python(src: Source, e: str, value: JSON) -> str:
    expected = values.decode_value(value)
    if isinstance(expected, (bool, int, float)):
        return f"(type({e}) is {src.const(type(expected))} and {e} == {src.const(expected)})"
    return f"{e} == {src.const(expected)}"


# Values an equality leaf may hold as they are (their type is checked, then ==).
_IMMUTABLE = (bool, int, float, str, bytes, type(None), torch.device, torch.dtype)


def _eq_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    expected = values.decode_value(value)
    if type(expected) is type(obj) and isinstance(expected, _IMMUTABLE):
        native.equals(mgr, expected, text)
    elif not isinstance(expected, (bool, int, float)):
        # Python's own comparison, against the decoded value (a fresh object: the live one
        # would follow its own later in-place changes).
        native.predicate(mgr, lambda o: bool(o == expected), text)
    else:
        return False
    return True


def _len_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    n = int(value)
    if not native.length(mgr, obj, n, text):
        native.predicate(mgr, lambda o: len(o) == n, text)
    return True


def _keys_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    keys = [values.decode_value(k) for k in value]
    native.predicate(mgr, lambda o: list(o.keys()) == keys, text)
    return True


def _hasattr_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    attr, present = str(value["attr"]), bool(value["present"])
    if present:
        native.predicate(mgr, lambda o: hasattr(o, attr), text)
    else:
        native.no_hasattr(mgr, attr, text)
    return True


def _contains_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    key, present = values.decode_value(value["key"]), bool(value["present"])
    if not native.dict_contains(mgr, obj, present, key, text):
        native.predicate(mgr, lambda o: (key in o) is present, text)
    return True


def _not_in_dict_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    d = getattr(obj, "__dict__", None)
    if type(d) is not dict:
        return False
    sub = tree.child(mgr, obj, ("__dict__", None), d, "__dict__")
    native.dict_contains(sub, d, False, value, text)
    return True


def _ident_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    if type(obj) is types.MethodType:   # a new object on every access: match its parts
        for part in ("__func__", "__self__"):
            sub = getattr(obj, part)
            tree.keep(sub)
            native.id_match(tree.child(mgr, obj, ("attr", part), sub, part), sub, text)
    else:
        tree.keep(obj)
        native.id_match(mgr, obj, text)
    return True


def _tensor_leaf(tree: Tree, mgr: Any, obj: Any, value: JSON, text: str) -> bool:
    if not isinstance(obj, torch.Tensor):
        return False
    native.tensor(mgr, obj, value["sizes"], value["strides"], text, text)
    return True


def _alias_python(src: Source, e: str, value: JSON) -> str:
    exprs = [src.rewrite(x) for x in value["exprs"]]
    groups = value["groups"]
    parts = [f"len({{{', '.join(f'id({x})' for x in exprs)}}}) == {len(groups)}"]
    for grp in groups:
        parts.extend(f"{exprs[grp[0]]} is {exprs[i]}" for i in grp[1:])
    return "(" + " and ".join(parts) + ")"


def _alias_leaf(tree: Tree, expr: str, value: JSON, text: str) -> bool:
    found = [tree.node(x) for x in value["exprs"]]
    mgrs = [f[0] for f in found if f is not None]
    if len(mgrs) != len(found):
        return False
    groups = value["groups"]
    if len(groups) > 1:
        native.distinct([mgrs[grp[0]] for grp in groups],
                        [value["exprs"][grp[0]] for grp in groups], text)
    for grp in groups:
        for i in grp[1:]:
            native.same_object(mgrs[grp[0]], mgrs[i], text)
    return True


def _overlap_python(src: Source, e: str, value: JSON) -> str:
    exprs = [src.rewrite(x) for x in value["exprs"]]
    return f"{src.const(_overlap_check(value['groups']))}({', '.join(exprs)})"


_TABLE = (
    Kind("global_state", ("GLOBAL_STATE",),
         lambda src, e, v: f"{src.const(runtime.global_state_check(v))}()", _global_state_leaf),
    Kind("modes", ("TORCH_FUNCTION_STATE",),
         lambda src, e, v: f"{src.const(function_modes)}() == {src.const(list(v))}"),
    Kind("default_device", ("DEFAULT_DEVICE",),
         lambda src, e, v: f"{src.const(runtime.default_device)}() == {src.const(v)}"),
    Kind("type", ("TYPE_MATCH", "FAKE_SCRIPT_TYPE_MATCH"),
         lambda src, e, v: f"{src.const(TypeRef(v))}.matches(type({e}))", _on_path(_type_leaf)),
    Kind("eq", ("EQUALS_MATCH", "CONSTANT_MATCH", "BOOL_MATCH"), _eq_python, _on_path(_eq_leaf)),
    Kind("len", ("SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT"),
         lambda src, e, v: f"len({e}) == {int(v)}", _on_path(_len_leaf, proxy_ok=True)),
    Kind("keys", ("DICT_KEYS_MATCH",),
         lambda src, e, v: f"list({e}.keys()) == "
                           f"{src.const([values.decode_value(k) for k in v])}",
         _on_path(_keys_leaf)),
    Kind("hasattr", ("HASATTR",),
         lambda src, e, v: f"hasattr({e}, {src.const(v['attr'])}) is "
                           f"{src.const(bool(v['present']))}", _on_path(_hasattr_leaf)),
    Kind("contains", ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS"),
         lambda src, e, v: f"({src.const(values.decode_value(v['key']))} in {e}) is "
                           f"{src.const(bool(v['present']))}",
         _on_path(_contains_leaf, proxy_ok=True)),
    Kind("not_in_dict", ("NOT_PRESENT_IN_GENERIC_DICT",),
         lambda src, e, v: f"{src.const(v)} not in {e}.__dict__", _on_path(_not_in_dict_leaf)),
    Kind("ident", ("ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "NONE_MATCH", "MODULE_MATCH",
                   "BUILTIN_MATCH", "OPAQUE_OBJ_GUARD_FN_MATCH"),
         lambda src, e, v: f"{src.const(_IdentMatch(v))}({e})", _on_path(_ident_leaf)),
    Kind("tensor", ("TENSOR_MATCH",),
         lambda src, e, v: f"{src.const(_tensor_check(v))}({e})", _on_path(_tensor_leaf)),
    Kind("alias", ("DUPLICATE_INPUT", "NO_TENSOR_ALIASING"), _alias_python, _alias_leaf),
    Kind("overlap", ("STORAGE_OVERLAPPING",), _overlap_python),
    Kind("expr", ("SHAPE_ENV", "NOT_NONE_MATCH"), lambda src, e, v: f"({e})"),
)

TABLE: dict[str, Kind] = {k.name: k for k in _TABLE}
# The order a checker evaluates them in (cheap ones first).
KINDS: tuple[str, ...] = tuple(TABLE)
# Kinds about the process, not an object path.
GLOBAL_KINDS = ("global_state", "modes", "default_device")
