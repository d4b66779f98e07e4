"""LOCAL_WORLD_SIZE: one local process does a node-level step, the others wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachecompile import node_once
from cachecompile.errors import RankConfigError

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import os, sys, time
from cachecompile import node_once
root, log = sys.argv[1], sys.argv[2]
def step():
    time.sleep(0.5)  # long enough for the others to be waiting
    if os.environ.get("NODE_FAIL") == "1":
        raise RuntimeError("install failed")
    with open(log, "a") as f:
        f.write(f"installed by local rank {os.environ['LOCAL_RANK']}\\n")
    return "ran"
res = node_once(root, "install-kernels", step, timeout=60)
with open(log, "a") as f:
    f.write(f"rank {os.environ['LOCAL_RANK']} passed ({res})\\n")
"""


def _spawn(tmp: Path, local: int, lws: int, job: str = "job1",
           **extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=str(lws), TORCHELASTIC_RUN_ID=job, **extra)
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


def _job(tmp: Path, *, fail: bool = False) -> list[tuple[int, str]]:
    """One plain-torchrun job (TORCHELASTIC_RUN_ID=none, the default port): ranks 1-3
    start first and must still be waiting a while later; then rank 0 starts."""
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
             "NODE_FAIL": "1" if fail else "0"}
    others = [_spawn(tmp, r, 4, "none", **extra) for r in (1, 2, 3)]
    time.sleep(3.0)
    early = [p.poll() for p in others]
    assert early == [None, None, None], f"ranks returned before this job's rank 0 ran: {early}"
    procs = [*others, _spawn(tmp, 0, 4, "none", **extra)]
    out = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        out.append((p.returncode, err))
    return out


def test_a_later_job_does_not_see_an_earlier_jobs_state(tmp_path: Path) -> None:
    first = _job(tmp_path, fail=True)
    assert all(rc != 0 for rc, _ in first), first
    assert all("install failed" in err for _, err in first), first
    second = _job(tmp_path)
    assert all(rc == 0 for rc, _ in second), second
    third = _job(tmp_path)  # after a success, too: the others wait for the new rank 0
    assert all(rc == 0 for rc, _ in third), third
    installs = [ln for ln in (tmp_path / "log").read_text().splitlines()
                if ln.startswith("installed")]
    assert installs == ["installed by local rank 0"] * 2, installs
