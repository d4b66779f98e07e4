"""Warm path: rebuild a cached method from an entry, without Dynamo.

Dynamo's transformed bytecode is turned back into a function over the method's own module
globals and closure, with the names it expects (``__compiled_fn_*``, ``__import_*``)
bound to the adapter's rebuilt program and to the modules it imports. It then reads the
module's parameters and the call's inputs from the live frame on every call, exactly as
in the compiling process.

Only ``torch`` is imported here; ``torch._dynamo.utils`` is served by a shim.
"""

from __future__ import annotations

import importlib
import marshal
import types
from collections.abc import Callable, Mapping
from typing import Any

from . import _dynamo_shim
from .errors import UnsupportedProgramError


def _resolve_module(name: str) -> types.ModuleType:
    if name == "torch._dynamo.utils":
        return _dynamo_shim.utils
    return importlib.import_module(name)


def rebuild(method: types.MethodType, bytecode: bytes, imports: Mapping[str, str],
            compiled_fn_name: str, compiled_fn: Callable[..., Any]) -> types.MethodType:
    func = method.__func__
    try:
        code = marshal.loads(bytecode)
    except (EOFError, ValueError, TypeError) as e:
        raise UnsupportedProgramError(f"stored bytecode does not load: {e}") from e
    if not isinstance(code, types.CodeType):
        raise UnsupportedProgramError("stored bytecode is not a code object")
    if code.co_freevars != func.__code__.co_freevars:  # type: ignore[attr-defined]
        raise UnsupportedProgramError("stored bytecode does not fit the method's closure")
    g = func.__globals__  # type: ignore[attr-defined]
    for gname, modname in imports.items():
        if not gname.startswith("__") or gname.endswith("__"):
            raise UnsupportedProgramError(f"unexpected global {gname!r} in entry")
        g.setdefault(gname, _resolve_module(modname))
    if not compiled_fn_name.startswith("__compiled_fn"):
        raise UnsupportedProgramError(f"unexpected compiled function name {compiled_fn_name!r}")
    # Dynamo names are unique per compile (a uuid); binding ours into the module's
    # globals is what Dynamo itself does in the compiling process.
    g[compiled_fn_name] = compiled_fn
    fn = types.FunctionType(code, g, func.__name__, func.__defaults__,  # type: ignore[attr-defined]
                            func.__closure__)  # type: ignore[attr-defined]
    fn.__kwdefaults__ = func.__kwdefaults__  # type: ignore[attr-defined]
    fn.__qualname__ = func.__qualname__
    return types.MethodType(fn, method.__self__)
