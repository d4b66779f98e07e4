"""cachecompile: a compilation cache for torch.compile.

``cache_compile(self.method)`` makes a fresh process skip Dynamo tracing and kernel
compilation for methods it has compiled before. See README.md and docs/usage.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import Any  # noqa: E402

from .api import cache_compile  # noqa: E402
from .cached import CachedFunction  # noqa: E402
from .errors import (  # noqa: E402
    CacheCompileError,
    CacheFaultWarning,
    ContractError,
    GraphBreakError,
    IgnoredArgumentWarning,
    InferenceOnlyError,
    OutOfGearWarning,
    RecompileWarning,
    SignatureLimitWarning,
    UnidentifiedPassError,
    UnsupportedTorchWarning,
)
from .node import node_once, prepare_node  # noqa: E402

# Prebuilding is imported on first use: `python -m cachecompile.build` must not find its
# module imported already, and serving processes never need it.
_LAZY = {"prebuild": "build", "prebuild_factory": "build", "Call": "build"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CacheCompileError",
    "CacheFaultWarning",
    "CachedFunction",
    "Call",
    "ContractError",
    "GraphBreakError",
    "IgnoredArgumentWarning",
    "InferenceOnlyError",
    "OutOfGearWarning",
    "RecompileWarning",
    "SignatureLimitWarning",
    "UnidentifiedPassError",
    "UnsupportedTorchWarning",
    "__version__",
    "cache_compile",
    "prebuild",
    "prebuild_factory",
    "node_once",
    "prepare_node",
]
