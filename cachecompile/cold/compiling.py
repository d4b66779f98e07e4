"""What every compiling session of the cold side shares: the adapter's compile of a graph,
timed in its phases, and the one context each call into Dynamo runs under."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cachecompile import _torch
from cachecompile._torch import dynamo, guard_export
from cachecompile.backends.base import Compiled
from cachecompile.spec import CompileSpec


class Phases:
    """Where a cold first call's wall time goes, phase by phase (seconds, accumulated).

    The phases are logged with the publish line and kept in the entry's meta
    (``cold_phases``), so ``tools/bench_compile.py --profile`` and ``cachectl show`` can say
    what a cold compile cost. ``dynamo`` is what is left of the traced call once the
    backend, the guard capture and the first runs are taken out: Dynamo's own tracing.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.seconds.items()}

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.2f}s" for k, v in self.seconds.items())


class Compiling:
    """What every session shares: the adapter's compile of a graph, timed in its phases."""

    def __init__(self, spec: CompileSpec, phases: Phases | None) -> None:
        self.phases = phases if phases is not None else Phases()
        self._adapter = spec.adapter
        self._options = dict(spec.options)
        self._decompositions = spec.decompositions
        self._dynamic = spec.dynamic
        self._automatic = spec.automatic  # dynamic=None: what to try instead differs
        self._compile_seconds = 0.0

    @staticmethod
    @contextlib.contextmanager
    def dynamo_call(record: bool) -> Iterator[None]:
        """What every call of a session into Dynamo runs under (the one place it is said):
        torch's meta-kernel errors kept quiet, compiled graphs' outputs left unmarked
        (:func:`dynamo.outputs_left_unmarked`), Dynamo's export record tolerant of a
        tensor built at each read (:mod:`cachecompile._torch.guard_export`), and, with ``record`` (a session that stores
        what Dynamo compiles), the names Dynamo looks up and the reads torch 2.11 leaves
        unguarded recorded. Without ``record``, :func:`dynamo.recorded_lookups` says "not
        recorded", and a frame's guards captured then are refused
        (:func:`guard_capture.translate`): a call that forgets to record costs a miss,
        never a frame stored without its absence guards."""
        with dynamo.quiet_meta_errors(), dynamo.outputs_left_unmarked(), \
                guard_export.tolerant():
            if not record:
                yield
                return
            with dynamo.unguarded_reads_recorded(), dynamo.recording_lookups():
                yield

    def _compile_here(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Compiled:
        # In a copy of the context: Dynamo builds the guards after the backend returns,
        # and a context variable the compiler sets and leaves set (torch 2.15's compiler
        # config overrides) would be guarded at the compiler's value, which a warm process
        # that loads the program instead never has.
        return contextvars.copy_context().run(self._adapter.compile, gm, example_inputs,
                                              self._options, self._decompositions)

    def _compile_live(self, gm: torch.fx.GraphModule,
                      example_inputs: list[Any]) -> Callable[..., Any]:
        """A graph compiled and run as the adapter built it: nothing kept."""
        t0 = time.perf_counter()
        compiled = self._compile_here(gm, example_inputs)
        self.phases.add("backend", time.perf_counter() - t0)
        self._compile_seconds += time.perf_counter() - t0
        return compiled.live

    def _public_backend(self) -> tuple[Any, dict[str, Any] | None] | None:
        """A live session's backend and options when torch's internals are not what
        :mod:`cachecompile._torch` expects: the adapter's public one, which needs none of
        them (None while they are)."""
        if _torch.probe(self._adapter.torch_parts) is None:
            return None
        return self._adapter.plain_backend(self._options, self._decompositions)
