"""A cached method's keys: its key per call signature, the shared-graph factors and
the rank group; the settings a process can change are read per signature lookup."""

from __future__ import annotations

import types
from typing import Any

import torch

from cachecompile.key import factors as factors_mod
from cachecompile.key.factors import Keyed
from cachecompile.key.signature import Signature, input_marks, to_json
from cachecompile.store import Key, make_key


class SignatureKeys:
    """The keys of one cached method.

    What the process cannot change (the method's settings, the versions) is read on the
    first call; what it can (the module's layout and classes, the torch flags, the compiler
    settings it changed, frozen weights) whenever a signature is looked up or compiled
    (:func:`cachecompile.key.factors.live_factors`): a signature compiled after
    ``torch._inductor.config.fallback_random = True`` is published under that setting, not
    under the one the method's first call saw. Only the miss path of a signature reads
    them: a call of a signature already loaded never computes a key."""

    def __init__(self, method: types.MethodType, spec: Keyed) -> None:
        self._method = method
        self._spec = spec
        self._fixed: dict[str, Any] | None = None
        # Frozen weights are hashed again only when a parameter or buffer was replaced or
        # written in place (its identity, storage or version counter changed).
        self._frozen: tuple[tuple[Any, ...], str] | None = None

    def factors(self, sig: Signature) -> dict[str, Any]:
        if self._fixed is None:
            self._fixed = factors_mod.fixed_factors(self._method, self._spec)
        live = factors_mod.live_factors(self._method, self._spec, self._frozen_digest)
        return {**self._fixed, **live, "signature": to_json(sig)}

    def _frozen_digest(self, module: torch.nn.Module) -> str:
        stamp = tuple((id(t), t.data_ptr(), t._version)
                      for t in (*module.parameters(), *module.buffers()))
        if self._frozen is None or self._frozen[0] != stamp:
            self._frozen = (stamp, factors_mod.state_digest(module))
        return self._frozen[1]

    def signature_key(self, sig: Signature) -> Key:
        return make_key(self.factors(sig))

    def changed_since(self, sig_key: Key) -> list[str]:
        """The live factors (:func:`~cachecompile.key.factors.live_factors`) whose value now
        differs from the one ``sig_key`` was made with: what this process changed since it
        looked the signature up (``torch._inductor.config.fallback_random = True`` after
        the first call). A frame compiled now is compiled under the new values, so it
        belongs to no entry of ``sig_key``."""
        now = make_key(factors_mod.live_factors(self._method, self._spec,
                                                self._frozen_digest)).factors
        return sorted(k for k, v in now.items() if sig_key.factors.get(k) != v)

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
