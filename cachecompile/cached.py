"""The cached method: per-call signature dispatch, and the hit / miss / degrade flow.

First call of a signature:

1. key = the method's base factors (computed once) + the signature;
2. store hit -> rebuild the method from the entry (no Dynamo, no compiler) and run it;
3. miss -> under the key's file lock (other processes wait, then load), compile with
   Dynamo + the adapter, run, verify the replayable program against the live result,
   publish; this process keeps the live ``torch.compile`` for that signature so that
   Dynamo can still notice a recompile (then the entry is withdrawn, as TorchAir does).

Any cache fault (store error, unloadable entry, non-replayable program) is one
``CacheFaultWarning`` and a live compile: never a crash, never a wrong result. A torch
the cache cannot run on (an untested release, a private name missing: see
:func:`cachecompile._torch.probe`) turns caching off for the process, with one
``UnsupportedTorchWarning``; every method then runs as plain ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import threading
import time
import types
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from cachecompile import _torch
from cachecompile.backends.base import Adapter
from cachecompile.entry import guards as guards_mod
from cachecompile.entry.files import BYTECODE_FILE
from cachecompile.errors import (
    CacheFaultWarning,
    InferenceOnlyError,
    OutOfGearWarning,
    SignatureLimitWarning,
    UnsupportedProgramError,
    UnsupportedTorchWarning,
    user_stacklevel,
)
from cachecompile.key import deps as deps_mod
from cachecompile.key import factors as factors_mod
from cachecompile.key import passes as passes_mod
from cachecompile.key.gears import Gears
from cachecompile.key.ranks import Ranks
from cachecompile.key.signature import (
    Signature,
    describe,
    input_marks,
    requires_grad,
    signature,
    to_json,
    varying,
)
from cachecompile.procs import coop
from cachecompile.store import Hit, Key, LocalStorage, default_root, make_key, open_store
from cachecompile.store.errors import KeyNotFound, StoreError
from cachecompile.store.explain import nearest as nearest_entry
from cachecompile.warm import replay

if TYPE_CHECKING:
    from cachecompile.cold.capture import Phases

logger = logging.getLogger(__name__)

_stores: dict[str, LocalStorage] = {}
_stores_lock = threading.Lock()


def _open_store(cache_dir: str | None) -> LocalStorage:
    """One store object per root and process (opening sweeps temp dirs: do it once).
    ``open_store`` decides read-only (``CACHECOMPILE_READONLY``), as it does for cachectl."""
    root = cache_dir if cache_dir is not None else str(default_root())
    with _stores_lock:
        st = _stores.get(root)
        if st is None:
            st = open_store(root)
            _stores[root] = st
        return st


_off: str | None = None      # why caching is off in this process; once set, it stays
_off_lock = threading.Lock()


def cache_off(parts: tuple[str, ...] = ()) -> str | None:
    """Why caching is off in this process, or None while it is on.

    Probes torch (:func:`cachecompile._torch.probe`: its release, the warm path's private
    names, and the cold-path ``parts``). The first failure turns caching off for the rest
    of the process, with one ``UnsupportedTorchWarning``.
    """
    global _off
    if _off is None:
        why = _torch.probe(parts)
        if why is None:
            return None
        with _off_lock:
            first = _off is None
            if first:
                _off = why
        if first:
            warnings.warn(why, UnsupportedTorchWarning, stacklevel=user_stacklevel())
            logger.debug("cachecompile is off for this process: %s", why)
    return _off


class _Absent(Exception):
    """No entry under a variant key: the end of the chain."""


class _Vacated(Exception):
    """The variant's entry was removed while being looked at (stale, corrupt)."""


# A frame key (the method, its settings and the call signature) holds up to this many
# entries, each with its own guards; past it, new variants run with live torch.compile.
MAX_VARIANTS = 16
# A guard whose subject forces more new variants than this in one process is taken for a
# value that changes on every call: later variants for it run live and are not published.
CHURN_LIMIT = 2
# The miss log line compares with at most this many entries of the method (manifests
# only), and names at most this many of the factors the nearest one differs in.
NEAREST_CANDIDATES = 50
NEAREST_NAMES = 8


def guard_mode() -> str:
    """``always`` (default): every guard on every call, as torch.compile does.
    ``first`` (opt-in, TorchAir's behaviour): the argument guards on every call, the
    state guards only on each signature's first call in a process (state changed later
    is not seen)."""
    mode = os.environ.get("CACHECOMPILE_GUARDS", "always").strip().lower() or "always"
    if mode not in ("first", "always"):
        logger.warning("ignoring CACHECOMPILE_GUARDS=%r (use always or first)", mode)
        return "always"
    return mode


@dataclasses.dataclass
class _Variant:
    """One loaded entry (or live compile) serving calls of a signature while its check holds."""

    run: Callable[..., Any]
    check: Callable[..., bool] | None    # bound to the module; None: nothing to check per call
    name: str


@dataclasses.dataclass
class _Probe:
    """What looking up a frame key's variants found."""

    runner: _Variant | None = None
    free: int | None = None            # first unused variant index
    rejected: list[str] = dataclasses.field(default_factory=list)  # why each variant did not fit
    # Operators an entry's program calls that this process has not registered.
    missing_ops: list[str] = dataclasses.field(default_factory=list)
    # Why the first entry there did not serve (``cachectl stats`` counts misses by it):
    # guard, stale, format, operator, unloadable, corrupt, insecure; None: no entry.
    kind: str | None = None
    guard: str | None = None           # with kind "guard": what the failing guard is about
    guard_reason: str = ""             # ... and how it failed (the miss line's words)
    # How many of the frame's variants failed on a guard about each subject.
    guard_fails: dict[str, int] = dataclasses.field(default_factory=dict)

    def reject(self, kind: str, why: str) -> None:
        self.rejected.append(why)
        self.first(kind)

    def first(self, kind: str) -> None:
        """Note why a variant did not serve; the first reason is the lookup's."""
        if self.kind is None:
            self.kind = kind


class CachedFunction:
    """What ``cache_compile`` returns. Call it like the method it wraps."""

    def __init__(self, method: types.MethodType, *, adapter: Adapter, options: Mapping[str, Any],
                 dynamic: bool, cache_dir: str | None, ranks: Ranks,
                 decompositions: Mapping[Any, Any] | None, max_signatures: int,
                 enabled: bool, extra_factors: Mapping[str, Any] | None = None,
                 guards: str | None = None, gears: Gears | None = None) -> None:
        self._method = method
        self._module = method.__self__
        self._adapter = adapter
        self._options = dict(options)
        self._dynamic = dynamic
        self._cache_dir = cache_dir
        self._ranks = ranks
        self._decompositions = decompositions
        self._max_signatures = max_signatures
        self._enabled = enabled
        self._extra = extra_factors
        self._guard_mode = guards or guard_mode()
        self._gears = gears
        self._gear_warned = False
        self._runners: dict[Signature, list[_Variant]] = {}
        self._base: dict[str, Any] | None = None
        self._fallback: Any = None
        self._limit_hit_warned = False  # a live compile passed Dynamo's recompile limit
        self._limit_warned = False
        self._churn: dict[str, int] = {}   # guard subject -> new variants it forced here
        self._churn_warned = False
        self._pins: list[Any] = []
        self._lock = threading.RLock()
        self._params = tuple(inspect.signature(method).parameters)
        self.__wrapped__ = method
        self.__name__ = method.__name__
        self.__qualname__ = method.__qualname__
        self.__doc__ = method.__doc__
        # Outcome of each variant's first call: "hit", "miss", "shared", "live" (tests, logs).
        self.events: list[tuple[str, str]] = []

    # -- calls ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            if requires_grad(args, kwargs):
                raise InferenceOnlyError(
                    f"{self.__qualname__} is cached for inference only, but an input requires "
                    "grad while grad mode is on. Call it under torch.no_grad() or "
                    "torch.inference_mode(), or detach the inputs; for training use "
                    "torch.compile directly.")
            with torch.no_grad():
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    @property
    def gears(self) -> Gears | None:
        """The declared gears (``cache_compile(gears=...)``), if any."""
        return self._gears

    @property
    def dynamic(self) -> bool:
        return self._dynamic

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._gears is not None:
            sizes = self._gears.sizes(args, kwargs)
            if not self._gears.holds(sizes):
                return self._off_gear(args, kwargs, sizes)
        return self._dispatch(args, kwargs)

    def _off_gear(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                  sizes: tuple[int, ...] | None) -> Any:
        """A call that fits no declared gear: padded up to one if asked, else live."""
        gears = self._gears
        assert gears is not None
        why = ""
        if gears.pad:
            plan, why = gears.pad_plan(args, kwargs, sizes)
            if plan is not None:
                return plan.unpad(self._dispatch(plan.args, plan.kwargs))
        sig = signature(args, kwargs, self._dynamic)
        variants = self._runners.get(sig)
        if variants:
            return variants[0].run(*args, **kwargs)  # this shape's live compile
        with self._lock:
            variants = self._runners.get(sig)
            if variants:
                return variants[0].run(*args, **kwargs)
            if not self._gear_warned:
                self._gear_warned = True
                shape = gears.describe(sizes) if sizes is not None else \
                    "a gear argument that is no tensor of the declared rank"
                warnings.warn(
                    f"{self.__qualname__}: a call with {shape} fits none of the declared gears "
                    f"({gears.describe()}){'; not padded: ' + why if gears.pad else ''}. It "
                    "runs with a live torch.compile and is not cached (this warning is given "
                    "once; later ones are logged)", OutOfGearWarning, stacklevel=user_stacklevel())
            return self._run_live(sig, args, kwargs, "outside the declared gears")

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sig = signature(args, kwargs, self._dynamic)
        variants = self._runners.get(sig)
        if variants is not None:
            for v in variants:
                if v.check is None or v.check(*args, **kwargs):
                    return v.run(*args, **kwargs)
        with self._lock:
            for v in self._runners.get(sig, ()):
                if v.check is None or v.check(*args, **kwargs):
                    return v.run(*args, **kwargs)
            return self._first_call(sig, args, kwargs)

    def _add(self, sig: Signature, variant: _Variant, event: str) -> None:
        self._runners.setdefault(sig, []).append(variant)
        self.events.append((event, describe(sig)))

    def _n_variants(self) -> int:
        return sum(len(v) for v in self._runners.values())

    # -- first call of a signature (or of a variant whose guards failed) --------------
    def _first_call(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._enabled:
            return self._run_live(sig, args, kwargs, "disabled")
        if cache_off() is not None:
            return self._run_live(sig, args, kwargs, "cache off for this torch")
        if not self._dynamic and self._n_variants() >= self._max_signatures:
            if not self._limit_warned:
                self._limit_warned = True
                what = varying(list(self._runners), sig, self._params)
                warnings.warn(
                    f"{self.__qualname__}: more than {self._max_signatures} static variants "
                    f"(dynamic=False){'; what varies: ' + what if what else ''}. New ones run "
                    "with live torch.compile (uncompiled past Dynamo's recompile limit) and are "
                    "not cached. Make that argument dynamic "
                    "(dynamic=True), pad it to a few sizes, or raise max_signatures.",
                    SignatureLimitWarning, stacklevel=user_stacklevel())
            return self._run_live(sig, args, kwargs, "over signature limit")
        t0 = time.perf_counter()
        early: dict[str, float] = {}  # the cold path's first phases (capture.Phases)
        try:
            frame = self._key(sig)
        except Exception as e:  # noqa: BLE001 - an unkeyable call is a fault, not a crash
            logger.debug("computing the key failed", exc_info=True)
            self._fault(f"computing the cache key failed ({type(e).__name__}: {e})")
            return self._run_live(sig, args, kwargs, "no key")
        early["key"] = time.perf_counter() - t0
        try:
            st = _open_store(self._cache_dir)
        except (StoreError, OSError) as e:
            self._fault(f"the cache store is unusable ({e})")
            return self._run_live(sig, args, kwargs, "store unusable")
        probe = self._probe(st, frame, args, kwargs)
        if probe.runner is not None:
            self._add(sig, probe.runner, "hit")
            logger.info("cachecompile hit %s %s [%s] loaded in %.1f ms", self.__qualname__,
                        probe.runner.name, describe(sig), (time.perf_counter() - t0) * 1e3)
            return probe.runner.run(*args, **kwargs)
        if probe.missing_ops:
            self._record_miss(st, probe.kind, None)
            # The entry is there; this process lacks what its program calls. Compiling
            # and publishing another one would not help the next process either.
            self._fault(f"{self.__qualname__} [{describe(sig)}]: the cached program calls "
                        f"{', '.join(probe.missing_ops)}, which this process has not "
                        "registered (import the module that defines it, or load its library, "
                        "before the first call); it runs with a live compile")
            return self._run_live(sig, args, kwargs, "custom operator not registered")
        early["lookup"] = time.perf_counter() - t0 - early["key"]
        if probe.rejected:
            why = "; ".join(probe.rejected[:3])
            self._record_miss(st, probe.kind, probe.guard if probe.kind == "guard" else None)
        else:
            near, differ = self._nearest(st, frame, sig)
            why = "no entry" + near
            # A miss for want of a key is counted by what set the nearest entry apart.
            self._record_miss(st, "absent", ", ".join(differ[:3]) or None)
        logger.info("cachecompile miss %s %s [%s]: %s", self.__qualname__, frame.digest[:12],
                    describe(sig), why)
        # Capture reads Dynamo's (and the adapter's) private names: probed on the first miss
        # (it imports them: most of what torch.compile itself imports before tracing).
        t1 = time.perf_counter()
        if cache_off(self._adapter.torch_parts) is not None:
            return self._run_live(sig, args, kwargs, "cache off for this torch")
        early["torch_imports"] = time.perf_counter() - t1
        return self._compile(st, frame, sig, args, kwargs, early,
                             publish=self._worth_publishing(probe, sig))

    def _record_miss(self, st: LocalStorage, kind: str | None, about: str | None) -> None:
        """Count this lookup's miss once, by why the first entry there did not serve
        (``absent`` when none was there), and what it was about: the failing guard's
        subject (bounded by the code, not values), or the factors the nearest entry
        differs in."""
        self._safe(lambda: st.record_miss(kind or "absent", about))

    def _variant_key(self, frame: Key, i: int) -> Key:
        return make_key({**frame.factors, "variant": i})

    def _probe(self, st: LocalStorage, frame: Key, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> _Probe:
        """Walk the frame's variants in order; load the first whose guards hold."""
        out = _Probe()
        for i in range(MAX_VARIANTS):
            key = self._variant_key(frame, i)
            try:
                meta = self._variant_meta(st, key)
            except _Absent:
                # Variants are published at the lowest free index, so the chain ends at the
                # first gap (a gap left by eviction is refilled by the next publish).
                out.free = i if out.free is None else out.free
                return out
            except _Vacated as v:
                # Quarantined by the store just now (it warned once): refill this index.
                out.free = i if out.free is None else out.free
                out.first(str(v))
                continue
            except (StoreError, OSError) as e:
                self._fault(f"looking up {key.digest[:12]} failed ({e})")
                return out
            if meta is None:
                continue  # unusable (corrupt, insecure): the store said why
            try:
                runner = self._try_variant(st, key, meta, args, kwargs, out)
            except _Vacated as v:
                # Quarantined or removed just now: the next publish refills this index.
                out.free = i if out.free is None else out.free
                out.first(str(v))
                continue
            except Exception as e:  # noqa: BLE001 - any load fault degrades to a recompile
                logger.debug("loading entry failed", exc_info=True)
                self._fault(f"entry {key.digest[:12]} could not be loaded "
                            f"({type(e).__name__}: {e}); it is removed and recompiled")
                out.first("unloadable")
                self._safe(functools.partial(st.delete, key))
                out.free = i if out.free is None else out.free
                return out
            if runner is not None:
                out.runner = runner
                return out
        return out

    def _variant_meta(self, st: LocalStorage, key: Key) -> dict[str, Any] | None:
        """An entry's meta, from its manifest when the local store has it (no file hashing,
        no hit counted); else through ``get`` (a remote tier downloads and backfills)."""
        try:
            return dict(st.manifest(key)["meta"])
        except KeyNotFound:
            pass
        except StoreError:
            # A manifest that fails its digest: ``get`` verifies it again and
            # quarantines it, so it is warned about once, not on every run.
            pass
        outcome = st.get(key)
        if isinstance(outcome, Hit):
            return dict(outcome.entry.meta)
        if outcome.kind == "absent":
            raise _Absent()
        if outcome.kind in ("corrupt", "insecure"):
            raise _Vacated(outcome.kind)
        self._fault(f"entry {key.digest[:12]} is unusable: {outcome.reason}")
        return None

    def _try_variant(self, st: LocalStorage, key: Key, meta: dict[str, Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any], out: _Probe) -> _Variant | None:
        name = f"{key.digest[:12]} (variant {key.factors.get('variant')})"
        if meta.get("format") != factors_mod.FORMAT_VERSION or meta.get("adapter") != self._adapter.name:
            out.reject("format", f"{name}: format {meta.get('format')!r} / adapter "
                                 f"{meta.get('adapter')!r} does not fit")
            return None
        changed = deps_mod.changed(meta.get("deps", {}))
        if changed:
            # Kept, not deleted: another checkout of the code (or a revert) may still
            # match it. Publishing reclaims stale variants when the chain is full.
            logger.info("cachecompile stale %s %s: source changed: %s", self.__qualname__,
                        name, ", ".join(changed[:3]))
            out.reject("stale", f"{name}: source changed ({', '.join(changed[:3])})")
            return None
        missing = passes_mod.missing_operators((meta.get("program") or {}).get("operators") or ())
        if missing:
            logger.info("cachecompile %s %s: its program calls %s, not registered here",
                        self.__qualname__, name, ", ".join(missing))
            out.reject("operator", f"{name}: operator {', '.join(missing)} is not registered")
            out.missing_ops.extend(m for m in missing if m not in out.missing_ops)
            return None
        func = self._method.__func__
        g = replay.replay_globals(func, meta["imports"])  # type: ignore[arg-type]
        checker = guards_mod.build_checker(
            func, meta["guards"], g,  # type: ignore[arg-type]
            every_call=self._guard_mode == "always")
        if not checker.full(self._module, *args, **kwargs):
            reason, subject = (checker.failure(self._module, *args, **kwargs)
                               or ("a guard failed", "a guard"))
            if out.kind is None:
                out.guard, out.guard_reason = subject, reason
            out.guard_fails[subject] = out.guard_fails.get(subject, 0) + 1
            out.reject("guard", f"{name}: guard failed: {reason}")
            return None
        outcome = st.get(key)
        if not isinstance(outcome, Hit):
            if outcome.kind != "absent":
                self._fault(f"entry {key.digest[:12]} is unusable: {outcome.reason}")
            out.rejected.append(f"{name}: {outcome.reason}")
            raise _Vacated(outcome.kind)
        entry = outcome.entry
        compiled_fn = self._adapter.load(entry.files, entry.meta["program"])
        bound = replay.rebuild(self._method, entry.files[BYTECODE_FILE].read_bytes(),
                               entry.meta.get("consts", []), g, entry.meta["compiled_fn"],
                               compiled_fn)
        try:
            self._pins.append(st.pin(entry))
        except Exception:  # noqa: BLE001 - a missing lease only weakens eviction safety
            logger.debug("could not pin entry", exc_info=True)
        return _Variant(run=bound, check=self._check_of(checker), name=name)

    def _check_of(self, checker: guards_mod.Checker) -> Callable[..., bool] | None:
        fn = checker.full if self._guard_mode == "always" else checker.per_call
        if fn is checker.per_call and checker.n_per_call == 0:
            return None
        return types.MethodType(fn, self._module)

    def _worth_publishing(self, probe: _Probe, sig: Signature) -> bool:
        """False once one guard's subject has forced more than CHURN_LIMIT new variants in
        this process, or failed in more than CHURN_LIMIT of the frame's stored variants: a
        value that changes on (nearly) every call (a cache layer's position, a step
        counter). Each such entry would serve one call; publishing them
        fills the store and the frame's variant chain for nothing. The variant still runs
        here, as a live compile."""
        if probe.kind != "guard" or not probe.guard:
            return True
        n = self._churn[probe.guard] = self._churn.get(probe.guard, 0) + 1
        # Across processes too: the store's variants that failed on the same subject.
        n = max(n, probe.guard_fails.get(probe.guard, 0))
        if n <= CHURN_LIMIT:
            return True
        if not self._churn_warned:
            self._churn_warned = True
            warnings.warn(
                f"{self.__qualname__} [{describe(sig)}]: {probe.guard} has a new value on "
                f"call after call ({n} variants for it so far; the guard: "
                f"{probe.guard_reason}). New variants for it "
                "run with a live compile and are not cached (each would serve one call). "
                "Pass that value as a tensor, or make it dynamic (dynamic=True, or "
                "torch._dynamo.mark_dynamic), so that one entry serves every value",
                SignatureLimitWarning, stacklevel=user_stacklevel())
        logger.info("cachecompile %s [%s]: not publishing another variant for %s",
                    self.__qualname__, describe(sig), probe.guard)
        return False

    def _compile(self, st: LocalStorage, frame: Key, sig: Signature, args: tuple[Any, ...],
                 kwargs: dict[str, Any], early: Mapping[str, float], *,
                 publish: bool = True) -> Any:
        from cachecompile.cold.capture import Phases, TraceSession

        phases = Phases()
        for name, seconds in early.items():
            phases.add(name, seconds)
        t_lock = time.perf_counter()
        lock: Any = None
        readonly = st.readonly
        who = f"{self.__qualname__} [{self._ranks.label()}, pid {os.getpid()}]"
        if not readonly:
            try:
                lock = coop.held(st, frame.digest, who=who,
                                 purpose=f"entry {frame.digest[:12]} ({self.__qualname__})")
                lock.__enter__()
            except (StoreError, OSError) as e:
                self._fault(f"could not take the compile lock for {frame.digest[:12]} ({e}); "
                            "compiling without it")
                lock = None
        share = (coop.GraphShare(st, self._graph_factors(sig), self._adapter, who,
                                 factors_mod.FORMAT_VERSION)
                 if not readonly and self._adapter.shares_graphs else None)
        try:
            if lock is not None:
                # Another process may have published while we waited for the lock.
                probe = self._probe(st, frame, args, kwargs)
                if probe.runner is not None:
                    self._add(sig, probe.runner, "hit")
                    return probe.runner.run(*args, **kwargs)
            phases.add("lock", time.perf_counter() - t_lock)
            session = TraceSession(self._method, self._adapter, self._options,
                                   self._decompositions, self._dynamic, share=share,
                                   phases=phases)
            session.on_recompile_limit = self._recompile_limit_hit
            t0 = time.perf_counter()
            result = session(*args, **kwargs)
            elapsed = time.perf_counter() - t0
            checker = session.checker
            # Dynamo guards its own live compile; our per-call check routes calls whose
            # arguments no longer fit to another variant, as a hit would.
            variant = _Variant(run=session, name="live",
                               check=self._check_of(checker) if checker is not None else None)
            self._add(sig, variant, "shared" if share is not None and share.shared else "miss")
            if not publish:
                return result  # no entry to build: it would not be published
            try:
                with phases.timed("entry"):
                    trace = session.trace()
            except UnsupportedProgramError as e:
                self._fault(f"{self.__qualname__} [{describe(sig)}] is not cacheable: {e}. "
                            "It runs with live torch.compile in this process")
                return result
            if readonly:
                self._fault(f"the cache at {st.root} is read-only; {self.__qualname__} "
                            f"[{describe(sig)}] was compiled but not published")
                return result
            t_publish = time.perf_counter()
            if share is not None:
                share.publish(trace.program, self._adapter.name, factors_mod.FORMAT_VERSION)
            self._publish(st, frame, sig, trace, elapsed, phases)
            phases.add("publish", time.perf_counter() - t_publish)
            logger.info("cachecompile cold phases %s [%s]: %s", self.__qualname__,
                        describe(sig), phases)
            session.on_recompile = lambda reason: logger.info(
                "cachecompile: Dynamo recompiled %s [%s] in this process (%s); the stored "
                "entry keeps its own guards", self.__qualname__, describe(sig), reason)
            return result
        finally:
            if share is not None:
                share.finish()
            if lock is not None:
                lock.__exit__(None, None, None)

    def _publish(self, st: LocalStorage, frame: Key, sig: Signature, trace: Any, elapsed: float,
                 phases: Phases) -> None:
        files: dict[str, Any] = dict(trace.program.files)
        files[BYTECODE_FILE] = trace.bytecode
        meta = {
            "format": factors_mod.FORMAT_VERSION,
            "adapter": self._adapter.name,
            "program": trace.program.meta,
            "imports": trace.imports,
            "consts": trace.consts,
            "compiled_fn": trace.compiled_fn_name,
            "deps": trace.deps,
            "guards": trace.guards,
            "signature": describe(sig),
            "compile_seconds": round(trace.compile_seconds, 3),
            "first_call_seconds": round(elapsed, 3),
            # Where the cold first call's time went, up to the publish (capture.Phases).
            "cold_phases": phases.rounded(),
        }
        module = self._module
        labels = {
            "model": type(module).__qualname__,
            "function": self._method.__name__,
            "dynamic": str(self._dynamic).lower(),
            "signature": describe(sig),
            "ranks": self._ranks.label(),
            "world_size": str(self._ranks.world_size),
            "global_rank": str(self._ranks.global_rank),
            "backend": self._adapter.name,
            "frame": frame.digest[:32],
        }
        labels["group"] = self._group(sig)
        labels["group_size"] = str(self._ranks.world_size)
        if self._ranks.tp_rank is not None:
            labels["tp_rank"] = str(self._ranks.tp_rank)
        if self._ranks.pp_rank is not None:
            labels["pp_rank"] = str(self._ranks.pp_rank)
        t0 = time.perf_counter()
        try:
            # Under the frame lock: the first free variant index. Another node (through a
            # remote tier) may take the same index at once; the loser moves on.
            for _ in range(MAX_VARIANTS):
                probe = self._free_variant(st, frame)
                if probe is None:
                    self._fault(f"{self.__qualname__} already has {MAX_VARIANTS} variants "
                                f"for [{describe(sig)}]; this one is not cached. "
                                "`cachectl explain` shows which guards differ")
                    return
                key = self._variant_key(frame, probe)
                labels["variant"] = str(probe)
                entry = st.put(key, files, labels=labels, meta=meta)
                if entry.meta.get("guards") == meta["guards"]:
                    break
        except (StoreError, OSError) as e:
            self._fault(f"publishing {frame.digest[:12]} failed ({e}); this process keeps its "
                        "live compile and the next one compiles again")
            return
        logger.info("cachecompile publish %s %s [%s]: compiled in %.1f s, stored in %.1f ms "
                    "(%d guards)", self.__qualname__, key.digest[:12], describe(sig), elapsed,
                    (time.perf_counter() - t0) * 1e3, len(trace.guards))

    def _free_variant(self, st: LocalStorage, frame: Key) -> int | None:
        """The lowest variant index with no entry (locally or in a remote tier); when
        every index is taken, the first one whose source files changed (it is removed)."""
        stale: Key | None = None
        for i in range(MAX_VARIANTS):
            key = self._variant_key(frame, i)
            if not st.contains(key) and not isinstance(st.get(key), Hit):
                return i
            if stale is None:
                try:
                    if deps_mod.changed(dict(st.manifest(key)["meta"]).get("deps", {})):
                        stale = key
                except (StoreError, OSError, KeyError, AttributeError):
                    continue
        if stale is not None and st.delete(stale):
            return int(stale.factors["variant"])
        return None

    def _run_live(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                  why: str) -> Any:
        from cachecompile.cold.capture import TraceSession

        if self._fallback is None:
            self._fallback = TraceSession(self._method, self._adapter, self._options,
                                          self._decompositions, self._dynamic, capture=False)
            self._fallback.on_recompile_limit = self._recompile_limit_hit
        self._add(sig, _Variant(run=self._fallback, check=None, name="live"), "live")
        logger.info("cachecompile live %s [%s]: %s", self.__qualname__, describe(sig), why)
        return self._fallback(*args, **kwargs)

    def _recompile_limit_hit(self, reason: str) -> None:
        """A live compile of this method passed Dynamo's recompile limit (capture.TraceSession
        then runs the call eagerly): say so once, naming the guard that keeps failing."""
        if self._limit_hit_warned:
            return
        self._limit_hit_warned = True
        warnings.warn(
            f"{self.__qualname__}: a value Dynamo guards changes on every call, so every "
            "call was a new compile, and Dynamo's recompile limit is reached. The guard that "
            f"failed last: {reason}. From now on a call that would need a new compile runs "
            "eagerly (uncompiled). Pass that value as a tensor, or make it dynamic "
            "(dynamic=True, or torch._dynamo.mark_dynamic), so that one compile serves every "
            "value", SignatureLimitWarning, stacklevel=user_stacklevel())

    # -- keys -------------------------------------------------------------------------
    def factors(self, sig: Signature) -> dict[str, Any]:
        if self._base is None:
            self._base = factors_mod.base_factors(
                self._method, options=self._options,
                backend={"name": self._adapter.name, **self._adapter.factors(self._options)},
                dynamic=self._dynamic, decompositions=self._decompositions, ranks=self._ranks,
                extra=self._extra)
        return {**self._base, "signature": to_json(sig)}

    def _graph_factors(self, sig: Signature) -> dict[str, Any]:
        """What a shared graph's program depends on beyond the graph (coop.GRAPH_FACTORS)."""
        f = self.factors(sig)
        marks = input_marks(sig)
        return {**f, "input_marks": to_json(tuple(marks))} if marks else f

    def _group(self, sig: Signature) -> str:
        """The rank group: every factor but this process's own ranks (world size stays)
        and the signature. Ranks of one job may each trace their own graph at their own
        shapes (pipeline stages, uneven shards); they are still evicted together, so a
        restart never finds some ranks warm and others cold."""
        f = self.factors(sig)
        f["ranks"] = {"world_size": f["ranks"]["world_size"]}
        f.pop("signature", None)
        # Each rank's shard has its own parameter shapes.
        f["module"] = {k: v for k, v in f["module"].items() if k != "layout"}
        return make_key(f).digest[:16]

    def _key(self, sig: Signature) -> Key:
        return make_key(self.factors(sig))

    def _nearest(self, st: LocalStorage, key: Key, sig: Signature) -> tuple[str, list[str]]:
        """' (nearest entry differs in: a, b)' for the miss log line, and those factors.
        Where the signature differs, both are shown: a stride, a size, an int's value."""
        try:
            near = nearest_entry(st, key.factors,
                                   {"model": type(self._method.__self__).__qualname__,
                                    "function": self._method.__name__},
                                   limit=NEAREST_CANDIDATES)
            theirs = (str(st.manifest(near.key)["labels"].get("signature", "?"))
                      if near is not None and "signature" in near.differ else None)
        except Exception:  # noqa: BLE001 - explaining a miss must never fail the call
            logger.debug("explaining a miss failed", exc_info=True)
            return "", []
        if near is None:
            return "", []
        names = near.differ[:NEAREST_NAMES]
        more = len(near.differ) - len(names)
        shown = [f"signature (the entry's [{theirs}], this call's [{describe(sig)}])"
                 if n == "signature" and theirs is not None else n for n in names]
        return (f" (nearest entry differs in: {', '.join(shown) or 'nothing?'}"
                f"{f' and {more} more' if more > 0 else ''})", list(near.differ))

    # -- helpers ----------------------------------------------------------------------
    def _fault(self, message: str) -> None:
        warnings.warn(f"cachecompile: {message}", CacheFaultWarning, stacklevel=user_stacklevel())
        logger.debug("cachecompile fault: %s", message)

    @staticmethod
    def _safe(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - bookkeeping must never fail a call
            logger.debug("store bookkeeping failed", exc_info=True)

    def __repr__(self) -> str:
        return (f"<cache_compile {self.__qualname__} backend={self._adapter.name} "
                f"dynamic={self._dynamic} signatures={len(self._runners)}>")
