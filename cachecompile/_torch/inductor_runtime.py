"""Light stand-ins for the few ``torch._inductor`` names that Inductor's output code imports.

Why: importing ``torch._inductor`` (which pulls in ``torch._dynamo``) costs 1.5-2 s, and
its ``AsyncCompile`` runs the CPU ISA probe and g++ before it looks for a built kernel.
A warm process needs neither. Each stand-in here is a faithful copy of the behaviour the
generated code relies on for inference (see ../shared/anchors.md, "A measured route").
The import rewriting (:func:`cachecompile._torch.inductor.rewrite_imports`) only swaps
an import when this module has a stand-in for exactly that name; anything else keeps the
real import (slow but correct).

This module must stay cheap to import: ``torch`` only. Stored programs import it by its
full name (``cachecompile._torch.inductor_runtime``), so moving it is a format change.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from cachecompile.errors import UnsupportedProgramError

logger = logging.getLogger(__name__)

# (module, attribute path) for every private name below: checked by cachecompile._torch.probe.
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch", "_C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr"),
    ("torch", "_C._dynamo.guards.assert_size_stride"),
)

ALIGN_BYTES = 64


def align(nbytes: int) -> int:
    """``torch._inductor.utils._align``: round up to a multiple of ALIGN_BYTES."""
    return (nbytes + ALIGN_BYTES - 1) & -ALIGN_BYTES


def assert_tensor_metadata(tensor: torch.Tensor | None, expected_size: tuple[Any, ...],
                           expected_stride: tuple[Any, ...], expected_dtype: torch.dtype,
                           op_name: str | None = None) -> None:
    """``torch._inductor.runtime.runtime_utils.assert_tensor_metadata`` (output code of
    torch 2.15 imports it): the same dtype check and the same C++ size/stride check."""
    if tensor is None:
        return
    if tensor.dtype != expected_dtype:
        op_msg = f"\nError in op: {op_name}" if op_name else ""
        raise RuntimeError(f"expected dtype {expected_dtype} but got {tensor.dtype}{op_msg}")
    torch._C._dynamo.guards.assert_size_stride(
        tensor, expected_size, expected_stride, op_name)


def run_intermediate_hooks(name: str, val: Any) -> None:
    """``torch._inductor.hooks.run_intermediate_hooks`` with no hooks installed."""


@contextlib.contextmanager
def maybe_profile(should_profile: bool, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """``torch._inductor.utils.maybe_profile``."""
    if should_profile:
        with torch.profiler.profile(*args, **kwargs) as p:
            yield p
    else:
        yield


class _ExternKernels:
    """``torch._inductor.select_algorithm.extern_kernels`` for the ATen fallbacks.

    Inductor registers each ``ExternKernelChoice(torch.mm, ...)`` under the name ``mm``.
    The adapter checks at capture time that every name the program uses resolves to the
    very same function here as in the real namespace; otherwise it keeps the real import.
    """

    def __getattr__(self, name: str) -> Any:
        fn = getattr(torch, name, None)
        if fn is None:
            raise AttributeError(f"no light extern kernel {name!r}")
        # Kept, so that the program's next call (once per kernel per call) finds it
        # without this Python lookup.
        setattr(self, name, fn)
        return fn


extern_kernels = _ExternKernels()


def kernel_digest(argtypes: list[str], source: str) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    h.update(repr(list(argtypes)).encode())
    h.update(b"\0")
    h.update(source.encode())
    return h.hexdigest()


@functools.cache
def _tensor_data_ptr() -> str:
    return str(torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)  # type: ignore[attr-defined]


def load_kernel_library(path: Path, digest: str) -> Callable[..., Any]:
    """Load a prebuilt Inductor C++ kernel (a CPython extension exposing ``kernel``)."""
    # Inductor's bindings read this env var to find a C helper: a function POINTER in
    # this process. Always overwrite it (as Inductor does): a value inherited from a
    # parent process that loaded kernels points into that process and crashes here.
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = _tensor_data_ptr()
    # The module's last name component must be "kernel": the .so exports PyInit_kernel.
    name = f"cachecompile_k{digest}.kernel"
    module = sys.modules.get(name)
    if module is None:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        if spec is None:
            raise UnsupportedProgramError(f"cannot load kernel library {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        sys.modules[name] = module
    return module.kernel


class LightAsyncCompile:
    """``AsyncCompile`` that hands out prebuilt kernels from an entry, compiling nothing."""

    def __init__(self, kernels: Mapping[str, Path]) -> None:
        self._kernels = kernels

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., Any]:
        digest = kernel_digest(argtypes, source_code)
        path = self._kernels.get(digest)
        if path is None:
            raise UnsupportedProgramError(f"entry lacks the built kernel {digest}")
        return load_kernel_library(path, digest)

    def wait(self, scope: dict[str, Any]) -> None:
        """Kernels are loaded eagerly; nothing to wait for."""

    def __getattr__(self, name: str) -> Any:
        raise UnsupportedProgramError(f"the light runtime has no AsyncCompile.{name}")


def light_async_compile_factory(kernels: Mapping[str, Path]) -> Callable[[], LightAsyncCompile]:
    return lambda: LightAsyncCompile(kernels)
