"""Warm path: rebuild a cached method from an entry, without Dynamo.

Dynamo's transformed bytecode is turned back into a function over the method's closure
and a *private* globals mapping: the names Dynamo generated (``__compiled_fn_*``,
``__import_*``, the builtins dict) live there, and every other name falls through to the
module's live globals. Nothing is written into the module's globals, so a later
``torch.compile`` of the same module (a new signature compiled live in this process) never
meets our stand-ins where Dynamo expects its own objects. The function reads the module's
parameters and the call's inputs from the live frame on every call, exactly as in the
compiling process.

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


class ReplayGlobals(dict[str, Any]):
    """Dynamo's generated names over the module's live globals (read through, never written)."""

    __slots__ = ("module_globals",)

    def __init__(self, module_globals: dict[str, Any], names: Mapping[str, Any]) -> None:
        super().__init__(names)
        self.module_globals = module_globals
        # A function's builtins come from its globals' __builtins__, read without
        # __missing__: set it here.
        self["__builtins__"] = module_globals.get("__builtins__", builtins)

    def __missing__(self, key: str) -> Any:
        return self.module_globals[key]

    def for_code(self, code: types.CodeType) -> ReplayGlobals:
        """The globals a function of ``code`` runs in: these, with the torch module bound to
        the stand-in (:data:`dynamo_shim.torch_standin`) under each name the code reads it
        by: the module's ``torch`` global, or the name Dynamo gave it where the module has
        none (``import torch as th``: ``___module_torch_<id>_c0``). The guards keep reading
        these, where each is torch itself."""
        swap = [n for n in code.co_names if self._reads_torch(n)]
        if not swap:
            return self
        out = ReplayGlobals(self.module_globals, self)
        for n in swap:
            out[n] = dynamo_shim.torch_standin
        return out

    def _reads_torch(self, name: str) -> bool:
        if dict.__contains__(self, name):     # one of Dynamo's names, bound at load
            return is_dynamo_global(name) and dict.get(self, name) is torch
        return name == "torch" and self.module_globals.get(name) is torch


def resolve_module(name: str) -> Any:
    """The object an entry's Dynamo global stands for: a module (Dynamo's helper module
    by its light stand-in), the builtins dict, or a builtin function or class by its
    qualified name (``module:qualname``; :func:`named_builtin`)."""
    if name == BUILTINS_DICT:
        return vars(builtins)
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
    """The method over its stored bytecode and the private globals ``g``; its graph
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
    fn = types.FunctionType(code, g.for_code(code), func.__name__, func.__defaults__,
                            func.__closure__)
    fn.__kwdefaults__ = func.__kwdefaults__
    fn.__qualname__ = func.__qualname__
    return types.MethodType(fn, method.__self__)
