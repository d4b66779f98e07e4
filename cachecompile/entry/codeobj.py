"""Dynamo's transformed bytecode as bytes, with the constants marshal cannot hold.

Dynamo bakes objects into the bytecode it generates: ``torch.device('cpu')``,
``torch.float16`` or ``torch.strided`` when a method reads ``x.device``/``x.dtype`` or
builds tensors, ``torch.Size`` when it returns a shape, slices, ``NotImplemented``, enum
members for HF's ``ModelOutput`` and cache classes, ``torch.finfo``. ``marshal`` refuses
all of them, so an entry could not hold the bytecode at all. :func:`dumps` swaps each such
constant (in ``co_consts``, inside tuples and frozensets, in nested code objects) for a
placeholder string and returns the constant's portable form; :func:`loads` marshals the
code back and puts the rebuilt objects in place.

The portable forms are :mod:`cachecompile.entry.values`' tagged JSON (``{"$": kind, ...}``) plus
the few kinds only bytecode needs (:data:`_OWN_KINDS`). The list comes from a cache entry
another process wrote, so it is read as data: a closed set of kinds with exact keys, each
rebuilt by name lookup (``getattr(torch, name)``, importing an enum's module), never by
eval or unpickling. A constant with no portable form is refused when the entry is
written, naming its type and the user's ``file:line``, so the method compiles live
instead of failing in a later process.

This module is imported on the warm path: torch and the standard library only, and
nothing from ``torch._dynamo`` or ``torch._inductor`` (SDPBackend through
:mod:`cachecompile._torch.runtime`).
"""

from __future__ import annotations

import dis
import enum
import importlib
import json
import logging
import marshal
import math
import re
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cachecompile._torch import runtime
from cachecompile.entry import values
from cachecompile.entry.files import CONST_PREFIX
from cachecompile.errors import UnsupportedProgramError
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)


# A string no source code produces by accident: NUL bytes, a fixed prefix, an index.
_PREFIX = CONST_PREFIX
_PREFIX_BYTES = CONST_PREFIX.encode("utf-8")
# Canonical ASCII decimal only ("٣", "+1", "01" are refused): str.isdigit() is too lenient.
_INDEX = re.compile(r"(?:0|[1-9][0-9]{0,8})")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEVICE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?::[0-9]{1,6})?")
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_MAX_DEPTH = 16

# Kinds values.decode_value rebuilds, with the exact keys a spec of that kind has. A spec
# with another key set is refused before anything is rebuilt.
_VALUE_KINDS: dict[str, frozenset[str]] = {
    **{k: frozenset({"$", "v"}) for k in (
        "float", "torch", "device", "size", "tuple", "list", "frozenset", "set", "dict",
        "slice", "range", "bytes", "complex")},
    "ellipsis": frozenset({"$"}),
    "enum": frozenset({"$", "module", "qualname", "name"}),
}
# Kinds only bytecode constants need (Dynamo's is_safe_constant allows them in LOAD_CONST):
# rebuilt here, before values is asked.
_OWN_KINDS: dict[str, frozenset[str]] = {
    "notimplemented": frozenset({"$"}),
    "finfo": frozenset({"$", "v"}),
    "iinfo": frozenset({"$", "v"}),
    "sdpbackend": frozenset({"$", "v"}),
    # A module's globals dict, by the module's name: Dynamo's bytecode rebuilds a nested
    # function over it after a graph break (its _create_nested_fn).
    "globals": frozenset({"$", "v"}),
    # A classmethod bound to an importable class (a namedtuple's ``_make``: Dynamo
    # rebuilds the namedtuple a frame returns through it).
    "classmethod": frozenset({"$", "module", "qualname", "name"}),
}
_KINDS = {**_VALUE_KINDS, **_OWN_KINDS}


def _marshallable(v: Any) -> bool:
    try:
        marshal.dumps(v)
    except ValueError:
        return False
    return True


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# --------------------------------------------------------------------------- source lines

def _line_of(ins: dis.Instruction) -> int | None:
    """The line an instruction belongs to, on every Python from 3.10 to 3.13."""
    positions = getattr(ins, "positions", None)            # 3.11+
    if positions is not None and positions.lineno is not None:
        return int(positions.lineno)
    line_number = getattr(ins, "line_number", None)        # 3.13
    if isinstance(line_number, int):
        return line_number
    starts = ins.starts_line                               # 3.10-3.12: int or None
    if isinstance(starts, int) and not isinstance(starts, bool):
        return starts
    return None


def _where(code: types.CodeType, index: int) -> str:
    """``file:line`` of the instruction that loads ``code.co_consts[index]``.

    Matching by the constant's slot rather than its value also finds constants nested in a
    tuple constant. An instruction without a line (Dynamo emits many) takes the line of
    the one before it; a constant nothing loads takes ``co_firstlineno``. Dynamo tags its
    generated instructions with the method's first line, so for transformed bytecode this
    is usually the ``def`` line of the compiled method.
    """
    current = code.co_firstlineno
    try:
        for ins in dis.get_instructions(code):
            line = _line_of(ins)
            if line is not None:
                current = line
            if ins.opcode in dis.hasconst and ins.arg == index:
                return f"{code.co_filename}:{current}"
    except Exception:  # only for the message; a broken repr must not hide it
        logger.debug("could not locate constant %d in %s", index, code.co_name, exc_info=True)
    return f"{code.co_filename}:{code.co_firstlineno}"


# --------------------------------------------------------------------------- encoding

def _dtype_by_name(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and _NAME.fullmatch(name) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch.{name} is not a dtype")
    return dtype


def _module_globals_name(d: dict[Any, Any]) -> str | None:
    """The name of the module whose globals ``d`` is (the very dict), else None."""
    name = d.get("__name__")
    mod = sys.modules.get(name) if isinstance(name, str) else None
    return name if mod is not None and getattr(mod, "__dict__", None) is d else None


def _encode_leaf(v: Any) -> JSON:
    """The portable form of one constant; UnsupportedProgramError if it has none."""
    if v is NotImplemented:
        return {"$": "notimplemented"}
    if type(v) is dict and _module_globals_name(v) is not None:
        return {"$": "globals", "v": _module_globals_name(v)}
    if isinstance(v, torch.finfo):
        return {"$": "finfo", "v": str(v.dtype)}
    if isinstance(v, torch.iinfo):
        return {"$": "iinfo", "v": str(v.dtype)}
    sdp = runtime.sdp_backend_name(v)
    if sdp is not None:
        return {"$": "sdpbackend", "v": sdp}
    if isinstance(v, types.MethodType) and isinstance(v.__self__, type):
        cls = v.__self__
        return {"$": "classmethod", "module": cls.__module__, "qualname": cls.__qualname__,
                "name": v.__name__}
    if isinstance(v, enum.Enum):
        # Here, not in values: values writes a StrEnum/IntEnum member as its plain value.
        cls = type(v)
        if "<locals>" in cls.__qualname__:
            raise UnsupportedProgramError(
                f"enum {cls.__qualname__} is defined in a function (not importable)")
        return {"$": "enum", "module": cls.__module__, "qualname": cls.__qualname__,
                "name": v.name}
    return values.encode_value(v)


def _same(a: Any, b: Any) -> bool:
    """Whether ``b`` is ``a`` rebuilt: equal *and* of the same types all the way down.

    ``==`` alone would accept ``"x"`` for a ``StrEnum`` member, ``1`` for ``True`` or for
    an ``IntEnum`` member, ``0.0`` for ``-0.0``: bytecode that then behaves differently.
    """
    if a is b:
        return True   # rebuilt as the very object (a module's globals)
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (frozenset, set)):
        return len(a) == len(b) and all(any(_same(x, y) for y in b) for x in a)
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            any(_same(k, k2) and _same(x, b[k2]) for k2 in b) for k, x in a.items())
    if isinstance(a, slice):
        return (_same(a.start, b.start) and _same(a.stop, b.stop)
                and _same(a.step, b.step))
    if isinstance(a, range):
        return (a.start, a.stop, a.step) == (b.start, b.stop, b.step)
    if isinstance(a, (float, complex)):
        return repr(a) == repr(b)  # nan == nan, -0.0 != 0.0
    return bool(a is b or a == b)


def _portable(v: Any) -> JSON:
    """``v``'s spec, checked to rebuild as ``v`` after a JSON round trip.

    The check runs when the entry is written, so a value that would come back different
    (a StrEnum member inside a slice, a Flag combination, a class renamed on import) is
    refused here, with the user's line, not replayed wrongly in another process.
    """
    try:
        spec = _encode_leaf(v)
    except UnsupportedProgramError as e:
        if str(e).startswith("no portable form"):  # values' message repeats type and repr
            raise UnsupportedProgramError("no portable form") from None
        raise
    except Exception as e:  # e.g. an enum whose name lookup fails
        raise UnsupportedProgramError(f"no portable form: {e}") from e
    try:
        stored = json.loads(json.dumps(spec, allow_nan=False))
        back = _decode(stored)
    except Exception as e:  # any failure to rebuild means: not portable
        raise UnsupportedProgramError(f"its portable form does not rebuild: {e}") from e
    if not _same(v, back):
        raise UnsupportedProgramError(
            f"its portable form rebuilds as {values.short(back)} ({_type_name(back)})")
    return spec


def _walk(code: types.CodeType, leaf: Callable[[Any, types.CodeType, int], Any]
          ) -> types.CodeType:
    """``code`` with every constant that is not a code object, tuple or frozenset (at any
    depth, in nested code too) replaced by ``leaf(value, owner, slot)``: ``owner`` is the
    code object whose ``co_consts[slot]`` holds the value (directly or in a container)."""

    def swap(v: Any, owner: types.CodeType, slot: int) -> Any:
        if isinstance(v, types.CodeType):
            return _walk(v, leaf)
        if type(v) is tuple:
            return tuple(swap(x, owner, slot) for x in v)
        if type(v) is frozenset:
            return frozenset(swap(x, owner, slot) for x in v)
        return leaf(v, owner, slot)

    return code.replace(co_consts=tuple(swap(v, code, i) for i, v in enumerate(code.co_consts)))


def _placeholder_clash(owner: types.CodeType, slot: int) -> str:
    return (f"transformed bytecode holds a string that looks like a cachecompile placeholder "
            f"at {_where(owner, slot)}")


def _unportable(v: Any, owner: types.CodeType, slot: int, why: Exception) -> str:
    return (f"transformed bytecode holds an unmarshallable constant {values.short(v)} "
            f"(type {_type_name(v)}) at {_where(owner, slot)}: {why}")


def describe_unmarshallable(code: types.CodeType) -> list[str]:
    """One message per constant in ``code`` that :func:`dumps` would refuse (empty: fine).

    For diagnostics (``cachectl``, logs): :func:`dumps` stops at the first one.
    """
    problems: list[str] = []

    def leaf(v: Any, owner: types.CodeType, slot: int) -> Any:
        if isinstance(v, str) and v.startswith(_PREFIX):
            problems.append(_placeholder_clash(owner, slot))
        elif not _marshallable(v):
            try:
                _portable(v)
            except UnsupportedProgramError as e:
                problems.append(_unportable(v, owner, slot, e))
        return v

    _walk(code, leaf)
    return problems


def dumps(code: types.CodeType) -> tuple[bytes, list[JSON]]:
    """marshal.dumps of ``code`` with every unmarshallable constant (recursively: in
    co_consts, inside tuples/frozensets, in nested code objects) replaced by a placeholder;
    returns the bytes and a JSON-able list of constant specs (index i <-> placeholder i).

    Raises UnsupportedProgramError naming the constant's type, repr and ``file:line`` when a
    constant has no portable form.
    """
    specs: list[JSON] = []

    def leaf(v: Any, owner: types.CodeType, slot: int) -> Any:
        if isinstance(v, str) and v.startswith(_PREFIX):
            raise UnsupportedProgramError(_placeholder_clash(owner, slot))
        if _marshallable(v):
            return v
        try:
            specs.append(_portable(v))
        except UnsupportedProgramError as e:
            raise UnsupportedProgramError(_unportable(v, owner, slot, e)) from None
        return f"{_PREFIX}{len(specs) - 1}"

    rewritten = _walk(code, leaf)
    if specs:
        logger.debug("%s: %d constant(s) stored by reconstruction", code.co_name, len(specs))
    return marshal.dumps(rewritten), specs


# --------------------------------------------------------------------------- decoding

def _plain(j: JSON) -> bool:
    """A value values' format writes as itself (nested in a spec)."""
    return (j is None or type(j) in (bool, str, int)
            or (type(j) is float and math.isfinite(j)))


def _check_spec(spec: JSON, depth: int = 0, kinds: dict[str, frozenset[str]] = _KINDS) -> str:
    """The spec's kind, after checking its whole shape, nested specs included.

    The grammar is exactly what :func:`dumps` writes: a known kind, exactly that kind's
    keys, and payloads of the right JSON types. values.decode_value alone is lenient
    (``{"$": "size", "v": "12"}`` would make ``torch.Size([1, 2])``); this is not.
    Nested specs (inside a tuple, slice, ...) are rebuilt by values alone, so only its
    kinds are allowed there. Raises ValueError.
    """
    kind = _spec_kind(spec, depth, kinds)
    v = spec.get("v")
    if kind in _PAYLOADS:
        ok = _PAYLOADS[kind](v)
    elif kind in ("slice", "tuple", "list", "frozenset", "set", "dict"):
        ok = _check_nested(kind, v, depth)
    elif kind in ("enum", "classmethod"):
        ok = _check_enum(spec)
    else:  # ellipsis, notimplemented: no payload
        ok = True
    if not ok:
        raise ValueError(f"bad {kind} spec {values.short(spec)}")
    return kind


def _spec_kind(spec: JSON, depth: int, kinds: dict[str, frozenset[str]]) -> str:
    """The envelope of a spec: an object of a known kind with exactly that kind's keys."""
    if depth > _MAX_DEPTH:
        raise ValueError("constant spec nested too deeply")
    if not isinstance(spec, dict):
        raise ValueError(f"a constant spec must be an object, not {type(spec).__name__}")
    kind = spec.get("$")
    if not isinstance(kind, str) or kind not in kinds:
        raise ValueError(f"unknown constant kind {kind!r}")
    if set(spec) != kinds[kind]:
        raise ValueError(f"constant spec of kind {kind!r} has keys {sorted(spec)}")
    return kind


def _name(pattern: re.Pattern[str]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and pattern.fullmatch(v) is not None


# The payload ``v`` of each kind that holds no other spec: its JSON type and form.
_PAYLOADS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(("torch", "finfo", "iinfo", "sdpbackend"), _name(_NAME)),
    "globals": _name(_DOTTED),
    "device": _name(_DEVICE),
    "float": lambda v: v in ("inf", "-inf", "nan"),
    "size": lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v),
    "range": lambda v: isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v),
    "bytes": _name(_HEX),
    "complex": lambda v: (isinstance(v, list) and len(v) == 2
                          and all(type(x) in (int, float) for x in v)),
}


def _check_nested(kind: str, v: Any, depth: int) -> bool:
    """A container's payload: a slice's three items, a dict's pairs, a sequence's items,
    each a plain value or a nested spec of values' kinds (checked in turn)."""
    if kind == "dict":
        if not isinstance(v, list):
            return False
        for pair in v:
            _check_items(kind, pair, depth, 2)
        return True
    _check_items(kind, v, depth, 3 if kind == "slice" else None)
    return True


def _check_items(kind: str, items: Any, depth: int, n: int | None) -> None:
    if not isinstance(items, list) or (n is not None and len(items) != n):
        raise ValueError(f"bad {kind} payload {values.short(items)}")
    for x in items:
        if not _plain(x):
            _check_spec(x, depth + 1, _VALUE_KINDS)


def _check_enum(spec: dict[str, Any]) -> bool:
    """An enum member, or a classmethod, by module and class, both dotted names (no class
    in a function), and its name."""
    module, qualname, name = spec["module"], spec["qualname"], spec["name"]
    if not (isinstance(module, str) and _DOTTED.fullmatch(module)):
        raise ValueError(f"bad enum module {module!r}")
    if not (isinstance(qualname, str) and _DOTTED.fullmatch(qualname)):
        raise ValueError(f"bad enum class {qualname!r} (classes in functions are refused)")
    return isinstance(name, str)


def _decode(spec: JSON) -> Any:
    kind = _check_spec(spec)
    v = spec.get("v")
    if kind == "notimplemented":
        return NotImplemented
    if kind == "finfo":
        dtype = _dtype_by_name(v)
        if not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"torch.finfo of a non-floating dtype {v!r}")
        return torch.finfo(dtype)
    if kind == "iinfo":
        dtype = _dtype_by_name(v)
        if dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
            raise ValueError(f"torch.iinfo of a non-integer dtype {v!r}")
        return torch.iinfo(dtype)
    if kind == "sdpbackend":
        return runtime.sdp_backend(v)
    if kind == "globals":
        if not (isinstance(v, str) and _DOTTED.fullmatch(v)):
            raise ValueError(f"bad module name {v!r}")
        return vars(sys.modules.get(v) or importlib.import_module(v))
    if kind == "classmethod":
        return _classmethod(spec)
    return values.decode_value(spec)


def _classmethod(spec: dict[str, Any]) -> types.MethodType:
    """The classmethod a checked ``classmethod`` spec names, bound to its class."""
    if not _NAME.fullmatch(str(spec["name"])):
        raise ValueError(f"bad classmethod name {spec['name']!r}")
    owner: Any = importlib.import_module(spec["module"])
    for part in str(spec["qualname"]).split("."):
        owner = getattr(owner, part)
    bound = getattr(owner, spec["name"]) if isinstance(owner, type) else None
    if not (isinstance(bound, types.MethodType) and bound.__self__ is owner):
        raise ValueError(f"{spec['qualname']}.{spec['name']} is no classmethod")
    return bound


def _rebuild(i: int, spec: JSON) -> Any:
    try:
        return _decode(spec)
    except Exception as e:  # torch.device('bogus') raises RuntimeError, etc.
        raise UnsupportedProgramError(f"stored constant {i} does not rebuild: {e}") from e


def loads(data: bytes, consts: list[JSON]) -> types.CodeType:
    """The inverse of :func:`dumps`: marshal.loads, then put back the rebuilt constants.

    Checks strictly, since ``consts`` comes from a cache entry: every spec has a known kind
    and exactly its keys, every placeholder names a spec, and every spec is used exactly
    once. Any mismatch raises UnsupportedProgramError (the caller compiles live).
    """
    if not isinstance(consts, list):
        raise UnsupportedProgramError("stored constants are not a list")
    try:
        code = marshal.loads(data)
    except (EOFError, ValueError, TypeError) as e:
        raise UnsupportedProgramError(f"stored bytecode does not load: {e}") from e
    if not isinstance(code, types.CodeType):
        raise UnsupportedProgramError("stored bytecode is not a code object")
    if not consts and _PREFIX_BYTES not in data:
        # No constant to put back, and no placeholder anywhere: a placeholder string is
        # in marshal's bytes as its UTF-8 text. Nothing to walk (a program's nested code
        # objects took ~0.4 ms an entry to rebuild unchanged).
        return code
    rebuilt = [_rebuild(i, s) for i, s in enumerate(consts)]
    used: set[int] = set()

    def leaf(v: Any, owner: types.CodeType, slot: int) -> Any:
        if not (isinstance(v, str) and v.startswith(_PREFIX)):
            return v
        tail = v[len(_PREFIX):]
        if not _INDEX.fullmatch(tail) or int(tail) >= len(rebuilt):
            raise UnsupportedProgramError(f"bad constant placeholder {tail!r}")
        i = int(tail)
        if i in used:
            raise UnsupportedProgramError(f"constant placeholder {i} used twice")
        used.add(i)
        return rebuilt[i]

    out = _walk(code, leaf)
    if len(used) != len(rebuilt):
        raise UnsupportedProgramError(
            f"stored constants do not match the bytecode ({len(rebuilt) - len(used)} unused)")
    return out


__all__ = ["JSON", "bind_names", "describe_unmarshallable", "dumps", "loads"]


# -- transformed code bound to objects instead of generated globals --------------------------
def _cache_units(op: int) -> int:
    entries = getattr(dis, "_inline_cache_entries", None)
    if entries is None:
        return 0                                         # 3.10: no inline caches
    if isinstance(entries, Mapping):                     # 3.13: by name
        return int(entries.get(dis.opname[op], 0))
    return int(entries[op])                              # 3.11, 3.12: by opcode


def _load_const(k: int, null: bool, units: int) -> list[tuple[int, int]] | None:
    """``LOAD_CONST k`` (with the NULL a ``LOAD_GLOBAL`` pushed, where it pushed one) in
    exactly ``units`` code units, NOPs after; None where it does not fit."""
    ext, nop = dis.opmap["EXTENDED_ARG"], dis.opmap["NOP"]
    seq: list[tuple[int, int]] = []
    if k > 255:
        seq.append((ext, k >> 8))
    seq.append((dis.opmap["LOAD_CONST"], k & 0xFF))
    if null:
        push_null = (dis.opmap["PUSH_NULL"], 0)
        # 3.13: the callable, then NULL; 3.11 and 3.12: NULL first.
        seq = [*seq, push_null] if sys.version_info >= (3, 13) else [push_null, *seq]
    if len(seq) > units or k > 0xFFFF:
        return None
    return seq + [(nop, 0)] * (units - len(seq))


def bind_names(code: types.CodeType, values: Mapping[str, Any]) -> types.CodeType:
    """``code`` with each ``LOAD_GLOBAL`` of a name in ``values`` made a ``LOAD_CONST`` of
    its value (nested code objects too).

    Replayed bytecode (a method's, a resume function's, a callee's) runs in its module's
    own globals, as under ``torch.compile``, so that a global it writes or deletes lands
    in the module; the names Dynamo generated for it (``__compiled_fn_*``,
    ``__resume_at_*``, ``__import_*``) are bound this way instead of being written into
    that module. Same length, same offsets: jumps, the exception table and the line table
    stay valid. UnsupportedProgramError where an instruction has no room (3.10, a
    constant index past 255 without an ``EXTENDED_ARG`` already there), or where the code
    writes a name it binds (the write would not reach what the reads see)."""
    consts = list(code.co_consts)
    for i, c in enumerate(consts):
        if isinstance(c, types.CodeType):
            consts[i] = bind_names(c, values)
    raw = bytearray(code.co_code)
    load_global, ext = dis.opmap["LOAD_GLOBAL"], dis.opmap["EXTENDED_ARG"]
    writes = {dis.opmap["STORE_GLOBAL"], dis.opmap["DELETE_GLOBAL"]}
    null_bit = sys.version_info >= (3, 11)
    added: dict[str, int] = {}
    start = i = 0
    arg = 0
    while i < len(raw):
        op, oparg = raw[i], raw[i + 1]
        arg = (arg << 8) | oparg
        if op == ext:
            i += 2
            continue
        if op in writes and code.co_names[arg] in values:
            raise UnsupportedProgramError(
                f"{code.co_name}'s bytecode writes {code.co_names[arg]}, a name it reads bound")
        if op == load_global:
            namei, null = (arg >> 1, arg & 1) if null_bit else (arg, 0)
            name = code.co_names[namei]
            if name in values:
                if name not in added:
                    added[name] = len(consts)
                    consts.append(values[name])
                units = (i - start) // 2 + 1 + _cache_units(op)
                seq = _load_const(added[name], bool(null), units)
                if seq is None:
                    raise UnsupportedProgramError(
                        f"no room to bind {name} in {code.co_name}'s bytecode")
                for j, (o, a) in enumerate(seq):
                    raw[start + 2 * j], raw[start + 2 * j + 1] = o, a
                i = start + 2 * units
                start, arg = i, 0
                continue
        i += 2 + 2 * _cache_units(op)
        start, arg = i, 0
    return code.replace(co_code=bytes(raw), co_consts=tuple(consts))
