"""How many compiles a node runs at once (torch-free: ``cachectl build``'s parent process
sizes its workers by it; :class:`cachecompile.procs.coop.CompileSlots` enforces it)."""

from __future__ import annotations

import os

from cachecompile.store import settings


def default_slots() -> int:
    """Compiles allowed at once on this node: ``CACHECOMPILE_COMPILE_SLOTS`` or cores / 2."""
    n = settings.COMPILE_SLOTS.get()
    return max(1, n if n is not None else (os.cpu_count() or 2) // 2)
