"""Dynamo's per-code cache of compiled frames, as the cold side reads and trims it: the
transformed code of each cache entry, and forgetting the frames earlier captures compiled.
Private torch names (``torch._C._dynamo.eval_frame``), probed with the others in
:mod:`cachecompile._torch.dynamo`."""

from __future__ import annotations

import types

import torch

__all__ = ["forget_captured", "note_captured", "transformed_code"]


# The frames (other than a session's own root) that a capture made Dynamo compile in
# this process: their cache entries stay in Dynamo's per-code cache after the session.
_CAPTURED: set[types.CodeType] = set()


def note_captured(code: types.CodeType) -> None:
    _CAPTURED.add(code)


def forget_captured() -> None:
    """Drop Dynamo's cache entries of every frame an earlier capture compiled in this
    process, so that the next capture's call traces them again and its entry holds them:
    a later signature whose frames an earlier one's (dynamic) entries serve would
    otherwise compile no frame here and publish nothing (a warm process, whose earlier
    calls ran from the store, traces them and publishes). Only recompiles: a frame whose
    entries go is compiled again when it is next reached."""
    for code in _CAPTURED:
        torch._C._dynamo.eval_frame.reset_code(code)
    _CAPTURED.clear()


def transformed_code(code: types.CodeType) -> list[types.CodeType]:
    """The transformed code object of each entry in Dynamo's cache for ``code``."""
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
    return [entry.code for entry in entries]
