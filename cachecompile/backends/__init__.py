"""Compile-path adapters, by name. Each adapter module holds its torch-version hacks."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from .base import Adapter

# name -> module that defines ADAPTER. Imported lazily: a warm process imports only its own.
_REGISTRY: dict[str, str] = {
    "inductor": "cachecompile.backends.inductor",
    "aot_eager": "cachecompile.backends.aot_eager",
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
    if backend is None:
        name = "inductor"
    elif isinstance(backend, str):
        name = backend
    else:
        raise TypeError(f"backend must be an adapter name ({', '.join(names())}), "
                        f"got {type(backend).__qualname__}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(names())}")
    if ge_cache:
        raise ValueError("ge_cache=True needs the Ascend torchair backend, which is not "
                         "available here")
    if config is None:
        options: dict[str, Any] = {}
    elif isinstance(config, Mapping):
        options = dict(config)
    else:
        raise TypeError(f"config for backend {name!r} must be a dict of options, got "
                        f"{type(config).__qualname__}")
    return get(name), options
