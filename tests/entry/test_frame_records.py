"""A graph break's frames as an entry stores them (entry.frame_records) and the bytecode pieces
they need: records read back strictly, a callee's code found again by name (nested
functions too), generated globals bound as constants (every Python the CI runs), a
module's globals as a bytecode constant (entry.codeobj)."""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import pytest
import torch

from cachecompile._torch import frame_hook
from cachecompile.entry import codeobj, frame_records
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key.identity import code_digest


# -- records --------------------------------------------------------------------------------
def _record(**kw: Any) -> frame_records.FrameRecord:
    var = frame_records.FrameVariant(bytecode="frames/0/0/bytecode.bin", consts=(), imports={},
                          graphs={"__compiled_fn_1": 0}, resumes={}, guards=(), checker={})
    base: dict[str, Any] = dict(id="a" * 32, kind=frame_records.RESUME, module="m", name="f (m.py:1)",
                                code="frames/0/code.bin", variants=(var,))
    base.update(kw)
    return frame_records.FrameRecord(**base)


def test_records_round_trip_and_are_read_strictly() -> None:
    r = _record()
    assert frame_records.read_frames([r.to_json()]) == (r,)
    bad: list[tuple[dict[str, Any], str]] = [
        ({**r.to_json(), "kind": "other"}, "kind"),
        ({**r.to_json(), "code": ""}, "no code"),
        ({**r.to_json(), "variants": [{"bytecode": 1}]}, "graphs|fields"),
        ({**r.to_json(), "variants": [{**r.variants[0].to_json(), "graphs": {"g": -1}}]},
         "indexes"),
        ({**r.to_json(), "variants": [{**r.variants[0].to_json(), "resumes": {"n": "zz"}}]},
         "lacks"),
    ]
    for raw, needle in bad:
        with pytest.raises(UnsupportedProgramError, match=needle):
            frame_records.read_frames([raw])
    with pytest.raises(UnsupportedProgramError, match="one id"):
        frame_records.read_frames([r.to_json(), r.to_json()])


def test_graph_files_are_the_adapters_own_names(tmp_path: Any) -> None:
    files = {"program.py": tmp_path / "a", "graphs/0/program.py": tmp_path / "b",
             "graphs/1/kernels/x.so": tmp_path / "c", "graphs/10/program.py": tmp_path / "d"}
    assert frame_records.graph_files(files, 1) == {"kernels/x.so": tmp_path / "c"}
    assert frame_records.graph_files(files, 0) == {"program.py": tmp_path / "b"}


# -- a callee, found again --------------------------------------------------------------------
def _decorate(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        return fn(*a, **k)
    return wrapper


class Owner:
    @_decorate
    def method(self, x: int) -> int:
        return x + 1

    @staticmethod
    def static(x: int) -> int:
        return x - 1

    def outer(self) -> Any:
        def inner(y: int) -> int:
            return y * 2
        return inner


def test_a_callee_is_found_by_name_through_decorators_and_nesting() -> None:
    mod = __name__
    # The functions alive while their frames are recorded, as a callee that just ran is
    # (Python 3.10 finds a code object's qualified name through them).
    functions = (Owner.method.__wrapped__, Owner.static, Owner().outer())
    for code in (f.__code__ for f in functions):
        where = frame_records.callee_where(code, code_digest(code))
        assert frame_records.find_callee(mod, where, code_digest) is code, where
    changed = frame_records.callee_where(Owner.static.__code__, "0" * 32)
    assert frame_records.find_callee(mod, changed, code_digest) is None        # another code there
    lam = (lambda v: v).__code__
    assert frame_records.find_callee(mod, frame_records.callee_where(lam, code_digest(lam)), code_digest) is None
    assert frame_records.find_callee("no_such_module_xyz", {"qualname": "f"}, code_digest) is None


# -- generated globals bound as constants -----------------------------------------------------
def _uses_globals(x: int, n: int) -> tuple[int, int, int]:
    r = GENERATED(x) + GENERATED(x)  # type: ignore[name-defined]  # noqa: F821 (bound by the test)
    listed = [GENERATED(i) for i in range(n)]  # type: ignore[name-defined]  # noqa: F821
    try:
        r += MISSING  # type: ignore[name-defined]  # never bound: the module's own NameError
    except NameError:
        r = -r
    return r, len(listed), max(x, 0)


def test_bind_globals_keeps_offsets_and_calls_the_bound_object() -> None:
    calls: list[int] = []

    def generated(v: int) -> int:
        calls.append(v)
        return v * 2

    code = codeobj.bind_names(_uses_globals.__code__, {"GENERATED": generated})
    assert len(code.co_code) == len(_uses_globals.__code__.co_code)
    fn = types.FunctionType(code, {"__builtins__": __builtins__})   # no GENERATED there
    assert fn(3, 2) == (-12, 2, 3)
    assert calls == [3, 3, 0, 1]


def test_bind_globals_past_255_constants() -> None:
    src = "def many(x):\n" + "".join(f"    x = x + {i}.5\n" for i in range(300)) + \
          "    return GENERATED(x)\n"
    scope: dict[str, Any] = {}
    exec(src, scope)
    code = scope["many"].__code__
    if sys.version_info < (3, 11):
        # 3.10: LOAD_GLOBAL has no inline caches to make room for EXTENDED_ARG.
        with pytest.raises(UnsupportedProgramError, match="no room"):
            codeobj.bind_names(code, {"GENERATED": abs})
        return
    bound = codeobj.bind_names(code, {"GENERATED": lambda v: -v})
    assert types.FunctionType(bound, {"__builtins__": __builtins__})(0.0) == -45000.0


# -- the frame hook (no Dynamo) ---------------------------------------------------------------
def test_the_frame_hook_runs_stored_code_only_inside_a_cachecompile_call() -> None:
    assert frame_hook.available()

    def target(x: int, k: int = 2) -> int:
        return x + k

    def stored(x: int, k: int = 2) -> int:
        return x * 100 + k

    code = target.__code__.replace()   # private: other tests never see the entry
    fn = types.FunctionType(code, globals(), "target", (2,))
    seen: list[dict[str, Any]] = []
    frame_hook.install(code, lambda d: seen.append(dict(d)) or d["x"] > 0,  # type: ignore[func-returns-value]
                 stored.__code__, "t")
    assert fn(1) == 3                   # outside a cachecompile call: as written
    with frame_hook.run_only():
        assert (fn(1), fn(-1), fn(1, k=5)) == (102, 1, 105)
    assert seen == [{"x": 1, "k": 2}, {"x": -1, "k": 2}, {"x": 1, "k": 5}]
    assert fn(1) == 3


# -- a module's globals as a bytecode constant ------------------------------------------------
def test_a_modules_globals_dict_is_a_constant_by_the_modules_name() -> None:
    inner = compile("def f():\n    return 1\n", "<t>", "exec").co_consts[0]
    code = (lambda: 0).__code__.replace(co_consts=(None, vars(torch), inner))
    data, consts = codeobj.dumps(code)
    assert consts == [{"$": "globals", "v": "torch"}]
    assert codeobj.loads(data, consts).co_consts[1] is vars(torch)
    other = dict(vars(torch))   # equal, but not the module's own dict: no portable form
    with pytest.raises(UnsupportedProgramError, match="no portable form"):
        codeobj.dumps(code.replace(co_consts=(None, other, inner)))
