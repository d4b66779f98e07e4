"""LOCAL_WORLD_SIZE: one local process does a node-level step, the others wait."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachecompile import node_once
from cachecompile.errors import RankConfigError

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import os, sys, time
from cachecompile import node_once
root, log = sys.argv[1], sys.argv[2]
def step():
    time.sleep(0.5)  # long enough for the others to be waiting
    with open(log, "a") as f:
        f.write(f"installed by local rank {os.environ['LOCAL_RANK']}\\n")
    return "ran"
res = node_once(root, "install-kernels", step, timeout=60)
with open(log, "a") as f:
    f.write(f"rank {os.environ['LOCAL_RANK']} passed ({res})\\n")
"""


def _spawn(tmp: Path, local: int, lws: int, job: str = "job1") -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=str(lws), TORCHELASTIC_RUN_ID=job)
    return subprocess.Popen([sys.executable, "-c", CHILD, str(tmp / "root"), str(tmp / "log")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_exactly_one_local_rank_runs_the_step(tmp_path: Path) -> None:
    # Rank 0 starts last: the others must wait for it, not run the step themselves.
    procs = [_spawn(tmp_path, r, 4) for r in (3, 2, 1)] + [_spawn(tmp_path, 0, 4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    lines = (tmp_path / "log").read_text().splitlines()
    installs = [line for line in lines if line.startswith("installed")]
    assert installs == ["installed by local rank 0"]
    passed = [line for line in lines if "passed" in line]
    assert len(passed) == 4 and lines.index(installs[0]) < min(map(lines.index, passed))
    assert "rank 0 passed (ran)" in passed


def test_disagreeing_local_world_size_is_an_error(tmp_path: Path) -> None:
    a, b = _spawn(tmp_path, 0, 2), _spawn(tmp_path, 1, 3)
    errs = []
    for p in (a, b):
        _, err = p.communicate(timeout=120)
        errs.append((p.returncode, err))
    assert any(rc != 0 and "must agree" in err for rc, err in errs), errs
    assert not (tmp_path / "log").exists() or "installed" not in (tmp_path / "log").read_text()


def test_missing_local_world_size_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RankConfigError, match="needs LOCAL_WORLD_SIZE"):
        node_once(tmp_path, "x", lambda: None)


def test_missing_job_id_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RankConfigError, match="TORCHELASTIC_RUN_ID"):
        node_once(tmp_path, "x", lambda: None)
