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

JSON = Any
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
    """A compile path. Implementations live in this package, one module each."""

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
