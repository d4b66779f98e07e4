"""Bytecode constants marshal cannot hold are stored by reconstruction (codeobj, values)."""

from __future__ import annotations

import enum
import marshal
import types

import pytest
import torch

from cachecompile import codeobj, values
from cachecompile.errors import UnsupportedProgramError


class Color(enum.Enum):
    RED = 1
    BLUE = 2


SPECIAL = [torch.device("cpu"), torch.float16, torch.Size([2, 3]), torch.strided,
           torch.contiguous_format, slice(None, 4, None), slice(1, None, 2), range(1, 9, 2),
           Color.BLUE, (torch.int8, (torch.device("cpu"), slice(2))),
           frozenset({torch.bfloat16}), Ellipsis, float("inf"), b"\x00\x01", 1 + 2j]


def _code_with(consts: list[object]) -> types.CodeType:
    src = "def f():\n    return 0\n\ndef g():\n    return 1\n"
    outer = compile(src, "<test>", "exec")
    f_code = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    nested = f_code.replace(co_consts=(*f_code.co_consts, *consts))
    return outer.replace(co_consts=(*outer.co_consts, nested, tuple(consts)))


def test_round_trip_of_every_kind() -> None:
    code = _code_with(SPECIAL)
    with pytest.raises(ValueError):
        marshal.dumps(code)
    data, specs = codeobj.dumps(code)
    back = codeobj.loads(data, specs)
    assert back.co_consts[-1] == tuple(SPECIAL)
    nested = [c for c in back.co_consts if isinstance(c, types.CodeType) and c.co_name == "f"][-1]
    assert nested.co_consts[-len(SPECIAL):] == tuple(SPECIAL)
    assert back.co_consts[-1][1] is torch.float16


def test_values_are_closed_kinds_only() -> None:
    with pytest.raises(ValueError, match="unknown value kind"):
        values.decode_value({"$": "pickle", "v": "..."})
    with pytest.raises(ValueError):
        values.decode_value({"$": "torch", "v": "nn"})  # not a dtype/layout/format
    with pytest.raises(ValueError):
        values.decode_value({"$": "enum", "module": "os", "qualname": "path", "name": "x"})


def test_tampered_specs_are_refused() -> None:
    data, specs = codeobj.dumps(_code_with([torch.float16]))
    with pytest.raises(UnsupportedProgramError):
        codeobj.loads(data, [])                                 # placeholder out of range
    with pytest.raises(UnsupportedProgramError):
        codeobj.loads(data, [*specs, {"$": "torch", "v": "float32"}])  # unused spec
    with pytest.raises(UnsupportedProgramError):
        codeobj.loads(data, [{"$": "eval", "v": "1"}])        # unknown kind


class Opaque:
    pass


def test_unportable_constant_names_type_and_line() -> None:
    src = "def f():\n    x = 1\n    return None\n"
    code = compile(src, "/src/model.py", "exec")
    f_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    opaque = Opaque()
    # Make the function's `return None` load the opaque object instead.
    i = f_code.co_consts.index(None)
    bad = f_code.replace(co_consts=tuple(opaque if j == i else c
                                         for j, c in enumerate(f_code.co_consts)))
    with pytest.raises(UnsupportedProgramError, match=r"Opaque.*/src/model.py:3"):
        codeobj.dumps(bad)


def test_dynamo_bytecode_with_device_and_dtype_constants() -> None:
    class M(torch.nn.Module):
        def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
            z = torch.zeros(2, device=torch.device("cpu"), dtype=torch.float16)
            return x + z.float().sum(), x.shape

    m = M()
    fn = torch.compile(m.run, backend="eager", fullgraph=True)
    fn(torch.ones(2))
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(M.run.__code__)
    code = entries[0].code
    data, specs = codeobj.dumps(code)
    back = codeobj.loads(data, specs)
    assert back.co_code == code.co_code
    assert back.co_consts == code.co_consts
