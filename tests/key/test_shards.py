"""``cachectl build --shard I/N``: the split of a build's signatures over N builders.

The promises, in-process (the assignment is a pure function of the strings): the shards'
union is the whole list and no signature is in two; every process computes the same
assignment whatever its ``PYTHONHASHSEED``; adding a signature moves no other one; the
shard is read from the engines' own variables, and a wrong one is a clear error.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cachecompile.key import shards
from cachecompile.key.shards import KUBERNETES, SLURM, TORCHRUN, Shard, from_engine, parse

REPO = Path(__file__).resolve().parents[2]

# A fleet's matrix as build factories name it: models x gears x prefill/decode x tp ranks.
MATRIX = [(f"{model}.{step}.tp{tp}", f"int64[{batch},{'n' if step == 'prefill' else 1}]@cpu")
          for model in ("llama", "phi3", "qwen") for step in ("prefill", "decode")
          for tp in range(4) for batch in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("count", [1, 2, 3, 8, 17])
def test_the_shards_partition_the_matrix(count: int) -> None:
    parts = [[s for s in MATRIX if Shard(i, count).holds(*s)] for i in range(count)]
    seen = Counter(s for part in parts for s in part)
    assert set(seen) == set(MATRIX)           # the union is the whole matrix
    assert max(seen.values()) == 1            # nothing in two shards
    if count > 1:
        # A hash, not one shard taking everything: 120 signatures over <= 17 shards.
        assert max(len(p) for p in parts) < len(MATRIX) * 0.6, [len(p) for p in parts]


def test_adding_a_signature_moves_no_other_one() -> None:
    before = {s: shards.shard_of(*s, 8) for s in MATRIX}
    grown = [("llama.decode.tp0", "int64[32,1]@cpu"), *MATRIX]  # prepended: order moves
    after = {s: shards.shard_of(*s, 8) for s in grown}
    assert all(after[s] == before[s] for s in MATRIX)


def test_every_process_assigns_the_same_shards() -> None:
    # Python's hash() of a str differs per process (PYTHONHASHSEED); the shard must not.
    code = ("import json, sys; from cachecompile.key.shards import shard_of; "
            "m = json.load(sys.stdin); print(json.dumps([shard_of(n, s, 5) for n, s in m]))")
    here = [shards.shard_of(n, s, 5) for n, s in MATRIX]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.run([sys.executable, "-c", code], input=json.dumps(MATRIX), env=env,
                           capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(p.stdout) == here
    # And a pinned value, so that a change of the hash (which would reshuffle every
    # fleet's shards between releases) is a decision, not an accident.
    assert shards.shard_of("decode", "float32[1,16]@cpu", 1000) == \
        int.from_bytes(__import__("hashlib").sha256(b"decode\0float32[1,16]@cpu")
                       .digest()[:8], "big") % 1000


def test_given_shards_parse_and_bad_ones_say_why() -> None:
    assert parse("2/8", {}) == Shard(2, 8)
    assert parse(" 0 / 1 ", {}) == Shard(0, 1)
    for text, words in [("8/8", "not in 0..7"), ("0/0", "at least 1 shard"),
                        ("-1/4", "is not I/N"), ("1of4", "is not I/N"), ("a/4", "is not I/N")]:
        with pytest.raises(ValueError, match=words):
            parse(text, {})


def test_the_engines_say_which_shard() -> None:
    # Kubernetes Indexed Job: the index only; the count is the Job's completions.
    assert parse("auto/8", {"JOB_COMPLETION_INDEX": "3"}) == Shard(3, 8, KUBERNETES)
    with pytest.raises(ValueError, match="auto/N"):
        parse("auto", {"JOB_COMPLETION_INDEX": "3"})
    # Slurm: #SBATCH --array=0-7, or 1-8, or 0-14:2 (index = (id - min) / step).
    assert parse("auto", {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "0",
                          "SLURM_ARRAY_TASK_COUNT": "8"}) == Shard(5, 8, SLURM)
    assert from_engine({"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_MIN": "1",
                        "SLURM_ARRAY_TASK_COUNT": "8"}) == Shard(7, 8, SLURM)
    assert from_engine({"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_MIN": "0",
                        "SLURM_ARRAY_TASK_STEP": "2",
                        "SLURM_ARRAY_TASK_COUNT": "8"}) == Shard(3, 8, SLURM)
    with pytest.raises(ValueError, match="MIN . k . STEP"):
        from_engine({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "0",
                     "SLURM_ARRAY_TASK_STEP": "2", "SLURM_ARRAY_TASK_COUNT": "8"})
    with pytest.raises(ValueError, match="disagrees"):
        parse("auto/4", {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "8"})
    # torchrun: RANK / WORLD_SIZE, and only that source hides them from the factory.
    got = parse("auto", {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    assert got == Shard(2, 4, TORCHRUN) and got.hides_launcher()
    assert not Shard(2, 4).hides_launcher()
    kept = shards.without_launcher({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                                    "MASTER_ADDR": "h", "TORCHELASTIC_RUN_ID": "j",
                                    "TORCHELASTIC_ERROR_FILE": "/e", "CXX": "g++",
                                    "SLURM_ARRAY_TASK_ID": "1"})
    assert kept == {"CXX": "g++", "SLURM_ARRAY_TASK_ID": "1"}
    # Kubernetes before Slurm before torchrun (a step inside a pod is the pod's shard).
    assert parse("auto/2", {"JOB_COMPLETION_INDEX": "1", "SLURM_ARRAY_TASK_ID": "0",
                            "RANK": "0", "WORLD_SIZE": "2"}).source == KUBERNETES
    for env, words in [({}, "no engine says"), ({"RANK": "x", "WORLD_SIZE": "2"},
                                                "not an integer"),
                       ({"RANK": "4", "WORLD_SIZE": "4"}, "not in 0..3"),
                       ({"RANK": "0"}, "WORLD_SIZE is not set")]:
        with pytest.raises(ValueError, match=words):
            parse("auto", env)


def test_torchrun_several_per_node_with_one_thread_is_warned(
        caplog: pytest.LogCaptureFixture) -> None:
    """torchrun sets OMP_NUM_THREADS=1 when it starts several processes per node, and the
    thread count is a key factor: the build would serve no process with more threads."""
    env = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}
    with caplog.at_level(logging.WARNING, logger="cachecompile.key.shards"):
        assert str(shards.parse("auto", env)) == "1/3"
    assert any("OMP_NUM_THREADS=1" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cachecompile.key.shards"):
        shards.parse("auto", {**env, "LOCAL_WORLD_SIZE": "1"})  # one per node: its own choice
        shards.parse("auto", {**env, "OMP_NUM_THREADS": "2"})
    assert not caplog.records


ENGINES = [  # an outer engine's variables for shard i of n, and the --shard text it takes
    ("kubernetes", lambda i, n: {"JOB_COMPLETION_INDEX": str(i)}, lambda n: f"auto/{n}"),
    ("slurm", lambda i, n: {"SLURM_ARRAY_TASK_ID": str(10 + 2 * i), "SLURM_ARRAY_TASK_MIN": "10",
                            "SLURM_ARRAY_TASK_STEP": "2", "SLURM_ARRAY_TASK_COUNT": str(n)},
     lambda n: "auto"),
    ("given", lambda i, n: {}, None),
]


@pytest.mark.parametrize("engine", [e[0] for e in ENGINES])
def test_torchrun_nested_in_an_engine_splits_its_shard_among_the_ranks(engine: str) -> None:
    """torchrun inside a Slurm array task, a Kubernetes Indexed Job pod or under a given
    --shard I/N: the outer engine says the shard, torchrun's ranks split it. For every
    shard count and world size: the ranks' parts are disjoint, their union is the outer
    shard (so the shards' union is still the matrix, each signature once), the ranks'
    variables are hidden from the factory, and a shard's signatures spread over its ranks."""
    _, outer, text = next(e for e in ENGINES if e[0] == engine)
    names = [(n, s) for n, s in MATRIX]
    for count in (1, 2, 3, 8):
        for world in (2, 3, 4):
            seen: Counter[tuple[str, str]] = Counter()
            for i in range(count):
                mine = {x for x in names if Shard(i, count).holds(*x)}
                parts = []
                for rank in range(world):
                    env = {**outer(i, count), "RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
                    shard = parse(text(count) if text else f"{i}/{count}", env)
                    assert (shard.index, shard.count, shard.rank, shard.ranks) == \
                        (i, count, rank, world)
                    assert shard.hides_launcher() and f"rank {rank} of {world}" in shard.part
                    parts.append({x for x in names if shard.holds(*x)})
                assert set().union(*parts) == mine
                assert sum(len(p) for p in parts) == len(mine)  # disjoint
                if len(mine) >= 4 * world:  # spread: no rank idle, none with it all
                    assert all(0 < len(p) < len(mine) for p in parts), [len(p) for p in parts]
                seen.update(x for p in parts for x in p)
            assert set(seen) == set(names) and set(seen.values()) == {1}


def test_torchrun_alone_or_with_one_process_splits_nothing_and_hides_its_variables() -> None:
    # torchrun as the engine itself: its rank is the shard, as before (no second split).
    got = parse("auto", {"RANK": "1", "WORLD_SIZE": "2"})
    assert (got.index, got.count, got.ranks, got.source) == (1, 2, 1, TORCHRUN)
    # One process under torchrun in a Slurm task: the task's shard, the variables hidden.
    one = parse("auto", {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2",
                         "RANK": "0", "WORLD_SIZE": "1"})
    assert (one.index, one.count, one.ranks) == (1, 2, 1) and one.hides_launcher()
    # No torchrun: the engine's shard as it always was; the factory sees everything.
    plain = parse("auto", {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert plain == Shard(1, 2, SLURM) and not plain.hides_launcher() and plain.part == ""
    # A build given no --shard under torchrun: its ranks split the whole matrix.
    assert shards.within_launcher(None, {}) is None
    whole = shards.within_launcher(None, {"RANK": "1", "WORLD_SIZE": "3"})
    assert whole is not None and (whole.count, whole.rank, whole.ranks) == (1, 1, 3)
    assert sum(whole.holds(*x) for x in MATRIX) < len(MATRIX)
    for env, words in [({"WORLD_SIZE": "2"}, "RANK is not"),
                       ({"WORLD_SIZE": "2", "RANK": "2"}, "not in 0..1"),
                       ({"WORLD_SIZE": "two", "RANK": "0"}, "not an integer")]:
        with pytest.raises(ValueError, match=words):
            parse("0/4", env)


def test_a_nested_torchrun_with_one_thread_per_process_is_warned(
        caplog: pytest.LogCaptureFixture) -> None:
    env = {"JOB_COMPLETION_INDEX": "0", "RANK": "1", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    with caplog.at_level(logging.WARNING, logger="cachecompile.key.shards"):
        parse("auto/4", env)
    assert any("OMP_NUM_THREADS=1" in r.getMessage() for r in caplog.records)
