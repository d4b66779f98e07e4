"""STAND-INS for torchair's four native modules, so torchair's Python runs on a CPU.

*** Nothing here is Ascend. *** On a machine without CANN, ``import torch_npu`` fails and
torchair's native extensions (``torchair.core._torchair``, ``_npu_graph_executor``,
``_npu_utils``, ``_abi_compat_ge_apis``) cannot load (they link libge_runner.so). This
module puts labelled Python stand-ins in their place in ``sys.modules`` and puts
``torch_npu/dynamo`` on ``sys.path``, so the REAL torchair Python from the installed
torch-npu wheel imports: its CompilerConfig, decompositions, FX passes, FX -> GE IR
converters and codegen are the real ones.

The stand-in for GE's graph executor (``TorchNpuGraphBase``) is a small *interpreter of
GE IR on CPU tensors* for the ops our test models lower to (MatMulV2, Add, Mul, Relu,
Sigmoid, ReduceSum, Transpose, Cast, ...). It is what makes a test's numbers meaningful:
the GE graph that real torchair converted and serialized is executed, and the result
must equal eager PyTorch. It also mimics GE's compile cache: with
``ge.graph_compiler_cache_dir`` and ``ge.graph_key`` in the graph options, ``compile()``
writes ``{graph_key}.om`` (the serialized graph) and ``{graph_key}.idx``, and a later
``compile()`` that finds them LOADS the graph from the ``.om`` instead of "compiling" (the
interpreter then runs the graph read from that file). ``STATS`` counts each.

Real GE's file names, formats and cache-hit rules are not known here; the adapter under
test treats everything GE writes into the directory as opaque files.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

STANDIN_SOC = "StandIn-CPU (no Ascend SoC)"
STATS: dict[str, int] = {"init": 0, "load": 0, "compile": 0, "cache_load": 0, "run": 0}
OM_MAGIC = b"CACHECOMPILE-STANDIN-OM\n"


def dynamo_dir() -> Path:
    """torch_npu/dynamo (holds the bundled torchair) without importing torch_npu."""
    spec = importlib.util.find_spec("torch_npu")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch-npu is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0]) / "dynamo"


def install() -> types.ModuleType:
    """Install the stand-ins (idempotent); returns the ``_torchair`` stand-in."""
    existing = sys.modules.get("torchair.core._torchair")
    if existing is not None and getattr(existing, "IS_STANDIN", False):
        return existing
    if "torchair" in sys.modules:
        raise RuntimeError("install() must run before torchair is imported")
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    d = str(dynamo_dir())
    if d not in sys.path:
        sys.path.insert(0, d)
    native = _make_torchair_module()
    sys.modules[native.__name__] = native
    for n in ("_npu_graph_executor", "_npu_utils", "_abi_compat_ge_apis"):
        m = types.ModuleType(f"torchair.core.{n}")
        m.IS_STANDIN = True  # type: ignore[attr-defined]
        m.__doc__ = "cachecompile test stand-in: no Ascend runtime here"
        sys.modules[m.__name__] = m
    return native


def _make_torchair_module() -> types.ModuleType:
    m = types.ModuleType("torchair.core._torchair")
    m.__doc__ = "cachecompile test STAND-IN for torchair's native _torchair (GE on CPU)"
    m.IS_STANDIN = True  # type: ignore[attr-defined]
    m.STATS = STATS  # type: ignore[attr-defined]
    m.TorchDataType = enum.IntEnum(  # type: ignore[attr-defined]
        "TorchDataType", "BOOL UINT8 INT8 INT16 UINT16 INT32 UINT32 INT64 UINT64 BF16 "
        "FLOAT16 FLOAT32 FLOAT64 COMPLEX64 COMPLEX128")
    m.TorchNpuGraphBase = StandInGraph  # type: ignore[attr-defined]

    def initialize(options: dict[str, str]) -> None:
        STATS["init"] += 1

    m.InitializeGraphEngine = initialize  # type: ignore[attr-defined]
    m.FinalizeGraphEngine = lambda: None  # type: ignore[attr-defined]
    m.GetSocName = lambda: STANDIN_SOC  # type: ignore[attr-defined]
    m.check_cann_compat = lambda *a: ""  # type: ignore[attr-defined]
    # Custom-op IR lookups: "not registered" (the test models use none).
    m.get_registered_ir_def = lambda name: ("not registered", [], [], [])  # type: ignore[attr-defined]
    m.SetDebugLogPath = lambda path: None  # type: ignore[attr-defined]

    def missing(attr: str) -> Any:
        raise AttributeError(f"the test stand-in for torchair.core._torchair has no {attr!r} "
                             "(needs real Ascend hardware)")

    m.__getattr__ = missing  # type: ignore[attr-defined]
    return m


# -- GE IR on CPU -------------------------------------------------------------------------
def _dtype(ge_dtype: int, *, proto: bool) -> Any:
    """GE has two numberings: the IR proto's (tensor descs) and ge::DataType (attrs)."""
    import torch

    if proto:
        table = {1: torch.float32, 2: torch.float16, 3: torch.int8, 4: torch.uint8,
                 5: torch.int16, 7: torch.int32, 8: torch.int64, 11: torch.bool,
                 12: torch.float64, 27: torch.bfloat16}
    else:
        table = {0: torch.float32, 1: torch.float16, 2: torch.int8, 3: torch.int32,
                 4: torch.uint8, 6: torch.int16, 9: torch.int64, 11: torch.float64,
                 12: torch.bool, 27: torch.bfloat16}
    if ge_dtype not in table:
        raise NotImplementedError(f"stand-in GE: dtype {ge_dtype}")
    return table[ge_dtype]


class StandInGraph:
    """Stand-in for ``_torchair.TorchNpuGraphBase``: load / compile / run a GE graph."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._serialized = b""
        self._options: dict[str, str] = {}
        self._graph: Any = None

    def load(self, serialized: bytes, options: dict[str, str], input_placements: Any,
             output_dtypes: Any, executor_type: Any) -> None:
        STATS["load"] += 1
        self._serialized = bytes(serialized)
        self._options = dict(options)

    def set_hint_shape(self, inputs_shape: Any, output_shapes: Any) -> None:
        pass

    def compile(self) -> None:
        cache_dir = self._options.get("ge.graph_compiler_cache_dir")
        key = self._options.get("ge.graph_key")
        serialized = self._serialized
        if cache_dir and key:
            om, idx = Path(cache_dir) / f"{key}.om", Path(cache_dir) / f"{key}.idx"
            if om.is_file() and idx.is_file():
                data = om.read_bytes()
                if not data.startswith(OM_MAGIC):
                    raise RuntimeError(f"stand-in GE: {om} is not an om file")
                STATS["cache_load"] += 1
                serialized = data[len(OM_MAGIC):]
            else:
                STATS["compile"] += 1
                om.parent.mkdir(parents=True, exist_ok=True)
                om.write_bytes(OM_MAGIC + serialized)
                idx.write_text(json.dumps({"graph_key": key, "om": om.name, "sha256":
                                           hashlib.sha256(serialized).hexdigest()}))
        else:
            STATS["compile"] += 1
        self._graph = _parse(serialized)

    def auto_tune(self, packed: Any) -> None:
        raise NotImplementedError("stand-in GE: no AOE tuning without Ascend hardware")

    def run(self, packed: Any) -> list[Any]:
        inputs, assigned_outputs, _stream = packed
        if self._graph is None:
            raise RuntimeError("stand-in GE: run() before compile()")
        STATS["run"] += 1
        outs = _interpret(self._graph, list(inputs))
        if assigned_outputs:
            for i, dst in enumerate(assigned_outputs):
                if dst is not None:
                    dst.copy_(outs[i])
                    outs[i] = dst
        return outs


def _parse(serialized: bytes) -> Any:
    from torchair._ge_concrete_graph.ge_ir_pb2 import ModelDef

    model = ModelDef()
    model.ParseFromString(serialized)
    if len(model.graph) != 1:
        raise NotImplementedError(f"stand-in GE: {len(model.graph)} graphs in a model")
    return model.graph[0]


def _const(op: Any) -> Any:
    import torch

    t = op.attr["value"].t
    dtype = _dtype(t.desc.dtype, proto=True)
    shape = list(t.desc.shape.dim)
    if not t.data:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).reshape(shape).clone()


def _interpret(graph: Any, inputs: list[Any]) -> list[Any]:  # noqa: C901 (today's exception: an interpreter: one branch per op)
    import torch

    values: dict[str, Any] = {}

    def arg(ref: str) -> Any:
        name, _, idx = ref.rpartition(":")
        v = values[name]
        return v[int(idx)] if isinstance(v, tuple) else v

    outputs: list[Any] = []
    for op in graph.op:
        ins = [arg(r) for r in op.input if r and not r.startswith("^")]
        attr = op.attr
        t = op.type
        if t in ("Data", "RefData"):
            out: Any = inputs[attr["index"].i]
        elif t == "Const":
            out = _const(op)
        elif t == "NetOutput":
            outputs = ins
            continue
        elif t in ("Add", "AddV2"):
            out = ins[0] + ins[1]
        elif t == "Sub":
            out = ins[0] - ins[1]
        elif t == "Mul":
            out = ins[0] * ins[1]
        elif t in ("RealDiv", "Div"):
            out = ins[0] / ins[1]
        elif t == "Maximum":
            out = torch.maximum(ins[0], ins[1])
        elif t == "Relu":
            out = torch.relu(ins[0])
        elif t == "Sigmoid":
            out = torch.sigmoid(ins[0])
        elif t == "Tanh":
            out = torch.tanh(ins[0])
        elif t == "Exp":
            out = torch.exp(ins[0])
        elif t == "Neg":
            out = -ins[0]
        elif t in ("Identity", "TensorMove"):
            out = ins[0].clone()
        elif t == "Cast":
            out = ins[0].to(_dtype(attr["dst_type"].i, proto=False))
        elif t == "Transpose":
            out = ins[0].permute(*[int(x) for x in ins[1].tolist()]).contiguous()
        elif t == "Reshape":
            out = ins[0].reshape([int(x) for x in ins[1].tolist()])
        elif t in ("MatMulV2", "MatMul", "BatchMatMulV2", "BatchMatMul"):
            a, b = ins[0], ins[1]
            if attr["transpose_x1"].b if "transpose_x1" in attr else attr["adj_x1"].b:
                a = a.transpose(-1, -2)
            if attr["transpose_x2"].b if "transpose_x2" in attr else attr["adj_x2"].b:
                b = b.transpose(-1, -2)
            out = a @ b
            if len(ins) > 2 and ins[2] is not None:
                out = out + ins[2]
        elif t in ("ReduceSum", "ReduceMean", "ReduceMax"):
            dims = [int(x) for x in ins[1].reshape(-1).tolist()]
            keep = bool(attr["keep_dims"].b)
            if t == "ReduceSum":
                out = ins[0].sum(dim=dims, keepdim=keep)
            elif t == "ReduceMean":
                out = ins[0].mean(dim=dims, keepdim=keep)
            else:
                out = ins[0].amax(dim=dims, keepdim=keep)
        elif t in ("SoftmaxV2",):
            out = torch.softmax(ins[0], dim=int(attr["axes"].list.i[0]))
        else:
            raise NotImplementedError(f"stand-in GE interpreter: op {t} ({op.name}); extend "
                                      "tests_npu/npu_standins.py or use a simpler model")
        values[op.name] = out
    return list(outputs)
