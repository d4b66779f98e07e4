"""Warm path: rebuild a cached method from an entry, without Dynamo.

Dynamo's transformed bytecode is turned back into a function over the method's closure
and the module's own globals, as ``torch.compile`` runs it: a global the method writes or
deletes (``global STEP; STEP += 1``) lands in the module, and every later read, in the
method, in a resume frame or in any function it calls, sees it. The names Dynamo generated
(``__compiled_fn_*``, ``__import_*``, ``__resume_at_*``) are not written into the module:
they are bound into the code itself as constants (:func:`bound_code`), so a later
``torch.compile`` of the same module (a new signature compiled live in this process) never
meets our stand-ins where Dynamo expects its own objects. :class:`ReplayGlobals` holds
those names for the guards, which read them with the module's live globals behind them.
The function reads the module's parameters and the call's inputs from the live frame on
every call, exactly as in the compiling process.

Only ``torch`` is imported here; Dynamo's helper module is served by a light stand-in
(:mod:`cachecompile._torch.dynamo_shim`).
"""

from __future__ import annotations

import builtins
import importlib
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cachecompile._torch import dynamo_shim
from cachecompile.entry import codeobj
from cachecompile.errors import UnsupportedProgramError

BUILTINS_DICT = "builtins.__dict__"
# The globals of a namedtuple's generated __new__ (collections.namedtuple's namespace, the
# same on every Python we support): Dynamo installs it when it inlines that __new__.
NAMEDTUPLE_SCOPE = "namedtuple-scope:"
_TYPENAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ReplayGlobals(dict[str, Any]):
    """Dynamo's generated names over the module's live globals (read through, never
    written): the namespace an entry's guards are checked in, and the names
    :func:`bound_code` binds into its bytecode."""

    __slots__ = ("module_globals",)

    def __init__(self, module_globals: dict[str, Any], names: Mapping[str, Any]) -> None:
        super().__init__(names)
        self.module_globals = module_globals
        # A function's builtins come from its globals' __builtins__, read without
        # __missing__: set it here.
        self["__builtins__"] = module_globals.get("__builtins__", builtins)

    def __missing__(self, key: str) -> Any:
        return self.module_globals[key]

    def reads_torch(self, name: str) -> bool:
        if dict.__contains__(self, name):     # one of Dynamo's names, bound at load
            return is_dynamo_global(name) and dict.get(self, name) is torch
        return name == "torch" and self.module_globals.get(name) is torch


def _all_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _all_names(c)
    return names


def bound_code(code: types.CodeType, g: ReplayGlobals) -> types.CodeType:
    """``code`` ready to run in its module's own globals: each of Dynamo's generated names
    of ``g`` loaded as the object it stands for, and the torch module read as the stand-in
    (:data:`dynamo_shim.torch_standin`) under each name the code reads it by: the module's
    ``torch`` global, or the name Dynamo gave it where the module has none (``import torch
    as th``: ``___module_torch_<id>_c0``). The guards keep reading ``g``, where each is
    torch itself. UnsupportedProgramError where a name cannot be bound
    (:func:`codeobj.bind_names`): the entry does not serve, never a program whose writes go
    astray."""
    values = {n: v for n, v in dict.items(g) if n != "__builtins__"}
    for n in _all_names(code):
        if g.reads_torch(n):
            values[n] = dynamo_shim.torch_standin
    return codeobj.bind_names(code, values)


def resolve_module(name: str) -> Any:
    """The object an entry's Dynamo global stands for: a module (Dynamo's helper module
    by its light stand-in), the builtins dict, or a builtin function or class by its
    qualified name (``module:qualname``; :func:`named_builtin`)."""
    if name == BUILTINS_DICT:
        return vars(builtins)
    if name.startswith(NAMEDTUPLE_SCOPE):
        typename = name[len(NAMEDTUPLE_SCOPE):]
        if not _TYPENAME.fullmatch(typename):
            raise UnsupportedProgramError(f"unexpected global {name!r} in entry")
        return {"_tuple_new": tuple.__new__, "__builtins__": {},
                "__name__": f"namedtuple_{typename}"}
    if ":" in name:
        module, _, qualname = name.partition(":")
        if not _DOTTED.fullmatch(module) or not _DOTTED.fullmatch(qualname):
            raise UnsupportedProgramError(f"unexpected global {name!r} in entry")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    standin = dynamo_shim.standin(name)
    if standin is not None:
        return standin
    return importlib.import_module(name)


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def namedtuple_scope(value: Any) -> str | None:
    """The portable name of a namedtuple ``__new__``'s globals (which Dynamo installs as
    ``___unnamed_scope_<id>``), else None: a dict equal to the namespace
    ``collections.namedtuple`` makes, so a warm process makes an equal one."""
    if type(value) is not dict or set(value) != {"_tuple_new", "__builtins__", "__name__"}:
        return None
    name = value["__name__"]
    if (value["_tuple_new"] is not tuple.__new__ or value["__builtins__"] != {}
            or not isinstance(name, str) or not name.startswith("namedtuple_")
            or not _TYPENAME.fullmatch(name[len("namedtuple_"):])):
        return None
    return NAMEDTUPLE_SCOPE + name[len("namedtuple_"):]


def named_builtin(value: Any) -> str | None:
    """``module:qualname`` for a builtin function or a class that its module names (so a
    warm process finds the very object by name), else None. Dynamo installs such objects
    under generated names (``___module_iter_<id>_c29``) when its bytecode rebuilds them."""
    if not isinstance(value, (types.BuiltinFunctionType, type)):
        return None
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if not _DOTTED.fullmatch(module) or not _DOTTED.fullmatch(qualname):
        return None
    try:
        found = resolve_module(f"{module}:{qualname}")
    except Exception:  # not reachable by its name: no portable form
        return None
    return f"{module}:{qualname}" if found is value else None


# Dynamo's global by object id, with no prefix (install_global_by_id("", module)): a
# module it reached through a closure or another module's attribute.
_BY_ID = re.compile(r"_\d+_c\d+")


def is_dynamo_global(name: str) -> bool:
    """A global Dynamo installs in the method's module for the transformed bytecode or its
    guards (``__import_torch``, ``___module_torch_<id>_c1``, ``__builtins_dict___0``,
    ``_<id>_c1``), which a warm process binds again by what it stood for."""
    if name.startswith("__"):
        return not name.endswith("__")
    return _BY_ID.fullmatch(name) is not None


def replay_globals(func: types.FunctionType, imports: Mapping[str, str],
                   extra: Mapping[str, Any] | None = None) -> ReplayGlobals:
    names: dict[str, Any] = {}
    for gname, modname in imports.items():
        if not is_dynamo_global(gname):
            raise UnsupportedProgramError(f"unexpected global {gname!r} in entry")
        names[gname] = resolve_module(modname)
    names.update(extra or {})
    return ReplayGlobals(func.__globals__, names)


def rebuild(method: types.MethodType, bytecode: bytes, consts: list[Any],
            g: ReplayGlobals, compiled_fn_name: str,
            compiled_fn: Callable[..., Any] | None) -> types.MethodType:
    """The method over its stored bytecode, its generated names bound from ``g``; its graph
    (``compiled_fn``) under ``compiled_fn_name``, unless the method's graph breaks before
    any graph (no name, no program: its frames hold them)."""
    func = method.__func__
    try:
        code = codeobj.loads(bytecode, consts)
    except (EOFError, ValueError, TypeError) as e:
        raise UnsupportedProgramError(f"stored bytecode does not load: {e}") from e
    if not isinstance(code, types.CodeType):
        raise UnsupportedProgramError("stored bytecode is not a code object")
    if code.co_freevars != func.__code__.co_freevars:
        raise UnsupportedProgramError("stored bytecode does not fit the method's closure")
    if compiled_fn_name or compiled_fn is not None:
        if not compiled_fn_name.startswith("__compiled_fn") or compiled_fn is None:
            raise UnsupportedProgramError(
                f"unexpected compiled function name {compiled_fn_name!r}")
        g[compiled_fn_name] = compiled_fn
    fn = types.FunctionType(bound_code(code, g), g.module_globals, func.__name__,
                            func.__defaults__, func.__closure__)
    fn.__kwdefaults__ = func.__kwdefaults__
    fn.__qualname__ = func.__qualname__
    return types.MethodType(fn, method.__self__)
