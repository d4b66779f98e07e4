"""Every benchmark and tool in tools/ still starts: each one's ``--help`` runs, in one
fresh process. A move of the modules they import (the house refactor moved the demo's
helpers) broke tools/bench_remote.py without a test noticing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

RUN_ALL = """
import runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append((path, e.code))
    except Exception as e:
        failed.append((path, repr(e)))
print("FAILED", failed)
"""


def test_every_tool_starts() -> None:
    tools = sorted(str(p) for p in (REPO / "tools").glob("*.py"))
    assert tools
    p = subprocess.run([sys.executable, "-c", RUN_ALL, *tools], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert "FAILED []" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
