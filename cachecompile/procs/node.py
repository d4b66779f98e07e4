"""Node-level steps: exactly one local process does it, the others wait (LOCAL_WORLD_SIZE).

TorchAir installs its static kernels this way (local rank 0 builds and installs, the
others wait at a barrier). :func:`node_once` is that barrier for any step that
must run once per job on a node: installing a shared artifact, sweeping the cache.

Protocol, all in plain files under ``<store root>/node/<job>/<step>/``:

1. every local rank writes ``rank<L>.json`` with its ``LOCAL_WORLD_SIZE``, pid and time;
2. local rank 0 waits until all ``LOCAL_WORLD_SIZE`` ranks registered, checks that they
   agree, runs the step and writes ``done.json`` (or ``failed.json`` with the reason);
3. the others wait for either file. Any rank that sees a registration with another
   ``LOCAL_WORLD_SIZE`` than its own raises at once.

The job is ``TORCHELASTIC_RUN_ID`` (torchrun sets it), else ``MASTER_ADDR:MASTER_PORT``.
Neither is unique: plain ``torchrun`` sets ``TORCHELASTIC_RUN_ID=none`` and the default
port for every job, so the state of an earlier job (or an earlier restart of this one)
may still be there. Hence: a registration counts only while its process is alive (pids
are checked in the caller's own pid namespace), and a waiting rank accepts only a
``done.json`` / ``failed.json`` written after it registered.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from cachecompile.errors import RankConfigError
from cachecompile.key.ranks import env_int
from cachecompile.procs.poll import poll
from cachecompile.store.fsutil import pid_alive

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL = 0.05


def job_id() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run == "none":  # plain torchrun's placeholder: says nothing about the job
        run = ""
    if not run:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        run = f"{addr}-{port}" if addr and port else ""
    if not run:
        raise RankConfigError(
            "a node-level step needs to know the job: set TORCHELASTIC_RUN_ID (torchrun "
            "does) or MASTER_ADDR and MASTER_PORT")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:100]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic: a reader sees all of it or nothing


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def node_once(root: str | os.PathLike[str], step: str, fn: Callable[[], T], *,  # noqa: C901 (today's exception: lock, wait and the leader's failure modes)
              timeout: float = 900.0) -> T | None:
    """Run ``fn`` on local rank 0 of this node, once per job; others wait for it.

    Returns ``fn``'s result on local rank 0 and None elsewhere. Raises RankConfigError
    if ``LOCAL_WORLD_SIZE`` or ``LOCAL_RANK`` is missing, if the ranks disagree on
    ``LOCAL_WORLD_SIZE``, if local rank 0 failed the step, or after ``timeout``.
    """
    lws = env_int("LOCAL_WORLD_SIZE")
    local = env_int("LOCAL_RANK")
    if lws is None or local is None:
        raise RankConfigError(
            f"node step {step!r} needs LOCAL_WORLD_SIZE and LOCAL_RANK (torchrun sets both; "
            "other launchers must export them) to know how many local processes take part")
    if not 0 <= local < lws:
        raise RankConfigError(f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={lws}")
    d = Path(root) / "node" / job_id() / re.sub(r"[^A-Za-z0-9_.-]", "_", step)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    registered = time.time()
    _write_json(d / f"rank{local}.json", {"local_world_size": lws, "pid": os.getpid(),
                                          "pidns": _pid_namespace(), "at": registered})

    def check_agreement() -> int:
        seen = 0
        for p in d.glob("rank*.json"):
            info = _read_json(p)
            if info is None or not _alive(info):
                continue  # a rank of an earlier job or attempt
            seen += 1
            if info.get("local_world_size") != lws:
                raise RankConfigError(
                    f"node step {step!r}: {p.stem} runs with LOCAL_WORLD_SIZE="
                    f"{info.get('local_world_size')} but local rank {local} with {lws}; all "
                    "processes of a job on one node must agree")
        return seen

    def ours(name: str) -> dict[str, Any] | None:
        """``done.json`` / ``failed.json`` if written for this attempt (after we came)."""
        info = _read_json(d / name)
        if info is None or not isinstance(info.get("at"), (int, float)):
            return None
        return info if info["at"] >= registered else None

    if local == 0:
        try:
            poll(lambda _: True if check_agreement() >= lws else None,
                 timeout=timeout, interval=_POLL,
                 expired=lambda _: RankConfigError(
                     f"node step {step!r}: only {check_agreement()} of LOCAL_WORLD_SIZE="
                     f"{lws} local ranks arrived within {timeout:g}s"))
            logger.info("node step %s: local rank 0 runs it for %d local ranks", step, lws)
            result = fn()
        except BaseException as e:
            _write_json(d / "failed.json", {"reason": f"{type(e).__name__}: {e}",
                                            "at": time.time()})
            raise
        _write_json(d / "done.json", {"pid": os.getpid(), "at": time.time()})
        return result
    logger.info("node step %s: local rank %d waits for local rank 0", step, local)

    def finished(_: float) -> bool | None:
        check_agreement()
        if ours("done.json") is not None:
            return True
        failed = ours("failed.json")
        if failed is not None:
            raise RankConfigError(f"node step {step!r} failed on local rank 0: "
                                  f"{failed.get('reason')}")
        return None

    poll(finished, timeout=timeout, interval=_POLL,
         expired=lambda _: RankConfigError(f"node step {step!r}: local rank 0 did not finish "
                                           f"within {timeout:g}s"))
    return None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _alive(info: dict[str, Any]) -> bool:
    """Whether a registration's process still runs. Another pid namespace (a container
    sharing the volume) cannot be checked: it counts."""
    pid = info.get("pid")
    if not isinstance(pid, int) or info.get("pidns", "") != _pid_namespace():
        return True
    return pid_alive(pid)


def prepare_node(cache_dir: str | os.PathLike[str] | None = None, *,
                 timeout: float = 900.0) -> None:
    """Call once per rank at job start: local rank 0 enforces the cache's size cap and
    sweeps stale temp dirs while the other local ranks wait, so N ranks do not all
    sweep the same directory at once. Needs LOCAL_WORLD_SIZE / LOCAL_RANK."""
    from cachecompile import store

    st = store.open_store(cache_dir).maintenance()  # the cap is the local store's
    node_once(st.root, "prepare", st.gc, timeout=timeout)
