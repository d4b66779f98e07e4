"""An entry's meta, typed: the one record the writer writes and every reader reads.

The store keeps an entry's meta as JSON in its manifest (covered by the manifest's
integrity digest). :class:`EntryMeta` is that JSON's only spelling: ``entry.writer``
writes ``to_json()``, and the warm lookup, the shared-graph loader (``procs.coop``) and
``cachectl`` (``show``, ``program``) read it back with :meth:`EntryMeta.from_json`, never
by string keys. ``program`` stays the adapter's own record (each adapter's ``load`` reads
what its ``compile`` wrote).

A change of what is stored is one bump of :data:`FORMAT_VERSION` (the key holds it, as
``versions.format``): a record of another format is refused by name here, so a lookup
reports it as a ``format`` miss, never a half-read entry. Torch-free and import-light:
``cachectl`` reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from cachecompile._version import ENTRY_FORMAT as FORMAT_VERSION
from cachecompile.errors import UnsupportedProgramError
from cachecompile.store.jsonvalue import JSON


def _field(kind: type | tuple[type, ...], default: Any = dataclasses.MISSING,
           factory: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"kind": kind})


@dataclasses.dataclass(frozen=True)
class EntryMeta:
    """What an entry holds beside its files.

    Every entry has the first four; a method's entry (not a shared graph's program) has
    the rest."""

    adapter: str = _field(str, default="")              # the backend adapter that loads it
    program: Mapping[str, JSON] = _field(dict, factory=dict)   # the adapter's own record
    publisher: Mapping[str, JSON] = _field(dict, factory=dict)  # who, pid, host
    format: int = _field(int, default=FORMAT_VERSION)
    # A method's entry: how the warm path rebuilds and checks it.
    imports: Mapping[str, str] = _field(dict, factory=dict)  # bytecode global -> module
    consts: Sequence[JSON] = _field(list, factory=list)       # rebuilt bytecode constants
    compiled_fn: str = _field(str, default="")               # the graph's global name
    deps: Mapping[str, str] = _field(dict, factory=dict)      # traced file -> content hash
    guards: Sequence[Mapping[str, JSON]] = _field(list, factory=list)  # portable guards
    checker: Mapping[str, JSON] = _field(dict, factory=dict)  # the checker, ready to load
    # A method whose graph breaks (fullgraph=False, entry.frame_records): the resume functions
    # its bytecode calls (__resume_at_* -> frame id), every other frame Dynamo compiled
    # for the call, and the graphs of those frames (the adapter's record each).
    resumes: Mapping[str, str] = _field(dict, factory=dict)
    frames: Sequence[Mapping[str, JSON]] = _field(list, factory=list)
    graphs: Sequence[Mapping[str, JSON]] = _field(list, factory=list)
    # A frame variant's entry (a frame compiled after the signature's first call, under
    # the signature's key plus the frame's id): the id of the frame, ``frames[0]``, whose
    # one variant it holds; the other records are the resume frames that variant calls.
    head: str = _field(str, default="")
    # What it cost and served, for people (cachectl show).
    signature: str = _field(str, default="")
    compile_seconds: float | None = _field((int, float, type(None)), default=None)
    first_call_seconds: float | None = _field((int, float, type(None)), default=None)
    cold_phases: Mapping[str, float] = _field(dict, factory=dict)

    @property
    def is_method(self) -> bool:
        """A method's entry (bytecode, guards), not a shared graph's program alone. (A
        method whose graph breaks before any graph has no ``compiled_fn``, but frames.)"""
        return bool(self.compiled_fn) or bool(self.frames)

    @property
    def n_frames(self) -> int:
        """How many frames the entry holds: the method's own and every other one."""
        return 1 + len(self.frames) if self.is_method else 0

    def to_json(self) -> dict[str, JSON]:
        """The manifest's ``meta``: plain JSON, the fields a method entry does not use
        left out of a shared graph's."""
        out: dict[str, JSON] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _ALWAYS or v != _default(f):
                out[f.name] = dict(v) if isinstance(v, Mapping) else (
                    list(v) if isinstance(v, (list, tuple)) else v)
        return out

    @classmethod
    def from_json(cls, meta: Mapping[str, JSON], *, any_format: bool = False) -> EntryMeta:
        """Read a manifest's ``meta``; UnsupportedProgramError naming what does not fit
        (another format, a field of the wrong type), which a lookup reports as a miss.

        ``any_format``: for showing an entry (``cachectl``), not for running it: a record
        of another format, or lacking core fields, reads with what it has."""
        if not isinstance(meta, Mapping):
            raise UnsupportedProgramError("the entry's meta is not a mapping")
        fmt = meta.get("format")
        if fmt != FORMAT_VERSION and not any_format:
            raise UnsupportedProgramError(
                f"entry format {fmt!r}, not {FORMAT_VERSION}: written by another release")
        values: dict[str, Any] = {}
        if any_format and not isinstance(fmt, int):
            values["format"] = -1
        for f in dataclasses.fields(cls):
            if f.name not in meta or (f.name == "format" and "format" in values):
                if f.name in _ALWAYS and not any_format:
                    raise UnsupportedProgramError(f"the entry's meta has no {f.name!r}")
                continue
            v = meta[f.name]
            kind = f.metadata["kind"]
            if not isinstance(v, kind) or isinstance(v, bool):
                raise UnsupportedProgramError(
                    f"the entry's meta field {f.name!r} is a {type(v).__name__}")
            values[f.name] = v
        return cls(**values)


_ALWAYS = ("format", "adapter", "program", "publisher")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


__all__ = ["FORMAT_VERSION", "EntryMeta"]
