"""Compile-path adapters, by name. Each adapter module holds its torch-version hacks."""

from __future__ import annotations

import importlib

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
