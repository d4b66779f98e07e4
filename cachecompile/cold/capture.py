"""Dynamo-side capture: trace one signature once, and keep what a fresh process replays.

A :class:`TraceSession` compiles a *private copy* of the method's code object, so that
Dynamo's cache (and so its recompile counting) is per signature, and other compiles of
the same method in the process do not interfere (vllm-ascend clones ``forward.__code__``
for the same reason). After the first call it hands out a :class:`Trace`:

* Dynamo's transformed bytecode for the method (marshalled): it reads parameters and
  inputs from the live frame, calls ``__compiled_fn_*`` and rebuilds the return value,
  replaying any side effects Dynamo recorded;
* the names of the module globals that bytecode uses (``__import_*``);
* the adapter's :class:`Program` for the graph, verified against the live compile;
* the user files Dynamo traced (dependency hashes, checked again on every hit).

Dynamo is reached through :mod:`cachecompile._torch.dynamo` (only this module, the guard
capture and the adapters call it): a warm process never imports this module.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sysconfig
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cachecompile._torch import dynamo, frame_cache, runtime
from cachecompile.backends.base import Compiled, Program
from cachecompile.cold import frame_assembly, guard_capture
from cachecompile.cold.compiling import Compiling, Phases
from cachecompile.cold.failures import (
    call_types,
    graph_break_error,
    last_line,
    torch_compile_error,
    with_note,
)
from cachecompile.cold.frame_assembly import FrameCompile, GraphCapture
from cachecompile.cold.frame_capture import FrameCapture
from cachecompile.cold.verify import Verified
from cachecompile.entry import checker as checker_mod
from cachecompile.entry import codeobj, guard_kinds
from cachecompile.errors import UnsupportedProgramError, fault
from cachecompile.key.deps import by_module as deps_by_module
from cachecompile.key.deps import hash_file
from cachecompile.procs.coop import GraphShare
from cachecompile.spec import CompileSpec

logger = logging.getLogger(__name__)

_TORCH_DIR = str(Path(torch.__file__).parent)
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


@dataclasses.dataclass
class Trace:
    """What one signature's first call produced."""

    bytecode: bytes
    imports: dict[str, str]          # global name in the bytecode -> module name
    compiled_fn_name: str            # "" when the method breaks before any graph
    program: Program | None          # None likewise
    deps: dict[str, str]             # traced user file -> content hash
    compile_seconds: float
    consts: list[Any]                # constants rebuilt on load (codeobj)
    guards: list[dict[str, Any]]     # Dynamo's guards, portable (guards.py)
    # The checker's bodies derived from them (checker.Checker.lines): stored so that a warm
    # process compiles its checker without parsing a guard.
    checker_lines: dict[str, str] = dataclasses.field(default_factory=dict)
    # A graph break (fullgraph=False): every other frame Dynamo compiled for the call
    # (cold.frame_assembly.assemble).
    frames: frame_assembly.Assembled | None = None


def clone_function(func: types.FunctionType) -> types.FunctionType:
    """A function with a private copy of ``func``'s code object (own Dynamo cache)."""
    code = func.__code__.replace()
    fn = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__,
                            func.__closure__)
    fn.__kwdefaults__ = func.__kwdefaults__
    fn.__qualname__ = func.__qualname__
    fn.__module__ = func.__module__
    fn.__dict__.update(func.__dict__)
    return fn


def _user_file_hashes(paths: list[str]) -> dict[str, str]:
    files: dict[str, str] = {}
    for path in paths:
        if not path or path.startswith("<") or path in files:
            continue
        if path.startswith(_TORCH_DIR) or path.startswith(_STDLIB_DIRS):
            continue  # covered by the torch / Python version factors
        digest = hash_file(path)
        if digest is not None:
            files[path] = digest
    return deps_by_module(files)


def frame_deps(compiles: Sequence[FrameCompile], traced: Sequence[str] = (),
               classes: set[type] | None = None) -> dict[str, str]:
    """The user files an entry depends on: what its graphs traced, the classes its guards
    name, and each frame's own file (a callee's stored code is stale once its source
    changes, though its frame traced nothing else)."""
    files = list(traced)
    all_classes = set(classes or ())
    for c in compiles:
        files += c.traced + [c.code.co_filename]
        all_classes |= c.classes
    return _user_file_hashes(files + sorted(guard_capture.class_files(all_classes)))


class _Breaks(Exception):
    """A trace captured whole broke where the graph may break (:meth:`LiveSession._let_break`)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first


class LiveSession(Compiling):
    """One signature of one cached method under plain ``torch.compile``: caching is off,
    or this call is not cached, so nothing is kept (:class:`TraceSession` keeps it).

    It compiles through the adapter's compile while torch's internals are what
    :mod:`cachecompile._torch` expects, else through the adapter's public backend, which
    needs none of them. What a capturing session adds, it adds by overriding the hooks
    below (the compile's arguments, the guard filter, a frame's graph, the first trace's
    compile and runner, a call's beginning, reads and end).
    """

    def __init__(self, method: types.MethodType, spec: CompileSpec, *,
                 phases: Phases | None = None) -> None:
        super().__init__(spec, phases)
        self._orig = method
        self._fn = clone_function(method.__func__)  # type: ignore[arg-type]
        self.traces = 0
        self.recompile_reason: str | None = None
        self.on_recompile: Callable[[str], None] | None = None
        # Told (with the guard that failed last) when a call passes Dynamo's recompile limit.
        self.on_recompile_limit: Callable[[str], None] | None = None
        self._compiled: Compiled | None = None
        self._called = False
        # The graph is captured whole first, whatever ``fullgraph`` says: a method that
        # compiles to one graph is then captured as fullgraph=True captures it (ranks share
        # its compile, a failed compile is tried under plain torch.compile). With
        # fullgraph=False, the first break switches the session to breaking
        # (:meth:`_let_break`), and Dynamo compiles other frames too (:meth:`_frame_graph`).
        self._fullgraph = True
        self._may_break = not spec.fullgraph
        self._live = self._torch_compile()

    def _torch_compile(self) -> Callable[..., Any]:
        backend, compile_options = self._compile_args()
        return torch.compile(types.MethodType(self._fn, self._orig.__self__),
                             backend=backend, fullgraph=self._fullgraph,
                             dynamic=self._dynamic, options=compile_options)

    def _let_break(self, first: bool) -> None:
        """A graph break in a trace captured whole, where the graph may break: from now on
        Dynamo traces as torch.compile(fullgraph=False) does. Dynamo raised while it traced,
        before the call ran anything, so the call is made again (as the first, if it was)."""
        logger.debug("%s: the graph breaks; traced again with fullgraph=False",
                     getattr(self._orig, "__qualname__", self._orig))
        self._fullgraph = False
        self._called = not first
        self._live = self._torch_compile()

    # -- the hooks a capturing session overrides ---------------------------------------
    def _compile_args(self) -> tuple[Any, dict[str, Any] | None]:
        """torch.compile's backend and options."""
        public = self._public_backend()
        return public if public is not None else (self._backend,
                                                  {"guard_filter_fn": self._on_guards})

    def _on_guards(self, entries: Any) -> list[bool]:
        """guard_filter_fn: keep every guard."""
        return [True] * len(entries)

    def _frame_graph(self, code: types.CodeType, gm: torch.fx.GraphModule,
                     example_inputs: list[Any]) -> Callable[..., Any]:
        """A graph of a frame other than the method's own (a graph break's)."""
        return self._compile_live(gm, example_inputs)

    def _first_compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                       collective: bool) -> Compiled:
        """The method's own frame's first trace, compiled."""
        return self._compile_here(gm, example_inputs)

    def _first_runner(self, compiled: Compiled, collective: bool) -> Callable[..., Any]:
        """What the method's own frame's first graph runs as."""
        return compiled.live

    def _call_begins(self, first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before a call reaches Dynamo (``first``: this session's first call)."""

    def _records(self, first: bool) -> bool:
        """Whether a call records what Dynamo looks up (:meth:`dynamo_call`)."""
        return False

    def _call_ends(self, first: bool) -> None:
        """After a call, its result or error given."""

    # -- Dynamo backend -------------------------------------------------------------
    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # A trace counts once the backend returns: Dynamo may restart analysis by raising
        # from inside the backend (e.g. TensorifyScalarRestartAnalysis), which is not a
        # recompile.
        if not self._fullgraph:
            frame = dynamo.compiling_frame()
            if frame is not None and frame.code is not self._fn.__code__:
                return self._frame_graph(frame.code, gm, example_inputs)
        if self._compiled is not None:
            compiled = self._adapter.compile(gm, example_inputs, self._options,
                                             self._decompositions)
            self.traces += 1
            self._on_second_trace()
            return compiled.live
        t0 = time.perf_counter()
        collective = has_collectives(gm)
        compiled = self._first_compile(gm, example_inputs, collective)
        self.traces += 1
        self._compile_seconds = time.perf_counter() - t0
        self.phases.add("backend", self._compile_seconds)
        self._compiled = compiled
        return self._first_runner(compiled, collective)

    def _on_second_trace(self) -> None:
        reason = dynamo.last_guard_failure(self._fn.__code__) or "unknown guard failure"
        self.recompile_reason = reason
        if self.on_recompile is not None:
            self.on_recompile(reason)

    # -- calls ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call(args, kwargs)
        except _Breaks as breaks:
            self._let_break(breaks.first)
            return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        first = not self._called
        self._called = True
        # Only the first call is timed: later calls of a live variant are the hot path.
        t0 = time.perf_counter() if first else 0.0
        before = sum(self.phases.seconds.values()) if first else 0.0
        self._call_begins(first, args, kwargs)
        try:
            with self.dynamo_call(self._records(first)):
                return self._live(*args, **kwargs)
        except dynamo.graph_break_errors() + dynamo.input_errors() as e:
            # Any break, one Dynamo blames on the inputs too (torch.compile(fullgraph=False)
            # breaks there, and eager's error is then raised by eager code); an operator
            # failing on fake tensors fails under fullgraph=False too (handled below).
            if self._fullgraph and self._may_break and not isinstance(e, dynamo.input_errors()):
                raise _Breaks(first) from e
            note = ""
            if dynamo.is_input_error(e):
                self._raise_eager_error(args, kwargs)
                note = ("(The method runs uncompiled on these inputs, so this is what Dynamo "
                        "cannot trace, not an error in them; it ran once to check.)\n")
            raise graph_break_error(e, self._orig, note) from None
        except dynamo.data_dependent_errors() as e:
            if self._fullgraph and self._may_break:
                raise _Breaks(first) from e
            raise graph_break_error(e, self._orig) from None
        except dynamo.backend_failures() as e:
            # fullgraph: nothing of the method ran yet (Dynamo compiles before it runs), so
            # plain torch.compile may try the same call: the spec. Where it succeeds, its
            # result is the call's (nothing cached, said once); where it fails too, it is
            # torch's own limit, said in one message. A graph break's earlier frames have
            # run already: not tried again there.
            if not self._fullgraph:
                raise torch_compile_error(e, self._orig, args, kwargs, self._dynamic,
                                          None, self._automatic) from None
            try:
                result = self._plain_torch_compile()(*args, **kwargs)
            except Exception as plain:
                logger.debug("plain torch.compile fails too", exc_info=True)
                raise torch_compile_error(e, self._orig, args, kwargs, self._dynamic,
                                          plain, self._automatic) from None
            fault(f"{getattr(self._orig, '__qualname__', self._orig)}: cachecompile's compile "
                  f"failed where plain torch.compile succeeds ({last_line(e)}); the call ran "
                  "with plain torch.compile and nothing is cached. Please report it.")
            return result
        except dynamo.recompile_limit_errors():
            # A value Dynamo guards changed on every call, each a new compile, up to its
            # recompile limit, which fullgraph makes a hard error. Dynamo raises it before
            # it traces anything (the call has had no effect yet): run the method itself,
            # eager's result. Calls that fit a program Dynamo already has keep running it.
            if self.on_recompile_limit is not None:
                self.on_recompile_limit(self.last_guard_failure() or "not recorded by Dynamo")
            return self._orig(*args, **kwargs)
        finally:
            if first:
                others = sum(self.phases.seconds.values()) - before
                self.phases.add("dynamo", time.perf_counter() - t0 - others)
            self._call_ends(first)

    def _plain_torch_compile(self) -> Callable[..., Any]:
        """Plain ``torch.compile`` of the method with this session's arguments, through the
        adapter's public backend: what cache_compile stands for."""
        backend, options = self._adapter.plain_backend(self._options, self._decompositions)
        return torch.compile(self._orig, backend=backend, fullgraph=not self._may_break,
                             dynamic=self._dynamic, options=options)

    def _raise_eager_error(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An operator failed on the call's fake tensors: run the method uncompiled on the
        same inputs (under no_grad, as the cached call) and raise what it raises, the
        error eager gives (``linear(): argument 'input' must be Tensor, not str``), with
        the call's argument types noted. Dynamo failed while tracing, before anything
        ran, so this run is the one the call makes: its effects are what an uncompiled
        call would have had. Returns only if eager succeeds (Dynamo's limit, then)."""
        try:
            with torch.no_grad():
                self._orig(*args, **kwargs)
        except Exception as eager:
            qualname = getattr(self._orig, "__qualname__", "the method")
            call = call_types(self._orig, args, kwargs)
            raise with_note(eager, (
                f"cache_compile: {qualname}({call}) raises this uncompiled too: the inputs "
                "do not fit the method. Nothing was compiled or cached.")) from None

    def last_guard_failure(self) -> str | None:
        """Why Dynamo last recompiled this session's code (the guard that failed), if known."""
        return dynamo.last_guard_failure(self._fn.__code__)



class TraceSession(LiveSession):
    """One signature of one cached method, compiled live by Dynamo and captured: its first
    trace records Dynamo's guards in portable form and the adapter's replayable program
    (run beside the live graph and compared), a graph break's other frames each with its
    own (:class:`FrameCapture`), and the files it depends on; :meth:`trace` then gives
    what a warm process needs.
    """

    def __init__(self, method: types.MethodType, spec: CompileSpec, *,
                 share: GraphShare | None = None, phases: Phases | None = None) -> None:
        super().__init__(method, spec, phases=phases)
        self.share = share
        # fullgraph=False: the frames Dynamo compiles other than the method's own.
        self._frames = FrameCapture(self.phases, self._compile_here)
        # Told the frames compiled in a later call (a branch first taken, a frame whose
        # guards failed), once the call is over: the miss path publishes each one.
        self.on_frames: Callable[[list[FrameCompile]], None] | None = None
        self._deps: dict[str, str] = {}
        self._traced: list[str] = []
        self._verdict: str | None = None     # None: verified; else why not cacheable
        self._program: Program | None = None
        self._call_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._state: dict[str, Any] = {}
        self._tensor_dims: dict[str, Any] = {}
        self._guards: list[dict[str, Any]] | None = None
        self._guard_classes: set[type] = set()
        self.checker: checker_mod.Checker | None = None
        # The method's own frame's graph (its outcome: program, verdict).
        self._root_graph: GraphCapture | None = None

    def _compile_args(self) -> tuple[Any, dict[str, Any] | None]:
        # Capturing needs the adapter's compile and Dynamo's guards, whatever the probe says.
        return self._backend, {"guard_filter_fn": self._on_guards}

    def _let_break(self, first: bool) -> None:
        super()._let_break(first)
        self.share = None   # a graph break compiles several graphs: each rank its own

    # -- Dynamo's guards ------------------------------------------------------------
    def _on_guards(self, entries: Any) -> list[bool]:
        """guard_filter_fn: keep every guard; record the first trace's in portable form."""
        keep = [True] * len(entries)
        if not self._fullgraph:
            frame = dynamo.compiling_frame()
            if frame is None and self._frames.in_first_call:
                self._verdict = ("this torch's Dynamo does not say which frame it compiles, "
                                 "so a graph break's frames cannot be told apart")
                return keep
            if frame is not None and frame.code is not self._fn.__code__:
                self._frames.guards(frame, entries)
                return keep
        if self._guards is not None or self._verdict is not None:
            return keep
        try:
            with self.phases.timed("guards"):
                self._record_guards(entries)
        except UnsupportedProgramError as e:
            self._verdict = str(e)
        except Exception as e:  # a guard we cannot carry means "do not cache"
            logger.debug("guard capture failed", exc_info=True)
            self._verdict = f"capturing Dynamo's guards failed: {type(e).__name__}: {e}"
        return keep

    def _record_guards(self, entries: Any) -> None:
        if self._call_args is None:
            raise UnsupportedProgramError("guards were built outside a call")
        func = self._orig.__func__
        params = list(inspect.signature(func, follow_wrapped=False).parameters)
        arg_names = set(params[1:])
        portable, classes = guard_capture.translate(
            entries, arg_names=arg_names, tensor_dims=self._tensor_dims,
            module_name=getattr(func, "__module__", "") or "", state=self._state,
            strings=self._frames.strings, resolved=dynamo.recorded_lookups())
        # The guards are checked here, before the graph runs, against the very call being
        # traced: a guard that does not hold now was translated wrongly. (Global state is
        # left out: Dynamo changes it while it builds guards; it was snapshotted before.)
        local = [gd for gd in portable if gd["kind"] not in guard_kinds.GLOBAL_KINDS]
        probe = checker_mod.build_checker(self._fn, local, self._fn.__globals__)
        args, kwargs = self._call_args
        call = (self._orig.__self__, *args)
        if not probe.full(*call, **kwargs):
            why = probe.explain(*call, **kwargs)
            raise UnsupportedProgramError(f"a carried guard does not hold at trace time: {why}")
        self._guards = portable
        self._guard_classes = classes
        self.checker = checker_mod.build_checker(self._fn, portable, self._fn.__globals__)

    # -- Dynamo backend -------------------------------------------------------------
    def _frame_graph(self, code: types.CodeType, gm: torch.fx.GraphModule,
                     example_inputs: list[Any]) -> Callable[..., Any]:
        return self._frames.graph(code, gm, example_inputs)

    def _first_compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                       collective: bool) -> Compiled:
        self._tensor_dims = guard_capture.tensor_dims_from_graph(gm)
        self._traced = dynamo.traced_code_files()
        self._frames.strings = dynamo.traced_code_strings()
        if self.share is None:
            return self._compile_here(gm, example_inputs)
        return self.share.compile(gm, example_inputs,
                                  lambda: self._compile_here(gm, example_inputs),
                                  publish_now=collective, state=self._state)

    def _first_runner(self, compiled: Compiled, collective: bool) -> Callable[..., Any]:
        # Graphs with collectives run exactly once per call on every rank: verifying would
        # issue each collective twice on this rank, and a rank whose capture failed once,
        # and the job would hang (Verified, verify=False).
        self._root_graph = GraphCapture(compiled, compiled.live)
        return Verified(self.phases, compiled, self._root_graph,
                        serve=collective or not self._fullgraph, verify=not collective)

    # -- calls ------------------------------------------------------------------------
    def _call_begins(self, first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if first:
            if not self._fullgraph:
                # The frames earlier captures compiled are traced again for this one.
                frame_cache.forget_captured()
            # Dynamo's guards are built during this call; they are checked against it.
            self._call_args = (args, dict(kwargs))
            self._state = guard_capture.state_snapshot()
            self._frames.in_first_call = True

    def _records(self, first: bool) -> bool:
        # A graph break's later calls may compile frames too (a branch first taken), each
        # published as a frame variant: they record as the first call does.
        return first or not self._fullgraph

    def _call_ends(self, first: bool) -> None:
        if first:
            self._call_args = None  # do not keep the first call's tensors alive
            self._frames.in_first_call = False
            if self._compiled is not None or self._frames.compiles:
                with self.phases.timed("deps"):
                    self._deps = frame_deps(self._frames.compiles, self._traced,
                                            self._guard_classes)
        elif self.on_frames is not None:
            late = self._frames.take_late()
            if late:
                self.on_frames(late)

    def trace(self) -> Trace:
        """After the first call: everything a warm process needs, or UnsupportedProgramError."""
        if self._root_graph is not None:
            self._verdict = self._verdict or self._root_graph.verdict
            self._program = self._program or self._root_graph.program
        if self._compiled is None and not self._frames.compiles:
            raise UnsupportedProgramError("Dynamo produced no graph for this call")
        if self._verdict is not None:
            raise UnsupportedProgramError(self._verdict)
        if self._compiled is not None and self._program is None:
            raise UnsupportedProgramError("the program was never run")
        codes = frame_cache.transformed_code(self._fn.__code__)
        if (not codes and not self._fullgraph and self._frames.compiles and self._guards is None
                and self._compiled is None):
            # Dynamo skipped the method's own frame (a graph break it cannot resume from,
            # inside a try block: transformers' decorators), so it runs as written, with no
            # guards, in torch.compile too; the frames it calls were compiled.
            codes = [self._fn.__code__]
            self._guards = []
        if self._guards is None:
            raise UnsupportedProgramError("Dynamo's guards were not recorded")
        if len(codes) != 1:
            raise UnsupportedProgramError(f"Dynamo holds {len(codes)} cache entries, expected 1")
        code = codes[0]
        if code.co_freevars != self._fn.__code__.co_freevars:
            raise UnsupportedProgramError("transformed bytecode changed the closure variables")
        g = self._fn.__globals__
        names = frame_assembly.all_names(code)
        imports = frame_assembly.dynamo_imports(
            [*names, *frame_assembly.guard_global_names(self._guards)], g,
            set(self._fn.__code__.co_names))
        compiled_fn_names = list(dict.fromkeys(
            n for n in names if n.startswith(frame_assembly.GRAPH_PREFIX)))
        if len(compiled_fn_names) != (self._compiled is not None):
            raise UnsupportedProgramError(
                f"expected {int(self._compiled is not None)} compiled graph in the method's "
                f"bytecode, found {len(compiled_fn_names)}")
        assembled = None
        if not self._fullgraph:
            assembled = frame_assembly.assemble(self._fn.__code__, code, g, self._frames.compiles)
            if not assembled.records and self._compiled is None:
                raise UnsupportedProgramError("Dynamo produced no graph for this call")
        bytecode, consts = codeobj.dumps(code)
        return Trace(bytecode=bytecode, imports=imports,
                     compiled_fn_name=compiled_fn_names[0] if compiled_fn_names else "",
                     program=self._program, deps=self._deps,
                     compile_seconds=self._compile_seconds + self._frames.seconds, consts=consts,
                     guards=self._guards,
                     checker_lines=self.checker.lines() if self.checker is not None else {},
                     frames=assembled if assembled is not None and assembled.records else None)



_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_dtensor", "c10d")


def has_collectives(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph communicates (functional collectives, c10d ops)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        module = getattr(target, "__module__", "") or ""
        if (runtime.operator_namespace(target) in _COLLECTIVE_NAMESPACES
                or module.startswith("torch.distributed")):
            return True
    return False


