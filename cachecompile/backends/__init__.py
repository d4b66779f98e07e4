"""Compile-path adapters, by name. Each adapter module holds what is particular to its
backend; torch's private names, and their differences between releases, live in
``cachecompile._torch`` (docs/design.md)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from cachecompile.backends.base import Adapter

# name -> module that defines ADAPTER. Imported lazily: a warm process imports only its own.
_REGISTRY: dict[str, str] = {
    "inductor": "cachecompile.backends.inductor",
    "aot_eager": "cachecompile.backends.aot_eager",
    "torchair": "cachecompile.backends.torchair",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> Adapter:
    try:
        module = _REGISTRY[name]
    except KeyError:
        raise KeyError(name) from None
    adapter: Adapter = importlib.import_module(module).ADAPTER
    return adapter


def register(name: str, module: str) -> None:
    """Register an adapter module (it must define ``ADAPTER``)."""
    _REGISTRY[name] = module


def resolve(backend: Any, config: Any, *, ge_cache: bool = False) -> tuple[Adapter, dict[str, Any]]:
    """Pick the adapter for ``cache_compile(backend=..., config=..., ge_cache=...)``.

    Returns the adapter and its options (the ``config`` part of the key). Raises
    TypeError / ValueError with a message for the user on bad input.
    """
    if _wants_torchair(backend, config, ge_cache):
        return _resolve_torchair(backend, config, ge_cache)
    if backend is None:
        name = "inductor"
    elif isinstance(backend, str):
        name = backend
    else:
        raise TypeError(f"backend must be an adapter name ({', '.join(names())}) or a "
                        f"torchair npu backend, got {type(backend).__qualname__}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(names())}")
    if ge_cache:
        raise ValueError(f"ge_cache=True is an option of the Ascend torchair backend, not of "
                         f"{name!r}; use backend='torchair' (or leave backend unset)")
    if config is None:
        options: dict[str, Any] = {}
    elif isinstance(config, Mapping):
        options = dict(config)
    else:
        raise TypeError(f"config for backend {name!r} must be a dict of options, got "
                        f"{type(config).__qualname__}")
    return get(name), options


def _looks_like_compiler_config(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "CompilerConfig" and cls.__module__.startswith("torchair")


def _looks_like_npu_backend(obj: Any) -> bool:
    import functools

    return isinstance(obj, functools.partial) and "compiler_config" in (obj.keywords or {})


def _npu_device_present() -> bool:
    """An NPU this process already set up (torch_npu imported by the user, a device seen).

    Only looked at when nothing else names a backend; torch_npu is never imported here
    (a failed import of it costs seconds and leaves half-registered state behind).
    """
    import sys

    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return False
    try:
        return bool(torch_npu.npu.is_available())
    except Exception:  # noqa: BLE001 - a broken torch_npu means: no NPU to use
        return False


def _wants_torchair(backend: Any, config: Any, ge_cache: bool) -> bool:
    if backend == "torchair" or _looks_like_npu_backend(backend):
        return True
    if isinstance(backend, str):
        return False  # another named adapter; ge_cache / config errors come from it
    if backend is not None:
        return False
    return ge_cache or _looks_like_compiler_config(config) or (
        config is None and _npu_device_present())


def _resolve_torchair(backend: Any, config: Any, ge_cache: bool) -> tuple[Adapter, dict[str, Any]]:
    from cachecompile.backends import torchair

    why = torchair.unavailable_reason()
    if why is not None:
        raise ValueError("the Ascend torchair backend was selected (backend='torchair', a "
                         "torchair CompilerConfig, ge_cache=True or an NPU device) but it is "
                         f"not usable here: {why}. Install torch-npu with CANN, or use "
                         "backend='inductor'")
    if _looks_like_npu_backend(backend):
        backend_config = backend.keywords.get("compiler_config")
        # TorchAir's own check (cache_compile in torchair/inference/_cache_compiler.py).
        if config is not None and backend_config != config:
            raise ValueError("config in current backend is different from the config during "
                             "cache generation.")
        config = backend_config if config is None else config
    if config is not None and not torchair.is_compiler_config(config):
        raise TypeError("config for backend 'torchair' must be a torchair.CompilerConfig, got "
                        f"{type(config).__qualname__}")
    try:
        options = torchair.make_options(config, ge_cache)
    except torchair.TorchairUnavailableError as e:
        raise ValueError(str(e)) from None
    return get("torchair"), options
