"""The guard checker says what it said: ``explain``, ``failure``, the verdicts and the
stored lines over the guard matrix's cases and generated ones, against the golden
recorded before the checker became a class (issue 52; tests/checker_golden.py records
it and says how)."""

from __future__ import annotations

import json
import sys

import checker_golden
import pytest

from cachecompile.entry import values


def _golden() -> dict:
    if not checker_golden.GOLDEN.exists():
        pytest.skip(f"no golden for Python {sys.version_info[0]}.{sys.version_info[1]} "
                    "(guards hold code digests of one release): record one with "
                    "python tests/checker_golden.py")
    return json.loads(checker_golden.GOLDEN.read_text())


def test_the_checker_says_what_it_said() -> None:
    golden = _golden()
    assert len(golden["cases"]) >= 45, sorted(golden["cases"])
    assert checker_golden.mismatches(golden) == []


def test_a_changed_message_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a value shown one character otherwise is a mismatch."""
    golden = _golden()
    short = values.short
    monkeypatch.setattr(values, "short", lambda v: short(v) + "!")
    names = ["matrix:DictValue", "generated:gen_52_0012"]
    found = checker_golden.mismatches(golden, names)
    assert any("DictValue changed" in m and "'b'!" in m for m in found), found
    assert any("gen_52_0012" in m for m in found), found
