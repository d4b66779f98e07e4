"""The README's main job: the demo runs cold then warm and the warm run hits; its report
has the same shape whatever the numbers (a busy machine changes numbers, not columns)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachecompile.demo.__main__ import report

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
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
    # What each child was doing, while it did it.
    assert "  cold: compiling (Dynamo, Inductor, g++): prefill ..." in out, out
    assert "  warm: loading from the cache: prefill ..." in out, out
    # Per call: min and p90, cached beside eager.
    assert re.search(r"^\| prefill \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out,
                     re.M), out
    # The kept store, and what to try on it (--workdir keeps it).
    assert f"The store is kept at {tmp_path / 'store'}. Try:" in out
    key = re.search(r"cachectl show ([0-9a-f]{12}) ", out)
    assert key is not None, out
    shown = subprocess.run([sys.executable, "-m", "cachecompile.cli.main", "show", key.group(1),
                            "--cache-dir", str(tmp_path / "store")],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "prefill" in shown.stdout, shown.stdout + shown.stderr


def _rows(scale: float, spread: float) -> list[dict[str, Any]]:
    def timing(ms: float) -> dict[str, float]:
        return {"cached_min": ms * scale, "cached_p90": ms * scale * spread,
                "eager_min": 1.3 * ms * scale, "eager_p90": 1.3 * ms * scale * spread}

    base = {"ok": True, "max_abs_diff": 0.0, "events": {}, "per_call": {},
            "dynamo_imported": False}
    return [{**base, "mode": "eager", "first_output_s": 4.0 * scale},
            {**base, "mode": "cold", "first_output_s": 60.0 * scale,
             "events": {"cached_prefill": ["miss", "miss"], "cached_decode": ["miss"]}},
            {**base, "mode": "warm", "first_output_s": 5.0 * scale,
             "events": {"cached_prefill": ["hit", "hit"], "cached_decode": ["hit"]},
             "per_call": {"prefill": timing(1.1), "decode": timing(0.9)}}]


def _shape(lines: list[str]) -> list[str]:
    """A line's shape: its table cells' count, or that it is prose."""
    return [f"cells {line.count('|')}" if line.startswith("|") else
            ("blank" if not line else "prose") for line in lines]


def test_the_report_has_one_shape_on_a_calm_and_a_busy_machine() -> None:
    calm = report(_rows(1.0, 1.1))
    busy = report(_rows(3.0, 4.0))
    # The tables keep their rows and columns; the busy run adds one note after them.
    assert _shape(calm) == _shape(busy)[:len(calm)]
    assert busy[len(calm):] and busy[-1].startswith("Note: the machine was busy while timing "
                                                    "(p90 up to 4.0x the min")
    assert not any(line.startswith("Note:") for line in calm)
    header = "| call | cached min | cached p90 | eager min | eager p90 | cached / eager (min) |"
    assert header in calm and header in busy
