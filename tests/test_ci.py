"""CI's deadline (.ci/tiers.sh): on a machine slower than the reference, a tier item whose
tests would end past the deadline is skipped and said; on one as fast as the reference it
fails CI. The real tiers.sh, over stand-in tier scripts that only say what they were asked."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A tier script that answers tiers.sh's questions: item "fast" takes 10 s on the reference
# machine, "slow" 1000 s; the sweep's "slow" has a smaller item, "small", that fits in 20 s.
STAND_IN = """#!/usr/bin/env bash
case "$1" in
  items) echo "${ITEMS}" ;;
  prepare) if [ "$2" = late ]; then sleep 6; fi; echo "prepared $2"
           echo "$(basename "$0" .sh) $2" >> prepared.txt ;;
  test) echo "tested $(basename "$0" .sh) $2"; echo "$(basename "$0" .sh) $2" >> tested.txt ;;
  estimate) case $2 in slow) echo 1000 ;; late) echo 30 ;; *) echo 10 ;; esac ;;
  discard) echo "discarded $2"; echo "$(basename "$0" .sh) $2" >> discarded.txt ;;
  fit) if [ "$(basename "$0" .sh)" = guard-sweep ] && [ "$3" -ge 20 ]; then echo small; fi ;;
esac
"""


def run_tiers(tmp_path: Path, factor: str, items: tuple[str, str, str] = ("fast slow", "fast", "slow"),
              deadline: int = 100, stand_in: str = STAND_IN,
              env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    ci = tmp_path / ".ci"
    ci.mkdir()
    shutil.copy(REPO / ".ci" / "tiers.sh", ci / "tiers.sh")
    for name, its in zip(("torch-matrix", "npu-tier", "guard-sweep"), items, strict=True):
        (ci / f"{name}.sh").write_text(stand_in.replace("${ITEMS}", its))
    script = ". .ci/tiers.sh; tiers_init; tiers_run"
    env = {"PATH": "/usr/bin:/bin", "TIERS_FACTOR": factor,
           "CACHECOMPILE_CI_DEADLINE_S": str(deadline),
           "TMPDIR": str(tmp_path), **(env_extra or {})}
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_slow_machine_skips_what_does_not_fit_and_says_so(tmp_path: Path) -> None:
    p = run_tiers(tmp_path, "3.0")
    assert p.returncode == 0, p.stdout + p.stderr
    # 10 s x 3 fits in 100 s; 1000 s x 3 does not, and the items after it still run; the
    # sweep runs smaller.
    assert lines(tmp_path / "tested.txt") == ["torch-matrix fast", "npu-tier fast",
                                              "guard-sweep small"]
    assert lines(tmp_path / "discarded.txt") == ["torch-matrix slow"]
    assert "== SKIPPED for time: torch-matrix slow" in p.stdout
    # What will not fit is not installed: the one after it installs instead.
    assert "torch-matrix slow" not in lines(tmp_path / "prepared.txt")
    assert "== SHRUNK for time: guard-sweep slow runs as guard-sweep small" in p.stdout
    assert "CI passed WITHOUT 2 tier item(s) whole" in p.stdout and "3.0x slower" in p.stdout


def test_an_install_that_ran_long_is_checked_again(tmp_path: Path) -> None:
    # "late" fits when its turn comes (30 s x 3 = 90 s of 95) but its install takes 6 s: it no
    # longer fits when the install ends, and is skipped then, its venv removed.
    p = run_tiers(tmp_path, "3", items=("late", "", ""), deadline=95)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "prepared late" in p.stdout
    assert lines(tmp_path / "tested.txt") == []
    assert lines(tmp_path / "discarded.txt") == ["torch-matrix late"]


def test_the_sweep_fits_whole_batches_in_the_time_left() -> None:
    def fit(n: int, seconds: int) -> str:
        return subprocess.run(["bash", str(REPO / ".ci" / "guard-sweep.sh"), "fit", str(n),
                               str(seconds)], capture_output=True, text=True).stdout.strip()

    assert fit(384, 200) == "256"     # (200 - 30) s at 229 s per 384 cases: 285, in 64s
    assert fit(384, 10_000) == "384"  # never more than asked
    assert fit(384, 50) == ""         # not one batch


@pytest.mark.parametrize("factor", ["1", "1.2"])
def test_a_machine_as_fast_as_the_reference_fails_instead(tmp_path: Path, factor: str) -> None:
    p = run_tiers(tmp_path, factor)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the tests have outgrown CI's time" in p.stderr
    assert lines(tmp_path / "tested.txt") == ["torch-matrix fast"]
    assert "SKIPPED" not in p.stdout


# Each event as it starts; a test takes a second, so an install begun beside it is logged
# before it.
TIMED = """#!/usr/bin/env bash
case "$1" in
  items) echo "${ITEMS}" ;;
  prepare) echo "prepare $2" >> events.txt ;;
  test) sleep 1; echo "test $2" >> events.txt ;;
  estimate) echo 10 ;;
esac
"""


@pytest.mark.parametrize("ahead", ["1", "2", "disk"])
def test_installs_run_ahead_of_the_tests_by_two_items(tmp_path: Path, ahead: str) -> None:
    """An install outlasts a short item's tests: the two items after the one under test
    install beside it (CACHECOMPILE_TIER_AHEAD, default 2), not only the next; the second
    only where the disk has room for both ("disk": room for one, so one ahead)."""
    free_gb = shutil.disk_usage(tmp_path).free // 2**30
    env: dict[str, str] = {
        "2": {}, "1": {"CACHECOMPILE_TIER_AHEAD": "1"},
        "disk": {"CACHECOMPILE_TIER_PREFETCH_GB": str(max(1, free_gb * 2 // 3))}}[ahead]
    p = run_tiers(tmp_path, "1", items=("a b c d", "", ""), stand_in=TIMED, env_extra=env)
    assert p.returncode == 0, p.stdout + p.stderr
    ev = lines(tmp_path / "events.txt")
    assert sorted(ev) == sorted(f"{what} {i}" for i in "abcd" for what in ("prepare", "test"))
    for i, j in zip("abcd", "bcd", strict=False):
        assert ev.index(f"prepare {j}") < ev.index(f"test {i}"), ev   # one ahead, always
    if ahead == "2":
        assert ev.index("prepare c") < ev.index("test a"), ev
        assert ev.index("prepare d") < ev.index("test b"), ev
    else:
        assert ev.index("prepare c") > ev.index("test a"), ev


def test_the_speed_tool_gives_a_factor_never_under_one() -> None:
    p = subprocess.run(["python3", str(REPO / "tools" / "machine_speed.py"), "--factor"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout) >= 1.0
