"""The method's identity factors (``key.factors.function_factors``) are read once per code
object (issue 53: inspect.getsource cost every signature's lookup ~0.25 ms), and read again
whenever what they are read from changes in the process: its code, what it wraps, its
name. The memo holds no function alive."""

from __future__ import annotations

import functools
import gc
import inspect
import weakref
from typing import Any

import pytest

from cachecompile.key import factors


def _make() -> Any:
    def f(x: int) -> int:
        return x + 1
    return f


def test_read_once_per_code(monkeypatch: pytest.MonkeyPatch) -> None:
    f = _make()
    reads: list[object] = []
    real = inspect.getsource

    def counted(obj: Any) -> str:
        reads.append(obj)
        return real(obj)

    monkeypatch.setattr(inspect, "getsource", counted)
    first = factors.function_factors(f)
    assert factors.function_factors(f) == first and len(reads) == 1
    first["bytecode"] = "changed by a caller"          # a copy: the memo is not touched
    assert factors.function_factors(f)["bytecode"] != "changed by a caller"


def test_a_change_in_the_process_is_read_again() -> None:
    f = _make()
    before = factors.function_factors(f)

    def g(x: int) -> int:
        return x * 2

    f.__code__ = g.__code__
    changed = factors.function_factors(f)
    assert changed["bytecode"] != before["bytecode"]
    f.__qualname__ = "renamed"
    assert factors.function_factors(f)["qualname"] == "renamed"

    def plain(x: int) -> int:
        return f(x)

    wrapper: Any = functools.wraps(f)(plain)

    inner = factors.function_factors(wrapper)["wrapped"]
    wrapper.__wrapped__ = _make()
    assert factors.function_factors(wrapper)["wrapped"] != inner


def test_the_memo_keeps_no_function_alive() -> None:
    f = _make()
    factors.function_factors(f)
    gone = weakref.ref(f)
    del f
    gc.collect()
    assert gone() is None
