"""A graph-breaking method's other frames, served in a warm process without Dynamo.

A loaded entry's method bytecode (warm.replay) calls resume functions by generated global
names (``__resume_at_118_3``). Here each name is bound, in the bytecode that calls it
(:func:`replay.bound_code`), to a :class:`Continuation`: it checks the guards of each
stored variant of that frame on every call, as Dynamo checks its cache entries, and runs
the first variant whose guards hold (its transformed bytecode, bound in turn and run in
its module's own globals, whose graphs are the adapter's loaded programs).

Where does a frame's variant come from? The signature's entry holds the variants Dynamo
compiled during the call that made it; a frame compiled later, in any process (a branch
first taken there, a frame whose guards failed), is published as a *frame variant*: an
entry of its own under the signature's key plus the frame's id, a chain 0, 1, ... like a
signature's variants (:class:`~cachecompile.warm.chain.VariantChain`). A call that no
loaded variant serves walks that chain (:meth:`Frames.from_chain`); if nothing there serves it either, the frame is
compiled live and published (:class:`FrameCompiler`, the cold side), or, where nothing may be
compiled, the continuation's own code runs as written: what Dynamo generated for the rest
of the method, in its module, so the result is eager's, never a program run on guards
that do not hold. A frame whose guards could not be stored (``FrameRecord.live``) is
compiled live in every process that reaches it, never published.

A callee (a function the eager code between graphs calls, whose frame Dynamo compiled:
``self.attn(x)`` whose ``forward`` breaks inside) is reached by no name of ours. Its
variants (the entry's and its chain's) are installed in Dynamo's run-only frame hook
(:mod:`cachecompile._torch.frame_hook`) on its live code object, with cachecompile's own guard
check, and the method runs under that hook: a callee whose guards hold runs its stored
code, any other frame runs as written. Nothing is traced or compiled, and
``torch._dynamo`` is not imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from cachecompile._torch import frame_hook
from cachecompile.backends.base import Adapter
from cachecompile.entry import checker as checker_mod
from cachecompile.entry import codeobj, frame_records, guard_tree
from cachecompile.entry.frame_records import FrameRecord, FrameVariant
from cachecompile.entry.guards import GuardMode
from cachecompile.entry.meta import EntryMeta
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key import deps as deps_mod
from cachecompile.key.identity import code_digest
from cachecompile.store import Hit, Key, LocalStorage
from cachecompile.warm import replay
from cachecompile.warm.chain import LIMIT, ChainEnd, Unusable, Vacated, VariantChain

logger = logging.getLogger(__name__)

def module_globals(name: str) -> dict[str, Any]:
    """The globals of the module a frame's code belongs to (imported if it is not yet)."""
    mod = sys.modules.get(name)
    if mod is None:
        mod = importlib.import_module(name)
    return vars(mod)


class LiveFrame(Protocol):
    """A continuation compiled live (what :class:`FrameCompiler` returns): run on each call
    no stored variant serves; it captures and publishes what Dynamo compiles for it."""

    # Dynamo met the frame and compiled nothing (it skips it): run it as written from now on.
    runs_as_written: bool

    def __call__(self, *args: Any) -> Any: ...


class FrameCompiler(Protocol):
    """The cold side, handed to a loaded entry by its cached method: asked for a
    continuation that no stored variant serves, it returns a :class:`LiveFrame`, or None
    where nothing may be compiled in this process (the frame then runs as written). It
    reads the frame (``frames``, ``cont``) and writes nothing of them. Imported on first
    use, as a signature's miss is."""

    def compile_frame(self, frames: Frames, cont: Continuation, why: str
                      ) -> LiveFrame | None: ...


class _Loaded:
    """One variant of a frame, loaded: its check over the frame's names, and its code with
    its generated names bound (:func:`replay.bound_code`), run in the frame's module's own
    globals, where its writes land."""

    __slots__ = ("check", "checker", "code", "fn", "globals", "name")

    def __init__(self, check: Callable[..., bool], checker: checker_mod.Checker,
                 code: types.CodeType, g: replay.ReplayGlobals, name: str) -> None:
        self.check = check
        self.checker = checker
        self.code = replay.bound_code(code, g)
        self.globals = g.module_globals
        self.name = name
        # Built once where no closure comes with each call.
        self.fn = (types.FunctionType(self.code, self.globals, name)
                   if not code.co_freevars else None)


class _Source:
    """One entry's files and graphs (the signature's entry, or a frame variant's)."""

    def __init__(self, files: Mapping[str, Path], graphs: Sequence[Mapping[str, Any]],
                 adapter: Adapter) -> None:
        self.files = files
        self._meta = list(graphs)
        self._adapter = adapter
        self._loaded: dict[int, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def graph(self, i: int) -> Callable[..., Any]:
        """Graph ``i``'s program, loaded once."""
        fn = self._loaded.get(i)
        if fn is None:
            with self._lock:
                fn = self._loaded.get(i)
                if fn is None:
                    if not 0 <= i < len(self._meta):
                        raise UnsupportedProgramError(f"the entry has no graph {i}")
                    fn = self._adapter.load(frame_records.graph_files(self.files, i), dict(self._meta[i]))
                    self._loaded[i] = fn
        return fn


@dataclasses.dataclass(frozen=True)
class _Published:
    """A variant of a frame's chain, read and its guards built, not yet loaded."""

    index: int
    key: Key
    meta: EntryMeta
    records: tuple[FrameRecord, ...]
    fetched: Hit | None
    guards: tuple[replay.ReplayGlobals, checker_mod.Checker]


class Continuation:
    """A resume function of a loaded entry, standing where the calling bytecode loads it.

    Its code has free variables when the method's frame had cells: Dynamo's bytecode then
    loads a factory and calls it with the closure (:meth:`factory`)."""

    def __init__(self, frames: Frames, record: FrameRecord, code: types.CodeType,
                 source: _Source) -> None:
        self._frames = frames
        self.record = record
        self.code = code
        self._source = source
        self._variants: list[_Loaded] | None = None
        self._lock = threading.Lock()
        self._eager: types.FunctionType | None = None
        self._told = False
        self.probed = 0             # the frame variant chain is walked from here
        # Variants of the chain walked before whose guards did not hold for that call,
        # checked again by later calls (another value may be theirs).
        self.passed: list[_Published] = []
        self.live: LiveFrame | None = None   # the live compile, once one was needed
        self._no_compile = False    # the compiler said nothing may be compiled here
        # Dynamo runs this frame as written (it skips it): so does this process.
        self.as_written = record.as_written
        # Outcome counts of this process (tests, logs): stored variant, compiled live
        # here, as written.
        self.served = 0
        self.compiled = 0
        self.unserved = 0

    def variants(self) -> list[_Loaded]:
        """The stored variants, loaded on the frame's first call (checker, bytecode). One
        that does not load is left out (logged): the call goes on to the frame's chain, a
        live compile or the code as written, never to a raw error in the user's call."""
        v = self._variants
        if v is None:
            with self._lock:
                if self._variants is None:
                    loaded = []
                    for i, var in enumerate(self.record.variants):
                        try:
                            loaded.append(self._frames.load_variant(self.record, self.code,
                                                                    var, self._source))
                        except Exception as e:  # a cache fault is a miss
                            logger.info("cachecompile %s: variant %d of frame %s did not "
                                        "load (%s: %s)", self._frames.qualname, i,
                                        self.record.name, type(e).__name__, e)
                    self._variants = loaded
                v = self._variants
        return v

    def add(self, loaded: _Loaded) -> None:
        with self._lock:
            self._variants = [*(self._variants or []), loaded]

    def __call__(self, *args: Any) -> Any:
        for v in self.variants():
            if v.check(*args):
                self.served += 1
                assert v.fn is not None
                return v.fn(*args)
        return self._unserved(args, None)

    def factory(self, closure: tuple[Any, ...]) -> Callable[..., Any]:
        """What Dynamo's factory returns for a continuation with free variables: this
        frame over ``closure``."""
        def run(*args: Any) -> Any:
            values = (*args, *(c.cell_contents for c in closure))
            for v in self.variants():
                if v.check(*values):
                    self.served += 1
                    return types.FunctionType(v.code, v.globals, v.name, None,
                                              closure)(*args)
            return self._unserved(args, closure)
        return run

    def why_unserved(self, args: tuple[Any, ...],
                     closure: tuple[Any, ...] | None = None) -> str:
        """Why no loaded variant serves a call, in words (the first variant's failing
        guard): for the log line of a frame compiled live or run as written."""
        if self.record.live:
            return f"its guards cannot be stored: {self.record.live}"
        if self.as_written:
            return "Dynamo runs it as written too (it skips the frame)"
        loaded = self._variants or []
        if not loaded:
            return "no stored variant"
        values = (*args, *(c.cell_contents for c in closure or ()))
        failed = loaded[0].checker.failure(*values)
        return (f"no stored variant's guards hold; the first's: "
                f"{failed[0] if failed else 'a guard failed'}")

    def _unserved(self, args: tuple[Any, ...], closure: tuple[Any, ...] | None) -> Any:
        """No loaded variant holds: one from the frame's chain, a live compile, or the
        continuation as Dynamo generated it, run as written in its module."""
        frames = self._frames
        if closure is None and not self.as_written:
            if not self.record.live:
                # Once a live compile serves this frame, only the variants walked already
                # are checked (the chain's free slot is not read again on every call).
                found = frames.from_chain(self, args, walk=self.live is None)
                if found is not None:
                    self.served += 1
                    assert found.fn is not None
                    return found.fn(*args)
            if self.live is None and frames.compiler is not None and not self._no_compile:
                self.live = frames.compiler.compile_frame(frames, self, self.why_unserved(args))
                self._no_compile = self.live is None
            if self.live is not None:
                self.compiled += 1
                result = self.live(*args)
                self.as_written = self.live.runs_as_written
                return result
        self.unserved += 1
        if not self._told:
            self._told = True
            logger.info("cachecompile %s: frame %s runs as written (%s)",
                        frames.qualname, self.record.name, self.why_unserved(args, closure))
        if closure is not None:
            return types.FunctionType(self.code, frames.globals_of(self.record),
                                      self.code.co_name, None, closure)(*args)
        fn = self._eager
        if fn is None:
            fn = self._eager = types.FunctionType(self.code, frames.globals_of(self.record),
                                                  self.code.co_name)
        return fn(*args)


class Frames:
    """The frames of one loaded entry (``EntryMeta.frames``), ready to run.

    ``st`` and ``key``: the store and the signature's key, where frame variants published
    later are found (:meth:`from_chain`); ``compiler``: the cold side, which compiles a frame no
    stored variant serves (None: such a frame runs as written)."""

    def __init__(self, meta: EntryMeta, files: Mapping[str, Path], adapter: Adapter,
                 mode: GuardMode, cost: guard_tree.BuildCost | None, qualname: str, *,
                 st: LocalStorage | None = None, key: Key | None = None,
                 compiler: FrameCompiler | None = None,
                 labels: Mapping[str, str] | None = None
                 ) -> None:
        self.qualname = qualname
        self.signature = meta.signature
        # The signature entry's labels: a frame variant published from here carries them.
        self.labels: dict[str, str] = dict(labels or {})
        self._adapter = adapter
        self._mode = mode
        self._cost = cost
        self.st = st
        self.key = key
        self.compiler = compiler
        self._lock = threading.RLock()
        self._pins: list[Any] = []
        self.records: dict[str, FrameRecord] = {}
        self.continuations: dict[str, Continuation] = {}
        self.callees: list[str] = []        # the callee frames installed in the hook
        self.callee_served: dict[str, int] = {}   # calls a stored callee variant ran
        source = _Source(files, meta.graphs, adapter)
        self._merge(frame_records.read_frames(meta.frames), source)
        for r in list(self.records.values()):
            if r.kind == frame_records.CALLEE:
                try:
                    self._install(r, source)
                except Exception as e:  # a callee that does not install runs as written
                    logger.info("cachecompile %s: frame %s runs as written (%s: %s)",
                                qualname, r.name, type(e).__name__, e)

    def _merge(self, records: Sequence[FrameRecord], source: _Source) -> None:
        """Frame records of an entry: a resume frame not known yet becomes a continuation
        (its code from ``source``); a known one keeps its own."""
        for r in records:
            if r.id in self.records:
                continue
            self.records[r.id] = r
            if r.kind == frame_records.RESUME:
                code = codeobj.loads(source.files[r.code].read_bytes(), list(r.code_consts))
                self.continuations[r.id] = Continuation(self, r, code, source)

    # -- names the bytecode loads ---------------------------------------------------------
    def names(self, resumes: Mapping[str, str]) -> dict[str, Any]:
        """What each ``__resume_at_*`` name a frame's bytecode loads stands for here."""
        out: dict[str, Any] = {}
        for name, fid in resumes.items():
            c = self.continuations.get(fid)
            if c is None:
                raise UnsupportedProgramError(f"{name} names no resume frame of the entry")
            out[name] = c.factory if c.code.co_freevars else c
        return out

    def globals_of(self, record: FrameRecord) -> dict[str, Any]:
        return module_globals(record.module)

    # -- a variant, loaded ----------------------------------------------------------------
    def _guards(self, record: FrameRecord, code: types.CodeType, var: FrameVariant
                ) -> tuple[replay.ReplayGlobals, checker_mod.Checker]:
        """A variant's private globals (its module references) and its guard checker."""
        g = replay.ReplayGlobals(self.globals_of(record), {})
        for gname, modname in var.imports.items():
            if not replay.is_dynamo_global(gname):
                raise UnsupportedProgramError(f"unexpected global {gname!r} in entry")
            g[gname] = replay.resolve_module(modname)
        fn = frame_records.frame_function(code, g)
        checker = checker_mod.build_checker(fn, [dict(gd) for gd in var.guards], g,
                                           every_call=self._mode is GuardMode.ALWAYS,
                                           lines=var.checker)
        return g, checker

    def load_variant(self, record: FrameRecord, code: types.CodeType, var: FrameVariant,
                     source: _Source,
                     guards: tuple[replay.ReplayGlobals, checker_mod.Checker] | None = None
                     ) -> _Loaded:
        """A variant ready to run: its guards (``guards`` if already built), its bytecode,
        its graphs and the continuations it calls, bound into its code."""
        g, checker = guards if guards is not None else self._guards(record, code, var)
        for gname, i in var.graphs.items():
            if not gname.startswith("__compiled_fn"):
                raise UnsupportedProgramError(f"unexpected graph name {gname!r}")
            g[gname] = source.graph(i)
        g.update(self.names(var.resumes))
        out_code = codeobj.loads(source.files[var.bytecode].read_bytes(), list(var.consts))
        if out_code.co_freevars != code.co_freevars:
            raise UnsupportedProgramError(f"frame {record.name}: stored bytecode does not "
                                          "fit its closure")
        return _Loaded(guard_tree.variant_check(checker, self._mode, self._cost), checker,
                       out_code, g,
                       code.co_name)

    # -- frame variants published later ---------------------------------------------------
    def _chain(self, fid: str, start: int
               ) -> Iterator[tuple[int, Key, EntryMeta | None, tuple[FrameRecord, ...],
                                   Hit | None]]:
        """(index, key, meta, head record, the Hit a remote download gave) of frame
        ``fid``'s published variants from ``start``, up to the first free index (the end of
        the chain); meta None for a variant that does not fit (another adapter, changed
        sources, not this frame's), and for one the store quarantined."""
        if self.st is None or self.key is None:
            return
        chain = VariantChain(self.st, self.key, fid)
        for i in range(start, LIMIT):
            k = chain.key(i)
            try:
                raw, fetched = chain.read(i)
            except ChainEnd:
                return
            except (Vacated, Unusable) as e:
                logger.info("cachecompile %s: frame variant %d: %s", self.qualname, i, e)
                yield i, k, None, (), None
                continue
            try:
                meta = EntryMeta.from_json(raw)
                records = frame_records.read_frames(meta.frames)
                one = len(records[0].variants) == 1 if records else False
                if (meta.head != fid or meta.adapter != self._adapter.name or not records
                        or records[0].id != fid
                        or not (one or (records[0].as_written and not records[0].variants))
                        or deps_mod.changed(dict(meta.deps))):
                    yield i, k, None, (), None
                    continue
            except UnsupportedProgramError:
                yield i, k, None, (), None
                continue
            yield i, k, meta, records, fetched

    def _fetch(self, k: Key, meta: EntryMeta, records: Sequence[FrameRecord],
               fetched: Hit | None) -> _Source | None:
        assert self.st is not None
        outcome = fetched or self.st.get(k)
        if not isinstance(outcome, Hit):
            return None
        try:
            self._pins.append(self.st.pin(outcome.entry))
        except Exception:  # a missing lease only weakens eviction safety
            logger.debug("could not pin entry", exc_info=True)
        source = _Source(outcome.entry.files, EntryMeta.from_json(outcome.entry.meta).graphs,
                         self._adapter)
        with self._lock:
            self._merge(records[1:], source)
        return source

    def from_chain(self, cont: Continuation, values: tuple[Any, ...], walk: bool = True
                   ) -> _Loaded | None:
        """A published variant of ``cont``'s frame whose guards hold for ``values``,
        loaded and added to it: first among those walked before for other values
        (``cont.passed``), then (``walk``) the rest of the chain; None if none holds. A
        variant passed over stays a candidate: which one a call needs depends on its
        values, not on the order the chain was walked in."""
        try:
            for p in list(cont.passed):
                if p.guards[1].full(*values):
                    with contextlib.suppress(ValueError):  # another thread took it
                        cont.passed.remove(p)
                    loaded = self._load_published(cont, p)
                    if loaded is not None:
                        return loaded
            for i, k, meta, records, fetched in (self._chain(cont.record.id, cont.probed)
                                                 if walk else ()):
                cont.probed = i + 1
                if meta is None:
                    continue
                if records[0].as_written:
                    # Another process found that Dynamo runs this frame as written.
                    cont.as_written = True
                    return None
                p = _Published(i, k, meta, records, fetched,
                               self._guards(records[0], cont.code, records[0].variants[0]))
                if not p.guards[1].full(*values):
                    cont.passed.append(p)
                    continue
                loaded = self._load_published(cont, p)
                if loaded is not None:
                    return loaded
        except Exception as e:  # a frame variant that does not load: the next way serves
            logger.info("cachecompile %s: a published variant of frame %s did not load "
                        "(%s: %s)", self.qualname, cont.record.name, type(e).__name__, e)
        return None

    def _load_published(self, cont: Continuation, p: _Published) -> _Loaded | None:
        source = self._fetch(p.key, p.meta, p.records, p.fetched)
        if source is None:
            return None
        loaded = self.load_variant(p.records[0], cont.code, p.records[0].variants[0], source,
                                   p.guards)
        cont.add(loaded)
        logger.info("cachecompile %s: frame %s served by its published variant %d",
                    self.qualname, cont.record.name, p.index)
        return loaded

    # -- callees: the run-only hook ---------------------------------------------------------
    def _chained_variants(self, record: FrameRecord) -> list[tuple[FrameVariant, _Source]]:
        """The callee's variants published after the entry (its frame's chain), each with
        the source it loads from."""
        found: list[tuple[FrameVariant, _Source]] = []
        try:
            for _, k, meta, records, fetched in self._chain(record.id, 0):
                if meta is not None and records[0].variants:
                    chained = self._fetch(k, meta, records, fetched)
                    if chained is not None:
                        found.append((records[0].variants[0], chained))
        except Exception:  # the chain is extra: the entry's own variants still install
            logger.debug("walking a callee's frame variants failed", exc_info=True)
        return found

    def _install(self, record: FrameRecord, source: _Source) -> None:
        if record.live:
            return
        if not frame_hook.available():
            logger.info("cachecompile %s: frame %s runs as written (this torch's frame hook "
                        "is unavailable)", self.qualname, record.name)
            return
        code = frame_records.find_callee(record.module, record.where, code_digest)
        if code is None:
            logger.info("cachecompile %s: frame %s runs as written (its code is not found "
                        "or changed)", self.qualname, record.name)
            return
        variants = [(var, source) for var in record.variants]
        variants += self._chained_variants(record)
        if record.as_written:
            return
        installed = 0
        for i, (var, src) in enumerate(variants):
            try:
                # Its code, bound (replay.bound_code), runs in the callee's own frame.
                loaded = self.load_variant(record, code, var, src)
            except UnsupportedProgramError as e:
                # This variant does not install (3.10: no room to bind a name): where no
                # other one holds, the callee runs as written, eager's result.
                logger.info("cachecompile %s: a variant of frame %s is not installed (%s)",
                            self.qualname, record.name, e)
                continue
            check = loaded.check

            def frame_check(frame_locals: dict[str, Any], check: Callable[..., bool] = check,
                            code: types.CodeType = code, fid: str = record.id) -> bool:
                if not check(*frame_records.frame_values(code, frame_locals)):
                    return False
                self.callee_served[fid] = self.callee_served.get(fid, 0) + 1
                return True

            frame_hook.install(code, frame_check, loaded.code,
                               f"cachecompile {record.name} variant {i}", owner=self)
            installed += 1
        if installed:
            self.callees.append(record.id)

    def served(self) -> dict[str, tuple[int, int, int]]:
        """Per frame (by name): calls a stored variant ran, calls compiled live here, calls
        run as written (a callee's are not counted: its code runs where none holds)."""
        out = {c.record.name: (c.served, c.compiled, c.unserved)
               for c in self.continuations.values()}
        for fid in self.callees:
            out[self.records[fid].name] = (self.callee_served.get(fid, 0), 0, 0)
        return out

    def wrap(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` under the frame hook when the entry installed callees (else itself)."""
        if not self.callees:
            return run

        def hooked(*args: Any, **kwargs: Any) -> Any:
            with frame_hook.run_only(self):
                return run(*args, **kwargs)
        return hooked
