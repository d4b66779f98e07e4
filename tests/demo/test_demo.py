"""The README's main job: the demo runs cold then warm and the warm run hits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_cold_then_warm(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "cachecompile.demo", "--calls", "5",
                           "--workdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = proc.stdout
    assert "| cache_compile warm (fresh process) |" in out
    warm_row = next(line for line in out.splitlines() if "cache_compile warm" in line)
    assert "prefill: hit/hit" in warm_row and "decode: hit" in warm_row, warm_row
    assert "imported torch._dynamo: no" in out
    assert "NO" not in warm_row
