"""Cooperation between processes that share a node's cache (ranks of one job, replicas).

* :func:`held` takes a named store lock, and while it waits it says for whom (the
  holder writes an ``.owner`` note beside the lock file) and gives up after a timeout
  with an error naming the lock and the holder. A holder that dies (even by SIGKILL)
  releases its flock with its process, so the next waiter proceeds.
* :class:`CompileSlots` bounds the compiles running at once on a node: K lock files
  ``compile-slot-<i>``; a compiler holds one for the duration of its backend compile.
* :func:`graph_digest` identifies a Dynamo graph for sharing its compiled program
  between ranks: the graph's code, its tensor constants and the metadata of its
  example inputs (shapes with their size hints, strides, dtypes, devices).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import xxhash

from cachecompile._torch import dynamo, runtime
from cachecompile.backends.base import Adapter, Compiled, Program
from cachecompile.entry import writer
from cachecompile.entry.meta import EntryMeta
from cachecompile.procs.poll import poll
from cachecompile.procs.slots import default_slots
from cachecompile.store import Hit, Key, make_key, settings
from cachecompile.store.errors import LockTimeout, StoreError
from cachecompile.store.index import GRAPH_SCOPE
from cachecompile.store.protocol import LocalStorage, Locking

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = settings.LOCK_TIMEOUT.default
_POLL = 0.2
_REPORT_EVERY = 30.0


def lock_timeout() -> float:
    return settings.LOCK_TIMEOUT.get()


def _owner_path(lock_path: Path) -> Path:
    return lock_path.with_suffix(".owner")


def describe_owner(lock_path: Path) -> str:
    try:
        info = json.loads(_owner_path(lock_path).read_text())
    except (OSError, ValueError):
        return "an unknown process"
    held = time.time() - float(info.get("since", time.time()))
    return (f"pid {info.get('pid')} on {info.get('host')} ({info.get('who', '?')}, "
            f"{info.get('purpose', '?')}, for {held:.0f}s)")


def _write_owner(lock_path: Path, who: str, purpose: str) -> None:
    try:
        tmp = lock_path.with_suffix(f".owner.{os.getpid()}")
        tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                   "who": who, "purpose": purpose, "since": time.time()}))
        os.replace(tmp, _owner_path(lock_path))
    except OSError:
        logger.debug("could not record lock owner", exc_info=True)


@contextlib.contextmanager
def held(st: Locking, name: str, *, who: str, purpose: str,
         timeout: float | None = None) -> Iterator[Path | None]:
    """Hold store lock ``name``; while waiting, log who holds it. LockTimeout after timeout.
    Gives the lock file, or None from a store with nothing to lock (a read-only one)."""
    limit = lock_timeout() if timeout is None else timeout
    waiting_on: list[Path] = []  # the lock file, once an attempt timed out on it

    def attempt(left: float) -> tuple[AbstractContextManager[Path | None], Path | None] | None:
        # Short tries, not one long one: between them, say who holds the lock.
        try:
            cm = st.lock(name, timeout=min(_POLL * 5, left))
            return cm, cm.__enter__()
        except LockTimeout as e:
            waiting_on[:] = [e.path]
            return None

    cm, path = poll(
        attempt, timeout=limit, interval=0, report_every=_REPORT_EVERY,
        expired=lambda _: LockTimeout(waiting_on[0], limit),
        report=lambda _: logger.info("%s waits for %s held by %s", who, purpose,
                                     describe_owner(waiting_on[0])))
    try:
        if path is not None:
            _write_owner(path, who, purpose)
        yield path
    finally:
        cm.__exit__(None, None, None)


class CompileSlots:
    """At most ``n`` compiles at once per store root (per node, for a local store)."""

    def __init__(self, st: Locking, n: int | None = None) -> None:
        self._st = st
        self.n = n if n is not None else default_slots()

    @contextlib.contextmanager
    def slot(self, who: str, timeout: float | None = None) -> Iterator[int]:
        limit = lock_timeout() if timeout is None else timeout

        def attempt(_: float) -> tuple[int, AbstractContextManager[Path | None], Path | None] | None:
            for i in range(self.n):
                try:
                    cm = self._st.lock(f"compile-slot-{i}", timeout=0)
                    return i, cm, cm.__enter__()
                except LockTimeout:
                    continue
            return None

        i, cm, path = poll(
            attempt, timeout=limit, interval=_POLL, report_every=_REPORT_EVERY,
            expired=lambda _: StoreError(
                f"{who} waited {limit:g}s for one of {self.n} compile slots "
                "(CACHECOMPILE_COMPILE_SLOTS); raise it or the lock timeout"),
            report=lambda _: logger.info("%s waits for one of %d compile slots", who, self.n))
        try:
            if path is not None:
                _write_owner(path, who, "a compile slot")
            yield i
        finally:
            cm.__exit__(None, None, None)


def _meta(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        def dim(s: Any) -> str:
            hint = dynamo.size_hint(s)
            return f"{s}~{hint}" if hint is not None else str(s)

        return (f"T({','.join(dim(s) for s in x.shape)};{','.join(dim(s) for s in x.stride())};"
                f"{x.dtype};{x.device};{x.requires_grad})")
    if isinstance(x, torch.SymInt):
        return f"S({x}~{dynamo.size_hint(x)})"
    return f"V({x!r})"


def graph_digest(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    h = xxhash.xxh3_128()
    h.update(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                h.update(f"{node.target}:{_meta(value)}".encode())
                flat = value.detach().cpu().contiguous().view(-1)
                h.update(bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b"")
            else:
                h.update(f"{node.target}:{value!r}".encode())
    for x in example_inputs:
        h.update(_meta(x).encode())
        h.update(b";")
    # What AOTAutograd makes of the same graph depends on the global state it compiles
    # under: grad mode (a training graph's forward and backward, or an inference graph)
    # and autocast (its casts are baked into the program).
    h.update(runtime.global_state().encode())
    return h.hexdigest()


# "input_marks" is present only when an input is marked (see signature.input_marks), and
# "frozen_state" only under freezing (the weights a frozen program holds: the graph's
# code and its inputs' metadata are the same for other weights), so other graphs keep
# their keys.
GRAPH_FACTORS = ("backend", "config", "dynamic", "decompositions", "versions", "device",
                 "torch_flags", "compiler_config", "input_marks", "frozen_state")


class GraphShare:
    """One compile per identical graph on a node.

    Inside the Dynamo backend: hash the graph, take the graph's lock (waiting ranks block
    here), then either load the program another process published for this graph, or
    compile it within a compile slot. The lock is held until :meth:`finish`, after the
    compiling process verified and published the program, so a waiter never sees an
    unverified one.
    """

    def __init__(self, st: LocalStorage, factors: Mapping[str, Any], adapter: Adapter,
                 who: str, model: str | None = None) -> None:
        self._st = st
        # The model that published it, as a label: ``cachectl purge --model`` (local or
        # remote) then retires a model's shared programs with its entries.
        self._labels = {"kind": "graph", **({"model": model} if model else {})}
        self._factors = {k: factors[k] for k in GRAPH_FACTORS if k in factors}
        self._adapter = adapter
        self._who = who
        # The graph's lock: taken inside Dynamo's backend callback (compile), released by
        # finish once the program is verified and published (the miss path's ExitStack
        # calls it), or as soon as a published program was loaded.
        self._held = contextlib.ExitStack()
        self._locked = False
        self.key: Key | None = None
        self.shared = False      # the program came from another process
        self.compiled = False    # this process compiled it

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                compile_fn: Callable[[], Compiled], publish_now: bool = False,
                state: Mapping[str, Any] | None = None) -> Compiled:
        """Load or compile the graph's program. ``publish_now``: share it and release
        the lock before the first call (graphs with collectives: a rank holding the
        lock through a call would wait in the collective for ranks waiting on the lock).
        ``state``: the global state the graph was traced under (autocast, grad mode,
        default dtype, function modes, default device): Dynamo's graph does not show it,
        but AOTAutograd and the backend compile under it (autocast's casts), so a program
        is shared only between traces under the same state.
        """
        digest = graph_digest(gm, example_inputs)
        key = make_key({"kind": "graph", "graph": digest, **self._factors,
                        **({"state": dict(state)} if state else {})})
        if self._locked and self.key is not None and key.digest != self.key.digest:
            self.finish()  # Dynamo restarted analysis and produced another graph
        self.key = key
        if not self._locked:  # held already if Dynamo restarted analysis on this graph
            try:
                self._held.enter_context(held(self._st, f"graph-{key.digest}", who=self._who,
                                              purpose=f"graph {key.digest[:12]}"))
                self._locked = True
            except (StoreError, OSError) as e:
                logger.warning("%s: no shared compile for graph %s (%s); compiling alone",
                               self._who, key.digest[:12], e)
                return compile_fn()
        try:
            outcome = self._st.get(self.key)
            if not isinstance(outcome, Hit):
                self._st.record_miss(GRAPH_SCOPE + outcome.kind)
        except (StoreError, OSError):
            outcome = None
        if isinstance(outcome, Hit):
            try:
                record = EntryMeta.from_json(outcome.entry.meta)
                meta = dict(record.program)
                light = self._adapter.load(outcome.entry.files, meta)
                program = Program(files=dict(outcome.entry.files), meta=meta, light=light,
                                  mutated_inputs=tuple(meta.get("mutated_inputs", ())))
                self.shared = True
                by = record.publisher
                here = by.get("pid") == os.getpid() and by.get("host") == socket.gethostname()
                logger.info("%s: graph %s was compiled %s; loaded it", self._who,
                            self.key.digest[:12],
                            "earlier in this process" if here
                            else f"by {by.get('who')}" if by else "by another process")
                # Nothing left to publish: let the next waiter in now (holding on through
                # the first call would deadlock ranks whose graph has collectives).
                self.finish()
                return Compiled(live=light, program=lambda: program)
            except Exception:  # a bad shared program: compile our own
                logger.warning("%s: shared program for graph %s does not load; compiling",
                               self._who, self.key.digest[:12], exc_info=True)
        with CompileSlots(self._st).slot(self._who):
            compiled = compile_fn()
        self.compiled = True
        if publish_now:
            try:
                program = compiled.program()
            except Exception:  # not replayable: others compile themselves
                logger.debug("program capture failed", exc_info=True)
                self.finish()
                return compiled
            self.publish(program)
            self.compiled = False  # published; finish() must not publish again
            self.finish()
            return Compiled(live=compiled.live, program=lambda: program)
        return compiled

    def publish(self, program: Program) -> None:
        """After verification: make this process's program available to the others."""
        if not self.compiled or self.key is None or not self._locked:
            return
        try:
            writer.write(self._st, self.key, program.files,
                         meta=EntryMeta(adapter=self._adapter.name, program=program.meta),
                         who=self._who, function="(shared graph)", labels=self._labels)
        except (StoreError, OSError) as e:
            logger.warning("%s: could not share graph %s (%s)", self._who,
                           self.key.digest[:12], e)

    def finish(self) -> None:
        """Release the graph's lock (the next waiting rank loads what was published)."""
        self._locked = False
        self._held.close()
