"""What Dynamo compiled for one call of a graph-breaking method, frame by frame.

``fullgraph=False``: Dynamo compiles the method's own frame, then each resume function its
transformed bytecode calls (and theirs), then any function the eager code between graphs
calls whose frame it converts (a callee). :class:`~cachecompile.cold.capture.TraceSession`
records each of those compiles while the first call runs (:class:`FrameCompile`: the
code, its transformed code, its graphs, its guards); :func:`assemble` turns them into the
entry's frame records (:mod:`cachecompile.entry.frame_records`), the files that hold their code
and the programs of their graphs, walking from the method's own bytecode through the
resume functions each frame calls.

A frame whose guards have no portable form, or whose program did not verify, is stored
with no variant and the reason (``live``): a warm process never runs it on guards it did
not check. Imported only in a compiling process.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import xxhash

from cachecompile._torch import dynamo
from cachecompile.backends.base import Compiled, Program
from cachecompile.entry import codeobj, frame_records
from cachecompile.entry import guards as guards_mod
from cachecompile.entry.frame_records import FrameRecord, FrameVariant
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key.identity import code_digest
from cachecompile.warm.replay import (
    BUILTINS_DICT,
    is_dynamo_global,
    named_builtin,
    namedtuple_scope,
)

logger = logging.getLogger(__name__)

RESUME_PREFIX = "__resume_at_"
GRAPH_PREFIX = "__compiled_fn"


@dataclasses.dataclass(eq=False)
class GraphCapture:
    """One graph a frame compiled: the adapter's compile, what the backend handed Dynamo
    (found again behind the ``__compiled_fn_*`` global) and, once run, its program."""

    compiled: Compiled
    run: Callable[..., Any]
    program: Program | None = None
    verdict: str | None = None


@dataclasses.dataclass(eq=False)
class FrameCompile:
    """One of Dynamo's compiles of a frame other than the method's own, during the call."""

    code: types.CodeType
    out_code: types.CodeType
    f_globals: dict[str, Any]
    graphs: list[GraphCapture]
    guards: list[dict[str, Any]] | None = None
    checker_lines: dict[str, Any] = dataclasses.field(default_factory=dict)
    verdict: str | None = None
    # The user files its graphs traced and the classes its guards name (dependencies).
    traced: list[str] = dataclasses.field(default_factory=list)
    classes: set[type] = dataclasses.field(default_factory=set)

    def why_not(self) -> str | None:
        if self.verdict is not None:
            return self.verdict
        for g in self.graphs:
            if g.verdict is not None:
                return g.verdict
            if g.program is None:
                return "its graph's program was never run"
        if self.guards is None:
            return "Dynamo's guards were not recorded"
        return None


@dataclasses.dataclass
class Assembled:
    """The frames of an entry, ready to publish."""

    resumes: dict[str, str]                 # the method's own __resume_at_* -> frame id
    records: list[FrameRecord]
    files: dict[str, bytes]                 # frames/<i>/... (codes, bytecode)
    programs: list[Program]                 # EntryMeta.graphs, in order


def frame_id(kind: str, module: str, code: types.CodeType) -> str:
    """A frame's id: the same code in the same module in any process."""
    h = xxhash.xxh3_128()
    h.update(f"{kind}\0{module}\0{frame_records.code_qualname(code)}\0{code_digest(code)}".encode())
    return h.hexdigest()


def all_names(code: types.CodeType) -> list[str]:
    """The names a code object and its nested code objects load."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(all_names(const))
    return names


def dynamo_imports(names: Sequence[str], g: Mapping[str, Any],
                   original: set[str]) -> dict[str, str]:
    """The module references (and builtins dict) Dynamo installed in ``g`` under generated
    names that ``names`` use, by what they stand for; UnsupportedProgramError for any
    other object it installed there."""
    imports: dict[str, str] = {}
    for n in names:
        if n.startswith((GRAPH_PREFIX, RESUME_PREFIX)) or n in imports:
            continue
        if is_dynamo_global(n) and n in g and n not in original:
            value = g.get(n)
            named = named_builtin(value) or namedtuple_scope(value)
            if isinstance(value, types.ModuleType):
                imports[n] = value.__name__
            elif value is vars(builtins):
                imports[n] = BUILTINS_DICT
            elif named is not None:
                imports[n] = named
            else:
                raise UnsupportedProgramError(
                    f"transformed bytecode uses Dynamo global {n} ({type(value).__name__})")
    return imports


def guard_global_names(guards: Sequence[Mapping[str, Any]]) -> list[str]:
    out: set[str] = set()
    for gd in guards:
        if gd["kind"] in ("alias", "overlap"):
            text = " ".join(gd["value"]["exprs"])
        else:
            text = str(gd.get("expr", ""))
        out.update(m.group(1) for m in guards_mod.GLOBAL_RE.finditer(text))
    return sorted(out)


class _Assembler:
    def __init__(self, compiles: Sequence[FrameCompile], root: types.CodeType | None) -> None:
        self.by_code: dict[types.CodeType, list[FrameCompile]] = {}
        for c in compiles:
            if c.code is not root:
                self.by_code.setdefault(c.code, []).append(c)
        self.records: dict[types.CodeType, FrameRecord] = {}
        self.order: list[types.CodeType] = []
        self.files: dict[str, bytes] = {}
        self.programs: list[Program] = []
        self._graph_index: dict[int, int] = {}

    # -- the walk ------------------------------------------------------------------------
    def resumes_of(self, out_code: types.CodeType, g: Mapping[str, Any]) -> dict[str, str]:
        """The resume functions ``out_code`` calls, by global name, as frame ids (each
        frame recorded, with the frames it calls in turn)."""
        out: dict[str, str] = {}
        for n in dict.fromkeys(all_names(out_code)):
            if not n.startswith(RESUME_PREFIX):
                continue
            code = dynamo.resume_code(g.get(n))
            if code is None:
                raise UnsupportedProgramError(f"the bytecode calls {n}, which is no resume "
                                              "function Dynamo made")
            module = str(g.get("__name__", ""))
            out[n] = self.record(code, frame_records.RESUME, module, g)
        return out

    def record(self, code: types.CodeType, kind: str, module: str,
               g: Mapping[str, Any]) -> str:
        known = self.records.get(code)
        if known is not None:
            return known.id
        fid = frame_id(kind, module, code)
        i = len(self.order)
        self.order.append(code)
        # A placeholder while the frame's own calls are walked (a frame calling itself).
        self.records[code] = FrameRecord(id=fid, kind=kind, module=module,
                                         name=f"{frame_records.code_qualname(code)} "
                                              f"({code.co_filename}:{code.co_firstlineno})")
        code_file, code_consts = "", list[Any]()
        where: dict[str, Any] = {}
        live = ""
        if kind == frame_records.RESUME:
            data, code_consts = codeobj.dumps(code)
            code_file = frame_records.frame_code_file(i)
            self.files[code_file] = data
        else:
            where = frame_records.callee_where(code, code_digest(code))
            if frame_records.find_callee(module, where, code_digest) is not code:
                live = ("its code cannot be found again by module and qualified name "
                        f"({module}.{where['qualname']})")
        variants: list[FrameVariant] = []
        if not live:
            try:
                for v, c in enumerate(self.by_code.get(code, ())):
                    variants.append(self.variant(i, v, c))
            except UnsupportedProgramError as e:
                live, variants = str(e), []
        if live:
            logger.info("cachecompile: frame %s is not stored (%s); a warm process runs it "
                        "%s", self.records[code].name, live,
                        "live" if kind == frame_records.RESUME else "as written")
        # A continuation Dynamo met and skipped (no graph in it, a break inside a try
        # block): torch.compile runs it as written, and so will a warm process.
        as_written = not live and not variants and dynamo.ran_as_written(code)
        self.records[code] = dataclasses.replace(
            self.records[code], code=code_file, code_consts=tuple(code_consts), where=where,
            variants=tuple(variants), live=live, as_written=as_written)
        return fid

    def variant(self, i: int, v: int, c: FrameCompile) -> FrameVariant:
        why = c.why_not()
        if why is not None:
            raise UnsupportedProgramError(why)
        assert c.guards is not None
        names = all_names(c.out_code)
        graphs: dict[str, int] = {}
        for n in dict.fromkeys(names):
            if n.startswith(GRAPH_PREFIX):
                graphs[n] = self.graph(c, n)
        if len(graphs) != len(c.graphs):
            raise UnsupportedProgramError(
                f"frame {c.code.co_name}: {len(c.graphs)} graphs compiled, "
                f"{len(graphs)} called by its bytecode")
        original = set(c.code.co_names)
        imports = dynamo_imports([*names, *guard_global_names(c.guards)], c.f_globals,
                                 original)
        resumes = self.resumes_of(c.out_code, c.f_globals)
        data, consts = codeobj.dumps(c.out_code)
        name = frame_records.frame_bytecode_file(i, v)
        self.files[name] = data
        return FrameVariant(bytecode=name, consts=tuple(consts), imports=imports,
                            graphs=graphs, resumes=resumes, guards=tuple(c.guards),
                            checker=c.checker_lines)

    def graph(self, c: FrameCompile, name: str) -> int:
        run = dynamo.graph_callable(c.f_globals.get(name))
        for gc in c.graphs:
            if gc.run is run:
                assert gc.program is not None
                key = id(gc)
                if key not in self._graph_index:
                    self._graph_index[key] = len(self.programs)
                    self.programs.append(gc.program)
                return self._graph_index[key]
        raise UnsupportedProgramError(f"{name} is no graph compiled for its frame")

    def callees(self) -> None:
        """Frames Dynamo compiled that no frame's bytecode names: functions the eager code
        called (in call order)."""
        for code, compiles in list(self.by_code.items()):
            # A resume function whose caller is not stored is reached through no record.
            if code not in self.records and not dynamo.is_resume_code(code):
                module = str(compiles[0].f_globals.get("__name__", ""))
                self.record(code, frame_records.CALLEE, module, compiles[0].f_globals)


def assemble(root_code: types.CodeType, root_out: types.CodeType, root_globals: dict[str, Any],
             compiles: Sequence[FrameCompile]) -> Assembled:
    """The frames reached from the method's transformed bytecode ``root_out`` and every
    other frame compiled during the call, as records, files and programs."""
    a = _Assembler(compiles, root_code)
    resumes = a.resumes_of(root_out, root_globals)
    a.callees()
    records = [a.records[c] for c in a.order]
    return Assembled(resumes=resumes, records=records, files=a.files, programs=a.programs)


def assemble_variant(c: FrameCompile) -> tuple[Assembled | None, str]:
    """A frame compiled after its entry was made, as a frame variant's entry: its record
    with this one variant (first), code-only records of the resume frames its bytecode
    calls (their own variants have their own entries), its graphs. (None, why) where the
    frame cannot be stored (its guards, its program, its code not found again)."""
    a = _Assembler([c], None)
    kind = frame_records.RESUME if dynamo.is_resume_code(c.code) else frame_records.CALLEE
    a.record(c.code, kind, str(c.f_globals.get("__name__", "")), c.f_globals)
    records = [a.records[x] for x in a.order]
    head = records[0]
    if head.live or not head.variants:
        return None, head.live or "no variant"
    return Assembled(resumes={}, records=records, files=a.files, programs=a.programs), ""


def assemble_as_written(code: types.CodeType, module: str) -> Assembled:
    """A frame variant's entry saying that Dynamo ran a continuation as written (it met
    its frame and compiled nothing): a warm process does the same, without compiling."""
    a = _Assembler([], None)
    a.record(code, frame_records.RESUME, module, {})
    records = [dataclasses.replace(a.records[c], as_written=True) for c in a.order]
    return Assembled(resumes={}, records=records, files=a.files, programs=a.programs)
