"""A graph-breaking method's other frames, served in a warm process without Dynamo.

A loaded entry's method bytecode (warm.replay) calls resume functions by generated global
names (``__resume_at_118_3``). Here each name is bound, in the private globals of the
bytecode that calls it, to a :class:`Continuation`: it checks the guards of each stored
variant of that frame on every call, as Dynamo checks its cache entries, and runs the
first variant whose guards hold (its transformed bytecode, rebuilt over private globals
in turn, whose graphs are the adapter's loaded programs). A call that no stored variant
serves (a branch never taken in the compiling process, state that changed) runs the
continuation's own code as written: what Dynamo generated for the rest of the method, in
the method's module, so the call's result is eager's, never a program run on guards
that do not hold.

A callee (a function the eager code between graphs calls, whose frame Dynamo compiled:
``self.attn(x)`` whose ``forward`` breaks inside) is reached by no name of ours. Its
variants are installed in Dynamo's run-only frame hook (:mod:`cachecompile._torch.frames`)
on its live code object, with cachecompile's own guard check, and the method runs under
that hook: a callee whose guards hold runs its stored code, any other frame runs as
written. Nothing is traced or compiled, and ``torch._dynamo`` is not imported.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cachecompile._torch import frames as hook
from cachecompile.backends.base import Adapter
from cachecompile.entry import codeobj, guard_tree
from cachecompile.entry import frames as ef
from cachecompile.entry import guards as guards_mod
from cachecompile.entry.frames import FrameRecord, FrameVariant
from cachecompile.entry.guards import GuardMode
from cachecompile.entry.meta import EntryMeta
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key.identity import code_digest
from cachecompile.warm import replay

logger = logging.getLogger(__name__)


def variant_check(checker: guards_mod.Checker, mode: GuardMode,
                  cost: guard_tree.BuildCost | None) -> Callable[..., bool]:
    """What runs on every call of a loaded variant, before it runs: every guard
    (ALWAYS: the C++ tree once worth building, the Python check until then and whenever
    the tree does not hold) or the argument guards with the state guards once more on the
    next call (FIRST)."""
    if mode is GuardMode.ALWAYS:
        return guard_tree.EveryCall(checker.parts, checker.full, cost)
    return guard_tree.FirstCall(checker.parts, checker.full,
                                checker.per_call if checker.n_per_call else None)


def module_globals(name: str) -> dict[str, Any]:
    """The globals of the module a frame's code belongs to (imported if it is not yet)."""
    mod = sys.modules.get(name)
    if mod is None:
        mod = importlib.import_module(name)
    return vars(mod)


class _Loaded:
    """One variant of a frame, loaded: its check over the frame's names and its code."""

    __slots__ = ("check", "checker", "code", "fn", "globals", "name")

    def __init__(self, check: Callable[..., bool], checker: guards_mod.Checker,
                 code: types.CodeType, g: replay.ReplayGlobals, name: str) -> None:
        self.check = check
        self.checker = checker
        self.code = code
        self.globals = g
        self.name = name
        # Built once where no closure comes with each call.
        self.fn = (types.FunctionType(code, g, name) if not code.co_freevars else None)


class Continuation:
    """A resume function of a loaded entry, standing where the calling bytecode loads it.

    Its code has free variables when the method's frame had cells: Dynamo's bytecode then
    loads a factory and calls it with the closure (:meth:`factory`)."""

    def __init__(self, frames: Frames, record: FrameRecord, code: types.CodeType) -> None:
        self._frames = frames
        self.record = record
        self.code = code
        self._variants: list[_Loaded] | None = None
        self._lock = threading.Lock()
        self._eager: types.FunctionType | None = None
        self._told = False
        # Outcome counts of this process (tests, logs): stored variant / as written.
        self.served = 0
        self.unserved = 0

    def variants(self) -> list[_Loaded]:
        """The stored variants, loaded on the frame's first call (checker, bytecode)."""
        v = self._variants
        if v is None:
            with self._lock:
                if self._variants is None:
                    self._variants = [self._frames.load_variant(self.record, self.code, i, var)
                                      for i, var in enumerate(self.record.variants)]
                v = self._variants
        return v

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
                    return types.FunctionType(v.code, v.globals, v.name, None, closure)(*args)
            return self._unserved(args, closure)
        return run

    def _unserved(self, args: tuple[Any, ...], closure: tuple[Any, ...] | None) -> Any:
        """No stored variant holds: the continuation as Dynamo generated it, run as
        written in its module (eager's result)."""
        self.unserved += 1
        if not self._told:
            self._told = True
            why = self.record.live or "it was never compiled"
            loaded = self._variants or []
            if loaded:
                values = (*args, *(c.cell_contents for c in closure or ()))
                failed = loaded[0].checker.failure(*values)
                why = (f"no stored variant's guards hold; variant 0: "
                       f"{failed[0] if failed else 'a guard failed'}")
            logger.info("cachecompile %s: frame %s runs as written (%s)",
                        self._frames.qualname, self.record.name, why)
        if closure is not None:
            return types.FunctionType(self.code, self._frames.globals_of(self.record),
                                      self.code.co_name, None, closure)(*args)
        fn = self._eager
        if fn is None:
            fn = self._eager = types.FunctionType(self.code, self._frames.globals_of(self.record),
                                                  self.code.co_name)
        return fn(*args)


class Frames:
    """The frames of one loaded entry (``EntryMeta.frames``), ready to run."""

    def __init__(self, meta: EntryMeta, files: Mapping[str, Path], adapter: Adapter,
                 mode: GuardMode, cost: guard_tree.BuildCost | None, qualname: str) -> None:
        self.qualname = qualname
        self._files = files
        self._adapter = adapter
        self._mode = mode
        self._cost = cost
        self.records = {r.id: r for r in ef.read_frames(meta.frames)}
        self._graph_meta = list(meta.graphs)
        self._graphs: dict[int, Callable[..., Any]] = {}
        self._lock = threading.RLock()
        self.continuations: dict[str, Continuation] = {}
        self.callees: list[str] = []        # the callee frames installed in the hook
        self.callee_served: dict[str, int] = {}   # calls a stored callee variant ran
        for r in self.records.values():
            if r.kind == ef.RESUME:
                code = codeobj.loads(files[r.code].read_bytes(), list(r.code_consts))
                self.continuations[r.id] = Continuation(self, r, code)
        for r in self.records.values():
            if r.kind == ef.CALLEE:
                self._install(r)

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

    def graph(self, i: int) -> Callable[..., Any]:
        """Graph ``i``'s program, loaded once."""
        fn = self._graphs.get(i)
        if fn is None:
            with self._lock:
                fn = self._graphs.get(i)
                if fn is None:
                    if not 0 <= i < len(self._graph_meta):
                        raise UnsupportedProgramError(f"the entry has no graph {i}")
                    fn = self._adapter.load(ef.graph_files(self._files, i),
                                            dict(self._graph_meta[i]))
                    self._graphs[i] = fn
        return fn

    # -- a variant, loaded ----------------------------------------------------------------
    def _variant_parts(self, record: FrameRecord, code: types.CodeType, var: FrameVariant
                       ) -> _Loaded:
        g = replay.ReplayGlobals(self.globals_of(record), {})
        for gname, modname in var.imports.items():
            if not replay.is_dynamo_global(gname):
                raise UnsupportedProgramError(f"unexpected global {gname!r} in entry")
            g[gname] = replay.resolve_module(modname)
        for gname, i in var.graphs.items():
            if not gname.startswith("__compiled_fn"):
                raise UnsupportedProgramError(f"unexpected graph name {gname!r}")
            g[gname] = self.graph(i)
        g.update(self.names(var.resumes))
        out_code = codeobj.loads(self._files[var.bytecode].read_bytes(), list(var.consts))
        if out_code.co_freevars != code.co_freevars:
            raise UnsupportedProgramError(f"frame {record.name}: stored bytecode does not "
                                          "fit its closure")
        fn = ef.frame_function(code, g)
        checker = guards_mod.build_checker(fn, [dict(gd) for gd in var.guards], g,
                                           every_call=self._mode is GuardMode.ALWAYS,
                                           lines=var.checker)
        return _Loaded(variant_check(checker, self._mode, self._cost), checker, out_code, g,
                       code.co_name)

    def load_variant(self, record: FrameRecord, code: types.CodeType, i: int,
                     var: FrameVariant) -> _Loaded:
        return self._variant_parts(record, code, var)

    # -- callees: the run-only hook ---------------------------------------------------------
    def _install(self, record: FrameRecord) -> None:
        if record.live or not record.variants:
            return
        if not hook.available():
            logger.info("cachecompile %s: frame %s runs as written (this torch's frame hook "
                        "is unavailable)", self.qualname, record.name)
            return
        code = ef.find_callee(record.module, record.where, code_digest)
        if code is None:
            logger.info("cachecompile %s: frame %s runs as written (its code is not found "
                        "or changed)", self.qualname, record.name)
            return
        for i, var in enumerate(record.variants):
            loaded = self._variant_parts(record, code, var)
            check = loaded.check
            # The generated names of its bytecode, bound to their objects: the callee
            # runs in its own module's globals, which are not written to.
            bound = ef.bind_globals(loaded.code, {k: v for k, v in loaded.globals.items()
                                                  if k != "__builtins__"})

            def frame_check(frame_locals: dict[str, Any], check: Callable[..., bool] = check,
                            code: types.CodeType = code, fid: str = record.id) -> bool:
                if not check(*ef.frame_values(code, frame_locals)):
                    return False
                self.callee_served[fid] = self.callee_served.get(fid, 0) + 1
                return True

            hook.install(code, frame_check, bound, f"cachecompile {record.name} variant {i}")
        self.callees.append(record.id)

    def served(self) -> dict[str, tuple[int, int]]:
        """Per frame (by name): calls a stored variant ran, calls it ran as written (a
        callee's are not counted: its code runs where no variant holds)."""
        out = {c.record.name: (c.served, c.unserved) for c in self.continuations.values()}
        for fid in self.callees:
            out[self.records[fid].name] = (self.callee_served.get(fid, 0), 0)
        return out

    def wrap(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` under the frame hook when the entry installed callees (else itself)."""
        if not self.callees:
            return run

        def hooked(*args: Any, **kwargs: Any) -> Any:
            with hook.run_only():
                return run(*args, **kwargs)
        return hooked
