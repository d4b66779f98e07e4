"""Key factors: the named, readable facts that decide whether an entry fits.

Each factor is JSON and goes into the entry's manifest as is, so ``cachectl explain`` can
say which one differs. Large inputs (source text, weights layout) are reduced to
XXH3 digests, with counts beside them so a human still sees the scale.
"""

from __future__ import annotations

import inspect
import logging
import platform
import sys
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import xxhash

from cachecompile._torch import runtime
from cachecompile._torch import versions as torch_versions
from cachecompile._version import ENTRY_FORMAT, __version__, code_digest
from cachecompile.key import identity, passes
from cachecompile.key.ranks import Ranks
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)

_PLAIN = (bool, int, float, str, type(None))


def _digest(data: bytes | str) -> str:
    return xxhash.xxh3_128_hexdigest(data.encode() if isinstance(data, str) else data)


def _source_digest(obj: Any) -> str | None:
    try:
        return _digest(inspect.getsource(obj))
    except (OSError, TypeError):
        return None


def callable_digest(fn: Callable[..., Any]) -> str:
    """A custom pass or decomposition, by its code and its closure, defaults and partial
    arguments as values (TorchAir uses only the disassembly: a changed closure hit)."""
    ident = identity.identity(fn)
    if ident is not None and not ident.startswith(("module:", "class:")):
        return _digest(ident)
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        return identity.code_digest(code)
    src = _source_digest(fn)
    if src is not None:
        return src
    return _digest(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}")


def canonical(value: Any, where: str = "config") -> JSON:
    """A JSON form for config values: passes and other callables by what they do
    (:func:`cachecompile.key.passes.identify`, which refuses what it cannot identify), others
    by repr."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        return {str(k): canonical(v, f"{where}[{k!r}]")
                for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if callable(value) or passes.is_pass(value):
        return passes.identify(value, where)
    return repr(value)


# Per function: its code, what it wraps, and its factors then. The source is read once per
# code object (inspect.getsource tokenizes the method's file: ~0.25 ms of every signature's
# lookup): a process runs the code it loaded, whatever its file says since.
_function_memo: weakref.WeakKeyDictionary[types.FunctionType, tuple[tuple[Any, ...],
                                                                    dict[str, JSON]]]
_function_memo = weakref.WeakKeyDictionary()


def _code_chain(func: Any) -> tuple[Any, ...]:
    """The function and each it wraps (by id: the memo must not keep its key alive), with
    its code: what its factors are read from."""
    chain: list[Any] = [getattr(func, "__qualname__", None), getattr(func, "__module__", None)]
    while func is not None and len(chain) < 20:
        chain += (id(func), getattr(func, "__code__", None))
        func = getattr(func, "__wrapped__", None)
    return tuple(chain)


def function_factors(func: types.FunctionType) -> dict[str, JSON]:
    """The method's identity: its name, bytecode and source, and the code it wraps."""
    chain = _code_chain(func)
    hit = _function_memo.get(func)
    if hit is not None and len(hit[0]) == len(chain) and \
            all(a is b or (type(a) in (int, str) and a == b)
                for a, b in zip(hit[0], chain, strict=True)):
        return dict(hit[1])
    f = _function_factors(func)
    _function_memo[func] = (chain, f)
    return dict(f)


def _function_factors(func: types.FunctionType) -> dict[str, JSON]:
    f: dict[str, JSON] = {"qualname": func.__qualname__, "module": func.__module__,
                          "bytecode": identity.code_digest(func.__code__), "source": _source_digest(func)}
    # A decorated method (functools.wraps): the wrapper's code is traced too, and the
    # functions it wraps are keyed by their code (closures are guarded by Dynamo).
    wrapped: list[JSON] = []
    inner = getattr(func, "__wrapped__", None)
    while inner is not None and len(wrapped) < 8:
        code = getattr(inner, "__code__", None)
        wrapped.append({"qualname": getattr(inner, "__qualname__", type(inner).__name__),
                        "bytecode": identity.code_digest(code) if isinstance(code, types.CodeType)
                        else None})
        inner = getattr(inner, "__wrapped__", None)
    if wrapped:
        f["wrapped"] = wrapped
    return f


def module_factors(module: torch.nn.Module) -> dict[str, JSON]:
    """Class code, parameter/buffer layout and training flags.

    Attribute values are not factors: Dynamo guards exactly those it reads (private,
    nested, in dicts or plain objects alike), and the entry carries those guards.
    """
    classes: dict[str, str | None] = {}
    layout = xxhash.xxh3_128()
    n_params = n_buffers = 0
    devices: set[str] = set()
    for name, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        qual = f"{cls.__module__}.{cls.__qualname__}"
        if qual not in classes:
            # The code of the class's methods, not its source text: inspect.getsource on a
            # class parses its whole file, which a warm process paid for every class of the
            # model (~0.3 s for a small decoder on a slow core). Class attributes a method
            # reads are guarded by Dynamo; torch's classes are pinned by the version factor.
            classes[qual] = identity.class_digest(cls)
        layout.update(f"{name}:{qual}:{sub.training};".encode())
        for pname, p in sub.named_parameters(recurse=False):
            n_params += 1
            devices.add(str(p.device))
            layout.update(f"p {name}.{pname} {tuple(p.shape)} {p.dtype} {p.device} "
                          f"{tuple(p.stride())};".encode())
        for bname, b in sub.named_buffers(recurse=False):
            n_buffers += 1
            devices.add(str(b.device))
            layout.update(f"b {name}.{bname} {tuple(b.shape)} {b.dtype} {b.device} "
                          f"{tuple(b.stride())};".encode())
    return {
        "classes": dict(sorted(classes.items())),
        "layout": layout.hexdigest(),
        "parameters": n_params,
        "buffers": n_buffers,
        "devices": sorted(devices),
        "training": module.training,
    }


def device_factors(devices: list[str]) -> dict[str, JSON]:
    f: dict[str, JSON] = {"types": sorted({d.split(":")[0] for d in devices}) or ["cpu"]}
    if any(d.startswith("cuda") for d in devices) and torch.cuda.is_available():
        idx = torch.cuda.current_device()
        f["cuda"] = {"name": torch.cuda.get_device_name(idx),
                     "capability": list(torch.cuda.get_device_capability(idx)),
                     "runtime": torch_versions.cuda()}
    return f


def torch_flags() -> dict[str, JSON]:
    """Global torch state that changes what a compile produces."""
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


def _config_value(v: Any) -> JSON:
    """A compiler setting as JSON: callables (a custom pass set globally) by their code."""
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, Mapping):
        return {str(k): _config_value(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_config_value(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted(repr(x) for x in v)
    if callable(v) and not isinstance(v, type):
        return {"callable": callable_digest(v)}
    return repr(v)


def compiler_config() -> dict[str, JSON]:
    """The settings of Inductor's, Dynamo's and AOTAutograd's config modules this process
    changed (``torch._inductor.config.fallback_random = True``, diffusers' speed guide's
    ``coordinate_descent_tuning``, ``max_autotune``, ``freezing``...), as torch's own FX
    graph cache keys its whole config. Read whenever a signature is looked up or compiled
    (:func:`live_factors`): a signature compiled after a setting changed is compiled, and
    published, under it, as torch.compile recompiles a new signature under the settings
    of the moment; a signature already loaded keeps running what it loaded, as
    torch.compile keeps what it compiled (Dynamo guards no compiler setting)."""
    return {mod.removeprefix("torch._").removesuffix(".config"): _config_value(changed)
            for mod, changed in sorted(runtime.compiler_config_changes().items())}


def versions() -> dict[str, JSON]:
    return {
        # The replayed bytecode is CPython-version specific; keep the full version.
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        # The full version with its local build tag (+cpu, +cu128) and the commit: two
        # builds of one release may generate different code.
        "torch": torch_versions.version(),
        "torch_git": torch_versions.git_version(),
        "cachecompile": __version__,
        # The code that captured, stored and replays the entry: a release or a local edit
        # of cachecompile is a miss, never an entry served without a later fix's guards.
        "cachecompile_code": code_digest(),
        "format": ENTRY_FORMAT,
    }


class Keyed(Protocol):
    """What the key reads of a cached method's settings (``spec.CompileSpec`` is one; the
    key does not import it, nor the adapters: the backend comes as data). A setting that
    changes what is compiled is a field there and a factor here."""

    @property
    def options(self) -> Mapping[str, Any]: ...
    @property
    def decompositions(self) -> Mapping[Any, Any] | None: ...
    @property
    def dynamic(self) -> bool: ...
    @property
    def ranks(self) -> Ranks: ...
    @property
    def extra_factors(self) -> Mapping[str, Any] | None: ...
    @property
    def freezes(self) -> bool: ...

    def backend_factors(self) -> dict[str, Any]: ...


def fixed_factors(method: types.MethodType, spec: Keyed) -> dict[str, JSON]:
    """The factors a process cannot change once the method is cached: its settings
    (backend, options, dynamic, decompositions, ranks) and the versions."""
    decomps = {str(k): callable_digest(v) for k, v in (spec.decompositions or {}).items()}
    f: dict[str, JSON] = {
        # The adapter's name and its own factors (Adapter.factors): the key names the
        # backend as data, never importing the adapters.
        "backend": spec.backend_factors(),
        "config": canonical(dict(spec.options)),
        "dynamic": spec.dynamic,
        "decompositions": dict(sorted(decomps.items())),
        "ranks": spec.ranks.factors(),
        "versions": versions(),
    }
    if spec.extra_factors:
        f["extra"] = canonical(dict(spec.extra_factors))
    return f


def live_factors(method: types.MethodType, spec: Keyed,
                 frozen: Callable[[torch.nn.Module], str] | None = None) -> dict[str, JSON]:
    """The factors a process may change between two signatures of a method: the module's
    layout, classes, devices and training flag (``model.half()``, ``model.train()``), the
    global torch flags, the compiler settings it changed
    (``torch._inductor.config.fallback_random = True``), the weights of a frozen program
    (``frozen``: :func:`state_digest` or a memo of it). Read whenever a signature is looked
    up or compiled, so an entry is published under the settings it was compiled with."""
    module = method.__self__
    assert isinstance(module, torch.nn.Module)
    mf = module_factors(module)
    f: dict[str, JSON] = {
        "function": function_factors(method.__func__),  # type: ignore[arg-type]
        "module": mf,
        "device": device_factors(mf["devices"]),
        "torch_flags": torch_flags(),
        "compiler_config": compiler_config(),
    }
    if spec.freezes:
        # The program holds the weights as constants: other weights, another program.
        f["frozen_state"] = (frozen or state_digest)(module)
    return f


def base_factors(method: types.MethodType, spec: Keyed) -> dict[str, JSON]:
    """Every factor but the signature, read now (:func:`fixed_factors` and
    :func:`live_factors`)."""
    return {**fixed_factors(method, spec), **live_factors(method, spec)}


def state_digest(module: torch.nn.Module) -> str:
    """The content of every parameter and buffer, by name, dtype and shape (XXH3-128;
    GPU tensors are copied to the host to be read). What a frozen program depends on."""
    h = xxhash.xxh3_128()
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.device.type}\n".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        # reshape(-1): a 0-d tensor (a logit scale) cannot be viewed as bytes otherwise.
        h.update(data.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()

