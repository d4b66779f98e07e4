"""ruff and mypy over the repository, with the configuration in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool(name: str) -> list[str]:
    # Prefer the tool next to this interpreter (the venv), then PATH.
    local = Path(sys.executable).parent / name
    if local.exists():
        return [str(local)]
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return [found]


def test_ruff() -> None:
    p = subprocess.run([*_tool("ruff"), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy() -> None:
    # Packages to check come from [tool.mypy] in pyproject.toml.
    p = subprocess.run(_tool("mypy"), cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
