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
  compile slot each (:class:`cachecompile.procs.coop.CompileSlots`). The parent side
  (handing out tasks, reporting, ``--check``, the push to the remote) is
  :mod:`cachecompile.procs.builders`, which imports no torch; this module is the
  worker's side (``python -m cachecompile.build worker module:factory``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from cachecompile.cached import CachedFunction
from cachecompile.errors import (
    CacheFaultWarning,
    ContractError,
    OutOfGearWarning,
    SignatureLimitWarning,
)
from cachecompile.forms import CachedModule
from cachecompile.key import identity
from cachecompile.key.signature import Signature, describe, signature

# The parent side (torch-free): re-exported, as cachecompile.build has always named them.
from cachecompile.procs.builders import (  # noqa: F401
    BUILT,
    FAILED,
    NOT_CACHED,
    OK,
    PRESENT,
    BuildError,
    BuildEvent,
    BuildResult,
    Checked,
    OnEvent,
    Pushed,
    check_factory,
    list_factory,
    parse_spec,
    prebuild_factory,
    push_results,
)
from cachecompile.store import settings
from cachecompile.store.errors import StoreError
from cachecompile.store.keys import Key
from cachecompile.warm.lookup import MAX_VARIANTS, variant_key
from cachecompile.warm.state import store_for

logger = logging.getLogger(__name__)

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
    sig: Signature | None = dataclasses.field(default=None, repr=False)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "signature": self.signature}

    def entry_key(self) -> str:
        """The digest of the signature's first entry (variant 0): what a lookup reads
        first, and what ``cachectl build --check`` asks a tier for. "" if unkeyable.

        The method's base factors are computed on its first key, as serving computes
        them on its first call: a build asks only after the call (a call of another
        method before it may change the module's keyed attributes, as it does when
        serving); ``--check`` asks before any call."""
        first = self.first_key()
        return first.digest if first is not None else ""

    def first_key(self) -> Key | None:
        """The key of the signature's first entry, with its factors (``--check`` names
        the factors the tier's nearest entries differ in); None if unkeyable."""
        if self.sig is None:
            return None
        try:
            return variant_key(self.fn.key(self.sig), 0)
        except Exception:  # an unkeyable call: the build reports it when it runs
            logger.debug("no key for %s [%s]", self.name, self.signature, exc_info=True)
            return None

    def local_entries(self) -> tuple[str, ...]:
        """The digests of the signature's entries in this process's local store, in
        variant order (what a sharded build pushes to the remote tier)."""
        first = self.entry_key()
        if not first or self.sig is None:
            return ()
        try:
            st = store_for(self.fn.spec.cache_dir)
            local = getattr(st, "local", st)  # the tier's local store, not the remote
            sig_key = self.fn.key(self.sig)
            found: list[str] = []
            for i in range(MAX_VARIANTS):
                digest = variant_key(sig_key, i).digest
                if not local.contains(digest):
                    break  # variants fill from 0: the first gap ends the chain
                found.append(digest)
            return tuple(found)
        except (StoreError, OSError):
            logger.debug("listing the local entries of %s failed", self.name, exc_info=True)
            return ()


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
                tasks.append(Task(len(tasks), name, describe(sig), fn, a, k, sig))
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


def load_factory(spec: str) -> Callable[[], Any]:
    """``package.module:factory`` (the attribute may be dotted) -> the callable."""
    module_name, attr = parse_spec(spec)
    if "" not in sys.path and os.getcwd() not in sys.path:
        # As `python -m` and servers do: the factory's module is found from the cwd.
        sys.path.insert(0, os.getcwd())
    obj = identity.import_attr(module_name, attr)
    if not callable(obj):
        raise ContractError(f"{spec} is {type(obj).__qualname__}, not a callable")
    return obj


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
    status = BUILT if events and events[0] in ("miss", "shared") else PRESENT
    return BuildResult(task.name, task.signature, status, seconds, note, worker,
                       task.local_entries())


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


def _worker_main(spec: str, listing: bool = False) -> int:
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
    if listing:
        # `build --check`: each signature with its first entry's key and factors, and
        # nothing run.
        listed = []
        for t in tasks:
            first = t.first_key()
            listed.append({**t.info(), "key": first.digest if first is not None else "",
                           "factors": first.factors if first is not None else None})
        send({"tasks": listed})
        return 0
    send({"tasks": [t.info() for t in tasks]})
    for line in sys.stdin:
        i = int(json.loads(line)["run"])
        r = run_task(tasks[i])
        send({"done": i, "status": r.status, "seconds": r.seconds, "detail": r.detail,
              "entries": list(r.entries)})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("worker", "list"):
        sys.stderr.write("usage: python -m cachecompile.build worker|list module:factory\n")
        return 2
    logging.basicConfig(level=settings.BUILD_LOG.get())
    return _worker_main(args[1], listing=args[0] == "list")


if __name__ == "__main__":
    # Run as `python -m cachecompile.build`, this file is __main__; the factory's
    # `from cachecompile import Call` imports it again as cachecompile.build. Hand over to
    # that module, so that one Call class is checked against.
    from cachecompile.build import main as _main

    sys.exit(_main())
