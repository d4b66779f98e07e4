"""Who this process is in a distributed job.

Sources, first match wins per field: explicit ``global_rank`` / ``tp_rank`` / ``pp_rank``
arguments, then an initialised ``torch.distributed``, then torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), then a single process.
"""

from __future__ import annotations

import dataclasses
import sys

from cachecompile.errors import RankConfigError
from cachecompile.store import config


@dataclasses.dataclass(frozen=True)
class Ranks:
    world_size: int
    global_rank: int
    tp_rank: int | None
    pp_rank: int | None
    local_rank: int
    local_world_size: int | None

    def factors(self) -> dict[str, int | None]:
        """The key factors: what makes two ranks' compiled programs differ."""
        return {"world_size": self.world_size, "global_rank": self.global_rank,
                "tp_rank": self.tp_rank, "pp_rank": self.pp_rank}

    def label(self) -> str:
        parts = [f"g{self.global_rank}/{self.world_size}"]
        if self.tp_rank is not None:
            parts.append(f"tp{self.tp_rank}")
        if self.pp_rank is not None:
            parts.append(f"pp{self.pp_rank}")
        return " ".join(parts)


def env_int(name: str) -> int | None:
    """A launcher's integer variable (``RANK``, ``LOCAL_WORLD_SIZE``...); None when unset.
    A value that is not an integer is a RankConfigError: ranks must never be guessed."""
    try:
        return config.env_int(name)
    except ValueError as e:
        raise RankConfigError(str(e)) from None


def _check_rank(kind: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise RankConfigError(f"{kind} must be a non-negative int, got {value!r}")


def detect(global_rank: int | None = None, tp_rank: int | None = None,
           pp_rank: int | None = None) -> Ranks:
    for kind, value in (("global_rank", global_rank), ("tp_rank", tp_rank),
                        ("pp_rank", pp_rank)):
        _check_rank(kind, value)
    world: int | None = None
    rank: int | None = None
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        rank = dist.get_rank()
    env_world, env_rank = env_int("WORLD_SIZE"), env_int("RANK")
    if world is None:
        world, rank = env_world, env_rank
    world = world if world is not None else 1
    if global_rank is not None:
        if global_rank >= world and (env_world is not None or dist is not None and world > 1):
            raise RankConfigError(
                f"global_rank={global_rank} is not below the world size {world} "
                "(from torch.distributed or WORLD_SIZE). Pass the process's real rank, or "
                "leave global_rank unset to take it from the launcher.")
        if rank is not None and rank != global_rank and world > 1:
            raise RankConfigError(
                f"global_rank={global_rank} disagrees with the launcher's rank {rank} "
                "(torch.distributed or RANK). Leave global_rank unset or pass the same value.")
        rank = global_rank
        world = max(world, global_rank + 1)
    rank = rank if rank is not None else 0
    local_rank = env_int("LOCAL_RANK")
    return Ranks(world_size=world, global_rank=rank, tp_rank=tp_rank, pp_rank=pp_rank,
                 local_rank=local_rank if local_rank is not None else 0,
                 local_world_size=env_int("LOCAL_WORLD_SIZE"))
