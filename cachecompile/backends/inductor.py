"""The Inductor adapter (CPU and CUDA). Every torch-version hack for Inductor lives here.

Capture (cold process): Dynamo's graph goes through ``compile_fx`` as usual; a wrapper
around ``compile_fx_inner`` keeps the ``CompiledFxGraph``. Its ``source_code`` is the
Python "output code" that Inductor itself executes. We rewrite the handful of
``torch._inductor`` imports at its top to the light stand-ins in ``cachecompile._runtime``,
then execute it once with a recording ``AsyncCompile`` that asks Inductor's own code cache
for each C++ kernel and notes the path of the built ``.so``. The program file plus those
binaries are the entry: a warm process execs the program with a ``LightAsyncCompile``
that loads the binaries directly, so it never imports ``torch._inductor``, never probes
the CPU ISA and never runs g++.

Triton kernels (CUDA) keep the real ``AsyncCompile``: the warm path stays correct but
imports Inductor and relies on Triton's own cache for the binaries (not yet bundled).

Refused (the call goes on with a live compile and a warning): more than one Inductor
graph, AOTAutograd changing the argument list (duplicate or synthetic-base inputs),
``cpp_wrapper``, freezing, CUDA graphs.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import _runtime
from ..errors import UnsupportedProgramError
from .base import JSON, Compiled, GraphCallable, Program, package_version

logger = logging.getLogger(__name__)

name = "inductor"

PROGRAM_FILE = "program.py"
CONSTANTS_FILE = "constants.pt"

# Top-level imports of Inductor's output code that have a light stand-in.
# (module, name) -> the line that replaces the import (alias substituted).
_STANDINS: dict[tuple[str, str], str] = {
    ("torch._inductor.hooks", "run_intermediate_hooks"):
        "from cachecompile._runtime import run_intermediate_hooks as {alias}",
    ("torch._inductor.utils", "maybe_profile"):
        "from cachecompile._runtime import maybe_profile as {alias}",
    ("torch._inductor.codegen.memory_planning", "_align"):
        "from cachecompile._runtime import align as {alias}",
    ("torch._inductor.utils", "_align"):
        "from cachecompile._runtime import align as {alias}",
    ("torch._inductor.select_algorithm", "extern_kernels"):
        "from cachecompile._runtime import extern_kernels as {alias}",
    ("torch._inductor.async_compile", "AsyncCompile"):
        "{alias} = __cachecompile_async_compile__",
}
_IMPORT_RE = re.compile(r"^from (torch\._(?:inductor|dynamo)[\w.]*) import (\w+)(?: as (\w+))?$")
_EXTERN_RE = re.compile(r"\bextern_kernels\.(\w+)\b")
# Env vars that change what Inductor generates (cache locations excluded: they do not).
# Prefixes only for torch's own namespaces; other variables by exact name (as prefixes,
# "CC" and "CXX" also matched CCACHE_DIR, CC_DIR, CXXFLAGS and split the cache).
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_")
_ENV_NAMES = {"ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "CXX", "CC"}
_ENV_IGNORED = {"TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
                "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE",
                "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_COMPILE_THREADS",
                "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_VEC_ISA_OK"}
_UNSUPPORTED_OPTIONS = ("cpp_wrapper", "freezing", "triton.cudagraphs", "aot_inductor.package")


@functools.cache
def _cpu_identity() -> dict[str, JSON]:
    """The CPU features that ``-march=native`` kernels depend on."""
    import xxhash

    model, flags = "unknown", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import platform

    return {"machine": platform.machine(), "model": model,
            "flags": xxhash.xxh3_64_hexdigest(" ".join(sorted(flags.split())).encode())}


@functools.cache
def _compiler_identity() -> dict[str, JSON]:
    """Which C++ compiler builds the kernels, identified without running it (cheap)."""
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        return {"cxx": cxx, "path": None}
    real = os.path.realpath(path)
    st = os.stat(real)
    return {"cxx": cxx, "path": real, "size": st.st_size, "mtime": int(st.st_mtime)}


def _env_factors() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items())
            if (k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)) and k not in _ENV_IGNORED}


class InductorAdapter:
    name = "inductor"
    shares_graphs = True

    def factors(self, options: Mapping[str, Any]) -> dict[str, JSON]:
        f: dict[str, JSON] = {
            "triton": package_version("triton"),
            "cpu": _cpu_identity(),
            "compiler": _compiler_identity(),
            # Inductor bakes the OpenMP thread count into the generated C++.
            "num_threads": torch.get_num_threads(),
            "env": _env_factors(),
        }
        return f

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        import torch._functorch.config as functorch_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        captured: list[Any] = []

        def inner(gm2: Any, ex2: Sequence[Any], **kwargs: Any) -> Any:
            out = compile_fx_inner(gm2, ex2, **kwargs)
            captured.append((out, gm2))
            return out

        n_inputs = len(example_inputs)
        # AOTAutograd's cache would hand back a compiled graph without calling
        # inner_compile, so there would be nothing to capture. Inductor's FX graph
        # cache below it stays on: a cache hit still yields a CompiledFxGraph.
        with functorch_config.patch(enable_autograd_cache=False):
            live: Any = compile_fx(gm, example_inputs, inner_compile=inner,
                              config_patches=dict(options) or None,
                              decompositions=dict(decompositions) if decompositions else None)

        def program() -> Program:
            return _capture_program(captured, n_inputs, options)

        return Compiled(live=live, program=program)

    def load(self, files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
        kernels = {digest: files[rel] for digest, rel in meta["kernels"].items()}
        if meta.get("async_compile") == "light":
            async_compile: Callable[[], Any] = _runtime.light_async_compile_factory(kernels)
        else:
            from torch._inductor.async_compile import AsyncCompile

            async_compile = AsyncCompile
        constants: dict[str, torch.Tensor] = {}
        if CONSTANTS_FILE in files:
            # weights_only=True: the restricted unpickler; an entry's bytes are untrusted.
            constants = torch.load(files[CONSTANTS_FILE], weights_only=True)
        src = files[PROGRAM_FILE].read_text(encoding="utf-8")
        return _exec_program(src, str(files[PROGRAM_FILE]), async_compile, constants,
                             meta.get("inputs_to_check", []))


def _exec_program(src: str, filename: str, async_compile: Callable[[], Any],
                  constants: Mapping[str, Any], inputs_to_check: Sequence[int]) -> GraphCallable:
    ns: dict[str, Any] = {"__name__": "cachecompile_program", "__file__": filename,
                          "__cachecompile_async_compile__": async_compile}
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - the entry was verified and owned
    ns.update(constants)
    call = ns["call"]
    check = tuple(inputs_to_check)

    if not check:
        def compiled_fn(*args: Any) -> Any:
            return call(list(args))
    else:
        def compiled_fn(*args: Any) -> Any:
            # Inductor assumes these inputs are 16-byte aligned and copies any that are
            # not (its align_inputs_from_check_idxs); keep that behaviour.
            flat = list(args)
            for i in check:
                t = flat[i]
                if isinstance(t, torch.Tensor) and t.data_ptr() % 16:
                    flat[i] = t.clone()
            return call(flat)

    return compiled_fn


def rewrite_imports(src: str) -> tuple[str, list[str]]:
    """Swap top-level ``torch._inductor`` imports for light stand-ins where one exists.

    Returns the new source and the imports that stay real (each costs Inductor's import).
    """
    used_extern = set(_EXTERN_RE.findall(src))
    extern_ok = True
    if used_extern:
        from torch._inductor.select_algorithm import extern_kernels as real_extern

        for n in used_extern:
            try:
                light = getattr(_runtime.extern_kernels, n)
            except AttributeError:
                extern_ok = False
                break
            if getattr(real_extern, n, None) is not light:
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


class _RecordingAsyncCompile:
    """Runs the program once at capture time, noting where each built kernel lives."""

    def __init__(self) -> None:
        self.kernels: dict[str, str] = {}
        self.needs_real = False
        self._real: Any = None

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., Any]:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        fn = CppPythonBindingsCodeCache.load_pybinding(argtypes, source_code)
        path = getattr(getattr(fn, "__self__", None), "__file__", None)
        if not path or not os.path.isfile(path):
            raise UnsupportedProgramError("could not locate a built C++ kernel library")
        self.kernels[_runtime.kernel_digest(argtypes, source_code)] = path
        return fn  # type: ignore[no-any-return]

    def wait(self, scope: dict[str, Any]) -> None:
        if self._real is not None:
            self._real.wait(scope)

    def __getattr__(self, attr: str) -> Any:
        # triton, cuda, halide...: keep Inductor's own machinery for these.
        if self._real is None:
            from torch._inductor.async_compile import AsyncCompile

            self._real = AsyncCompile()
        self.needs_real = True
        return getattr(self._real, attr)


def _capture_program(captured: list[Any], n_inputs: int, options: Mapping[str, Any]) -> Program:
    from torch._inductor import config as inductor_config
    from torch._inductor.output_code import CompiledFxGraph

    for opt in _UNSUPPORTED_OPTIONS:
        value = options.get(opt, inductor_config.get_config_copy().get(opt))
        if value:
            raise UnsupportedProgramError(f"Inductor option {opt}={value!r} is not replayable")
    if len(captured) != 1:
        raise UnsupportedProgramError(f"expected one Inductor graph, got {len(captured)}")
    out, aot_gm = captured[0]
    if not isinstance(out, CompiledFxGraph) or not out.source_code:
        raise UnsupportedProgramError(f"Inductor returned {type(out).__name__}, not a CompiledFxGraph")
    n_aot = sum(1 for n in aot_gm.graph.nodes if n.op == "placeholder")
    if n_aot != n_inputs:
        # AOTAutograd deduplicated or merged inputs: its runtime wrappers would be needed.
        raise UnsupportedProgramError(
            f"AOTAutograd changed the inputs ({n_inputs} graph inputs, {n_aot} compiled)")
    if out.torchbind_constants:
        raise UnsupportedProgramError("the graph holds torchbind objects")

    src, heavy = rewrite_imports(out.source_code)
    recorder = _RecordingAsyncCompile()
    constants = {k: v for k, v in (out.constants or {}).items()}
    if any(not isinstance(v, torch.Tensor) for v in constants.values()):
        raise UnsupportedProgramError("the graph holds non-tensor constants")
    inputs_to_check = [int(i) for i in (out.inputs_to_check or ())]
    # Execute the program exactly as a warm process would, except that kernels come from
    # Inductor's cache (already built) so we learn their paths.
    light = _exec_program(src, "<cachecompile capture>", lambda: recorder, constants,
                          inputs_to_check)

    files: dict[str, bytes | Path] = {PROGRAM_FILE: src.encode("utf-8")}
    kernels: dict[str, str] = {}
    for digest, path in sorted(recorder.kernels.items()):
        rel = f"kernels/{digest}.so"
        files[rel] = Path(path)
        kernels[digest] = rel
    if constants:
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() if v.device.type == "meta" else v.detach()
                    for k, v in constants.items()}, buf)
        files[CONSTANTS_FILE] = buf.getvalue()
    if heavy:
        logger.info("the warm path of this program keeps real imports: %s", ", ".join(heavy))
    meta: dict[str, JSON] = {
        "kernels": kernels,
        "async_compile": "real" if recorder.needs_real else "light",
        "heavy_imports": heavy,
        "inputs_to_check": inputs_to_check,
        "mutated_inputs": sorted(int(i) for i in (out.mutated_input_idxs or ())),
        "n_inputs": n_inputs,
        "python": sys.version_info[:2],
    }
    return Program(files=files, meta=meta, light=light,
                   mutated_inputs=tuple(meta["mutated_inputs"]))


ADAPTER = InductorAdapter()
