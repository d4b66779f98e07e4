"""A graph break's other frames, captured as Dynamo compiles them (cold side).

:class:`FrameCapture` keeps each frame Dynamo compiles other than a session's root (its
graphs, verified; its guards, portable); :class:`FrameSession` compiles a continuation no
stored variant serves in a warm process, capturing what it compiles for publishing, and
:class:`LiveFrameSession` compiles one that cannot be stored, keeping nothing.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from cachecompile._torch import dynamo, frame_cache
from cachecompile.backends.base import Compiled
from cachecompile.cold import guard_capture
from cachecompile.cold.compiling import Compiling, Phases
from cachecompile.cold.frame_assembly import FrameCompile, GraphCapture
from cachecompile.cold.verify import Verified
from cachecompile.entry import checker as checker_mod
from cachecompile.entry import frame_records, guard_kinds
from cachecompile.errors import UnsupportedProgramError
from cachecompile.spec import CompileSpec

logger = logging.getLogger(__name__)


class FrameCapture:
    """A graph break's capture (fullgraph=False), for a session that stores what it
    compiles: each frame Dynamo compiles other than the session's own root (its graphs,
    then its guards, made portable and checked against the frame's own arguments:
    :class:`FrameCompile`), kept for the session's entry (during its first call) or for
    publishing as a frame variant (later: :meth:`take_late`)."""

    def __init__(self, phases: Phases,
                 compile_graph: Callable[[torch.fx.GraphModule, list[Any]], Compiled]) -> None:
        self.phases = phases
        self._compile_graph = compile_graph
        self.seconds = 0.0  # compiling the frames' graphs
        self.in_first_call = False
        self.compiles: list[FrameCompile] = []
        self._late: list[FrameCompile] = []
        self._pending: dict[types.CodeType, list[GraphCapture]] = {}
        self._pending_dims: dict[types.CodeType, dict[str, Any]] = {}
        self._pending_traced: dict[types.CodeType, list[str]] = {}
        self.strings: set[str] = set()  # string constants of the traced code

    def take_late(self) -> list[FrameCompile]:
        """The frames compiled since the last time asked, outside a first call."""
        out, self._late = self._late, []
        return out

    def graph(self, code: types.CodeType, gm: torch.fx.GraphModule,
              example_inputs: list[Any]) -> Callable[..., Any]:
        """A graph of a frame other than the root (a resume function's, a callee's):
        compiled, verified on its first run, kept with its frame's compile."""
        t0 = time.perf_counter()
        self._pending_dims.setdefault(code, {}).update(guard_capture.tensor_dims_from_graph(gm))
        self._pending_traced.setdefault(code, []).extend(dynamo.traced_code_files())
        self.strings |= dynamo.traced_code_strings()
        compiled = self._compile_graph(gm, example_inputs)
        self.phases.add("backend", time.perf_counter() - t0)
        self.seconds += time.perf_counter() - t0
        graph = GraphCapture(compiled, compiled.live)
        run = Verified(self.phases, compiled, graph, serve=True)
        graph.run = run
        self._pending.setdefault(code, []).append(graph)
        return run

    def guards(self, frame: dynamo.CompilingFrame, entries: Any) -> None:
        """A frame other than the root finished compiling: its guards, portable, checked
        against its own arguments now, and its compile kept."""
        code, g = frame.code, frame.f_globals
        frame_cache.note_captured(code)
        compile_ = FrameCompile(code=code, out_code=frame.out_code or code, f_globals=g,
                                graphs=self._pending.pop(code, []),
                                traced=self._pending_traced.pop(code, []))
        (self.compiles if self.in_first_call else self._late).append(compile_)
        dims = self._pending_dims.pop(code, {})
        if frame.out_code is None:
            compile_.verdict = "this torch's Dynamo does not show the frame's transformed code"
            return
        try:
            with self.phases.timed("guards"):
                names = frame_records.frame_names(code)
                portable, classes = guard_capture.translate(
                    entries, arg_names=set(names) - {"self"}, tensor_dims=dims,
                    module_name=str(g.get("__name__", "")),
                    state=guard_capture.frame_state(), strings=self.strings,
                    resolved=dynamo.recorded_lookups())
                fn = frame_records.frame_function(code, g)
                local = [gd for gd in portable if gd["kind"] not in guard_kinds.GLOBAL_KINDS]
                values = frame_records.frame_values(code, frame.f_locals)
                probe = checker_mod.build_checker(fn, local, g)
                if not probe.full(*values):
                    raise UnsupportedProgramError("a carried guard does not hold at trace "
                                                  f"time: {probe.explain(*values)}")
                compile_.guards = portable
                compile_.checker_lines = checker_mod.build_checker(fn, portable, g).lines()
                compile_.classes = classes
        except UnsupportedProgramError as e:
            compile_.verdict = str(e)
        except Exception as e:  # a guard we cannot carry means "do not store this frame"
            logger.debug("guard capture failed", exc_info=True)
            compile_.verdict = f"capturing Dynamo's guards failed: {type(e).__name__}: {e}"


class FrameSession(Compiling):
    """A resume function compiled live in a process whose stored variants of it did not
    serve a call (a branch the compiling process never took, state that changed since):
    ``torch.compile`` of the continuation, with every frame Dynamo compiles for its calls
    captured (:class:`FrameCapture`) so that each can be published as a frame variant
    (:meth:`take_late`). :class:`LiveFrameSession` is the one that keeps nothing."""

    def __init__(self, fn: types.FunctionType, spec: CompileSpec) -> None:
        super().__init__(spec, None)
        self._frames = FrameCapture(self.phases, self._compile_here)
        self._live = torch.compile(fn, backend=self._backend, fullgraph=False,
                                   dynamic=self._dynamic,
                                   options={"guard_filter_fn": self._on_guards})

    def take_late(self) -> list[FrameCompile]:
        """The frames compiled since the last time asked."""
        return self._frames.take_late()

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        frame = dynamo.compiling_frame()
        if frame is None:
            return self._compile_here(gm, example_inputs).live  # not attributable: not kept
        return self._frames.graph(frame.code, gm, example_inputs)

    def _on_guards(self, entries: Any) -> list[bool]:
        frame = dynamo.compiling_frame()
        if frame is not None:
            self._frames.guards(frame, entries)
        return [True] * len(entries)

    def __call__(self, *args: Any) -> Any:
        # As TraceSession's calls: what it compiles is published, with every guard.
        with self.dynamo_call(record=True):
            return self._live(*args)


class LiveFrameSession(Compiling):
    """A resume function under plain ``torch.compile``, kept nowhere: a frame whose guards
    cannot be stored is compiled live in each process (as is any frame of a process that
    may not write the store). As :class:`LiveSession`, through the adapter's public
    backend when torch's internals are not what :mod:`cachecompile._torch` expects."""

    def __init__(self, fn: types.FunctionType, spec: CompileSpec) -> None:
        super().__init__(spec, None)
        public = self._public_backend()
        backend, options = public if public is not None else (self._compile_live, None)
        self._live = torch.compile(fn, backend=backend, fullgraph=False,
                                   dynamic=self._dynamic, options=options)

    def take_late(self) -> list[FrameCompile]:
        """Nothing: a live frame's compiles are not published."""
        return []

    def __call__(self, *args: Any) -> Any:
        with self.dynamo_call(record=False):
            return self._live(*args)
