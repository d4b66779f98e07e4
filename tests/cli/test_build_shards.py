"""Sharded builds (docs/deploy.md, "Building on the fleet's engine"): N ``cachectl build
--shard I/N`` processes, each with its own local store as on N machines, fill one shared
remote tier; ``cachectl build --check`` gates on it. A shard killed mid-build and run
again builds only what it lacks and leaves the union complete.

The options' usage errors are checked in-process (click's runner, no torch); the fleet
itself with real processes against a real redis-server, then the check and a re-run's
upload against moto's S3.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ccutil import Sandbox
from click.testing import CliRunner

from cachecompile.cli.main import cli
from cachecompile.key.shards import TORCHRUN, Shard, parse

# Six signatures (one per gear) of a tiny method, compiled with aot_eager: the compiler is
# not the subject here, the split and the tier are.
GRID = '''
import torch
from torch import nn
from cachecompile import cache_compile

GEARS = [1, 2, 3, 4, 5, 6]

class Grid(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.cached_step = cache_compile(self.step, backend="aot_eager", dynamic=False,
                                         gears={"x": {0: GEARS}})

    def step(self, x):
        return torch.relu(self.lin(x)) + 1

def factory():
    return {"step": (Grid().eval().cached_step, [torch.randn(1, 8)])}
'''
N = 3
SIGNATURES = [f"float32[{g},8]@cpu" for g in (1, 2, 3, 4, 5, 6)]


def _cmd(*args: str) -> list[str]:
    # This checkout's cachectl: an installed script may belong to another checkout's install.
    return [sys.executable, "-m", "cachecompile.cli.main", *args]


def test_shard_options_are_checked_before_anything_runs() -> None:
    runner = CliRunner()
    for args, words in [(["--shard", "3/3"], "not in 0..2"), (["--shard", "1of3"], "not I/N"),
                        (["--shard", "auto"], "no engine says")]:
        env = {k: "" for k in ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "RANK")}
        r = runner.invoke(cli, ["build", "nowhere:factory", *args], env=env)
        assert r.exit_code == 2, r.output
        assert words in r.output and "--shard" in r.output


def test_the_shard_names_where_it_was_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CACHECOMPILE_BUILD_SHARD was reported as "from the --shard": the variable, the
    option or the engine's variable is named, in errors and in the build's own output."""
    from cachecompile.cli import build as build_cli
    from cachecompile.procs.builders import BuildEvent

    runner = CliRunner()
    engines = {k: "" for k in ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "RANK")}
    var = "$CACHECOMPILE_BUILD_SHARD"
    for args, env, words in [
            ([], {"CACHECOMPILE_BUILD_SHARD": "3/3"}, f"not in 0..2 (from {var})"),
            (["--shard", "3/3"], {"CACHECOMPILE_BUILD_SHARD": "0/3"}, "not in 0..2 (from --shard)"),
            ([], {"CACHECOMPILE_BUILD_SHARD": "auto"}, f"{var} auto: no engine says"),
            ([], {"CACHECOMPILE_BUILD_SHARD": "auto/2", "JOB_COMPLETION_INDEX": "5"},
             f"not in 0..1 (from $JOB_COMPLETION_INDEX (Kubernetes Indexed Job; "
             f"{var}=auto/2))")]:
        r = runner.invoke(cli, ["build", "nowhere:factory", *args], env={**engines, **env})
        flat = " ".join(r.output.split())  # click folds long messages
        assert r.exit_code == 2 and words in flat, flat

    # A build's "N signature(s) to build" line: no workers (the subject is the line).
    def prebuild(*_: Any, on_event: Any, **__: Any) -> list[Any]:
        on_event(BuildEvent("planned", 0))
        return []

    monkeypatch.setattr(build_cli, "prebuild_factory", prebuild)
    monkeypatch.delenv("CACHECOMPILE_REMOTE", raising=False)
    for args, env, words in [
            ([], {"CACHECOMPILE_BUILD_SHARD": "1/2"}, f"(shard 1/2, from {var})"),
            (["--shard", "1/2"], {}, "(shard 1/2)"),
            ([], {"CACHECOMPILE_BUILD_SHARD": "auto", "RANK": "1", "WORLD_SIZE": "2"},
             f"(shard 1/2, from $RANK and $WORLD_SIZE (torchrun; {var}=auto))")]:
        r = runner.invoke(cli, ["build", "grid:factory", *args], env={**engines, **env})
        flat = " ".join(r.output.split())
        assert r.exit_code == 0 and words in flat, flat


def test_a_build_sharded_by_torchrun_keys_no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's RANK / WORLD_SIZE pick the shard; the factory's processes must not see
    # them, or every entry would be keyed as rank I of N (ranks are key factors).
    from cachecompile.key import ranks
    from cachecompile.procs.builders import _worker_env

    for k, v in {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "TORCHELASTIC_RUN_ID": "build"}.items():
        monkeypatch.setenv(k, v)
    shard = parse("auto", os.environ)
    assert shard == Shard(2, 4, TORCHRUN)
    env = _worker_env(1, None, shard)
    assert not {"RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"} & set(env)
    with monkeypatch.context() as mp:
        for k in list(os.environ):
            mp.delenv(k)
        for k, v in env.items():
            mp.setenv(k, v)
        assert ranks.detect().factors() == ranks.Ranks(1, 0, None, None, 0, None).factors()
    # A shard that says nothing of torchrun leaves the variables as they are; one parsed
    # under torchrun (given as I/N too: issue 50) hides them and splits among the ranks.
    assert _worker_env(1, None, Shard(2, 4))["RANK"] == "2"
    given = parse("1/2", os.environ)
    assert (given.rank, given.ranks) == (2, 4)
    assert not {"RANK", "WORLD_SIZE"} & set(_worker_env(1, None, given))


def test_an_empty_shard_or_rank_part_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard with no signatures (more shards than signatures, or torchrun's ranks
    splitting a small shard) said nothing at all: it says so, and exits 0."""
    from cachecompile.cli import build as build_cli
    from cachecompile.procs.builders import BuildEvent

    def prebuild(*_: Any, on_event: Any, **__: Any) -> list[Any]:
        on_event(BuildEvent("planned", 0, declared=6))
        return []

    monkeypatch.setattr(build_cli, "prebuild_factory", prebuild)
    monkeypatch.delenv("CACHECOMPILE_REMOTE", raising=False)
    engines = {k: "" for k in ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "RANK",
                               "WORLD_SIZE", "CACHECOMPILE_BUILD_SHARD")}
    for args, env, words in [
            (["--shard", "7/8"], {}, "shard 7/8 holds none of the 6 signature(s)"),
            (["--shard", "auto"], {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4",
                                   "RANK": "1", "WORLD_SIZE": "2"},
             "shard 3/4 (rank 1 of 2 (torchrun)) holds none"),
            ([], {"RANK": "1", "WORLD_SIZE": "8"},
             "this part of the matrix (rank 1 of 8 (torchrun)) holds none")]:
        r = CliRunner().invoke(cli, ["build", "grid:factory", *args], env={**engines, **env})
        flat = " ".join(r.stderr.split())
        assert r.exit_code == 0 and words in flat, r.output + r.stderr


class Fleet:
    """N builders' environments: one sandbox (one CXX and Inductor dirs, which are key
    factors and must agree across shards as across a fleet's identical nodes), a local
    store per shard, one remote."""

    def __init__(self, tmp: Path, remote: dict[str, str]) -> None:
        self.box = Sandbox(tmp / "fleet")
        (self.box.root / "grid.py").write_text(GRID)
        self.remote = {"CACHECOMPILE_SIGNING_KEY": "fleet-key", **remote}

    def store(self, i: int) -> Path:
        return self.box.root / f"node{i}"

    def env(self, i: int | None) -> dict[str, str]:
        store = self.store(i) if i is not None else self.box.root / "gate"
        return self.box.env(CACHECOMPILE_DIR=str(store), CACHECOMPILE_COMPILE_SLOTS="1",
                            environ=self.remote)

    def start(self, i: int, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(_cmd("build", "grid:factory", "--shard", f"{i}/{N}",
                                     "--jobs", "1", *extra),
                                cwd=self.box.root, env=self.env(i), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def run(self, *args: str, node: int | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(_cmd(*args), cwd=self.box.root, env=self.env(node),
                              capture_output=True, text=True, timeout=600)

    def check(self, *extra: str) -> tuple[int, dict[str, Any]]:
        p = self.run("build", "grid:factory", "--check", "--json", *extra)
        assert p.returncode in (0, 1), p.stdout + p.stderr
        return p.returncode, json.loads(p.stdout)

    def local_keys(self, i: int) -> set[str]:
        from cachecompile.store import open_store

        if not self.store(i).exists():
            return set()
        return {e.key for e in open_store(self.store(i), remote="", create=False).entries()}


def _kill_after_first_build(p: subprocess.Popen[str]) -> None:
    """SIGKILL the shard (its whole process group: the pod or array task dies) once it
    has reported its first built signature: mid-build, its next compile under way."""
    assert p.stdout is not None
    deadline = time.monotonic() + 300
    for line in p.stdout:
        if line.startswith("built"):
            break
        assert time.monotonic() < deadline, "the shard built nothing in 300 s"
    else:
        pytest.fail(f"the shard exited before building: {p.wait()} {p.stderr.read() if p.stderr else ''}")
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(30)


@pytest.mark.slow
def test_three_shards_fill_the_remote_once_and_a_killed_one_is_rerun(tmp_path: Path) -> None:
    from redis_util import RedisServer

    from cachecompile.store.remote import RedisRemote
    from cachecompile.store.signing import Trust

    parts = {i: [s for s in SIGNATURES if Shard(i, N).holds("step", s)] for i in range(N)}
    killed = max(parts, key=lambda i: len(parts[i]))  # pigeonhole: >= 2 signatures
    assert len(parts[killed]) >= 2

    srv = RedisServer(tmp_path / "redis").start()
    try:
        fleet = Fleet(tmp_path, {"CACHECOMPILE_REMOTE": srv.url()})
        # The killed shard first: what it leaves behind is what its re-run must not build
        # again (its node keeps its local store, as a Slurm requeue or a pod with a
        # persistent volume does).
        _kill_after_first_build(fleet.start(killed))
        left = fleet.local_keys(killed)
        assert 1 <= len(left) <= len(parts[killed])
        # Killed mid-compile, it left no torn entry (publishing is an atomic rename).
        from cachecompile.store import open_store

        assert open_store(fleet.store(killed), remote="", create=False).maintenance().verify().problems == []

        gate = fleet.run("build", "grid:factory", "--check")  # the gate: not yet
        assert gate.returncode == 1, gate.stdout + gate.stderr
        missing = [line for line in gate.stdout.splitlines() if line.startswith("missing")]
        assert len(SIGNATURES) - len(left) <= len(missing) <= len(SIGNATURES)
        assert f"{len(SIGNATURES)} signatures declared; redis://" in gate.stdout

        # The fleet: all N shards at once (the killed one re-run).
        procs = {i: fleet.start(i, "--json") for i in range(N)}
        results: dict[int, list[dict[str, Any]]] = {}
        for i, p in procs.items():
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, (i, out, err)
            results[i] = json.loads(out)

        # Each shard did its own part, and the parts are the whole matrix, once.
        done = [(r["name"], r["signature"]) for i in range(N) for r in results[i]]
        assert sorted(done) == sorted(("step", s) for s in SIGNATURES)
        for i in range(N):
            assert {r["signature"] for r in results[i]} == set(parts[i])
        # Nothing built twice: the re-run found what the killed run had published.
        rerun = {r["signature"]: r for r in results[killed]}
        again = [s for s, r in rerun.items() if set(r["entries"]) & left]
        assert len(again) == len(left) and all(rerun[s]["status"] == "present" for s in again)
        for i in range(N):
            built = [r for r in results[i] if r["status"] == "built"]
            assert len(built) == len(parts[i]) - (len(left) if i == killed else 0)
        # Every node's local store holds its own shard's entries only.
        locals_ = [fleet.local_keys(i) for i in range(N)]
        assert sum(len(k) for k in locals_) == len(SIGNATURES)

        remote = {r.key for r in RedisRemote(srv.url(), trust=Trust(key=b"fleet-key")).records()}
        assert remote == set().union(*locals_)
        rc, after = fleet.check()
        assert rc == 0 and after["missing"] == [] and after["present"] == len(SIGNATURES)
    finally:
        srv.stop()

    # The S3 tier, the check and upload halves (in this process: the shards' processes
    # are the same against either tier): each node pushes what its build left in its
    # local store, and the check against the bucket then finds the whole matrix.
    from s3_util import MotoServer

    from cachecompile.procs.builders import BuildResult, check_factory, push_results

    moto = MotoServer(tmp_path / "moto").start()
    try:
        url = f"s3://{moto.bucket()}/fleet"
        with pytest.MonkeyPatch.context() as mp:
            for k, v in {**moto.env(), "CACHECOMPILE_REMOTE": url,
                         "CACHECOMPILE_SIGNING_KEY": "fleet-key"}.items():
                mp.setenv(k, v)
            for i in range(N):
                got = [BuildResult(r["name"], r["signature"], r["status"], 0.0,
                                   entries=tuple(r["entries"])) for r in results[i]]
                pushed = push_results(got, cache_dir=str(fleet.store(i)))
                assert pushed is not None and not pushed.failed
                assert (pushed.sent, pushed.there) == (len(parts[i]), 0)
            mp.chdir(fleet.box.root)
            for k, v in fleet.env(None).items():
                if k not in ("CACHECOMPILE_REMOTE",) and not k.startswith("AWS_"):
                    mp.setenv(k, v)
            found = check_factory("grid:factory")
        assert found.tier.startswith("s3://") and found.missing == []
        assert len(found.present) == len(SIGNATURES)
    finally:
        moto.stop()


# The same grid with Inductor (the default backend): its keys hold the CPU target. The
# check below computes keys only, so nothing is compiled.
TARGETED = GRID.replace(', backend="aot_eager"', "")


def test_check_with_cpu_targets_checks_each_targets_keys_of_the_same_shard(
        tmp_path: Path) -> None:
    import platform

    from cachecompile.key import cpu

    if platform.machine() not in cpu.BY_NAME["x86-64-v2"].machines:
        pytest.skip("CPU targets are x86-64 levels")
    # Before any worker: a target this CPU lacks is exit 2 for the check as for a build
    # (it could not compute that target's keys). The flags are pretended: an SSE2 CPU.
    v1 = "fpu cmov cx8 fxsr mmx syscall sse sse2"
    lacking = CliRunner().invoke(cli, ["build", "nowhere:factory", "--check", "--shard", "0/2",
                                       "--cpu-target", "x86-64-v2"],
                                 env={cpu.TEST_FLAGS_ENV: v1})
    assert lacking.exit_code == 2, lacking.output
    assert "cannot build for x86-64-v2: this CPU lacks" in lacking.output

    box = Sandbox(tmp_path)
    (box.root / "grid.py").write_text(TARGETED)
    p = subprocess.run(_cmd("build", "grid:factory", "--check", "--json", "--shard", "0/2",
                            "--cpu-target", "x86-64-v2", "--cpu-target", "native"),
                       cwd=box.root, env=box.env(CACHECOMPILE_DIR=str(box.root / "empty")),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr  # an empty store lacks everything
    found = json.loads(p.stdout)
    assert found["cpu_targets"] == ["x86-64-v2", "native"]
    mine = [s for s in SIGNATURES if Shard(0, 2).holds("step", s)]
    by_target: dict[str, dict[str, str]] = {}
    for m in found["missing"]:
        by_target.setdefault(m["cpu_target"], {})[m["signature"]] = m["key"]
    # Each target: the shard's signatures, the same split whatever the target ...
    assert {t: sorted(k) for t, k in by_target.items()} == \
        {"x86-64-v2": sorted(mine), "native": sorted(mine)}
    assert found["declared"] == 2 * len(mine) and found["present"] == 0
    # ... each with keys of its own (the workers were told the target).
    assert not set(by_target["x86-64-v2"].values()) & set(by_target["native"].values())
    assert all(by_target["x86-64-v2"].values())


def _torchrun(box: Sandbox, nproc: int, args: list[str], logs: Path,
              **env: str) -> list[tuple[int, str, str]]:
    """``cachectl ARGS`` in each of ``nproc`` ranks of a real torchrun job; each rank's
    (rank, stdout, stderr), read from torchrun's per-rank logs (it interleaves ranks'
    output on its own)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", "--log-dir", str(logs),
                           "--redirects", "3", "-m", "cachecompile.cli.main", *args],
                          cwd=box.root, env=box.env(environ=env), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    out = []
    for rank in range(nproc):
        (d,) = logs.glob(f"*/attempt_0/{rank}")
        out.append((rank, (d / "stdout.log").read_text(), (d / "stderr.log").read_text()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["kubernetes", "slurm"])
def test_torchrun_nested_in_an_array_task_builds_each_signature_once(
        tmp_path: Path, engine: str) -> None:
    """torchrun with two ranks inside a Kubernetes Indexed Job pod or a Slurm array task:
    both ranks took the pod's shard, built it twice and keyed it as rank r of 2, which no
    single-process server looks up. Now the ranks split the shard: each signature is
    built once, by one rank, keyed as a single process."""
    from cachecompile.store import open_store

    # A shard of the 6 signatures over 2 that both ranks have a part of (the split is a
    # pure function of the strings: the test picks it as a user could not, to see both).
    count = 2
    index = next(i for i in range(count) if all(
        any(Shard(i, count, rank=r, ranks=2).holds("step", s) for s in SIGNATURES)
        for r in range(2)))
    mine = {s for s in SIGNATURES if Shard(index, count).holds("step", s)}
    if engine == "kubernetes":
        env, shard = {"JOB_COMPLETION_INDEX": str(index)}, f"auto/{count}"
    else:
        env, shard = {"SLURM_ARRAY_TASK_ID": str(index + 1), "SLURM_ARRAY_TASK_MIN": "1",
                      "SLURM_ARRAY_TASK_COUNT": str(count)}, "auto"
    box = Sandbox(tmp_path)
    (box.root / "grid.py").write_text(GRID)
    store = box.root / "node"  # one node: both ranks share its store, as a pod's do
    ranks = _torchrun(box, 2, ["build", "grid:factory", "--shard", shard, "--jobs", "1",
                               "--json"], tmp_path / "logs", CACHECOMPILE_DIR=str(store),
                      CACHECOMPILE_COMPILE_SLOTS="1", **env)
    done = {rank: json.loads(out) for rank, out, _ in ranks}
    built = [r["signature"] for rank in done for r in done[rank]]
    assert sorted(built) == sorted(mine), (done, [e for _, _, e in ranks])
    assert all(r["status"] == "built" for rank in done for r in done[rank])
    assert all(done[rank] for rank in done)  # both ranks had a part
    infos = [i for i in open_store(store, remote="", create=False).entries()
             if i.labels.get("kind") != "graph"]
    assert sorted(i.labels["signature"] for i in infos) == sorted(mine)
    # Keyed as the factory declares (no ranks), not as torchrun's rank r of 2.
    assert {(i.labels["world_size"], i.labels["global_rank"]) for i in infos} == {("1", "0")}
    # The gate, outside torchrun, sees the shard whole.
    p = subprocess.run(_cmd("build", "grid:factory", "--check", "--json", "--shard",
                            f"{index}/{count}"), cwd=box.root,
                       env=box.env(CACHECOMPILE_DIR=str(store)), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["present"] == len(mine)


# An Inductor method with two gears: its keys hold the thread count and the compiler.
THREADED = GRID.replace(', backend="aot_eager"', "").replace("[1, 2, 3, 4, 5, 6]", "[1, 2]")


@pytest.mark.slow
def test_check_names_the_thread_count_or_compiler_that_sets_a_build_apart(
        tmp_path: Path) -> None:
    """A build under torchrun with two processes per node runs with OMP_NUM_THREADS=1
    (torchrun's default), and the thread count is a key factor: the gate then said "lacks
    2" and no more. It names the cause (the nearest entries' factors), as it does for a
    compiler (CXX) that differs from the build's."""
    box = Sandbox(tmp_path)
    (box.root / "grid.py").write_text(THREADED)
    store = box.root / "node"
    ranks = _torchrun(box, 2, ["build", "grid:factory", "--jobs", "1", "--json"],
                      tmp_path / "logs", CACHECOMPILE_DIR=str(store),
                      CACHECOMPILE_COMPILE_SLOTS="1")
    built = [r for _, out, _ in ranks for r in json.loads(out)]
    # No --shard: the ranks split the whole matrix, each signature built once.
    assert sorted(r["signature"] for r in built) == ["float32[1,8]@cpu", "float32[2,8]@cpu"]
    assert any("OMP_NUM_THREADS=1" in err for _, _, err in ranks)  # the build's warning

    def check(**env: str) -> tuple[int, dict[str, Any], str]:
        p = subprocess.run(_cmd("build", "grid:factory", "--check", "--json"), cwd=box.root,
                           env=box.env(environ=env, CACHECOMPILE_DIR=str(store)),
                           capture_output=True, text=True, timeout=600)
        assert p.returncode in (0, 1), p.stdout + p.stderr
        return p.returncode, json.loads(p.stdout), p.stderr

    rc, found, _ = check(OMP_NUM_THREADS="1")  # the build's own conditions: all there
    assert rc == 0 and found["present"] == 2, json.dumps(found)
    rc, found, _ = check(OMP_NUM_THREADS="2")
    assert rc == 1 and len(found["missing"]) == 2, found
    assert [c for c in found["likely_causes"] if c.startswith("the thread count")], found
    assert "2 of the 2 missing" in found["likely_causes"][0], found
    # The nearest entry's factors, this check's value and the tier's: {factor: [here, there]}.
    assert all(m["nearest"]["differ"]["backend.num_threads"] == [2, 1]
               for m in found["missing"]), found
    plain = subprocess.run(_cmd("build", "grid:factory", "--check"), cwd=box.root,
                           env=box.env(CACHECOMPILE_DIR=str(store), OMP_NUM_THREADS="2"),
                           capture_output=True, text=True, timeout=600)
    assert plain.returncode == 1 and "likely cause: the thread count" in plain.stdout, \
        plain.stdout + plain.stderr
    # One formatter for both: each missing line and the cause give the values alike.
    assert plain.stdout.count("backend.num_threads (2 here, 1 there)") >= 2, plain.stdout
    # Another compiler than the build's (the plain g++, not the session's wrapper).
    rc, found, _ = check(OMP_NUM_THREADS="1", CXX="g++")
    assert rc == 1 and len(found["missing"]) == 2, found
    assert [c for c in found["likely_causes"] if c.startswith("the C++ compiler")], found
    assert not [c for c in found["likely_causes"] if c.startswith("the thread count")]
