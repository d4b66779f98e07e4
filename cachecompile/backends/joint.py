"""A training graph's two stored programs joined into one differentiable call.

What AOTAutograd's ``CompiledFunction`` does at run time for a graph of the forms
:func:`cachecompile._torch.aot.layout` accepts, rebuilt from the stored
:class:`~cachecompile.entry.joint.Layout` without AOTAutograd: the forward program runs
with grad off and its saved values go to the autograd context; the backward program
takes the saved sizes, the saved tensors and the output gradients (each laid out as the
program was traced for) and returns one gradient per input. The adapters share it: each
stores its two programs with :func:`join_programs` and loads them with :func:`load`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from cachecompile._torch import runtime
from cachecompile.backends.base import GraphCallable, Program
from cachecompile.entry import joint as joint_format
from cachecompile.entry.joint import Layout
from cachecompile.errors import UnsupportedProgramError
from cachecompile.store.jsonvalue import JSON

# torch's own words for the two refusals, so that a user sees what torch.compile says.
_DETERMINISTIC = ("This compiled backward function is being run with "
                  "torch.use_deterministic_algorithms(True), but it was previously generated "
                  "during the forward function while torch.use_deterministic_algorithms(False) "
                  "was set.")
_DONATED = ("This backward function was compiled with non-empty donated buffers which "
            "requires create_graph=False and retain_graph=False. Please keep "
            "backward(create_graph=False, retain_graph=False) across all backward() "
            "function calls, or set torch._functorch.config.donated_buffer=False to disable "
            "donated buffer.")


_DOUBLE_BACKWARD = ("torch.compile with aot_autograd does not currently support double "
                    "backward (cachecompile: the same for a cached training graph). Take the "
                    "second derivative through the module itself, uncompiled, or through "
                    "torch.func.")


def _coercer(spec: Mapping[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """An output gradient laid out as the backward program was traced for (AOTAutograd's
    ``coerce_to_expected_memory_format``)."""
    if "memory_format" in spec:
        fmt = getattr(torch, spec["memory_format"])

        def to_format(x: torch.Tensor) -> torch.Tensor:
            return x if x.is_contiguous(memory_format=fmt) else x.contiguous(memory_format=fmt)

        return to_format
    size, stride = tuple(spec["size"]), tuple(spec["stride"])

    def restride(x: torch.Tensor) -> torch.Tensor:
        if x.shape == size and x.stride() == stride:
            return x
        out = torch.empty_strided(size, stride, dtype=x.dtype, device=x.device,
                                  layout=x.layout, requires_grad=x.requires_grad)
        out.copy_(x)
        return out

    return restride


def joined(forward: GraphCallable, backward: GraphCallable, layout: Layout) -> GraphCallable:
    """The graph callable of a training program: flat inputs -> the outputs, with an
    autograd node that runs ``backward``."""
    n_out, n_sym, n_unchecked = layout.n_outputs, layout.n_symints, layout.n_unchecked
    not_diff = [i for i, rg in enumerate(layout.outputs_require_grad) if not rg]
    tangents = layout.tangents
    coerce = [_coercer(t) for t in layout.tangent_layouts]
    amp_off: Callable[[], Any] = runtime.autocast_off if layout.disable_amp \
        else contextlib.nullcontext
    check_deterministic = layout.deterministic is False
    donated = layout.donated
    n_inputs = layout.n_inputs

    class JointProgram(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            with amp_off():
                outs = list(forward(*args))
            end = len(outs) - n_sym
            saved = [x.detach() if runtime.is_view(x) else x for x in outs[n_out:end]]
            checked = len(saved) - n_unchecked
            ctx.save_for_backward(*saved[:checked])
            ctx.cc_unchecked = saved[checked:]
            ctx.cc_symints = outs[end:]
            user = outs[:n_out]
            ctx.mark_non_differentiable(*[user[i] for i in not_diff
                                          if isinstance(user[i], torch.Tensor)])
            return tuple(user)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            if check_deterministic and torch.are_deterministic_algorithms_enabled():
                raise RuntimeError(_DETERMINISTIC)
            if donated and runtime.keeps_graph():
                raise RuntimeError(_DONATED)
            args = [*ctx.cc_symints, *ctx.saved_tensors, *ctx.cc_unchecked,
                    *(c(grads[i]) for c, i in zip(coerce, tangents, strict=True))]

            def run() -> tuple[Any, ...]:
                with amp_off():
                    out = tuple(backward(*args))
                if len(out) != n_inputs:
                    raise RuntimeError(f"cachecompile: the stored backward returned "
                                       f"{len(out)} gradients for {n_inputs} inputs")
                return out

            if torch.is_grad_enabled():
                # create_graph=True: the gradients are computed, and a second backward
                # through them refused, as AOTAutograd's CompiledFunctionBackward does.
                return _SecondBackward.apply(run, torch.empty(0, requires_grad=True))
            return run()

    def call(*args: Any) -> Any:
        return JointProgram.apply(*args)

    return call


class _SecondBackward(torch.autograd.Function):
    """The gradients of a backward run with ``create_graph=True``: a node that refuses
    to be differentiated (AOTAutograd compiles no double backward)."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[], tuple[Any, ...]], _anchor: torch.Tensor) -> Any:
        return run()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(_DOUBLE_BACKWARD)


def join_programs(forward: Program, backward: Program,
                  raw_layout: Mapping[str, Any] | str) -> Program:
    """One stored program of a training graph's two (the backward's files under
    ``backward/``, its record under ``backward``); ``raw_layout`` as
    :func:`cachecompile._torch.aot.layout_or_refusal` gave it (the refusal raised here),
    checked as a load checks it."""
    if isinstance(raw_layout, str):
        raise UnsupportedProgramError(raw_layout)
    layout = Layout.from_json(raw_layout)
    if forward.mutated_inputs or backward.mutated_inputs:
        raise UnsupportedProgramError("a training graph that mutates an input is not cached yet")
    if forward.light is None or backward.light is None:
        raise UnsupportedProgramError("the adapter built no replayable training program")
    files = dict(forward.files)
    files.update({joint_format.BACKWARD_DIR + k: v for k, v in backward.files.items()})
    meta: dict[str, JSON] = dict(forward.meta)
    meta[joint_format.KEY] = layout.to_json()
    meta[joint_format.BACKWARD_META] = backward.meta
    # Both programs' custom operators: a warm process lacking one misses by name.
    ops = sorted({*_names(forward.meta.get("operators")), *_names(backward.meta.get("operators"))})
    if ops:
        meta["operators"] = list(ops)
        meta["op_namespaces"] = sorted({*_names(forward.meta.get("op_namespaces")),
                                        *_names(backward.meta.get("op_namespaces"))})
    return Program(files=files, meta=meta, light=joined(forward.light, backward.light, layout))


def _names(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def load(load_one: Callable[[Mapping[str, Path], Mapping[str, JSON]], GraphCallable],
         files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
    """A stored training program's callable, each half loaded by ``load_one`` (the
    adapter's loader of one program)."""
    layout = joint_format.layout_of(meta)
    if layout is None:
        raise UnsupportedProgramError("the entry's program is no training program")
    bw_meta = meta.get(joint_format.BACKWARD_META)
    if not isinstance(bw_meta, Mapping):
        raise UnsupportedProgramError("the entry's training program has no backward record")
    prefix = joint_format.BACKWARD_DIR
    fw_files = {k: v for k, v in files.items() if not k.startswith(prefix)}
    bw_files = {k[len(prefix):]: v for k, v in files.items() if k.startswith(prefix)}
    return joined(load_one(fw_files, meta), load_one(bw_files, bw_meta), layout)
