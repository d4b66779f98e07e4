"""An entry is never served across torch releases: one store, two torch releases.

A process on one release publishes; a process on another release, on the same store,
misses and says that the nearest entry differs in the torch version (never a hit, never a
fault), publishes its own entry beside it, and each release then hits its own entry.

It needs a second interpreter with another torch release and this checkout's test
dependencies: CI's torch matrix (.ci/torch-matrix.sh) runs it in each release's venv with
the README command's venv (torch 2.13) as the other one, through
``CACHECOMPILE_TEST_OTHER_PYTHON``. Without that variable the test skips, saying so; with it
set to something that is not a Python with torch, it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from ccutil import Sandbox

OTHER_ENV = "CACHECOMPILE_TEST_OTHER_PYTHON"
OTHER = os.environ.get(OTHER_ENV)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not OTHER, reason=f"{OTHER_ENV} names no second Python with another "
                                         "torch release (CI's torch matrix sets it)"),
]

SCRIPT = """
import json, logging, sys
import torch
from cachecompile import cache_compile

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
log = logging.getLogger("cachecompile")
log.setLevel(logging.INFO)
log.addHandler(Keep())

class Cross(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
    def run(self, x):
        return torch.tanh(self.lin(x)) * 2

m = Cross().eval()
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
f = cache_compile(m.run, backend="aot_eager", dynamic=False)
with torch.no_grad():
    got = f(x)
    want = m.run(x)
print("RESULT " + json.dumps({"torch": torch.__version__, "events": [e[0] for e in f.events],
                              "ok": bool(torch.allclose(got, want)),
                              "log": [l for l in lines if "Cross.run" in l]}), flush=True)
"""


def _run(box: Sandbox, python: str) -> dict[str, Any]:
    proc = subprocess.run([python, "-c", textwrap.dedent(SCRIPT)], env=box.env(),
                          capture_output=True, text=True, timeout=600, cwd=str(box.root))
    results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, (
        f"{python} failed (rc={proc.returncode})\n{proc.stdout}\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(results[-1])
    return out


def test_an_entry_of_another_torch_release_is_a_named_miss(tmp_path: Path) -> None:
    assert OTHER is not None
    box = Sandbox(tmp_path)
    other = _run(box, OTHER)
    assert other["torch"].split("+")[0] != torch.__version__.split("+")[0], (
        f"{OTHER_ENV} runs torch {other['torch']}, the release under test: no second release")
    assert other["events"] == ["miss"] and other["ok"], other

    mine = _run(box, sys.executable)
    assert mine["torch"] == torch.__version__, mine
    # Not served: a miss whose log line names the torch version as what sets the other
    # release's entry apart (no warning, no fault: an ordinary miss).
    assert mine["events"] == ["miss"] and mine["ok"], mine
    miss = [line for line in mine["log"] if "cachecompile miss" in line]
    assert miss and "versions.torch" in miss[0], mine["log"]

    # Both entries stay, each served to its own release.
    again_mine = _run(box, sys.executable)
    again_other = _run(box, OTHER)
    assert again_mine["events"] == ["hit"] and again_mine["ok"], again_mine
    assert again_other["events"] == ["hit"] and again_other["ok"], again_other
