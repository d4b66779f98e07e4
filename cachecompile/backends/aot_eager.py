"""The ``aot_eager`` adapter: AOTAutograd's ATen graph, run by the eager kernels.

No kernels are generated, so an entry is just the graph's Python code (FX codegen) plus
any tensor constants. Useful where Inductor cannot run, to debug a model, and as the
fast path in tests. The same replay contract as Inductor: ``call(flat_inputs)``; a
training graph's forward and backward are two such programs, joined
(:mod:`cachecompile.backends.joint`).
"""

from __future__ import annotations

import io
import logging
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cachecompile import _torch
from cachecompile._torch import dynamo, runtime
from cachecompile.backends.base import Adapter, Compiled, GraphCallable, Program
from cachecompile.entry import files as entry_files
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key import passes
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)

PROGRAM_FILE = entry_files.AOT_EAGER_PROGRAM
CONSTANTS_FILE = "constants.pt"
# Globals FX codegen may reference that are safe and cheap to rebuild in a warm process.
_SAFE_GLOBALS = {"torch", "inf", "nan", "NoneType", "device", "fx_pytree", "pytree"}


class _Holder:
    """Stands in for the GraphModule's ``self``: holds get_attr constants."""

    def __init__(self, constants: Mapping[str, Any]) -> None:
        for k, v in constants.items():
            setattr(self, k, v)


def _globals_for(names: Sequence[str]) -> dict[str, Any]:
    import math

    g: dict[str, Any] = {"torch": torch, "inf": math.inf, "nan": math.nan,
                         "NoneType": type(None), "device": torch.device}
    if "fx_pytree" in names or "pytree" in names:
        g.update(runtime.pytree_modules())
    return g


def _make_callable(src: str, filename: str, constants: Mapping[str, Any],
                   global_names: Sequence[str]) -> GraphCallable:
    ns = _globals_for(global_names)
    exec(compile(src, filename, "exec"), ns)  # verified, owner-checked entry
    forward = ns["forward"]
    holder = _Holder(constants)

    def compiled_fn(*args: Any) -> Any:
        return forward(holder, *args)

    return compiled_fn


class AotEagerAdapter(Adapter):
    name = "aot_eager"
    # Compiling is cheaper than loading, and a shared program would run graph constants
    # taken from another process's trace (a DynamicCache's empty meta placeholders
    # tripped the device check): every process traces its own.
    shares_graphs = False
    torch_parts = (_torch.DYNAMO,)

    def factors(self, options: Mapping[str, Any]) -> dict[str, JSON]:
        return {}

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        if options:
            raise UnsupportedProgramError(f"aot_eager takes no options, got {sorted(options)}")
        from cachecompile._torch import aot  # cold only

        n_inputs = len(example_inputs)
        if aot.needs_autograd(example_inputs):
            return self._compile_training(gm, example_inputs, decompositions)
        captured: list[torch.fx.GraphModule] = []
        live = dynamo.aot_inference(captured.append, decompositions)(gm, example_inputs)

        def program() -> Program:
            if len(captured) != 1:
                raise UnsupportedProgramError(f"expected one AOT graph, got {len(captured)}")
            return _program_of(captured[0], n_inputs)

        return Compiled(live=live, program=program)

    def _compile_training(self, gm: Any, example_inputs: Sequence[Any],
                          decompositions: Mapping[Any, Any] | None) -> Compiled:
        """A graph that needs autograd: AOTAutograd's forward and backward, joined."""
        from cachecompile._torch import aot  # cold only

        n_inputs = len(example_inputs)
        forwards: list[tuple[torch.fx.GraphModule, Any]] = []  # (graph, layout or why not)
        backwards: list[torch.fx.GraphModule] = []
        backend = aot.training_backend(lambda g, lay: forwards.append((g, lay)),
                                       backwards.append, n_inputs, decompositions)
        with aot.backward_with_forward():
            live = backend(gm, example_inputs)

        def program() -> Program:
            if len(forwards) != 1 or len(backwards) != 1:
                raise UnsupportedProgramError(
                    f"expected one forward and one backward graph, got {len(forwards)} and "
                    f"{len(backwards)}")
            fw_gm, layout = forwards[0]
            bw_gm = backwards[0]
            n_bw = sum(1 for n in bw_gm.graph.nodes if n.op == "placeholder")
            from cachecompile.backends import joint

            return joint.join_programs(_program_of(fw_gm, n_inputs), _program_of(bw_gm, n_bw),
                                       layout)

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
        # torch.compile's aot_eager takes no decompositions: custom ones are not applied.
        return "aot_eager", None


def _program_of(fx_gm: torch.fx.GraphModule, n_inputs: int) -> Program:
    """One AOT graph as a stored program: its FX code, its tensor constants."""
    placeholders = [n for n in fx_gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != n_inputs:
        raise UnsupportedProgramError(
            f"AOTAutograd changed the inputs ({n_inputs} graph inputs, "
            f"{len(placeholders)} compiled)")
    code = fx_gm.graph.python_code(root_module="self")
    bad = sorted(k for k, v in code.globals.items()
                 if k not in _SAFE_GLOBALS and not isinstance(v, types.ModuleType)
                 and not k.startswith("__"))
    if bad:
        raise UnsupportedProgramError(f"graph code needs globals {bad}")
    constants: dict[str, torch.Tensor] = {}
    for node in fx_gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(fx_gm, str(node.target))
            if not isinstance(value, torch.Tensor):
                raise UnsupportedProgramError(f"graph attribute {node.target} is "
                                              f"a {type(value).__name__}")
            constants[str(node.target)] = value.detach()
    mutated = tuple(i for i, p in enumerate(placeholders)
                    if any(u.target is torch.ops.aten.copy_.default and u.args[0] is p
                           for u in p.users))
    files: dict[str, bytes | Path] = {PROGRAM_FILE: code.src.encode("utf-8")}
    if constants:
        buf = io.BytesIO()
        torch.save(constants, buf)
        files[CONSTANTS_FILE] = buf.getvalue()
    names = sorted(code.globals)
    light = _make_callable(code.src, "<cachecompile capture>", constants, names)
    operators = passes.operators_in(code.src)
    meta: dict[str, JSON] = {"globals": names, "n_inputs": n_inputs,
                             "mutated_inputs": list(mutated), "operators": operators,
                             "op_namespaces": passes.namespaces(operators)}
    return Program(files=files, meta=meta, light=light, mutated_inputs=mutated)


def _load_one(files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
    constants: dict[str, Any] = {}
    if CONSTANTS_FILE in files:
        constants = torch.load(files[CONSTANTS_FILE], weights_only=True)
    src = files[PROGRAM_FILE].read_text(encoding="utf-8")
    globals_ = meta.get("globals", [])
    return _make_callable(src, str(files[PROGRAM_FILE]), constants,
                          [str(n) for n in globals_] if isinstance(globals_, list) else [])


ADAPTER = AotEagerAdapter()
