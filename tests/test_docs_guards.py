"""docs/usage.md's "Guards" section lists what is guarded and what is not, each row naming
its test (issue 47): every row names one, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _section() -> str:
    text = (REPO / "docs" / "usage.md").read_text()
    start = text.index("## Guards: when a hit is right")
    return text[start:text.index("\n## ", start + 1)]


def _rows(section: str) -> list[str]:
    return [line for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")
            and not re.match(r"\|\s*(what a method reads|not guarded)\s*\|", line)]


def _tests() -> dict[str, Path]:
    return {p.name: p for p in (REPO / "tests").rglob("test_*.py")}


def test_every_row_of_the_guards_tables_names_a_test_that_exists() -> None:
    rows = _rows(_section())
    assert len(rows) >= 15, rows
    files = _tests()
    for row in rows:
        last = row.rstrip("|").rsplit("|", 1)[-1]
        refs = re.findall(r"`(?:tests/[\w/]+/)?(test_\w+\.py)(?:::(\w+))?`", last)
        if last.strip() == "-":
            continue    # nothing a test could change (autograd's hooks: no grad here)
        assert refs, f"a row names no test: {row}"
        for name, func in refs:
            assert name in files, f"{name} (named in docs/usage.md) does not exist"
            if func:
                assert re.search(rf"^def {func}\(", files[name].read_text(), re.M), \
                    f"{name}::{func} (named in docs/usage.md) does not exist"
        for extra in re.findall(r"`::(\w+)`", last):
            assert any(re.search(rf"^def {extra}\(", files[n].read_text(), re.M)
                       for n, _ in refs), f"::{extra} (named in docs/usage.md) does not exist"
