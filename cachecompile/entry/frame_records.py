"""The frames of a graph-breaking method, as an entry stores them (``fullgraph=False``).

A method whose graph breaks is several frames to Dynamo. Its own frame is compiled to
transformed bytecode that runs the first graph, then the code Dynamo could not trace (a
``print``, a branch on ``.item()``, a call it does not support), then calls a *resume
function* (``__resume_at_<offset>_<n>``, a code object Dynamo generates for the rest of
the method), whose frame Dynamo compiles in turn, and so on. A function the eager code
calls (a submodule's ``forward`` that breaks inside) is a frame of its own too. Each frame
Dynamo compiled has one variant per set of guards (Dynamo's cache entries for its code),
each with its transformed bytecode, its graphs and its guards.

An entry keeps the method's own frame in :class:`~cachecompile.entry.meta.EntryMeta`'s
root fields (as for a method that compiles whole) and every other frame as a
:class:`FrameRecord` in ``EntryMeta.frames``:

* ``resume``: a continuation Dynamo generated; its code is stored (a warm process has no
  Dynamo to generate it), its frame is found by the global name its caller's bytecode
  loads (``FrameVariant.resumes``);
* ``callee``: a function of the user's (or a library's) code that the eager code called;
  its code is the live one, found again by module, qualified name and code digest
  (:func:`find_callee`).

A frame whose guards cannot all be stored has no variants and says why (``live``): it is
never run on guards that were not checked. Graphs of frames other than the method's are
``EntryMeta.graphs`` (the adapter's record each), their files under ``graphs/<i>/``.

Torch-free but for the constants' rebuilding (entry.codeobj); read by the warm lookup and
by ``cachectl``.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import inspect
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cachecompile.errors import UnsupportedProgramError
from cachecompile.store.jsonvalue import JSON

RESUME = "resume"
CALLEE = "callee"
KINDS = (RESUME, CALLEE)

# Where a frame's and a graph's files are in an entry.
FRAMES_DIR = "frames"
GRAPHS_DIR = "graphs"


def frame_code_file(i: int) -> str:
    """The stored code object of frame ``i`` (a resume function's own code)."""
    return f"{FRAMES_DIR}/{i}/code.bin"


def frame_bytecode_file(i: int, v: int) -> str:
    """The transformed bytecode of frame ``i``'s variant ``v``."""
    return f"{FRAMES_DIR}/{i}/{v}/bytecode.bin"


def graph_prefix(i: int) -> str:
    return f"{GRAPHS_DIR}/{i}/"


def graph_files(files: Mapping[str, Path], i: int) -> dict[str, Path]:
    """Graph ``i``'s files as its adapter wrote them (the entry's files under its folder)."""
    prefix = graph_prefix(i)
    return {k[len(prefix):]: v for k, v in files.items() if k.startswith(prefix)}


def _str_map(v: Any, what: str) -> dict[str, str]:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) and isinstance(x, str)
                                             for k, x in v.items()):
        raise UnsupportedProgramError(f"the entry's {what} is not a map of names")
    return dict(v)


@dataclasses.dataclass(frozen=True)
class FrameVariant:
    """One compiled variant of a frame: what one of Dynamo's cache entries for its code
    holds, in portable form."""

    bytecode: str                          # the entry's file with the transformed code
    consts: Sequence[JSON]                 # its rebuilt constants (entry.codeobj)
    imports: Mapping[str, str]             # Dynamo global -> module (warm.replay)
    graphs: Mapping[str, int]              # __compiled_fn_* -> index in EntryMeta.graphs
    resumes: Mapping[str, str]             # __resume_at_* -> frame id
    guards: Sequence[Mapping[str, JSON]]   # portable guards (entry.guards)
    checker: Mapping[str, JSON]            # the checker, ready to load

    def to_json(self) -> dict[str, JSON]:
        return {"bytecode": self.bytecode, "consts": list(self.consts),
                "imports": dict(self.imports), "graphs": dict(self.graphs),
                "resumes": dict(self.resumes), "guards": [dict(g) for g in self.guards],
                "checker": dict(self.checker)}

    @classmethod
    def from_json(cls, j: Any) -> FrameVariant:
        if not isinstance(j, Mapping):
            raise UnsupportedProgramError("a frame variant of the entry is not a mapping")
        graphs = j.get("graphs", {})
        if not isinstance(graphs, Mapping) or not all(
                isinstance(k, str) and type(i) is int and i >= 0 for k, i in graphs.items()):
            raise UnsupportedProgramError("a frame variant's graphs are not a map of indexes")
        guards, consts, checker = j.get("guards"), j.get("consts"), j.get("checker", {})
        if (not isinstance(j.get("bytecode"), str) or not isinstance(guards, list)
                or not isinstance(consts, list) or not isinstance(checker, Mapping)):
            raise UnsupportedProgramError("a frame variant of the entry lacks its fields")
        return cls(bytecode=j["bytecode"], consts=tuple(consts),
                   imports=_str_map(j.get("imports", {}), "frame imports"),
                   graphs=dict(graphs), resumes=_str_map(j.get("resumes", {}), "resumes"),
                   guards=tuple(guards), checker=dict(checker))


@dataclasses.dataclass(frozen=True)
class FrameRecord:
    """A frame Dynamo compiled for the call, other than the method's own."""

    id: str                                # stable across processes (code digest based)
    kind: str                              # RESUME or CALLEE
    module: str                            # its globals' module (``__name__``)
    name: str                              # for people: qualified name and first line
    code: str = ""                         # RESUME: the entry's file with its code
    code_consts: Sequence[JSON] = ()       # ... and that code's rebuilt constants
    where: Mapping[str, JSON] = dataclasses.field(default_factory=dict)  # CALLEE: found by
    variants: Sequence[FrameVariant] = ()
    live: str = ""                         # why no variant is stored ("": they are)
    # Dynamo met this frame and left it as written (it skipped it): so does a warm process.
    as_written: bool = False

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {"id": self.id, "kind": self.kind, "module": self.module,
                                "name": self.name,
                                "variants": [v.to_json() for v in self.variants]}
        if self.code:
            out["code"], out["code_consts"] = self.code, list(self.code_consts)
        if self.where:
            out["where"] = dict(self.where)
        if self.live:
            out["live"] = self.live
        if self.as_written:
            out["as_written"] = True
        return out

    @classmethod
    def from_json(cls, j: Any) -> FrameRecord:
        if not isinstance(j, Mapping):
            raise UnsupportedProgramError("a frame of the entry is not a mapping")
        kind = j.get("kind")
        if kind not in KINDS:
            raise UnsupportedProgramError(f"a frame of the entry has kind {kind!r}")
        for f in ("id", "module", "name"):
            if not isinstance(j.get(f), str):
                raise UnsupportedProgramError(f"a frame of the entry has no {f!r}")
        code, consts, where = j.get("code", ""), j.get("code_consts", []), j.get("where", {})
        variants, live = j.get("variants", []), j.get("live", "")
        as_written = j.get("as_written", False)
        if (not isinstance(code, str) or not isinstance(consts, list)
                or not isinstance(where, Mapping) or not isinstance(variants, list)
                or not isinstance(live, str) or not isinstance(as_written, bool)):
            raise UnsupportedProgramError("a frame of the entry has a field of the wrong type")
        if kind == RESUME and not code:
            raise UnsupportedProgramError("a resume frame of the entry has no code")
        return cls(id=j["id"], kind=kind, module=j["module"], name=j["name"], code=code,
                   code_consts=tuple(consts), where=dict(where),
                   variants=tuple(FrameVariant.from_json(v) for v in variants), live=live,
                   as_written=as_written)


def read_frames(raw: Sequence[Any]) -> tuple[FrameRecord, ...]:
    """``EntryMeta.frames`` as records (UnsupportedProgramError on anything else); ids are
    unique and every resume name a variant calls is one of them."""
    frames = tuple(FrameRecord.from_json(j) for j in raw)
    ids = {f.id for f in frames}
    if len(ids) != len(frames):
        raise UnsupportedProgramError("two frames of the entry have one id")
    for f in frames:
        for v in f.variants:
            missing = set(v.resumes.values()) - ids
            if missing:
                raise UnsupportedProgramError(f"frame {f.name} calls a frame the entry lacks")
    return frames


# -- a callee's code, found again in another process ----------------------------------------
def code_qualname(code: types.CodeType) -> str:
    return str(getattr(code, "co_qualname", code.co_name))


def callee_where(code: types.CodeType, digest: str) -> dict[str, JSON]:
    return {"qualname": _qualname_of_live(code), "name": code.co_name,
            "line": code.co_firstlineno, "digest": digest}


def _qualname_of_live(code: types.CodeType) -> str:
    """``code``'s qualified name. Python 3.10's code objects carry none (``co_qualname``
    is 3.11's): there it is the name of a function made from ``code`` that is still alive
    (a callee that just ran: a class's method, a decorator's wrapped function), else the
    bare name, which :func:`find_callee` does not find (the callee then runs as written)."""
    if hasattr(code, "co_qualname"):
        return code_qualname(code)
    for ref in gc.get_referrers(code):
        if isinstance(ref, types.FunctionType) and ref.__code__ is code:
            return ref.__qualname__
    return code.co_name


def _candidates(obj: Any, depth: int = 0) -> list[types.CodeType]:
    """The code objects reachable from an attribute: a function, a method, a property's
    getter, what a decorator wraps (``__wrapped__``), a static or class method."""
    if depth > 8:
        return []
    out: list[types.CodeType] = []
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, property):
        for part in (obj.fget, obj.fset):
            if part is not None:
                out.extend(_candidates(part, depth + 1))
        return out
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):
        out.append(code)
    wrapped = getattr(obj, "__wrapped__", None)
    if wrapped is not None and wrapped is not obj:
        out.extend(_candidates(wrapped, depth + 1))
    return out


def _nested(code: types.CodeType, name: Any, line: Any, depth: int = 0
            ) -> list[types.CodeType]:
    """Code objects defined inside ``code`` (at any depth) with that name and first line."""
    out: list[types.CodeType] = []
    if depth > 8:
        return out
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            if c.co_name == name and c.co_firstlineno == line:
                out.append(c)
            out.extend(_nested(c, name, line, depth + 1))
    return out


def find_callee(module: str, where: Mapping[str, JSON],
                digest_of: Any) -> types.CodeType | None:
    """The live code object of a callee frame (``where``: :func:`callee_where`) in the
    module ``module``, if it is still that code (``digest_of(code)`` equals the stored
    digest); None when it cannot be found or changed. Reaches module-level functions and
    methods of module-level classes by their qualified name, through decorators, and a
    function defined inside one of those (``Outer.method.<locals>.inner``: one code object
    serves every closure made from it)."""
    qualname = where.get("qualname")
    if not isinstance(qualname, str) or "<lambda>" in qualname:
        return None
    outer, sep, _ = qualname.partition(".<locals>.")
    if sep:
        found = find_callee(module, {"qualname": outer, "name": outer.rsplit(".", 1)[-1],
                                     "line": None, "digest": None}, None)
        if found is None:
            return None
        for code in _nested(found, where.get("name"), where.get("line")):
            # 3.10 (no co_qualname): the name, line and digest _nested and this compare.
            same_name = code_qualname(code) == qualname or not hasattr(code, "co_qualname")
            if same_name and digest_of(code) == where.get("digest"):
                return code
        return None
    for code in _candidates(_module_attr(module, qualname)):
        if digest_of is None and code.co_name == where.get("name"):
            return code   # an enclosing function, searched for its nested code
        if (code.co_firstlineno == where.get("line") and code.co_name == where.get("name")
                and digest_of is not None and digest_of(code) == where.get("digest")):
            return code
    return None


def _module_attr(module: str, qualname: str) -> Any:
    """What ``qualname`` names in ``module`` (imported if it is not yet), reached through
    classes without running their descriptors; None where it is not there."""
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except Exception:  # a module that does not import here: its frame runs as written
            return None
    obj: Any = mod
    parts = qualname.split(".")
    for part in parts[:-1]:
        obj = inspect.getattr_static(obj, part, None)
        if obj is None:
            return None
    attr = (vars(obj).get(parts[-1]) if isinstance(obj, type)
            else getattr(obj, parts[-1], None))
    if attr is None and isinstance(obj, type):
        attr = getattr(obj, parts[-1], None)
    return attr


def frame_names(code: types.CodeType) -> tuple[str, ...]:
    """A frame's arguments (by position, ``*args`` and ``**kwargs`` included) and its free
    variables: what its guards may read as locals, in the order a check takes them."""
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return tuple(code.co_varnames[:n]) + tuple(code.co_freevars)


def frame_function(code: types.CodeType, f_globals: dict[str, Any]) -> types.FunctionType:
    """A function of the frame's names (:func:`frame_names`), all positional: what a
    frame's guard checker is compiled over (its guards read them as ``L['name']``)."""
    names = frame_names(code)
    if not all(n.isidentifier() for n in names):
        raise UnsupportedProgramError(f"frame {code.co_name} has a local that is no name")
    scope: dict[str, Any] = {}
    exec(compile(f"def frame({', '.join(names)}):\n    pass\n", "<cachecompile frame>",
                 "exec"), scope)
    fn: types.FunctionType = scope["frame"]
    fn = types.FunctionType(fn.__code__, f_globals, "frame")
    fn.__qualname__ = code_qualname(code)
    return fn


def frame_values(code: types.CodeType, f_locals: Mapping[str, Any],
                 closure: Sequence[Any] | None = None) -> list[Any]:
    """The values of :func:`frame_names` from a frame's locals (its arguments by name, as
    Dynamo and its C hook hand them over), free variables from ``closure`` (cells) when
    given, else from the locals."""
    names = frame_names(code)
    n_args = len(names) - len(code.co_freevars)
    out = [f_locals[n] for n in names[:n_args]]
    if code.co_freevars:
        if closure is not None:
            out.extend(c.cell_contents for c in closure)
        else:
            out.extend(f_locals[n] for n in code.co_freevars)
    return out
