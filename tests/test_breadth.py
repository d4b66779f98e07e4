"""tests/breadth.py: which cases the README command leaves to CI's breadth step."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import breadth
import pytest

BACKENDS = pytest.mark.parametrize("backend", ["inductor", "aot_eager"]).mark
MULTI = pytest.mark.parametrize("backend,seed", [("inductor", 1),
                                                 pytest.param("aot_eager", 2)]).mark
LONE = pytest.mark.parametrize("backend", [pytest.param("aot_eager")]).mark


@dataclass
class _Item:
    nodeid: str
    params: dict[str, Any] | None = None
    markers: list[pytest.Mark] = field(default_factory=list)
    marks: list[str] = field(default_factory=list)

    @property
    def callspec(self) -> Any:
        return None if self.params is None else SimpleNamespace(params=self.params)

    def iter_markers(self, name: str) -> list[pytest.Mark]:
        return [m for m in self.markers if m.name == name]

    def add_marker(self, name: str) -> None:
        self.marks.append(name)


def _marked(items: list[_Item], check: bool = True) -> list[str]:
    n = breadth.mark(cast(list[pytest.Item], items), check)
    got = [i.nodeid for i in items if breadth.MARK in i.marks]
    assert n == len(got)
    return got


def test_the_aot_eager_case_of_a_test_over_both_backends_is_breadth_whatever_is_collected(
        ) -> None:
    f = "tests/e2e/test_x.py::test_f"
    items = [_Item(f"{f}[inductor]", {"backend": "inductor"}, [BACKENDS]),
             _Item(f"{f}[aot_eager]", {"backend": "aot_eager"}, [BACKENDS]),
             _Item(f"{f}2[aot_eager-2]", {"backend": "aot_eager", "seed": 2}, [MULTI]),
             # a test parametrized over aot_eager alone keeps it
             _Item(f"{f}3[aot_eager]", {"backend": "aot_eager"}, [LONE]),
             _Item("tests/e2e/test_x.py::test_h")]
    assert _marked(items) == [f"{f}[aot_eager]", f"{f}2[aot_eager-2]"]
    # Selected alone (by its node id), the twin is still breadth.
    assert _marked([_Item(f"{f}[aot_eager]", {"backend": "aot_eager"}, [BACKENDS])]) \
        == [f"{f}[aot_eager]"]


def test_a_named_case_is_breadth_and_its_siblings_are_not() -> None:
    case = next(c for c in breadth.CASES if c.endswith("]"))
    func = case.split("[", 1)[0]
    same_file = [c for c in breadth.CASES if c.split("::", 1)[0] == case.split("::", 1)[0]]
    items = [_Item(f"{func}[some-other-case]"), *map(_Item, same_file)]
    assert _marked(items) == same_file


def test_a_named_case_missing_from_its_collected_file_fails_a_whole_collection() -> None:
    case = next(iter(breadth.CASES))
    items = [_Item(case.split("::", 1)[0] + "::test_renamed")]
    with pytest.raises(pytest.UsageError, match="update CASES in tests/breadth.py"):
        _marked(items)
    # A run that collects less than the file (a node id, --lf): no verdict.
    assert _marked(items, check=False) == []


@pytest.mark.parametrize("args, lf, whole", [(["tests"], False, True), ([], False, True),
                                             (["tests/x.py::test_a"], False, False),
                                             (["tests"], True, False)])
def test_only_a_whole_collection_is_checked(args: list[str], lf: bool, whole: bool) -> None:
    config = SimpleNamespace(args=args, getoption=lambda name, default=None: lf)
    assert breadth.whole(cast(pytest.Config, config)) is whole
