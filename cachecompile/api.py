"""``cache_compile``: the public entry point, a drop-in for TorchAir's.

Argument checking lives here; the behaviour lives in :mod:`cachecompile.cached`.
"""

from __future__ import annotations

import inspect
import logging
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import backends
from .cached import CachedFunction, cache_off
from .errors import ContractError
from .ranks import detect

logger = logging.getLogger(__name__)

_PATTERN = (
    "Use it on a bound method of an nn.Module instance, inside __init__:\n"
    "    class Model(nn.Module):\n"
    "        def __init__(self):\n"
    "            super().__init__()\n"
    "            self.cached_forward = cache_compile(self._forward)\n"
    "        def forward(self, x):\n"
    "            return self.cached_forward(x)\n"
    "        def _forward(self, x):\n"
    "            ..."
)


def _check_method(func: Any) -> types.MethodType:
    if isinstance(func, CachedFunction):
        raise ContractError("cache_compile() got an already cached function; wrap the "
                            "original method once.\n" + _PATTERN)
    if not isinstance(func, types.MethodType):
        what = type(func).__qualname__
        if isinstance(func, torch.nn.Module):
            hint = f"got the module {what} itself; pass one of its methods (module.forward)"
        elif inspect.isfunction(func):
            hint = (f"got the plain function {func.__qualname__}; pass it bound to an "
                    "instance (self.method), not through the class")
        else:
            hint = f"got {what}"
        raise ContractError(f"cache_compile() needs a bound method of an nn.Module: {hint}.\n"
                            + _PATTERN)
    if not isinstance(func.__self__, torch.nn.Module):
        raise ContractError("cache_compile() needs a method of an nn.Module instance, got a "
                            f"method of {type(func.__self__).__qualname__}.\n" + _PATTERN)
    inner = func.__func__
    if not isinstance(inner, types.FunctionType):
        # functools.wraps-style decorators give a plain function (traced, wrapper and all);
        # other callables (a class instance, a C function) have no bytecode to replay.
        raise ContractError(
            f"cache_compile() got {func.__qualname__}, which is wrapped by "
            f"{type(inner).__qualname__}, not a Python function: Dynamo's bytecode cannot "
            "be replayed for it. Cache the undecorated method, or decorate it with a plain "
            "function wrapper (functools.wraps).\n" + _PATTERN)
    return func


def _int_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(f"cache_compile(): {name} must be an int or None, got {value!r}")
    return value


def cache_compile(func: Callable[..., Any], *, config: Any = None, backend: Any = None,
                  dynamic: bool = True, cache_dir: str | os.PathLike[str] | None = None,
                  global_rank: int | None = None, tp_rank: int | None = None,
                  pp_rank: int | None = None,
                  custom_decompositions: Mapping[Any, Callable[..., Any]] | None = None,
                  ge_cache: bool = False, max_signatures: int = 8,
                  guards: str | None = None, **kwargs: Any) -> CachedFunction:
    """Cache ``torch.compile`` of a module method across processes.

    ``func`` must be a bound method of an ``nn.Module`` (``self._forward``). The result is
    called like the method. The first call of each input signature loads a matching
    entry from the cache, or compiles (Dynamo fullgraph + the backend) and publishes one.
    See docs/usage.md for the key factors and every warning.

    Args:
        config: backend options (Inductor config options for ``"inductor"``).
        backend: adapter name: ``"inductor"`` (default) or ``"aot_eager"``.
        dynamic: compile with dynamic shapes (one entry serves all sizes) or static
            shapes (one entry per shape, at most ``max_signatures``).
        cache_dir: store root; default ``$CACHECOMPILE_DIR`` or ``~/.cache/cachecompile``.
        global_rank, tp_rank, pp_rank: this process's ranks; default from
            torch.distributed or torchrun's environment.
        custom_decompositions: extra decompositions for AOTAutograd (part of the key).
        ge_cache: Ascend GE cache; accepted for TorchAir compatibility, needs the
            torchair adapter.
        max_signatures: static signatures cached per method before falling back to live
            torch.compile (``dynamic=False`` only).
        guards: when a loaded entry's guards run: ``"first"`` (default; argument guards
            on every call, state guards on each signature's first call in a process) or
            ``"always"`` (every guard on every call, as torch.compile does). Default
            ``$CACHECOMPILE_GUARDS`` or ``"first"``.
    """
    if kwargs:
        raise ContractError(f"cache_compile() got unexpected keyword arguments "
                            f"{', '.join(sorted(kwargs))}")
    method = _check_method(func)
    if not isinstance(dynamic, bool):
        raise ContractError(f"cache_compile(): dynamic must be True or False, got {dynamic!r}")
    if isinstance(max_signatures, bool) or not isinstance(max_signatures, int) or max_signatures < 1:
        raise ContractError(f"cache_compile(): max_signatures must be a positive int, got "
                            f"{max_signatures!r}")
    if custom_decompositions is not None and not isinstance(custom_decompositions, Mapping):
        raise ContractError("cache_compile(): custom_decompositions must be a dict "
                            "{aten op: function}")
    try:
        adapter, options = backends.resolve(backend, config, ge_cache=ge_cache)
    except (TypeError, ValueError, KeyError) as e:
        raise ContractError(f"cache_compile(): {e}") from None
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ContractError(f"cache_compile(): cache_dir must be a path, got {cache_dir!r}")
    ranks = detect(_int_or_none("global_rank", global_rank), _int_or_none("tp_rank", tp_rank),
                   _int_or_none("pp_rank", pp_rank))
    if guards is not None and guards not in ("first", "always"):
        raise ContractError(f"cache_compile(): guards must be 'first' or 'always', got {guards!r}")
    enabled = os.environ.get("CACHECOMPILE_DISABLE", "") not in ("1", "true", "yes")
    if enabled:
        # A torch the cache cannot run on: warn here, where the user asked for caching;
        # calls then run as plain torch.compile (CachedFunction checks again).
        cache_off(stacklevel=2)
    return CachedFunction(method, adapter=adapter, options=options, dynamic=dynamic,
                          cache_dir=os.fspath(cache_dir) if cache_dir is not None else None,
                          ranks=ranks, decompositions=custom_decompositions,
                          max_signatures=max_signatures, enabled=enabled, guards=guards)
