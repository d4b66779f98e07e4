"""Inductor's private names, for the cold path: compile, output code, kernels, import rewriting.

Importing this module is cheap: each function imports the part of ``torch._inductor`` it
needs when it is called (a warm process of a C++ program never calls one; a Triton
program's warm path calls :func:`async_compile_class`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import unittest.mock
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from cachecompile._torch import inductor_runtime, versions

logger = logging.getLogger(__name__)

# (module, attribute path) for every private name below: checked by cachecompile._torch.probe
# when a cold compile with Inductor starts.
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch._inductor.compile_fx", "compile_fx"),
    ("torch._inductor.compile_fx", "compile_fx_inner"),
    ("torch._inductor.freezing", "freeze"),
    ("torch._functorch.config", "patch"),
    ("torch._functorch.config", "enable_autograd_cache"),
    ("torch._inductor.config", "get_config_copy"),
    ("torch._inductor.output_code", "CompiledFxGraph"),
    ("torch._inductor.async_compile", "AsyncCompile"),
    ("torch._inductor.codecache", "CppPythonBindingsCodeCache.load_pybinding"),
    ("torch._inductor.select_algorithm", "extern_kernels"),
    ("torch._inductor.cpu_vec_isa", "valid_vec_isa_list"),
    ("torch._inductor.cpu_vec_isa", "VecAVX2"),
    ("torch._inductor.cpu_vec_isa", "VecAVX512"),
)


# -- compiling -----------------------------------------------------------------------------
def compile_capturing(gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                      decompositions: Mapping[Any, Any] | None,
                      on_forward: Callable[[], Any] | None = None) -> tuple[Any, list[Any]]:
    """``compile_fx`` as torch.compile runs it, keeping what ``compile_fx_inner`` returned.

    Returns the live callable and a list that fills, as graphs compile, with
    ``(compiled graph, AOTAutograd's graph module, kept, role)`` tuples. ``kept`` is None,
    or under freezing the indices of the inputs the compiled graph still takes (the others,
    the weights, became its constants): what ``freeze`` returned. ``role`` is "backward"
    for a training graph's backward, else what ``on_forward`` returned when the graph was
    compiled (called while AOTAutograd's metadata for it is current), or None.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.freezing as freezing
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    captured: list[Any] = []
    kept: list[list[int]] = []
    real_freeze = freezing.freeze

    def freeze(*args: Any, **kwargs: Any) -> Any:
        opt_model, preserved = real_freeze(*args, **kwargs)
        kept.append([int(i) for i in preserved])
        return opt_model, preserved

    def inner(gm2: Any, ex2: Sequence[Any], **kwargs: Any) -> Any:
        role = "backward" if kwargs.get("is_backward") else \
            on_forward() if on_forward is not None else None
        out = compile_fx_inner(gm2, ex2, **kwargs)
        captured.append((out, gm2, kept.pop() if kept else None, role))
        return out

    # AOTAutograd's cache would hand back a compiled graph without calling
    # inner_compile, so there would be nothing to capture. Inductor's FX graph
    # cache below it stays on: a cache hit still yields a CompiledFxGraph.
    with functorch_config.patch(enable_autograd_cache=False), \
            unittest.mock.patch.object(freezing, "freeze", freeze):
        live = compile_fx(gm, example_inputs, inner_compile=inner,
                          config_patches=config_patches(options) or None,
                          decompositions=dict(decompositions) if decompositions else None)
    return live, captured


def config_value(name: str) -> Any:
    """The current value of an Inductor config option (``cpp_wrapper``, ``triton.cudagraphs``)."""
    from torch._inductor import config as inductor_config

    return inductor_config.get_config_copy().get(name)


@dataclasses.dataclass(frozen=True)
class OutputCode:
    """What a ``CompiledFxGraph`` holds that a replayed program needs."""

    source_code: str                 # the Python output code Inductor itself executes
    constants: dict[str, Any]
    torchbind_constants: dict[str, Any]
    inputs_to_check: tuple[int, ...]  # inputs the program assumes are aligned
    mutated_inputs: tuple[int, ...]


def output_code(compiled: Any) -> OutputCode | None:
    """The output code of what ``compile_fx_inner`` returned; None if it is no CompiledFxGraph."""
    from torch._inductor.output_code import CompiledFxGraph

    if not isinstance(compiled, CompiledFxGraph):
        return None
    return OutputCode(source_code=compiled.source_code or "",
                      constants=dict(compiled.constants or {}),
                      torchbind_constants=dict(compiled.torchbind_constants or {}),
                      inputs_to_check=tuple(int(i) for i in (compiled.inputs_to_check or ())),
                      mutated_inputs=tuple(int(i) for i in (compiled.mutated_input_idxs or ())))


# -- CPU targets ---------------------------------------------------------------------------
@functools.cache
def _plain_isa(vec: str) -> Any:
    """Inductor's vector ISA ``vec`` with nothing this CPU adds: AVX-512 without the
    ``-mavx512bf16`` Inductor appends where this CPU has it (an x86-64-v4 host may not)."""
    from torch._inductor import cpu_vec_isa

    isa: Any
    if vec == "avx2":
        isa = cpu_vec_isa.VecAVX2()
    elif vec == "avx512":
        @dataclasses.dataclass
        class PlainAVX512(cpu_vec_isa.VecAVX512):
            # A class of its own: VecISA instances compare equal by class and fields, and
            # Inductor caches __bool__ and the bf16 answer per equal instance.
            __hash__ = cpu_vec_isa.VecAVX512.__hash__

            def is_avx512_bf16_supported(self) -> bool:  # type: ignore[override]
                return False

            def build_arch_flags(self) -> str:
                return str(self._arch_flags)

        isa = PlainAVX512()
    else:
        raise ValueError(f"no vector ISA named {vec!r}")
    # Its dry compile and load, as Inductor checks every ISA it picks from.
    return isa if bool(isa) else None


def config_patches(options: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor's config patches for ``options``, as this release takes them.

    torch 2.11 and 2.12 have no ``cpp.march`` setting (their ``-march=native`` is a literal
    in ``cpp_builder._get_optimization_cflags``): the option is taken out here and
    :func:`vec_isa_limited` puts the level's ``-march`` into the flags instead. Their FX
    graph cache is off for such a compile: its key holds the Inductor config, which on
    these releases says nothing of the level, so it could hand back output code generated
    for this CPU's vector ISA (on 2.13+ ``cpp.march`` is in that key)."""
    out = dict(options)
    if "cpp.march" in out and not versions.at_least(2, 13):
        del out["cpp.march"]
        out["fx_graph_cache"] = False
    return out


@contextlib.contextmanager
def vec_isa_limited(march: str, vec: str | None) -> Iterator[None]:
    """Compile for ``-march=<march>`` with vector ISA ``vec`` at most (None: scalar
    kernels): Inductor's ``cpp.march`` (on 2.11 and 2.12, the ``-march`` in its flags, see
    :func:`config_patches`) plus its list of valid vector ISAs, which every pick of an ISA
    (codegen, the kernels' build command, the code cache's key) reads."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder, cpu_vec_isa

    isas = [i for i in ([_plain_isa(vec)] if vec else []) if i is not None]
    if vec and not isas:
        logger.warning("Inductor's %s vector ISA failed its build check here; the kernels "
                       "for %s are scalar", vec, march)
    if versions.at_least(2, 13):
        march_set: contextlib.AbstractContextManager[Any] = inductor_config.patch(
            {"cpp.march": march})
    else:
        real_cflags = cpp_builder._get_optimization_cflags

        def cflags(*args: Any, **kwargs: Any) -> tuple[list[str], list[str]]:
            flags, ldflags = real_cflags(*args, **kwargs)
            return [f"march={march}" if f == "march=native" else f for f in flags], ldflags

        march_set = unittest.mock.patch.object(cpp_builder, "_get_optimization_cflags", cflags)
    with march_set, \
            unittest.mock.patch.object(cpu_vec_isa, "valid_vec_isa_list", lambda: list(isas)):
        yield


# -- kernels -------------------------------------------------------------------------------
def async_compile_class() -> type:
    """Inductor's own ``AsyncCompile`` (Triton, CUDA, Halide kernels: builds what it must)."""
    from torch._inductor.async_compile import AsyncCompile

    return AsyncCompile


def load_cpp_kernel(argtypes: list[str], source_code: str) -> tuple[Callable[..., Any], str | None]:
    """A C++ kernel from Inductor's code cache (built if missing) and its library's path."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    fn = CppPythonBindingsCodeCache.load_pybinding(argtypes, source_code)
    path = getattr(getattr(fn, "__self__", None), "__file__", None)
    return fn, path


def real_extern_kernel(name: str) -> Any:
    """``extern_kernels.<name>`` as Inductor's own namespace has it (None if it has none)."""
    from torch._inductor.select_algorithm import extern_kernels

    return getattr(extern_kernels, name, None)


# -- the output code's imports -------------------------------------------------------------
_LIGHT = inductor_runtime.__name__
# Top-level imports of Inductor's output code that have a light stand-in.
# (module, name) -> the line that replaces the import (alias substituted).
_STANDINS: dict[tuple[str, str], str] = {
    ("torch._inductor.hooks", "run_intermediate_hooks"):
        f"from {_LIGHT} import run_intermediate_hooks as {{alias}}",
    # torch 2.15's output code imports it; 2.13 and 2.14 emit no such line.
    ("torch._inductor.runtime.runtime_utils", "assert_tensor_metadata"):
        f"from {_LIGHT} import assert_tensor_metadata as {{alias}}",
    ("torch._inductor.utils", "maybe_profile"):
        f"from {_LIGHT} import maybe_profile as {{alias}}",
    ("torch._inductor.codegen.memory_planning", "_align"):
        f"from {_LIGHT} import align as {{alias}}",
    ("torch._inductor.utils", "_align"):
        f"from {_LIGHT} import align as {{alias}}",
    ("torch._inductor.select_algorithm", "extern_kernels"):
        f"from {_LIGHT} import extern_kernels as {{alias}}",
    ("torch._inductor.async_compile", "AsyncCompile"):
        "{alias} = __cachecompile_async_compile__",
}
_IMPORT_RE = re.compile(r"^from (torch\._(?:inductor|dynamo)[\w.]*) import (\w+)(?: as (\w+))?$")
_EXTERN_RE = re.compile(r"\bextern_kernels\.(\w+)\b")


def rewrite_imports(src: str) -> tuple[str, list[str]]:
    """Swap top-level ``torch._inductor`` imports of output code for light stand-ins.

    A stand-in replaces an import only where :mod:`.inductor_runtime` has exactly that
    name (``extern_kernels`` only if every kernel the code uses is the very same function
    as in Inductor's namespace). The program calls ``AsyncCompile`` through the name
    ``__cachecompile_async_compile__``, which its loader provides. Returns the new source
    and the imports that stay real (each costs Inductor's import in a warm process).
    """
    used_extern = set(_EXTERN_RE.findall(src))
    extern_ok = True
    for n in sorted(used_extern):
        try:
            light = getattr(inductor_runtime.extern_kernels, n)
        except AttributeError:
            extern_ok = False
            break
        if real_extern_kernel(n) is not light:
            extern_ok = False
            break
    out: list[str] = []
    heavy: list[str] = []
    for line in src.splitlines():
        m = _IMPORT_RE.match(line)
        if m:
            module, imported, alias = m.group(1), m.group(2), m.group(3) or m.group(2)
            template = _STANDINS.get((module, imported))
            if imported == "extern_kernels" and not extern_ok:
                template = None
            if template is not None:
                out.append(template.format(alias=alias))
                continue
            heavy.append(f"{module}.{imported}")
        out.append(line)
    return "\n".join(out) + "\n", heavy
