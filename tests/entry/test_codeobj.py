"""Bytecode constants marshal cannot hold are stored by reconstruction (codeobj, values).

Most tests inject objects into ``compile()``d code with ``code.replace(co_consts=...)``;
the last one takes real Dynamo bytecode and runs it rebuilt, without Dynamo.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import marshal
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from cachecompile.entry import codeobj, values
from cachecompile.errors import UnsupportedProgramError


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Holder:
    class Inner(enum.Enum):  # a nested qualname: Holder.Inner
        X = "x"


Point = collections.namedtuple("Point", ["x", "y"])


class Maker:
    @classmethod
    def make(cls) -> Maker:
        return cls()

    @staticmethod
    def plain() -> int:
        return 1


class Perm(enum.Flag):
    R = 1
    W = 2


if sys.version_info >= (3, 11):
    class Letter(enum.StrEnum):
        A = "a"


SPECIAL: list[Any] = [
    torch.device("cpu"), torch.device("cuda", 1), torch.float16, torch.bfloat16, torch.bool,
    torch.Size([2, 3]), torch.Size([]), torch.strided, torch.sparse_coo,
    torch.contiguous_format, torch.channels_last,
    slice(None, 4, None), slice(1, None, -2), slice(torch.int8, Color.RED),
    range(1, 9, 2), range(0), Color.BLUE, Level.HIGH, Holder.Inner.X,
    NotImplemented, torch.finfo(torch.float16), torch.iinfo(torch.uint8),
    torch.nn.attention.SDPBackend.MATH,
    (torch.int8, (torch.device("cpu"), slice(2)), "plain"),
    frozenset({torch.bfloat16, torch.float32, 3}),
    # A classmethod bound to an importable class: Dynamo rebuilds a namedtuple a resume
    # frame returns through its _make (Reformer, issue 61).
    Point._make, Maker.make,
    # marshal holds these already: they must pass through untouched.
    Ellipsis, float("inf"), b"\x00\x01", 1 + 2j, None, (1, "a", (2.5,)),
]


def _strict_eq(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (``==`` takes 1 for True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_strict_eq(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, frozenset):
        return a == b and all(any(_strict_eq(x, y) for y in b) for x in a)
    if isinstance(a, slice):
        return all(_strict_eq(x, y) for x, y in
                   ((a.start, b.start), (a.stop, b.stop), (a.step, b.step)))
    if isinstance(a, float):
        return repr(a) == repr(b)
    return bool(a == b)


_SRC = '''
def outer():
    def inner():
        return "INNER"
    return inner(), "OUTER"
'''


def _code_returning(inner_value: Any, outer_value: Any,
                    filename: str = "<test>") -> types.CodeType:
    """``outer``'s code; ``outer()`` returns ``(inner_value, outer_value)``, the first from
    a nested code object."""
    module = compile(_SRC, filename, "exec")
    outer = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    inner = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    inner = inner.replace(co_consts=tuple(
        inner_value if c == "INNER" else c for c in inner.co_consts))
    return outer.replace(co_consts=tuple(
        inner if isinstance(c, types.CodeType) else outer_value if c == "OUTER" else c
        for c in outer.co_consts))


def _call(code: types.CodeType) -> Any:
    return types.FunctionType(code, {})()


# --------------------------------------------------------------------------- round trips

def test_round_trip_of_every_kind() -> None:
    code = _code_returning(tuple(SPECIAL), tuple(reversed(SPECIAL)))
    with pytest.raises(ValueError, match="unmarshallable"):
        marshal.dumps(code)
    data, specs = codeobj.dumps(code)
    assert json.loads(json.dumps(specs)) == specs          # stored as JSON
    back = codeobj.loads(data, json.loads(json.dumps(specs)))

    inner_back, outer_back = _call(back)
    assert _strict_eq(inner_back, tuple(SPECIAL))
    assert _strict_eq(outer_back, tuple(reversed(SPECIAL)))
    assert _strict_eq(_call(back), _call(code))
    # Singletons come back as themselves, not as equal copies.
    assert inner_back[2] is torch.float16 and inner_back[16] is Color.BLUE
    assert inner_back[19] is NotImplemented
    assert back.co_code == code.co_code and back.co_names == code.co_names


@pytest.mark.parametrize("value", SPECIAL, ids=lambda v: type(v).__name__)
def test_each_kind_alone(value: Any) -> None:
    code = _code_returning(value, None)
    data, specs = codeobj.dumps(code)
    assert _strict_eq(_call(codeobj.loads(data, specs))[0], value)


def test_marshallable_code_has_no_specs() -> None:
    code = _code_returning((1, "x", b"y", None, Ellipsis, 2.5), 3)
    data, specs = codeobj.dumps(code)
    assert specs == []
    assert marshal.loads(data) == code
    assert codeobj.describe_unmarshallable(code) == []


def test_spec_format() -> None:
    code = _code_returning((torch.float16, torch.device("cpu", 0), Color.RED,
                            torch.Size([2, 3]), slice(None, 4), NotImplemented), None)
    _, specs = codeobj.dumps(code)
    assert specs == [
        {"$": "torch", "v": "float16"},
        {"$": "device", "v": "cpu:0"},
        {"$": "enum", "module": __name__, "qualname": "Color", "name": "RED"},
        {"$": "size", "v": [2, 3]},
        {"$": "slice", "v": [None, 4, None]},
        {"$": "notimplemented"},
    ]


# --------------------------------------------------------------------------- refusals

class Opaque:
    def __repr__(self) -> str:
        return "Opaque(42)"


def _user_code_with(value: Any) -> types.CodeType:
    """``f`` from /src/model.py whose ``return None`` on line 3 loads ``value``."""
    src = "def f():\n    x = 1\n    return None\n"
    module = compile(src, "/src/model.py", "exec")
    f_code = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    return f_code.replace(co_consts=tuple(value if c is None else c for c in f_code.co_consts))


@pytest.mark.parametrize("wrap", [lambda o: o, lambda o: (1, (o,)), lambda o: frozenset({o})],
                         ids=["bare", "in-tuple", "in-frozenset"])
def test_unportable_constant_names_type_repr_and_line(wrap: Any) -> None:
    code = _user_code_with(wrap(Opaque()))
    with pytest.raises(UnsupportedProgramError) as info:
        codeobj.dumps(code)
    msg = str(info.value)
    assert "Opaque(42)" in msg
    assert f"type {__name__}.Opaque" in msg
    assert "/src/model.py:3" in msg


def test_unportable_constant_in_nested_code_names_its_line() -> None:
    code = _code_returning(Opaque(), None, filename="/src/nested.py")
    with pytest.raises(UnsupportedProgramError, match=r"Opaque\(42\).*/src/nested\.py:4"):
        codeobj.dumps(code)
    [msg] = codeobj.describe_unmarshallable(code)
    assert "/src/nested.py:4" in msg


def test_describe_lists_every_problem() -> None:
    code = _code_returning((Opaque(), torch.float16), Opaque(), filename="/src/two.py")
    problems = codeobj.describe_unmarshallable(code)
    assert len(problems) == 2
    assert any("/src/two.py:4" in p for p in problems)
    assert any("/src/two.py:5" in p for p in problems)


def test_enum_defined_in_a_function_is_refused() -> None:
    class Local(enum.Enum):
        A = 1

    with pytest.raises(UnsupportedProgramError, match=r"Local\.A.*<locals>|<locals>.*Local"):
        codeobj.dumps(_user_code_with(Local.A))


def test_constants_that_would_rebuild_differently_are_refused() -> None:
    # values' portable form of these is lossy (a Flag combination has no member name; a
    # StrEnum inside a slice comes back as a plain str): refused when the entry is
    # written, with the user's line, not replayed wrongly later.
    lossy: list[Any] = [Perm.R | Perm.W]
    if sys.version_info >= (3, 11):
        lossy.append(slice(Letter.A))
    for value in lossy:
        with pytest.raises(UnsupportedProgramError, match="/src/model.py:3"):
            codeobj.dumps(_user_code_with(value))
    if sys.version_info >= (3, 11):  # on its own a StrEnum member is an enum spec
        data, specs = codeobj.dumps(_user_code_with(Letter.A))
        assert types.FunctionType(codeobj.loads(data, specs), {})() is Letter.A


def test_user_string_that_looks_like_a_placeholder_is_refused() -> None:
    with pytest.raises(UnsupportedProgramError, match="placeholder"):
        codeobj.dumps(_user_code_with("\x00cachecompile-const\x000"))


# --------------------------------------------------------------------------- bad entries

def _with_placeholders(*tails: str) -> bytes:
    """Marshalled code whose constants are placeholders with the given index texts."""
    return marshal.dumps(_code_returning(
        tuple(f"\x00cachecompile-const\x00{t}" for t in tails), None))


F16 = {"$": "torch", "v": "float16"}


@pytest.mark.parametrize("specs", [
    [],                                                      # placeholder out of range
    [F16, F16],                                              # a spec nothing uses
    [{"$": "eval", "v": "1"}],                               # unknown kind
    [{"$": "pickle", "v": "gASV"}],                          # unknown kind
    [{"v": "float16"}],                                      # no kind
    ["float16"],                                             # not an object
    [None],
    [{"$": "torch", "v": "float16", "x": 1}],                # extra key
    [{"$": "torch"}],                                        # missing key
    [{"$": "torch", "v": "nn"}],                             # not a dtype/layout/format
    [{"$": "torch", "v": "__import__"}],
    [{"$": "device", "v": "no-such-device:0"}],
    [{"$": "device", "v": "nosuchdev:0"}],                   # torch raises RuntimeError
    [{"$": "size", "v": "12"}],                              # values alone: Size([1, 2])
    [{"$": "size", "v": [2, True]}],
    [{"$": "slice", "v": [1, 2]}],
    [{"$": "slice", "v": [1, 2, {"$": "eval", "v": "x"}]}],  # bad nested spec
    [{"$": "tuple", "v": [[1, 2]]}],                         # bare list nested
    [{"$": "tuple", "v": [{"$": "notimplemented"}]}],        # codeobj's kinds: top only
    [{"$": "bytes", "v": "xyz"}],
    [{"$": "enum", "module": "os", "qualname": "path", "name": "sep"}],  # not an enum
    [{"$": "enum", "module": __name__, "qualname": "f.<locals>.E", "name": "A"}],
    [{"$": "enum", "module": __name__, "qualname": "Color", "name": "GREEN"}],
    [{"$": "enum", "module": "no_such_module_xyz", "qualname": "E", "name": "A"}],
    [{"$": "enum", "module": "os; import x", "qualname": "E", "name": "A"}],
    [{"$": "finfo", "v": "int8"}],                           # finfo of an integer dtype
    [{"$": "iinfo", "v": "float32"}],
    [{"$": "sdpbackend", "v": "__class__"}],
    [{"$": "range", "v": [0, 1, 0]}],                        # range() step 0
    [{"$": "classmethod", "module": __name__, "qualname": "Maker", "name": "plain"}],
    [{"$": "classmethod", "module": "os", "qualname": "path", "name": "join"}],
    [{"$": "classmethod", "module": __name__, "qualname": "Maker", "name": "__class__"}],
    [{"$": "classmethod", "module": __name__, "qualname": "Maker", "name": "a.b"}],
    [{"$": "classmethod", "module": __name__, "qualname": "Maker", "name": "make", "v": 1}],
], ids=repr)
def test_bad_specs_are_refused(specs: list[Any]) -> None:
    data = _with_placeholders("0")
    assert _call(codeobj.loads(data, [F16]))[0] == (torch.float16,)   # the good case loads
    with pytest.raises(UnsupportedProgramError):
        codeobj.loads(data, specs)


@pytest.mark.parametrize("tail", ["1", "-1", "01", "+0", " 0", "0 ", "x", "", "\u0663",
                                  "99999999999999999999"])
def test_tampered_placeholders_are_refused(tail: str) -> None:
    with pytest.raises(UnsupportedProgramError, match="placeholder"):
        codeobj.loads(_with_placeholders(tail), [F16])


def test_placeholder_used_twice_is_refused() -> None:
    with pytest.raises(UnsupportedProgramError, match="twice"):
        codeobj.loads(_with_placeholders("0", "0"), [F16])


def test_bad_bytes_are_refused() -> None:
    data, specs = codeobj.dumps(_code_returning(torch.float16, None))
    with pytest.raises(UnsupportedProgramError):
        codeobj.loads(data[:20], specs)
    with pytest.raises(UnsupportedProgramError, match="not a code object"):
        codeobj.loads(marshal.dumps((1, 2)), [])


def test_values_are_closed_kinds_only() -> None:
    with pytest.raises(ValueError, match="unknown value kind"):
        values.decode_value({"$": "pickle", "v": "..."})


def test_codeobj_imports_no_compiler() -> None:
    # The warm path imports codeobj; load the module file alone (not the package
    # __init__) and check that it pulls in neither Dynamo nor Inductor.
    import subprocess
    code = (
        "import importlib.util, sys, types\n"
        "pkg = types.ModuleType('cachecompile'); pkg.__path__ = ['cachecompile']\n"
        "sys.modules['cachecompile'] = pkg\n"
        "spec = importlib.util.spec_from_file_location('cachecompile.entry.codeobj',"
        " 'cachecompile/entry/codeobj.py')\n"
        "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m\n"
        "spec.loader.exec_module(m)\n"
        "print([n for n in ('torch._dynamo', 'torch._inductor') if n in sys.modules])\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]", out


# --------------------------------------------------------------------------- real Dynamo

@dataclasses.dataclass
class Output:
    """A ModelOutput-like result, built by Dynamo's bytecode after the graph."""
    hidden: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class _Model(torch.nn.Module):
    def forward_like(self, x: torch.Tensor) -> tuple[Output, torch.layout]:
        z = torch.zeros(2, device=torch.device("cpu"), dtype=torch.float16)
        return Output(x + z.float().sum(), x.shape, x.dtype, x.device), x.layout


def test_dynamo_bytecode_with_device_dtype_and_size_constants() -> None:
    # Constants that are unhashable (slice on 3.11, torch.finfo) are left out on purpose:
    # torch 2.13 can std::terminate the process on them in Dynamo's own code path.
    m = _Model()
    fn = torch.compile(m.forward_like, backend="eager", fullgraph=True)
    x = torch.ones(2, 3)
    expected, layout = fn(x)

    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(
        _Model.forward_like.__code__)
    code = entries[0].code
    kinds = {type(c) for c in code.co_consts}
    assert {torch.Size, torch.device, torch.dtype} <= kinds, code.co_consts
    with pytest.raises(ValueError, match="unmarshallable"):
        marshal.dumps(code)

    data, specs = codeobj.dumps(code)
    assert {s["$"] for s in specs} >= {"size", "device", "torch"}
    back = codeobj.loads(data, json.loads(json.dumps(specs)))
    assert back.co_code == code.co_code
    assert _strict_eq(back.co_consts, code.co_consts)

    # The rebuilt code runs without Dynamo: Dynamo installed the compiled graph and its
    # helpers in the method's module globals.
    rebuilt = types.FunctionType(back, _Model.forward_like.__globals__, "forward_like")
    out, out_layout = rebuilt(m, x)
    assert isinstance(out, Output) and out_layout is layout is torch.strided
    torch.testing.assert_close(out.hidden, expected.hidden)
    assert out.shape == expected.shape == torch.Size([2, 3])
    assert out.dtype is torch.float32 and out.device == torch.device("cpu")


# ------------------------------------------------- Dynamo's globals and guard helpers (61)

def test_a_namedtuple_scope_has_a_portable_form() -> None:
    """Dynamo installs the globals of a namedtuple's generated ``__new__`` when it inlines
    it (``___unnamed_scope_<id>``): a warm process makes an equal dict by the type's name."""
    from cachecompile.warm.replay import namedtuple_scope, resolve_module

    scope = Point.__new__.__globals__
    name = namedtuple_scope(scope)
    assert name is not None and resolve_module(name) == scope
    assert resolve_module(name) is not scope  # made anew: nothing of this process's
    for other in ({}, {"_tuple_new": tuple.__new__, "__builtins__": {}, "__name__": "x"},
                  {**scope, "extra": 1}, {**scope, "_tuple_new": list.__new__},
                  {**scope, "__name__": "namedtuple_a.b"}, vars(collections)):
        assert namedtuple_scope(other) is None, other
    with pytest.raises(UnsupportedProgramError):
        resolve_module("namedtuple-scope:a.b")


def test_the_from_numpy_guard_helper_is_dynamos() -> None:
    """``___from_numpy``: a guard on a numpy value Dynamo traced as a tensor (Reformer's
    ``np.lcm(...) % k`` on Python's stack at a break) checks it as torch does."""
    import numpy as np
    from torch._dynamo.guards import from_numpy as dynamos

    from cachecompile._torch import runtime

    for v in (np.bool_(True), np.int64(7), np.arange(3.0), 3, 2.5, "x", None):
        ours, theirs = runtime.from_numpy(v), dynamos(v)
        assert type(ours) is type(theirs), v
        if isinstance(ours, torch.Tensor):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
        else:
            assert ours is v
