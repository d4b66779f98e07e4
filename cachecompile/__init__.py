"""cachecompile: a compilation cache for torch.compile.

``cache_compile(self.method)`` makes a fresh process skip Dynamo tracing and kernel
compilation for methods it has compiled before. See README.md and docs/usage.md.

The names below are imported on first use (PEP 562), not here: ``cachecompile.store`` and
``cachectl`` live in this package and must never import torch, and importing a
subpackage runs this file first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# name -> the submodule that defines it.
_LAZY = {
    "cache_compile": ".api",
    "compile_repeated_blocks": ".api",
    "CachedFunction": ".cached",
    "CacheCompileError": ".errors",
    "CacheFaultWarning": ".errors",
    "ContractError": ".errors",
    "GraphBreakError": ".errors",
    "IgnoredArgumentWarning": ".errors",
    "InferenceOnlyError": ".errors",
    "InferenceOnlyWarning": ".errors",
    "OutOfGearWarning": ".errors",
    "RecompileWarning": ".errors",
    "SignatureLimitWarning": ".errors",
    "UncachedCallWarning": ".errors",
    "UnidentifiedPassError": ".errors",
    "UnsupportedTorchWarning": ".errors",
    "node_once": ".procs.node",
    "prepare_node": ".procs.node",
    # Prebuilding is imported on first use too: `python -m cachecompile.build` must not
    # find its module imported already, and serving processes never need it.
    "prebuild": ".build",
    "prebuild_factory": ".build",
    "Call": ".build",
    "Exact": ".build",
    "CachedModule": ".forms",
}

__all__ = [
    "CacheCompileError",
    "CacheFaultWarning",
    "CachedFunction",
    "CachedModule",
    "Call",
    "ContractError",
    "Exact",
    "GraphBreakError",
    "IgnoredArgumentWarning",
    "InferenceOnlyError",
    "InferenceOnlyWarning",
    "OutOfGearWarning",
    "RecompileWarning",
    "SignatureLimitWarning",
    "UncachedCallWarning",
    "UnidentifiedPassError",
    "UnsupportedTorchWarning",
    "__version__",
    "cache_compile",
    "compile_repeated_blocks",
    "prebuild",
    "prebuild_factory",
    "node_once",
    "prepare_node",
]

if TYPE_CHECKING:
    from cachecompile.api import cache_compile, compile_repeated_blocks
    from cachecompile.build import Call, Exact, prebuild, prebuild_factory
    from cachecompile.cached import CachedFunction
    from cachecompile.errors import (
        CacheCompileError,
        CacheFaultWarning,
        ContractError,
        GraphBreakError,
        IgnoredArgumentWarning,
        InferenceOnlyError,
        InferenceOnlyWarning,
        OutOfGearWarning,
        RecompileWarning,
        SignatureLimitWarning,
        UncachedCallWarning,
        UnidentifiedPassError,
        UnsupportedTorchWarning,
    )
    from cachecompile.forms import CachedModule
    from cachecompile.procs.node import node_once, prepare_node


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # The import runs with the collector paused: what it drops must not look long-lived
    # (warm.collector; issue 53).
    from cachecompile.warm import collector

    with collector.paused():
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups are plain module attributes: no hook per call
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
