"""The compile-path protocol: one adapter per backend (torch's private names stay in
``cachecompile._torch``, for adapters as for the rest).

An adapter turns a Dynamo graph into two things at once:

* a *live* callable that Dynamo runs in the compiling process, and
* a :class:`Program`: files plus JSON metadata that a fresh process turns back into a
  callable with :meth:`Adapter.load`, without Dynamo, AOTAutograd or any compiler.

The program's callable takes the flat graph inputs (parameters, buffers, user inputs and
symbolic sizes, in Dynamo's placeholder order) and returns the graph's output tuple, the
contract Dynamo's transformed bytecode expects of ``__compiled_fn_*``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from cachecompile.store.jsonvalue import JSON

GraphCallable = Callable[..., Any]


def package_version(dist: str) -> str | None:
    """An installed distribution's version, without importing it (cheap on the warm path)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass
class Program:
    """What a backend produced for one graph, ready to be stored."""

    files: dict[str, bytes | Path]
    meta: dict[str, JSON]
    # The callable the warm path would build from ``files``; used to verify the program
    # against the live compile before anything is published.
    light: GraphCallable | None = None
    mutated_inputs: tuple[int, ...] = ()


@dataclasses.dataclass
class Compiled:
    """The result of compiling one Dynamo graph."""

    live: GraphCallable
    # Builds the Program lazily: capture can be costly and is skipped when caching is off.
    program: Callable[[], Program]


class Adapter(Protocol):
    """A compile path. Implementations live in this package, one module each; a vendor's
    lives in its own package (docs/usage.md, "A backend as a plugin").

    The members above "optional capabilities" are required (:data:`REQUIRED` is read from
    this class). The optional ones have their defaults here, as vLLM's
    ``CompilerInterface`` has: an adapter that subclasses this protocol inherits them, and
    one that does not gets them through :func:`capability`.
    """

    name: str
    # Whether ranks share one compile of an identical graph (coop.GraphShare). Worth it
    # where compiling costs seconds; a cheap backend compiles its own.
    shares_graphs: bool
    # The parts of torch's internals (cachecompile._torch.DYNAMO, INDUCTOR) its compile
    # uses: probed before a cold compile; a missing name turns the cache off.
    torch_parts: tuple[str, ...]

    def factors(self, options: Mapping[str, Any]) -> dict[str, JSON]:
        """Key factors that decide whether this backend's artifacts fit this machine."""
        ...

    def compile(self, gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any],
                decompositions: Mapping[Any, Any] | None) -> Compiled:
        """Compile a Dynamo graph (runs inside Dynamo's backend callback)."""
        ...

    def load(self, files: Mapping[str, Path], meta: Mapping[str, JSON]) -> GraphCallable:
        """Rebuild the graph callable from a stored program, in a fresh process."""
        ...

    def plain_backend(self, options: Mapping[str, Any], decompositions: Mapping[Any, Any] | None
                      ) -> tuple[Any, dict[str, Any] | None]:
        """``(backend, options)`` for plain ``torch.compile`` through public API only: the
        path when torch's internals are not what cachecompile expects."""
        ...

    # -- optional capabilities (OPTIONAL), with their defaults ---------------------------
    def make_options(self, config: Any) -> Mapping[str, Any]:
        """``cache_compile(config=...)`` as this backend's options (the ``config`` key
        factor). Default: a dict of options, or none."""
        if config is None:
            return {}
        if isinstance(config, Mapping):
            return dict(config)
        raise TypeError(f"config for backend {self.name!r} must be a dict of options, got "
                        f"{type(config).__qualname__}")

    def freezes(self, options: Mapping[str, Any]) -> bool:
        """Whether the program holds the module's weights (Inductor's ``freezing``): then
        their content is a key factor. Default: it does not."""
        return False

    def cpu_target(self, options: Mapping[str, Any], target: str) -> Mapping[str, Any] | None:
        """``options`` that build for the named CPU target ``target`` (``native`` or a
        level of :mod:`cachecompile.key.cpu`), whose name :meth:`factors` then puts in the
        key in place of this CPU's model and flags. Default None: this backend has no CPU
        targets (its programs hold no code built for this CPU, or it cannot choose)."""
        return None

    def with_passes(self, options: Mapping[str, Any], passes: Any) -> Mapping[str, Any]:
        """``options`` with ``cache_compile(passes=...)`` (custom compiler passes by hook,
        or None) merged in and checked; TypeError / ValueError say what is wrong. Default:
        this backend runs no custom passes, so any are refused."""
        if passes is None:
            return options
        raise ValueError(f"passes= are Inductor's custom pass hooks; the {self.name!r} "
                         "backend does not run them")

    def trains(self) -> bool:
        """Whether a call that needs autograd is cached (its graphs' forward and backward
        programs, joined by :mod:`cachecompile.backends.joint`). Default: inference only;
        such a call then runs under ``no_grad`` or is refused (``InferenceOnlyError``)."""
        return False

    def default_cache_dir(self) -> str | None:
        """The cache dir when ``cache_compile`` names none: a backend's own convention (a
        drop-in keeps its users' caches where they were). Default None: cachecompile's."""
        return None


# The optional capabilities: defined with a default on Adapter.
OPTIONAL = ("make_options", "freezes", "cpu_target", "with_passes", "trains",
            "default_cache_dir")
# Everything else the protocol names is required.
REQUIRED = tuple(sorted(
    {*Adapter.__annotations__,
     *(n for n, v in vars(Adapter).items() if callable(v) and not n.startswith("_"))}
    - set(OPTIONAL)))


def missing(obj: Any) -> list[str]:
    """The required members of the protocol ``obj`` lacks."""
    return [a for a in REQUIRED if not hasattr(obj, a)]


def capability(adapter: Any, name: str) -> Callable[..., Any]:
    """The adapter's optional capability ``name``, or the protocol's default bound to it."""
    if name not in OPTIONAL:
        raise AttributeError(f"{name} is not an optional capability of an adapter")
    own = getattr(adapter, name, None)
    if own is not None:
        return own
    default: Callable[..., Any] = getattr(Adapter, name).__get__(adapter)
    return default
