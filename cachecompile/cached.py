"""The cached method: per-call signature dispatch, and the hit / miss / degrade flow.

First call of a signature:

1. key = the method's base factors (computed once) + the signature;
2. store hit -> rebuild the method from the entry (no Dynamo, no compiler) and run it;
3. miss -> under the key's file lock (other processes wait, then load), compile with
   Dynamo + the adapter, run, verify the replayable program against the live result,
   publish; this process keeps the live ``torch.compile`` for that signature so that
   Dynamo can still notice a recompile (then the entry is withdrawn, as TorchAir does).

Any cache fault (store error, unloadable entry, non-replayable program) is one
``CacheFaultWarning`` and a live compile: never a crash, never a wrong result.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

import store as store_pkg
from store import Hit, Key, make_key
from store.errors import StoreError

from . import coop, replay
from . import deps as deps_mod
from . import factors as factors_mod
from .backends.base import Adapter
from .errors import (
    CacheFaultWarning,
    InferenceOnlyError,
    RecompileWarning,
    SignatureLimitWarning,
    UnsupportedProgramError,
)
from .ranks import Ranks
from .signature import Signature, describe, requires_grad, signature, to_json

logger = logging.getLogger(__name__)

BYTECODE_FILE = "bytecode.bin"
_stores: dict[tuple[str | None, bool], Any] = {}
_stores_lock = threading.Lock()


def _open_store(cache_dir: str | None) -> Any:
    """One store object per root and process (opening sweeps temp dirs: do it once)."""
    readonly = os.environ.get("CACHECOMPILE_READONLY", "").lower() in ("1", "true", "yes")
    root = cache_dir if cache_dir is not None else str(store_pkg.default_root())
    with _stores_lock:
        k = (root, readonly)
        st = _stores.get(k)
        if st is None:
            st = store_pkg.open_store(root, readonly=readonly)
            _stores[k] = st
        return st


class _Stale(Exception):
    pass




class CachedFunction:
    """What ``cache_compile`` returns. Call it like the method it wraps."""

    def __init__(self, method: types.MethodType, *, adapter: Adapter, options: Mapping[str, Any],
                 dynamic: bool, cache_dir: str | None, ranks: Ranks,
                 decompositions: Mapping[Any, Any] | None, max_signatures: int,
                 enabled: bool, extra_factors: Mapping[str, Any] | None = None) -> None:
        self._method = method
        self._adapter = adapter
        self._options = dict(options)
        self._dynamic = dynamic
        self._cache_dir = cache_dir
        self._ranks = ranks
        self._decompositions = decompositions
        self._max_signatures = max_signatures
        self._enabled = enabled
        self._extra = extra_factors
        self._runners: dict[Signature, Callable[..., Any]] = {}
        self._base: dict[str, Any] | None = None
        self._fallback: Any = None
        self._limit_warned = False
        self._pins: list[Any] = []
        self._lock = threading.RLock()
        self.__wrapped__ = method
        self.__name__ = method.__name__
        self.__qualname__ = method.__qualname__
        self.__doc__ = method.__doc__
        # Outcome of each signature's first call: "hit", "miss", "live" (for tests, logs).
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

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sig = signature(args, kwargs, self._dynamic)
        runner = self._runners.get(sig)
        if runner is not None:
            return runner(*args, **kwargs)
        with self._lock:
            runner = self._runners.get(sig)
            if runner is not None:
                return runner(*args, **kwargs)
            return self._first_call(sig, args, kwargs)

    # -- first call of a signature ----------------------------------------------------
    def _first_call(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._enabled:
            return self._run_live(sig, args, kwargs, "disabled")
        if not self._dynamic and len(self._runners) >= self._max_signatures:
            if not self._limit_warned:
                self._limit_warned = True
                warnings.warn(
                    f"{self.__qualname__}: more than {self._max_signatures} static signatures "
                    f"(dynamic=False); new ones run with live torch.compile and are not "
                    "cached. Use dynamic=True, pad inputs to fewer sizes, or raise "
                    "max_signatures.", SignatureLimitWarning, stacklevel=4)
            return self._run_live(sig, args, kwargs, "over signature limit")
        t0 = time.perf_counter()
        try:
            key = self._key(sig)
        except Exception as e:  # noqa: BLE001 - an unkeyable call is a fault, not a crash
            logger.debug("computing the key failed", exc_info=True)
            self._fault(f"computing the cache key failed ({type(e).__name__}: {e})")
            return self._run_live(sig, args, kwargs, "no key")
        try:
            st = _open_store(self._cache_dir)
        except (StoreError, OSError) as e:
            self._fault(f"the cache store is unusable ({e})")
            return self._run_live(sig, args, kwargs, "store unusable")
        runner = self._try_load(st, key, sig)
        if runner is not None:
            self._runners[sig] = runner
            self.events.append(("hit", describe(sig)))
            logger.info("cachecompile hit %s %s [%s] loaded in %.1f ms", self.__qualname__,
                        key.digest[:12], describe(sig), (time.perf_counter() - t0) * 1e3)
            return runner(*args, **kwargs)
        return self._compile(st, key, sig, args, kwargs)

    def _try_load(self, st: Any, key: Key, sig: Signature,
                  quiet: bool = False) -> Callable[..., Any] | None:
        try:
            outcome = st.get(key)
        except (StoreError, OSError) as e:
            self._fault(f"looking up {key.digest[:12]} failed ({e})")
            return None
        if not isinstance(outcome, Hit):
            if outcome.kind == "absent":
                if quiet:
                    return None
                logger.info("cachecompile miss %s %s [%s]: %s%s", self.__qualname__,
                            key.digest[:12], describe(sig), outcome.reason, self._nearest(st, key))
            else:
                self._fault(f"entry {key.digest[:12]} is unusable: {outcome.reason}")
            return None
        entry = outcome.entry
        try:
            return self._load(st, entry)
        except _Stale as e:
            logger.info("cachecompile stale %s %s: %s", self.__qualname__, key.digest[:12], e)
            self._safe(lambda: st.record_miss("stale"))
            self._safe(lambda: st.delete(key))
            return None
        except Exception as e:  # noqa: BLE001 - any load fault degrades to a recompile
            logger.debug("loading entry failed", exc_info=True)
            self._fault(f"entry {key.digest[:12]} could not be loaded "
                        f"({type(e).__name__}: {e}); it is removed and recompiled")
            self._safe(lambda: st.record_miss("unloadable"))
            self._safe(lambda: st.delete(key))
            return None

    def _load(self, st: Any, entry: Any) -> Callable[..., Any]:
        meta = entry.meta
        if meta.get("format") != factors_mod.FORMAT_VERSION or meta.get("adapter") != self._adapter.name:
            raise UnsupportedProgramError(f"entry format {meta.get('format')!r} / adapter "
                                          f"{meta.get('adapter')!r} does not fit")
        changed = deps_mod.changed(meta.get("deps", {}))
        if changed:
            raise _Stale("source changed: " + ", ".join(changed[:3]))
        compiled_fn = self._adapter.load(entry.files, meta["program"])
        bound = replay.rebuild(self._method, entry.files[BYTECODE_FILE].read_bytes(),
                               meta["imports"], meta["compiled_fn"], compiled_fn)
        try:
            self._pins.append(st.pin(entry))
        except Exception:  # noqa: BLE001 - a missing lease only weakens eviction safety
            logger.debug("could not pin entry", exc_info=True)
        return bound

    def _compile(self, st: Any, key: Key, sig: Signature, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        from .capture import TraceSession

        lock: Any = None
        readonly = isinstance(st, store_pkg.ReadOnlyStore)
        who = f"{self.__qualname__} [{self._ranks.label()}, pid {os.getpid()}]"
        if not readonly:
            try:
                lock = coop.held(st, key.digest, who=who,
                                 purpose=f"entry {key.digest[:12]} ({self.__qualname__})")
                lock.__enter__()
            except (StoreError, OSError) as e:
                self._fault(f"could not take the compile lock for {key.digest[:12]} ({e}); "
                            "compiling without it")
                lock = None
        share = (coop.GraphShare(st, self.factors(sig), self._adapter, who,
                                 factors_mod.FORMAT_VERSION) if not readonly else None)
        try:
            if lock is not None:
                # Another process may have published while we waited for the lock.
                runner = self._try_load(st, key, sig, quiet=True)
                if runner is not None:
                    self._runners[sig] = runner
                    self.events.append(("hit", describe(sig)))
                    return runner(*args, **kwargs)
            session = TraceSession(self._method, self._adapter, self._options,
                                   self._decompositions, self._dynamic, share=share)
            t0 = time.perf_counter()
            result = session(*args, **kwargs)
            elapsed = time.perf_counter() - t0
            self._runners[sig] = session
            self.events.append(("shared" if share is not None and share.shared else "miss",
                                describe(sig)))
            try:
                trace = session.trace()
            except UnsupportedProgramError as e:
                self._fault(f"{self.__qualname__} [{describe(sig)}] is not cacheable: {e}. "
                            "It runs with live torch.compile in this process")
                return result
            if readonly:
                self._fault(f"the cache at {st.root} is read-only; {self.__qualname__} "
                            f"[{describe(sig)}] was compiled but not published")
                return result
            if share is not None:
                share.publish(trace.program, self._adapter.name, factors_mod.FORMAT_VERSION)
            self._publish(st, key, sig, trace, elapsed)
            session.on_recompile = lambda reason: self._withdraw(st, key, sig, reason)
            return result
        finally:
            if share is not None:
                share.finish()
            if lock is not None:
                lock.__exit__(None, None, None)

    def _publish(self, st: Any, key: Key, sig: Signature, trace: Any, elapsed: float) -> None:
        files: dict[str, Any] = dict(trace.program.files)
        files[BYTECODE_FILE] = trace.bytecode
        meta = {
            "format": factors_mod.FORMAT_VERSION,
            "adapter": self._adapter.name,
            "program": trace.program.meta,
            "imports": trace.imports,
            "compiled_fn": trace.compiled_fn_name,
            "deps": trace.deps,
            "signature": describe(sig),
            "compile_seconds": round(trace.compile_seconds, 3),
            "first_call_seconds": round(elapsed, 3),
        }
        module = self._method.__self__
        labels = {
            "model": type(module).__qualname__,
            "function": self._method.__name__,
            "dynamic": str(self._dynamic).lower(),
            "signature": describe(sig),
            "ranks": self._ranks.label(),
            "world_size": str(self._ranks.world_size),
            "global_rank": str(self._ranks.global_rank),
            "backend": self._adapter.name,
        }
        labels["group"] = self._group(sig)
        labels["group_size"] = str(self._ranks.world_size)
        if self._ranks.tp_rank is not None:
            labels["tp_rank"] = str(self._ranks.tp_rank)
        if self._ranks.pp_rank is not None:
            labels["pp_rank"] = str(self._ranks.pp_rank)
        t0 = time.perf_counter()
        try:
            st.put(key, files, labels=labels, meta=meta)
        except (StoreError, OSError) as e:
            self._fault(f"publishing {key.digest[:12]} failed ({e}); this process keeps its "
                        "live compile and the next one compiles again")
            return
        logger.info("cachecompile publish %s %s [%s]: compiled in %.1f s, stored in %.1f ms",
                    self.__qualname__, key.digest[:12], describe(sig), elapsed,
                    (time.perf_counter() - t0) * 1e3)

    def _withdraw(self, st: Any, key: Key, sig: Signature, reason: str) -> None:
        warnings.warn(
            f"{self.__qualname__} [{describe(sig)}] was traced twice by Dynamo ({reason}); "
            "its cache entry is withdrawn and this process goes on with live torch.compile. "
            "Something the cache key does not see (a global, an attribute changed after "
            "the first call) changes the graph: make it an argument or a module attribute "
            "set before the first call.", RecompileWarning, stacklevel=2)
        self._safe(lambda: st.delete(key))
        self._safe(lambda: st.record_miss("recompile"))

    def _run_live(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                  why: str) -> Any:
        from .capture import TraceSession

        if self._fallback is None:
            self._fallback = TraceSession(self._method, self._adapter, self._options,
                                          self._decompositions, self._dynamic, capture=False)
        self._runners[sig] = self._fallback
        self.events.append(("live", describe(sig)))
        logger.info("cachecompile live %s [%s]: %s", self.__qualname__, describe(sig), why)
        return self._fallback(*args, **kwargs)

    # -- keys -------------------------------------------------------------------------
    def factors(self, sig: Signature) -> dict[str, Any]:
        if self._base is None:
            self._base = factors_mod.base_factors(
                self._method, adapter=self._adapter, options=self._options,
                dynamic=self._dynamic, decompositions=self._decompositions, ranks=self._ranks,
                extra=self._extra)
        return {**self._base, "signature": to_json(sig)}

    def _group(self, sig: Signature) -> str:
        """The rank group: every factor but this process's own ranks (world size stays)."""
        f = self.factors(sig)
        f["ranks"] = {"world_size": f["ranks"]["world_size"]}
        return make_key(f).digest[:16]

    def _key(self, sig: Signature) -> Key:
        return make_key(self.factors(sig))

    def _nearest(self, st: Any, key: Key) -> str:
        """' (differs from nearest entry in: a, b)' for the miss log line."""
        try:
            candidates = st.find(model=type(self._method.__self__).__qualname__,
                                 function=self._method.__name__)
            best: tuple[int, list[str]] | None = None
            for info in candidates[:50]:
                # The manifest alone: a get() would hash every file of every candidate
                # and count a hit on each, just to word a log line.
                try:
                    factors = st.manifest(info.key)["factors"]
                except (StoreError, OSError, KeyError):
                    continue
                diff = _diff(key.factors, factors)
                if best is None or len(diff) < best[0]:
                    best = (len(diff), diff)
            if best is None:
                return ""
            return f" (nearest entry differs in: {', '.join(best[1]) or 'nothing?'})"
        except Exception:  # noqa: BLE001 - explaining a miss must never fail the call
            logger.debug("explaining a miss failed", exc_info=True)
            return ""

    # -- helpers ----------------------------------------------------------------------
    def _fault(self, message: str) -> None:
        warnings.warn(f"cachecompile: {message}", CacheFaultWarning, stacklevel=5)
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


def _diff(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        if isinstance(va, Mapping) and isinstance(vb, Mapping) and not prefix:
            out.extend(_diff(va, vb, f"{k}."))
        else:
            out.append(prefix + k)
    return out
