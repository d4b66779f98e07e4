"""The guard checker says what it said: ``explain``, ``failure``, the verdicts and the
stored lines over the guard matrix's cases and generated ones, against the golden
recorded before the checker became a class (issue 52; tests/checker_golden.py records
it and says how).

Compared in a fresh interpreter, as the golden was recorded: the checker's words include
torch's global state (a ``global_state`` guard says which setting changed), which any
earlier test in a pytest worker may have left changed (a CI run's worker saw 142
mismatches that a plain process does not).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import checker_golden
import pytest

TESTS = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import checker_golden
from cachecompile.entry import values
names = json.loads(sys.argv[2])
if sys.argv[3] == "1":      # a value shown one character otherwise
    short = values.short
    values.short = lambda v: short(v) + "!"
golden = json.loads(checker_golden.GOLDEN.read_text())
print("MISMATCHES " + json.dumps(checker_golden.mismatches(golden, names)))
"""


def _golden() -> dict:
    if not checker_golden.GOLDEN.exists():
        pytest.skip(f"no golden for Python {sys.version_info[0]}.{sys.version_info[1]} "
                    "(guards hold code digests of one release): record one with "
                    "python tests/checker_golden.py")
    return json.loads(checker_golden.GOLDEN.read_text())


def _mismatches(env: dict[str, str], names: list[str] | None = None,
                changed_short: bool = False) -> list[str]:
    r = subprocess.run([sys.executable, "-c", CHILD, str(TESTS), json.dumps(names),
                        "1" if changed_short else "0"],
                       env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("MISMATCHES ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return list(json.loads(line[-1][len("MISMATCHES "):]))


def test_the_checker_says_what_it_said(child_env: dict[str, str]) -> None:
    golden = _golden()
    assert len(golden["cases"]) >= 45, sorted(golden["cases"])
    assert _mismatches(child_env) == []


def test_a_changed_message_is_seen(child_env: dict[str, str]) -> None:
    """The comparison can fail: a value shown one character otherwise is a mismatch."""
    _golden()
    names = ["matrix:DictValue", "generated:gen_52_0012"]
    found = _mismatches(child_env, names, changed_short=True)
    assert any("DictValue changed" in m and "'b'!" in m for m in found), found
    assert any("gen_52_0012" in m for m in found), found
