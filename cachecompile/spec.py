"""What to compile and how: one frozen ``CompileSpec`` per cached method.

``cache_compile`` (``api``) checks its arguments once and builds the spec; the cached
method, its key and its miss path read from it. A new option is one field here and its
check in ``api``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from cachecompile.backends.base import Adapter, capability
from cachecompile.entry.guards import GuardMode
from cachecompile.key.gears import Gears
from cachecompile.key.ranks import Ranks


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """A cached method's settings, checked (``api.cache_compile``) and fixed for its life."""

    adapter: Adapter
    options: Mapping[str, Any]            # backend options (custom passes merged in)
    decompositions: Mapping[Any, Any] | None
    dynamic: bool
    guards: GuardMode
    ranks: Ranks
    cache_dir: str | None
    max_signatures: int
    gears: Gears | None = None
    # dynamic=None, torch.compile's automatic dynamic: ``dynamic`` is False until a call
    # differs from an earlier one in sizes only; the cached method then switches to True.
    automatic: bool = False
    # False under CACHECOMPILE_DISABLE: every call runs as plain torch.compile.
    enabled: bool = True
    extra_factors: Mapping[str, Any] | None = None
    # CACHECOMPILE_CPU_TARGET (key.cpu): the named level ``options`` build for (None:
    # native, or a backend without CPU targets); the options of the other candidates this
    # CPU supports, best first, looked up when this one misses; and, where the CPU
    # supports no candidate, why (every call is then a named miss and a live compile).
    cpu_target: str | None = None
    alternates: tuple[Mapping[str, Any], ...] = ()
    cpu_unserved: str | None = None
    # torch.compile's: False lets the graph break; every frame Dynamo compiles for a call
    # is stored in the signature's entry (entry.frame_records).
    fullgraph: bool = True

    def __post_init__(self) -> None:
        # Frozen all the way down: nothing the key hashed may change under it.
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))
        object.__setattr__(self, "alternates",
                           tuple(types.MappingProxyType(dict(o)) for o in self.alternates))

    def for_alternate(self, i: int) -> CompileSpec:
        """The spec of the ``i``-th alternate target (for its key: lookups only)."""
        return dataclasses.replace(self, options=self.alternates[i], alternates=(),
                                   cpu_target=None)

    @property
    def freezes(self) -> bool:
        """Whether the backend bakes the module's weights into its program (Inductor's
        ``freezing``): then the weights' content is a key factor."""
        return bool(capability(self.adapter, "freezes")(self.options))

    def backend_factors(self) -> dict[str, Any]:
        """The backend as the key names it: the adapter's name and its own factors."""
        return {"name": self.adapter.name, **self.adapter.factors(self.options)}
