"""Where Python looked a name up and found nothing: absent state, from the lookup itself.

A compiled frame depends on what each name it read resolved to, and also on every
namespace Python consulted before that and found without the name: ``self.K`` found on a
base class holds only while the subclass and the instance still lack ``K``; a builtin
``abs`` holds only while the module calling it defines no ``abs``. Dynamo guards what it
found (the value, the dict it came from), rarely where it found nothing, and a fresh
process may add the name there.

:mod:`cachecompile._torch.dynamo` records each lookup Dynamo resolves while it traces
(``obj.name`` and ``getattr``, ``getattr`` with a default, ``hasattr``, a global its
function's globals lack), with the live object and Dynamo's source expression for it.
This module replays Python's own lookup on that object, now, and names each namespace the
lookup consulted that lacked the name: :data:`ROWS` has one row per kind of lookup,
each the order CPython consults namespaces in (``object.__getattribute__``,
``type.__getattribute__``, the module's ``__getattr__``, ``LOAD_GLOBAL``). Each such
namespace becomes a guard that it still lacks the name (:meth:`Absent.guard`). Nothing
here reads Dynamo's guard text.

Not guarded (docs/usage.md, "Guards"): namespaces of classes and modules whose code is
pinned by the torch and Python version factors (torch's, the standard library's, builtin
types, which a user does not patch a name into), the instance dict of a tensor (Dynamo's
tensor guards cover a tensor), a name an ``nn.Module`` keeps in its ``_parameters``,
``_buffers`` or ``_modules`` (its ``__setattr__`` keeps those out of the instance dict),
objects with a custom ``__getattribute__`` (their lookup is their own code, which Dynamo
traces), and objects made during the trace (they have no path from the frame).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from cachecompile._torch.dynamo import Resolved
from cachecompile.entry import values
from cachecompile.entry.guards import user_text
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key.identity import pinned_by_version
from cachecompile.store.jsonvalue import JSON


@dataclasses.dataclass(frozen=True)
class Absent:
    """A namespace a lookup consulted and found without ``name``: the entry guards that
    it still lacks it.

    ``where``: ``"class"`` (a class's own ``__dict__``; ``expr`` is the class,
    ``type(L['self']).__mro__[1]``), ``"instance"`` (an object's ``__dict__``, a module's
    included; ``expr`` is the object) or ``"globals"`` (a module's globals before the
    builtins; ``expr`` is its name as a guard reads it, ``G['__name__']`` or a constant)."""

    where: str
    expr: str
    name: str
    text: str
    holder: Any = dataclasses.field(repr=False, compare=False)   # the namespace's owner

    def guard(self) -> tuple[str, str, JSON]:
        """(guard kind, expression, value) of the portable guard (entry/guard_kinds.py)."""
        if self.where == "class":
            return ("contains", f"{self.expr}.__dict__",
                    {"key": values.encode_value(self.name), "present": False})
        if self.where == "instance":
            return "not_in_dict", self.expr, self.name
        return "expr", f"not ___module_has({self.expr}, {self.name!r})", None


@dataclasses.dataclass(frozen=True)
class Row:
    """One kind of lookup: which lookups it is, and the namespaces it consults, in
    CPython's order, that lacked the name."""

    kind: str
    doc: str
    applies: Callable[[Resolved], bool]
    consulted: Callable[[Resolved, str], list[Absent]]


# -- what a lookup consults ---------------------------------------------------------------
_NOTHING = object()


def _index(mro: Sequence[type], name: str) -> int | None:
    """The position of the first class in ``mro`` whose own dict holds ``name``."""
    for i, klass in enumerate(mro):
        if name in vars(klass):
            return i
    return None


def _data_descriptor(value: Any) -> bool:
    kind = type(value)
    return hasattr(kind, "__get__") and (hasattr(kind, "__set__") or hasattr(kind, "__delete__"))


def _pinned_class(klass: type) -> bool:
    """A class a user does not add a name to: a builtin (immutable) type, or one whose code
    the version factors pin (torch's, the standard library's)."""
    return bool(klass.__flags__ & _IMMUTABLETYPE) or _pinned_module(klass.__module__)


_IMMUTABLETYPE = 1 << 8   # Py_TPFLAGS_IMMUTABLETYPE


def _pinned_module(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    return pinned_by_version(name) or name.split(".")[0] in sys.stdlib_module_names


def _classes(owner: str, mro: Sequence[type], upto: int | None, name: str,
             why: str, start: int = 0) -> list[Absent]:
    """The classes of ``mro`` from ``start`` and before ``upto`` (to the end if None), each
    lacking ``name``."""
    out: list[Absent] = []
    for j, klass in enumerate(mro):
        if j < start or upto is not None and j >= upto or _pinned_class(klass):
            continue
        expr = f"{owner}.__mro__[{j}]"
        out.append(Absent("class", expr, name, f"{user_text(expr)} ({klass.__qualname__}) has "
                          f"no class attribute {name!r} ({why})", klass))
    return out


def _instance_dict(obj: Any) -> dict[str, Any] | None:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None     # __slots__ only
    return d if isinstance(d, dict) else None


def _kept_by_module(obj: Any, name: str) -> bool:
    """A name an nn.Module holds in a registry: its ``__setattr__`` never lets it into the
    instance dict (a parameter, buffer or submodule is replaced through the registry)."""
    if not isinstance(obj, torch.nn.Module) or type(obj).__setattr__ is not torch.nn.Module.__setattr__:
        return False
    d = _instance_dict(obj) or {}
    return any(name in d.get(reg, ()) for reg in ("_parameters", "_buffers", "_modules"))


def _what(lk: Resolved, base: str) -> str:
    """The lookup, in the user's terms, for a guard's text."""
    if lk.how == "default":
        return f"getattr({base}, {lk.name!r}, default)"
    if lk.how == "hasattr":
        return f"hasattr({base}, {lk.name!r})"
    return f"{base}.{lk.name}"


def _getattr_hook(owner: str, mro: Sequence[type], why: str) -> list[Absent]:
    """A lookup that found the name nowhere calls the class's ``__getattr__``: the classes
    before the one defining it (all, if none does) lack one."""
    return _classes(owner, mro, _index(mro, "__getattr__"), "__getattr__", why)


def _instance_attr(lk: Resolved, base: str) -> list[Absent]:
    """``object.__getattribute__``: a data descriptor on the type's MRO, else the instance
    dict, else the type's attribute; found nowhere, the type's ``__getattr__``."""
    obj, name = lk.obj, lk.name
    cls = type(obj)
    what = _what(lk, user_text(base))
    owner = f"type({base})"
    mro = cls.__mro__
    i = _index(mro, name)
    found = "" if i is None else f"found on {mro[i].__qualname__}"
    out = _classes(owner, mro, i, name, f"{what} is {found or 'looked up there first'}")
    if i is not None and _data_descriptor(vars(mro[i])[name]):
        return out
    d = _instance_dict(obj)
    if d is not None and name in d:
        return out
    if d is not None and not _kept_by_module(obj, name) and not isinstance(obj, torch.Tensor):
        out.append(Absent("instance", base, name, f"{user_text(base)} has no instance attribute "
                          f"{name!r} ({what} is {found or 'not in it'})", obj))
    if i is None:
        out += _getattr_hook(owner, mro, f"{what} would call it")
    return out


def _class_attr(lk: Resolved, base: str) -> list[Absent]:
    """``type.__getattribute__``: a data descriptor on the metaclass's MRO, else the class's
    MRO, else the metaclass's attribute; found nowhere, the metaclass's ``__getattr__``."""
    cls, name = lk.obj, lk.name
    meta = type(cls)
    what = _what(lk, user_text(base))
    meta_owner = f"type({base})"
    j = _index(meta.__mro__, name)
    at_meta = f"found on the metaclass {meta.__mro__[j].__qualname__}" if j is not None else ""
    out = _classes(meta_owner, meta.__mro__, j, name, f"{what} is looked up there first")
    if j is not None and _data_descriptor(vars(meta.__mro__[j])[name]):
        return out
    i = _index(cls.__mro__, name)
    found = f"found on {cls.__mro__[i].__qualname__}" if i is not None else at_meta
    out += _classes(base, cls.__mro__, i, name, f"{what} is {found or 'not found'}")
    if i is None and j is None:
        out += _getattr_hook(meta_owner, meta.__mro__, f"{what} would call it")
    return out


def _module_attr(lk: Resolved, base: str) -> list[Absent]:
    """A module's attribute: its class's data descriptors, its ``__dict__``, its class's
    attribute; found nowhere, the ``__getattr__`` in its ``__dict__`` (PEP 562), then its
    class's."""
    mod, name = lk.obj, lk.name
    cls = type(mod)
    what = _what(lk, user_text(base))
    owner = f"type({base})"
    i = _index(cls.__mro__, name)
    out = _classes(owner, cls.__mro__, i, name, f"{what} is looked up there first")
    if i is not None and _data_descriptor(vars(cls.__mro__[i])[name]):
        return out
    d = _instance_dict(mod)
    if d is None or name in d or _pinned_module(getattr(mod, "__name__", None)):
        return out
    out.append(Absent("instance", base, name, f"{user_text(base)} has no global {name!r} "
                      f"({what} is {'found on its class' if i is not None else 'not found'})",
                      mod))
    if i is None:
        if "__getattr__" not in d:
            out.append(Absent("instance", base, "__getattr__",
                              f"{user_text(base)} has no module __getattr__ ({what} would "
                              "call it)", mod))
            out += _getattr_hook(owner, cls.__mro__, f"{what} would call it")
    return out


def _global(lk: Resolved, base: str) -> list[Absent]:
    """``LOAD_GLOBAL``: the function's module globals, then the builtins. A name read from
    the builtins was consulted in the module first."""
    g, name = lk.obj, lk.name
    module_name = g.get("__name__") if isinstance(g, dict) else None
    if name in g or _pinned_module(module_name):
        return []
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if getattr(module, "__dict__", None) is not g:
        raise UnsupportedProgramError(
            f"the traced code reads the builtin {name!r} from a function whose globals are no "
            f"imported module's ({module_name!r}), so a global {name!r} defined there later "
            "could not be guarded against; define the function in a module")
    expr = "G['__name__']" if lk.root else repr(module_name)
    return [Absent("globals", expr, name, f"{module_name}.{name} is not defined (the "
                   f"{'method' if lk.root else 'function it inlines from ' + str(module_name)} "
                   f"calls the builtin {name})", g)]


def _super_attr(lk: Resolved, base: str) -> list[Absent]:
    """``super(T, obj).name``: the MRO of ``obj`` (of ``obj`` itself where it is a class)
    from the class after ``T``; the classes between ``T`` and the one it is found on."""
    obj, name, after = lk.obj, lk.name, lk.after
    is_class = isinstance(obj, type)
    mro = obj.__mro__ if is_class else type(obj).__mro__
    owner = base if is_class else f"type({base})"
    if after not in mro:
        return []
    start = mro.index(after) + 1
    i = _index(mro[start:], name)
    what = f"super().{name} in {user_text(base)}'s method"
    found = f"found on {mro[start + i].__qualname__}" if i is not None else "not found"
    return _classes(owner, mro, None if i is None else start + i, name, f"{what} is {found}",
                    start)


def _plain_getattribute(cls: type, expected: Any) -> bool:
    return getattr(cls, "__getattribute__", None) is expected


ROWS: tuple[Row, ...] = (
    Row("global", "a global name: the function's module globals, then the builtins",
        lambda lk: lk.how == "global", _global),
    Row("super() attribute", "the MRO of the object (or class) after the class super() "
        "names", lambda lk: lk.after is not None, _super_attr),
    Row("module attribute", "a module's class (data descriptors), its __dict__, its "
        "class, its __getattr__ (PEP 562)",
        lambda lk: isinstance(lk.obj, types.ModuleType)
        and _plain_getattribute(type(lk.obj), types.ModuleType.__getattribute__), _module_attr),
    Row("class attribute", "the metaclass's MRO (data descriptors), the class's MRO, the "
        "metaclass's MRO, the metaclass's __getattr__",
        lambda lk: isinstance(lk.obj, type)
        and _plain_getattribute(type(lk.obj), type.__getattribute__), _class_attr),
    Row("instance attribute", "the type's MRO (data descriptors), the instance __dict__, "
        "the type's MRO, the type's __getattr__",
        lambda lk: not isinstance(lk.obj, (type, types.ModuleType))
        and _plain_getattribute(type(lk.obj), object.__getattribute__), _instance_attr),
)


@dataclasses.dataclass(frozen=True)
class Found:
    """A plain value a lookup found that Dynamo took as an attribute it does not model and
    reads without a guard (an attribute of a metaclass): the entry guards the lookup's
    result (``type(L['self']).K == 2.0``), which also fails where a nearer namespace gains
    the name."""

    expr: str
    value: JSON
    text: str

    def guard(self) -> tuple[str, str, JSON]:
        return "eq", self.expr, self.value


def unguarded(lookups: Iterable[Resolved]) -> list[Found]:
    """The plain values Dynamo read without a guard (:attr:`Resolved.unguarded`), found
    where Python's static lookup finds them (no descriptor runs here)."""
    out: list[Found] = []
    seen: set[str] = set()
    for lk in lookups:
        if not lk.unguarded or lk.source is None or lk.how == "global":
            continue
        value = inspect.getattr_static(lk.obj, lk.name, _NOTHING)
        if not isinstance(value, _PLAIN):
            continue    # a descriptor, a function: Dynamo traces what it does with it
        expr = f"{lk.source}.{lk.name}"
        if expr in seen:
            continue
        seen.add(expr)
        out.append(Found(expr, values.encode_value(value), f"{user_text(expr)} == {value!r} "
                         "(Dynamo reads it without a guard)"))
    return out


_PLAIN = (bool, int, float, str, bytes, type(None))


def guards(lookups: Sequence[Resolved]) -> list[tuple[str, str, JSON, str]]:
    """Every guard the lookups call for: (kind, expression, value, text), the absent
    namespaces first."""
    return ([(*a.guard(), a.text) for a in absent(lookups)]
            + [(*f.guard(), f.text) for f in unguarded(lookups)])


def absent(lookups: Iterable[Resolved]) -> list[Absent]:
    """Every namespace the lookups consulted and found without the name, once each (a
    class's dict by the class, whichever path first reached it). A global lookup whose
    module cannot be named raises UnsupportedProgramError: its absence cannot be guarded."""
    out: list[Absent] = []
    seen: set[tuple[str, int, str]] = set()
    for lk in lookups:
        if lk.how != "global" and lk.source is None:
            continue    # an object made during the trace: no path from the frame
        row = next((r for r in ROWS if r.applies(lk)), None)
        if row is None:
            continue    # a custom __getattribute__: its own code decides, and Dynamo traces it
        for a in row.consulted(lk, lk.source or ""):
            key = (a.where, id(a.holder), a.name)
            if key not in seen:
                seen.add(key)
                out.append(a)
    return out
