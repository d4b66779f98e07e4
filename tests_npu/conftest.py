"""The Ascend tier: torchair's real Python on CPU, its native modules stood in.

Run with the tier's own venv (.ci/npu-tier.sh): torch-npu 2.13.0 installed, plain
``import torch_npu`` failing for want of CANN. The stand-ins (npu_standins.py) are
installed before anything imports torchair. Tests marked ``npu`` need real Ascend
hardware and are skipped here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def _real_npu() -> str | None:
    """None if a real NPU is usable, else why not."""
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:
        return f"no Ascend runtime (import torch_npu: {type(e).__name__}: {e})"
    import torch

    if not torch.npu.is_available():  # type: ignore[attr-defined]
        return "torch_npu imports but no NPU is available"
    return None


_NPU_WHY = _real_npu()
if _NPU_WHY is not None:
    import npu_standins

    npu_standins.install()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "npu: needs Ascend hardware (CANN + an NPU)")
    config.addinivalue_line("markers", "standin: runs torchair's Python with native stand-ins")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "npu" in item.keywords and _NPU_WHY is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs Ascend hardware: {_NPU_WHY}"))
        if "standin" in item.keywords and _NPU_WHY is None:
            item.add_marker(pytest.mark.skip(reason="real NPU present: stand-in tests are "
                                                    "for machines without one"))
