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
  guards, the global state its own guard;
* what has no native leaf (shape relations, environment reads, memory overlap, function
  modes) runs as one Python function on the tree's root, the checker's own conditions.

Every native leaf is at least as strict as its Python guard, so a tree that passes means
the Python check would. When the tree fails, the Python check decides
(:class:`EveryCall`): an equal replacement object (a new config with the same values)
passes it and the tree is built again, up to :data:`MAX_BUILDS` times.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

from cachecompile._torch import guard_tree as native
from cachecompile.entry import guard_paths
from cachecompile.entry.guard_kinds import TABLE
from cachecompile.entry.guard_paths import FRAME_GLOBALS, Step
from cachecompile.entry.guards import Parts, guard_lines, indent

logger = logging.getLogger(__name__)

# Builds per loaded variant: past this many (state replaced by equal objects call after
# call), the variant keeps the Python check.
MAX_BUILDS = 8


class _Builder:
    """The tree being built (guard_kinds.Tree): accessors shared by path."""

    def __init__(self, frame: dict[str, Any], enum_: Any) -> None:
        self.frame = frame
        self.enum = enum_
        self.root = native.root()
        self.nodes: dict[tuple[Step, ...], tuple[Any, Any]] = {(): (self.root, frame)}
        self.children: dict[tuple[int, Step], Any] = {}
        self.held = _Held()

    def keep(self, obj: Any) -> None:
        self.held.add(obj)

    def child(self, mgr: Any, obj: Any, step: Step, value: Any, source: str) -> Any:
        key = (id(mgr), step)
        found = self.children.get(key)
        if found is None:
            found = self.children[key] = native.child(mgr, obj, step, value, source, self.enum)
        return found

    def node(self, expr: str) -> tuple[Any, Any] | None:
        """(manager, live value) for an object path, accessors shared; None if it is not
        one or cannot be read now."""
        steps = guard_paths.path(expr)
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
                    hit = (self.child(mgr, obj, steps[i], value, expr), value)
                self.nodes[key] = hit
            mgr, obj = hit
        return mgr, obj

    def leaf(self, g: dict[str, Any], text: str) -> bool:
        """The native leaf for guard ``g`` (guard_kinds.TABLE); False if it has none."""
        kind = TABLE.get(str(g["kind"]))
        if kind is None or kind.native is None:
            return False
        return kind.native(self, str(g.get("expr") or ""), g.get("value"), text)


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
    (builtin functions, which live as long as the process)."""

    __slots__ = ("alive", "refs", "strong")

    def __init__(self) -> None:
        self.alive = True
        self.refs: list[weakref.ref[Any]] = []
        self.strong: list[Any] = []

    def add(self, obj: Any) -> None:
        try:
            self.refs.append(weakref.ref(obj, self._died))
        except TypeError:
            self.strong.append(obj)

    def _died(self, _ref: weakref.ref[Any]) -> None:
        self.alive = False


class Tree:
    """A built tree as a check over the method's own arguments."""

    def __init__(self, check: Callable[..., bool], n_native: int, n_python: int,
                 held: _Held, build_ms: float) -> None:
        self.check = check
        self.n_native = n_native
        self.n_python = n_python
        self.held = held
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
        # The frame builder and the tree's check are compiled once per checker; a rebuild
        # only binds a new root.
        make_frame = parts.env.get("__cc_frame") or parts.function(
            "__cc_frame", f"def __cc_frame({parts.params}):\n    return {frame_src}\n")
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
        make = parts.env.get("__cc_make_tree") or parts.function(
            "__cc_make_tree", f"def __cc_make_tree(__cc_root):\n"
            f"    def __cc_tree({parts.params}):\n"
            f"        return __cc_root.check({frame_src})\n"
            "    return __cc_tree\n")
        check = make(b.root)
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
    return Tree(check, n - len(rest), len(rest), b.held, ms)


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
    the tree, so the tree only ever makes a passing call cheaper."""

    def __init__(self, parts: Parts, python: Callable[..., bool]) -> None:
        self._parts = parts
        self._python = python
        self._tree: Tree | None = None
        self._builds = 0

    @property
    def tree(self) -> Tree | None:
        return self._tree

    def fast(self, *args: Any, **kwargs: Any) -> bool:
        """The tree alone: True only if it is built and holds (no Python check)."""
        tree = self._tree
        if tree is None or not tree.held.alive:
            return False
        try:
            return bool(tree.check(*args, **kwargs))
        except Exception:  # noqa: BLE001 - the full check decides
            logger.debug("guard tree raised", exc_info=True)
            return False

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        if self.fast(*args, **kwargs):
            return True
        if not self._python(*args, **kwargs):
            return False
        if self._builds < MAX_BUILDS:
            self._builds += 1
            self._tree = build(self._parts, args, kwargs)
        return True


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
