"""Gears: the few static shapes a ``dynamic=False`` method is declared to see.

``cache_compile(self.decode, dynamic=False, gears={"tokens": {0: [1, 2, 4, 8]}})``
declares, per argument and dimension, the sizes calls will have, in the form of TorchAir's
``set_dim_gears(tokens, dim_gears={0: [1, 2, 4, 8]})``. Two policies merge the lists of
several dimensions into gears, as TorchAir's ``dynamic_gears_merge_policy`` does:

* ``zip`` (default): the i-th value of every list together is gear i (all lists the same
  length);
* ``product``: every combination of the values.

Each gear is one static signature, so one entry. A call whose sizes are no gear either
runs with a live compile (one :class:`OutOfGearWarning`, the entry set stays the declared
one) or, with ``pad=True``, is padded up to the smallest gear that holds it
(:meth:`Gears.pad_plan`): the method runs at the gear's shape and each output is sliced
back. Padding is the user's assertion that the method treats the padded rows
independently (see docs/usage.md, "Gears"); what this module guarantees is only the
mechanics: inputs padded with zeros along the gear dims, outputs narrowed along the same
dim index where their size is the padded size, and no padding where that is ambiguous.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cachecompile.errors import ContractError

logger = logging.getLogger(__name__)

POLICIES = ("zip", "product")
MAX_VALUES = 100      # per dimension, as TorchAir's set_dim_gears allows
MAX_GEARS = 1024      # after merging: every gear is a compile


@dataclasses.dataclass(frozen=True)
class _Dim:
    param: str
    index: int | None    # position among the method's positional parameters, if any
    dim: int


@dataclasses.dataclass
class PadPlan:
    """How one out-of-gear call becomes a gear call, and how its outputs come back."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    gear: tuple[int, ...]
    narrow: dict[int, tuple[int, int]]   # output dim -> (padded size, original size)

    def unpad(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            for d, (padded, original) in self.narrow.items():
                if d < out.dim() and out.shape[d] == padded:
                    out = out.narrow(d, 0, original)
            return out
        if isinstance(out, tuple) and hasattr(out, "_fields"):
            return type(out)(*(self.unpad(x) for x in out))
        if isinstance(out, (list, tuple)):
            return type(out)(self.unpad(x) for x in out)
        if isinstance(out, dict):
            return {k: self.unpad(v) for k, v in out.items()}
        return out


class Gears:
    """The declared gears of one cached method, and the per-call check."""

    def __init__(self, method: types.MethodType, gears: Mapping[str, Mapping[int, Sequence[int]]],
                 policy: str = "zip", pad: bool = False) -> None:
        if policy not in POLICIES:
            raise ContractError(f"cache_compile(): gear_policy must be 'zip' or 'product', got "
                                f"{policy!r}")
        if not isinstance(pad, bool):
            raise ContractError(f"cache_compile(): pad must be True or False, got {pad!r}")
        if not isinstance(gears, Mapping) or not gears:
            raise ContractError("cache_compile(): gears must be a non-empty dict "
                                "{argument name: {dim: [sizes]}}, e.g. {'x': {0: [1, 2, 4, 8]}}")
        self.policy = policy
        self.pad = pad
        params = list(inspect.signature(method).parameters.values())
        positional = [p.name for p in params
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        accepted = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        dims: list[_Dim] = []
        lists: list[list[int]] = []
        for name, per_dim in gears.items():
            if name not in accepted:
                raise ContractError(f"cache_compile(): gears name {name!r}, which is not an "
                                    f"argument of {method.__qualname__} ({', '.join(accepted)})")
            if not isinstance(per_dim, Mapping) or not per_dim:
                raise ContractError(f"cache_compile(): gears[{name!r}] must be a dict "
                                    "{dim: [sizes]}")
            for dim, values in per_dim.items():
                dims.append(_Dim(name, positional.index(name) if name in positional else None,
                                 _dim(name, dim)))
                lists.append(_values(name, dim, values))
        if policy == "zip":
            lengths = {len(v) for v in lists}
            if len(lengths) > 1:
                raise ContractError(
                    "cache_compile(): gear_policy='zip' pairs the i-th sizes of every dim, so "
                    f"every list needs the same length; got lengths {sorted(lengths)}. Use "
                    "gear_policy='product' for every combination")
            shapes = list(zip(*lists, strict=True))
        else:
            n = 1
            for v in lists:
                n *= len(v)
            if n > MAX_GEARS:
                raise ContractError(f"cache_compile(): gear_policy='product' makes {n} gears "
                                    f"(at most {MAX_GEARS}); each is a compile")
            shapes = list(itertools.product(*lists))
        self.dims: tuple[_Dim, ...] = tuple(dims)
        self.shapes: tuple[tuple[int, ...], ...] = tuple(dict.fromkeys(shapes))
        self._set = frozenset(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def describe(self, shape: Sequence[int] | None = None) -> str:
        """``x[0]=4, mask[0]=4`` for a gear (or a call's sizes)."""
        if shape is None:
            return "; ".join(self.describe(s) for s in self.shapes)
        return ", ".join(f"{d.param}[{d.dim}]={n}" for d, n in zip(self.dims, shape, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "pad": self.pad,
                "dims": [[d.param, d.dim] for d in self.dims],
                "gears": [list(s) for s in self.shapes]}

    # -- calls -------------------------------------------------------------------------
    def _value(self, d: _Dim, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        if d.index is not None and d.index < len(args):
            return args[d.index]
        return kwargs.get(d.param)

    def sizes(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, ...] | None:
        """The call's size at each gear dim; None if a gear argument is no tensor of that rank."""
        out: list[int] = []
        for d in self.dims:
            t = self._value(d, args, kwargs)
            if not isinstance(t, torch.Tensor) or t.dim() <= d.dim:
                return None
            out.append(int(t.shape[d.dim]))
        return tuple(out)

    def holds(self, sizes: tuple[int, ...] | None) -> bool:
        return sizes is not None and sizes in self._set

    def pad_plan(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 sizes: tuple[int, ...] | None) -> tuple[PadPlan | None, str]:
        """The call padded up to the smallest gear that holds it, or (None, why not)."""
        if sizes is None:
            return None, "a gear argument is not a tensor of the declared rank"
        fits = [g for g in self.shapes if all(n >= s for n, s in zip(g, sizes, strict=True))]
        if not fits:
            return None, "it is larger than every gear"
        gear = min(fits, key=lambda g: (sum(g), self.shapes.index(g)))
        narrow: dict[int, tuple[int, int]] = {}
        targets: dict[str, dict[int, int]] = {}
        for d, n, s in zip(self.dims, gear, sizes, strict=True):
            if n == s:
                continue
            seen = narrow.get(d.dim)
            if seen is not None and seen != (n, s):
                return None, (f"dim {d.dim} is padded {seen[1]}->{seen[0]} and {s}->{n} in one "
                              "call: which one an output's dim follows is ambiguous")
            narrow[d.dim] = (n, s)
            targets.setdefault(d.param, {})[d.dim] = n
        new_args = list(args)
        new_kwargs = dict(kwargs)
        for d in self.dims:
            if d.param not in targets:
                continue
            t = self._value(d, tuple(new_args), new_kwargs)
            padded = _padded(t, targets.pop(d.param))
            if d.index is not None and d.index < len(new_args):
                new_args[d.index] = padded
            else:
                new_kwargs[d.param] = padded
        return PadPlan(tuple(new_args), new_kwargs, gear, narrow), ""

    # -- prebuilding -------------------------------------------------------------------
    def expand(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
               ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """One call per gear, from a template call: each gear dim of each gear argument is
        resized to the gear's size (the template's data cut or repeated along that dim)."""
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        for gear in self.shapes:
            new_args = list(args)
            new_kwargs = dict(kwargs)
            per_param: dict[str, dict[int, int]] = {}
            for d, n in zip(self.dims, gear, strict=True):
                per_param.setdefault(d.param, {})[d.dim] = n
            for d in self.dims:
                if d.param not in per_param:
                    continue
                t = self._value(d, tuple(new_args), new_kwargs)
                if not isinstance(t, torch.Tensor) or t.dim() <= max(per_param[d.param]):
                    raise ContractError(f"prebuild: the example's {d.param!r} is not a tensor "
                                        f"with dim {d.dim}, which its gears declare")
                resized = _resized(t, per_param.pop(d.param))
                if d.index is not None and d.index < len(new_args):
                    new_args[d.index] = resized
                else:
                    new_kwargs[d.param] = resized
            calls.append((tuple(new_args), new_kwargs))
        return calls


def _dim(name: str, dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ContractError(f"cache_compile(): gears[{name!r}] has dim {dim!r}; dims are ints "
                            "counted from 0")
    return dim


def _values(name: str, dim: int, values: Any) -> list[int]:
    if not isinstance(values, (list, tuple)) or not values:
        raise ContractError(f"cache_compile(): gears[{name!r}][{dim}] must be a list of sizes")
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ContractError(f"cache_compile(): gears[{name!r}][{dim}] holds {v!r}; sizes "
                                "are ints >= 1")
        out.append(v)
    if len(set(out)) != len(out):
        raise ContractError(f"cache_compile(): gears[{name!r}][{dim}] repeats a size: {out}")
    if len(out) > MAX_VALUES:
        raise ContractError(f"cache_compile(): gears[{name!r}][{dim}] has {len(out)} sizes "
                            f"(at most {MAX_VALUES}, as TorchAir's set_dim_gears)")
    return out


def _padded(t: torch.Tensor, sizes: Mapping[int, int]) -> torch.Tensor:
    shape = list(t.shape)
    for d, n in sizes.items():
        shape[d] = n
    out = t.new_zeros(shape)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def _resized(t: torch.Tensor, sizes: Mapping[int, int]) -> torch.Tensor:
    out = t
    for d, n in sorted(sizes.items()):
        have = out.shape[d]
        if n <= have:
            out = out.narrow(d, 0, n)
        else:
            reps = [1] * out.dim()
            reps[d] = -(-n // have) if have else 1
            out = (out.repeat(*reps) if have else out.new_zeros(
                [n if i == d else s for i, s in enumerate(out.shape)])).narrow(d, 0, n)
    return out.contiguous().clone()
