"""The cached method: per-call signature dispatch, and the hit / miss / degrade decisions.

First call of a signature:

1. key = the method's base factors (computed once) + the signature (``key.signature_key``);
2. store hit -> rebuild the method from the entry (no Dynamo, no compiler) and run it
   (``warm.lookup``);
3. miss -> ``cold.miss``: under the key's file lock (other processes wait, then load),
   compile with Dynamo + the adapter, run, verify the replayable program against the live
   result, publish; this process keeps the live ``torch.compile`` for that signature so
   that Dynamo can still notice a recompile.

Any cache fault (store error, unloadable entry, non-replayable program) is one
``CacheFaultWarning`` and a live compile: never a crash, never a wrong result. A torch
the cache cannot run on (an untested release, a private name missing: see
:func:`cachecompile._torch.probe`) turns caching off for the process, with one
``UnsupportedTorchWarning``; every method then runs as plain ``torch.compile``.

The cold side is imported on the first miss, not here: a warm process never loads it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import threading
import time
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, cast, overload

import torch

from cachecompile.backends.base import capability
from cachecompile.errors import (
    InferenceOnlyError,
    InferenceOnlyWarning,
    OutOfGearWarning,
    SignatureLimitWarning,
    fault,
    user_stacklevel,
)
from cachecompile.key.gears import Gears
from cachecompile.key.signature import Signature, describe, requires_grad, signature, varying
from cachecompile.key.signature_key import SignatureKeys
from cachecompile.spec import CompileSpec
from cachecompile.store import Key, LocalStorage
from cachecompile.store.errors import StoreError
from cachecompile.warm import collector
from cachecompile.warm.lookup import Lookup, Probe, Variant, record_miss
from cachecompile.warm.state import cache_off, store_for

if TYPE_CHECKING:
    from cachecompile.cold.capture import LiveSession
    from cachecompile.cold.miss import MissPath
    from cachecompile.warm.frame_serving import Continuation, Frames, LiveFrame

logger = logging.getLogger(__name__)

__all__ = ["CachedFunction", "SharedEntries", "cache_off"]

# Read on every call: the function itself, not two attribute lookups through ``torch``.
_grad_enabled = torch.is_grad_enabled

_P = ParamSpec("_P")
_R = TypeVar("_R")

# What a miss of a signature outside the declared gears is counted about (cachectl stats).
OFF_GEAR = "outside the declared gears"


class SharedEntries:
    """Entries loaded once for the instances of repeated blocks (``compile_repeated_blocks``).

    N identical blocks have one signature key per signature. The first block to load an entry
    registers it here; every other block's first call of that signature checks the
    entry's guards against itself (its own parameters, its own attributes: a block whose
    ``layer_idx`` the program read fails them) and, if they hold, runs the same program
    with its own ``self``: one load, N guard checks, no second read of the entry.
    """

    def __init__(self) -> None:
        self._loaded: dict[str, list[Variant]] = {}   # signature key digest -> loaded variants
        self._lock = threading.Lock()
        self.loads = 0      # entries loaded from the store for the group
        self.reuses = 0     # block instances served by an entry another one loaded

    def add(self, sig_key: Key, variant: Variant) -> None:
        if variant.checker is None or not isinstance(variant.run, types.MethodType):
            return  # a live compile: bound to its own instance, nothing to share
        with self._lock:
            self._loaded.setdefault(sig_key.digest, []).append(variant)
            self.loads += 1

    def reuse(self, sig_key: Key, lookup: Lookup, module: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Variant | None:
        """A variant another block loaded whose guards hold for ``module``, rebound to it."""
        with self._lock:
            variants = list(self._loaded.get(sig_key.digest, ()))
        for v in variants:
            assert v.checker is not None and isinstance(v.run, types.MethodType)
            if v.checker.full(module, *args, **kwargs):
                check, fast = lookup.check_of(v.checker)
                with self._lock:
                    self.reuses += 1
                return Variant(run=types.MethodType(v.run.__func__, module), check=check,
                               name=v.name, fast=fast, checker=v.checker)
        return None


class _ColdSide:
    """What a cached method does when no stored variant serves (for its current spec): a
    miss's compile (``cold.miss``, imported on the first miss), the live fallback, and a
    graph break's frames compiled live (``frame_serving.FrameCompiler``)."""

    def __init__(self, cached: CachedFunction) -> None:
        self._cached = cached
        self._miss: MissPath | None = None
        self._fallback: LiveSession | None = None

    def miss_path(self) -> MissPath:
        if self._miss is None:
            from cachecompile.cold.miss import MissPath

            c = self._cached
            self._miss = MissPath(c._method, c.spec, c._keys, c._lookup,
                                  self.recompile_limit_hit)
        return self._miss

    def compile(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                st: LocalStorage, sig_key: Key, probe: Probe, early: dict[str, float]) -> Any:
        """A miss: compile the signature (publishing it where that is worth it) and run it."""
        # Capture reads Dynamo's (and the adapter's) private names: probed on the first miss
        # (it imports them: most of what torch.compile itself imports before tracing).
        t1 = time.perf_counter()
        if cache_off(self._cached.spec.adapter.torch_parts) is not None:
            return self.run_live(sig, args, kwargs, "cache off for this torch")
        early["torch_imports"] = time.perf_counter() - t1
        miss = self.miss_path()
        served = miss.run(st, sig_key, sig, args, kwargs, early,
                          publish=miss.churn.worth_publishing(probe, sig))
        self._cached._add(sig, served.variant, served.outcome.value)
        return served.result

    def run_live(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                 why: str) -> Any:
        from cachecompile.cold.capture import LiveSession

        c = self._cached
        if self._fallback is None:
            self._fallback = LiveSession(c._method, c.spec)
            self._fallback.on_recompile_limit = self.recompile_limit_hit
        c._add(sig, Variant(run=self._fallback, check=None, name="live"), "live")
        logger.info("cachecompile live %s [%s]: %s", c.__qualname__, describe(sig), why)
        return self._fallback(*args, **kwargs)

    def recompile_limit_hit(self, reason: str) -> None:
        """A live compile of this method passed Dynamo's recompile limit (capture.LiveSession
        then runs the call eagerly): say so once per method, naming the guard that keeps
        failing."""
        c = self._cached
        if c._limit_hit_warned:
            return
        c._limit_hit_warned = True
        warnings.warn(
            f"{c.__qualname__}: a value Dynamo guards changes on every call, so every "
            "call was a new compile, and Dynamo's recompile limit is reached. The guard that "
            f"failed last: {reason}. From now on a call that would need a new compile runs "
            "eagerly (uncompiled). Pass that value as a tensor, or make it dynamic "
            "(dynamic=True, or torch._dynamo.mark_dynamic), so that one compile serves every "
            "value", SignatureLimitWarning, stacklevel=user_stacklevel())

    def compile_frame(self, frames: Frames, cont: Continuation, why: str) -> LiveFrame | None:
        """frame_serving.FrameCompiler: None where nothing may be compiled (the frame then
        runs as written)."""
        if cache_off(self._cached.spec.adapter.torch_parts) is not None:
            return None
        return self.miss_path().compile_frame(frames, cont, why)


def _off_gear_warning(qualname: str, gears: Gears, sizes: tuple[int, ...] | None,
                      why: str) -> None:
    shape = gears.describe(sizes) if sizes is not None else \
        "a gear argument that is no tensor of the declared rank"
    warnings.warn(
        f"{qualname}: a call with {shape} fits none of the declared gears "
        f"({gears.describe()}){'; not padded: ' + why if gears.pad else ''}. It is "
        "compiled for its own shape and cached like any other signature (counted in "
        "cachectl stats as a miss about 'outside the declared gears'). Declare it as a "
        "gear, or prebuild it with cachecompile.Exact (this warning is given once per "
        "method)", OutOfGearWarning, stacklevel=user_stacklevel())


def _training_warning(qualname: str, module: torch.nn.Module) -> None:
    """A module in training mode whose parameters require grad, called in grad mode:
    training, or inference that forgot ``model.eval()``. The outputs carry no autograd
    history either way; said once per method, before anything is compiled, so that a
    ``backward()`` that fails later ("does not require grad") has its cause on record."""
    if not any(p.requires_grad for p in module.parameters()):
        return
    warnings.warn(
        f"{qualname} is cached for inference only: its module "
        f"({type(module).__qualname__}) is in training mode with parameters that "
        "require grad, and grad mode is on, but the cached call runs under "
        "torch.no_grad(): its outputs carry no autograd history, so backward() through "
        "them fails. For inference, call model.eval() (or call under torch.no_grad() "
        "or torch.inference_mode()); to train, use torch.compile for this method. "
        "(This warning is given once per cached method.)",
        InferenceOnlyWarning, stacklevel=user_stacklevel())


class CachedFunction(Generic[_P, _R]):
    """What ``cache_compile`` returns. Call it like the method it wraps (a type checker
    sees the method's parameters and return type)."""

    def __init__(self, method: types.MethodType, spec: CompileSpec,
                 shared: SharedEntries | None = None) -> None:
        self._method = method
        self._shared = shared
        self._module = cast(torch.nn.Module, method.__self__)  # api checked it
        self.spec = spec
        self._gears = spec.gears
        self._dynamic = spec.dynamic
        self._gear_warned = False
        self._runners: dict[Signature, list[Variant]] = {}
        # The variant that served the last two calls, tried by its guard tree alone before
        # the signature is computed (__call__); the one that served the last call.
        self._last: Variant | None = None
        self._prev: Variant | None = None
        self._keys = SignatureKeys(method, spec)
        # The other CPU targets this CPU supports (CACHECOMPILE_CPU_TARGET), best first:
        # looked up when the best one misses; a miss compiles for the best.
        self._alt_keys = [SignatureKeys(method, spec.for_alternate(i))
                          for i in range(len(spec.alternates))]
        self._lookup = Lookup(method, spec)
        self._cold = _ColdSide(self)
        self._lookup.frame_compiler = self._cold
        self._limit_hit_warned = False  # a live compile passed Dynamo's recompile limit
        self._training_warned = False   # InferenceOnlyWarning given (or not needed)
        self._trains = bool(capability(spec.adapter, "trains")())
        # dynamic=None: each call's form (key.automatic.form) -> its first static signature,
        # until a call differs from it (then dims or the method dynamic, as Dynamo does).
        self._shapes: dict[Signature, Signature] | None = {} if spec.automatic else None
        # ... and, per form, the dims that changed (key.automatic): widened from then on.
        self._widened: dict[Signature, tuple[tuple[int, tuple[int, ...]], ...]] = {}
        self._unmark: Callable[[], None] | None = None  # the marks a first call put on
        self._retired: list[Lookup] = []  # lookups of the static phase (they hold pins)
        self._limit_warned = False
        self._lock = threading.RLock()
        self._params = tuple(inspect.signature(method).parameters)
        self.__wrapped__ = method
        self.__name__ = method.__name__
        self.__qualname__ = method.__qualname__
        self.__doc__ = method.__doc__
        # Outcome of each variant's first call: "hit", "miss", "shared", "live" (tests, logs).
        self.events: list[tuple[str, str]] = []

    # -- calls ------------------------------------------------------------------------
    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        # The warm call, inline (every decode step runs it): grad off, no gears, a
        # signature seen before whose one variant's check holds. Everything else, and any
        # change of those, takes the general path below.
        if self._gears is None and not _grad_enabled():
            # First the variant that served the last calls, by its guard tree alone, every
            # guard of its entry: what Dynamo checks before it runs a cache entry. The
            # signature only picks which variants to try, and computing it after a program
            # has run (its caches cold) cost a decode step 3-4 us, 2% of the call (issue
            # 53). A tree that says no costs one check: the signature then decides, and
            # the shortcut waits until one variant serves two calls in a row again.
            last = self._last
            if last is not None:
                if last.fast(*args, **kwargs):  # type: ignore[misc]
                    return last.run(*args, **kwargs)
                self._last = None
            sig = signature(args, kwargs, self._dynamic)
            if self._widened:
                sig = self._widen(sig, args, kwargs)
            variants = self._runners.get(sig)
            if variants is not None and len(variants) == 1:
                v = variants[0]
                if v.check is None or v.check(*args, **kwargs):
                    if v is self._prev and v.fast is not None:
                        self._last = v
                    self._prev = v
                    return v.run(*args, **kwargs)
                return self._locked(sig, args, kwargs)  # as _dispatch after its checks
            return self._dispatch(args, kwargs, sig=sig)
        if _grad_enabled():
            grad_input = requires_grad(args, kwargs)
            if self._trains and (grad_input or self._training_with_grads()):
                # A training call: compiled (forward and backward), stored and served in
                # grad mode, as torch.compile runs it; its guards hold grad mode and each
                # input's and parameter's requires_grad, so it never serves an
                # inference call, nor one of those a training call.
                return self._call(args, kwargs)
            if grad_input:
                raise InferenceOnlyError(
                    f"{self.__qualname__} is cached for inference only, but an input requires "
                    "grad while grad mode is on. Call it under torch.no_grad() or "
                    "torch.inference_mode(), or detach the inputs; for training use "
                    "torch.compile directly.")
            if not self._training_warned and self._module.training:
                self._training_warned = True
                _training_warning(self.__qualname__, self._module)
            with torch.no_grad():
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _training_with_grads(self) -> bool:
        """The module is training with parameters that require grad: in grad mode, with
        an input that requires grad, a call that needs autograd (an ``eval()`` module
        keeps the inference path: under ``no_grad``, its outputs without history)."""
        return self._module.training and any(p.requires_grad for p in self._module.parameters())

    @property
    def gears(self) -> Gears | None:
        """The declared gears (``cache_compile(gears=...)``), if any."""
        return self._gears

    @property
    def dynamic(self) -> bool:
        return self.spec.dynamic

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._gears is not None:
            sizes = self._gears.sizes(args, kwargs)
            if not self._gears.holds(sizes):
                return self._off_gear(args, kwargs, sizes)
        return self._dispatch(args, kwargs)

    def _off_gear(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                  sizes: tuple[int, ...] | None) -> Any:
        """A call that fits no declared gear: padded up to one if asked, else a signature
        like any other (compiled once, published, loaded by the next process), with one
        warning per method that the gears do not cover it."""
        gears = self._gears
        assert gears is not None
        why = ""
        if gears.pad:
            plan, why = gears.pad_plan(args, kwargs, sizes)
            if plan is not None:
                return plan.unpad(self._dispatch(plan.args, plan.kwargs))
        if not self._gear_warned:
            with self._lock:
                if not self._gear_warned:
                    self._gear_warned = True
                    _off_gear_warning(self.__qualname__, gears, sizes, why)
        return self._dispatch(args, kwargs, off_gear=True)

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                  off_gear: bool = False, sig: Signature | None = None) -> Any:
        if sig is None:
            sig = signature(args, kwargs, self._dynamic)
            if self._widened:
                sig = self._widen(sig, args, kwargs)
        variants = self._runners.get(sig)
        if variants is not None:
            if len(variants) > 1:
                # Each variant's C++ tree first: a full check of a variant that does not
                # fit costs a Python walk, which every call would pay for each variant
                # ahead of the one that fits.
                for v in variants:
                    if v.fast is not None and v.fast(*args, **kwargs):
                        return v.run(*args, **kwargs)
            for v in variants:
                if v.check is None or v.check(*args, **kwargs):
                    return v.run(*args, **kwargs)
        return self._locked(sig, args, kwargs, off_gear)

    def _locked(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                off_gear: bool = False) -> Any:
        """No variant of ``sig`` held without the lock: again under it (another thread may
        have added one), else the signature's first call (or a new variant's)."""
        with self._lock:
            for v in self._runners.get(sig, ()):
                if v.check is None or v.check(*args, **kwargs):
                    return v.run(*args, **kwargs)
            return self._first_call(sig, args, kwargs, off_gear)

    def _add(self, sig: Signature, variant: Variant, event: str) -> None:
        self._runners.setdefault(sig, []).append(variant)
        self.events.append((event, describe(sig)))

    def _n_variants(self) -> int:
        return sum(len(v) for v in self._runners.values())

    # -- first call of a signature (or of a variant whose guards failed) --------------
    def _first_call(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                    off_gear: bool = False) -> Any:
        # Decided with the collector paused (what a load drops must not look long-lived
        # to it: warm.collector); what it decided runs after, so a compile or the
        # program's first run is outside.
        try:
            with collector.paused():
                act = self._decide(sig, args, kwargs, off_gear)
            return act()
        finally:
            unmark, self._unmark = self._unmark, None   # set by _automatic, if it marked
            if unmark is not None:
                unmark()

    def _decide(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any],  # noqa: C901 (today's exception: the first call's outcomes (hit, miss, refusal, fault))
                off_gear: bool) -> Callable[[], Any]:
        """What the first call of a signature does: load a stored variant (a hit), run
        live, or compile (a miss); as a call to make once the lookup is over."""
        if self._shapes is not None:
            sig = self._automatic(sig, args, kwargs)
        spec = self.spec
        live = functools.partial(self._cold.run_live, sig, args, kwargs)
        if not spec.enabled:
            return functools.partial(live, "disabled")
        if cache_off() is not None:
            return functools.partial(live, "cache off for this torch")
        if not spec.dynamic and self._n_variants() >= spec.max_signatures:
            if not self._limit_warned:
                self._limit_warned = True
                what = varying(list(self._runners), sig, self._params)
                warnings.warn(
                    f"{self.__qualname__}: more than {spec.max_signatures} static variants "
                    f"(dynamic=False){'; what varies: ' + what if what else ''}. New ones run "
                    "with live torch.compile (uncompiled past Dynamo's recompile limit) and are "
                    "not cached. Make that argument dynamic "
                    "(dynamic=True), pad it to a few sizes, or raise max_signatures.",
                    SignatureLimitWarning, stacklevel=user_stacklevel())
            return functools.partial(live, "over signature limit")
        t0 = time.perf_counter()
        early: dict[str, float] = {}  # the cold path's first phases (cold.compiling.Phases)
        try:
            sig_key = self.key(sig)
        except Exception as e:  # an unkeyable call is a fault, not a crash
            logger.debug("computing the key failed", exc_info=True)
            fault(f"computing the cache key failed ({type(e).__name__}: {e})")
            return functools.partial(live, "no key")
        early["key"] = time.perf_counter() - t0
        if self._shared is not None:
            reused = self._shared.reuse(sig_key, self._lookup, self._module, args, kwargs)
            if reused is not None:
                self._add(sig, reused, "hit")
                logger.info("cachecompile hit %s %s [%s] shared with a repeated block, "
                            "checked in %.1f ms", self.__qualname__, reused.name,
                            describe(sig), (time.perf_counter() - t0) * 1e3)
                return functools.partial(reused.run, *args, **kwargs)
        try:
            st = store_for(spec.cache_dir)
        except (StoreError, OSError) as e:
            fault(f"the cache store is unusable: {e}")
            return functools.partial(live, "store unusable")
        if spec.cpu_unserved is not None:
            # Never a lookup of kernels this CPU cannot run, nor a compile for them.
            record_miss(st, "cpu", "no CPU target this CPU supports")
            logger.info("cachecompile miss %s [%s]: %s", self.__qualname__, describe(sig),
                        spec.cpu_unserved)
            fault(f"{self.__qualname__} [{describe(sig)}]: no CPU target of "
                  f"CACHECOMPILE_CPU_TARGET fits this CPU ({spec.cpu_unserved}); it runs "
                  "with a live native compile, neither loaded nor published")
            return functools.partial(live, "no CPU target fits this CPU")
        probe = self._lookup.probe(st, sig_key, args, kwargs)
        for alt in self._alt_keys if probe.runner is None and not probe.missing_ops else ():
            found = self._lookup.probe(st, alt.signature_key(sig), args, kwargs)
            if found.runner is not None or found.missing_ops:
                # Served under the best target's signature key from now on (repeated blocks share
                # it); a miss of them all stays the best one's, which a compile fills.
                probe = found
                break
        if probe.runner is not None:
            self._add(sig, probe.runner, "hit")
            if self._shared is not None:
                self._shared.add(sig_key, probe.runner)
            logger.info("cachecompile hit %s %s [%s] loaded in %.1f ms", self.__qualname__,
                        probe.runner.name, describe(sig), (time.perf_counter() - t0) * 1e3)
            return functools.partial(probe.runner.run, *args, **kwargs)
        if probe.missing_ops:
            record_miss(st, probe.kind, None)
            # The entry is there; this process lacks what its program calls. Compiling
            # and publishing another one would not help the next process either.
            fault(f"{self.__qualname__} [{describe(sig)}]: the cached program calls "
                  f"{', '.join(probe.missing_ops)}, which this process has not "
                  "registered (import the module that defines it, or load its library, "
                  "before the first call); it runs with a live compile")
            return functools.partial(live, "custom operator not registered")
        early["lookup"] = time.perf_counter() - t0 - early["key"]
        if probe.kind is not None:
            # An entry was there and did not serve (a guard, stale, unloadable, corrupt...).
            why = "; ".join(probe.rejected[:3]) or f"the entry was {probe.kind}"
            record_miss(st, probe.kind, probe.guard if probe.kind == "guard" else None)
        else:
            near, differ = self._lookup.nearest(st, sig_key, sig)
            why = "no entry" + near
            # A miss for want of a key is counted by what set the nearest entry apart; a
            # signature outside the declared gears by that (cachectl stats counts them).
            record_miss(st, "absent", OFF_GEAR if off_gear else ", ".join(differ[:3]) or None)
        # The key the compile will publish (under a CPU target, the target's), so that
        # the digest here is the one `cachectl ls` shows once it is published.
        logger.info("cachecompile miss %s %s [%s]: %s", self.__qualname__,
                    probe.publish_key(sig_key).digest[:12], describe(sig), why)
        return functools.partial(self._cold.compile, sig, args, kwargs, st, sig_key, probe,
                                 early)

    def _widen(self, sig: Signature, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Signature:
        """A static signature with the dims its form widened (dynamic=None, per dim)."""
        from cachecompile.key import automatic  # imported once a form widened

        dims = self._widened.get(automatic.form(signature(args, kwargs, True)))
        return sig if dims is None else automatic.widen(sig, dims)

    def _automatic(self, sig: Signature, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Signature:
        """dynamic=None, as torch.compile's automatic dynamic shapes: the first call of a
        form compiles static; a later call that differs from it in tensor sizes only
        compiles with the dims that changed dynamic (key.automatic), every other dim
        static, for that form from then on; one that differs in more (an int's value)
        switches the method to dynamic, for every call from then on. Decided per process
        from its own calls, so a warm process that sees the same calls loads the same
        entries (the static one, then the widened one)."""
        from cachecompile.key import automatic  # not a warm start's: only sizes that vary

        assert self._shapes is not None
        blind = automatic.form(signature(args, kwargs, True))
        seen = self._shapes.get(blind)
        if seen is None:
            self._shapes[blind] = sig
            return sig
        static = signature(args, kwargs, False)
        known = self._widened.get(blind, ())
        if static == seen and not known:
            return sig
        dims = automatic.changed_dims(seen, static, known)
        if dims is not None:
            if dims != known:
                logger.info("cachecompile %s: [%s] after [%s]: sizes changed, so those dims "
                            "are dynamic from now on (dynamic=None, torch.compile's automatic "
                            "dynamic shapes)", self.__qualname__, describe(static),
                            describe(seen))
                self._widened[blind] = dims
            sig = automatic.widen(static, dims)
            self._unmark = automatic.mark(sig, args, kwargs, dims)
            return sig
        logger.info("cachecompile %s: [%s] after [%s]: more than sizes changed, so dynamic "
                    "from now on (dynamic=None, torch.compile's automatic dynamic shapes)",
                    self.__qualname__, describe(static), describe(seen))
        self._shapes = None
        self._widened = {}
        self.spec = dataclasses.replace(self.spec, dynamic=True)
        self._dynamic = True
        self._keys = SignatureKeys(self._method, self.spec)
        self._alt_keys = [SignatureKeys(self._method, self.spec.for_alternate(i))
                          for i in range(len(self.spec.alternates))]
        self._retired.append(self._lookup)
        self._lookup = Lookup(self._method, self.spec)
        self._cold = _ColdSide(self)
        self._lookup.frame_compiler = self._cold
        return signature(args, kwargs, True)

    # -- keys -------------------------------------------------------------------------
    def factors(self, sig: Signature) -> dict[str, Any]:
        """The key factors of a call signature (named, readable: ``cachectl explain``)."""
        return self._keys.factors(sig)

    def key(self, sig: Signature) -> Key:
        """The key of a call signature (its variants: ``warm.chain.VariantChain``)."""
        return self._keys.signature_key(sig)

    if TYPE_CHECKING:
        # As a class attribute (``@cache_compile`` above ``def forward(self, ...)``) it
        # is bound on access: what a type checker sees of ``model.forward``.
        @overload
        def __get__(self, instance: None, owner: type | None = None) -> CachedFunction[_P, _R]: ...
        @overload
        def __get__(self, instance: object, owner: type | None = None) -> Callable[..., _R]: ...
        def __get__(self, instance: Any, owner: Any = None) -> Any: ...

    def __deepcopy__(self, memo: dict[int, Any]) -> CachedFunction[_P, _R]:
        """A deep copy of a module whose ``forward`` is cached (an instance attribute, as the
        class-body and repeated-block forms make it) caches the copy's own method."""
        module = memo.get(id(self._module))
        if module is None:
            module = copy.deepcopy(self._module, memo)
        return CachedFunction(types.MethodType(self._method.__func__, module), self.spec,
                              self._shared)

    def __repr__(self) -> str:
        return (f"<cache_compile {self.__qualname__} backend={self.spec.adapter.name} "
                f"dynamic={self.spec.dynamic} signatures={len(self._runners)}>")
