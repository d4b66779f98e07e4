"""Shared test setup: make the repository importable, also in child processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for a child ``python`` that must import this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("CACHECOMPILE_DIR", None)
    env.pop("CACHECOMPILE_SHARED_GROUP", None)
    return env
