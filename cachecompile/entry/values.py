"""Plain values in a portable JSON form: guard expectations and rebuilt bytecode constants.

An entry is read by another process, so the values it carries (what a guard compares
with, the constants of Dynamo's bytecode) are written as tagged JSON and rebuilt from a
closed list of kinds: never eval, never unpickle. ``int``, ``float``, ``str``, ``bool``
and ``None`` are themselves; everything else is ``{"$": kind, ...}``.
"""

from __future__ import annotations

import enum
import importlib
import math
import sys
from typing import Any

import torch

from cachecompile.errors import UnsupportedProgramError
from cachecompile.store.jsonvalue import JSON

_TORCH_SINGLETONS = (torch.dtype, torch.layout, torch.memory_format)


def _torch_name(v: Any) -> str:
    name = str(v).replace("torch.", "")
    if getattr(torch, name, None) is not v:
        raise UnsupportedProgramError(f"{v!r} has no public torch name")
    return name


def encode_value(v: Any, depth: int = 0) -> JSON:
    """A JSON form of ``v``; raises UnsupportedProgramError for anything else."""
    if depth > 16:
        raise UnsupportedProgramError("value nested too deeply")
    if v is None or isinstance(v, (bool, str)) or type(v) is int:
        return v
    if type(v) in _CONTAINERS:
        return _encode_container(v, depth)
    if isinstance(v, enum.Enum):
        cls = type(v)
        if "<locals>" in cls.__qualname__:
            raise UnsupportedProgramError(f"enum {cls.__qualname__} is defined in a function")
        return {"$": "enum", "module": cls.__module__, "qualname": cls.__qualname__,
                "name": v.name}
    return _encode_scalar(v)


# The kinds that hold other values (each item encoded in turn), by exact type: a subclass
# (a NamedTuple, an OrderedDict) has no portable form here.
_CONTAINERS = (tuple, list, frozenset, set, dict, slice)


def _encode_container(v: Any, depth: int) -> JSON:
    if type(v) is dict:
        return {"$": "dict", "v": [[encode_value(k, depth + 1), encode_value(x, depth + 1)]
                                   for k, x in v.items()]}
    if type(v) is slice:
        return {"$": "slice", "v": [encode_value(v.start, depth + 1),
                                    encode_value(v.stop, depth + 1),
                                    encode_value(v.step, depth + 1)]}
    items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
    return {"$": type(v).__name__, "v": [encode_value(x, depth + 1) for x in items]}


def _encode_scalar(v: Any) -> JSON:
    """A value that holds no other: a non-finite float, torch's singletons, a size, ..."""
    if type(v) is float:
        return v if math.isfinite(v) else {"$": "float", "v": repr(v)}
    if isinstance(v, _TORCH_SINGLETONS):
        return {"$": "torch", "v": _torch_name(v)}
    if isinstance(v, torch.device):
        return {"$": "device", "v": str(v)}
    if isinstance(v, torch.Size):
        return {"$": "size", "v": [int(x) for x in v]}
    if type(v) is range:
        return {"$": "range", "v": [v.start, v.stop, v.step]}
    if type(v) is bytes:
        return {"$": "bytes", "v": v.hex()}
    if type(v) is complex:
        return {"$": "complex", "v": [v.real, v.imag]}
    if v is Ellipsis:
        return {"$": "ellipsis"}
    raise UnsupportedProgramError(f"no portable form for a {type(v).__module__}."
                                  f"{type(v).__qualname__} ({short(v)})")


def decode_value(j: JSON) -> Any:
    """The inverse of :func:`encode_value`; raises ValueError on anything unexpected."""
    if j is None or isinstance(j, (bool, str, int, float)):
        return j
    if isinstance(j, list):  # JSON turns tuples into lists only inside specs we wrote
        raise ValueError("bare list in a value spec")
    if not isinstance(j, dict) or "$" not in j:
        raise ValueError(f"not a value spec: {j!r}")
    kind = j["$"]
    v: Any = j.get("v")
    if kind in ("tuple", "list", "frozenset", "set"):  # by ==: a kind may be any JSON
        return _SEQUENCES[kind]([decode_value(x) for x in v])
    if kind == "dict":
        return {decode_value(k): decode_value(x) for k, x in v}
    if kind == "slice":
        return slice(*(decode_value(x) for x in v))
    if kind == "enum":
        return _enum_member(str(j["module"]), str(j["qualname"]), str(j["name"]))
    return _decode_scalar(kind, v)


_SEQUENCES: dict[str, Any] = {"tuple": tuple, "list": list, "frozenset": frozenset, "set": set}


def _decode_scalar(kind: Any, v: Any) -> Any:
    """:func:`_encode_scalar`'s inverse."""
    if kind == "float":
        if v not in ("inf", "-inf", "nan"):
            raise ValueError(f"bad float {v!r}")
        return float(v)
    if kind == "torch":
        obj = getattr(torch, str(v), None)
        if not isinstance(obj, _TORCH_SINGLETONS):
            raise ValueError(f"torch.{v} is not a dtype, layout or memory format")
        return obj
    if kind == "device":
        return torch.device(str(v))
    if kind == "size":
        return torch.Size([int(x) for x in v])
    if kind == "range":
        return range(*(int(x) for x in v))
    if kind == "bytes":
        return bytes.fromhex(str(v))
    if kind == "complex":
        return complex(float(v[0]), float(v[1]))
    if kind == "ellipsis":
        return Ellipsis
    raise ValueError(f"unknown value kind {kind!r}")


def _enum_member(module: str, qualname: str, name: str) -> Any:
    mod = sys.modules.get(module) or importlib.import_module(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
        raise ValueError(f"{module}.{qualname} is not an enum")
    return obj[name]


def short(v: Any) -> str:
    try:
        r = repr(v)
    except Exception:  # a broken __repr__ must not hide the real error
        r = object.__repr__(v)
    return r if len(r) < 60 else r[:57] + "..."
