"""A loaded entry's guards as Dynamo's C++ guard tree: every guard on every call, fast.

The Python checker (:mod:`cachecompile.entry.guards`) is the truth: it compares what the
entry was traced against in portable terms (a function by qualified name and code, a
tensor by its facts). Once it has passed on a call, this module builds a tree of Dynamo's
own C++ guard managers from the same guards and the live objects it just verified:

* each object path (``L['self']._modules['lin'].weight``) becomes a chain of accessors,
  shared between guards as Dynamo shares them;
* a portable identity becomes an identity match on the object that passed (held weakly:
  the tree is retired when one of them dies, since its id may be reused), a class a type
  match, a value an equality match, a tensor Dynamo's TENSOR_MATCH, aliasing its aliasing
  guards, the global state, function modes, the default device and an unset environment
  variable their own leaves;
* what has no native leaf (shape relations, memory overlap) runs as one Python function
  on the tree's root, the checker's own conditions.

It checks less than it holds: a module's state is skipped while the module's dicts are
unchanged, and only what no dict decides is checked on every call (:class:`_Builder`).

Every native leaf is at least as strict as its Python guard, so a tree that passes means
the Python check would. When the tree fails, the Python check decides
(:class:`EveryCall`): an equal replacement object (a new config with the same values)
passes it and the tree is built again, up to :data:`MAX_BUILDS` times.
"""

from __future__ import annotations

import functools
import logging
import time
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cachecompile._torch import guard_tree as native
from cachecompile.entry import guard_paths
from cachecompile.entry.checker import Checker, Parts
from cachecompile.entry.guard_kinds import (
    TABLE,
    config_map_read,
    fixed_class,
    instance_dict,
    reads_instance_dict,
)
from cachecompile.entry.guard_paths import FRAME_GLOBALS, Step
from cachecompile.entry.guards import GuardMode, guard_lines, indent

logger = logging.getLogger(__name__)

# Builds per loaded variant: past this many (state replaced by equal objects call after
# call), the variant keeps the Python check. The first SKIPPING_BUILDS of them skip
# unchanged state (:class:`_Builder`); later ones check every leaf on every call.
MAX_BUILDS = 8
SKIPPING_BUILDS = 3

# A first build's price before this method has built one: per guard, measured on this
# 2-core machine (305 guards, 7-16 ms a build once the process is warm, loaded).
FIRST_PRICE_MS_PER_GUARD = 0.04


class BuildCost:
    """When a variant's first tree is worth building, shared by a method's variants.

    A tree costs ~300 accessors and leaves built from Python (10-15 ms an entry on this
    machine) and then saves the Python check's time on every call (0.2-0.5 ms against
    0.01). Built on a variant's second call, N entries that each serve a few calls pay N
    builds where they saved little. So the variant first rents: its calls run the Python
    check (every guard, every call, as always) and add up what that took; once the rent
    reaches a build's price, the tree is built (ski rental: at most twice the cost of
    knowing the call count beforehand). The price is the method's last build, per guard
    (its variants differ by sizes only), or :data:`FIRST_PRICE_MS_PER_GUARD` before one."""

    __slots__ = ("ms_per_guard",)

    def __init__(self) -> None:
        self.ms_per_guard = FIRST_PRICE_MS_PER_GUARD

    def price_ms(self, n_guards: int) -> float:
        return self.ms_per_guard * max(n_guards, 1)

    def note(self, n_guards: int, build_ms: float) -> None:
        self.ms_per_guard = build_ms / max(n_guards, 1)


class Node:
    """Where a guard's leaf goes: a manager of the tree being built and its live value.

    ``pinned``: the manager is in an anchor's skipped subtree, so a leaf on it runs only
    while that anchor is checked leaf by leaf; such a leaf must hold as long as the object
    is the same one (guard_kinds says which do). :meth:`live` is the same object's manager
    that is checked on every call. ``text``: the path, for the C++'s messages."""

    __slots__ = ("_b", "mgr", "obj", "pinned", "text")

    def __init__(self, b: _Builder, text: str, mgr: Any, obj: Any, pinned: bool) -> None:
        self._b, self.text, self.mgr, self.obj, self.pinned = b, text, mgr, obj, pinned

    def live(self) -> Node:
        return self._b.front(self) if self.pinned else self

    def child(self, step: Step) -> Node:
        """One more step from this node: pinned where the step keeps it so."""
        if self.pinned:
            pinned = _pin(step, self.obj)
            if pinned is not None:
                return self._b.walk(self, pinned[0], pinned[1])
        return self._b.walk(self.live(), [step], [])


class _Builder:
    """The tree being built (guard_kinds.Tree): accessors shared by path.

    Checking less. The state a method reads hangs off a few *anchors*: the
    ``nn.Module`` (or Python module) an object path first reaches. From an anchor, a path
    whose every step reads a dict (an attribute from the instance ``__dict__``, an item of
    a plain dict, a class's own dict) or an immutable link (a tuple item, a function's
    ``__closure__``) is *pinned*: while the anchor is the same object and none of those
    dicts has changed, the object at its end is the same object. Such paths are walked
    through the dicts themselves under the anchor, whose subtree the C++ skips while its
    dicts are unchanged (:func:`native.skip_while_unchanged`); a leaf goes there only if
    the object's identity decides it (an identity, an immutable value, a dict's keys or
    length).

    Everything else about a pinned object (a tensor's facts, a class that can be
    reassigned, what a custom ``__getattribute__`` returns, a list's items, a cell's
    contents) is checked on every call, on the object itself: each such object is an
    entry of the *frontier*, a tuple the tree holds (weakly where the object allows),
    reached in two steps from the frame instead of by its whole path. While the anchor's
    dicts are unchanged the frontier object is the one at the path's end; once they
    change, the subtree is checked leaf by leaf, and an identity leaf there ties each path
    to its frontier object, so a replaced object fails the tree (the Python check then
    decides, and a new tree is built). Each object whose ``__dict__`` or class a pinned
    path goes through is checked for both on every call (``obj.__dict__ = d`` and
    ``obj.__class__ = C`` change no dict).
    """

    def __init__(self, frame: dict[str, Any], enum_: Any, skip: bool) -> None:
        self.frame = frame
        self.enum = enum_
        self.skip = skip
        self.root = native.root()
        self.top = Node(self, "", self.root, frame, False)
        # By (node, step): nodes live as long as the builder, so their identity is a key.
        self.nodes: dict[tuple[Node, Step], Node] = {}
        self._anchors: dict[int, Node] = {}
        self._next: dict[tuple[Node, Step], Node | None] = {}
        self.held = _Held()
        self.anchors: list[Any] = []
        self.front_refs: list[Any] = []
        self._front: dict[int, Node] = {}
        self._front_root: Any = None
        self._tied: set[tuple[int, int]] = set()
        self._needs: set[tuple[int, str]] = set()
        self.rearm = _Rearm()

    def keep(self, obj: Any) -> None:
        self.held.add(obj)

    def node(self, expr: str) -> Node | None:
        """The node an object path names; None if it is not one. A step that cannot be
        read now raises :class:`_NotAPath` (Python checks that guard)."""
        steps = guard_paths.path(expr)
        if steps is None:
            return None
        node = self.top
        for i, step in enumerate(steps):
            # Paths share long prefixes: each (node, step) is decided once per build.
            nxt = self._next.get((node, step), _UNSEEN)
            if nxt is _UNSEEN:
                nxt = self._next[(node, step)] = self._step_from(node, step)
            if nxt is None:     # no longer pinned: the rest is checked on every call
                return self.walk(node.live(), steps[i:], ())
            node = nxt
        return node

    def _step_from(self, node: Node, step: Step) -> Node | None:
        """One step of a path: up to the first anchor as it is, then pinned while each
        step keeps it so (None where one does not)."""
        if not node.pinned:
            nxt = self.walk(node, (step,), ())
            return self._anchor(nxt) if self.skip and _is_anchor(nxt.obj) else nxt
        pinned = _pin(step, node.obj)
        return None if pinned is None else self.walk(node, *pinned)

    def _anchor(self, node: Node) -> Node:
        """``node``'s manager as an anchor: a subtree root, skipped while unchanged."""
        found = self._anchors.get(id(node))
        if found is None:
            found = self._anchors[id(node)] = Node(self, node.text, node.mgr, node.obj, True)
            self.anchors.append(node.mgr)
            native.predicate(node.mgr, self.rearm.note(len(self.anchors) - 1),
                             "the anchor's state, checked leaf by leaf")
        return found

    def walk(self, node: Node, steps: Sequence[Step], needs: Sequence[str]) -> Node:
        """Down ``steps`` from ``node``, sharing managers by path; ``needs``: what each
        step asks of the object it starts from on every call ("type", "dict")."""
        for i, step in enumerate(steps):
            if step == ("attr", "__dict__") and _plain_class(node.obj):
                # A class's own dict through the C++ class-dict accessor: ``cls.__dict__``
                # is a new mapping proxy on each read, which no native leaf tests.
                step = ("type_dict", None)
            found = self.nodes.get((node, step))
            if found is None:
                obj = node.obj
                try:
                    value = _step(obj, step)
                except Exception as e:  # not readable now: Python checks it
                    raise _NotAPath(step) from e
                text = node.text + guard_paths.label(step)
                if step[0] == "dict":
                    # dict(proxy)[k] is proxy[k]: the same node, for a class's __dict__ only
                    # (a proxy, or the dict behind it).
                    if not isinstance(obj, types.MappingProxyType) and type(obj) is not dict:
                        raise _NotAPath(step)
                    mgr = node.mgr
                else:
                    mgr = native.child(node.mgr, obj, step, value, text, self.enum)
                found = self.nodes[(node, step)] = Node(self, text, mgr, value, node.pinned)
            if i < len(needs) and needs[i]:
                for what in needs[i].split(","):
                    if what:
                        self.need(node, what)
            node = found
        return node

    def need(self, node: Node, what: str) -> None:
        """``what`` of a pinned object, checked on every call: its class or its ``__dict__``."""
        if (id(node.obj), what) in self._needs:
            return
        self._needs.add((id(node.obj), what))
        live = node.live()
        if what.startswith("mapped:"):
            self._mapped(node, what.partition(":")[2])
            return
        if what == "type":
            self.keep(type(node.obj))
            native.type_match(live.mgr, type(node.obj), f"type({node.text})")
        elif what == "mro":
            mro = node.obj.__mro__
            self.keep(mro)
            native.id_match(native.child(live.mgr, node.obj, ("attr", "__mro__"), mro,
                                         f"{node.text}.__mro__", self.enum),
                            mro, f"{node.text}.__mro__ (the same MRO)")
        else:
            d = object.__getattribute__(node.obj, "__dict__")
            self.keep(d)
            native.dict_identity(live.mgr, node.obj, d, f"{node.text}.__dict__ (same dict)",
                                 self.enum)

    def _mapped(self, node: Node, name: str) -> None:
        """What makes ``obj.name`` the instance dict's item under transformers' config
        ``__getattribute__`` (guard_kinds.config_map_read), on every call: the class's
        ``__getattribute__`` and ``attribute_map`` are the same objects, the map lacks
        ``name``, and the instance has no ``attribute_map`` of its own."""
        obj = node.obj
        cls = type(obj)
        amap = config_map_read(obj, name)
        if amap is None:
            raise _NotAPath(("attr", name))
        text = f"{node.text}.{name} (read through {cls.__qualname__}.attribute_map)"
        owner = self.const(cls)
        if (id(cls), "mapped") not in self._needs:
            self._needs.add((id(cls), "mapped"))
            fn = cls.__getattribute__
            self.keep(fn)
            native.id_match(native.child(owner.mgr, cls, ("attr", "__getattribute__"), fn,
                                         f"{cls.__qualname__}.__getattribute__", self.enum),
                            fn, f"{cls.__qualname__}.__getattribute__ is transformers' own")
            self.keep(amap)
            native.id_match(self._class_map(owner, cls, amap), amap,
                            f"{cls.__qualname__}.attribute_map is the same dict")
        mgr = self._class_map(owner, cls, amap)
        if not native.dict_contains(mgr, amap, False, name, text):
            native.predicate(mgr, functools.partial(_lacks, name), text)
        d = object.__getattribute__(obj, "__dict__")
        own = native.child(node.live().mgr, obj, ("__dict__", None), d,
                           f"{node.text}.__dict__", self.enum)
        if not native.dict_contains(own, d, False, "attribute_map", text):
            native.predicate(own, functools.partial(_lacks, "attribute_map"), text)

    def _class_map(self, owner: Node, cls: type, amap: dict[str, Any]) -> Any:
        found = self.nodes.get((owner, ("attr", "attribute_map")))
        if found is None:
            found = self.nodes[(owner, ("attr", "attribute_map"))] = Node(
                self, f"{cls.__qualname__}.attribute_map",
                native.child(owner.mgr, cls, ("attr", "attribute_map"), amap,
                             f"{cls.__qualname__}.attribute_map", self.enum), amap, False)
        return found.mgr

    def const(self, obj: Any) -> Node:
        """A frontier entry for ``obj`` itself, reached by no path."""
        return self._entry(obj)

    def front(self, node: Node) -> Node:
        """The frontier entry of a pinned node's object (made on first use), tied to the
        node: the anchor's subtree, when checked leaf by leaf, matches it by identity."""
        obj = node.obj
        if (id(node.mgr), id(obj)) not in self._tied:
            self._tied.add((id(node.mgr), id(obj)))
            self.keep(obj)
            native.id_match(node.mgr, obj, f"{node.text} is the object checked every call")
        return self._entry(obj)

    def _entry(self, obj: Any) -> Node:
        found = self._front.get(id(obj))
        if found is not None:
            return found
        self.keep(obj)
        i = len(self.front_refs)
        try:
            ref: Any = weakref.ref(obj)
        except TypeError:
            ref = obj
        self.front_refs.append(ref)
        if self._front_root is None:
            self._front_root = native.child(self.root, self.frame, ("item", FRONTIER),
                                            (ref,), "frontier", self.enum)
        mgr = native.child(self._front_root, (ref,), ("item", i), ref, f"frontier[{i}]",
                           self.enum)
        if ref is not obj:
            mgr = native.weakref_call(mgr, obj, f"frontier[{i}]()", self.enum)
        found = self._front[id(obj)] = Node(self, f"frontier[{i}]", mgr, obj, False)
        return found

    def skip_unchanged(self) -> int:
        """Mark each anchor's subtree to be skipped while unchanged; answers how many
        managers are."""
        sizes = [native.skip_while_unchanged(a) for a in self.anchors]
        self.rearm.big = [n >= REARM_MIN for n in sizes]
        return sum(sizes)

    def leaf(self, g: dict[str, Any], text: str) -> bool:
        """The native leaf for guard ``g`` (guard_kinds.TABLE); False if it has none."""
        kind = TABLE.get(str(g["kind"]))
        if kind is None or kind.native is None:
            return False
        try:
            return kind.native(self, str(g.get("expr") or ""), g.get("value"), text)
        except _NotAPath:
            return False


def _lacks(key: str, d: Any) -> bool:
    return key not in d


class _NotAPath(Exception):
    """A step the tree cannot follow here: the guard is checked in Python."""


class _Rearm:
    """Notes when an anchor's subtree is checked leaf by leaf again after the check that
    recorded its dicts: something in it changed, and the skipping is off for good in this
    tree. Where that anchor holds much of the state (:data:`REARM_MIN` managers or more),
    :class:`EveryCall` then builds a new tree (a bounded number of times); a small one
    (a Python module whose globals change as it runs) is left checked leaf by leaf."""

    __slots__ = ("big", "counts", "due", "on_due")

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.big: list[bool] = []
        self.due = False
        self.on_due: Callable[[], None] | None = None

    def note(self, i: int) -> Callable[[Any], bool]:
        self.counts.append(0)
        self.big.append(False)

        def seen(_value: Any) -> bool:
            self.counts[i] += 1
            if self.counts[i] > 1 and self.big[i]:
                self.due = True
                if self.on_due is not None:
                    self.on_due()
            return True
        return seen


# Managers under an anchor for its change to be worth a new tree (_Rearm).
REARM_MIN = 16
_UNSEEN: Any = object()
# The frame entry holding the frontier (the objects checked on every call).
FRONTIER = "__cc_F"
def _step(obj: Any, step: Step) -> Any:
    how, name = step
    if how == "type":
        return type(obj)
    if how == "dict":
        return obj
    if how == "attr":
        return getattr(obj, name)
    if how == "__dict__":
        return object.__getattribute__(obj, "__dict__")
    if how == "type_dict":
        return native.class_dict(obj)
    if how in ("key", "value"):
        return native.by_position(how, name)(obj)
    return obj[name]


def _plain_class(obj: Any) -> bool:
    """A class whose ``__dict__`` is type's own: the read-only view of its class dict."""
    if not isinstance(obj, type):
        return False
    meta: Any = type(obj)
    return all("__dict__" not in vars(k) for k in meta.__mro__ if k is not type)


def _is_anchor(obj: Any) -> bool:
    """An object whose state a subtree may skip while unchanged: a ``nn.Module`` or a
    Python module (they outlive the call and take the weak reference the C++ keeps)."""
    return (isinstance(obj, (torch.nn.Module, types.ModuleType))
            and type(obj).__weakrefoffset__ != 0)


def _pin(step: Step, obj: Any) -> tuple[list[Step], list[str]] | None:
    """``step`` from a pinned ``obj`` as steps that keep the result pinned, with what each
    needs checked on every call of the object it starts from; None if it does not."""
    how, _ = step
    if how == "attr":
        return _pin_attr(step, obj)
    if how == "item":
        if native.plain_dict(obj) or type(obj) is tuple:
            return [step], [""]
        return None
    if how in ("key", "value"):
        # dict.keys / dict.__getitem__ themselves: any dict's version pins both.
        return ([step], [""]) if isinstance(obj, dict) else None
    if how == "dict":
        # dict(cls.__dict__): the class's own dict, already reached by ("type_dict").
        return ([], []) if type(obj) is dict else None
    if how == "type":
        return [step], ["" if fixed_class(obj) else "type"]
    if how in ("__dict__", "type_dict"):
        return [step], ["dict" if how == "__dict__" and not isinstance(obj, types.ModuleType)
                        else ""]
    return None


def _pin_attr(step: Step, obj: Any) -> tuple[list[Step], list[str]] | None:
    """:func:`_pin` for an attribute read (``obj.name``): kept pinned where the attribute
    cannot change unseen (read-only, or read through a dict whose version is checked)."""
    name = step[1]
    if name == "__dict__" and isinstance(obj, type):
        return [("type_dict", None)], [""]
    if name == "__mro__" and _plain_class(obj):
        # A class's MRO is a tuple that changes only with its bases: the same tuple
        # (checked on every call), then its items and their dicts stay pinned.
        return [step], ["mro"]
    if name in ("__func__", "__self__") and type(obj) is types.MethodType:
        return [step], [""]            # read-only
    if name in ("__closure__", "__globals__") and type(obj) is types.FunctionType:
        return [step], [""]            # read-only
    # A Python module's __dict__ cannot be reassigned; any other object's is checked.
    dict_need = "" if isinstance(obj, types.ModuleType) else "dict"
    if name == "__dict__" and instance_dict(obj) is not None:
        return [("__dict__", None)], [dict_need]
    if reads_instance_dict(obj, name):
        return [("__dict__", None), ("item", name)], [dict_need, ""]
    if config_map_read(obj, name) is not None:
        # transformers' config: the same read, while the class's attribute_map and its
        # __getattribute__ are what they were (checked on every call: need "mapped").
        return [("__dict__", None), ("item", name)], [f"{dict_need},mapped:{name}", ""]
    return None


def _frame_source(parts: Parts) -> str:
    """``{'self': self, 'x': x, ..., '__cc_G': __cc_G, 'n': <closure cell>}``."""
    items = [f"{n!r}: {n}" for n in parts.names]
    items.append(f"{FRAME_GLOBALS!r}: {FRAME_GLOBALS}")
    items += [f"{n!r}: __cc_closure[{i}].cell_contents"
              for i, n in enumerate(parts.func.__code__.co_freevars)]
    return "{" + ", ".join(items) + "}"


class _Held:
    """The objects a tree matches by id. An id is only that object's while it lives, so
    the tree is used only while all of them do: held weakly where they allow it (a
    swapped-out submodule is freed, not kept alive by a tree that no longer fits), and
    the tree dies with the first of them (its id may be reused); held strongly otherwise
    (builtin functions, cells, dicts), until then."""

    __slots__ = ("alive", "ids", "on_death", "refs", "strong")

    def __init__(self) -> None:
        self.alive = True
        self.on_death: Callable[[], None] | None = None
        self.ids: set[int] = set()
        self.refs: list[weakref.ref[Any]] = []
        self.strong: list[Any] = []

    def add(self, obj: Any) -> None:
        if id(obj) in self.ids:
            return
        self.ids.add(id(obj))
        try:
            self.refs.append(weakref.ref(obj, self._died))
        except TypeError:
            self.strong.append(obj)

    def _died(self, _ref: weakref.ref[Any]) -> None:
        self.alive = False
        self.strong.clear()   # the tree is not used again: let go of what it held
        if self.on_death is not None:
            self.on_death()


class Tree:
    """A built tree as a check over the method's own arguments."""

    def __init__(self, check: Callable[..., bool], n_native: int, n_python: int,
                 skipped: int, frontier: int, held: _Held, rearm: _Rearm,
                 build_ms: float) -> None:
        self.check = check
        self.n_native = n_native
        self.n_python = n_python
        self.skipped = skipped      # managers skipped while their anchor is unchanged
        self.frontier = frontier    # objects checked on every call, reached directly
        self.held = held
        self.rearm = rearm
        self.build_ms = build_ms


def build(parts: Parts, args: tuple[Any, ...], kwargs: dict[str, Any],
          skip: bool = True) -> Tree | None:
    """The tree for ``parts``'s guards on the objects of this call (whose Python check
    just passed); None if this torch cannot build one or it does not pass here.
    ``skip``: skip unchanged state (where this torch can); else every leaf on every call."""
    if not native.available():
        return None
    t0 = time.perf_counter()
    frame_src = _frame_source(parts)
    n = len(parts.guards)
    try:
        # The frame builder and the tree's check are compiled once per checker; a rebuild
        # only binds a new root and frontier.
        make_frame = parts.env.get("__cc_frame") or parts.function(
            "__cc_frame", f"def __cc_frame({parts.params}):\n    return {frame_src}\n")
        _defaults(make_frame, parts)
        frame = make_frame(*args, **kwargs)
        rest: list[str] = []
        with native.building() as enum_:
            b = _Builder(frame, enum_, skip and native.tags_available())
            for g, cond in zip(parts.guards, parts.conds, strict=True):
                if not b.leaf(g, str(g.get("text") or cond)):
                    rest.append(cond)
            if rest:
                native.predicate(b.root, _python_rest(parts, rest), "the guards checked in Python")
            skipped = b.skip_unchanged()
        make = parts.env.get("__cc_make_tree") or parts.function(
            "__cc_make_tree", f"def __cc_make_tree(__cc_root, {FRONTIER}):\n"
            f"    def __cc_tree({parts.params}):\n"
            f"        return __cc_root.check({frame_src[:-1]}, {FRONTIER!r}: {FRONTIER}}})\n"
            "    return __cc_tree\n")
        check = make(b.root, tuple(b.front_refs))
        _defaults(check, parts)
        if not check(*args, **kwargs):     # also the check that records the anchors' dicts
            logger.debug("guard tree for %s fails where the Python check passed: not used",
                         parts.func.__qualname__)
            return None
    except Exception:  # a tree is an optimisation: the Python check stays
        logger.debug("building the guard tree for %s failed", parts.func.__qualname__,
                     exc_info=True)
        return None
    ms = (time.perf_counter() - t0) * 1e3
    logger.debug("guard tree for %s: %d guards native, %d in Python; %d managers under %d "
                 "anchors skipped while unchanged, %d objects checked on every call; built "
                 "in %.1f ms", parts.func.__qualname__, n - len(rest), len(rest), skipped,
                 len(b.anchors), len(b.front_refs), ms)
    return Tree(check, n - len(rest), len(rest), skipped, len(b.front_refs), b.held, b.rearm,
                ms)


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
    return parts.function("__cc_rest", src)


class EveryCall:
    """``guards="always"``: the tree when it holds, the Python check when it does not.

    Bound to the module as the variant's check. The Python check decides every failure of
    the tree, so the tree only ever makes a passing call cheaper. A tree is built again
    when the Python check passes where it failed (an equal object replaced one it matched
    by identity) and when an anchor's state changed under it (its skipping is then off):
    the first :data:`SKIPPING_BUILDS` builds skip unchanged state, later ones check every
    leaf (they hold across equal replacements), and past :data:`MAX_BUILDS` the variant
    keeps the Python check.

    ``cost``: the first tree waits until the Python checks of passing calls have taken as
    long as a build would (:class:`BuildCost`); until then every call runs the Python
    check. None: the first passing check builds it."""

    def __init__(self, parts: Parts, python: Callable[..., bool],
                 cost: BuildCost | None = None) -> None:
        self._parts = parts
        self._python = python
        self._cost = cost
        self._rent_ms = 0.0     # the Python checks' time of passing calls, before a tree
        self._tree: Tree | None = None
        # The tree's check while it may answer alone; None once an object it matched died
        # or its skipping turned off (the tree calls _off), and while there is no tree.
        self._check: Callable[..., bool] | None = None
        self._builds = 0

    @property
    def tree(self) -> Tree | None:
        return self._tree

    def fast(self, *args: Any, **kwargs: Any) -> bool:
        """The tree alone: True only if it is built and holds (no Python check)."""
        check = self._check
        if check is None:
            return self._settle(args, kwargs)
        try:
            return bool(check(*args, **kwargs))
        except Exception:  # the full check decides
            logger.debug("guard tree raised", exc_info=True)
            return False

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        # fast(), inline: this runs on every call.
        check = self._check
        if check is not None:
            try:
                if check(*args, **kwargs):
                    return True
            except Exception:  # the full check decides
                logger.debug("guard tree raised", exc_info=True)
        elif self._settle(args, kwargs):
            return True
        elif self._cost is not None and self._builds == 0:
            return self._rent(args, kwargs)
        if not self._python(*args, **kwargs):
            return False
        self._build(args, kwargs)
        return True

    def _rent(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """No tree yet: the Python check decides, and its time counts toward a build."""
        t0 = time.perf_counter()
        if not self._python(*args, **kwargs):
            return False
        self._rent_ms += (time.perf_counter() - t0) * 1e3
        cost = self._cost
        if cost is not None and self._rent_ms >= cost.price_ms(len(self._parts.guards)):
            self._build(args, kwargs)
        return True

    def _off(self) -> None:
        self._check = None

    def _settle(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """The tree in hand once its check is off: dropped if an object it matched died
        (its id may be reused); else its skipping turned off, so it is checked leaf by
        leaf and, where it holds (the Python check would), built again to skip again."""
        tree = self._tree
        if tree is None:
            return False
        if not tree.held.alive:
            self._tree = None
            return False
        try:
            ok = bool(tree.check(*args, **kwargs))
        except Exception:  # the full check decides
            logger.debug("guard tree raised", exc_info=True)
            return False
        if ok:
            self._build(args, kwargs, rearm=True)
        return ok

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any], rearm: bool = False) -> None:
        """A new tree from this call's objects (its check just passed). Past the budget
        the variant keeps the Python check, unless this is a re-arm of a tree that still
        holds (its skipping turned off): that tree stays, checking leaf by leaf."""
        if self._builds >= MAX_BUILDS:
            tree = self._tree
            if rearm and tree is not None:
                tree.rearm.on_due = None
                self._check = tree.check
            else:
                self._tree = self._check = None
            return
        self._builds += 1
        tree = self._tree = build(self._parts, args, kwargs,
                                  skip=self._builds <= SKIPPING_BUILDS)
        self._check = None
        if tree is not None:
            if self._cost is not None:
                self._cost.note(len(self._parts.guards), tree.build_ms)
            tree.held.on_death = tree.rearm.on_due = self._off
            if tree.held.alive:
                self._check = tree.check


class FirstCall:
    """``guards="first"`` (TorchAir's behaviour): the argument guards on every call, the
    state guards when the variant is loaded and once more on its next call.

    That second look is for a method whose own side effects change state it is guarded
    on (``self.step += 1``, an append to a list it reads): the replayed program writes the
    traced values, so after one call the state no longer fits. Such a variant then
    checks every guard on every call, as ``"always"`` does, so that its side effects
    happen on every call; state that only the user changes later is still not seen."""

    def __init__(self, parts: Parts, full: Callable[..., bool],
                 per_call: Callable[..., bool] | None) -> None:
        self._parts = parts
        self._full = full
        self._per_call = per_call
        self._every: Callable[..., bool] | None = None
        self._looked = False

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        if self._every is not None:
            return self._every(*args, **kwargs)
        if not self._looked:
            self._looked = True
            if not self._full(*args, **kwargs):
                logger.info("cachecompile %s: the state it is guarded on changed after one "
                            "call; this variant checks every guard on every call",
                            self._parts.func.__qualname__)
                self._every = EveryCall(self._parts, self._full)
                return False
        return self._per_call is None or self._per_call(*args, **kwargs)


def variant_check(checker: Checker, mode: GuardMode,
                  cost: BuildCost | None) -> Callable[..., bool]:
    """What runs on every call of a loaded variant (a signature's or a frame's), before it
    runs: every guard (ALWAYS: the C++ tree once worth building, the Python check until
    then and whenever the tree does not hold) or the argument guards with the state guards
    once more on the next call (FIRST)."""
    if mode is GuardMode.ALWAYS:
        return EveryCall(checker.parts, checker.full, cost)
    return FirstCall(checker.parts, checker.full,
                     checker.per_call if checker.n_per_call else None)
