"""Checking a captured graph's replayable program against the live compile (cold side).

:class:`Verified` is the one place it is done: each captured graph's first call runs the
adapter's program beside the live graph, on the same random numbers, and compares.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cachecompile.backends.base import Compiled, Program
from cachecompile.cold.compiling import Phases
from cachecompile.cold.frame_assembly import GraphCapture
from cachecompile.entry import joint
from cachecompile.errors import UnsupportedProgramError

logger = logging.getLogger(__name__)


class Verified:
    """A captured graph's callable: the one place a replayable program is checked against
    the live compile (each graph's first call).

    The first call captures the adapter's program (``out.program``; why it cannot be stored
    in ``out.verdict``) and, with ``verify``, runs it beside the live graph: both draw the
    same random numbers and the call draws them once, as torch.compile's one call does;
    each mutated input goes to one of them as a copy made before either ran; outputs and
    mutated inputs are compared, and a training program's gradients too
    (:func:`gradients_differ`); a difference is a verdict. ``serve`` says who answers:

    * ``serve=False`` (the method's own graph, fullgraph): the live graph, on the call's
      arguments, in this call and every later one; the program gets the copies;
    * ``serve=True`` (a graph break's graph): once verified, the program itself, on the
      call's arguments, this call and every later one; the live graph gets the copies,
      and where the two disagree its results stand (its mutations copied back). The frames
      after it take its outputs as arguments, and Dynamo guards what it sees of them (a
      view's base, its strides): the very tensors a warm process will hand them, rather
      than what AOTAutograd's runtime wrappers make of the live graph's;
    * ``verify=False`` (a graph with collectives, which must run exactly once per call on
      every rank): the program, once, unverified, where there is one; else the live graph.
    """

    def __init__(self, phases: Phases, compiled: Compiled, out: GraphCapture, *,
                 serve: bool, verify: bool = True) -> None:
        self._phases = phases
        self._compiled = compiled
        self._out = out
        self._serve = serve
        self._verify = verify
        self._first = True
        self._runner: Callable[..., Any] = compiled.live

    def __call__(self, *args: Any) -> Any:
        if not self._first:
            return self._runner(*args)
        self._first = False
        program = self._capture()
        if program is None or program.light is None:
            with self._phases.timed("run"):
                return self._compiled.live(*args)
        if not self._verify:
            self._runner = program.light
            return self._runner(*args)
        copies = list(args)
        for i in program.mutated_inputs:
            copies[i] = args[i].clone()
        live_args, light_args = (copies, list(args)) if self._serve else (list(args), copies)
        restore_rng = rng_snapshot()
        with self._phases.timed("run"):
            live_out = self._compiled.live(*live_args)
        restore_rng()
        light_out: Any = None
        try:
            with self._phases.timed("verify"):
                light_out = program.light(*light_args)
                mismatch = compare(light_out, live_out)
                for i in program.mutated_inputs:
                    mismatch = mismatch or compare(light_args[i], live_args[i],
                                                    f"mutated input {i}")
                if not mismatch and joint.KEY in program.meta:
                    mismatch = gradients_differ(self._compiled.live, program.light, args,
                                                restore_rng)
        except Exception as e:  # the program failed: the live graph's result stands
            logger.debug("the program failed on the call's arguments", exc_info=True)
            mismatch = f"it raised {type(e).__name__}: {e}"
        if mismatch:
            self._out.verdict = ("the replayed program disagrees with the live compile: "
                                 f"{mismatch}")
        if not self._serve:
            return live_out
        if mismatch:
            for i in program.mutated_inputs:
                args[i].copy_(live_args[i])
            return live_out
        self._runner = program.light
        return light_out

    def _capture(self) -> Program | None:
        out = self._out
        try:
            with self._phases.timed("capture"):
                program = out.program = self._compiled.program()
            if program.light is None:
                raise UnsupportedProgramError("the adapter built no replayable program")
            return program
        except UnsupportedProgramError as e:
            out.verdict = str(e)
        except Exception as e:  # any capture failure means "do not cache"
            logger.debug("program capture failed", exc_info=True)
            out.verdict = f"capturing the program failed: {type(e).__name__}: {e}"
        return None


def gradients_differ(live: Callable[..., Any], light: Callable[..., Any],
                     args: Sequence[Any], restore_rng: Callable[[], None]) -> str | None:
    """A training program's gradients against the live compile's: each run on leaves of
    its own (the call's autograd graph stays the user's), from the random state before
    the call, and differentiated with the same random output gradients (drawn from a
    generator of their own); the random state after the call is kept."""
    after = rng_snapshot()
    grads: list[tuple[Any, ...]] = []
    try:
        for fn in (live, light):
            restore_rng()
            leaves = [a.detach().requires_grad_(a.requires_grad)
                      if isinstance(a, torch.Tensor) else a for a in args]
            with torch.enable_grad():
                outs = fn(*leaves)
            outs = [o for o in (outs if isinstance(outs, (list, tuple)) else [outs])
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            inputs = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
            gen = torch.Generator().manual_seed(0)
            tangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)
                        for o in outs]
            grads.append(torch.autograd.grad(outs, inputs, tangents, allow_unused=True)
                         if outs and inputs else ())
    finally:
        after()
    return compare(grads[1], grads[0], "gradient")


def rng_snapshot() -> Callable[[], None]:
    """Restores the CPU generator (and every initialised CUDA one) to their state now."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    return restore


def compare(a: Any, b: Any, where: str = "output") -> str | None:
    """None if ``a`` and ``b`` agree (tensors exactly or within float tolerance)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if torch.equal(a, b):
            return None
        if a.is_floating_point() and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
            return None
        return f"{where}: values differ"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            m = compare(x, y, f"{where}[{i}]")
            if m:
                return m
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"
