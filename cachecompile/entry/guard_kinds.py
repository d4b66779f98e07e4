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

import ast
import dataclasses
import os
import sys
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import torch

from cachecompile._torch import guard_tree as native
from cachecompile._torch import runtime
from cachecompile.entry import values
from cachecompile.entry.guard_paths import LEAVES, NO_GLOBAL, UNSET_ENV
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key.identity import class_digest, identity, qualified_name
from cachecompile.store.jsonvalue import JSON

if TYPE_CHECKING:  # the cold side's (a capture's) only: a warm process never imports it
    from cachecompile._torch.dynamo import GuardEntry


class Source(Protocol):
    """What a kind's ``python`` gets from the checker it is compiled into."""

    def const(self, value: Any) -> str:
        """A name in the checker's namespace bound to ``value``."""
        ...

    def rewrite(self, expr: str) -> str:
        """A Dynamo source expression as Python over the method's arguments."""
        ...


class Node(Protocol):
    """A place in the tree being built: a manager and the live value it guards."""

    mgr: Any
    obj: Any
    # In an anchor's subtree, checked only while the anchor's state has changed: a leaf
    # here must hold as long as the object is the same one.
    pinned: bool

    def live(self) -> Node:
        """The same object's node that is checked on every call."""
        ...

    def child(self, step: tuple[str, Any]) -> Node:
        """One more step from here (pinned where the step keeps it so)."""
        ...


class Tree(Protocol):
    """What a kind's ``native`` gets from the tree being built."""

    root: Any
    enum: Any

    def node(self, expr: str) -> Node | None:
        """The node an object path names; None if it is not one or unreadable."""
        ...

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` for the tree's life (its id is matched)."""
        ...

    def const(self, obj: Any) -> Node:
        """A node for ``obj`` itself, checked on every call (no path leads to it)."""
        ...


class Capture(Protocol):
    """What a kind's ``capture`` gets from the compiling process (cold/guard_capture.py):
    the frame's state and the steps that several kinds share."""

    state: Mapping[str, JSON]   # the global state snapshot taken before the traced call

    def add(self, kind: str, expr: str, value: JSON, text: str | None = None) -> None:
        """One portable guard (its text: the expression in the user's terms, if None)."""
        ...

    def text(self, expr: str) -> str:
        """A source expression in the user's terms (``self.cfg.act``, ``module.CONST``)."""
        ...

    def value(self, e: GuardEntry) -> Any:
        """The guarded value at trace time; not cacheable (named) if Dynamo had none."""
        ...

    def ident(self, expr: str, value: Any, guard_type: str, origin: str = "") -> None:
        """An identity guard, or not cacheable (naming ``origin``, the traced line)."""
        ...

    def type_match(self, expr: str, value: Any) -> None:
        ...

    def tensor(self, expr: str, value: Any) -> None:
        ...

    def duplicate(self, e: GuardEntry) -> None:
        """Two sources of one input tensor: both join the alias guard."""
        ...

    def attr_of(self, e: GuardEntry) -> str:
        """The attribute name an attribute guard (HASATTR, NOT_PRESENT...) was built with."""
        ...

    def fallback(self, e: GuardEntry, why: str) -> NoReturn:
        """Not cacheable: this guard has no portable form (``why`` says what is missing)."""
        ...


@dataclasses.dataclass(frozen=True)
class Kind:
    """One guard kind: the Dynamo guard types it carries, how the compiling process captures
    one (``capture``, None where cachecompile derives it itself), how a warm process checks
    it in Python (``python``) and as a C++ leaf (``native``)."""

    name: str
    dynamo: tuple[str, ...]
    python: Callable[[Source, str, Any], str]
    native: Callable[[Tree, str, Any, str], bool] | None = None
    capture: Callable[[Capture, GuardEntry], None] | None = None

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
            if identity(obj, matched=True) != self.value:
                return False
            self._last, self._last_self = _remember(obj.__func__), _remember(obj.__self__)
            return True
        if obj is self._last():
            return True
        if identity(obj, matched=True) != self.value:
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
    try:    # the common case, checked on every call: each tensor has its own storage
        bases = [t.untyped_storage().data_ptr() for t in tensors]
        if len(set(bases)) == len(bases):
            return []
    except Exception:  # not all dense tensors: the general rule below
        pass
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.layout is torch.strided:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    if all(len(v) < 2 for v in by_storage.values()):
        return []
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
    if not expected:
        def distinct(*tensors: Any) -> bool:
            # The common case inline, as on every call: one storage each, no list built.
            try:
                if len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors):
                    return True
            except Exception:  # not all dense tensors: the general rule decides
                pass
            return not overlap_groups(tensors)

        return distinct

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

def _on_path(build: Callable[[Tree, Node, JSON, str], bool], *,
             implied: Callable[[Any, JSON], bool] = lambda obj, value: False,
             proxy_ok: bool = False) -> Callable[[Tree, str, JSON, str], bool]:
    """A native leaf on the object an expression names. ``implied(obj, value)``: whether
    the guard holds as long as ``obj`` is the same object (and, for a dict, unchanged),
    so that it may sit in an anchor's skipped subtree; otherwise it is checked on every
    call. ``dict(proxy)`` is walked as the proxy itself, which only a length or
    membership test reads the same (``proxy_ok``)."""
    def native_(tree: Tree, expr: str, value: JSON, text: str) -> bool:
        node = tree.node(expr) if expr else None
        if node is None:
            return False
        if isinstance(node.obj, types.MappingProxyType) and not proxy_ok:
            return False    # the guard reads dict(proxy) itself: Python checks it
        if node.pinned and not implied(node.obj, value):
            node = node.live()
        return build(tree, node, value, text)
    return native_


# What an object's identity decides (guard_tree skips these while their anchor's dicts are
# unchanged): the object is the same one, and a dict's contents are what its version says.
def fixed_class(obj: Any, value: JSON = None) -> bool:
    """Its class cannot be reassigned: an immutable builtin type (a Python module's can)."""
    return bool(type(obj).__flags__ & _IMMUTABLETYPE) and not isinstance(obj, types.ModuleType)


_IMMUTABLETYPE = 1 << 8   # Py_TPFLAGS_IMMUTABLETYPE


def instance_dict(obj: Any) -> dict[str, Any] | None:
    """``vars(obj)`` where it is a plain dict, without running ``__getattr__``."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None
    return d if type(d) is dict else None


def reads_instance_dict(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` reads ``vars(obj)[name]``: in it, not shadowed by a data
    descriptor of its class, and the class's attribute lookup is Python's own."""
    d = instance_dict(obj)
    cls = type(obj)
    if d is None or name not in d or cls.__getattribute__ not in _PLAIN_GETATTRIBUTE:
        return False
    return _not_shadowed(cls, name)


_PLAIN_GETATTRIBUTE = (object.__getattribute__, types.ModuleType.__getattribute__)
_NO_VALUE = object()


def _not_shadowed(cls: type, name: str) -> bool:
    """No data descriptor of ``cls`` (or its bases) stands in front of an instance's
    ``name``."""
    for klass in cls.__mro__:
        found = klass.__dict__.get(name, _NO_VALUE)
        if found is not _NO_VALUE:
            return not (hasattr(type(found), "__set__") or hasattr(type(found), "__delete__"))
    return True


def _config_getattribute() -> Any:
    """transformers' ``PretrainedConfig.__getattribute__`` (None unless transformers'
    configuration module is imported: nothing to recognise then)."""
    cls = getattr(sys.modules.get("transformers.configuration_utils"), "PretrainedConfig", None)
    return vars(cls).get("__getattribute__") if isinstance(cls, type) else None


def config_map_read(obj: Any, name: str) -> dict[str, Any] | None:
    """The class's ``attribute_map`` where ``obj.name`` reads ``vars(obj)[name]`` through
    transformers' ``PretrainedConfig.__getattribute__`` (recognised by the function's
    identity); else None.

    That function maps ``name`` through ``attribute_map`` (a plain dict on the class), then
    reads the attribute as Python does. So while ``type(obj).__getattribute__`` is that
    function, ``type(obj).attribute_map`` is this dict and lacks ``name``, and the instance
    holds no ``attribute_map`` of its own, ``obj.name`` is ``vars(obj)[name]``: decided by
    those dicts, which a guard tree can watch (issue 33's decision). Any other custom
    ``__getattribute__`` stays checked by calling it."""
    cls = type(obj)
    fn = _config_getattribute()
    if fn is None or cls.__getattribute__ is not fn or name == "attribute_map":
        return None
    d = instance_dict(obj)
    if d is None or name not in d or "attribute_map" in d or not _not_shadowed(cls, name):
        return None
    amap = _class_attr(cls, "attribute_map")
    return amap if type(amap) is dict and name not in amap else None


def _class_attr(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return _NO_VALUE


def _in_instance_dict(obj: Any, value: JSON) -> bool:
    """``hasattr(obj, a)`` is true while ``a`` stays in ``vars(obj)``."""
    return bool(value["present"]) and reads_instance_dict(obj, str(value["attr"]))


def _immutable(obj: Any, value: JSON = None) -> bool:
    return type(obj) in _IMMUTABLE or type(obj) is tuple and all(_immutable(x) for x in obj)


def _versioned(obj: Any, value: JSON = None) -> bool:
    """A dict whose length and membership are its own (its version tracks them), or a tuple."""
    return type(obj) is tuple or (native.plain_dict(obj) and type(obj).__len__ is dict.__len__
                                  and type(obj).__contains__ is dict.__contains__)


def _ordered_by_version(obj: Any, value: JSON = None) -> bool:
    """A plain dict: its key order changes only with its version (an OrderedDict's
    ``move_to_end`` does not touch it)."""
    return type(obj) is dict


def _always(obj: Any, value: JSON = None) -> bool:
    return True


def _global_state_leaf(tree: Tree, expr: str, value: JSON, text: str) -> bool:
    native.global_state(tree.root, text)   # the state now: the Python check just passed
    return True


def _modes_leaf(tree: Tree, expr: str, value: JSON, text: str) -> bool:
    native.function_modes(tree.root, text)  # the classes now: at least as strict as names
    return True


def _default_device_leaf(tree: Tree, expr: str, value: JSON, text: str) -> bool:
    native.default_device(tree.root, text)
    return True


def _expr_leaf(tree: Tree, expr: str, value: JSON, text: str) -> bool:
    """``not ___environ_has('X')`` as a membership leaf on ``os.environ``'s own dict (what
    ``'X' in os.environ`` reads), ``not ___module_has(G['__name__'], 'abs')`` as one on the
    module's dict; other expressions stay Python."""
    g = NO_GLOBAL.fullmatch(expr)
    if g is not None:
        if g.group(1).startswith("G"):
            node = tree.node(g.group(1))
            name = node.obj if node is not None else None
        else:
            name = ast.literal_eval(g.group(1))
        module = sys.modules.get(name) if type(name) is str else None
        d = getattr(module, "__dict__", None)
        if type(d) is not dict:
            return False
        return native.dict_contains(tree.const(d).mgr, d, False, ast.literal_eval(g.group(2)),
                                    text)
    m = UNSET_ENV.fullmatch(expr)
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if m is None or type(data) is not dict or encode is None:
        return False
    name = ast.literal_eval(m.group(1))
    return native.dict_contains(tree.const(data).mgr, data, False, encode(name), text)


def _type_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    tree.keep(type(node.obj))
    native.type_match(node.mgr, type(node.obj), text)
    return True


def _eq_python(src: Source, e: str, value: JSON) -> str:
    expected = values.decode_value(value)
    if isinstance(expected, (bool, int, float)):
        return f"(type({e}) is {src.const(type(expected))} and {e} == {src.const(expected)})"
    return f"{e} == {src.const(expected)}"


# Values an equality leaf may hold as they are (their type is checked, then ==).
_IMMUTABLE = (bool, int, float, str, bytes, type(None), torch.device, torch.dtype)


def _eq_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    expected = values.decode_value(value)
    obj = node.obj
    if type(expected) is type(obj) and isinstance(expected, _IMMUTABLE):
        native.equals(node.mgr, expected, text)
    elif not isinstance(expected, (bool, int, float)):
        # Python's own comparison, against the decoded value (a fresh object: the live one
        # would follow its own later in-place changes).
        native.predicate(node.mgr, lambda o: bool(o == expected), text)
    else:
        return False
    return True


def _len_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    n = int(value)
    if not native.length(node.mgr, node.obj, n, text):
        native.predicate(node.mgr, lambda o: len(o) == n, text)
    return True


def _keys_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    keys = [values.decode_value(k) for k in value]
    native.predicate(node.mgr, lambda o: list(o.keys()) == keys, text)
    return True


def _hasattr_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    attr, present = str(value["attr"]), bool(value["present"])
    if present:
        # The attribute's own accessor fails the tree where it is missing: shared with the
        # guards on its value, and pinned (a dict item) where vars(obj) holds it.
        node.child(("attr", attr))
    else:
        native.no_hasattr(node.mgr, attr, text)
    return True


def _contains_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    key, present = values.decode_value(value["key"]), bool(value["present"])
    if not native.dict_contains(node.mgr, node.obj, present, key, text):
        native.predicate(node.mgr, lambda o: (key in o) is present, text)
    return True


def _not_in_dict_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    d = getattr(node.obj, "__dict__", None)
    if type(d) is not dict:
        return False
    native.dict_contains(node.child(("__dict__", None)).mgr, d, False, value, text)
    return True


def _ident_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    obj = node.obj
    if type(obj) is types.MethodType:   # a new object on every access: match its parts
        for part in ("__func__", "__self__"):
            sub = node.child(("attr", part))
            tree.keep(sub.obj)
            native.id_match(sub.mgr, sub.obj, text)
    else:
        tree.keep(obj)
        native.id_match(node.mgr, obj, text)
    return True


def _tensor_leaf(tree: Tree, node: Node, value: JSON, text: str) -> bool:
    if not isinstance(node.obj, torch.Tensor):
        return False
    native.tensor(node.mgr, node.obj, value["sizes"], value["strides"], text, text)
    return True


def _alias_python(src: Source, e: str, value: JSON) -> str:
    exprs = [src.rewrite(x) for x in value["exprs"]]
    groups = value["groups"]
    parts = [f"len({{{', '.join(f'id({x})' for x in exprs)}}}) == {len(groups)}"]
    for grp in groups:
        parts.extend(f"{exprs[grp[0]]} is {exprs[i]}" for i in grp[1:])
    return "(" + " and ".join(parts) + ")"


def _alias_leaf(tree: Tree, expr: str, value: JSON, text: str) -> bool:
    # Relational leaves keep state across the managers they span, so each side is one
    # that is checked on every call.
    found = [tree.node(x) for x in value["exprs"]]
    mgrs = [f.live().mgr for f in found if f is not None]
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


# -- capture: one of Dynamo's guard entries -> portable guards --------------------------
def _capture_global_state(c: Capture, e: GuardEntry) -> None:
    c.add("global_state", "", c.state["global_state"], "global torch state (grad mode, "
          "autocast, default dtype, deterministic algorithms, threads)")


def _capture_modes(c: Capture, e: GuardEntry) -> None:
    c.add("modes", "", c.state["modes"], f"the active torch function modes {c.state['modes']}")


def _capture_default_device(c: Capture, e: GuardEntry) -> None:
    c.add("default_device", "", c.state["default_device"],
          f"torch default device == {c.state['default_device']!r}")


def _capture_type(c: Capture, e: GuardEntry) -> None:
    value = c.value(e)
    # An opaque (script) object such as a process group: its real type at run time.
    c.type_match(e.expr, getattr(value, "real_obj", value)
                 if e.guard_type == "FAKE_SCRIPT_TYPE_MATCH" else value)


def _capture_eq(c: Capture, e: GuardEntry) -> None:
    value = c.value(e)
    if isinstance(value, types.CodeType):
        c.add("ident", e.expr, identity(value), f"{c.text(e.expr)} is the same code")
        return
    try:
        enc = values.encode_value(value)
    except UnsupportedProgramError:
        c.ident(e.expr, value, e.guard_type, e.origin())
        return
    c.add("eq", e.expr, enc, f"{c.text(e.expr)} == {value!r}")


def _capture_len(c: Capture, e: GuardEntry) -> None:
    n = len(c.value(e))
    c.add("len", e.expr, n, f"len({c.text(e.expr)}) == {n}")


def _capture_keys(c: Capture, e: GuardEntry) -> None:
    value = c.value(e)
    c.add("keys", e.expr, [values.encode_value(k) for k in value.keys()],
          f"{c.text(e.expr)} has keys {list(value.keys())!r}")


def _capture_hasattr(c: Capture, e: GuardEntry) -> None:
    attr = c.attr_of(e)
    known = e.keyword("present")          # a release whose entry names the attribute
    present = bool(known) if isinstance(known, bool) else hasattr(c.value(e), attr)
    c.add("hasattr", e.expr, {"attr": attr, "present": present},
          f"{c.text(e.expr)} {'has' if present else 'has no'} attribute {attr!r}")


def _capture_contains(c: Capture, e: GuardEntry) -> None:
    c.value(e)
    key = e.keyword("key")
    present = "NOT" not in e.guard_type
    c.add("contains", e.expr, {"key": values.encode_value(key), "present": present},
          f"{key!r} {'in' if present else 'not in'} {c.text(e.expr)}")


def _capture_not_in_dict(c: Capture, e: GuardEntry) -> None:
    c.value(e)
    attr = c.attr_of(e)
    c.add("not_in_dict", e.expr, attr, f"{c.text(e.expr)} has no instance attribute {attr!r}")


def _capture_ident(c: Capture, e: GuardEntry) -> None:
    value = c.value(e)
    if e.guard_type == "NONE_MATCH":
        c.add("ident", e.expr, "None", f"{c.text(e.expr)} is None")
    elif e.guard_type == "CLOSURE_MATCH" and isinstance(value, types.FunctionType):
        # Dynamo matches a user function by its code object (its closure cells are
        # guarded on their own where they are read).
        c.add("ident", f"{e.expr}.__code__", identity(value.__code__),
              f"{c.text(e.expr)} is {qualified_name(value)} with the same code")
    elif e.guard_type == "OPAQUE_OBJ_GUARD_FN_MATCH" and identity(value) is None:
        c.fallback(e, "cachecompile has no portable form for this guard type")
    else:
        # An opaque object's guard values (a process group's name, rank and size) are
        # part of its portable identity, as a class's or a module's name is theirs.
        c.ident(e.expr, value, e.guard_type, e.origin())


def _capture_tensor(c: Capture, e: GuardEntry) -> None:
    c.tensor(e.expr, c.value(e))


def _capture_alias(c: Capture, e: GuardEntry) -> None:
    c.value(e)
    c.duplicate(e)


def _capture_expr(c: Capture, e: GuardEntry) -> None:
    if e.guard_type == "SHAPE_ENV":
        for part in e.code_parts:
            c.add("expr", part, None)
    else:   # NOT_NONE_MATCH
        c.value(e)
        c.add("expr", f"{e.expr} is not None", None)


_TABLE = (
    Kind("global_state", ("GLOBAL_STATE",),
         lambda src, e, v: f"{src.const(runtime.global_state_check(v))}()", _global_state_leaf,
         _capture_global_state),
    Kind("modes", ("TORCH_FUNCTION_STATE",),
         lambda src, e, v: f"{src.const(function_modes)}() == {src.const(list(v))}",
         _modes_leaf, _capture_modes),
    Kind("default_device", ("DEFAULT_DEVICE",),
         lambda src, e, v: f"{src.const(runtime.default_device)}() == {src.const(v)}",
         _default_device_leaf, _capture_default_device),
    Kind("type", ("TYPE_MATCH", "FAKE_SCRIPT_TYPE_MATCH"),
         lambda src, e, v: f"{src.const(TypeRef(v))}.matches(type({e}))",
         _on_path(_type_leaf, implied=fixed_class), _capture_type),
    Kind("eq", ("EQUALS_MATCH", "CONSTANT_MATCH", "BOOL_MATCH"), _eq_python,
         _on_path(_eq_leaf, implied=_immutable), _capture_eq),
    Kind("len", ("SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT"),
         lambda src, e, v: f"len({e}) == {int(v)}",
         _on_path(_len_leaf, implied=_versioned, proxy_ok=True), _capture_len),
    Kind("keys", ("DICT_KEYS_MATCH",),
         lambda src, e, v: f"list({e}.keys()) == "
                           f"{src.const([values.decode_value(k) for k in v])}",
         _on_path(_keys_leaf, implied=_ordered_by_version), _capture_keys),
    Kind("hasattr", ("HASATTR",),
         lambda src, e, v: f"hasattr({e}, {src.const(v['attr'])}) is "
                           f"{src.const(bool(v['present']))}",
         _on_path(_hasattr_leaf, implied=_in_instance_dict), _capture_hasattr),
    Kind("contains", ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS"),
         lambda src, e, v: f"({src.const(values.decode_value(v['key']))} in {e}) is "
                           f"{src.const(bool(v['present']))}",
         _on_path(_contains_leaf, implied=_versioned, proxy_ok=True), _capture_contains),
    Kind("not_in_dict", ("NOT_PRESENT_IN_GENERIC_DICT",),
         lambda src, e, v: f"{src.const(v)} not in {e}.__dict__",
         _on_path(_not_in_dict_leaf, implied=_always), _capture_not_in_dict),
    Kind("ident", ("ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "CLOSURE_MATCH", "NONE_MATCH",
                   "MODULE_MATCH", "BUILTIN_MATCH", "NN_MODULE", "OPAQUE_OBJ_GUARD_FN_MATCH"),
         lambda src, e, v: f"{src.const(_IdentMatch(v))}({e})",
         _on_path(_ident_leaf, implied=_always), _capture_ident),
    Kind("tensor", ("TENSOR_MATCH",),
         lambda src, e, v: f"{src.const(_tensor_check(v))}({e})", _on_path(_tensor_leaf),
         _capture_tensor),
    Kind("alias", ("DUPLICATE_INPUT", "NO_TENSOR_ALIASING"), _alias_python, _alias_leaf,
         _capture_alias),
    Kind("overlap", ("STORAGE_OVERLAPPING",), _overlap_python),
    Kind("expr", ("SHAPE_ENV", "NOT_NONE_MATCH"), lambda src, e, v: f"({e})", _expr_leaf,
         _capture_expr),
)

TABLE: dict[str, Kind] = {k.name: k for k in _TABLE}
# Dynamo's guard type -> the kind that captures it (one row each: a new type is one row).
BY_DYNAMO: dict[str, Kind] = {t: k for k in _TABLE for t in k.dynamo}
# The order a checker evaluates them in (cheap ones first).
KINDS: tuple[str, ...] = tuple(TABLE)
# Kinds about the process, not an object path.
GLOBAL_KINDS = ("global_state", "modes", "default_device")
