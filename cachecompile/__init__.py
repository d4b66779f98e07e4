"""cachecompile: a compilation cache for torch.compile.

``cache_compile(self.method)`` makes a fresh process skip Dynamo tracing and kernel
compilation for methods it has compiled before. See README.md and docs/usage.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import cache_compile  # noqa: E402
from .cached import CachedFunction  # noqa: E402
from .errors import (  # noqa: E402
    CacheCompileError,
    CacheFaultWarning,
    ContractError,
    GraphBreakError,
    InferenceOnlyError,
    RecompileWarning,
    SignatureLimitWarning,
    UnsupportedTorchWarning,
)
from .node import node_once, prepare_node  # noqa: E402

__all__ = [
    "CacheCompileError",
    "CacheFaultWarning",
    "CachedFunction",
    "ContractError",
    "GraphBreakError",
    "InferenceOnlyError",
    "RecompileWarning",
    "SignatureLimitWarning",
    "UnsupportedTorchWarning",
    "__version__",
    "cache_compile",
    "node_once",
    "prepare_node",
]
