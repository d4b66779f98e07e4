"""The guard kinds table (entry/guard_kinds.py) is where a guard kind lives: the Dynamo
guard types it carries, how the compiling process captures one, how a warm process checks
it in Python and as a C++ leaf. One row per kind, so a new Dynamo guard type is one row;
capture (cold/guard_capture.py) only dispatches to the row. A torch release that adds a
guard type is not cacheable (named) until a row lists it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cachecompile._torch.dynamo import GuardEntry
from cachecompile.cold import guard_capture
from cachecompile.entry.guard_kinds import BY_DYNAMO, TABLE
from cachecompile.errors import UnsupportedProgramError

# Relations cachecompile derives itself (over the tensors capture collected), not from a
# Dynamo guard entry of that type.
_DERIVED = {"NO_TENSOR_ALIASING", "STORAGE_OVERLAPPING"}


def test_every_listed_dynamo_type_has_one_kind_that_captures_it() -> None:
    listed = [t for kind in TABLE.values() for t in kind.dynamo]
    assert len(listed) == len(set(listed)), "a Dynamo guard type on two kinds"
    for t in set(listed) - _DERIVED:
        assert BY_DYNAMO[t].capture is not None, t
    for kind in TABLE.values():
        if set(kind.dynamo) <= _DERIVED:
            assert kind.capture is None, kind.name
    dropped = guard_capture._IN_GLOBAL_STATE | guard_capture._AUTOGRAD_ONLY
    assert not set(listed) & dropped


def _entry(guard_type: str, expr: str, value: Any, **keywords: Any) -> GuardEntry:
    guard = SimpleNamespace(create_fn=SimpleNamespace(keywords=keywords, args=()))
    return GuardEntry(guard_type=guard_type, expr=expr, value=value, has_value=True,
                      derived_types=frozenset(), code_parts=(), _guard=guard)


def _capture(*entries: GuardEntry) -> list[dict[str, Any]]:
    b = guard_capture._Builder(set(), {}, "mod", {"global_state": "", "modes": [],
                                                  "default_device": None})
    for e in entries:
        b.entry(e)
    return b.out


def test_capture_goes_through_the_row_of_the_guard_type() -> None:
    out = _capture(_entry("EQUALS_MATCH", "L['self'].n", 3),
                   _entry("HASATTR", "L['self'].cfg", object(), attr="act"),
                   _entry("DICT_NOT_CONTAINS", "L['self'].d", {}, key="k"),
                   _entry("NONE_MATCH", "G['X']", None),
                   _entry("SEQUENCE_LENGTH", "L['self'].xs", [1, 2]))
    assert [(g["kind"], g["text"]) for g in out] == [
        ("eq", "self.n == 3"), ("hasattr", "self.cfg has no attribute 'act'"),
        ("contains", "'k' not in self.d"), ("ident", "mod.X is None"),
        ("len", "len(self.xs) == 2")]


def test_an_unknown_guard_type_is_not_cacheable_and_named() -> None:
    with pytest.raises(UnsupportedProgramError, match="WEAKREF_ALIVE.*no portable form"):
        _capture(_entry("WEAKREF_ALIVE", "L['self'].ref", None))
