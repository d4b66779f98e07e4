"""A cached method's keys: its frame key per call signature, the shared-graph factors and
the rank group, from base factors computed once."""

from __future__ import annotations

import types
from typing import Any

from cachecompile.key import factors as factors_mod
from cachecompile.key.factors import Keyed
from cachecompile.key.signature import Signature, input_marks, to_json
from cachecompile.store import Key, make_key


class FrameKeys:
    """The keys of one cached method. The base factors (code, module, backend, config,
    versions, device, ranks) are computed on the first call, when the module is built."""

    def __init__(self, method: types.MethodType, spec: Keyed) -> None:
        self._method = method
        self._spec = spec
        self._base: dict[str, Any] | None = None

    def factors(self, sig: Signature) -> dict[str, Any]:
        if self._base is None:
            self._base = factors_mod.base_factors(self._method, self._spec)
        return {**self._base, "signature": to_json(sig)}

    def frame(self, sig: Signature) -> Key:
        return make_key(self.factors(sig))

    def graph_factors(self, sig: Signature) -> dict[str, Any]:
        """What a shared graph's program depends on beyond the graph (coop.GRAPH_FACTORS)."""
        f = self.factors(sig)
        marks = input_marks(sig)
        return {**f, "input_marks": to_json(tuple(marks))} if marks else f

    def group(self, sig: Signature) -> str:
        """The rank group: every factor but this process's own ranks (world size stays)
        and the signature. Ranks of one job may each trace their own graph at their own
        shapes (pipeline stages, uneven shards); they are still evicted together, so a
        restart never finds some ranks warm and others cold."""
        f = self.factors(sig)
        f["ranks"] = {"world_size": f["ranks"]["world_size"]}
        f.pop("signature", None)
        # Each rank's shard has its own parameter shapes.
        f["module"] = {k: v for k, v in f["module"].items() if k != "layout"}
        return make_key(f).digest[:16]
