"""``cache_compile``: the public entry point, a drop-in for TorchAir's.

Argument checking lives here; the behaviour lives in :mod:`cachecompile.cached`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import os
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypedDict, TypeVar, cast, overload

import torch

from cachecompile import backends, forms
from cachecompile._torch import runtime
from cachecompile.backends.base import capability
from cachecompile.cached import CachedFunction, SharedEntries, cache_off
from cachecompile.entry.guards import GuardMode
from cachecompile.errors import ContractError, IgnoredArgumentWarning, user_stacklevel
from cachecompile.key import cpu
from cachecompile.key.factors import callable_digest, device_factors, function_factors
from cachecompile.key.gears import Gears
from cachecompile.key.ranks import detect
from cachecompile.spec import CompileSpec
from cachecompile.store import settings
from cachecompile.store.settings import warn_unknown_names
from cachecompile.warm import collector

if TYPE_CHECKING:
    from typing_extensions import Unpack

logger = logging.getLogger(__name__)

_PATTERN = (
    "Use it on a module (cache_compile(model)), as a decorator on a module's method or "
    "class, on a plain function, or on a bound method of an nn.Module instance:\n"
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
        raise ContractError(f"cache_compile() needs a bound method of an nn.Module: got "
                            f"{type(func).__qualname__}.\n" + _PATTERN)
    if not isinstance(func.__self__, torch.nn.Module):
        raise ContractError("cache_compile() needs a method of an nn.Module instance, got a "
                            f"method of {type(func.__self__).__qualname__}: make the class an "
                            "nn.Module, or cache a plain function.\n" + _PATTERN)
    inner = func.__func__
    if isinstance(inner, types.FunctionType):
        forms.refuse_generators(inner, func.__qualname__)
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
    with one warning per name and process (a typo still shows up once, with the name it
    is closest to)."""
    new = sorted(set(kwargs) - _warned_kwargs)
    if not new:
        return
    _warned_kwargs.update(new)
    named = []
    for name in new:
        near = difflib.get_close_matches(name, _KEYWORDS, n=1, cutoff=0.75)
        named.append(f"{name} (did you mean {near[0]}?)" if near else name)
    warnings.warn(f"cache_compile() ignores unknown keyword arguments: {', '.join(named)}",
                  IgnoredArgumentWarning, stacklevel=user_stacklevel())


# torch.compile(mode=...) as Inductor options: torch._inductor.list_mode_options of
# torch 2.11-2.15, less CUDA graphs (their capture is not cached yet: see _mode_options).
_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
}


def _mode_options(mode: Any, backend: Any) -> dict[str, Any]:
    if mode is None or mode == "default":
        return {}  # torch.compile's default: no options, for any backend
    if mode == "reduce-overhead":
        raise ContractError(
            "cache_compile(): mode='reduce-overhead' means CUDA graphs, whose capture is not "
            "cached yet (a warm process would have to capture them again, and the program "
            "is refused as not replayable). Use mode='max-autotune-no-cudagraphs' or the "
            "default, or torch.compile(mode='reduce-overhead') for this method")
    if mode not in _MODES:
        raise ContractError(f"cache_compile(): mode must be one of {', '.join(_MODES)} or "
                            f"'reduce-overhead' (refused), got {mode!r}")
    if backend not in (None, "inductor"):
        raise ContractError(f"cache_compile(): mode={mode!r} selects Inductor options, as "
                            f"torch.compile's does; backend {backend!r} has none. Drop mode=, "
                            "or give the backend's own options in config=")
    if mode == "max-autotune" and torch.cuda.is_available():
        _warn_once("max-autotune", "cache_compile(): mode='max-autotune' runs without CUDA "
                   "graphs, as 'max-autotune-no-cudagraphs' (graph capture is not cached "
                   "yet); the kernels and autotuning choices are the same")
    return dict(_MODES[mode])


def _torch_compile_args(config: Any, backend: Any, mode: Any, options: Any) -> Any:
    """torch.compile's own arguments, as ``config``: ``mode=`` and ``options=`` merged in
    (what ``config`` says explicitly wins over the mode)."""
    if mode is None and options is None:
        return config
    merged = _mode_options(mode, backend)
    for name, extra in (("config", config), ("options", options)):
        if extra is None:
            continue
        if not isinstance(extra, Mapping):
            raise ContractError(f"cache_compile(): with mode= or options=, {name} must be a "
                                f"dict of Inductor options, got {type(extra).__qualname__}")
        merged.update(extra)
    if config is not None and options is not None:
        both = {k for k in options if k in config and config[k] != options[k]}
        if both:
            raise ContractError(f"cache_compile(): config and options disagree on "
                                f"{', '.join(sorted(both))}; give each option once")
    return merged


_warned_once: set[str] = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned_once:
        _warned_once.add(what)
        warnings.warn(message, IgnoredArgumentWarning, stacklevel=user_stacklevel())


@dataclasses.dataclass(frozen=True)
class _ByForm:
    """A default by form: TorchAir's for its own form, a bound method; torch.compile's
    where ``cache_compile`` stands where ``torch.compile`` stood (docs/usage.md, "Forms")."""

    torchair: Any
    torch_compile: Any


_BY_FORM: Any = _ByForm(True, None)             # dynamic: TorchAir's True, else automatic
_FULLGRAPH_BY_FORM: Any = _ByForm(True, False)  # fullgraph: one graph, else may break


class Options(TypedDict, total=False):
    """``cache_compile``'s keyword arguments, for type checkers (the overloads below)."""

    config: Any
    backend: Any
    dynamic: bool | None
    cache_dir: str | os.PathLike[str] | None
    global_rank: int | None
    tp_rank: int | None
    pp_rank: int | None
    custom_decompositions: Mapping[Any, Callable[..., Any]] | None
    ge_cache: bool
    max_signatures: int
    guards: str | None
    passes: Mapping[str, Any] | None
    gears: Mapping[str, Mapping[int, Sequence[int]]] | None
    gear_policy: str
    pad: bool
    mode: str | None
    options: Mapping[str, Any] | None
    fullgraph: bool
    disable: bool


_M = TypeVar("_M", bound=torch.nn.Module)
_T = TypeVar("_T")
_P = ParamSpec("_P")
_R = TypeVar("_R")


class Decorator(Protocol):
    """What ``cache_compile(**options)`` returns: a decorator that gives back what it
    decorates, as its type (a method stays that method, a class that class)."""

    def __call__(self, target: _T, /) -> _T: ...


# The forms as a type checker sees them: a module class stays the class, a module is a
# CachedModule, any other callable (a bound method, a plain function) a CachedFunction
# with the callable's own parameters and return type.
@overload
def cache_compile(func: None = None, /, **options: Unpack[Options]) -> Decorator: ...
@overload
def cache_compile(func: type[_M], /,  # type: ignore[overload-overlap]
                  **options: Unpack[Options]) -> type[_M]: ...
@overload
def cache_compile(func: torch.nn.Module, /,  # type: ignore[overload-overlap]
                  **options: Unpack[Options]) -> forms.CachedModule: ...
@overload
def cache_compile(func: Callable[_P, _R], /,
                  **options: Unpack[Options]) -> CachedFunction[_P, _R]: ...
def cache_compile(func: Any = None, /, *, config: Any = None, backend: Any = None,
                  dynamic: Any = _BY_FORM, cache_dir: str | os.PathLike[str] | None = None,
                  global_rank: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None,
                  custom_decompositions: Mapping[Any, Callable[..., Any]] | None = None,
                  ge_cache: bool = False, max_signatures: int = 8,
                  guards: str | None = None, passes: Mapping[str, Any] | None = None,
                  gears: Mapping[str, Mapping[int, Sequence[int]]] | None = None,
                  gear_policy: str = "zip", pad: bool = False,
                  mode: str | None = None, options: Mapping[str, Any] | None = None,
                  fullgraph: Any = _FULLGRAPH_BY_FORM, disable: bool = False, **kwargs: Any) -> Any:
    """Cache ``torch.compile`` across processes, wherever ``torch.compile`` would go.

    ``func`` is any of (docs/usage.md, "Forms"):

    * a bound method of an ``nn.Module`` (``self._forward``): returns a
      :class:`~cachecompile.cached.CachedFunction`, called like the method;
    * an ``nn.Module``: returns a :class:`~cachecompile.forms.CachedModule`, the module
      with its ``forward`` cached (as ``torch.compile(module)``);
    * a method in a class body (``@cache_compile`` or ``@cache_compile(dynamic=False)``
      above ``def forward(self, ...)``), or an ``nn.Module`` class (as a class decorator):
      cached per instance, on first access;
    * a plain function (module level, defined once): returns a ``CachedFunction``;
    * nothing: ``cache_compile(**options)`` is a decorator applying those options.

    The first call of each input signature loads a matching entry from the cache, or
    compiles (Dynamo + the backend) and publishes one. See docs/usage.md for
    the key factors and every warning.

    Args:
        config: backend options (Inductor config options for ``"inductor"``, custom pass
            hooks included).
        backend: adapter name: ``"inductor"`` (default), ``"aot_eager"`` or ``"torchair"``.
        dynamic: compile with dynamic shapes (one entry serves all sizes) or static
            shapes (one entry per shape, at most ``max_signatures``); ``None`` is
            torch.compile's automatic dynamic: static first, then, once a call differs
            from the first of its form in sizes, those dims dynamic (in an int's value:
            the whole method dynamic) from then on.
            Default: ``True`` for a bound method (TorchAir's form and default), ``None``
            (torch.compile's default) for every form that stands where torch.compile
            stood: a module, a decorated method or class, a plain function.
        cache_dir: store root; default ``$CACHECOMPILE_DIR`` or ``~/.cache/cachecompile``
            (with the torchair backend: ``$CACHECOMPILE_DIR``, else TorchAir's
            ``$TORCHAIR_CACHE_HOME`` or ``./.torchair_cache``).
        global_rank, tp_rank, pp_rank: this process's ranks; default from
            torch.distributed or torchrun's environment.
        custom_decompositions: extra decompositions for AOTAutograd (part of the key).
        ge_cache: Ascend GE cache; accepted for TorchAir compatibility, needs the
            torchair adapter.
        max_signatures: static signatures cached per method, besides its gears, before
            falling back to live torch.compile (``dynamic=False`` only).
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
            default: such a call is compiled for its own shape and cached, with one warning.
        mode: torch.compile's: ``"default"``, ``"max-autotune"`` or
            ``"max-autotune-no-cudagraphs"`` become Inductor options (both max-autotune
            modes without CUDA graphs); ``"reduce-overhead"`` is refused.
        options: torch.compile's: Inductor options, merged into ``config``.
        fullgraph: torch.compile's: ``True`` (a graph break raises
            :class:`GraphBreakError` naming where) or ``False`` (the graph may break: every
            frame Dynamo compiles for a call is stored, each with its guards; the code
            between graphs runs as under torch.compile; docs/usage.md, "Graph breaks").
            Default: ``True`` for a bound method (TorchAir's), else ``False`` (torch.compile's).
        disable: torch.compile's: ``True`` returns ``func`` itself, uncompiled and uncached
            (``disable=not args.compile``); with no ``func``, a decorator that does so.

    Unknown keyword arguments are ignored with one warning, as TorchAir ignores them.
    """
    warn_unknown_names()
    if kwargs:
        _ignore_unknown(kwargs)
    if not isinstance(disable, bool):
        raise ContractError(f"cache_compile(): disable must be True or False, got {disable!r}")
    if disable:
        # torch.compile(disable=True) returns what it was given, as it was given.
        return (lambda target: target) if func is None else func
    settings = _Settings(
        config=_torch_compile_args(config, backend, mode, options),
        backend=backend, dynamic=dynamic, cache_dir=cache_dir, global_rank=global_rank,
        tp_rank=tp_rank, pp_rank=pp_rank, custom_decompositions=custom_decompositions,
        ge_cache=ge_cache, max_signatures=max_signatures, guards=guards, passes=passes,
        gears=gears, gear_policy=gear_policy, pad=pad, fullgraph=fullgraph)
    # With the collector paused: resolving the backend imports it (warm.collector).
    with collector.paused():
        if func is None:
            _checked(settings)  # a bad option fails where the decorator is written

            def decorate(target: Any) -> Any:
                with collector.paused():
                    return _form(target, settings)

            return decorate
        return _form(func, settings)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """``cache_compile``'s arguments, as given (checked by :func:`_checked`)."""

    config: Any
    backend: Any
    dynamic: Any
    cache_dir: Any
    global_rank: Any
    tp_rank: Any
    pp_rank: Any
    custom_decompositions: Any
    ge_cache: Any
    max_signatures: Any
    guards: Any
    passes: Any
    gears: Any
    gear_policy: Any
    pad: Any
    fullgraph: Any = _FULLGRAPH_BY_FORM


def _by_form(s: _Settings, torchair: bool) -> _Settings:
    """``dynamic`` and ``fullgraph`` left to their defaults: TorchAir's for its form (a
    bound method, ``torchair``), torch.compile's for the rest (:class:`_ByForm`)."""
    chosen = {n: (v.torchair if torchair else v.torch_compile) for n in ("dynamic", "fullgraph")
              if isinstance(v := getattr(s, n), _ByForm)}
    return dataclasses.replace(s, **chosen)


def _form(func: Any, s: _Settings) -> Any:
    """Every form, down to a bound method of a module (forms.py)."""
    s = _by_form(s, torchair=isinstance(func, types.MethodType))
    if isinstance(func, (CachedFunction, forms.CachedModule, forms.CachedMethod)):
        raise ContractError(f"cache_compile() got a {type(func).__name__}, which is already "
                            "cached: cache the original once.\n" + _PATTERN)
    if forms.is_optimized_module(func):
        raise ContractError(
            "cache_compile() got what torch.compile returned (an OptimizedModule); pass the "
            "original module instead: cache_compile(model), not "
            "cache_compile(torch.compile(model)) (the original is its ._orig_mod)")
    original = runtime.compiled_by_dynamo(func)
    if original is not None:
        name = getattr(original, "__qualname__", "")
        raise ContractError(
            f"cache_compile() got what torch.compile returned"
            f"{f' for {name}' if name and '<' not in name else ''}: cache_compile compiles "
            "it itself. Pass what you gave torch.compile instead: cache_compile(model.forward) "
            "or cache_compile(model), not cache_compile(torch.compile(model).forward)")
    if isinstance(func, type):
        if issubclass(func, torch.nn.Module):
            _checked(s)
            return forms.decorate_class(func, lambda m: _cache_method(_check_method(m), s))
        raise ContractError(f"cache_compile() got the class {func.__qualname__}, which is not "
                            "an nn.Module subclass; as a class decorator it caches a module's "
                            "forward")
    if isinstance(func, torch.nn.Module):
        if isinstance(func.forward, CachedFunction) or isinstance(
                getattr(type(func), "forward", None), forms.CachedMethod):
            raise ContractError(f"cache_compile({type(func).__qualname__}): its forward is "
                                "cached already (@cache_compile on the class or method); "
                                "call the module as it is")

        def make(method: types.MethodType, forward: Any = None) -> CachedFunction:
            return _cache_method(_check_method(method), s, forward=forward)

        return forms.CachedModule(func, make)
    if isinstance(func, types.MethodType):
        return _cache_method(_check_method(func), s)
    if isinstance(func, types.FunctionType) and forms.in_class_body(func):
        if forms.taken_from_class(func):
            raise ContractError(
                f"cache_compile() got {func.__qualname__} through its class: pass it bound to "
                "an instance (cache_compile(model.forward)), the module itself, or decorate "
                "the method in the class body.\n" + _PATTERN)
        forms.refuse_generators(func, func.__qualname__)
        _checked(s)
        return forms.CachedMethod(func, lambda m: _cache_method(_check_method(m), s))
    fn = forms.check_function(func, _PATTERN)
    return _cache_method(forms.function_method(fn), s, function=fn)


def _check_values(s: _Settings) -> None:
    """The plain values' types and ranges (dynamic, fullgraph, max_signatures,
    custom_decompositions): each a ContractError naming the argument."""
    if s.dynamic is not None and not isinstance(s.dynamic, (bool, _ByForm)):
        raise ContractError(f"cache_compile(): dynamic must be True, False or None "
                            f"(automatic, as torch.compile's default), got {s.dynamic!r}")
    if not isinstance(s.fullgraph, (bool, _ByForm)):
        raise ContractError(f"cache_compile(): fullgraph must be True or False, got "
                            f"{s.fullgraph!r}")
    max_signatures = s.max_signatures
    if isinstance(max_signatures, bool) or not isinstance(max_signatures, int) or max_signatures < 1:
        raise ContractError(f"cache_compile(): max_signatures must be a positive int, got "
                            f"{max_signatures!r}")
    if s.custom_decompositions is not None and not isinstance(s.custom_decompositions, Mapping):
        raise ContractError("cache_compile(): custom_decompositions must be a dict "
                            "{aten op: function}")


def _checked(s: _Settings) -> tuple[Any, dict[str, Any], GuardMode, str | None]:
    """The checks that need no method: adapter and options, guard mode, cache dir."""
    _check_values(s)
    try:
        adapter, options = backends.resolve(s.backend, s.config, ge_cache=s.ge_cache)
    except (TypeError, ValueError, KeyError) as e:
        raise ContractError(f"cache_compile(): {e}") from None
    try:
        options = dict(capability(adapter, "with_passes")(options, s.passes))
    except ContractError:
        raise   # worded for the user already (key.passes)
    except (TypeError, ValueError) as e:
        raise ContractError(f"cache_compile(): {e}") from None
    cache_dir = s.cache_dir
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ContractError(f"cache_compile(): cache_dir must be a path, got {cache_dir!r}")
    if cache_dir is None:
        cache_dir = capability(adapter, "default_cache_dir")()
    try:
        mode = GuardMode(s.guards) if s.guards is not None else GuardMode.from_env()
    except ValueError:
        raise ContractError(f"cache_compile(): guards must be 'first' or 'always', got "
                            f"{s.guards!r}") from None
    if s.gears is not None and s.dynamic is not False:
        raise ContractError("cache_compile(): gears declare static shapes; use them with "
                            "dynamic=False")
    if s.gears is None and s.pad:
        raise ContractError("cache_compile(): pad=True pads calls up to a gear; declare gears=")
    return adapter, options, mode, os.fspath(cache_dir) if cache_dir is not None else None


def _cache_method(method: types.MethodType, s: _Settings,
                  function: types.FunctionType | None = None,
                  shared: SharedEntries | None = None, forward: Any = None) -> CachedFunction:
    """The cached method. ``function``: the plain function ``method`` holds
    (forms.function_method), keyed as the method's own code is. ``forward``: the instance
    forward ``method`` calls (forms.forward_method), keyed by what it is."""
    adapter, options, mode, cache_dir = _checked(s)
    ranks = detect(_int_or_none("global_rank", s.global_rank), _int_or_none("tp_rank", s.tp_rank),
                   _int_or_none("pp_rank", s.pp_rank))
    max_signatures = s.max_signatures
    declared: Gears | None = None
    if s.gears is not None:
        # Gear names are the function's own parameters (a holder's method takes *args).
        named = cast(types.MethodType, function) if function is not None else method
        declared = Gears(named, s.gears, s.gear_policy, s.pad)
        # The gears always fit; max_signatures more may come from calls outside them.
        max_signatures = len(declared) + max_signatures
    extra: dict[str, Any] | None = None
    if function is not None:
        # The holder's method is the same code for every function: the function's module,
        # qualified name, bytecode and source are the key's. What it reads is guarded by
        # Dynamo as for a method, and its file's content is a dependency. A stateless
        # module has no device of its own: a CUDA device's model is keyed here instead.
        extra = {"function": function_factors(function)}
        if torch.cuda.is_available():
            extra["device"] = device_factors(["cuda"])
    if forward is not None:
        # One holder method calls every such forward: the callable itself is keyed (its
        # function's code, its bound arguments as values), as a method's code is.
        extra = {"forward": callable_digest(forward)}
    enabled = not settings.DISABLE.get()
    if enabled:
        # A torch the cache cannot run on: warn here, where the user asked for caching;
        # calls then run as plain torch.compile (CachedFunction checks again).
        cache_off()
    targets = _cpu_targets(adapter, options)
    options = targets.pop("options", options)
    # dynamic=None (automatic): static until sizes change (CachedFunction switches).
    spec = CompileSpec(adapter=adapter, options=options, dynamic=bool(s.dynamic),
                       automatic=s.dynamic is None, guards=mode,
                       cache_dir=cache_dir, ranks=ranks, decompositions=s.custom_decompositions,
                       max_signatures=max_signatures, enabled=enabled, gears=declared,
                       extra_factors=extra, fullgraph=s.fullgraph, **targets)
    return CachedFunction(method, spec, shared)


def _cpu_targets(adapter: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's CPU-target fields for ``CACHECOMPILE_CPU_TARGET`` (key.cpu): the options
    of the best candidate this CPU supports, the others' for lookups, or why none fits."""
    targets = capability(adapter, "cpu_target")
    plan = cpu.from_env()
    if targets(options, cpu.NATIVE) is None or plan.candidates == (cpu.NATIVE,):
        return {}  # no CPU targets for this backend (or config names its own), or native
    if plan.build is None:
        # Never a kernel built for a level this CPU lacks: a named miss, a native compile.
        return {"cpu_unserved": plan.why_none()}
    built = [dict(targets(options, t) or options) for t in plan.supported]
    return {"options": built[0], "alternates": tuple(built[1:]),
            "cpu_target": None if plan.build == cpu.NATIVE else plan.build}


def compile_repeated_blocks(model: torch.nn.Module, *, blocks: Sequence[Any] | None = None,
                            **options: Any) -> SharedEntries:
    """Regional compilation, cached: the ``forward`` of every repeated block of ``model``
    (the classes named by ``blocks``, else by the model's ``_repeated_blocks``, diffusers'
    attribute) is cached, all instances as one group: identical blocks share one entry per
    signature, compiled once; a warm process loads it once and checks its guards for each
    block instance (docs/usage.md, "Repeated blocks").

    ``options`` are ``cache_compile``'s. Each block's ``forward`` becomes an instance
    attribute, as ``block.forward = cache_compile(block.forward)`` would make it; do not
    also cache a method that calls the blocks (the trace would meet the cached blocks).
    Returns the group, whose ``loads`` and ``reuses`` count what the warm path did.
    """
    if not isinstance(model, torch.nn.Module):
        raise ContractError(f"compile_repeated_blocks() needs an nn.Module, got "
                            f"{type(model).__qualname__}")
    wanted = list(blocks) if blocks is not None else list(
        getattr(model, "_repeated_blocks", None) or ())
    if not wanted:
        raise ContractError(
            f"compile_repeated_blocks(): {type(model).__qualname__} has no _repeated_blocks; "
            "name the block classes: compile_repeated_blocks(model, blocks=[DecoderBlock])")
    names = {b if isinstance(b, str) else getattr(b, "__name__", repr(b)) for b in wanted}
    group = SharedEntries()
    if options.pop("disable", False) is True:
        return group  # as torch.compile(disable=True): nothing compiled, the blocks as they are
    settings = _Settings(**{**_DEFAULTS, **_settings_of(options)})
    settings = _by_form(settings, torchair=False)   # it stands where block.compile() stood
    found: set[str] = set()
    for sub in model.modules():
        name = type(sub).__name__
        if name not in names:
            continue
        if isinstance(sub.forward, CachedFunction):
            raise ContractError(f"compile_repeated_blocks(): {name}.forward is cached "
                                "already; cache each block once")
        sub.forward = _cache_method(_check_method(sub.forward), settings,
                                    shared=group)
        found.add(name)
    # Classes named explicitly must be there; of the model's own _repeated_blocks (a
    # config may have none of one kind, Flux's single blocks), one is enough, as diffusers.
    missing = sorted(names - found)
    if missing and (blocks is not None or not found):
        raise ContractError(f"compile_repeated_blocks(): {type(model).__qualname__} has no "
                            f"submodule of class {', '.join(missing)}")
    return group


# cache_compile's keyword arguments, for "did you mean" (cache_compile's own, so the list
# cannot drift from the signature).
_KEYWORDS = [n for n in inspect.signature(cache_compile).parameters if n not in ("func", "kwargs")]

# cache_compile's defaults, for helpers that take its options as keywords.
_DEFAULTS: dict[str, Any] = {
    "config": None, "backend": None, "dynamic": _BY_FORM, "cache_dir": None, "global_rank": None,
    "tp_rank": None, "pp_rank": None, "custom_decompositions": None, "ge_cache": False,
    "max_signatures": 8, "guards": None, "passes": None, "gears": None,
    "gear_policy": "zip", "pad": False, "fullgraph": _FULLGRAPH_BY_FORM,
}


def _settings_of(options: Mapping[str, Any]) -> dict[str, Any]:
    """``cache_compile``'s keyword options as settings: torch.compile's own (mode,
    options) merged into config, unknown ones warned about and dropped."""
    opts = dict(options)
    mode, extra = opts.pop("mode", None), opts.pop("options", None)
    unknown = {k: opts.pop(k) for k in list(opts) if k not in _DEFAULTS}
    if unknown:
        _ignore_unknown(unknown)
    opts["config"] = _torch_compile_args(opts.get("config"), opts.get("backend"), mode, extra)
    return opts
