"""Fresh child processes for the Ascend tier (stand-ins installed in each child)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PRELUDE = """
import json as _json, os as _os, sys as _sys, warnings as _warnings
_warnings.simplefilter("always")
def report(obj):
    print("RESULT " + _json.dumps(obj), flush=True)
import npu_standins as _standins
if _os.environ.get("NPU_TIER_REAL") != "1":
    _native = _standins.install()
def ge_stats():
    return dict(_standins.STATS)
"""

# A small model whose GE graph the stand-in interpreter runs: Linear, ReLU, a buffer,
# sigmoid, a reduction and a transpose. SHIFT_DOWN is a module global the traced code
# branches on: not a key factor, so changing it provokes a Dynamo recompile.
MODEL = '''
import torch
from cachecompile import cache_compile

GLOBAL_SCALE = 2.0
SHIFT_DOWN = True


class Net(torch.nn.Module):
    def __init__(self, **cc):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 6)
        self.register_buffer("shift", torch.linspace(-1, 1, 6))
        self.cached = cache_compile(self._forward, **cc)

    def _forward(self, x):
        y = torch.relu(self.lin(x)) * GLOBAL_SCALE + self.shift
        if SHIFT_DOWN:
            y = y - 0.25
        return torch.sigmoid(y).sum(-1), y.t()
'''


class NpuSandbox:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = root / "cc-store"
        (root / "npu_model.py").write_text(MODEL)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_", "ASCEND_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), str(self.root)])
        env["CACHECOMPILE_DIR"] = str(self.store)
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        env["TORCHINDUCTOR_CACHE_DIR"] = str(self.root / "inductor")
        env.update(extra)
        return env

    def run(self, code: str, *, check: bool = True, timeout: float = 300, **extra: str) -> Any:
        proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                              env=self.env(**extra), capture_output=True, text=True,
                              timeout=timeout, cwd=str(self.root))
        results = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if check and (proc.returncode != 0 or not results):
            raise AssertionError(f"child failed (rc={proc.returncode})\nstdout:\n{proc.stdout}"
                                 f"\nstderr:\n{proc.stderr[-6000:]}")
        return Child(json.loads(results[-1]) if results else None, proc.returncode,
                     proc.stdout, proc.stderr)


class Child:
    def __init__(self, value: Any, rc: int, stdout: str, stderr: str) -> None:
        self.value, self.rc, self.stdout, self.stderr = value, rc, stdout, stderr

    def __getitem__(self, k: str) -> Any:
        return self.value[k]


# Child code: build the model, call it twice, compare with eager, report what happened.
RUN_MODEL = '''
import torch
import npu_model
from cachecompile.backends import torchair as _adapter_mod
_compiles = []
_orig_compile = _adapter_mod.ADAPTER.compile
def _counting_compile(*a, **k):
    _compiles.append(1)  # called only from inside Dynamo's backend callback
    return _orig_compile(*a, **k)
_adapter_mod.ADAPTER.compile = _counting_compile
cc = _json.loads(_os.environ.get("CC_ARGS", "{{}}"))
{setup}
m = npu_model.Net(**cc)
x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out = m.cached(x)
    ref = m._forward(x)
    out2 = m.cached(x + 1)
    ref2 = m._forward(x + 1)
ok = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(list(out) + list(out2), list(ref) + list(ref2)))
{after}
report({{"ok": ok, "events": m.cached.events, "ge": ge_stats(),
        "dynamo_compiles": len(_compiles), **extra}})
'''


def run_model(sb: NpuSandbox, cc: dict[str, Any] | None = None, setup: str = "",
              after: str = "extra = {}", check: bool = True, **env: str) -> Child:
    code = RUN_MODEL.format(setup=textwrap.dedent(setup), after=textwrap.dedent(after))
    return sb.run(code, check=check, CC_ARGS=json.dumps(cc or {"backend": "torchair"}), **env)
