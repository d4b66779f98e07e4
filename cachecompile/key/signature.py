"""The call signature: a cheap bucket for a call, and part of the entry's key.

It is computed on every call and is no stricter than Dynamo: the guards carried in each
entry (:mod:`cachecompile.entry.guards`) decide whether an entry fits; the signature only
groups calls that can share entries and names the group in logs and labels.

* Tensors: class (when not a plain Tensor / Parameter), dtype, device, rank, inference
  flag, layout, and either the exact shape (``dynamic=False``) or each dimension's
  size class 0 / 1 / many (``dynamic=True``: Dynamo specialises sizes 0 and 1 even for
  dynamic dims). The layout is ``True`` for a tensor with the strides a fresh tensor of
  its shape has; otherwise, with ``dynamic=False``, its exact strides (Dynamo's tensor
  guard checks them, so a slice ``x[:, :1]`` with strides ``[8, 1]`` and a fresh
  ``[1, 1]`` tensor miss each other: they must not print, nor build, as one signature);
  with ``dynamic=True``, ``is_contiguous()`` (exact strides when every size is 0 or 1,
  which Dynamo specialises). Storage offset is left to the guards (and
  to Inductor's own alignment copy), as Dynamo does. Dynamo's marks on the tensor (``mark_dynamic``,
  ``maybe_mark_dynamic``, ``mark_static``, ``mark_unbacked``, ``mark_static_address``)
  are part of it, and decide per dim between exact size and size class as they decide
  between static and symbolic in Dynamo.
* ints: with ``dynamic=True`` their class 0 / 1 / many (Dynamo makes other ints
  symbolic); with ``dynamic=False`` their value. floats: their value only with
  ``dynamic=False``. bools, strings, None, dtypes, devices: their value.
* lists, tuples, dicts, NamedTuples and dataclasses: recursively (tensors inside are
  graph inputs; other fields are guarded). Any other object: its class (Dynamo guards
  whatever the method reads from it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cachecompile._torch import runtime
from cachecompile.key.sigtext import _describe_one, describe  # noqa: F401 (re-exported: callers import it from here)

Signature = tuple[Any, ...]

_VALUE_SCALARS = (bool, str, type(None), torch.dtype, torch.device)
_Tensor = torch.Tensor
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_MAX_DEPTH = 6
_dim_marks = runtime.dim_marks


def _size_class(n: int) -> int:
    return n if n < 2 else -1  # (written out in _tensor_sig, which runs on every call)


@functools.lru_cache(maxsize=4096)
def _standard_strides(shape: torch.Size) -> tuple[int, ...]:
    """A fresh tensor's strides for ``shape`` (a call's shapes repeat: cached)."""
    out: list[int] = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _layout(t: torch.Tensor, shape: torch.Size, dynamic: bool) -> bool | tuple[int, ...]:
    """True for a fresh tensor's strides; else the strides (static) or contiguity."""
    contiguous = t.is_contiguous()
    if contiguous and 1 not in shape and 0 not in shape:
        return True  # contiguous with no size-1 dim: the strides are the standard ones
    if dynamic and any(n > 1 for n in shape):
        return contiguous  # symbolic dims: Dynamo's stride guards are symbolic too
    strides = t.stride()
    return True if strides == _standard_strides(shape) else strides


def _tensor_sig(t: torch.Tensor, dynamic: bool) -> tuple[Any, ...]:
    shape = t.shape
    marks = _dim_marks(t)
    if marks is None:
        sizes = tuple([n if n < 2 else -1 for n in shape]) if dynamic else tuple(shape)
    else:
        # Dynamo honours the marks over dynamic=: a dim marked dynamic is symbolic even
        # with dynamic=False (one entry for its sizes), one marked static is specialised
        # even with dynamic=True (mark_dynamic wins where both are set, as in Dynamo).
        marked = dict(marks)
        dyn = {i for label in runtime.DYNAMIC_MARKS for i in marked.get(label, ())}
        static = set(marked.get("static", ()))
        sizes = tuple(_size_class(s) if i in dyn or (dynamic and i not in static) else s
                      for i, s in enumerate(shape))
    cls = type(t)
    sig = ("T", t.dtype, t.device, sizes, _layout(t, shape, dynamic), t.is_inference(),
           None if cls in _PLAIN_TENSORS else f"{cls.__module__}.{cls.__qualname__}")
    # The marks are an 8th item only when present: unmarked tensors keep their keys.
    return sig if marks is None else (*sig, marks)


def _qual(v: Any) -> str:
    cls = type(v)
    return f"{cls.__module__}.{cls.__qualname__}"


def _value_sig(v: Any, dynamic: bool, depth: int = 0) -> Any:
    plain = _PLAIN_OBJECTS.get(type(v))
    if plain is not None:
        return plain
    if isinstance(v, _Tensor):
        return _tensor_sig(v, dynamic)
    if isinstance(v, _VALUE_SCALARS):
        # type matters: True == 1 == 1.0 but Dynamo treats them differently
        return (type(v).__name__, v)
    if isinstance(v, int) and type(v) is int:
        return ("int", _size_class(v)) if dynamic else ("int", v)
    if isinstance(v, float) and type(v) is float:
        return ("float", None) if dynamic else ("float", v)
    if depth >= _MAX_DEPTH:
        return ("obj", _qual(v))
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return ("nt", _qual(v), tuple(_value_sig(x, dynamic, depth + 1) for x in v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value_sig(x, dynamic, depth + 1) for x in v))
    if isinstance(v, Mapping):
        return ("dict", tuple((k, _value_sig(v[k], dynamic, depth + 1))
                              for k in sorted(v, key=repr)))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return ("dc", _qual(v), tuple((f.name, _value_sig(getattr(v, f.name, None), dynamic,
                                                          depth + 1))
                                      for f in dataclasses.fields(v)))
    out = ("obj", _qual(v))
    if len(_PLAIN_OBJECTS) < _MAX_PLAIN:
        _PLAIN_OBJECTS[type(v)] = out    # what its class alone decides: kept for next time
    return out


# Classes whose objects sign as ("obj", their name): none of the kinds above, which each
# call would otherwise test again (a cache object passed on every decode step).
_PLAIN_OBJECTS: dict[type, tuple[str, str]] = {}
_MAX_PLAIN = 1024


def signature(args: tuple[Any, ...], kwargs: Mapping[str, Any], dynamic: bool) -> Signature:
    # Every warm call computes it: a plain tensor goes straight to its signature, and a
    # list (not a generator) builds the tuple (1.4 against 2.0 us for a decode's token).
    pos = tuple([_tensor_sig(a, dynamic) if type(a) is _Tensor else _value_sig(a, dynamic)
                 for a in args])
    if not kwargs:
        return pos
    return pos + (("kw",) + tuple((k, _value_sig(kwargs[k], dynamic)) for k in sorted(kwargs)),)


def tensors_in_order(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
    """The call's tensors in the order :func:`signature` signs them (keyword arguments
    sorted, containers to the same depth): the n-th is the n-th tensor signature."""
    out: list[Any] = []

    def walk(v: Any, depth: int) -> None:
        if isinstance(v, _Tensor):
            out.append(v)
        elif type(v) in _PLAIN_OBJECTS or isinstance(v, (*_VALUE_SCALARS, int, float)):
            return
        elif depth >= _MAX_DEPTH:
            return
        elif isinstance(v, Mapping):
            for k in sorted(v, key=repr):
                walk(v[k], depth + 1)
        elif isinstance(v, (list, tuple)) or (dataclasses.is_dataclass(v)
                                              and not isinstance(v, type)):
            for x in _children(v):
                walk(x, depth + 1)

    for a in args:
        walk(a, 0)
    for k in sorted(kwargs):
        walk(kwargs[k], 0)
    return out


def _children(v: Any) -> list[Any]:
    if isinstance(v, (list, tuple)):
        return list(v)
    if isinstance(v, Mapping):
        return list(v.values())
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return [getattr(v, f.name, None) for f in dataclasses.fields(v)]
    return []


def requires_grad(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """True if any tensor argument (top level or nested in containers) requires grad."""
    stack: list[tuple[Any, int]] = [(a, 0) for a in (*args, *kwargs.values())]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, _Tensor):
            if v.requires_grad:
                return True
        elif depth < _MAX_DEPTH:
            stack.extend((c, depth + 1) for c in _children(v))
    return False


def describe_types(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   names: Sequence[str] = ()) -> str:
    """A call's arguments by type, named where ``names`` (the parameters) say: ``x:
    float32[4,15]@cpu, n: int``, ``x: str`` (for an error message about the call)."""

    def one(v: Any) -> str:
        if isinstance(v, _Tensor):
            return _describe_one(_tensor_sig(v, False))
        return type(v).__qualname__

    parts = [f"{names[i]}: {one(a)}" if i < len(names) else one(a) for i, a in enumerate(args)]
    parts += [f"{k}: {one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def varying(old: list[Signature], new: Signature, names: tuple[str, ...] = ()) -> str:
    """Which argument of ``new`` differs from the signatures seen before, and how."""
    if not old:
        return ""
    best = min(old, key=lambda s: sum(1 for a, b in zip(s, new, strict=False) if a != b))
    diffs: list[str] = []
    for i, (a, b) in enumerate(zip(best, new, strict=False)):
        if a == b:
            continue
        if isinstance(b, tuple) and b and b[0] == "kw" and isinstance(a, tuple) and a[:1] == ("kw",):
            old_kw, new_kw = dict(a[1:]), dict(b[1:])
            diffs.extend(f"{k}: {_describe_one(old_kw.get(k))} -> {_describe_one(new_kw.get(k))}"
                         for k in sorted(set(old_kw) | set(new_kw)) if old_kw.get(k) != new_kw.get(k))
        else:
            what = f"argument {names[i]!r}" if i < len(names) else f"argument #{i}"
            diffs.append(f"{what}: {_describe_one(a)} -> {_describe_one(b)}")
    if len(best) != len(new):
        diffs.append(f"{len(best)} -> {len(new)} arguments")
    return "; ".join(diffs)


def input_marks(sig: Signature) -> list[Any]:
    """``[(position, marks), ...]`` for the marked tensors of a signature, in order; empty
    when none is marked. Graph sharing keys them: most marks change the traced graph's code
    anyway, but TorchAir's gears do not, and a program is built for exactly its gears."""
    out: list[Any] = []

    def walk(v: Any, path: tuple[int, ...]) -> None:
        if not isinstance(v, tuple):
            return
        if v and v[0] == "T":
            if len(v) > 7:
                out.append((path, v[7]))
            return
        for i, x in enumerate(v):
            walk(x, (*path, i))

    walk(sig, ())
    return out


def to_json(sig: Signature) -> Any:
    """A JSON-able, canonical form of a signature (for the key and the manifest)."""
    if isinstance(sig, tuple):
        return [to_json(x) for x in sig]
    if isinstance(sig, (torch.dtype, torch.device)):
        return str(sig)
    if isinstance(sig, float) and (sig != sig or sig in (float("inf"), float("-inf"))):
        return repr(sig)
    return sig
