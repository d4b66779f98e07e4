"""Which shard of a sharded build (``cachectl build --shard I/N``) a signature belongs to.

A fleet's matrix of signatures is split over N builders by a stable hash of what declares
each signature: the factory's name for the method and the signature's description
(``describe(signature)``, as entries are labelled). Not Python's ``hash()`` (salted per
process by ``PYTHONHASHSEED``) and not the position in the list (an example added to one
method would move every later one to another shard): every shard computes the same
assignment on its own, so the shards' union is the whole matrix and no signature is in
two shards.

The shard may come from the engine that runs the builders (``--shard auto``):

* a Kubernetes Indexed Job: ``JOB_COMPLETION_INDEX`` (the count is the Job's
  ``completions``, which Kubernetes does not export: ``--shard auto/N``);
* a Slurm job array: ``SLURM_ARRAY_TASK_ID``, ``SLURM_ARRAY_TASK_MIN``,
  ``SLURM_ARRAY_TASK_STEP`` and ``SLURM_ARRAY_TASK_COUNT``;
* torchrun: ``RANK`` and ``WORLD_SIZE``. These also say which rank a process is in a
  distributed job, a key factor (:mod:`cachecompile.key.ranks`): a build sharded by torchrun
  hides them (:func:`without_launcher`) from the factory, so that its entries are keyed as the
  factory declares them, not as shard I of N.

**Nested engines.** torchrun inside a Slurm array task or a Kubernetes Indexed Job pod (or
under ``--shard I/N``): the outer engine says the shard, and torchrun's ``WORLD_SIZE > 1``
ranks split *that shard* among themselves (:func:`within_launcher`), by a second hash
independent of the first, so each of the shard's signatures is built by one rank, once,
and the ranks' parts are the shard. The ranks' variables are hidden from the factory here
too: an entry is keyed by ranks only where the factory passes them to ``cache_compile``
(``global_rank=``, ``tp_rank=``...), never by the launcher that happened to run the build.
Splitting rather than refusing: the ranks are the parallelism the job was given, and a
check of the shard (``--check --shard I/N``, outside torchrun) still sees one shard.

Torch-free: ``cachectl`` parses ``--shard`` before it imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Mapping

logger = logging.getLogger(__name__)

KUBERNETES = "Kubernetes Indexed Job"
SLURM = "Slurm job array"
TORCHRUN = "torchrun"
GIVEN = "--shard"

# What torchrun sets in each process it starts: a build sharded by it passes none of them
# on to the factory (RANK / WORLD_SIZE would key every entry as rank I of N, and
# TORCHELASTIC_RUN_ID names a rank group, docs/ranks.md).
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIX = "TORCHELASTIC_"


def without_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less torchrun's variables (:data:`LAUNCHER_VARS`, ``TORCHELASTIC_*``)."""
    return {k: v for k, v in env.items()
            if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIX)}

_GIVEN = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_AUTO = re.compile(r"^\s*auto\s*(?:/\s*(\d+)\s*)?$")


def shard_of(name: str, signature: str, count: int, *, within: bool = False) -> int:
    """The shard (0 .. count-1) of the signature ``signature`` of the method ``name``;
    ``within``: its part (0 .. count-1) among the ranks that split one shard, from other
    bits of the same hash, so that a shard's signatures spread over its ranks."""
    if count < 1:
        raise ValueError(f"a build has at least 1 shard, not {count}")
    digest = hashlib.sha256(f"{name}\0{signature}".encode()).digest()
    bits = digest[8:16] if within else digest[:8]
    return int.from_bytes(bits, "big") % count


@dataclasses.dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``; ``source``: given (:data:`GIVEN`) or which engine
    said so; ``origin``: where the value was read, as the user would look for it (the
    option, ``$CACHECOMPILE_BUILD_SHARD``, or the engine's variables and what said
    ``auto``). Two shards are equal whatever their origin."""

    index: int
    count: int
    source: str = GIVEN
    origin: str = dataclasses.field(default=GIVEN, compare=False)
    # torchrun's ranks splitting this shard (nested engines): this process's part.
    rank: int = 0
    ranks: int = 1
    # torchrun's variables are in the environment: the factory must not see them.
    launcher: bool = False

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a build has at least 1 shard, not {self.count} "
                             f"(from {self.origin})")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} is not in 0..{self.count - 1} "
                             f"(from {self.origin})")
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"torchrun's $RANK={self.rank} is not in 0..{self.ranks - 1} "
                             "($WORLD_SIZE)")

    def holds(self, name: str, signature: str) -> bool:
        if shard_of(name, signature, self.count) != self.index:
            return False
        return self.ranks == 1 or shard_of(name, signature, self.ranks, within=True) == self.rank

    def hides_launcher(self) -> bool:
        """Whether the launcher's rank variables must be kept from the factory."""
        return self.source == TORCHRUN or self.launcher

    @property
    def part(self) -> str:
        """This process's part of the shard, where torchrun's ranks split it: "" or
        "rank 1 of 2 (torchrun)"."""
        return f"rank {self.rank} of {self.ranks} (torchrun)" if self.ranks > 1 else ""

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def within_launcher(shard: Shard | None, env: Mapping[str, str]) -> Shard | None:
    """``shard`` (None: the whole matrix) as this process builds it: where torchrun runs
    ``WORLD_SIZE > 1`` processes and did not itself say the shard, its ranks split the
    shard (the whole matrix, for a build given none) among them (see "Nested engines");
    where torchrun is present at all, its variables are hidden from the factory. Without
    torchrun, ``shard`` as it is. ValueError if torchrun's variables are not integers or
    disagree."""
    if shard is None:
        if _int(env, "WORLD_SIZE") is None:
            return None
        shard = Shard(0, 1, GIVEN, "torchrun's ranks")
    return _nested(shard, env)


def _nested(shard: Shard, env: Mapping[str, str]) -> Shard:
    world = _int(env, "WORLD_SIZE")
    if world is None or shard.source == TORCHRUN:
        return shard
    rank = _int(env, "RANK")
    if rank is None:
        raise ValueError(f"$WORLD_SIZE={world} is set and $RANK is not: run the build "
                         "under torchrun, or unset WORLD_SIZE")
    if world <= 1:
        return dataclasses.replace(shard, launcher=True)
    split = dataclasses.replace(shard, rank=rank, ranks=world, launcher=True)
    logger.info("build shard %s split among torchrun's %d ranks: this is %s", split, world,
                split.part)
    _warn_one_thread(env)
    return split


def _warn_one_thread(env: Mapping[str, str]) -> None:
    if env.get("OMP_NUM_THREADS") == "1" and env.get("LOCAL_WORLD_SIZE", "1") not in ("", "1"):
        # torchrun sets OMP_NUM_THREADS=1 in each process when it starts several per
        # node; the thread count is a key factor, so these entries would serve only
        # one-thread processes (a new-user trial's whole build missed at serve time).
        logger.warning("torchrun set OMP_NUM_THREADS=1 for its %s processes on this node: "
                       "the thread count is in every key, so this build serves only "
                       "one-thread processes. Run one shard per node "
                       "(--nproc-per-node 1), or set OMP_NUM_THREADS to the serving "
                       "processes' count", env.get("LOCAL_WORLD_SIZE"))


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None


def _slurm(env: Mapping[str, str], task: int) -> tuple[int, int | None]:
    """The index of this array task among the array's tasks, and their count."""
    low = _int(env, "SLURM_ARRAY_TASK_MIN")
    step = _int(env, "SLURM_ARRAY_TASK_STEP") or 1
    count = _int(env, "SLURM_ARRAY_TASK_COUNT")
    offset = task - (low if low is not None else 0)
    if offset % step:
        # --array=1,4,9: no arithmetic maps the ids onto 0..N-1.
        raise ValueError(f"$SLURM_ARRAY_TASK_ID={task} is not MIN + k * STEP of the array; "
                         "use a range (--array=0-7) or give --shard I/N")
    return offset // step, count


def from_engine(env: Mapping[str, str], count: int | None = None,
                given_by: str = GIVEN) -> Shard:
    """The shard the engine running this process says, with ``count`` if given (``auto/N``);
    ``given_by`` is what said ``auto`` (the option or the variable), for the messages.

    Kubernetes first, then Slurm, then torchrun: a Slurm or torchrun step inside a
    Kubernetes pod is a shard of the pod's Job, not the other way round."""
    said = f"{given_by}=auto" + (f"/{count}" if count is not None else "")

    def read(engine: str, variables: str) -> str:
        return f"{variables} ({engine}; {said})"

    index = _int(env, "JOB_COMPLETION_INDEX")
    if index is not None:
        if count is None:
            raise ValueError("a Kubernetes Indexed Job says the index ($JOB_COMPLETION_INDEX), "
                             f"not the count: give {given_by} auto/N with N = the Job's "
                             "completions")
        return Shard(index, count, KUBERNETES, read(KUBERNETES, "$JOB_COMPLETION_INDEX"))
    task = _int(env, "SLURM_ARRAY_TASK_ID")
    if task is not None:
        index, engine_count = _slurm(env, task)
        return Shard(index, _agree(count, engine_count, "SLURM_ARRAY_TASK_COUNT", given_by),
                     SLURM, read(SLURM, "$SLURM_ARRAY_TASK_ID"))
    rank = _int(env, "RANK")
    if rank is not None:
        world = _int(env, "WORLD_SIZE")
        return Shard(rank, _agree(count, world, "WORLD_SIZE", given_by), TORCHRUN,
                     read(TORCHRUN, "$RANK and $WORLD_SIZE"))
    raise ValueError(f"{given_by} auto: no engine says which shard this is (none of "
                     "$JOB_COMPLETION_INDEX, $SLURM_ARRAY_TASK_ID, torchrun's $RANK is set); "
                     f"give {given_by} I/N")


def _agree(given: int | None, engine: int | None, name: str, given_by: str = GIVEN) -> int:
    if engine is None and given is None:
        raise ValueError(f"${name} is not set: give {given_by} auto/N")
    if engine is not None and given is not None and engine != given:
        raise ValueError(f"{given_by} auto/{given} disagrees with ${name}={engine}")
    count = given if given is not None else engine
    assert count is not None
    return count


def parse(text: str, env: Mapping[str, str], given_by: str = GIVEN) -> Shard:
    """``I/N``, ``auto`` or ``auto/N`` -> a Shard; ValueError saying what is wrong.
    ``given_by``: where ``text`` was read (``--shard``, or ``$CACHECOMPILE_BUILD_SHARD``),
    which the shard's messages and ``cachectl build``'s output name."""
    m = _GIVEN.match(text)
    if m:
        return _nested(Shard(int(m.group(1)), int(m.group(2)), GIVEN, given_by), env)
    m = _AUTO.match(text.lower())
    if m:
        shard = from_engine(env, int(m.group(1)) if m.group(1) else None, given_by)
        logger.info("build shard %s from %s", shard, shard.origin)
        if shard.source == TORCHRUN:
            _warn_one_thread(env)
        return _nested(shard, env)
    raise ValueError(f"{given_by}={text!r} is not I/N (e.g. 0/8), auto or auto/N")
