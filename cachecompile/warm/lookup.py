"""Finding the entry that serves a call: walk a signature key's variants, load the first whose
guards hold.

A signature key (the method, its settings and the call signature) holds up to
``MAX_VARIANTS`` entries, one per set of guard values, at variant indexes 0, 1, ...
Looking them up reads each one's manifest (no file hashing), checks its format, its
traced source files, the operators its program calls and then its guards against this
call; the first that fits is verified, loaded and rebuilt into the method (no Dynamo, no
compiler). What did not fit is kept in a :class:`Probe`, so that the miss is counted and
explained by its first reason.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cachecompile.entry import checker as checker_mod
from cachecompile.entry import guard_tree
from cachecompile.entry.files import BYTECODE_FILE
from cachecompile.entry.guards import GuardMode
from cachecompile.entry.meta import EntryMeta
from cachecompile.errors import UnsupportedProgramError, fault
from cachecompile.key import deps as deps_mod
from cachecompile.key import passes as passes_mod
from cachecompile.key.identity import model_label
from cachecompile.key.signature import Signature, describe
from cachecompile.spec import CompileSpec
from cachecompile.store import Hit, Key, LocalStorage
from cachecompile.store.errors import StoreError
from cachecompile.warm import replay
from cachecompile.warm.chain import LIMIT, ChainEnd, Unusable, Vacated, VariantChain

if TYPE_CHECKING:
    from cachecompile.warm import frame_serving

logger = logging.getLogger(__name__)

# A signature key holds up to this many entries, each with its own guards; past it, new
# variants run with live torch.compile.
MAX_VARIANTS = LIMIT
# The miss log line compares with at most this many entries of the method (manifests
# only), and names at most this many of the factors the nearest one differs in.
NEAREST_CANDIDATES = 50
NEAREST_NAMES = 8


# Factors a miss line names in words beside their key path.
_FACTOR_WORDS = {
    "versions.cachecompile_code": "versions.cachecompile_code (cachecompile code changed: "
                                  "the entry was written by another release or a local edit)",
    "versions.cachecompile": "versions.cachecompile (another cachecompile release)",
}


class _Vacated(Exception):
    """The variant's entry was removed while being looked at (stale, corrupt)."""


@dataclasses.dataclass
class Variant:
    """One loaded entry (or live compile) serving calls of a signature while its check holds."""

    run: Callable[..., Any]
    check: Callable[..., bool] | None    # bound to the module; None: nothing to check per call
    name: str
    # The C++ guard tree alone: cheap, and may say no where ``check`` says yes. Where a
    # signature has several variants, every variant's is tried before any full check.
    fast: Callable[..., bool] | None = None
    # A loaded entry's guard checker (free of any instance): repeated blocks reuse it.
    checker: checker_mod.Checker | None = None
    # A graph break: the entry's other frames, loaded (warm.frame_serving).
    frames: frame_serving.Frames | None = None


@dataclasses.dataclass
class Probe:
    """What looking up a signature key's variants found."""

    runner: Variant | None = None
    free: int | None = None            # first unused variant index
    rejected: list[str] = dataclasses.field(default_factory=list)  # why each variant did not fit
    # Operators an entry's program calls that this process has not registered.
    missing_ops: list[str] = dataclasses.field(default_factory=list)
    # Why the first entry there did not serve (``cachectl stats`` counts misses by it):
    # guard, stale, format, operator, unloadable, corrupt, insecure; None: no entry.
    kind: str | None = None
    guard: str | None = None           # with kind "guard": what the failing guard is about
    guard_reason: str = ""             # ... and how it failed (the miss line's words)
    # For each subject a stored variant first failed on, the values those variants were
    # made for (a counter's steps: many; a flag changed once: one).
    guard_values: dict[str, set[str]] = dataclasses.field(default_factory=dict)

    def publish_key(self, sig_key: Key) -> Key:
        """The key a compile of this miss publishes under, which ``cachectl ls`` lists and
        the miss line names: the first free variant of ``sig_key`` (the signature's own key is
        never an entry's). With every index taken, the signature key: the publish then picks a
        stale slot, or publishes nothing, and its own line says which."""
        return sig_key if self.free is None else variant_key(sig_key, self.free)

    def reject(self, kind: str, why: str) -> None:
        self.rejected.append(why)
        self.first(kind)

    def first(self, kind: str) -> None:
        """Note why a variant did not serve; the first reason is the lookup's."""
        if self.kind is None:
            self.kind = kind


def variant_key(sig_key: Key, i: int) -> Key:
    """The key of variant ``i`` of a signature (:meth:`VariantChain.key_of`)."""
    return VariantChain.key_of(sig_key, i)


def specialised(wanted: str, dynamic: bool = True) -> str:
    """Why a tensor guard of an entry compiled with ``dynamic=True`` holds exact sizes,
    where ``wanted`` (the failing guard's value, as JSON) is one with sizes Dynamo made
    static: said in the miss reason, since the user asked for every size."""
    if not dynamic:
        return ""
    try:
        facts = json.loads(wanted)
    except ValueError:
        return ""
    sizes = facts.get("sizes") if isinstance(facts, dict) else None
    if not isinstance(sizes, list) or all(s is None for s in sizes):
        return ""
    from cachecompile.store.explain import SPECIALISED  # a miss's words, not a hit's import

    one = any(s in (0, 1) for s in sizes)
    return f"; {SPECIALISED}" + (", and a size of 0 or 1 is always specialised" if one else "")


def safely(fn: Callable[[], Any]) -> None:
    """Store bookkeeping (counters, pins): it must never fail a call."""
    try:
        fn()
    except Exception:  # bookkeeping must never fail a call
        logger.debug("store bookkeeping failed", exc_info=True)


def record_miss(st: LocalStorage, kind: str | None, about: str | None) -> None:
    """Count a lookup's miss once, by why the first entry there did not serve (``absent``
    when none was there), and what it was about: the failing guard's subject (bounded by
    the code, not values), or the factors the nearest entry differs in."""
    safely(lambda: st.record_miss(kind or "absent", about))


class Lookup:
    """The warm side of one cached method: its variants' lookup and loading."""

    def __init__(self, method: types.MethodType, spec: CompileSpec) -> None:
        self._method = method
        self._module = method.__self__
        self._spec = spec
        self._pins: list[Any] = []   # leases on loaded entries (eviction leaves them be)
        self._fetched: dict[str, Hit] = {}  # fetched for their meta, not yet loaded
        # When a variant's C++ tree is worth building: its variants differ by sizes only,
        # so one's build prices the next's.
        self._tree_cost = guard_tree.BuildCost()
        # The cold side a graph break's frames call when no stored variant serves them
        # (set by the cached method; None: such a frame runs as written).
        self.frame_compiler: frame_serving.FrameCompiler | None = None

    def probe(self, st: LocalStorage, sig_key: Key, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Probe:
        """Walk the signature key's variants in order; load the first whose guards hold."""
        out = Probe()
        self._fetched.clear()  # only this walk's fetches
        chain = VariantChain(st, sig_key)
        for i in range(LIMIT):
            key = chain.key(i)
            try:
                meta, fetched = chain.read(i)
            except ChainEnd:
                out.free = i if out.free is None else out.free
                return out
            except Vacated as v:
                # Quarantined by the store just now: the user hears of it once, as
                # promised, and the next publish refills this index.
                fault(f"{v}; it is quarantined and compiled again")
                out.free = i if out.free is None else out.free
                out.first(v.kind)
                continue
            except Unusable as u:
                fault(str(u))
                continue
            except (StoreError, OSError) as e:
                fault(f"looking up {key.digest[:12]} failed ({e})")
                return out
            if fetched is not None:
                # Fetched (a remote tier downloaded it): the variant's load uses this
                # outcome, so one lookup is one hit, not two.
                self._fetched[key.digest] = fetched
            try:
                runner = self._try_variant(st, key, meta, args, kwargs, out)
            except _Vacated as v:
                # Quarantined or removed just now: the next publish refills this index.
                out.free = i if out.free is None else out.free
                out.first(str(v))
                continue
            except Exception as e:  # any load fault degrades to a recompile
                logger.debug("loading entry failed", exc_info=True)
                fault(f"entry {key.digest[:12]} could not be loaded "
                      f"({type(e).__name__}: {e}); it is removed and recompiled")
                out.first("unloadable")
                safely(functools.partial(st.delete, key))
                out.free = i if out.free is None else out.free
                return out
            if runner is not None:
                out.runner = runner
                return out
        return out

    def _try_variant(self, st: LocalStorage, key: Key, raw: dict[str, Any],
                     args: tuple[Any, ...], kwargs: dict[str, Any], out: Probe) -> Variant | None:
        name = f"{key.digest[:12]} (variant {key.factors.get('variant')})"
        qualname = self._method.__qualname__
        adapter = self._spec.adapter
        try:
            meta = EntryMeta.from_json(raw)
        except UnsupportedProgramError as e:
            out.reject("format", f"{name}: {e}")
            return None
        if meta.adapter != adapter.name or not meta.is_method:
            out.reject("format", f"{name}: written by the {meta.adapter!r} adapter"
                                 f"{'' if meta.is_method else ' as a shared graph'}, "
                                 f"not {adapter.name!r}")
            return None
        if meta.frames and self._spec.fullgraph:
            # torch.compile(fullgraph=True) raises where this method's graph breaks.
            out.reject("format", f"{name}: its graph breaks (written with fullgraph=False)")
            return None
        changed = deps_mod.changed(dict(meta.deps))
        if changed:
            # Kept, not deleted: another checkout of the code (or a revert) may still
            # match it. Publishing reclaims stale variants when the chain is full.
            logger.info("cachecompile stale %s %s: source changed: %s", qualname,
                        name, ", ".join(changed[:3]))
            out.reject("stale", f"{name}: source changed ({', '.join(changed[:3])})")
            return None
        missing = passes_mod.missing_operators(meta.program.get("operators") or ())
        if missing:
            logger.info("cachecompile %s %s: its program calls %s, not registered here",
                        qualname, name, ", ".join(missing))
            out.reject("operator", f"{name}: operator {', '.join(missing)} is not registered")
            out.missing_ops.extend(m for m in missing if m not in out.missing_ops)
            return None
        func = self._method.__func__
        g = replay.replay_globals(func, meta.imports)  # type: ignore[arg-type]
        checker = checker_mod.build_checker(
            func, meta.guards, g,  # type: ignore[arg-type]
            every_call=self._spec.guards is GuardMode.ALWAYS, lines=meta.checker)
        if not checker.full(self._module, *args, **kwargs):
            reason, subject, wanted = (checker.failure(self._module, *args, **kwargs)
                                       or ("a guard failed", "a guard", ""))
            reason += specialised(wanted, self._spec.dynamic)
            if out.kind is None:
                out.guard, out.guard_reason = subject, reason
            out.guard_values.setdefault(subject, set()).add(wanted)
            out.reject("guard", f"{name}: guard failed: {reason}")
            return None
        outcome = self._fetched.pop(key.digest, None) or st.get(key)
        if not isinstance(outcome, Hit):
            if outcome.kind != "absent":
                fault(f"entry {key.digest[:12]} is unusable: {outcome.reason}")
            out.rejected.append(f"{name}: {outcome.reason}")
            raise _Vacated(outcome.kind)
        entry = outcome.entry
        # What was verified: the record read again from the entry ``get`` returned.
        loaded = EntryMeta.from_json(entry.meta)
        compiled_fn = (adapter.load(entry.files, dict(loaded.program))
                       if loaded.compiled_fn else None)
        frames = None
        if loaded.frames:
            # A graph break: the resume functions the bytecode calls and the callees it
            # reaches, each with its own guards (warm.frame_serving).
            signature_key = VariantChain.signature_of(key)
            # Imported here: a method whose graph never breaks does not load it.
            from cachecompile.warm import frame_serving

            frames = frame_serving.Frames(loaded, entry.files, adapter, self._spec.guards,
                                        self._tree_cost, qualname, st=st, key=signature_key,
                                        compiler=self.frame_compiler,
                                        labels=entry.labels)
            g.update(frames.names(loaded.resumes))
        bound = replay.rebuild(self._method, entry.files[BYTECODE_FILE].read_bytes(),
                               list(loaded.consts), g, loaded.compiled_fn, compiled_fn)
        try:
            self._pins.append(st.pin(entry))
        except Exception:  # a missing lease only weakens eviction safety
            logger.debug("could not pin entry", exc_info=True)
        check, fast = self.check_of(checker, alone=bool(loaded.guards))
        run = frames.wrap(bound) if frames is not None else bound
        return Variant(run=run, check=check, name=name, fast=fast, checker=checker,
                       frames=frames)

    def check_of(self, checker: checker_mod.Checker, alone: bool = True
                 ) -> tuple[Callable[..., bool], Callable[..., bool] | None]:
        """What runs on every call of a variant, bound to the module: every guard (ALWAYS),
        or the argument guards, with the state guards once more on the next call (FIRST);
        and the tree alone (ALWAYS), which dispatch tries first among several variants.
        ``alone`` False: no tree alone. An entry with no guard on the method's own frame
        (Dynamo skipped it; its frames carry the guards) holds for any call: answering
        before the signature (CachedFunction's last-variant shortcut), it would serve calls
        of other signatures, whose frames it has for other values, and compile them live."""
        m = self._module
        check = guard_tree.variant_check(checker, self._spec.guards, self._tree_cost)
        if isinstance(check, guard_tree.EveryCall):
            return types.MethodType(check, m), (types.MethodType(check.fast, m) if alone
                                                 else None)
        return types.MethodType(check, m), None

    def nearest(self, st: LocalStorage, key: Key, sig: Signature) -> tuple[str, list[str]]:
        """' (nearest entry differs in: a, b)' for the miss log line, and those factors.
        Where the signature differs, both are shown: a stride, a size, an int's value."""
        # A miss's only: a warm process that hits never imports it.
        from cachecompile.store.explain import nearest as nearest_entry

        try:
            near = nearest_entry(st, key.factors,
                                 {"model": model_label(self._module),
                                  "function": self._method.__name__},
                                 limit=NEAREST_CANDIDATES)
            theirs = (str(st.manifest(near.key)["labels"].get("signature", "?"))
                      if near is not None and "signature" in near.differ else None)
        except Exception:  # explaining a miss must never fail the call
            logger.debug("explaining a miss failed", exc_info=True)
            return "", []
        if near is None:
            return "", []
        names = near.differ[:NEAREST_NAMES]
        more = len(near.differ) - len(names)
        shown = [f"signature (the entry's [{theirs}], this call's [{describe(sig)}])"
                 if n == "signature" and theirs is not None else _FACTOR_WORDS.get(n, n)
                 for n in names]
        return (f" (nearest entry differs in: {', '.join(shown) or 'nothing?'}"
                f"{f' and {more} more' if more > 0 else ''})", list(near.differ))
