"""Stand-ins for ``torch._dynamo.utils`` and ``torch`` inside replayed Dynamo bytecode.

Dynamo's transformed bytecode calls a few helpers from ``torch._dynamo.utils`` (sizes,
strides, profiler markers). Importing that module imports all of Dynamo (~1.5 s), so a
warm process gets these copies instead; any other attribute falls back to the real
module, which is slower but correct. ``torch`` itself is torch's but for the helper that
turns a traced float into the tensor the graph takes (made once per float, not per call).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any

import torch

from . import runtime

# (module, attribute path) for every private name below: checked by cachecompile._torch.probe.
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch", "_C._profiler._RecordFunctionFast"),
    ("torch.autograd.profiler", "_is_profiler_enabled"),
)

DYNAMO_UTILS = "torch._dynamo.utils"


def call_size(x: Any, i: int) -> int:
    return x.size(i)


def call_stride(x: Any, i: int) -> int:
    return x.stride(i)


def call_storage_offset(x: Any) -> int:
    return x.storage_offset()


def record_pregraph_bytecode_enter() -> contextlib.AbstractContextManager[None] | None:
    """The profiler's marker while one runs; else None, entered and left by nothing
    (torch's helper enters and exits a new nullcontext: two Python calls more on every
    replayed call)."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    cm: contextlib.AbstractContextManager[None] = torch._C._profiler._RecordFunctionFast(
        "Pregraph bytecode")
    cm.__enter__()
    return cm


def record_pregraph_bytecode_exit(cm: contextlib.AbstractContextManager[None] | None) -> None:
    if cm is not None:
        cm.__exit__(None, None, None)


class _LazyShim(types.ModuleType):
    """A module of our own copies; any other name is the real module's (imported then)."""

    def __getattr__(self, name: str) -> Any:
        # Kept once looked up: replayed bytecode reads it on every call.
        value = getattr(importlib.import_module(self.__name__), name)
        setattr(self, name, value)
        return value


utils = _LazyShim(DYNAMO_UTILS)
for _name in ("call_size", "call_stride", "call_storage_offset",
              "record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit"):
    setattr(utils, _name, globals()[_name])


class _TorchStandin(types.ModuleType):
    """``torch`` as replayed bytecode reads it: :func:`runtime.as_tensor_fullprec` (one
    tensor per float, not one per call) for ``_as_tensor_fullprec``; any other name is
    torch's, read on each use."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


torch_standin = _TorchStandin("torch")
torch_standin._as_tensor_fullprec = runtime.as_tensor_fullprec  # type: ignore[attr-defined]

DYNAMO_FUNCTIONS = "torch._dynamo.variables.functions"


def _create_nested_fn(code: types.CodeType, f_globals: dict[str, Any], name: str,
                      defaults: tuple[Any, ...] | None, closure: tuple[Any, ...] | None,
                      kwdefaults: dict[str, Any] | None, annotations: Any) -> types.FunctionType:
    """A nested function rebuilt after a graph break, as Dynamo's helper of this name makes
    it (annotations may come as a flat tuple of name, value pairs)."""
    func = types.FunctionType(code, f_globals, name, defaults, closure)
    func.__kwdefaults__ = kwdefaults
    if isinstance(annotations, tuple):
        annotations = dict(zip(annotations[::2], annotations[1::2], strict=True))
    func.__annotations__ = annotations
    return func


functions = _LazyShim(DYNAMO_FUNCTIONS)
functions._create_nested_fn = _create_nested_fn  # type: ignore[attr-defined]


POLYFILL_BUILTINS = "torch._dynamo.polyfills.builtins"


class _PolyfillBuiltinsShim(types.ModuleType):
    """``torch._dynamo.polyfills.builtins`` until something needs more than its sentinel.

    torch 2.11 and 2.12 inline their ``iter()`` polyfill (``iter_(fn_or_iterable,
    sentinel=_sentinel_missing)``) where a method iterates a module list, and guard the
    default's type: ``type(<the module>._sentinel_missing) is object``. Importing the module
    for that guard imports all of Dynamo. Until the real module is imported, the sentinel
    is a plain ``object()`` of our own (its type is all the guard reads); once it is (a
    replayed bytecode or a live compile needed a polyfill), every name, the sentinel
    included, is the real module's, so a polyfill never meets a sentinel it does not know."""

    _own_sentinel = object()

    def __getattr__(self, name: str) -> Any:
        real = sys.modules.get(POLYFILL_BUILTINS)
        if name == "_sentinel_missing" and real is None:
            return self._own_sentinel
        return getattr(real if real is not None else importlib.import_module(POLYFILL_BUILTINS),
                       name)


_STANDINS: dict[str, types.ModuleType] = {
    DYNAMO_UTILS: utils, DYNAMO_FUNCTIONS: functions,
    POLYFILL_BUILTINS: _PolyfillBuiltinsShim(POLYFILL_BUILTINS)}


def standin(module_name: str) -> types.ModuleType | None:
    """The light module replayed bytecode gets for ``module_name``, if there is one."""
    return _STANDINS.get(module_name)
