"""The parent side of a build: worker processes that each import the factory, driven
from a process that never imports torch (``cachectl build``, ``build --check``).

* :func:`prebuild_factory` starts ``jobs`` workers (``python -m cachecompile.build
  worker module:factory``, :mod:`cachecompile.build`), hands out the signatures they list
  (with ``shard``, that shard's part: :mod:`cachecompile.key.shards`), one at a time
  to whichever is free, and collects one :class:`BuildResult` each; with ``cpu_target``,
  the workers build for that CPU target (``CACHECOMPILE_CPU_TARGET``,
  :mod:`cachecompile.key.cpu`);
* :func:`list_factory` has one worker list what the factory declares, and
  :func:`check_factory` asks the tier for each signature's first entry;
* :func:`push_results` uploads, and waits for, what the remote tier lacks of a build's
  entries.

A worker talks to its parent in JSON lines on its original stdout (anything the model
prints goes to its stderr): first ``{"tasks": [...]}`` (each with its name and
signature; or ``{"error": ...}``), then one ``{"done": i, ...}`` per ``{"run": i}`` it is
sent on stdin (with the digests of the entries that serve it); it exits at end of input.
Started as ``list``, it sends the tasks with their first entry's key, and exits.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from cachecompile.errors import BuildError, ContractError
from cachecompile.key import cpu
from cachecompile.key.shards import Shard, without_launcher
from cachecompile.procs.slots import default_slots
from cachecompile.store import open_store, settings
from cachecompile.store.errors import StoreNotFound
from cachecompile.store.remote import open_levels
from cachecompile.store.remote.push import Pushed, push_entries

logger = logging.getLogger(__name__)

# Outcomes of one signature.
BUILT = "built"            # compiled and published by this build
PRESENT = "present"        # the entry was there already (loaded, not compiled)
NOT_CACHED = "not cached"  # it ran, but with a live compile: no entry serves it
FAILED = "failed"          # the call raised
OK = (BUILT, PRESENT)


@dataclasses.dataclass
class BuildResult:
    name: str
    signature: str
    status: str                  # BUILT, PRESENT, NOT_CACHED or FAILED
    seconds: float
    detail: str = ""             # why not cached / failed; a note on the example
    worker: int | None = None
    # The local entries serving the signature (digests, variant order): what a build
    # with a remote tier makes sure the remote has (push_results).
    entries: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status in OK


@dataclasses.dataclass
class BuildEvent:
    """What a progress callback is told: ``planned`` (once), ``started``, ``finished``.
    ``declared`` (with ``planned``): the signatures the factory declares, every shard's."""

    kind: str
    total: int
    task: dict[str, Any] | None = None
    result: BuildResult | None = None
    declared: int | None = None


OnEvent = Callable[[BuildEvent], None]


def parse_spec(spec: str) -> tuple[str, str]:
    """``package.module:factory`` -> (module, attribute path); ContractError otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ContractError(f"{spec!r} is not module:factory (e.g. myapp.serving:build_model)")
    return module_name, attr


# -- the workers ----------------------------------------------------------------------------
class _Worker:
    def __init__(self, wid: int, spec: str, env: dict[str, str], events: queue.Queue[Any],
                 mode: str = "worker") -> None:
        self.wid = wid
        self.log: IO[bytes] = tempfile.TemporaryFile(prefix="cachectl-build-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachecompile.build", mode, spec],
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
_EXIT_GRACE = settings.REMOTE_FLUSH_TIMEOUT.get() + 10.0


def _worker_env(n: int, cache_dir: str | None, shard: Shard | None,
                cpu_target: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    if cache_dir is not None:
        env[settings.DIR.name] = str(Path(cache_dir).resolve())
    if cpu_target is not None:
        # The workers' cache_compile builds for it and keys by it (key.cpu); a listing
        # worker's keys are then that target's keys, which build --check asks for.
        env[cpu.ENV] = cpu_target
    if n > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in env:
        # The workers are the parallelism: Inductor's own pool of compile processes (one
        # per core, in every worker) would oversubscribe the cores n times over and cost
        # each worker the pool's start-up. Not a key factor (it changes no program).
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    if shard is not None and shard.hides_launcher():
        # torchrun's RANK / WORLD_SIZE said which shard this is; in the factory they would
        # say which rank each entry is for (a key factor): shard 3 of 8 would build rank 3
        # of 8's entries, which no single-process server looks up.
        env = without_launcher(env)
    return env


def prebuild_factory(spec: str, *, jobs: int | None = None, cache_dir: str | None = None,  # noqa: C901 (today's exception: the factory's forms and the pool's outcomes)
                     on_event: OnEvent | None = None,
                     shard: Shard | None = None,
                     cpu_target: str | None = None) -> list[BuildResult]:
    """Build every signature the factory ``spec`` (``module:callable``) lists, in ``jobs``
    worker processes (default: the node's compile slots), or with ``shard``, the
    signatures of that shard only (:mod:`cachecompile.key.shards`); for ``cpu_target`` if
    given (``CACHECOMPILE_CPU_TARGET`` in the workers; the caller checks it against this
    CPU first, :func:`cachecompile.key.cpu.build_targets`). Returns one result per
    signature built, in the factory's order. Raises :class:`BuildError` if the factory
    fails in a worker, two workers list different tasks, or every worker dies."""
    parse_spec(spec)  # a usage error before any worker starts
    n = jobs if jobs is not None else default_slots()
    if n < 1:
        raise ContractError(f"jobs must be >= 1, got {n}")
    env = _worker_env(n, cache_dir, shard, cpu_target)
    emit = on_event or (lambda e: None)
    events: queue.Queue[Any] = queue.Queue()
    workers = [_Worker(i, spec, env, events) for i in range(n)]
    tasks: list[dict[str, Any]] | None = None
    mine: list[int] = []  # the indexes of the tasks this build (this shard) builds
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
                    emit(BuildEvent("started", len(mine), tasks[w.task]))
                    w.send({"run": w.task})
                else:
                    w.close()

    try:
        while alive and (tasks is None or len(results) < len(mine)):
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
                    emit(BuildEvent("finished", len(mine), t, r))
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
                    mine = [i for i, t in enumerate(listed)
                            if shard is None or shard.holds(t["name"], t["signature"])]
                    pending.extend(mine)
                    emit(BuildEvent("planned", len(mine), declared=len(listed)))
                elif [(t["name"], t["signature"]) for t in listed] != \
                        [(t["name"], t["signature"]) for t in tasks]:
                    raise BuildError(f"{spec} listed different signatures in two workers; a "
                                     "build factory must return the same examples every time")
            elif "done" in msg and tasks is not None:
                i = int(msg["done"])
                r = BuildResult(tasks[i]["name"], tasks[i]["signature"], str(msg["status"]),
                                float(msg["seconds"]), str(msg.get("detail", "")), wid,
                                tuple(str(d) for d in msg.get("entries", ())))
                results[i] = r
                w.task = None
                emit(BuildEvent("finished", len(mine), tasks[i], r))
            dispatch()
        if tasks is None:
            raise BuildError("no build worker listed the tasks")
        for i in pending:
            t = tasks[i]
            results[i] = BuildResult(t["name"], t["signature"], FAILED, 0.0,
                                     "every worker exited before this signature was built")
        return [results[i] for i in mine]
    finally:
        for w in workers:
            w.stop()


def list_factory(spec: str, *, cache_dir: str | None = None,
                 shard: Shard | None = None,
                 cpu_target: str | None = None) -> list[dict[str, Any]]:
    """What the factory declares (``name``, ``signature``, ``key``: the digest of its first
    entry, ``factors``: that key's), listed by one worker process as a build lists it,
    compiling nothing; with ``shard``, that shard's part only; with ``cpu_target``, the
    keys of that target's entries."""
    return [t for t in _listed(spec, cache_dir, shard, cpu_target)
            if shard is None or shard.holds(t["name"], t["signature"])]


def _listed(spec: str, cache_dir: str | None, shard: Shard | None,
            cpu_target: str | None) -> list[dict[str, Any]]:
    """Every signature the factory declares (every shard's), listed by one worker run
    with ``shard``'s environment."""
    parse_spec(spec)
    events: queue.Queue[Any] = queue.Queue()
    w = _Worker(0, spec, _worker_env(1, cache_dir, shard, cpu_target), events, mode="list")
    try:
        while True:
            _, msg = events.get()
            if msg is None:
                raise BuildError(f"the worker listing {spec} exited (rc={w.proc.wait()}):\n"
                                 f"{w.tail()}")
            if "error" in msg:
                raise BuildError(f"{spec}: {msg['error']}")
            if "tasks" in msg:
                # It ran nothing and has nothing to upload: no need to wait for a torch
                # process's teardown (a second or more).
                w.proc.kill()
                return list(msg["tasks"])
    finally:
        w.stop()


@dataclasses.dataclass(frozen=True)
class Cause:
    """A likely cause of ``--check``'s misses that a user can act on: ``advice`` (what
    differs and what to do), how many of the missing signatures it sets apart
    (``count`` of ``of``), and its factors as the first of those signatures' nearest
    entry has them, ``{factor: [here, there]}`` (``nearest["differ"]``'s shape)."""

    advice: str
    count: int
    of: int
    differ: dict[str, list[Any]]


@dataclasses.dataclass
class Checked:
    """What ``cachectl build --check`` found: each declared signature (of the shard), there
    or not; ``declared``: the factory's signatures, every shard's. A missing signature
    carries ``nearest`` where the tier has entries of its method: the tier's entry most
    like it, ``{"key", "differ": {factor: [here, there]}}`` (the factors they differ in,
    with this check's value and the entry's); ``causes`` names the likely causes of the
    misses where those factors say one (:func:`likely_causes`). ``cachectl build`` prints
    both (cachecompile.cli.build)."""

    tier: str                                  # the store asked (the remote, or the local)
    present: list[dict[str, Any]]
    missing: list[dict[str, Any]]
    declared: int = 0
    causes: list[Cause] = dataclasses.field(default_factory=list)


# The entries ``--check`` reads to explain what is missing: one manifest each (a GET on S3,
# eight in flight); a bigger tier is explained from these.
EXPLAIN_LIMIT = 10_000
# Factors (dotted paths, a prefix ending in ".") that name a cause a user can act on, as
# builds run somewhere else than the serving processes (torchrun, another image) miss it.
_CAUSES = (
    ("the thread count (OMP_NUM_THREADS, torch.set_num_threads); torchrun sets "
     "OMP_NUM_THREADS=1 when it starts several processes per node: build with the serving "
     "processes' count",
     ("backend.num_threads", "backend.env.OMP_NUM_THREADS")),
    ("the C++ compiler (CXX): build with the compiler the serving processes use, at the "
     "same path",
     ("backend.compiler.", "backend.env.CXX", "backend.env.CC")),
)


def likely_causes(missing: Sequence[dict[str, Any]]) -> list[Cause]:
    """What the missing signatures' nearest entries differ in that a user can fix: one
    :class:`Cause` per cause, with how many signatures it sets apart and its factors'
    values on both sides."""
    out: list[Cause] = []
    for advice, paths in _CAUSES:
        hit = [t for t in missing if any(_under(d, paths) for d in (t.get("nearest") or {})
                                         .get("differ", {}))]
        if hit:
            differ = hit[0]["nearest"]["differ"]
            out.append(Cause(advice, len(hit), len(missing),
                             {d: v for d, v in differ.items() if _under(d, paths)}))
    return out


def _under(path: str, paths: Sequence[str]) -> bool:
    return any(path == p or (p.endswith(".") and path.startswith(p)) for p in paths)


def _nearest(factors: dict[str, Any], candidates: Sequence[tuple[str, dict[str, Any]]]
             ) -> dict[str, Any] | None:
    """The candidate (key, factors) with the fewest differing factors, those of the same
    signature first (the rule of ``cachectl explain``, :func:`~cachecompile.store.explain.
    closest`): ``{"key", "differ": {factor: [here, there]}}``."""
    from cachecompile.store.explain import closest, flatten

    same = [c for c in candidates if c[1].get("signature") == factors.get("signature")]
    near = closest(factors, same or candidates)
    if near is None:
        return None
    fo, ft = flatten(factors), flatten(dict(candidates)[near.key])
    return {"key": near.key, "differ": {d: [fo.get(d), ft.get(d)] for d in near.differ}}


def check_factory(spec: str, *, cache_dir: str | None = None,
                  shard: Shard | None = None,
                  cpu_target: str | None = None) -> Checked:
    """Which of the factory's signatures (``shard``'s, if given) the shared tier lacks:
    the remote tier if ``$CACHECOMPILE_REMOTE`` names one, else the local store; with
    ``cpu_target``, that target's entries (checked against this CPU first, as for a build:
    a CPU that lacks the level cannot key its entries).

    A signature is there when the tier holds its first entry (variant 0); nothing is
    loaded, so no guard is checked (``cachectl build`` does that, and says ``present``)."""
    listed = _listed(spec, cache_dir, shard, cpu_target)
    tasks = [t for t in listed if shard is None or shard.holds(t["name"], t["signature"])]
    url = settings.REMOTE.get()
    has: Callable[[str], bool]
    entries: Callable[[], Iterator[tuple[str, dict[str, Any]]]]
    if url:
        # A chain of levels: a signature is there if any level has it (a serving node
        # looks in each in turn).
        levels = open_levels(url)
        for remote in levels:
            remote.breaker.quiet = True  # a failure is the check's error, not a warning too
            remote.ping()
        tier = ", ".join(r.config.display for r in levels)

        def has(digest: str) -> bool:
            return any(r.contains(digest) for r in levels)

        def entries() -> Iterator[tuple[str, dict[str, Any]]]:
            # Every level's records, nearest level first (a serving node's lookup order).
            return ((rec.key, dict(rec.manifest.get("factors") or {}))
                    for r in levels for rec in r.records())
    else:
        try:
            local = open_store(cache_dir, remote="", create=False).maintenance()
        except StoreNotFound:
            tier, has = f"{cache_dir or '$CACHECOMPILE_DIR'} (no store there)", lambda d: False

            def entries() -> Iterator[tuple[str, dict[str, Any]]]:
                return iter(())
        else:
            tier, has = f"the local store at {local.root}", local.contains

            def entries() -> Iterator[tuple[str, dict[str, Any]]]:
                return ((i.key, dict(local.manifest(i.key).get("factors") or {}))
                        for i in local.entries())
    out = Checked(tier, [], [], declared=len(listed))
    for t in tasks:
        (out.present if t["key"] and has(t["key"]) else out.missing).append(t)
    if out.missing:
        _explain_missing(out, entries)
    return out


def _explain_missing(out: Checked,
                     entries: Callable[[], Iterator[tuple[str, dict[str, Any]]]]) -> None:
    """Give each missing signature its nearest entry in the tier (of the same method:
    its function's qualified name and module), among the first :data:`EXPLAIN_LIMIT`
    entries read, and ``out`` the likely causes. A failure to read the tier's entries
    only leaves the check without them."""
    try:
        every = list(itertools.islice(entries(), EXPLAIN_LIMIT))
    except Exception as e:  # the answer (what is missing) stands without the explanation
        logger.warning("could not read the tier's entries to explain the missing "
                       "signatures: %s", e)
        return
    by_method: dict[str, list[tuple[str, dict[str, Any]]]] = collections.defaultdict(list)
    for key, factors in every:
        by_method[_method_of(factors)].append((key, factors))
    for t in out.missing:
        ours = t.get("factors")
        if not isinstance(ours, dict):
            continue
        near = _nearest(ours, by_method.get(_method_of(ours), []))
        if near is not None:
            t["nearest"] = near
    out.causes = likely_causes(out.missing)


def _method_of(factors: dict[str, Any]) -> str:
    f = factors.get("function")
    return f"{f.get('module')}.{f.get('qualname')}" if isinstance(f, dict) else ""


def push_results(results: Sequence[BuildResult], *,
                 cache_dir: str | None = None) -> Pushed | None:
    """Make sure the remote tier (``$CACHECOMPILE_REMOTE``) has every entry that serves a
    built or present signature of ``results``; None without a (writable) remote.

    The workers upload what they publish in the background, but a worker waits at most
    ``CACHECOMPILE_REMOTE_FLUSH_TIMEOUT`` for its uploads, and a build killed before that
    leaves entries only in its local store: run again, it finds them there (``present``)
    and would never upload them. This uploads whatever the remote still lacks, in this
    process, waiting for each (an entry there already costs one read), through the loop
    ``cachectl push`` runs (:func:`cachecompile.store.remote.push.push_entries`): a
    record the remote kept rather than take ours is counted apart, as refused."""
    url = settings.REMOTE.get()
    digests = list(dict.fromkeys(d for r in results if r.ok for d in r.entries))
    if not url:
        return None
    # A chain: every writable level gets them; what is reported is the farthest level's
    # (the fleet-wide one, as a rule), the nearer ones are filled first.
    writable = [r for r in open_levels(url) if not r.readonly]
    if not writable:
        return None
    for remote in writable:
        remote.breaker.quiet = True
    if not digests:
        return Pushed(writable[-1].config.display)
    local = open_store(cache_dir, remote="", create=False).maintenance()
    # repair (the default), as `cachectl push` does: a builder with the fleet's key
    # replaces a record that does not verify under it (nodes would refuse that one).
    for remote in writable[:-1]:
        push_entries(remote, local, digests, keep_going=True)
    return push_entries(writable[-1], local, digests, keep_going=True)
