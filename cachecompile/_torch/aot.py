"""AOTAutograd's private names for a training graph (cold path): its forward and backward
programs compiled at once, and the runtime layout that joins them, read from its metadata.

A graph that needs autograd (grad mode on, an input that requires grad) is split by
AOTAutograd into a forward program, whose outputs are the user's outputs followed by what
backward needs (tensors, then symbolic sizes), and a backward program, which takes those
and one gradient per output that requires grad, and returns one gradient per input. Its
``CompiledFunction`` joins them at run time, guided by ``ViewAndMutationMeta``. The warm
path joins them itself (:mod:`cachecompile.backends.joint`) from the plain layout read
here (:class:`cachecompile.entry.joint.Layout` reads it), for the metadata it replays
exactly; any other form is refused, which costs a live
compile, never a wrong gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from cachecompile.errors import UnsupportedProgramError

# (module, attribute path) for every private name below: checked by cachecompile._torch.probe
# when a cold compile starts.
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch._guards", "TracingContext.try_get"),
    ("torch._functorch.config", "patch"),
    ("torch._dynamo.backends.common", "aot_autograd"),
)

# The functorch option that compiles the backward with the forward, as torch's own
# precompile does, rather than at the first backward: the entry then holds both programs
# when the first call stores it. Absent from a release: the backward compiles lazily, and
# the program is refused for lacking it.
_EAGER_BACKWARD = "force_non_lazy_backward_lowering"
# And no donated buffers (a backward that reuses the saved activations' memory): torch
# decides it at the first backward, from whether that one keeps its graph, so
# torch.compile lets retain_graph=True and create_graph=True through when its first
# backward uses them. Compiled before any backward, a stored backward would have to
# refuse them always; without donation it takes them always. The arithmetic is the same.
_DONATED = "donated_buffer"


def needs_autograd(example_inputs: Sequence[Any]) -> bool:
    """AOTAutograd's own test: grad mode on and an input that requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


@contextlib.contextmanager
def backward_with_forward() -> Iterator[None]:
    """While compiling: AOTAutograd compiles a graph's backward with its forward, and
    with no donated buffers."""
    import torch._functorch.config as functorch_config

    patch = {name: value for name, value in ((_EAGER_BACKWARD, True), (_DONATED, False))
             if hasattr(functorch_config, name)}
    with functorch_config.patch(patch):
        yield


def _memory_format(meta: Any) -> dict[str, Any]:
    """A tangent's expected layout (AOTAutograd's ``MemoryFormatMeta``), as data."""
    fmt = getattr(meta, "memory_format", None)
    if fmt is not None:
        name = str(fmt).removeprefix("torch.")
        if name not in ("contiguous_format", "channels_last", "channels_last_3d"):
            raise UnsupportedProgramError(f"a tangent's memory format {fmt} is not replayable")
        return {"memory_format": name}
    size, stride = getattr(meta, "size", None), getattr(meta, "stride", None)
    if size is None or stride is None:
        raise UnsupportedProgramError("a tangent's expected layout could not be read")
    try:
        return {"size": [int(s) for s in size], "stride": [int(s) for s in stride]}
    except TypeError as e:  # symbolic: never given as size and stride, but fail closed
        raise UnsupportedProgramError(f"a tangent's layout is symbolic ({e})") from None


def _refuse(why: str) -> UnsupportedProgramError:
    return UnsupportedProgramError(f"a training graph that {why} is not cached yet (it runs "
                                   "with torch.compile)")


def _check_form(meta: Any) -> None:
    """Refuse the forms of a graph the warm join does not replay (its runtime wrappers
    would be needed): input mutations, views, RNG state, tokens, opaques, subclasses."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if meta.num_mutated_inp_runtime_indices:
        raise _refuse("mutates an input (a buffer, an argument)")
    if meta.num_intermediate_bases or getattr(meta, "num_unsafe_view_outputs", 0):
        raise _refuse("returns views of its intermediates")
    if getattr(meta, "is_rng_op_functionalized", False):
        raise _refuse("functionalizes random ops")
    if getattr(meta, "tokens", None) or getattr(meta, "num_backward_tokens", 0):
        raise _refuse("has side-effect tokens")
    if getattr(meta, "num_opaque_objects_saved_for_bw", 0):
        raise _refuse("saves opaque objects for backward")
    if any(is_traceable_wrapper_subclass(x) for x in getattr(meta, "traced_tangents", ())):
        raise _refuse("has tensor-subclass gradients")
    n_outputs = int(meta.num_outputs)
    if int(meta.num_forward_returns) != n_outputs or int(meta.num_forward) != n_outputs:
        raise _refuse("returns more than its outputs before what backward saves")


def _outputs(meta: Any) -> tuple[list[bool], list[int]]:
    """Whether each output requires grad, and which take a gradient in backward."""
    from torch._functorch._aot_autograd.schemas import OutputType
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    # What a plain tensor output is seen as while AOTAutograd traces.
    plain = (torch.Tensor, torch.nn.Parameter, FunctionalTensor, FakeTensor)
    outputs: list[bool] = []
    tangents: list[int] = []
    for i, info in enumerate(meta.output_info):
        if info.output_type is not OutputType.non_alias:
            raise _refuse(f"returns an alias ({info.output_type.name}) as output {i}")
        tensor = issubclass(info.raw_type, torch.Tensor)
        if tensor and info.raw_type not in plain:
            raise _refuse(f"returns a {info.raw_type.__name__}")
        if not tensor and info.requires_grad:
            raise _refuse(f"returns a {info.raw_type.__name__} that requires grad")
        outputs.append(bool(info.requires_grad))
        if tensor and getattr(info, "requires_grad_for_backward", info.requires_grad):
            tangents.append(i)
    return outputs, tangents


def _compiling_metadata() -> Any:
    """AOTAutograd's metadata of the graph it is compiling now (its tracing context's,
    current inside its compiler callbacks); None outside one."""
    from torch._guards import TracingContext

    return getattr(TracingContext.try_get(), "fw_metadata", None)


def layout(meta: Any, n_inputs: int, disable_amp: bool) -> dict[str, Any]:
    """The layout of a training graph from AOTAutograd's metadata ``meta``, as the record
    :class:`cachecompile.entry.joint.Layout` reads."""
    if meta is None:
        raise UnsupportedProgramError("AOTAutograd's metadata for the graph was not found")
    _check_form(meta)
    outputs, tangents = _outputs(meta)
    tangent_metas = list(getattr(meta, "subclass_tangent_meta", None) or ())
    if len(tangent_metas) != len(tangents):
        raise _refuse(f"has {len(tangent_metas)} tangents for {len(tangents)} outputs")
    deterministic = meta.deterministic
    return {"n_inputs": n_inputs, "n_outputs": len(outputs),
            "n_symints": int(meta.num_symints_saved_for_bw or 0),
            "n_unchecked": int(getattr(meta, "num_tensors_saved_with_no_vc_check", 0) or 0),
            "outputs_require_grad": outputs, "tangents": tangents,
            "tangent_layouts": [_memory_format(getattr(m, "memory_format", None))
                                for m in tangent_metas],
            "disable_amp": disable_amp,
            "deterministic": None if deterministic is None else bool(deterministic),
            "donated": bool(getattr(meta, "bw_donated_idxs", None))}


def any_autocast() -> bool:
    """Whether autocast is on for any device now (AOTAutograd then runs its programs with
    it off: the graph holds the casts)."""
    return bool(torch._C._is_any_autocast_enabled())


def _say_none_donated(meta: Any) -> None:
    """With donation off (:func:`backward_with_forward`) AOTAutograd leaves the graph's
    donated-buffer list unset, which its runtime reads as "some" (``None != []``) and then
    refuses ``retain_graph=True`` in the live compile: say none."""
    if meta is not None and getattr(meta, "bw_donated_idxs", []) is None:
        meta.bw_donated_idxs = []


def layout_or_refusal(n_inputs: int, disable_amp: bool) -> dict[str, Any] | str:
    """The layout of the training graph AOTAutograd is compiling now (:func:`layout`), or
    why there is none: called inside its forward compiler callback, where an exception
    would fail the user's live compile."""
    meta = _compiling_metadata()
    _say_none_donated(meta)
    try:
        return layout(meta, n_inputs, disable_amp)
    except UnsupportedProgramError as e:
        return str(e)
    except Exception as e:  # a release whose metadata reads otherwise: not cached
        return f"AOTAutograd's metadata did not read as expected ({type(e).__name__}: {e})"


def training_backend(on_forward: Callable[[torch.fx.GraphModule, dict[str, Any] | str], None],
                     on_backward: Callable[[torch.fx.GraphModule], None], n_inputs: int,
                     decompositions: Mapping[Any, Any] | None) -> Callable[..., Any]:
    """A Dynamo backend: AOTAutograd, both programs run by the eager kernels (aot_eager's
    training path), each seen by a callback as it is compiled."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    amp = any_autocast()

    def fw_compiler(fx_gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        on_forward(fx_gm, layout_or_refusal(n_inputs, amp))
        return make_boxed_func(fx_gm.forward)

    def bw_compiler(fx_gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        on_backward(fx_gm)
        return make_boxed_func(fx_gm.forward)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                        decompositions=dict(decompositions) if decompositions else {})
