"""``cache_compile``: the public entry point, a drop-in for TorchAir's.

Argument checking lives here; the behaviour lives in :mod:`cachecompile.cached`.
"""

from __future__ import annotations

import inspect
import logging
import os
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from cachecompile import backends
from cachecompile.cached import CachedFunction, cache_off
from cachecompile.entry.guards import GuardMode
from cachecompile.errors import ContractError, IgnoredArgumentWarning, user_stacklevel
from cachecompile.key import passes as passes_mod
from cachecompile.key.gears import Gears
from cachecompile.key.ranks import detect
from cachecompile.spec import CompileSpec

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


_warned_kwargs: set[str] = set()


def _ignore_unknown(kwargs: Mapping[str, Any]) -> None:
    """TorchAir's cache_compile accepts and ignores keywords it does not know; so do we,
    with one warning per name and process (a typo still shows up once)."""
    new = sorted(set(kwargs) - _warned_kwargs)
    if not new:
        return
    _warned_kwargs.update(new)
    warnings.warn(f"cache_compile() ignores unknown keyword arguments: {', '.join(new)}",
                  IgnoredArgumentWarning, stacklevel=user_stacklevel())


def _torchair_default_dir() -> str | None:
    """TorchAir's default cache dir, unless cachecompile's own variable names one."""
    if os.environ.get("CACHECOMPILE_DIR"):
        return None
    return os.path.abspath(os.environ.get("TORCHAIR_CACHE_HOME") or ".torchair_cache")


def cache_compile(func: Callable[..., Any], *, config: Any = None, backend: Any = None,
                  dynamic: bool = True, cache_dir: str | os.PathLike[str] | None = None,
                  global_rank: int | None = None, tp_rank: int | None = None,
                  pp_rank: int | None = None,
                  custom_decompositions: Mapping[Any, Callable[..., Any]] | None = None,
                  ge_cache: bool = False, max_signatures: int = 8,
                  guards: str | None = None, passes: Mapping[str, Any] | None = None,
                  gears: Mapping[str, Mapping[int, Sequence[int]]] | None = None,
                  gear_policy: str = "zip", pad: bool = False,
                  **kwargs: Any) -> CachedFunction:
    """Cache ``torch.compile`` of a module method across processes.

    ``func`` must be a bound method of an ``nn.Module`` (``self._forward``). The result is
    called like the method. The first call of each input signature loads a matching
    entry from the cache, or compiles (Dynamo fullgraph + the backend) and publishes one.
    See docs/usage.md for the key factors and every warning.

    Args:
        config: backend options (Inductor config options for ``"inductor"``, custom pass
            hooks included).
        backend: adapter name: ``"inductor"`` (default), ``"aot_eager"`` or ``"torchair"``.
        dynamic: compile with dynamic shapes (one entry serves all sizes) or static
            shapes (one entry per shape, at most ``max_signatures``).
        cache_dir: store root; default ``$CACHECOMPILE_DIR`` or ``~/.cache/cachecompile``
            (with the torchair backend: ``$CACHECOMPILE_DIR``, else TorchAir's
            ``$TORCHAIR_CACHE_HOME`` or ``./.torchair_cache``).
        global_rank, tp_rank, pp_rank: this process's ranks; default from
            torch.distributed or torchrun's environment.
        custom_decompositions: extra decompositions for AOTAutograd (part of the key).
        ge_cache: Ascend GE cache; accepted for TorchAir compatibility, needs the
            torchair adapter.
        max_signatures: static signatures cached per method before falling back to live
            torch.compile (``dynamic=False`` only; at least the number of gears).
        guards: when a loaded entry's guards run: ``"always"`` (default: every guard on
            every call, as torch.compile does) or ``"first"`` (TorchAir's behaviour:
            argument guards on every call, state guards only on each signature's first
            call in a process, so state changed later is not seen; cheaper per call).
            Default ``$CACHECOMPILE_GUARDS`` or ``"always"``.
        passes: Inductor custom passes, ``{hook: pass}`` with hooks
            ``post_grad_custom_post_pass`` & co. (docs/passes.md); the same as giving
            them in ``config``. Each pass is keyed by what it does; one that cannot be
            identified is refused (:class:`UnidentifiedPassError`).
        gears: the static shapes calls will have, ``{argument: {dim: [sizes]}}``
            (``dynamic=False``); one entry per gear (docs/usage.md, "Gears").
        gear_policy: how the sizes of several dims make gears: ``"zip"`` or ``"product"``.
        pad: pad a call that fits no gear up to the smallest gear that holds it, and slice
            the outputs back (you assert the method treats padded rows independently);
            default: such a call compiles live, with one warning.

    Unknown keyword arguments are ignored with one warning, as TorchAir ignores them.
    """
    if kwargs:
        _ignore_unknown(kwargs)
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
    if passes is not None and adapter.name != "inductor":
        raise ContractError(f"cache_compile(): passes= are Inductor's custom pass hooks; the "
                            f"{adapter.name!r} backend does not run them (with torchair, give "
                            "them in its CompilerConfig)")
    if adapter.name == "inductor":
        options = passes_mod.merge(options, passes)
        passes_mod.check(options)
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ContractError(f"cache_compile(): cache_dir must be a path, got {cache_dir!r}")
    if cache_dir is None and adapter.name == "torchair":
        cache_dir = _torchair_default_dir()
    ranks = detect(_int_or_none("global_rank", global_rank), _int_or_none("tp_rank", tp_rank),
                   _int_or_none("pp_rank", pp_rank))
    try:
        mode = GuardMode(guards) if guards is not None else GuardMode.from_env()
    except ValueError:
        raise ContractError(f"cache_compile(): guards must be 'first' or 'always', got "
                            f"{guards!r}") from None
    declared: Gears | None = None
    if gears is not None:
        if dynamic:
            raise ContractError("cache_compile(): gears declare static shapes; use them with "
                                "dynamic=False")
        declared = Gears(method, gears, gear_policy, pad)
        max_signatures = max(max_signatures, len(declared))
    elif pad:
        raise ContractError("cache_compile(): pad=True pads calls up to a gear; declare gears=")
    enabled = os.environ.get("CACHECOMPILE_DISABLE", "") not in ("1", "true", "yes")
    if enabled:
        # A torch the cache cannot run on: warn here, where the user asked for caching;
        # calls then run as plain torch.compile (CachedFunction checks again).
        cache_off()
    spec = CompileSpec(adapter=adapter, options=options, dynamic=dynamic, guards=mode,
                       cache_dir=os.fspath(cache_dir) if cache_dir is not None else None,
                       ranks=ranks, decompositions=custom_decompositions,
                       max_signatures=max_signatures, enabled=enabled, gears=declared)
    return CachedFunction(method, spec)
