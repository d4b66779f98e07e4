"""tests/breadth.py: which cases the README command leaves to CI's breadth step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import breadth
import pytest


@dataclass
class _CallSpec:
    params: dict[str, Any]


@dataclass
class _Item:
    nodeid: str
    callspec: _CallSpec | None = None
    marks: list[str] = field(default_factory=list)

    def add_marker(self, name: str) -> None:
        self.marks.append(name)


def _param(func: str, **params: Any) -> _Item:
    return _Item(f"{func}[{'-'.join(map(str, params.values()))}]", _CallSpec(params))


def _marked(items: list[_Item], args: tuple[str, ...] = ("tests",)) -> list[str]:
    breadth.mark(cast(list[pytest.Item], items), args)
    return [i.nodeid for i in items if breadth.MARK in i.marks]


def test_the_aot_eager_twin_of_a_backend_pair_is_breadth_and_a_lone_backend_is_not() -> None:
    f = "tests/e2e/test_x.py::test_f"
    items = [_param(f, backend="inductor", case="a"), _param(f, backend="aot_eager", case="a"),
             # aot_eager alone for case b (its inductor twin is another test's case)
             _param(f, backend="aot_eager", case="b"),
             _param("tests/e2e/test_x.py::test_g", backend="aot_eager"),
             _Item("tests/e2e/test_x.py::test_h")]
    assert _marked(items) == [f"{f}[aot_eager-a]"]


def test_a_named_case_is_breadth_and_its_siblings_are_not() -> None:
    case = next(c for c in breadth.CASES if c.endswith("]"))
    func = case.split("[", 1)[0]
    same_file = [c for c in breadth.CASES if c.split("::", 1)[0] == case.split("::", 1)[0]]
    items = [_Item(f"{func}[some-other-case]"), *map(_Item, same_file)]
    assert _marked(items) == same_file


def test_a_named_case_missing_from_its_collected_file_fails_the_collection() -> None:
    case = next(iter(breadth.CASES))
    items = [_Item(case.split("::", 1)[0] + "::test_renamed")]
    with pytest.raises(pytest.UsageError, match="not collected"):
        _marked(items)
    # A run that names its tests (one node id) collects less than the file: no verdict.
    assert _marked(items, (items[0].nodeid,)) == []
