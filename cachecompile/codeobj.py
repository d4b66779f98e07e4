"""Dynamo's transformed bytecode as bytes, with the constants marshal cannot hold.

Dynamo bakes objects into the bytecode it generates: ``torch.device('cpu')`` and
``torch.float16`` when a method builds tensors, ``torch.Size`` and slices when it
rebuilds outputs, enum members for HF's ``ModelOutput`` and cache classes. ``marshal``
refuses all of them. :func:`dumps` swaps each such constant (in ``co_consts``, inside
tuples and frozensets, in nested code objects) for a placeholder and returns its
portable form (:mod:`cachecompile.values`); :func:`loads` puts the rebuilt objects back.
A constant with no portable form is named with the user's source line.
"""

from __future__ import annotations

import dis
import logging
import marshal
import types
from typing import Any

from . import values
from .errors import UnsupportedProgramError

logger = logging.getLogger(__name__)

JSON = Any

# A string no source code produces by accident: NUL bytes, a fixed prefix, an index.
_PREFIX = "\x00cachecompile-const\x00"


def _marshallable(v: Any) -> bool:
    try:
        marshal.dumps(v)
    except ValueError:
        return False
    return True


def _where(code: types.CodeType, const: Any) -> str:
    """``file:line`` of the instruction that loads ``const`` in ``code``."""
    line = code.co_firstlineno
    try:
        for ins in dis.get_instructions(code):
            if ins.opname.startswith("LOAD_CONST") and ins.argval is const:
                if ins.positions is not None and ins.positions.lineno is not None:
                    line = ins.positions.lineno
                break
    except Exception:  # noqa: BLE001 - only for the message
        logger.debug("could not locate a constant", exc_info=True)
    return f"{code.co_filename}:{line}"


def dumps(code: types.CodeType) -> tuple[bytes, list[JSON]]:
    """marshal.dumps with unmarshallable constants replaced; also their portable forms."""
    specs: list[JSON] = []

    def swap(v: Any, owner: types.CodeType) -> Any:
        if isinstance(v, types.CodeType):
            return rewrite(v)
        if type(v) is tuple:
            return tuple(swap(x, owner) for x in v)
        if type(v) is frozenset:
            return frozenset(swap(x, owner) for x in v)
        if isinstance(v, str) and v.startswith(_PREFIX):
            raise UnsupportedProgramError("bytecode holds a cachecompile placeholder string")
        if _marshallable(v):
            return v
        try:
            spec = values.encode_value(v)
        except UnsupportedProgramError as e:
            raise UnsupportedProgramError(
                f"transformed bytecode holds an unmarshallable constant {values.short(v)} "
                f"(type {type(v).__module__}.{type(v).__qualname__}) at {_where(owner, v)}: "
                f"{e}") from None
        specs.append(spec)
        return f"{_PREFIX}{len(specs) - 1}"

    def rewrite(c: types.CodeType) -> types.CodeType:
        return c.replace(co_consts=tuple(swap(v, c) for v in c.co_consts))

    return marshal.dumps(rewrite(code)), specs


def loads(data: bytes, consts: list[JSON]) -> types.CodeType:
    """The inverse of :func:`dumps`; raises UnsupportedProgramError on bad input."""
    try:
        code = marshal.loads(data)
    except (EOFError, ValueError, TypeError) as e:
        raise UnsupportedProgramError(f"stored bytecode does not load: {e}") from e
    if not isinstance(code, types.CodeType):
        raise UnsupportedProgramError("stored bytecode is not a code object")
    try:
        rebuilt = [values.decode_value(s) for s in consts]
    except (ValueError, TypeError, KeyError, AttributeError, ImportError) as e:
        raise UnsupportedProgramError(f"stored constant does not rebuild: {e}") from e
    used: set[int] = set()

    def back(v: Any) -> Any:
        if isinstance(v, types.CodeType):
            return restore(v)
        if type(v) is tuple:
            return tuple(back(x) for x in v)
        if type(v) is frozenset:
            return frozenset(back(x) for x in v)
        if isinstance(v, str) and v.startswith(_PREFIX):
            tail = v[len(_PREFIX):]
            if not tail.isdigit() or int(tail) >= len(rebuilt):
                raise UnsupportedProgramError(f"bad constant placeholder {tail!r}")
            used.add(int(tail))
            return rebuilt[int(tail)]
        return v

    def restore(c: types.CodeType) -> types.CodeType:
        return c.replace(co_consts=tuple(back(v) for v in c.co_consts))

    out = restore(code)
    if len(used) != len(rebuilt):
        raise UnsupportedProgramError("stored constants do not match the bytecode")
    return out
