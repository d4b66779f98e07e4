"""A training program's layout as stored: read back as written, and every malformed
record refused by name (a miss), never half-read. The malformed records are generated:
each field of a valid record, replaced by each wrong value of a small set."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from cachecompile.entry import joint
from cachecompile.entry.joint import Layout
from cachecompile.errors import UnsupportedProgramError

VALID: dict[str, Any] = {
    "n_inputs": 5, "n_outputs": 2, "n_symints": 1, "n_unchecked": 0,
    "outputs_require_grad": [True, False], "tangents": [0],
    "tangent_layouts": [{"size": [2, 3], "stride": [3, 1]}],
    "disable_amp": False, "deterministic": None, "donated": True,
}

WRONG: list[Any] = [None, -1, True, "1", 1.5, [], {}, [True, True, True], [3], [[1]]]


def test_a_layout_reads_back_as_written() -> None:
    layout = Layout.from_json(VALID)
    assert layout.to_json() == VALID
    assert joint.layout_of({joint.KEY: VALID}) == layout
    assert joint.layout_of({}) is None
    fmt = {**VALID, "tangent_layouts": [{"memory_format": "channels_last"}]}
    assert Layout.from_json(fmt).tangent_layouts == ({"memory_format": "channels_last"},)


def _malformed() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for field, wrong in itertools.product(VALID, WRONG):
        flags = ("disable_amp", "donated", "deterministic")
        if wrong is VALID[field] or (field in flags and isinstance(wrong, bool)) or \
                (field == "deterministic" and wrong is None):
            continue  # a valid value for the field
        out.append((f"{field}={wrong!r}", {**VALID, field: wrong}))
    for field in VALID:
        out.append((f"no {field}", {k: v for k, v in VALID.items() if k != field}))
    out += [
        ("a tangent past the outputs", {**VALID, "tangents": [2],
                                        "tangent_layouts": VALID["tangent_layouts"]}),
        ("tangents out of order", {**VALID, "tangents": [1, 0],
                                   "tangent_layouts": VALID["tangent_layouts"] * 2}),
        ("a memory format torch has no", {**VALID, "tangent_layouts": [
            {"memory_format": "preserve_format"}]}),
        ("size and stride of two ranks", {**VALID, "tangent_layouts": [
            {"size": [2, 3], "stride": [1]}]}),
        ("a format with a size", {**VALID, "tangent_layouts": [
            {"memory_format": "contiguous_format", "size": [2]}]}),
    ]
    return out


@pytest.mark.parametrize(("what", "record"), _malformed(), ids=[w for w, _ in _malformed()])
def test_a_malformed_layout_is_refused_by_name(what: str, record: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedProgramError, match="training layout is malformed"):
        Layout.from_json(record)
