"""The Inductor adapter (CPU and CUDA). Inductor's private names are in cachecompile._torch.

Capture (cold process): Dynamo's graph goes through ``compile_fx`` as usual; a wrapper
around ``compile_fx_inner`` keeps the ``CompiledFxGraph``. Its ``source_code`` is the
Python "output code" that Inductor itself executes. We rewrite the handful of Inductor
imports at its top to the light stand-ins in ``cachecompile._torch.inductor_runtime``,
then execute it once with a recording ``AsyncCompile`` that asks Inductor's own code
cache for each C++ kernel and notes the path of the built ``.so``. The program file plus
those binaries are the entry: a warm process execs the program with a
``LightAsyncCompile`` that loads the binaries directly, so it never imports
``torch._inductor``, never probes the CPU ISA and never runs g++.

Triton kernels (CUDA) keep the real ``AsyncCompile``: the warm path stays correct but
imports Inductor and relies on Triton's own cache for the binaries (not yet bundled).

Freezing (``config={"freezing": True}``, inference): the weights become the program's
constants, stored in the entry (``constants.pt``) with the indices of the inputs the
program still takes; the key holds the weights' content (``frozen_state``), so other
weights are a miss, never the old ones. Only the module's own state may be frozen.

A training graph (a call that needs autograd) is two Inductor graphs, its forward and
backward, each captured as above and stored together (:mod:`cachecompile.backends.joint`).

Refused (the call goes on with a live compile and a warning): more Inductor graphs than
that, AOTAutograd changing the argument list (duplicate or synthetic-base inputs),
``cpp_wrapper``, CUDA graphs, freezing set in ``torch._inductor.config`` rather than
given to ``cache_compile`` (the key would not hold the weights).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import shutil
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cachecompile import _torch
from cachecompile._torch import inductor_runtime
from cachecompile.backends.base import (
    JSON,
    Adapter,
    Compiled,
    GraphCallable,
    Program,
    package_version,
)
from cachecompile.entry import codeobj
from cachecompile.entry import files as entry_files
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key import cpu, passes
from cachecompile.key.passes import check as check_passes
from cachecompile.key.passes import merge as merge_passes

logger = logging.getLogger(__name__)

name = "inductor"

PROGRAM_FILE = entry_files.INDUCTOR_PROGRAM
PROGRAM_CODE = entry_files.INDUCTOR_PROGRAM_CODE
CONSTANTS_FILE = "constants.pt"

# Env vars that change what Inductor generates (cache locations excluded: they do not).
# Prefixes only for torch's own namespaces; other variables by exact name (as prefixes,
# "CC" and "CXX" also matched CCACHE_DIR, CC_DIR, CXXFLAGS and split the cache).
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_")
_ENV_NAMES = {"ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "CXX", "CC"}
_ENV_IGNORED = {"TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
                "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE",
                "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_COMPILE_THREADS",
                "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_VEC_ISA_OK"}
_UNSUPPORTED_OPTIONS = ("cpp_wrapper", "triton.cudagraphs", "aot_inductor.package")


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


def _level(options: Mapping[str, Any]) -> str | None:
    """The named level the options build for (None: native or a march of the user's)."""
    march = options.get("cpp.march")
    return march if march in cpu.BY_NAME else None


def _building_for(level: cpu.Level | None) -> contextlib.AbstractContextManager[None]:
    """Inductor's vector ISA choice held to the level, so that the compiler's flags and
    the kernels' vector code agree (-march alone leaves Inductor's ISA flags in)."""
    from cachecompile._torch import inductor  # cold only: imported when used

    if level is None:
        return contextlib.nullcontext()
    return inductor.vec_isa_limited(level.name, level.vec)


def _env_factors() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items())
            if (k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)) and k not in _ENV_IGNORED}


class InductorAdapter(Adapter):
    name = "inductor"
    shares_graphs = True
    torch_parts = (_torch.DYNAMO, _torch.INDUCTOR)

    def factors(self, options: Mapping[str, Any]) -> dict[str, JSON]:
        f: dict[str, JSON] = {
            "triton": package_version("triton"),
            # A named level (CACHECOMPILE_CPU_TARGET) in place of this CPU's model and
            # flags: its kernels run on every CPU that has the level.
            "cpu": cpu.factor(_level(options)),
            "compiler": _compiler_identity(),
            # Inductor bakes the OpenMP thread count into the generated C++.
            "num_threads": torch.get_num_threads(),
            "env": _env_factors(),
        }
        return f

    def freezes(self, options: Mapping[str, Any]) -> bool:
        return bool(options.get("freezing"))

    def with_passes(self, options: Mapping[str, Any], passes: Any) -> Mapping[str, Any]:
        # Inductor's pass hooks are options: merged, then every pass among them (given
        # here or in config=) must be one the key can identify.
        merged = merge_passes(options, passes)
        check_passes(merged)
        return merged

    def cpu_target(self, options: Mapping[str, Any], target: str) -> Mapping[str, Any] | None:
        if "cpp.march" in options or "cpp.simdlen" in options:
            return None  # the config chose its own; it stays as given
        if target == cpu.NATIVE:
            return dict(options)
        level = cpu.BY_NAME[target]
        # Inductor's own options: the compiler's -march, and a vector width the level has
        # (in the FX graph cache's key too, so a native graph is never reused for it).
        out = {**options, "cpp.march": level.name}
        if level.simdlen is not None:
            out["cpp.simdlen"] = level.simdlen
        return out

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        # Cold only: the warm path never imports them.
        from cachecompile._torch import aot, dynamo, inductor

        n_inputs = len(example_inputs)
        sources = [dynamo.placeholder_source(n) or "" for n in gm.graph.nodes
                   if n.op == "placeholder"]
        level = cpu.BY_NAME.get(_level(options) or "")
        training = aot.needs_autograd(example_inputs)
        amp = aot.any_autocast()
        # A training graph's layout is read while AOTAutograd compiles its forward.
        on_forward = (lambda: aot.layout_or_refusal(n_inputs, amp)) if training else None
        with _building_for(level), \
                aot.backward_with_forward() if training else contextlib.nullcontext():
            live, captured = inductor.compile_capturing(gm, example_inputs, options,
                                                        decompositions, on_forward)

        def program() -> Program:
            # The capture run asks Inductor's code cache for each kernel by its build
            # command: the same target, or it would build (and record) native ones.
            with _building_for(level):
                if not training:
                    return _capture_program(captured, n_inputs, options, sources)
                return _capture_training(captured, n_inputs, options, sources)

        return Compiled(live=live, program=program)

    def trains(self) -> bool:
        return True

    def load(self, files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
        if entry_files.JOINT_META in meta:   # a training program (imported when one loads)
            from cachecompile.backends import joint

            return joint.load(_load_one, files, meta)
        return _load_one(files, meta)

    def plain_backend(self, options: Mapping[str, Any], decompositions: Mapping[Any, Any] | None
                      ) -> tuple[Any, dict[str, Any] | None]:
        from cachecompile._torch import inductor

        # torch.compile's Inductor takes no decompositions: custom ones are not applied.
        return "inductor", inductor.config_patches(options) or None


def _load_one(files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
    kernels = {digest: files[rel] for digest, rel in meta["kernels"].items()}
    if meta.get("async_compile") == "light":
        async_compile: Callable[[], Any] = inductor_runtime.light_async_compile_factory(kernels)
    else:
        from cachecompile._torch import inductor  # Inductor's own machinery

        async_compile = inductor.async_compile_class()
    constants: dict[str, torch.Tensor] = {}
    if CONSTANTS_FILE in files:
        # weights_only=True: the restricted unpickler; an entry's bytes are untrusted.
        constants = torch.load(files[CONSTANTS_FILE], weights_only=True)
    code = _stored_code(files) if meta.get("code") == PROGRAM_CODE else None
    if code is None:
        src = files[PROGRAM_FILE].read_text(encoding="utf-8")
        code = _compile_program(src, str(files[PROGRAM_FILE]))
    return _exec_program(code, str(files[PROGRAM_FILE]), async_compile, constants,
                         meta.get("inputs_to_check", []), meta.get("kept_inputs"))


def _compile_program(src: str, filename: str) -> types.CodeType:
    return compile(src, filename, "exec")


def _stored_code(files: Mapping[str, Path]) -> types.CodeType | None:
    """The program's code object the entry stores (``PROGRAM_CODE``), verified with the
    entry's other files; None where it does not load here (the source is compiled)."""
    path = files.get(PROGRAM_CODE)
    if path is None:
        return None
    try:
        return codeobj.loads(path.read_bytes(), [])
    except (UnsupportedProgramError, OSError):
        logger.debug("stored program code does not load: compiling its source", exc_info=True)
        return None


def _exec_program(code: types.CodeType, filename: str, async_compile: Callable[[], Any],
                  constants: Mapping[str, Any], inputs_to_check: Sequence[int],
                  kept: Sequence[int] | None = None) -> GraphCallable:
    ns: dict[str, Any] = {"__name__": "cachecompile_program", "__file__": filename,
                          "__cachecompile_async_compile__": async_compile}
    exec(code, ns)  # the entry was verified and owned
    ns.update(constants)
    program_call = ns["call"]
    check = tuple(inputs_to_check)
    if kept is None:
        call = program_call
    else:
        # Frozen: the weights are the program's constants; it takes the other inputs
        # (Inductor's own wrapper in fw_compiler_freezing does the same).
        keep = tuple(kept)

        def call(args: list[Any]) -> Any:
            return program_call([args[i] for i in keep])

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


class _RecordingAsyncCompile:
    """Runs the program once at capture time, noting where each built kernel lives."""

    def __init__(self) -> None:
        self.kernels: dict[str, str] = {}
        self.needs_real = False
        self._real: Any = None

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., Any]:
        from cachecompile._torch import inductor  # cold only: imported when used

        fn, path = inductor.load_cpp_kernel(argtypes, source_code)
        if not path or not os.path.isfile(path):
            raise UnsupportedProgramError("could not locate a built C++ kernel library")
        self.kernels[inductor_runtime.kernel_digest(argtypes, source_code)] = path
        return fn

    def wait(self, scope: dict[str, Any]) -> None:
        if self._real is not None:
            self._real.wait(scope)

    def __getattr__(self, attr: str) -> Any:
        # triton, cuda, halide...: keep Inductor's own machinery for these.
        from cachecompile._torch import inductor  # cold only: imported when used

        if self._real is None:
            self._real = inductor.async_compile_class()()
        self.needs_real = True
        return getattr(self._real, attr)


def _capture_program(captured: list[Any], n_inputs: int, options: Mapping[str, Any],  # noqa: C901 (today's exception: one branch per form of Inductor's output)
                     sources: Sequence[str]) -> Program:
    from cachecompile._torch import inductor  # cold only: imported when used

    for opt in _UNSUPPORTED_OPTIONS:
        value = options.get(opt, inductor.config_value(opt))
        if value:
            raise UnsupportedProgramError(f"Inductor option {opt}={value!r} is not replayable")
    if len(captured) != 1:
        raise UnsupportedProgramError(f"expected one Inductor graph, got {len(captured)}")
    out, aot_gm, kept, _ = captured[0]
    code = inductor.output_code(out)
    if code is None or not code.source_code:
        raise UnsupportedProgramError(f"Inductor returned {type(out).__name__}, not a CompiledFxGraph")
    n_aot = sum(1 for n in aot_gm.graph.nodes if n.op == "placeholder")
    if kept is not None:
        _check_frozen(kept, n_inputs, n_aot, options, sources)
    elif n_aot != n_inputs:
        # AOTAutograd deduplicated or merged inputs: its runtime wrappers would be needed.
        raise UnsupportedProgramError(
            f"AOTAutograd changed the inputs ({n_inputs} graph inputs, {n_aot} compiled)")
    if code.torchbind_constants:
        raise UnsupportedProgramError("the graph holds torchbind objects")

    src, heavy = inductor.rewrite_imports(code.source_code)
    recorder = _RecordingAsyncCompile()
    constants = dict(code.constants)
    if any(not isinstance(v, torch.Tensor) for v in constants.values()):
        raise UnsupportedProgramError("the graph holds non-tensor constants")
    inputs_to_check = list(code.inputs_to_check)
    # Execute the program exactly as a warm process would, except that kernels come from
    # Inductor's cache (already built) so we learn their paths.
    program_code = _compile_program(src, PROGRAM_FILE)
    light = _exec_program(program_code, "<cachecompile capture>", lambda: recorder, constants,
                          inputs_to_check, kept)

    files: dict[str, bytes | Path] = {PROGRAM_FILE: src.encode("utf-8")}
    try:
        stored, consts = codeobj.dumps(program_code)
    except UnsupportedProgramError:  # the source alone serves: compiled when loaded
        stored, consts = b"", [None]
    if not consts:   # plain constants only (a program's are): stored compiled
        files[PROGRAM_CODE] = stored
    operators = passes.operators_in(src)
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
        # The compiled program (PROGRAM_CODE), loaded in place of compiling the source.
        "code": PROGRAM_CODE if PROGRAM_CODE in files else None,
        "async_compile": "real" if recorder.needs_real else "light",
        "heavy_imports": heavy,
        "inputs_to_check": inputs_to_check,
        "mutated_inputs": sorted(code.mutated_inputs),
        "n_inputs": n_inputs,
        # Under freezing: the inputs the program still takes (the others are constants).
        "kept_inputs": kept,
        "python": sys.version_info[:2],
        # Custom operators (a fusion pass's, torch.library's) the program calls by name: a
        # warm process that has not registered one gets a miss that names it.
        "operators": operators,
        "op_namespaces": passes.namespaces(operators),
    }
    return Program(files=files, meta=meta, light=light,
                   mutated_inputs=tuple(meta["mutated_inputs"]))


def _capture_training(captured: list[Any], n_inputs: int, options: Mapping[str, Any],
                      sources: Sequence[str]) -> Program:
    """A training graph's two Inductor programs, joined (:mod:`cachecompile.backends.joint`)."""
    if [role == "backward" for *_, role in captured] != [False, True]:
        raise UnsupportedProgramError(
            f"expected one forward and one backward Inductor graph, got {len(captured)} "
            "graphs")
    (fw_out, fw_gm, fw_kept, layout), bw = captured
    if fw_kept is not None or bw[2] is not None:
        raise UnsupportedProgramError("freezing is for inference: a training graph's weights "
                                      "change")
    n_bw = sum(1 for n in bw[1].graph.nodes if n.op == "placeholder")
    forward = _capture_program([(fw_out, fw_gm, None, None)], n_inputs, options, sources)
    backward = _capture_program([bw], n_bw, options, [""] * n_bw)
    from cachecompile.backends import joint

    return joint.join_programs(forward, backward, layout)


def _check_frozen(kept: Sequence[int], n_inputs: int, n_aot: int,
                  options: Mapping[str, Any], sources: Sequence[str]) -> None:
    """A frozen program is replayable only where the key holds what was frozen."""
    if not options.get("freezing"):
        raise UnsupportedProgramError(
            "freezing is on in torch._inductor.config, not in cache_compile's config: the "
            "key would not hold the weights it bakes in. Pass config={'freezing': True}")
    if n_aot != n_inputs or len(sources) != n_inputs:
        raise UnsupportedProgramError(
            f"AOTAutograd changed the inputs ({n_inputs} graph inputs, {n_aot} compiled)")
    frozen = sorted(set(range(n_inputs)) - set(kept))
    foreign = [sources[i] or "?" for i in frozen if not sources[i].startswith("L['self']")]
    if foreign:
        # The key digests the module's own parameters and buffers, nothing else.
        raise UnsupportedProgramError(f"freezing would bake in {foreign[0]}, which is not "
                                      "the module's own state")


ADAPTER = InductorAdapter()
