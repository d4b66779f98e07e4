"""Prebuilding: fill the cache before serving, in this process or in parallel workers.

Two entry points:

* :func:`prebuild` ``(cached_fn, examples)``: call the cached method once per distinct
  signature of ``examples`` (every declared gear of each example, if the method has gears)
  in this process, one after the other. Each call compiles and publishes its entry, or
  finds it there.
* :func:`prebuild_factory` ``("package.module:factory", jobs=N)``: what ``cachectl build``
  runs for an image build step. ``factory()`` returns the work as ``[(cached_fn,
  examples), ...]`` or ``{name: (cached_fn, examples)}``. ``N`` worker processes
  (default: the node's compile slots, ``CACHECOMPILE_COMPILE_SLOTS``) each import the
  factory, list the same tasks, and take the next unbuilt signature as they become free,
  so independent signatures compile in parallel; their backend compiles still take a
  compile slot each (:class:`cachecompile.procs.coop.CompileSlots`). This process only hands
  out tasks and reports progress.

A worker talks to its parent in JSON lines on its original stdout (anything the model
prints goes to its stderr): first ``{"tasks": [...]}`` (or ``{"error": ...}``), then one
``{"done": i, ...}`` per ``{"run": i}`` it is sent on stdin; it exits at end of input.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from cachecompile.cached import CachedFunction
from cachecompile.errors import (
    CacheFaultWarning,
    ContractError,
    OutOfGearWarning,
    SignatureLimitWarning,
)
from cachecompile.forms import CachedModule
from cachecompile.key import cpu, identity
from cachecompile.key.signature import describe, signature
from cachecompile.procs import coop
from cachecompile.store.config import env_float

logger = logging.getLogger(__name__)

# Outcomes of one signature.
BUILT = "built"            # compiled and published by this build
PRESENT = "present"        # the entry was there already (loaded, not compiled)
NOT_CACHED = "not cached"  # it ran, but with a live compile: no entry serves it
FAILED = "failed"          # the call raised
OK = (BUILT, PRESENT)
_FAULTS = (CacheFaultWarning, SignatureLimitWarning)


class Call:
    """One example call with keyword arguments: ``Call(tokens, mask=m)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.args)} args, {sorted(self.kwargs)})"


class Exact(Call):
    """An example built at its own shapes, not as a template over the method's gears: a
    signature outside them, which serving would compile and cache too (``Exact(x)``)."""


@dataclasses.dataclass
class Task:
    """One signature to build."""

    index: int
    name: str                    # the cached method (or the factory's name for it)
    signature: str               # describe(signature), as entries are labelled
    fn: CachedFunction = dataclasses.field(repr=False)
    args: tuple[Any, ...] = dataclasses.field(repr=False)
    kwargs: dict[str, Any] = dataclasses.field(repr=False)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "signature": self.signature}


@dataclasses.dataclass
class BuildResult:
    name: str
    signature: str
    status: str                  # BUILT, PRESENT, NOT_CACHED or FAILED
    seconds: float
    detail: str = ""             # why not cached / failed; a note on the example
    worker: int | None = None

    @property
    def ok(self) -> bool:
        return self.status in OK


@dataclasses.dataclass
class BuildEvent:
    """What a progress callback is told: ``planned`` (once), ``started``, ``finished``."""

    kind: str
    total: int
    task: dict[str, Any] | None = None
    result: BuildResult | None = None


OnEvent = Callable[[BuildEvent], None]


class BuildError(Exception):
    """The build could not start or go on: a bad factory, workers that disagree or died."""


# -- planning ------------------------------------------------------------------------------
def _calls(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, Call):
        return tuple(example.args), dict(example.kwargs)
    if isinstance(example, tuple):
        return example, {}
    return (example,), {}


def plan(targets: Iterable[tuple[str, CachedFunction, Sequence[Any]]]) -> list[Task]:
    """One task per distinct (method, signature): each example call, expanded over the
    method's gears (an example is then a template, see :meth:`Gears.expand`)."""
    tasks: list[Task] = []
    seen: set[tuple[int, Any]] = set()
    for name, fn, examples in targets:
        if isinstance(fn, CachedModule):
            fn = fn.cached_forward  # cache_compile(module): its cached forward
        if not isinstance(fn, CachedFunction):
            raise ContractError(f"prebuild: {name} is {type(fn).__qualname__}, not what "
                                "cache_compile returns")
        if isinstance(examples, (str, bytes)) or not isinstance(examples, Iterable):
            raise ContractError(f"prebuild: the examples of {name} must be a list of calls")
        examples = list(examples)
        if not examples:
            raise ContractError(f"prebuild: no examples for {name}"
                                + (" (gears need one example to take dtypes and the other "
                                   "dims from)" if fn.gears is not None else ""))
        for example in examples:
            args, kwargs = _calls(example)
            calls = [(args, kwargs)]
            gears = fn.gears
            if gears is not None and not isinstance(example, Exact):
                calls = gears.expand(args, kwargs)
            for a, k in calls:
                sig = signature(a, k, fn.dynamic)
                if (id(fn), sig) in seen:
                    continue
                seen.add((id(fn), sig))
                tasks.append(Task(len(tasks), name, describe(sig), fn, a, k))
    return tasks


def _targets(made: Any, spec: str) -> list[tuple[str, CachedFunction, Sequence[Any]]]:
    """What a factory returned, as (name, cached function, examples)."""
    items: list[tuple[str, Any]]
    if isinstance(made, Mapping):
        items = [(str(k), v) for k, v in made.items()]
    elif isinstance(made, (list, tuple)) and len(made) == 2 and isinstance(made[0], CachedFunction):
        items = [(made[0].__qualname__, made)]
    elif isinstance(made, (list, tuple)):
        items = [(getattr(v[0], "__qualname__", str(i)) if isinstance(v, (list, tuple)) and v
                  else str(i), v) for i, v in enumerate(made)]
    else:
        raise ContractError(f"{spec} returned {type(made).__qualname__}; a build factory "
                            "returns [(cached_fn, [example, ...]), ...] or "
                            "{name: (cached_fn, [example, ...])}")
    out: list[tuple[str, CachedFunction, Sequence[Any]]] = []
    for name, pair in items:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ContractError(f"{spec}: {name} is not a (cached_fn, examples) pair")
        out.append((name, pair[0], pair[1]))
    return out


def parse_spec(spec: str) -> tuple[str, str]:
    """``package.module:factory`` -> (module, attribute path); ContractError otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ContractError(f"{spec!r} is not module:factory (e.g. myapp.serving:build_model)")
    return module_name, attr


def load_factory(spec: str) -> Callable[[], Any]:
    """``package.module:factory`` (the attribute may be dotted) -> the callable."""
    module_name, attr = parse_spec(spec)
    if "" not in sys.path and os.getcwd() not in sys.path:
        # As `python -m` and servers do: the factory's module is found from the cwd.
        sys.path.insert(0, os.getcwd())
    obj = identity.import_attr(module_name, attr)
    if not callable(obj):
        raise ContractError(f"{spec} is {type(obj).__qualname__}, not a callable")
    return obj  # type: ignore[no-any-return]


def plan_factory(spec: str) -> list[Task]:
    return plan(_targets(load_factory(spec)(), spec))


# -- running one task ----------------------------------------------------------------------
def run_task(task: Task, worker: int | None = None) -> BuildResult:
    """Call the method once for the task's signature; what that did to the cache."""
    fn = task.fn
    before = len(fn.events)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                fn(*task.args, **task.kwargs)
        except Exception as e:  # reported per task; the build goes on
            logger.debug("prebuild of %s [%s] failed", task.name, task.signature, exc_info=True)
            return BuildResult(task.name, task.signature, FAILED, time.perf_counter() - t0,
                               f"{type(e).__name__}: {e}", worker)
    seconds = time.perf_counter() - t0
    events = [e for e, _ in fn.events[before:]]
    faults = [str(w.message) for w in caught if issubclass(w.category, _FAULTS)]
    for w in caught:
        # A signature outside the gears is what an Exact example asks for: cached, no fault.
        if not issubclass(w.category, (*_FAULTS, OutOfGearWarning)):
            # Not ours to judge: let the user's warnings through.
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if faults or "live" in events:
        detail = "; ".join(faults) or "it ran with a live compile"
        return BuildResult(task.name, task.signature, NOT_CACHED, seconds, detail, worker)
    note = ""
    if " strides[" in task.signature:
        # Dynamo's tensor guard checks strides: a slice (x[:, :1] of a wider tensor) and a
        # fresh tensor of its shape are two signatures. Likely a mistake in the example.
        note = ("an example tensor has the strides of a slice (strides[...] above): calls "
                "with fresh or .contiguous() tensors are another signature and would not hit")
    if events and events[0] in ("miss", "shared"):
        return BuildResult(task.name, task.signature, BUILT, seconds, note, worker)
    return BuildResult(task.name, task.signature, PRESENT, seconds, note, worker)


def prebuild(fn: CachedFunction, examples: Sequence[Any], *,
             on_event: OnEvent | None = None) -> list[BuildResult]:
    """Build ``fn``'s entries for ``examples`` in this process, one signature at a time.

    An example is a tuple of positional arguments, a :class:`Call` (with keywords), or a
    single argument. With declared gears, each example is a template, built at every gear.
    Signatures that already have an entry are loaded, not compiled (``present``).
    For parallel builds across processes use :func:`prebuild_factory`.
    """
    return _run_here(plan([(fn.__qualname__, fn, examples)]), on_event)


def _run_here(tasks: list[Task], on_event: OnEvent | None) -> list[BuildResult]:
    emit = on_event or (lambda e: None)
    emit(BuildEvent("planned", len(tasks)))
    results: list[BuildResult] = []
    for task in tasks:
        emit(BuildEvent("started", len(tasks), task.info()))
        result = run_task(task)
        results.append(result)
        emit(BuildEvent("finished", len(tasks), task.info(), result))
    return results


# -- in parallel: workers ------------------------------------------------------------------
class _Worker:
    def __init__(self, wid: int, spec: str, env: dict[str, str], events: queue.Queue[Any]) -> None:
        self.wid = wid
        self.log: IO[bytes] = tempfile.TemporaryFile(prefix="cachectl-build-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachecompile.build", "worker", spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
            text=True, bufsize=1)
        self.task: int | None = None
        self.closed = False
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True,
                                        name=f"cachecompile-build-{wid}")
        self._reader.start()

    def _read(self, events: queue.Queue[Any]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                events.put((self.wid, json.loads(line)))
            except ValueError:
                logger.debug("worker %d: not a protocol line: %r", self.wid, line)
        events.put((self.wid, None))

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass

    def tail(self, lines: int = 15) -> str:
        try:
            self.log.seek(0)
            text = self.log.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def stop(self) -> None:
        self.close()
        if self.proc.poll() is None:
            # Its stdin is closed: a worker then exits by itself, after waiting for its
            # uploads to a remote tier (CACHECOMPILE_REMOTE_FLUSH_TIMEOUT). A SIGTERM
            # straight away killed that flush, and no build ever reached the remote.
            try:
                self.proc.wait(timeout=_EXIT_GRACE)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


# How long a worker whose input is closed may take to exit: its uploads' flush, plus a margin.
_EXIT_GRACE = env_float("CACHECOMPILE_REMOTE_FLUSH_TIMEOUT", 5.0) + 10.0


def prebuild_factory(spec: str, *, jobs: int | None = None, cache_dir: str | None = None,
                     on_event: OnEvent | None = None,
                     cpu_target: str | None = None) -> list[BuildResult]:
    """Build every signature the factory ``spec`` (``module:callable``) lists, in ``jobs``
    worker processes (default: the node's compile slots), for ``cpu_target`` if given
    (``CACHECOMPILE_CPU_TARGET`` in the workers). Returns one result per
    signature, in the factory's order. Raises :class:`BuildError` if the factory fails in
    a worker, two workers list different tasks, or every worker dies."""
    parse_spec(spec)  # a usage error before any worker starts
    n = jobs if jobs is not None else coop.default_slots()
    if n < 1:
        raise ContractError(f"jobs must be >= 1, got {n}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    if cache_dir is not None:
        env["CACHECOMPILE_DIR"] = str(Path(cache_dir).resolve())
    if cpu_target is not None:
        env[cpu.ENV] = cpu_target  # the workers' cache_compile builds for it (key.cpu)
    if n > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in env:
        # The workers are the parallelism: Inductor's own pool of compile processes (one
        # per core, in every worker) would oversubscribe the cores n times over and cost
        # each worker the pool's start-up. Not a key factor (it changes no program).
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    emit = on_event or (lambda e: None)
    events: queue.Queue[Any] = queue.Queue()
    workers = [_Worker(i, spec, env, events) for i in range(n)]
    tasks: list[dict[str, Any]] | None = None
    pending: collections.deque[int] = collections.deque()
    results: dict[int, BuildResult] = {}
    alive = set(range(n))
    started: dict[int, float] = {}

    def dispatch() -> None:
        for w in workers:
            if w.wid in alive and w.task is None and not w.closed and tasks is not None:
                if pending:
                    w.task = pending.popleft()
                    started[w.task] = time.perf_counter()
                    emit(BuildEvent("started", len(tasks), tasks[w.task]))
                    w.send({"run": w.task})
                else:
                    w.close()

    try:
        while alive and (tasks is None or len(results) < len(tasks)):
            wid, msg = events.get()
            w = workers[wid]
            if msg is None:
                alive.discard(wid)
                if w.task is not None and tasks is not None:
                    t = tasks[w.task]
                    r = BuildResult(t["name"], t["signature"], FAILED,
                                    time.perf_counter() - started.get(w.task, time.perf_counter()),
                                    f"worker {wid} exited (rc={w.proc.wait()}): {w.tail()}", wid)
                    results[w.task] = r
                    emit(BuildEvent("finished", len(tasks), t, r))
                    w.task = None
                elif tasks is None and not alive:
                    raise BuildError(f"every build worker exited before listing the tasks; "
                                     f"the last one said:\n{w.tail()}")
                continue
            if "error" in msg:
                raise BuildError(f"{spec}: {msg['error']}")
            if "tasks" in msg:
                listed = msg["tasks"]
                if tasks is None:
                    tasks = listed
                    pending.extend(range(len(tasks)))
                    emit(BuildEvent("planned", len(tasks)))
                elif [(t["name"], t["signature"]) for t in listed] != \
                        [(t["name"], t["signature"]) for t in tasks]:
                    raise BuildError(f"{spec} listed different signatures in two workers; a "
                                     "build factory must return the same examples every time")
            elif "done" in msg and tasks is not None:
                i = int(msg["done"])
                r = BuildResult(tasks[i]["name"], tasks[i]["signature"], str(msg["status"]),
                                float(msg["seconds"]), str(msg.get("detail", "")), wid)
                results[i] = r
                w.task = None
                emit(BuildEvent("finished", len(tasks), tasks[i], r))
            dispatch()
        if tasks is None:
            raise BuildError("no build worker listed the tasks")
        for i in pending:
            t = tasks[i]
            results[i] = BuildResult(t["name"], t["signature"], FAILED, 0.0,
                                     "every worker exited before this signature was built")
        return [results[i] for i in range(len(tasks))]
    finally:
        for w in workers:
            w.stop()


def _worker_main(spec: str) -> int:
    # The protocol keeps the original stdout; the model's prints go to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        tasks = plan_factory(spec)
    except Exception as e:  # the parent reports it as the build's failure
        logger.debug("planning %s failed", spec, exc_info=True)
        send({"error": f"{type(e).__name__}: {e}"})
        return 2
    send({"tasks": [t.info() for t in tasks]})
    for line in sys.stdin:
        i = int(json.loads(line)["run"])
        r = run_task(tasks[i])
        send({"done": i, "status": r.status, "seconds": r.seconds, "detail": r.detail})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "worker":
        sys.stderr.write("usage: python -m cachecompile.build worker module:factory\n")
        return 2
    logging.basicConfig(level=os.environ.get("CACHECOMPILE_BUILD_LOG", "WARNING"))
    return _worker_main(args[1])


if __name__ == "__main__":
    # Run as `python -m cachecompile.build`, this file is __main__; the factory's
    # `from cachecompile import Call` imports it again as cachecompile.build. Hand over to
    # that module, so that one Call class is checked against.
    from cachecompile.build import main as _main

    sys.exit(_main())
