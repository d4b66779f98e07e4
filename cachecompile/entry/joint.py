"""A training graph's layout: how its stored forward and backward programs join.

Written by the adapters' cold path (from AOTAutograd's metadata, :mod:`cachecompile._torch.aot`)
into a program's record under :data:`KEY`, and read back by the warm path
(:mod:`cachecompile.backends.joint`), here only. Torch-free: ``cachectl`` reads it.

The forward program returns ``n_outputs`` user outputs, then the tensors backward needs
(``n_unchecked`` of them last, saved without a version-counter check, as AOTAutograd
saves them), then ``n_symints`` sizes. The backward program takes the sizes, the tensors
and one gradient per output named in ``tangents``, and returns one gradient per input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cachecompile.entry import files
from cachecompile.errors import UnsupportedProgramError
from cachecompile.store.jsonvalue import JSON

# The program record's key for the layout (its presence makes the program a training one)
# and for the backward program's own record; the backward's files lie under BACKWARD_DIR.
KEY = files.JOINT_META
BACKWARD_META = files.BACKWARD_META
BACKWARD_DIR = files.BACKWARD_DIR

_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d")


@dataclasses.dataclass(frozen=True)
class Layout:
    n_inputs: int
    n_outputs: int
    n_symints: int
    n_unchecked: int
    outputs_require_grad: tuple[bool, ...]
    tangents: tuple[int, ...]          # the outputs whose gradients backward takes, in order
    # Each tangent's expected layout: {"memory_format": name} or {"size": [..], "stride": [..]}
    tangent_layouts: tuple[Mapping[str, Any], ...]
    disable_amp: bool                  # autocast was on when traced: the programs hold the casts
    deterministic: bool | None         # torch.use_deterministic_algorithms when traced
    donated: bool                      # backward reuses saved buffers: no retain_graph

    def to_json(self) -> dict[str, JSON]:
        return {"n_inputs": self.n_inputs, "n_outputs": self.n_outputs,
                "n_symints": self.n_symints, "n_unchecked": self.n_unchecked,
                "outputs_require_grad": list(self.outputs_require_grad),
                "tangents": list(self.tangents),
                "tangent_layouts": [dict(t) for t in self.tangent_layouts],
                "disable_amp": self.disable_amp, "deterministic": self.deterministic,
                "donated": self.donated}

    @classmethod
    def from_json(cls, raw: Any) -> Layout:
        """The layout a record holds; UnsupportedProgramError for anything malformed."""
        if not isinstance(raw, Mapping):
            raise _bad("not a map")
        n_outputs = _count(raw, "n_outputs")
        rg = raw.get("outputs_require_grad")
        if not isinstance(rg, list) or len(rg) != n_outputs or \
                not all(isinstance(x, bool) for x in rg):
            raise _bad("outputs_require_grad")
        tangents = raw.get("tangents")
        if not isinstance(tangents, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_outputs
                for i in tangents) or tangents != sorted(set(tangents)):
            raise _bad("tangents")
        layouts = raw.get("tangent_layouts")
        if not isinstance(layouts, list) or len(layouts) != len(tangents):
            raise _bad("tangent_layouts")
        for t in layouts:
            _check_tangent_layout(t)
        return cls(n_inputs=_count(raw, "n_inputs"), n_outputs=n_outputs,
                   n_symints=_count(raw, "n_symints"), n_unchecked=_count(raw, "n_unchecked"),
                   outputs_require_grad=tuple(rg), tangents=tuple(tangents),
                   tangent_layouts=tuple(dict(t) for t in layouts),
                   disable_amp=_flag(raw, "disable_amp"),
                   deterministic=_flag(raw, "deterministic", nullable=True),
                   donated=_flag(raw, "donated"))


def _bad(why: str) -> UnsupportedProgramError:
    return UnsupportedProgramError(f"the entry's training layout is malformed: {why}")


def _count(raw: Mapping[str, Any], name: str) -> int:
    v = raw.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _bad(f"{name} is {v!r}")
    return v


def _flag(raw: Mapping[str, Any], name: str, nullable: bool = False) -> Any:
    v = raw.get(name, "missing")
    if isinstance(v, bool) or (nullable and v is None):
        return v
    raise _bad(f"{name} is {v!r}")


def _check_tangent_layout(t: Any) -> None:
    """{"memory_format": name} or {"size": [ints], "stride": [ints]} of one rank."""
    if not isinstance(t, Mapping):
        raise _bad("a tangent layout")
    if "memory_format" in t:
        if t["memory_format"] not in _FORMATS or len(t) != 1:
            raise _bad(f"memory format {t.get('memory_format')!r}")
    elif set(t) != {"size", "stride"} or not all(
            isinstance(t[k], list) and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in t[k]) for k in ("size", "stride")) \
            or len(t["size"]) != len(t["stride"]):
        raise _bad("a tangent's size and stride")


def layout_of(meta: Mapping[str, Any]) -> Layout | None:
    """A program record's training layout; None for an inference program."""
    raw = meta.get(KEY)
    return None if raw is None else Layout.from_json(raw)
