"""The lookup table (cachecompile/cold/lookups.py), row by row, in process: which
namespaces each kind of lookup consults and finds without the name, by Python's rules.
No Dynamo here: the records are what :func:`cachecompile._torch.dynamo.recorded_lookups`
hands over; tests/e2e/test_absent_state.py and test_guard_sweep.py run them end to end."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from cachecompile._torch.dynamo import Resolved
from cachecompile.cold import guard_capture, lookups
from cachecompile.entry.checker import build_checker
from cachecompile.errors import UnsupportedProgramError


def guards(*resolved: Resolved) -> list[tuple[str, str, Any]]:
    return [(kind, expr, value) for kind, expr, value, _ in lookups.guards(list(resolved))]


def no_class_attr(expr: str, name: str) -> tuple[str, str, Any]:
    return ("contains", f"{expr}.__dict__", {"key": name, "present": False})


class Base:
    K = 2.0


class Mid(Base):
    pass


class Leaf(Mid):
    def __init__(self) -> None:
        self.v = 1.0


def test_instance_attribute_found_on_a_base_class() -> None:
    obj = Leaf()
    got = guards(Resolved("attr", "K", obj, "L['o']"))
    # Leaf and Mid lack K (a K there would be found first), and so does the instance.
    assert got == [no_class_attr("type(L['o']).__mro__[0]", "K"),
                   no_class_attr("type(L['o']).__mro__[1]", "K"),
                   ("not_in_dict", "L['o']", "K")]


def test_instance_attribute_found_in_the_instance_dict() -> None:
    got = guards(Resolved("attr", "v", Leaf(), "L['o']"))
    # The whole MRO was consulted for a data descriptor first (object is builtin: skipped).
    assert got == [no_class_attr(f"type(L['o']).__mro__[{i}]", "v") for i in range(3)]


class WithProperty:
    @property
    def p(self) -> float:
        return 1.0


class Slotted:
    __slots__ = ("k",)

    def __init__(self) -> None:
        self.k = 1.0


def test_a_data_descriptor_stops_the_lookup_before_the_instance_dict() -> None:
    assert guards(Resolved("attr", "p", WithProperty(), "L['o']")) == []
    assert guards(Resolved("attr", "k", Slotted(), "L['o']")) == []


class Fallback(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def __getattr__(self, name: str) -> Any:
        if name == "K":
            return 2.0
        return super().__getattr__(name)


def test_a_name_served_by_getattr() -> None:
    m = Fallback()
    got = guards(Resolved("attr", "K", m, "L['self']"))
    assert got == [no_class_attr("type(L['self']).__mro__[0]", "K"),
                   ("not_in_dict", "L['self']", "K")]   # Fallback defines __getattr__ itself
    # A submodule: nn.Module's __setattr__ keeps it out of the instance dict.
    assert guards(Resolved("attr", "lin", m, "L['self']")) == [
        no_class_attr("type(L['self']).__mro__[0]", "lin")]


def test_a_class_gaining_getattr_is_guarded_where_none_was_found() -> None:
    got = guards(Resolved("default", "missing", Leaf(), "L['o']"))
    assert ("not_in_dict", "L['o']", "missing") in got
    assert no_class_attr("type(L['o']).__mro__[0]", "__getattr__") in got


class Meta(type):
    K = 2.0


class Classy(metaclass=Meta):
    pass


class ClassyChild(Classy):
    pass


def test_class_attribute_found_on_the_metaclass() -> None:
    got = guards(Resolved("attr", "K", ClassyChild, "type(L['o'])"))
    assert got == [no_class_attr("type(L['o']).__mro__[0]", "K"),
                   no_class_attr("type(L['o']).__mro__[1]", "K")]
    # Dynamo read it without a guard: its value is guarded too.
    got = guards(Resolved("attr", "K", ClassyChild, "type(L['o'])", unguarded=True))
    assert ("eq", "type(L['o']).K", 2.0) in got


def test_class_attribute_found_on_a_base() -> None:
    got = guards(Resolved("attr", "K", Leaf, "type(L['o'])"))
    assert got == [no_class_attr("type(L['o']).__mro__[0]", "K"),
                   no_class_attr("type(L['o']).__mro__[1]", "K")]


def test_module_attribute_and_its_getattr() -> None:
    mod = types.ModuleType("cc_test_helper_mod")
    got = guards(Resolved("default", "NAME", mod, "G['helper']"))
    assert got == [("not_in_dict", "G['helper']", "NAME"),
                   ("not_in_dict", "G['helper']", "__getattr__")]
    mod.__getattr__ = lambda name: 1.0   # type: ignore[method-assign]
    assert guards(Resolved("attr", "NAME", mod, "G['helper']")) == [
        ("not_in_dict", "G['helper']", "NAME")]
    mod.NAME = 3.0   # type: ignore[attr-defined]
    assert guards(Resolved("attr", "NAME", mod, "G['helper']")) == []


def test_a_global_read_from_the_builtins() -> None:
    here = vars(sys.modules[__name__])
    assert guards(Resolved("global", "abs", here, None, root=True)) == [
        ("expr", "not ___module_has(G['__name__'], 'abs')", None)]
    assert guards(Resolved("global", "abs", here, None, root=False)) == [
        ("expr", f"not ___module_has({__name__!r}, 'abs')", None)]
    # torch's own modules (pinned by the version factors) are not guarded.
    assert guards(Resolved("global", "len", vars(torch.nn.modules.module), None)) == []
    with pytest.raises(UnsupportedProgramError, match="no imported module's"):
        guards(Resolved("global", "abs", {"__name__": "nowhere"}, None))


def test_what_is_not_guarded() -> None:
    # torch's classes, tensors, objects made during the trace, a custom __getattribute__.
    assert guards(Resolved("attr", "weight", nn.Linear(2, 2), "L['lin']")) == []
    assert guards(Resolved("attr", "view", torch.ones(1), "L['x']")) == []
    assert guards(Resolved("attr", "K", Leaf(), None)) == []

    class Custom:
        def __getattribute__(self, name: str) -> Any:
            return 1.0

    assert guards(Resolved("attr", "K", Custom(), "L['o']")) == []


def test_one_guard_per_namespace_and_name() -> None:
    a, b = Leaf(), Leaf()
    got = guards(Resolved("attr", "K", a, "L['a']"), Resolved("attr", "K", b, "L['b']"))
    # Both classes once (by the first path that reached them); each instance its own.
    assert [g for g in got if g[0] == "contains"] == [
        no_class_attr("type(L['a']).__mro__[0]", "K"),
        no_class_attr("type(L['a']).__mro__[1]", "K")]
    assert [g for g in got if g[0] == "not_in_dict"] == [("not_in_dict", "L['a']", "K"),
                                                          ("not_in_dict", "L['b']", "K")]


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = Leaf()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.leaf.K


def test_the_guards_hold_then_fail_when_the_name_is_added() -> None:
    m = Holder()
    out, _ = guard_capture.translate(
        [], arg_names={"x"}, tensor_dims={}, module_name=__name__, state={},
        resolved=[Resolved("attr", "K", m.leaf, "L['self'].leaf")])
    # From the lookups alone (no guard of Dynamo's was given): no text is parsed.
    assert {g["kind"] for g in out} == {"contains", "not_in_dict"}
    check = build_checker(Holder.run, out,  # type: ignore[arg-type]
                          vars(sys.modules[__name__])).full
    x = torch.ones(1)
    assert check(m, x)
    Mid.K = 5.0
    try:
        assert not check(m, x)
    finally:
        del Mid.K
    assert check(m, x)
    m.leaf.K = 5.0
    assert not check(m, x)


def test_a_super_attribute_looks_after_the_class_named() -> None:
    class A:
        S = 2.0

    class B(A):
        pass

    class C(B):
        pass

    class D(C):
        pass

    obj = D()
    # super() in C's method: B is consulted (and lacks S) before A; D and C are not.
    got = guards(Resolved("attr", "S", obj, "L['self']", after=C))
    assert got == [no_class_attr("type(L['self']).__mro__[2]", "S")]
