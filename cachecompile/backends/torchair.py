"""The Ascend adapter: TorchAir's GE/ACL graph compile, captured as its generated code.

What TorchAir's own ``cache_compile`` keeps, and so what an entry here holds:

* the Python code TorchAir generates for the compiled graph (``_CompiledFxGraph.get_code``:
  the serialized GE graph, its GE options and a ``kernel(*args)`` that loads, compiles
  and runs it). A fresh process execs it and skips Dynamo, AOTAutograd, TorchAir's FX
  passes and the FX -> GE conversion;
* with ``ge_cache=True``: GE's own compile cache. ``ge.graph_compiler_cache_dir`` points
  into a private staging directory; whatever GE writes there (``.om`` / ``.idx``)
  becomes files of the entry, published atomically with the rest, so a fresh process
  also skips the GE graph compile;
* with static kernels (``experimental_config.aclgraph._aclnn_static_shape_kernel``):
  TorchAir's build outputs (``.run`` packages, op JSON) written under the staging
  directory, likewise files of the entry;
* the sources of the graph inputs (``L['self'].layer.weight`` ...) and the input gears,
  in the metadata. Parameters are NOT captured: Dynamo's replayed bytecode reads them
  from the live module on every call, so a weight swap after load is seen.

The miss path mirrors TorchAir's ``CacheBackend`` (torchair/inference/_cache_compiler.py):
``get_npu_backend`` validates the config and merges the decompositions, then
``_compile_graph_with_aot(..., is_cache=True)`` with a forward compiler that asks
TorchAir's ``_NpuFxCompiler`` for its codegen. *Live* is what TorchAir itself runs on a
miss: the generated kernel inside AOTAutograd's runtime wrapper. *Light* is a second,
independent exec of the exact text that is stored (as :meth:`load` does), without
AOTAutograd; capture compares the two before anything is published. On Ascend hardware
with ``ge_cache`` the second run finds GE's cache the first one wrote, so the check also
proves the staged GE cache loads; without ``ge_cache`` it costs a second GE compile.

The adapter is split by role: importing torchair and the machine's factors
(:mod:`~cachecompile.backends.torchair_machine`), the config as options
(:mod:`~cachecompile.backends.torchair_config`), the stored program and its staging
(:mod:`~cachecompile.backends.torchair_program`), and what selects it without its name
(:mod:`~cachecompile.backends.torchair_select`); this module compiles and loads.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cachecompile import _torch
from cachecompile._torch import dynamo
from cachecompile.backends.base import (
    JSON,
    Adapter,
    Compiled,
    GraphCallable,
    Program,
    package_version,
)
from cachecompile.backends.torchair_config import static_kernel
from cachecompile.backends.torchair_machine import (
    cann_version,
    import_quiet,
    import_torchair,
    install_deterministic_guard,
    npu_flags,
    soc_name,
    static_kernel_options,
    torchair_identity,
)
from cachecompile.backends.torchair_program import (
    GE_CACHE_PREFIX,
    PROGRAM_FILE,
    STATIC_KERNEL_PREFIX,
    exec_program,
    gears_of,
    point_dirs,
    private_view,
    staged_files,
    temp_dir,
    with_gear_check,
)
from cachecompile.errors import UnsupportedProgramError
from cachecompile.store import settings

logger = logging.getLogger(__name__)

# Bumped when what this adapter stores, or how it replays it, changes.
CODEGEN_FORMAT = 1
# Environment that changes what GE compiles (read by torchair / GE at compile time).
_ENV_KEYS = ("AUTOFUSE_FLAGS", "ASCEND_OPP_PATH", "ASCEND_CUSTOM_OPP_PATH")


def _input_sources(gm: Any) -> list[str]:
    out: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        label = dynamo.placeholder_source(node)
        out.append(label if label is not None else node.name)
    return out


def _no_backward(gm: Any, example_inputs: Sequence[Any]) -> Any:
    raise RuntimeError("cache_compile is inference only: no backward graph")


class TorchairAdapter(Adapter):
    name = "torchair"
    shares_graphs = True
    torch_parts = (_torch.DYNAMO,)

    def factors(self, options: Mapping[str, Any]) -> dict[str, JSON]:
        torch_npu, _ = import_quiet()
        cfg = options["compiler_config"].config
        return {
            "codegen_format": CODEGEN_FORMAT,
            "torchair": torchair_identity(),
            "torch_npu": package_version("torch-npu") or getattr(torch_npu, "__version__", None),
            "torch_npu_imported": torch_npu is not None,
            "cann": cann_version(),
            "soc": soc_name(),
            "npu": npu_flags(),
            "ge_cache": bool(options.get("ge_cache")),
            "static_kernel": static_kernel(cfg),
            "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
        }

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],  # noqa: C901 (today's exception: TorchAir's config forms side by side)
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        import_torchair()
        import torchair
        from torchair import npu_fx_compiler as fx

        config = options["compiler_config"].config
        ge_cache = bool(options.get("ge_cache"))
        static = static_kernel(config)
        stage = temp_dir("cachecompile-torchair-stage-")
        ge_dir = stage / "ge_cache" if ge_cache else None
        static_dir = stage / "static_kernel" if static else None
        extend: dict[str, str] = {}
        if ge_dir is not None:
            ge_dir.mkdir()
            extend["ge.graph_compiler_cache_dir"] = str(ge_dir)
        if static_dir is not None:
            static_dir.mkdir()
            extend.update(static_kernel_options(static_dir))

        # Validates the config and merges TorchAir's default decompositions with the
        # user's, exactly as a user's torch.compile(backend=get_npu_backend(...)) would.
        backend = torchair.get_npu_backend(compiler_config=config,
                                           custom_decompositions=dict(decompositions or {}))
        merged = backend.keywords["decompositions"]
        compiler = fx.get_compiler(config)
        captured: list[tuple[str | None, Any]] = []

        def fw_compiler(fx_gm: Any, ex: Sequence[Any]) -> Any:
            runner = compiler(fx_gm, ex)
            code = runner.get_code(extend)
            if not isinstance(code, str):
                # TorchAir does not generate code for some configs (enable_ref_data, export,
                # aoe, fx_summary, data_dump): run it live, do not cache.
                captured.append((None, fx_gm))
                return code
            captured.append((code, fx_gm))
            mod = fx._compile_py_code(code)
            point_dirs(mod, ge_dir, static_dir)
            return mod.kernel

        install_deterministic_guard()
        fx._process_send_recv(gm, config)
        n_inputs = len(example_inputs)
        sources = _input_sources(gm)
        aot_live = fx._compile_graph_with_aot(gm, fw_compiler, list(example_inputs), config,
                                              merged, is_cache=True, bw_compiler=_no_backward)
        holder: dict[str, Program] = {}

        def live(*args: Any) -> Any:
            out = aot_live(*args)
            program = holder.pop("program", None)
            if program is not None:
                # Both runs (light first, then this one) are done: GE has written its
                # cache and TorchAir its static-kernel builds into the staging dir.
                if ge_dir is not None:
                    program.files.update(staged_files(ge_dir, GE_CACHE_PREFIX))
                if static_dir is not None:
                    program.files.update(staged_files(static_dir, STATIC_KERNEL_PREFIX))
                program.meta["staged_files"] = sorted(k for k in program.files if k != PROGRAM_FILE)
            return out

        def program() -> Program:
            if len(captured) != 1:
                raise UnsupportedProgramError(f"expected one torchair graph, got {len(captured)}")
            code, fx_gm = captured[0]
            if code is None:
                raise UnsupportedProgramError(
                    "torchair generated no code for this config (enable_ref_data, export_mode, "
                    "aoe_mode, fx_summary or data_dump are not cacheable)")
            placeholders = [n for n in fx_gm.graph.nodes if n.op == "placeholder"]
            if len(placeholders) != n_inputs:
                raise UnsupportedProgramError(
                    f"AOTAutograd changed the inputs ({n_inputs} graph inputs, "
                    f"{len(placeholders)} compiled)")
            mutated = tuple(i for i, p in enumerate(placeholders)
                            if any(u.target is torch.ops.aten.copy_.default and u.args[0] is p
                                   for u in p.users))
            meta: dict[str, JSON] = {
                "mode": config.mode.value,
                "ge_cache": ge_cache,
                "static_kernel": static,
                "inputs": sources,
                "n_inputs": n_inputs,
                "mutated_inputs": list(mutated),
                "gears": {},
                "python": list(sys.version_info[:2]),
            }
            files: dict[str, bytes | Path] = {PROGRAM_FILE: code.encode("utf-8")}
            light_mod = exec_program(code, "<cachecompile torchair capture>")
            point_dirs(light_mod, ge_dir, static_dir)
            kernel = light_mod.kernel

            def light(*args: Any) -> Any:
                meta["gears"] = gears_of(args)
                return kernel(*args)

            prog = Program(files=files, meta=meta, light=light, mutated_inputs=mutated)
            holder["program"] = prog
            return prog

        return Compiled(live=live, program=program)

    def load(self, files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
        import_torchair()
        path = files[PROGRAM_FILE]
        mod = exec_program(path.read_text(encoding="utf-8"), str(path))
        ge_dir = private_view(files, GE_CACHE_PREFIX, "ge") if meta.get("ge_cache") else None
        static_dir = (private_view(files, STATIC_KERNEL_PREFIX, "static-kernel")
                      if meta.get("static_kernel") else None)
        point_dirs(mod, ge_dir, static_dir)
        kernel: Callable[..., Any] = mod.kernel
        return with_gear_check(kernel, meta.get("gears") or {})

    def with_passes(self, options: Mapping[str, Any], passes: Any) -> Mapping[str, Any]:
        if passes is None:
            return options
        raise ValueError("passes= are Inductor's custom pass hooks; the 'torchair' backend "
                         "does not run them (give them in its CompilerConfig)")

    def default_cache_dir(self) -> str | None:
        # TorchAir's own default (its cache_compile's), unless cachecompile's variable
        # names one: a drop-in keeps its users' caches where they were.
        if settings.DIR.get():
            return None
        return os.path.abspath(os.environ.get("TORCHAIR_CACHE_HOME") or ".torchair_cache")

    def plain_backend(self, options: Mapping[str, Any], decompositions: Mapping[Any, Any] | None
                      ) -> tuple[Any, dict[str, Any] | None]:
        _, torchair = import_torchair()
        return torchair.get_npu_backend(compiler_config=options["compiler_config"].config,
                                        custom_decompositions=dict(decompositions or {})), None


ADAPTER = TorchairAdapter()
