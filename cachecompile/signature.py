"""The call signature: the cheap guard that stands in for Dynamo's guards on a hit.

A signature is a hashable tuple computed on every call. It holds, for each tensor in the
arguments, its dtype, device, rank, layout facts and either its exact shape
(``dynamic=False``) or each dimension's size class 0 / 1 / many (``dynamic=True``: Dynamo
specialises sizes 0 and 1 even for dynamic dims); and for every other argument, its
value (Dynamo specialises on bools, ints, floats and strings). Calls with equal
signatures can share one compiled entry; anything else is a different entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import ContractError

Signature = tuple[Any, ...]

_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)
_Tensor = torch.Tensor


def _tensor_sig(t: torch.Tensor, dynamic: bool) -> tuple[Any, ...]:
    shape = t.shape
    if dynamic:
        sizes: tuple[Any, ...] = tuple(s if s < 2 else -1 for s in shape)
    else:
        sizes = tuple(shape)
    contiguous = t.is_contiguous()
    return ("T", t.dtype, t.device, sizes, contiguous,
            None if contiguous else t.stride(), t.storage_offset(), t.is_inference())


def _value_sig(v: Any, dynamic: bool, where: str) -> Any:
    if isinstance(v, _Tensor):
        return _tensor_sig(v, dynamic)
    if isinstance(v, _SCALARS):
        # type matters: True == 1 == 1.0 but Dynamo treats them differently
        return (type(v).__name__, v)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value_sig(x, dynamic, f"{where}[{i}]")
                                        for i, x in enumerate(v)))
    if isinstance(v, Mapping):
        return ("dict", tuple((k, _value_sig(v[k], dynamic, f"{where}[{k!r}]"))
                              for k in sorted(v, key=repr)))
    raise ContractError(
        f"cache_compile cannot key argument {where} of type {type(v).__qualname__}: cached "
        "methods take tensors, bools, ints, floats, strings, None, dtypes, devices and "
        "lists/tuples/dicts of those. Pass other state through the module's attributes "
        "or make it part of the module.")


def signature(args: tuple[Any, ...], kwargs: Mapping[str, Any], dynamic: bool) -> Signature:
    pos = tuple(_value_sig(a, dynamic, f"#{i}") for i, a in enumerate(args))
    if not kwargs:
        return pos
    return pos + (("kw",) + tuple((k, _value_sig(kwargs[k], dynamic, k)) for k in sorted(kwargs)),)


def requires_grad(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """True if any tensor argument (top level or in a list/tuple/dict) requires grad."""
    stack: list[Any] = list(args) + list(kwargs.values())
    while stack:
        v = stack.pop()
        if isinstance(v, _Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
    return False


def describe(sig: Signature) -> str:
    """A short human-readable rendering, for labels and log lines."""
    parts: list[str] = []
    for item in sig:
        if isinstance(item, tuple) and item and item[0] == "kw":
            parts.extend(f"{k}={_describe_one(v)}" for k, v in item[1:])
        else:
            parts.append(_describe_one(item))
    return ", ".join(parts)


def _describe_one(v: Any) -> str:
    if isinstance(v, tuple) and v and v[0] == "T":
        _, dtype, device, sizes, contiguous, _stride, offset, _inf = v
        dims = ",".join("n" if s == -1 else str(s) for s in sizes)
        extra = "" if contiguous else " strided"
        extra += f" +{offset}" if offset else ""
        return f"{str(dtype).replace('torch.', '')}[{dims}]@{device}{extra}"
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
        kind, val = v
        if kind in ("list", "tuple"):
            inner = ", ".join(_describe_one(x) for x in val)
            return f"[{inner}]" if kind == "list" else f"({inner})"
        if kind == "dict":
            return "{" + ", ".join(f"{k!r}: {_describe_one(x)}" for k, x in val) + "}"
        return repr(val)
    return repr(v)


def to_json(sig: Signature) -> Any:
    """A JSON-able, canonical form of a signature (for the key and the manifest)."""
    if isinstance(sig, tuple):
        return [to_json(x) for x in sig]
    if isinstance(sig, (torch.dtype, torch.device)):
        return str(sig)
    if isinstance(sig, float) and (sig != sig or sig in (float("inf"), float("-inf"))):
        return repr(sig)
    return sig
