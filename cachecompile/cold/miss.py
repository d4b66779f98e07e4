"""A miss, in order: lock -> look again -> trace -> verify -> publish.

Under the signature key's file lock (other processes wait, then load what this one
published), the variants are looked up again; then Dynamo and the adapter compile the
call (``capture.TraceSession``), which verifies the replayable program against the live
result on the first call; then the entry is written at the first free variant index. The
lock and a shared graph's lock are held in one ``ExitStack``, released in reverse order
whatever happens. This process keeps the live compile for the signature, so Dynamo can
still notice a recompile.

Deciding whether to publish at all is :class:`Churn`'s: a guard whose value changes on
every call would otherwise leave one entry per call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import linecache
import logging
import os
import re
import threading
import time
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from cachecompile._torch import dynamo
from cachecompile._torch import frame_hook as frame_hook
from cachecompile.cold import capture as capture_mod
from cachecompile.cold import frame_assembly, frame_capture
from cachecompile.cold.capture import Trace, TraceSession
from cachecompile.cold.compiling import Phases
from cachecompile.cold.frame_assembly import FrameCompile
from cachecompile.entry import writer
from cachecompile.entry.files import BYTECODE_FILE
from cachecompile.entry.frame_records import FrameRecord, graph_prefix, read_frames
from cachecompile.entry.meta import EntryMeta
from cachecompile.errors import (
    SignatureLimitWarning,
    UnsupportedProgramError,
    fault,
    user_stacklevel,
)
from cachecompile.key.identity import model_label
from cachecompile.key.signature import Signature, describe
from cachecompile.key.signature_key import SignatureKeys
from cachecompile.procs import coop
from cachecompile.spec import CompileSpec
from cachecompile.store import Entry, Key, LocalStorage
from cachecompile.store.errors import StoreError
from cachecompile.store.explain import guard_diff
from cachecompile.warm import frame_serving
from cachecompile.warm.chain import VariantChain
from cachecompile.warm.lookup import (
    MAX_VARIANTS,
    Lookup,
    Probe,
    Variant,
    record_miss,
)

logger = logging.getLogger(__name__)

# A guard whose subject forces more new variants than this in one process is taken for a
# value that changes on every call: later variants for it run live and are not published.
CHURN_LIMIT = 2


# Read-only stores this process has warned about (their roots): a read-only consumer's
# every miss compiles and publishes nothing, which it is told once, not once per miss.
_told_readonly: set[str] = set()
_told_lock = threading.Lock()


def _not_published(st: LocalStorage, qualname: str, sig: Signature) -> None:
    """Say that a compile was not published to the read-only ``st``: one warning per
    store and process, then an INFO line per signature (cachectl stats counts them)."""
    with _told_lock:
        first = str(st.root) not in _told_readonly
        _told_readonly.add(str(st.root))
    if first:
        fault(f"the cache at {st.root} is read-only; {qualname} [{describe(sig)}] was "
              "compiled but not published, nor will later misses be (said once per "
              "process; each is logged at INFO)")
    else:
        logger.info("cachecompile %s [%s]: compiled, not published (read-only cache %s)",
                    qualname, describe(sig), st.root)


# Labels the writer sets itself (entry.writer), and the signature's variant index.
_WRITER_LABELS = frozenset({"backend", "function", "code", "variant"})


class Outcome(enum.Enum):
    """How a signature's first call (or a new variant's) was served."""

    HIT = "hit"          # a stored entry, loaded
    MISS = "miss"        # compiled here (and published, when it could be)
    SHARED = "shared"    # compiled here, its graph's program loaded from another process
    LIVE = "live"        # plain torch.compile, nothing cached


@dataclasses.dataclass
class Served:
    """What a miss gave: the call's result and the variant that serves the signature now."""

    outcome: Outcome
    variant: Variant
    result: Any


class Churn:
    """Whether another variant is worth publishing: not once one guard's subject has
    forced more than CHURN_LIMIT new variants in this process, or the frame's stored
    variants that failed on it were made for more than CHURN_LIMIT of its values (a cache
    layer's position, a step counter).
    Each such entry would serve one call; publishing them fills the store and the frame's
    variant chain for nothing. The variant still runs here, as a live compile."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname
        self._forced: dict[str, int] = {}   # guard subject -> new variants it forced here
        self._warned = False

    def worth_publishing(self, probe: Probe, sig: Signature) -> bool:
        if probe.kind != "guard" or not probe.guard:
            return True
        here = self._forced[probe.guard] = self._forced.get(probe.guard, 0) + 1
        # Across processes too: the values the store's variants that failed on it were
        # made for. Variants made for other changes (train(), a hook) that all hold the
        # value this call no longer has are one value: a change made once, not churn.
        stored = len(probe.guard_values.get(probe.guard, ()))
        n = max(here, stored)
        if n <= CHURN_LIMIT:
            return True
        if not self._warned:
            self._warned = True
            how = (f"on call after call ({n} variants for it so far" if here >= stored else
                   f"in process after process ({stored} stored variants were made for other "
                   "values of it")
            warnings.warn(
                f"{self._qualname} [{describe(sig)}]: {probe.guard} has a new value {how}; "
                f"the guard: {probe.guard_reason}). New variants for it "
                "run with a live compile and are not cached (each would serve one call). "
                "Pass that value as a tensor, or make it dynamic (dynamic=True, or "
                "torch._dynamo.mark_dynamic), so that one entry serves every value",
                SignatureLimitWarning, stacklevel=user_stacklevel())
        logger.info("cachecompile %s [%s]: not publishing another variant for %s",
                    self._qualname, describe(sig), probe.guard)
        return False


class MissPath:
    """The cold side of one cached method."""

    def __init__(self, method: types.MethodType, spec: CompileSpec, keys: SignatureKeys,
                 lookup: Lookup, on_recompile_limit: Callable[[str], None]) -> None:
        self._method = method
        self._spec = spec
        self._keys = keys
        self._lookup = lookup
        self._on_recompile_limit = on_recompile_limit
        self._qualname = method.__qualname__
        self.churn = Churn(self._qualname)
        self._full_frames: set[str] = set()   # frames whose chain was full (said once)

    def run(self, st: LocalStorage, sig_key: Key, sig: Signature, args: tuple[Any, ...],
            kwargs: dict[str, Any], early: Mapping[str, float], *, publish: bool) -> Served:
        phases = Phases()
        for name, seconds in early.items():
            phases.add(name, seconds)
        t_lock = time.perf_counter()
        who = f"{self._qualname} [{self._spec.ranks.label()}, pid {os.getpid()}]"
        with contextlib.ExitStack() as held:
            if self._lock(held, st, sig_key, who):
                # Another process may have published while we waited for the lock.
                probe = self._lookup.probe(st, sig_key, args, kwargs)
                if probe.runner is not None:
                    return Served(Outcome.HIT, probe.runner, probe.runner.run(*args, **kwargs))
            phases.add("lock", time.perf_counter() - t_lock)
            share = None
            # Captured whole first (capture.LiveSession): a graph break drops the share,
            # as it compiles several graphs per call, and each rank compiles its own.
            if not st.readonly and self._spec.adapter.shares_graphs:
                share = coop.GraphShare(st, self._keys.graph_factors(sig), self._spec.adapter,
                                        who, model=model_label(self._method.__self__))
                held.callback(share.finish)
            session = TraceSession(self._method, self._spec, share=share, phases=phases)
            session.on_recompile_limit = self._on_recompile_limit
            t0 = time.perf_counter()
            result = session(*args, **kwargs)
            elapsed = time.perf_counter() - t0
            checker = session.checker
            # Dynamo guards its own live compile; our per-call check routes calls whose
            # arguments no longer fit to another variant, as a hit would.
            check, fast = (self._lookup.check_of(checker) if checker is not None
                           else (None, None))
            variant = Variant(run=session, name="live", check=check, fast=fast)
            served = Served(Outcome.SHARED if share is not None and share.shared
                            else Outcome.MISS, variant, result)
            if not publish:
                return served  # no entry to build: it would not be published
            try:
                with phases.timed("entry"):
                    trace = session.trace()
            except UnsupportedProgramError as e:
                fault(f"{self._qualname} [{describe(sig)}] is not cacheable: {e}. "
                      "It runs with live torch.compile in this process")
                return served
            if st.readonly:
                _not_published(st, self._qualname, sig)
                return served
            t_publish = time.perf_counter()
            if share is not None and trace.program is not None:
                share.publish(trace.program)
            self._publish(st, sig_key, sig, trace, elapsed, phases, who)
            phases.add("publish", time.perf_counter() - t_publish)
            logger.info("cachecompile cold phases %s [%s]: %s", self._qualname,
                        describe(sig), phases)
            labels = self._labels(sig_key, describe(sig), self._keys.group(sig))
            session.on_frames = lambda compiles: self.publish_frames(st, sig_key, labels,
                                                                     compiles)
            session.on_recompile = lambda reason: logger.info(
                "cachecompile: Dynamo recompiled %s [%s] in this process (%s); the stored "
                "entry keeps its own guards", self._qualname, describe(sig), reason)
            return served

    def _lock(self, held: contextlib.ExitStack, st: LocalStorage, sig_key: Key, who: str) -> bool:
        """The signature key's compile lock, held until ``held`` closes; False when read-only or
        when it cannot be had (then this process compiles without it)."""
        if st.readonly:
            return False
        try:
            held.enter_context(coop.held(st, sig_key.digest, who=who,
                                         purpose=f"entry {sig_key.digest[:12]} ({self._qualname})"))
        except (StoreError, OSError) as e:
            fault(f"could not take the compile lock for {sig_key.digest[:12]} ({e}); "
                  "compiling without it")
            return False
        return True

    def _publish(self, st: LocalStorage, sig_key: Key, sig: Signature, trace: Trace,
                 elapsed: float, phases: Phases, who: str) -> None:
        files: dict[str, Any] = dict(trace.program.files) if trace.program else {}
        files[BYTECODE_FILE] = trace.bytecode
        frames = trace.frames
        if frames is not None:
            # Every other frame of the call (entry.frame_records): codes, bytecode, graphs.
            files.update(frames.files)
            for i, program in enumerate(frames.programs):
                files.update({graph_prefix(i) + k: v for k, v in program.files.items()})
        meta = EntryMeta(
            adapter=self._spec.adapter.name,
            program=trace.program.meta if trace.program else {},
            imports=trace.imports, consts=trace.consts, compiled_fn=trace.compiled_fn_name,
            resumes=frames.resumes if frames is not None else {},
            frames=[f.to_json() for f in frames.records] if frames is not None else [],
            graphs=[p.meta for p in frames.programs] if frames is not None else [],
            deps=trace.deps, guards=trace.guards,
            # The checker's bodies, derived once here: a warm process loads them without
            # parsing a guard (entry.checker.build_checker's ``lines``).
            checker=trace.checker_lines,
            signature=describe(sig), compile_seconds=round(trace.compile_seconds, 3),
            first_call_seconds=round(elapsed, 3),
            # Where the cold first call's time went, up to the publish (cold.compiling.Phases).
            cold_phases=phases.rounded())
        labels = self._labels(sig_key, describe(sig), self._keys.group(sig))
        if meta.frames:
            labels["frames"] = str(meta.n_frames)   # cachectl ls: how many frames
        t0 = time.perf_counter()

        def write_at(key: Key, index: int) -> Entry:
            labels["variant"] = str(index)
            return writer.write(st, key, files, meta=meta, who=who,
                                function=self._method.__name__, labels=labels)

        try:
            # Under the signature key's lock: the first free variant index. Another node (through a
            # remote tier) may take the same index at once; the loser moves on.
            key = VariantChain(st, sig_key).publish(
                write_at, lambda theirs: _guards_of(theirs) == list(meta.guards))
        except (StoreError, OSError) as e:
            fault(f"publishing {sig_key.digest[:12]} failed ({e}); this process keeps its "
                  "live compile and the next one compiles again")
            return
        if key is None:
            fault(f"{self._qualname} already has {MAX_VARIANTS} variants "
                  f"for [{describe(sig)}]; this one is not cached. "
                  "`cachectl explain` shows which guards differ")
            return
        logger.info("cachecompile publish %s %s [%s]: compiled in %.1f s, stored in %.1f ms "
                    "(%d guards, %d frames)", self._qualname, key.digest[:12], describe(sig),
                    elapsed, (time.perf_counter() - t0) * 1e3, len(trace.guards),
                    meta.n_frames)

    def _labels(self, sig_key: Key, signature: str, group: str) -> dict[str, str]:
        """An entry's labels: what ``cachectl ls`` filters by, what gc evicts by."""
        spec = self._spec
        ranks = spec.ranks
        labels = {
            "model": model_label(self._method.__self__),
            "dynamic": str(spec.dynamic).lower(),
            "signature": signature,
            "ranks": ranks.label(),
            **({"cpu_target": spec.cpu_target} if spec.cpu_target else {}),
            "world_size": str(ranks.world_size),
            "global_rank": str(ranks.global_rank),
            "signature_key": sig_key.digest[:32],
            "group": group,
            "group_size": str(ranks.world_size),
        }
        if ranks.tp_rank is not None:
            labels["tp_rank"] = str(ranks.tp_rank)
        if ranks.pp_rank is not None:
            labels["pp_rank"] = str(ranks.pp_rank)
        return labels

    # -- a graph break's frames compiled after the signature's entry ----------------------
    def publish_frames(self, st: LocalStorage, sig_key: Key, labels: Mapping[str, str],
                       compiles: list[FrameCompile]) -> None:
        """Each frame Dynamo compiled after the signature's entry was made (a branch first
        taken, a frame whose stored guards failed), as a frame variant under the
        signature's key (warm.frame_serving.frame_variant_key), at its chain's first free index;
        an identical variant already there is left alone. A frame that cannot be stored is
        compiled live by each process that reaches it."""
        if st.readonly:
            return
        for c in compiles:
            try:
                assembled, why = frame_assembly.assemble_variant(c)
                if assembled is None:
                    logger.info("cachecompile %s [%s]: frame %s is not stored (%s)",
                                self._qualname, labels.get("signature", ""), c.code.co_name,
                                why)
                    continue
                self.publish_frame(st, sig_key, labels, assembled, capture_mod.frame_deps([c]))
            except Exception as e:  # publishing is extra: the call's result stands
                logger.debug("publishing a frame variant failed", exc_info=True)
                fault(f"{self._qualname}: a variant of frame {c.code.co_name} is not "
                      f"published ({type(e).__name__}: {e})")

    def publish_frame(self, st: LocalStorage, sig_key: Key, labels: Mapping[str, str],
                       assembled: frame_assembly.Assembled, deps: Mapping[str, str]) -> None:
        """One frame variant at its chain's first free index (or nowhere, where the
        same one is there already, or the store is read-only)."""
        if st.readonly:
            return
        changed = self._keys.changed_since(sig_key)
        if changed:
            # Compiled under settings the signature's key does not name: a process with the
            # key's settings must not be served it (it compiles its own, as torch.compile).
            logger.info("cachecompile %s [%s]: frame %s is not published (this process "
                        "changed %s since the signature's entry was looked up)",
                        self._qualname, labels.get("signature", ""),
                        assembled.records[0].name, ", ".join(changed))
            return
        who = f"{self._qualname} [{self._spec.ranks.label()}, pid {os.getpid()}]"
        signature = str(labels.get("signature", ""))
        head = assembled.records[0]
        files: dict[str, Any] = dict(assembled.files)
        for i, program in enumerate(assembled.programs):
            files.update({graph_prefix(i) + k: v for k, v in program.files.items()})
        meta = EntryMeta(
            adapter=self._spec.adapter.name, head=head.id,
            frames=[r.to_json() for r in assembled.records],
            graphs=[p.meta for p in assembled.programs], deps=dict(deps),
            signature=signature)
        frame_labels = {**{k: v for k, v in labels.items() if k not in _WRITER_LABELS},
                        "dynamo_frame": head.name[:200], "frames": "+1"}
        mine = [list(v.guards) for v in head.variants]
        stored: list[list[Any]] = []  # the last stored variant's guards compared

        def same(theirs_meta: Mapping[str, Any]) -> bool:
            try:
                theirs = read_frames(EntryMeta.from_json(theirs_meta).frames)[0]
            except (KeyError, IndexError, UnsupportedProgramError):
                return False
            stored[:] = [list(v.guards) for v in theirs.variants]
            return stored == mine and theirs.as_written == head.as_written

        def write_at(key: Key, index: int) -> Entry:
            entry = writer.write(st, key, files, meta=meta, who=who,
                                 function=self._method.__name__, labels=frame_labels)
            logger.info("cachecompile publish %s [%s]: frame %s, variant %d%s",
                        self._qualname, signature, head.name, index,
                        " (runs as written)" if head.as_written else "")
            return entry

        try:
            key = VariantChain(st, sig_key, head.id).publish(write_at, same)
        except (StoreError, OSError) as e:
            fault(f"publishing a variant of frame {head.name} failed ({e})")
            return
        if key is None:
            differs = _changed_guard(mine, stored)
            self._chain_full(head.name, signature, differs + _stack_note(head.name, differs))

    def _chain_full(self, name: str, signature: str, changed: str) -> None:
        """Said once per frame and process: its chain holds MAX_VARIANTS variants whose
        sources are current, so a new one is compiled live in every process."""
        if name in self._full_frames:
            return
        self._full_frames.add(name)
        fault(f"{self._qualname} [{signature}]: frame {name} already has {MAX_VARIANTS} "
              "published variants; this one is not stored, and each process that needs it "
              f"compiles it live. A value it reads changes from call to call ({changed}): "
              "pass it as a tensor, or make it fixed.")

    def compile_frame(self, frames: frame_serving.Frames, cont: frame_serving.Continuation,
                      why: str) -> _LiveFrame:
        """A continuation no stored variant serves, compiled live (``torch.compile`` of
        it), its frames captured and published after each call; one whose guards cannot be
        stored compiled live and published nowhere (frame_serving.FrameCompiler)."""
        fn = types.FunctionType(cont.code, frames.globals_of(cont.record), cont.code.co_name)
        capture = not cont.record.live and frames.st is not None and not frames.st.readonly
        # Said once per frame and process (a continuation compiles live once, then its
        # session serves it): what costs this process a compile, and why.
        why += _stack_note(cont.record.name, why)
        if cont.record.live:
            fault(f"{self._qualname} [{frames.signature}]: frame {cont.record.name} is "
                  f"compiled live in every process ({why})")
        else:
            fault(f"{self._qualname} [{frames.signature}]: frame {cont.record.name} is "
                  f"compiled live in this process ({why}); "
                  f"{'it is published for the next process (where the frame has a free variant slot)' if capture else 'not published: the store takes no writes'}")
        if frames.st is not None:
            # Counted by the frame (its qualified name), bounded by the code.
            short = cont.record.name.split(" (", 1)[0]
            record_miss(frames.st, "frame", f"{short}: "
                        f"{'live in every process' if cont.record.live else 'compiled'}")
        session = (frame_capture.FrameSession(fn, self._spec) if capture
                   else frame_capture.LiveFrameSession(fn, self._spec))
        return _LiveFrame(self, frames, cont.code, cont.record, session)


class _LiveFrame:
    """frame_serving.LiveFrame: a continuation under a live session; after each call, what
    Dynamo compiled for it is published, or, where it compiled nothing (Dynamo skips the
    frame), that it runs as written."""

    def __init__(self, miss: MissPath, frames: frame_serving.Frames, code: types.CodeType,
                 record: FrameRecord,
                 session: frame_capture.FrameSession | frame_capture.LiveFrameSession) -> None:
        self._miss = miss
        self._code = code
        self._record = record
        self._session = session
        self._st, self._key = frames.st, frames.key
        self._labels = frames.labels
        self.runs_as_written = False

    def __call__(self, *args: Any) -> Any:
        # Dynamo compiles every frame it meets in there itself: the frames this process
        # installed (callees) stay out, so no stored code runs under Dynamo's tracing.
        with frame_hook.not_serving():
            result = self._session(*args)
        late = self._session.take_late()
        if self._st is None or self._key is None:
            return result
        if late:
            self._miss.publish_frames(self._st, self._key, self._labels, late)
        elif dynamo.ran_as_written(self._code) and not self._record.live:
            # Dynamo met the frame and compiled nothing (it skips it): say so to every
            # other process, which then runs it as written without compiling.
            self.runs_as_written = True
            try:
                self._miss.publish_frame(
                    self._st, self._key, self._labels,
                    frame_assembly.assemble_as_written(self._code, self._record.module), {})
            except Exception:  # publishing is extra: the call's result stands
                logger.debug("publishing a frame that runs as written failed", exc_info=True)
        return result


def _guards_of(meta: Mapping[str, Any]) -> list[Any] | None:
    """The guards of a published entry's meta; None if it is not a record this code reads."""
    try:
        return list(EntryMeta.from_json(meta).guards)
    except UnsupportedProgramError:
        return None


def _changed_guard(mine: list[list[Any]], stored: list[list[Any]]) -> str:
    """What tells this frame's new variant from a stored one, in the user's terms: the
    first guard whose value differs (``n == 17`` here, ``n == 3`` stored)."""
    if mine and stored:
        diff = guard_diff({"meta": {"guards": [dict(g) for g in mine[0]]}},
                          {"meta": {"guards": [dict(g) for g in stored[0]]}})
        if diff.changed:
            here, there = diff.changed[0]
            return f"`{here}` here, `{there}` in a stored variant"
    return "`cachectl explain` shows which guards differ"


_AT = re.compile(r"\((?P<file>.+):(?P<line>\d+)\)$")
_STACK = re.compile(r"\b___stack\d+\b")


def _stack_note(frame: str, text: str) -> str:
    """What a guard on ``___stackN`` reads, where ``text`` names one: a resume frame's
    argument, a value Python's stack held at the break (Dynamo's guard source knows no
    more), shown with the break's line (the frame's name ends ``(FILE:LINE)``):
    ``; ___stack0 is a value on Python's stack at the break, line 8: `k = n.item()` ``."""
    names = sorted(set(_STACK.findall(text)))
    at = _AT.search(frame)
    if not names or at is None:
        return ""
    line = linecache.getline(at["file"], int(at["line"])).strip()
    return (f"; {' and '.join(names)} {'is a value' if len(names) == 1 else 'are values'} "
            f"on Python's stack at the break, line {at['line']}" + (f": `{line}`" if line else ""))
