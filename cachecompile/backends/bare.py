"""A bare backend callable (``cache_compile(..., backend=my_backend)``, any
``torch.compile`` backend: MindIE SD's backend object, a vendor's function): its Dynamo
half is cached, its own half runs in every process.

cachecompile cannot store what an unknown backend produced, but it can store what Dynamo
gave it: the transformed bytecode and the guards (as for every entry) and the FX graph
as data (each node's op, name, target by import path and arguments: no code, no pickle)
with its constants. A warm process skips Dynamo, rebuilds that exact graph and hands it to
the same backend with the call's own inputs as the examples. So a warm start saves the
trace and pays the backend (once per set of symbolic sizes: a backend that traces again
specialises to the ints it is handed). The rebuilt graph has no ``node.meta`` (Dynamo's
fake tensors are not stored): a backend that reads it computes it itself; one that fails
on the rebuilt graph is a warning, and that process runs the graph eagerly.

The backend's identity is a key factor, found the way custom Inductor passes are keyed
(:mod:`cachecompile.key.passes`): its code, closures, defaults, the plain globals and
config objects it reads; a callable object by its class's code and its attributes. One
that cannot be identified is refused when ``cache_compile`` is called.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from cachecompile import _torch
from cachecompile._torch import runtime
from cachecompile.backends.base import Adapter, Compiled, GraphCallable, Program
from cachecompile.entry import files as entry_files
from cachecompile.errors import ContractError, UnsupportedProgramError, fault
from cachecompile.key import identity, passes
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)

GRAPH_FILE = entry_files.BARE_GRAPH
CONSTANTS_FILE = "constants.pt"


class _Holder(torch.nn.Module):
    """The rebuilt graph's ``self``: the graph's get_attr constants as buffers."""

    def __init__(self, constants: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in constants.items():
            self.register_buffer(k, v, persistent=False)


class _Unstorable(Exception):
    pass


def _target_of(fn: Any) -> dict[str, str]:
    if runtime.is_operator(fn):
        refs = [{"op": str(fn)}]  # "aten.sym_size.int": its path under torch.ops
    else:
        module = getattr(fn, "__module__", None)
        # torch's C functions: __qualname__ "_VariableFunctionsClass.arange", found as
        # torch.arange by their __name__.
        names = [getattr(fn, "__qualname__", None), getattr(fn, "__name__", None)]
        refs = [{"fn": f"{module}:{n}"} for n in dict.fromkeys(names)
                if module and n and "<" not in n]
    for ref in refs:
        try:
            if _resolve(ref) is fn:
                return ref
        except (ImportError, AttributeError):
            pass
    raise _Unstorable(f"the graph calls {fn!r}, which has no importable name")


def _resolve(ref: Mapping[str, str]) -> Any:
    if "op" in ref:
        obj: Any = torch.ops
        for part in ref["op"].split("."):
            obj = getattr(obj, part)
        return obj
    module, _, name = ref["fn"].partition(":")
    return identity.import_attr(module, name)


def _encode(v: Any, index: Mapping[Any, int]) -> JSON:
    if isinstance(v, torch.fx.Node):
        return {"n": index[v]}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, torch.Size):
        return {"size": [_encode(x, index) for x in v]}
    if isinstance(v, (list, tuple)):
        # FX's immutable_list and other subclasses: as the plain kind they are.
        return {"list" if isinstance(v, list) else "tuple": [_encode(x, index) for x in v]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"dict": [[k, _encode(x, index)] for k, x in v.items()]}
    if isinstance(v, slice):
        return {"slice": [_encode(v.start, index), _encode(v.stop, index),
                          _encode(v.step, index)]}
    if v is Ellipsis:
        return {"ellipsis": True}
    for kind, cls in _TORCH_VALUES.items():
        if isinstance(v, cls):
            return {kind: str(v).removeprefix("torch.")}
    raise _Unstorable(f"the graph holds a {type(v).__qualname__} argument")


_TORCH_VALUES: dict[str, type] = {"dtype": torch.dtype, "device": torch.device,
                                   "memory_format": torch.memory_format,
                                   "layout": torch.layout}


def _decode(v: JSON, nodes: list[Any]) -> Any:
    if not isinstance(v, dict):
        return v
    ((kind, x),) = v.items()
    if kind == "n":
        return nodes[x]
    if kind == "float":
        return float(x)
    if kind in ("list", "tuple", "size"):
        items = [_decode(i, nodes) for i in x]
        return items if kind == "list" else tuple(items) if kind == "tuple" else \
            torch.Size(items)
    if kind == "dict":
        return {k: _decode(i, nodes) for k, i in x}
    if kind == "slice":
        return slice(*(_decode(i, nodes) for i in x))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "device":
        return torch.device(x)
    if kind in ("dtype", "memory_format", "layout"):
        return getattr(torch, x)  # by its name
    raise ValueError(f"unknown value kind {kind!r} in a stored graph")


def dump_graph(graph: Any) -> dict[str, JSON]:
    """The graph as JSON: each node's op, name, target and arguments, nodes by position.
    No code: a rebuilt graph is these nodes, exactly (raises _Unstorable)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    out = []
    for n in graph.nodes:
        target = _target_of(n.target) if n.op == "call_function" else str(n.target)
        out.append({"op": n.op, "name": n.name, "target": target,
                    "args": _encode(n.args, index), "kwargs": _encode(n.kwargs, index)})
    return {"nodes": out}


def rebuild(doc: Mapping[str, JSON], constants: Mapping[str, torch.Tensor]) -> Any:
    """The Dynamo graph as a ``torch.fx.GraphModule`` again, from :func:`dump_graph`."""
    graph = torch.fx.Graph()
    nodes: list[Any] = []
    for rec in doc["nodes"]:
        target = _resolve(rec["target"]) if rec["op"] == "call_function" else rec["target"]
        if rec["op"] == "output":
            nodes.append(graph.output(_decode(rec["args"], nodes)[0]))
            continue
        nodes.append(graph.create_node(rec["op"], target, _decode(rec["args"], nodes),
                                       _decode(rec["kwargs"], nodes), name=rec["name"]))
    return torch.fx.GraphModule(_Holder(constants), graph)


def _name_of(fn: Any) -> str:
    """A readable name for the key and the messages: a function's, a partial's function's,
    an object's class's."""
    if isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)})"
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return identity.qualified_name(fn)
    return f"{identity.qualified_name(type(fn))} instance"


def structure(graph: Any) -> list[tuple[Any, ...]]:
    """A graph as its nodes' ops, targets and arguments, with nodes by position: what two
    graphs must share to compute the same thing, whatever their nodes are named."""
    index = {n: i for i, n in enumerate(graph.nodes)}

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        return repr(a)

    out: list[tuple[Any, ...]] = []
    for n in graph.nodes:
        target = n.target if isinstance(n.target, str) else identity.qualified_name(n.target)
        if n.op == "placeholder":
            target = ""  # named after the argument: the position is what counts
        out.append((n.op, target, arg(n.args), arg(n.kwargs)))
    return out


class BareAdapter(Adapter):
    """One backend callable. ``name`` is the same for all ("callable"); the key tells them
    apart by :meth:`factors`."""

    name = "callable"
    shares_graphs = False  # the backend's output is not ours to share
    torch_parts: tuple[str, ...] = (_torch.DYNAMO,)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        try:
            ident = passes.identify(fn, "the backend callable")
        except ContractError as e:
            raise ContractError(
                f"{e}. A backend callable is keyed by what it does (its code and what it "
                "reads); give a function, a functools.partial or an object of your own "
                "class, or register an adapter (docs/usage.md, 'Backends')") from None
        self.qualname = _name_of(fn)
        self.identity = xxhash.xxh3_128_hexdigest(repr(ident).encode())

    def make_options(self, config: Any) -> dict[str, Any]:
        if config is not None:
            raise TypeError("a backend callable takes no config: torch.compile hands it "
                            "only the graph. Put its settings in the callable itself (a "
                            "functools.partial, or the config object it reads), where the "
                            "key finds them")
        return {}

    def factors(self, options: Mapping[str, Any]) -> dict[str, JSON]:
        return {"callable": self.qualname, "identity": self.identity}

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        # Taken before the backend runs: it may rewrite the graph in place, and the warm
        # process must hand it the graph Dynamo made, not the rewritten one.
        try:
            doc: dict[str, JSON] | None = dump_graph(gm.graph)
            unstorable = ""
        except _Unstorable as e:
            doc, unstorable = None, str(e)
        shape = structure(gm.graph)
        calls = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_module"})
        constants: dict[str, torch.Tensor] = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = getattr(gm, str(node.target), None)
                if isinstance(value, torch.Tensor):
                    constants[str(node.target)] = value.detach().clone()
        int_inputs = [i for i, x in enumerate(example_inputs)
                      if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)]
        live = self.fn(gm, example_inputs)
        n_inputs = len(example_inputs)

        def program() -> Program:
            if doc is None:
                raise UnsupportedProgramError(unstorable)
            if calls:
                raise UnsupportedProgramError(f"the graph calls submodules {calls[:3]}")
            # Our half, verified without running the backend twice: the stored graph
            # rebuilds the graph Dynamo made, node for node (op, target, arguments).
            try:
                same = structure(rebuild(doc, constants).graph) == shape
            except Exception as e:  # any failure: not storable, said why
                raise UnsupportedProgramError(f"the stored graph does not rebuild "
                                              f"({type(e).__name__}: {e})") from None
            if not same:
                raise UnsupportedProgramError("the stored graph does not rebuild the same")
            files: dict[str, bytes | Path] = {
                GRAPH_FILE: json.dumps(doc, separators=(",", ":")).encode("utf-8")}
            if constants:
                buf = io.BytesIO()
                torch.save(constants, buf)
                files[CONSTANTS_FILE] = buf.getvalue()
            # The warm process runs the backend's output for this same graph: the live one.
            return Program(files=files, meta={"n_inputs": n_inputs, "backend": self.qualname,
                                              "int_inputs": int_inputs}, light=live)

        return Compiled(live=live, program=program)

    def load(self, files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
        constants: dict[str, torch.Tensor] = {}
        if CONSTANTS_FILE in files:
            constants = torch.load(files[CONSTANTS_FILE], weights_only=True)
        doc = json.loads(files[GRAPH_FILE].read_bytes())
        compiled: dict[tuple[int, ...], Callable[..., Any]] = {}
        lock = threading.Lock()
        fn, qualname = self.fn, self.qualname
        # The graph's int inputs: the sizes Dynamo made symbolic. A backend given plain
        # ints and real tensors specialises to them (aot_autograd, compile_fx), so a
        # dynamic graph gets its backend output per set of sizes, as Dynamo would
        # recompile it; a static graph has none and compiles once.
        ints = [int(i) for i in meta.get("int_inputs", [])]

        def first(args: tuple[Any, ...]) -> Callable[..., Any]:
            # The backend's half, in this process: the graph Dynamo gave it when it
            # compiled, with this call's inputs as the examples.
            gm = rebuild(doc, constants)
            try:
                return fn(gm, list(args))
            except Exception as e:  # a backend fault must not fail the call
                # As torch.compile with suppress_errors: the graph runs eagerly, said once.
                logger.debug("backend %s failed on the rebuilt graph", qualname, exc_info=True)
                fault(f"the backend {qualname} failed on the graph rebuilt from the cache "
                      f"({type(e).__name__}: {e}); this process runs that graph eagerly "
                      "(docs/usage.md, 'A bare backend callable')")
                return gm

        def call(*args: Any) -> Any:
            sizes = tuple(args[i] for i in ints)
            out = compiled.get(sizes)
            if out is None:
                with lock:
                    out = compiled.get(sizes)
                    if out is None:
                        out = compiled[sizes] = first(args)
            return out(*args)

        return call

    def plain_backend(self, options: Mapping[str, Any], decompositions: Mapping[Any, Any] | None
                      ) -> tuple[Any, dict[str, Any] | None]:
        return self.fn, None
