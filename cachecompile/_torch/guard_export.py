"""Dynamo's export record on its guards, made to bear a tensor built anew at each read.

Dynamo notes on each guard, for ``torch.export``, a weak reference to the object it
guards (``Guard.set_export_info``), and asserts that a second note names the same object
by comparing the two references: ``ref_a == ref_b`` compares the objects themselves while
both live. A guard whose source builds a tensor each time it is read
(``___from_numpy(...)``: BigBird's block-sparse attention, numpy arrays made tensors) is
noted twice with two live tensors whenever guards are built twice, and a
``guard_filter_fn`` (which every session of the cold side passes, to see the guards)
builds them twice: the tensors' ``==`` raises "Boolean value of Tensor with more than one
value is ambiguous" as an ``InternalTorchDynamoError``. Plain ``torch.compile(model)``,
building them once, never meets it; ``torch.compile(model, options={"guard_filter_fn":
...})`` does (torch 2.13).

While a session calls into Dynamo (:func:`tolerant`), a note that would compare a tensor
with another object forgets the earlier reference first, as Dynamo already does for an
earlier reference that has died. Only the export record changes: torch.compile reads
none of it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["NEEDS", "tolerant"]

NEEDS: tuple[tuple[str, str], ...] = (("torch._guards", "Guard.set_export_info"),)

_lock = threading.Lock()
_depth = 0
_original: Any = None


def _set_export_info(self: Any, *args: Any, **kwargs: Any) -> Any:
    new = args[-1] if args else kwargs.get("obj_weakref")
    old = getattr(self, "obj_weakref", None)
    if old is not None and new is not None and old is not new and callable(old):
        if isinstance(old(), torch.Tensor):
            self.obj_weakref = None
    return _original(self, *args, **kwargs)


@contextlib.contextmanager
def tolerant() -> Iterator[None]:
    """``Guard.set_export_info`` tolerant of two live tensors for one guard, for the
    duration (nested and threaded calls share one patch, removed by the last out)."""
    global _depth, _original
    from torch._guards import Guard

    with _lock:
        if _depth == 0:
            _original = Guard.set_export_info
            Guard.set_export_info = _set_export_info  # type: ignore[method-assign]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                Guard.set_export_info = _original  # type: ignore[method-assign]
