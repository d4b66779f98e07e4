"""Dynamo's C++ guard tree (``torch._C._dynamo.guards``), built without importing Dynamo.

``import torch`` already loads the C++ classes: ``RootGuardManager``, its accessors
(``getattr_manager``, ``dict_getitem_manager``, ...) and leaf guards. Creating a child
accessor makes the C++ import ``torch._dynamo.guards`` (for ``GuardManagerType``) and
``torch._dynamo.config`` (a few flags), which would pull in all of Dynamo (~2.5 s). While a
tree is built, and only if Dynamo is not imported yet, stand-ins for those two modules sit
in ``sys.modules`` under the import lock; the finished tree no longer reads them, and a
later real ``import torch._dynamo`` works (tested).

Every name here is private and per release: :func:`available` builds a small tree once
per process and checks that it accepts and rejects what it should; where it does not,
cachecompile checks guards in Python only.

What a leaf takes, side by side per release (2.11-2.15 agree; checked on each): ``add_*_guard(value...,
verbose_code_parts, user_stack)``; ``add_tensor_match_guard(value, sizes, strides, name,
verbose_code_parts, user_stack, pytype, dispatch_keys)``.
"""

from __future__ import annotations

import _imp
import ast
import contextlib
import enum
import functools
import gc
import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

NEEDS: tuple[tuple[str, str], ...] = (
    ("torch", "_C._dynamo.guards.RootGuardManager"),
    ("torch", "_C._dynamo.guards.GlobalStateGuard"),
    ("torch", "_C._dynamo.guards.install_no_tensor_aliasing_guard"),
    ("torch", "_C._dynamo.guards.install_object_aliasing_guard"),
    ("torch", "_C._dispatch_keys"),
)

_G: Any = getattr(torch._C, "_dynamo", None) and torch._C._dynamo.guards


# The flags the C++ reads from torch._dynamo.config when it creates a manager; their
# defaults are read from this torch's config.py (:func:`_config_defaults`).
_CONFIG_FLAGS = ("max_saved_pointers_for_recursive_dict_tags_check",
                 "skip_tensor_guards_with_matching_dict_tags", "verbose")
_STAND_INS = ("torch._dynamo", "torch._dynamo.guards", "torch._dynamo.config")


def _module_source(name: str) -> str | None:
    """The source text of a module of torch._dynamo, without importing it (or Dynamo)."""
    spec = importlib.machinery.PathFinder.find_spec(name.rsplit(".", 1)[-1], _dynamo_path())
    if spec is None or not spec.origin:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def _dynamo_path() -> list[str]:
    return [os.path.join(os.path.dirname(torch.__file__), "_dynamo")]


# Read with regular expressions, not ast.parse: parsing torch/_dynamo/guards.py cost a warm
# start ~55 ms, once per process (tests/entry/test_guard_tree.py checks both reads agree).
_CLASS_BODY = r"^class {name}\b[^\n]*:\n((?:[ \t]+[^\n]*\n|[ \t]*\n)*)"
_MEMBER = re.compile(r"^    ([A-Za-z_]\w*) = (\d+)[ \t]*(?:#[^\n]*)?$", re.M)
_TOP_ASSIGN = r"^{name}[ \t]*(?::[^=\n]+)?=[ \t]*([^\n#]*?)[ \t]*(?:#[^\n]*)?$"


def _search_from(src: str, head: str, pattern: str) -> re.Match[str] | None:
    """``re.search(pattern, src, re.M)`` for a pattern anchored at a line that starts
    with ``head``: matched only at such lines (found with str.find), which spares a scan
    of the whole file by the regex engine (~10 ms a pattern on torch/_dynamo's sources)."""
    rx = re.compile(pattern, re.M)
    at = 0 if src.startswith(head) else src.find("\n" + head) + 1
    if at == 0 and not src.startswith(head):
        return None
    while True:
        m = rx.match(src, at)
        if m is not None:
            return m
        nxt = src.find("\n" + head, at)
        if nxt < 0:
            return None
        at = nxt + 1


@functools.cache
def _manager_type() -> type[enum.Enum] | None:
    """A copy of this torch's ``GuardManagerType`` (names and values, read from the
    source of torch/_dynamo/guards.py), or None if it is not there as expected."""
    src = _module_source("torch._dynamo.guards") or ""
    body = _search_from(src, "class GuardManagerType", _CLASS_BODY.format(name="GuardManagerType"))
    members = {k: int(v) for k, v in _MEMBER.findall(body.group(1))} if body else {}
    if "GUARD_MANAGER" in members:
        return enum.Enum("GuardManagerType", members)  # type: ignore[return-value]
    return None


@functools.cache
def _config_defaults() -> dict[str, Any] | None:
    """The defaults of the flags the C++ reads, from the source of torch/_dynamo/config.py."""
    src = _module_source("torch._dynamo.config") or ""
    found: dict[str, Any] = {}
    for name in _CONFIG_FLAGS:
        m = _search_from(src, name, _TOP_ASSIGN.format(name=name))
        if m is None:
            continue
        if name == "verbose":   # set from the environment in every release
            found[name] = os.environ.get("TORCHDYNAMO_VERBOSE", "0") == "1"
            continue
        try:
            found[name] = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            continue
    return found if set(found) == set(_CONFIG_FLAGS) else None


class _AdoptStandIn(importlib.abc.MetaPathFinder):
    """Once a stand-in ``GuardManagerType`` has been used, the C++ compares every later
    manager type with the stand-in's members (by identity, cached on first use). So the
    real ``torch._dynamo.guards``, when it is imported later, adopts the stand-in class
    (same names and values; only that module uses it), and torch.compile keeps working."""

    def __init__(self, stand_in: type[enum.Enum]) -> None:
        self.stand_in = stand_in

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo.guards":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module
        stand_in = self.stand_in

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            module.GuardManagerType = stand_in  # type: ignore[attr-defined]

        loader.exec_module = exec_module
        return spec


_adopting: list[_AdoptStandIn] = []

Manager = Any   # a torch._C._dynamo.guards.GuardManager


@contextlib.contextmanager
def building() -> Iterator[Any]:
    """Hold the import lock, with stand-ins for Dynamo's modules unless it is imported.

    Yields the ``GuardManagerType`` member to pass to accessors.

    Tensors are never taken for immutable while building (Dynamo's
    ``skip_tensor_guards_with_matching_dict_tags``, on by default, lets the C++ skip a
    tensor's TENSOR_MATCH while the dict holding it is unchanged, which misses an in-place
    ``requires_grad_()`` or ``.data =``)."""
    _imp.acquire_lock()
    try:
        if "torch._dynamo.guards" in sys.modules:
            cfg_real = sys.modules.get("torch._dynamo.config")
            flag = "skip_tensor_guards_with_matching_dict_tags"
            before = getattr(cfg_real, flag, None)
            if before:
                setattr(cfg_real, flag, False)
            try:
                yield sys.modules["torch._dynamo.guards"].GuardManagerType.GUARD_MANAGER
            finally:
                if before:
                    setattr(cfg_real, flag, before)
            return
        manager_type, defaults = _manager_type(), _config_defaults()
        if manager_type is None or defaults is None:
            raise RuntimeError("torch._dynamo's GuardManagerType or config flags are not "
                               "where this release is expected to keep them")
        if not _adopting:
            _adopting.append(_AdoptStandIn(manager_type))
            sys.meta_path.insert(0, _adopting[0])
        saved = {k: sys.modules.get(k) for k in _STAND_INS}
        pkg = types.ModuleType("torch._dynamo")
        pkg.__path__ = []
        gmod = types.ModuleType("torch._dynamo.guards")
        gmod.GuardManagerType = manager_type  # type: ignore[attr-defined]
        cfg = types.ModuleType("torch._dynamo.config")
        cfg.__dict__.update(defaults, skip_tensor_guards_with_matching_dict_tags=False)
        pkg.guards, pkg.config = gmod, cfg  # type: ignore[attr-defined]
        sys.modules.update({"torch._dynamo": pkg, "torch._dynamo.guards": gmod,
                            "torch._dynamo.config": cfg})
        try:
            yield manager_type.GUARD_MANAGER  # type: ignore[attr-defined]
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
    finally:
        _imp.release_lock()


def root() -> Manager:
    return _G.RootGuardManager()


def child(mgr: Manager, parent: Any, step: tuple[str, Any], example: Any, source: str,
          enum_: Any) -> Manager:
    """The accessor for one step of an object path from ``parent`` (the value ``mgr``
    guards): ``("attr", name)``, ``("item", key)``, ``("type", _)`` (``type(parent)``),
    ``("__dict__", None)`` (the instance dict, without running ``__getattr__``),
    ``("type_dict", None)`` (a class's own dict, :func:`class_dict`), ``("key", i)`` or
    ``("value", i)`` (a dict's i-th key, or its value).

    Dicts whose lookup is dict's (no ``__missing__``) use the dict accessor, lists and
    tuples theirs, anything else Python's ``obj[key]`` (the same lookup the Python check
    makes)."""
    how, key = step
    if how == "type":
        return mgr.type_manager(source=source, example_value=example, guard_manager_enum=enum_)
    if how in ("key", "value"):
        # By position in a dict (Dynamo's own DictGuardManager takes over the whole dict):
        # a Python accessor, which runs only where the dict is checked leaf by leaf.
        return mgr.lambda_manager(python_lambda=by_position(how, key), source=source,
                                  example_value=example, guard_manager_enum=enum_)
    if how == "__dict__":
        return mgr.get_generic_dict_manager(source=source, example_value=example,
                                            guard_manager_enum=enum_)
    if how == "type_dict":
        return mgr.type_dict_manager(source=source, example_value=example,
                                     guard_manager_enum=enum_)
    if how == "attr":
        if type(parent) is types.FunctionType and key in _FUNCTION_ACCESSORS:
            # A function's own slots, read directly (a value that is no function then
            # fails the check instead of being read through getattr).
            make = getattr(mgr, _FUNCTION_ACCESSORS[key])
            return make(source=source, example_value=example, guard_manager_enum=enum_)
        return mgr.getattr_manager(attr=key, source=source, example_value=example,
                                   guard_manager_enum=enum_)
    kw = {"key": key, "source": source, "example_value": example, "guard_manager_enum": enum_}
    if plain_dict(parent):
        return mgr.dict_getitem_manager(**kw)
    if type(parent) is list and isinstance(key, int):
        return mgr.list_getitem_manager(**kw)
    if type(parent) is tuple and isinstance(key, int):
        return mgr.tuple_getitem_manager(**kw)
    return mgr.getitem_manager(**kw)


_FUNCTION_ACCESSORS = {"__code__": "code_manager", "__closure__": "closure_manager",
                       "__defaults__": "func_defaults_manager",
                       "__kwdefaults__": "func_kwdefaults_manager"}


def by_position(how: str, i: int) -> Callable[[Any], Any]:
    """A dict's i-th key (``list(dict.keys(d))[i]``, ``how="key"``) or its value
    (``dict.__getitem__(d, ...)``, ``how="value"``), as Dynamo reads a dict it iterated."""
    if how == "key":
        return lambda d: list(dict.keys(d))[i]
    return lambda d: dict.__getitem__(d, list(dict.keys(d))[i])


def class_dict(cls: type) -> dict[str, Any]:
    """The dict a class keeps its attributes in (``cls.__dict__`` is a read-only view of
    it): what the C++ class-dict accessor reads, so that its changes are seen."""
    found = [d for d in gc.get_referents(cls.__dict__) if type(d) is dict]
    if len(found) != 1:
        raise TypeError(f"no dict behind {cls!r}.__dict__")
    return found[0]


def plain_dict(obj: Any) -> bool:
    """A dict whose item lookup is dict's own (the C++ dict accessor skips ``__missing__``)."""
    cls = type(obj)
    return (issubclass(cls, dict) and cls.__getitem__ is dict.__getitem__
            and not hasattr(cls, "__missing__"))


def type_match(mgr: Manager, cls: type, text: str) -> None:
    mgr.add_type_match_guard(id(cls), [text], None)


def id_match(mgr: Manager, obj: Any, text: str) -> None:
    mgr.add_id_match_guard(id(obj), [text], None)


def equals(mgr: Manager, value: Any, text: str) -> None:
    """``type(x) is type(value) and x == value`` (EQUALS_MATCH checks the type first)."""
    mgr.add_equals_match_guard(value, [text], None)


def length(mgr: Manager, obj: Any, n: int, text: str) -> bool:
    """A length leaf where C++ has one for ``obj``'s kind (dicts, lists, tuples)."""
    if isinstance(obj, dict):
        mgr.add_dict_length_check_guard(n, [text], None)
        return True
    if type(obj) in (list, tuple):
        mgr.add_length_check_guard(n, [text], None)
        return True
    return False


def no_hasattr(mgr: Manager, attr: str, text: str) -> None:
    mgr.add_no_hasattr_guard(attr, [text], None)


def dict_contains(mgr: Manager, obj: Any, present: bool, key: Any, text: str) -> bool:
    if type(obj) is not dict and (not isinstance(obj, dict)
                                  or type(obj).__contains__ is not dict.__contains__):
        return False
    mgr.add_dict_contains_guard(present, key, [text], None)
    return True


def tensor(mgr: Manager, t: torch.Tensor, sizes: Sequence[int | None],
           strides: Sequence[int | None], name: str, text: str) -> None:
    """TENSOR_MATCH: class, dispatch keys, dtype, device, requires_grad, the static dims."""
    mgr.add_tensor_match_guard(t, list(sizes), list(strides), name, [text], None, type(t),
                               torch._C._dispatch_keys(t))


def global_state(mgr: Manager, text: str) -> None:
    """The global state as it is now (built right after the Python check passed)."""
    mgr.add_global_state_guard(_G.GlobalStateGuard(), [text], None)


def function_modes(mgr: Manager, text: str) -> None:
    """The torch function mode stack holds modes of the classes it holds now."""
    mgr.add_torch_function_mode_stack_guard(
        [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())],
        [text], None)


def default_device(mgr: Manager, text: str) -> None:
    """``torch.set_default_device`` is what it is now."""
    mgr.add_default_device_guard([text], None)


def predicate(mgr: Manager, fn: Callable[[Any], bool], text: str) -> None:
    """A Python check of the manager's value (a leaf with no native form)."""
    mgr.add_lambda_guard(fn, [text], None)


def distinct(mgrs: Sequence[Manager], names: Sequence[str], text: str) -> None:
    """The values of ``mgrs`` are distinct objects (Dynamo's NO_TENSOR_ALIASING)."""
    _G.install_no_tensor_aliasing_guard(list(mgrs), list(names), [text], None)


def same_object(a: Manager, b: Manager, text: str) -> None:
    _G.install_object_aliasing_guard(a, b, [text], None)


def check(tree: Manager, frame: dict[str, Any]) -> bool:
    return bool(tree.check(frame))


def skip_while_unchanged(anchor: Manager) -> int:
    """Check ``anchor``'s subtree only when something in it changed (Dynamo's recursive
    dict tags). On its first check the C++ records every dict-valued node of the subtree
    with its version and keeps a weak reference to the anchor object; while the anchor is
    that object and none of those dicts has changed, later checks skip the whole subtree,
    the anchor's own leaves included. A changed dict, a failing check or a dead anchor
    turns the skipping off for good: the subtree is then checked leaf by leaf.

    The caller answers for the subtree: each of its leaves must hold as long as the anchor
    is the same object and those dicts are unchanged. Answers the managers marked."""
    seen = 0
    stack = [anchor]
    while stack:
        mgr = stack.pop()
        mgr.mark_tag_safe()
        seen += 1
        stack.extend(mgr.get_child_managers())
    anchor.mark_tag_safe_root()
    return seen


def weakref_call(mgr: Manager, obj: Any, source: str, enum_: Any) -> Manager:
    """The object a weak reference (the value ``mgr`` guards) points to."""
    return mgr.weakref_call_manager(source=source, example_value=obj, guard_manager_enum=enum_)


def dict_identity(mgr: Manager, obj: Any, d: dict[str, Any], text: str, enum_: Any) -> None:
    """``obj.__dict__ is d`` (``d`` held by the caller: an id is only its own while it lives)."""
    sub = mgr.get_generic_dict_manager(source=text, example_value=d, guard_manager_enum=enum_)
    sub.add_id_match_guard(id(d), [text], None)


def _probe_fn(a: int = 1) -> int:
    return a


@functools.cache
def available() -> bool:
    """Whether this torch builds and checks a tree as this module expects (once per process)."""
    if _G is None:
        return False
    # The probe's module and tensors draw from the global generator: a user's seeded
    # stream must not see it (a method that samples gave eager's numbers on its first
    # call only, the probe running on its second).
    with torch.random.fork_rng(devices=[]):
        return _available_probe()


def _available_probe() -> bool:
    try:
        lin = torch.nn.Linear(2, 2)
        x = torch.randn(3, 2)
        with building() as enum_:
            r = root()
            frame = {"self": lin, "x": x, "fn": _probe_fn}
            m = child(r, frame, ("item", "self"), lin, "self", enum_)
            type_match(m, type(lin), "type")
            hooks = child(m, lin, ("attr", "_forward_hooks"), lin._forward_hooks, "hooks", enum_)
            length(hooks, lin._forward_hooks, 0, "no hooks")
            w = child(m, lin, ("attr", "weight"), lin.weight, "w", enum_)
            tensor(w, lin.weight, [2, 2], [2, 1], "w", "w")
            xm = child(r, frame, ("item", "x"), x, "x", enum_)
            tensor(xm, x, [None, 2], [2, 1], "x", "x")
            distinct([w, xm], ["w", "x"], "distinct")
            fn = child(r, frame, ("item", "fn"), _probe_fn, "fn", enum_)
            id_match(child(fn, _probe_fn, ("attr", "__code__"), _probe_fn.__code__, "code",
                           enum_), _probe_fn.__code__, "fn.__code__")
            length(child(fn, _probe_fn, ("attr", "__defaults__"), _probe_fn.__defaults__,
                         "defaults", enum_), _probe_fn.__defaults__, 1, "one default")
            predicate(r, lambda d: d["x"].shape[0] <= 8, "x.size(0) <= 8")
            global_state(r, "global state")
            function_modes(r, "no function mode")
            default_device(r, "no default device")
        ok = (check(r, frame) and check(r, {**frame, "x": torch.randn(5, 2)})
              and not check(r, {**frame, "x": torch.randn(9, 2)})
              and not check(r, {**frame, "x": torch.randn(3, 3)})
              and not check(r, {**frame, "x": lin.weight})
              and not check(r, {**frame, "fn": lambda a=1: a})
              and not check(r, {**frame, "fn": len}))
        with torch.set_grad_enabled(not torch.is_grad_enabled()):   # global state flipped
            ok = ok and not check(r, frame)
        with torch.overrides.TorchFunctionMode():
            ok = ok and not check(r, frame)
        with torch.device("meta"):
            ok = ok and not check(r, frame)
        h = lin.register_forward_hook(lambda *a: None)
        ok = ok and not check(r, frame)
        h.remove()
    except Exception:  # any difference in this release: Python checks only
        logger.debug("the C++ guard tree is unavailable on this torch", exc_info=True)
        return False
    if not ok:
        logger.debug("the C++ guard tree checks differently on this torch: not used")
    return ok


@functools.cache
def tags_available() -> bool:
    """Whether this torch skips a subtree while its dicts are unchanged the way
    :func:`skip_while_unchanged` says (once per process): it skips an unchanged subtree,
    notices a changed value, an added key and a replaced object in any dict below the
    anchor, then checks leaf by leaf; and a tensor under an unchanged dict is still
    checked where it is not in a skipped subtree. Where it does not, trees check every
    leaf on every call."""
    if not available():
        return False
    try:
        with torch.random.fork_rng(devices=[]):   # the user's seeded stream stays as it is
            return _tags_probe()
    except Exception:  # any difference in this release: check every leaf
        logger.debug("skipping unchanged subtrees is unavailable on this torch", exc_info=True)
        return False


def _tags_probe() -> bool:
    def tree(lin: torch.nn.Linear, seen: list[int]) -> tuple[Manager, dict[str, Any]]:
        frame = {"self": lin, "live": lin.weight}

        def checked(_value: Any) -> bool:
            seen.append(1)
            return True

        with building() as enum_:
            r = root()
            a = child(r, frame, ("item", "self"), lin, "self", enum_)
            predicate(a, checked, "checked")
            d = child(a, lin, ("__dict__", None), lin.__dict__, "__dict__", enum_)
            equals(child(d, lin.__dict__, ("item", "training"), True, "training", enum_),
                   True, "training")
            hooks = child(d, lin.__dict__, ("item", "_forward_hooks"), lin._forward_hooks,
                          "hooks", enum_)
            length(hooks, lin._forward_hooks, 0, "no hooks")
            ps = child(d, lin.__dict__, ("item", "_parameters"), lin._parameters, "ps", enum_)
            id_match(child(ps, lin._parameters, ("item", "weight"), lin.weight, "w", enum_),
                     lin.weight, "weight")
            # A tensor under a dict whose tag is unchanged, outside the skipped subtree.
            live = child(r, frame, ("item", "live"), lin.weight, "live", enum_)
            tensor(live, lin.weight, [2, 2], [2, 1], "live", "live")
            if skip_while_unchanged(a) != 6:
                raise RuntimeError("unexpected subtree")
        return r, frame

    def new_weight(m: torch.nn.Linear) -> None:
        m.weight = torch.nn.Parameter(torch.randn(2, 2))

    # Each change, and how to undo it (None: the tree cannot pass again).
    changes: list[tuple[Callable[[torch.nn.Linear], Any], Callable[[Any], Any] | None]] = [
        (lambda m: m.eval(), lambda m: m.train()),
        (lambda m: m.register_forward_hook(lambda *a: None), lambda h: h.remove()),
        (new_weight, None),
    ]
    for change, undo in changes:
        seen: list[int] = []
        lin = torch.nn.Linear(2, 2)
        r, frame = tree(lin, seen)
        if not (r.check(frame) and r.check(frame) and r.check(frame)) or len(seen) != 1:
            return False                       # records once, then skips
        undone = change(lin)
        if r.check(frame) or len(seen) != 2:
            return False                       # the change is seen: checked, and fails
        if undo is not None:
            undo(undone if undone is not None else lin)
            if not r.check(frame) or len(seen) != 3:
                return False                   # leaf by leaf from now on
    lin = torch.nn.Linear(2, 2)
    r, frame = tree(lin, [])
    r.check(frame)
    lin.weight.requires_grad_(False)           # in place: no dict changes
    return not r.check(frame)
