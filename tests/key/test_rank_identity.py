"""Rank identity: explicit arguments, then torch.distributed, then torchrun's env."""

from __future__ import annotations

import pytest

from cachecompile import ContractError, cache_compile
from cachecompile.errors import RankConfigError
from cachecompile.key.ranks import detect


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_single_process_defaults() -> None:
    r = detect()
    assert (r.world_size, r.global_rank, r.tp_rank, r.pp_rank) == (1, 0, None, None)
    assert r.label() == "g0/1"


def test_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    r = detect(tp_rank=1, pp_rank=0)
    assert (r.world_size, r.global_rank, r.local_rank, r.local_world_size) == (8, 5, 1, 4)
    assert r.label() == "g5/8 tp1 pp0"
    assert r.factors() == {"world_size": 8, "global_rank": 5, "tp_rank": 1, "pp_rank": 0}


def test_explicit_rank_agreeing_with_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    assert detect(global_rank=2).global_rank == 2


def test_explicit_rank_not_below_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RankConfigError, match="global_rank=4 is not below the world size 4"):
        detect(global_rank=4)


def test_explicit_rank_contradicting_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RankConfigError, match="disagrees with the launcher's rank 1"):
        detect(global_rank=3)


def test_bad_values() -> None:
    with pytest.raises(RankConfigError, match="tp_rank must be a non-negative int"):
        detect(tp_rank=-1)


def test_garbage_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(RankConfigError, match="WORLD_SIZE='four' is not an integer"):
        detect()


def test_cache_compile_surfaces_rank_conflicts(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")
    m = torch.nn.Linear(2, 2)
    with pytest.raises(RankConfigError):
        cache_compile(m.forward, global_rank=7)
    with pytest.raises(ContractError):
        cache_compile(m.forward, global_rank=True)
