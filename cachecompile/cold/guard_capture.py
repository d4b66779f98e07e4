"""Cold side of the guards: Dynamo's guard list for one frame, made portable.

Dynamo hands every guard it installs for a frame to ``guard_filter_fn`` as a
``GuardFilterEntry``; :func:`cachecompile._torch.dynamo.guard_entries` reads each into a
:class:`~cachecompile._torch.dynamo.GuardEntry` (the source expression, the guard type,
the value at trace time).
:func:`translate` turns each into a portable guard (see :mod:`cachecompile.entry.guards`);
:class:`GuardRecorder` is the ``guard_filter_fn``: it translates, compiles the result
into a checker and checks it against the call being traced *before* the graph runs.
A guard with no portable form (a weakref, an arbitrary object matched by identity, a
guard type this module does not know) makes the frame not cacheable, with the guard
named; it never becomes a weaker check.

Imported only in a compiling process (it reads Dynamo's objects, never imports Dynamo).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import torch

from cachecompile._torch import dynamo, runtime
from cachecompile._torch.dynamo import GuardEntry
from cachecompile.cold import lookups
from cachecompile.entry import guard_kinds
from cachecompile.entry import guards as g
from cachecompile.errors import UnsupportedProgramError
from cachecompile.key import identity as idn
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)


# Covered by the one GLOBAL_STATE snapshot (Dynamo checks them through it too).
_IN_GLOBAL_STATE = {"GRAD_MODE", "DETERMINISTIC_ALGORITHMS", "FSDP_TRAINING_STATE"}
# Autograd-only state: a cached method runs without grad (inference only).
_AUTOGRAD_ONLY = {"AUTOGRAD_SAVED_TENSORS_HOOKS"}


# An environment variable's name as the traced code might spell it (upper case by convention).
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]{1,127}$")


def _dims(values: Sequence[int | None]) -> str:
    """``[2, None]`` -> ``2,*`` (``*``: a dimension Dynamo made symbolic)."""
    return ",".join("*" if v is None else str(v) for v in values)


def reads_args(expr: str, arg_names: set[str]) -> bool:
    return any(m.group(1) in arg_names for m in g.LOCAL_RE.finditer(expr))


# torch.nn.modules.module's registries of global hooks, as Dynamo's guards name them.
_GLOBAL_HOOKS = re.compile(r"\._global_\w*hooks\w*$")


# A traced line that reads an object's id() (copy.deepcopy's memo: ``d = id(x)``).
_READS_ID = re.compile(r"(?<![\w.])id\(")
_ORIGIN = re.compile(r"^(?P<file>[^:]+):\d+ in (?P<func>[^:]+): (?P<line>.*)$")
# Traced lines whose id() is a key that never leaves the frame: the number Dynamo bakes
# into the program is compared only with numbers baked from the same objects, and nothing
# holding it outlives the call. ``kernels`` (transformers 5.25's hub kernels, on every
# Llama-family attention): ``new_forward`` keys a dict by id(fn), sets it in a context
# variable and resets that in ``finally``; ``Func.forward`` looks itself up in it. Read
# in kernels 0.19's kernels/_internals/layer/layer.py. (file, function, line) as the
# guard's origin gives them (GuardEntry.origin: no trailing colon); any other id() read
# is not cacheable.
_FRAME_LOCAL_IDS = frozenset({
    ("layer.py", "new_forward",
     "active_kernel_funcs[id(fn)] = (kernel_func, kernel_func.forward.__func__)"),
    ("layer.py", "forward",
     "if (active_kernel_func := active_kernel_funcs.get(id(self))) is not None"),
    # inspect.unwrap (Python 3.10-3.13): a local memo of the wrappers seen, against cycles.
    ("inspect.py", "unwrap", "memo = {id(f): f}"),
    ("inspect.py", "unwrap", "id_func = id(func)"),
})


def _id_leaves_frame(origin: str, value: Any) -> bool:
    """Whether the traced line ``origin``, which made Dynamo guard ``value``'s identity,
    reads an id() that may reach the program's result or state: Dynamo bakes the number
    in, and another process's object has another. The line is all that is known of
    which object's id it reads; the builtin ``id`` itself, read there, is not one."""
    if value is id or not _READS_ID.search(origin):
        return False
    m = _ORIGIN.match(origin)
    return m is None or (m["file"], m["func"], m["line"]) not in _FRAME_LOCAL_IDS


class _Builder:
    def __init__(self, arg_names: set[str], tensor_dims: Mapping[str, tuple[list[Any], list[Any]]],
                 module_name: str, state: Mapping[str, JSON]) -> None:
        self.arg_names = arg_names
        self.tensor_dims = tensor_dims
        self.module_name = module_name
        self.state = state
        self.out: list[g.GuardDict] = []
        self.classes: set[type] = set()
        self.tensors: list[tuple[str, Any]] = []
        self._seen: set[tuple[str, str, str]] = set()

    def add(self, kind: str, expr: str, value: JSON, text: str | None = None) -> None:
        sig = (kind, expr, repr(value))
        if sig in self._seen:
            return
        self._seen.add(sig)
        self.out.append({"kind": kind, "expr": expr, "value": value,
                         "text": text or g.user_text(expr, self.module_name),
                         "args": reads_args(expr, self.arg_names)})

    def unset_environment(self, strings: Iterable[str]) -> None:
        """A variable the traced code read from the environment while it was unset.

        Dynamo guards the value of a variable that is set (``os.environ._data[b'X'] ==
        b'1'``) but nothing for one that is not: its lookup fails inside Dynamo's trace
        and leaves no guard, so torch.compile in a process where it is set traces anew
        while an entry made without it would hit. When the frame read the environment,
        every string constant of the traced code that names an unset variable (upper case,
        as variables are by convention) becomes a guard that it is still unset. A name
        built at run time, or a lower-case one, is not seen."""
        if not any("environ" in str(gd.get("expr", "")) for gd in self.out):
            return
        for name in sorted(s for s in strings if _ENV_NAME.match(s) and s not in os.environ):
            self.add("expr", f"not ___environ_has({name!r})", None,
                     f"environment variable {name} is unset")

    def absent_state(self, resolved: Sequence[dynamo.Resolved]) -> None:
        """State that was absent when the frame was traced, which a fresh process could add:
        every namespace a name lookup Dynamo resolved consulted and found without the name
        (the subclass before the base a class attribute came from, the instance dict
        before a module's ``__getattr__``, the module before the builtins...), each guarded
        to still lack it. Derived from the lookups themselves by Python's rules
        (:mod:`cachecompile.cold.lookups`), never from Dynamo's guard text."""
        for kind, expr, value, text in lookups.guards(resolved):
            self.add(kind, expr, value, text)

    def ident(self, expr: str, value: Any, guard_type: str, origin: str = "") -> None:
        # An id() read (copy.deepcopy's memo, LED's decoder copying its config) is never
        # portable, whatever names the object: the number is in the program.
        reads_id = _id_leaves_frame(origin, value)
        ident = None if reads_id else idn.identity(value, matched=True)
        if ident is None:
            if reads_id:
                fix = ("the traced code reads its id(), a number that Dynamo bakes into the "
                       "program and that the object has in no other process; where that "
                       "code is yours, copy the object or key by something else outside "
                       "the cached method")
            elif callable(value):
                fix = ("define it at the top level of an importable module (a fresh process "
                       "then finds it by name), or call it outside the cached method")
            else:
                fix = ("pass it as an argument, or make it a plain value (a number, a "
                       "string, a tuple of them)")
            raise UnsupportedProgramError(
                f"Dynamo guards the identity of {g.user_text(expr, self.module_name)} "
                f"({guard_type} on a {idn.qualified_name(type(value))}"
                f"{f', for `{origin}`' if origin else ''}), which has no "
                f"process-independent form; {fix}")
        if isinstance(value, type):
            self.classes.add(value)
        self.add("ident", expr, ident, f"{g.user_text(expr, self.module_name)} is {_short(ident)}")

    def entry(self, e: GuardEntry) -> None:
        """One of Dynamo's guard entries, by the kind that carries its type (one row of
        :data:`cachecompile.entry.guard_kinds.TABLE` each)."""
        gt = e.guard_type
        if gt in _IN_GLOBAL_STATE or gt in _AUTOGRAD_ONLY:
            return
        kind = guard_kinds.BY_DYNAMO.get(gt)
        if kind is None or kind.capture is None:
            self.fallback(e, "cachecompile has no portable form for this guard type")
        if gt != "TYPE_MATCH" and "TYPE_MATCH" in e.derived_types:
            self.type_match(e.expr, self.value(e))
        kind.capture(self, e)

    # -- guard_kinds.Capture: what the kinds' capture steps share --------------------------
    def text(self, expr: str) -> str:
        return g.user_text(expr, self.module_name)

    def value(self, e: GuardEntry) -> Any:
        if not e.has_value:
            self.fallback(e, "its value could not be read at trace time")
        return e.value

    def duplicate(self, e: GuardEntry) -> None:
        # Two sources Dynamo took for one input (tied weights, a buffer two submodules
        # share, one tensor passed twice): its program reads it once. Both join the
        # alias guard over every tensor, which then fails when the sharing is lost.
        other = dynamo.source_name(e.keyword("source_b"))
        if other is None:
            self.fallback(e, "its second source is unknown")
        seen = {x for x, _ in self.tensors}
        for x in (e.expr, other):
            if x not in seen:
                self.tensors.append((x, e.value))

    def attr_of(self, e: GuardEntry) -> str:
        """The attribute name an attribute guard (HASATTR, NOT_PRESENT...) was built with."""
        attr = e.keyword("attr")
        if not isinstance(attr, str):
            self.fallback(e, "its attribute name is unknown")
        return str(attr)

    def type_match(self, expr: str, value: Any) -> None:
        cls = type(value)
        self.classes.add(cls)
        self.add("type", expr, idn.type_value(cls),
                 f"type({g.user_text(expr, self.module_name)}) is {idn.qualified_name(cls)}")
        if isinstance(value, dict) and _GLOBAL_HOOKS.search(expr):
            # torch.nn's global module hooks (register_module_forward_hook & co.): Dynamo
            # guards only these dicts' type, so a program traced without a global hook
            # would run where one is registered (a wrong result, torch.compile's too once
            # compiled). The entry also guards how many there are.
            self.add("len", expr, len(value),
                     f"len({g.user_text(expr, self.module_name)}) == {len(value)} "
                     "(global module hooks)")

    def tensor(self, expr: str, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise UnsupportedProgramError(f"TENSOR_MATCH on a {type(value).__name__}")
        self.classes.add(type(value))
        dims = self.tensor_dims.get(expr)
        sizes, strides = (concrete(dims[0]), concrete(dims[1])) if dims else (None, None)
        facts = g.tensor_facts(value, sizes, strides)
        self.tensors.append((expr, value))
        # The strides are in the text (where Dynamo checks them): two entries that differ
        # only in them must not read the same in a miss line or in `cachectl explain`.
        self.add("tensor", expr, facts, f"{g.user_text(expr, self.module_name)} is a "
                 f"{facts['dtype']}[{_dims(facts['sizes'])}] "
                 f"{facts['type']['qual'].rsplit('.', 1)[-1]} on {facts['device']}, "
                 f"strides [{_dims(facts['strides'])}]")

    def fallback(self, e: GuardEntry, why: str) -> NoReturn:
        raise UnsupportedProgramError(
            f"Dynamo's {e.guard_type} guard on {g.user_text(e.expr, self.module_name) or 'global state'} "
            f"cannot be carried across processes ({why})")

    def aliasing(self) -> None:
        """Which tensors are the same object: Dynamo guards that pattern (no_tensor_aliasing)."""
        for per_call in (True, False):
            chosen = [(x, v) for x, v in self.tensors
                      if not per_call or reads_args(x, self.arg_names)]
            if len(chosen) < 2:
                continue
            groups: dict[int, list[int]] = {}
            for i, (_, v) in enumerate(chosen):
                groups.setdefault(id(v), []).append(i)
            exprs = [x for x, _ in chosen]
            shared = [grp for grp in groups.values() if len(grp) > 1]
            text = ("inputs alias as at trace time" if not shared else
                    "aliased inputs: " + "; ".join(
                        " is ".join(g.user_text(exprs[i], self.module_name) for i in grp)
                        for grp in shared))
            self.out.append({"kind": "alias", "expr": "", "args": per_call, "text": text,
                             "value": {"exprs": exprs, "groups": list(groups.values())}})
            if per_call:
                self.overlap(chosen)

    def overlap(self, chosen: list[tuple[str, Any]]) -> None:
        """Which input tensors share memory (views of one buffer): a program traced with
        inputs apart must not run on overlapping views that one of them writes through.
        Dynamo guards this only when the views overlapped at trace time, with dynamic
        shapes (AOTAutograd's StorageOverlap); the entry always guards it."""
        exprs = [x for x, _ in chosen]
        groups = guard_kinds.overlap_groups([v for _, v in chosen])
        text = ("input tensors do not share memory" if not groups else
                "input tensors share memory: " + "; ".join(
                    " and ".join(g.user_text(exprs[i], self.module_name) for i in grp)
                    for grp in groups))
        self.out.append({"kind": "overlap", "expr": "", "args": True, "text": text,
                         "value": {"exprs": exprs, "groups": groups}})


def tensor_dims_from_graph(gm: Any) -> dict[str, tuple[list[Any], list[Any]]]:
    """Source expression -> (sizes, strides) with None where Dynamo made a dim symbolic."""
    out: dict[str, tuple[list[Any], list[Any]]] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = dynamo.placeholder_source(node)
        ex = dynamo.example_value(node)
        if name is None or not isinstance(ex, torch.Tensor):
            continue
        # Symbolic sizes stay symbolic here: Dynamo and Inductor may still specialise
        # them (a replacement s0 -> 2); :func:`concrete` reads them when guards are built.
        out[name] = (list(ex.size()), list(ex.stride()))
    return out


def concrete(dims: Sequence[Any]) -> list[int | None]:
    """Static sizes as ints, dynamic ones as None (as Dynamo's TENSOR_MATCH sees them)."""
    return [dynamo.known_int(d) for d in dims]


def translate(entries: Sequence[Any], *, arg_names: set[str],
              tensor_dims: Mapping[str, tuple[list[Any], list[Any]]], module_name: str,
              state: Mapping[str, JSON], strings: Iterable[str] = (),
              resolved: Sequence[dynamo.Resolved] | None
              ) -> tuple[list[g.GuardDict], set[type]]:
    """Dynamo's guard entries for one frame, portable, with the absent state its lookups
    (``resolved``) found. ``resolved`` None: the lookups were not recorded (the frame was
    compiled outside the session's Dynamo call), so what was absent is not known and the
    frame is not stored (UnsupportedProgramError)."""
    if resolved is None:
        raise UnsupportedProgramError("the names Dynamo looked up while tracing the frame "
                                      "were not recorded, so the state it found absent "
                                      "cannot be guarded")
    b = _Builder(arg_names, tensor_dims, module_name, state)
    for e in dynamo.guard_entries(entries):
        b.entry(e)
    b.aliasing()
    b.unset_environment(strings)
    b.absent_state(resolved)
    return b.out, b.classes


def state_snapshot() -> dict[str, JSON]:
    """The global state Dynamo sees at frame entry (taken just before the traced call)."""
    return {"global_state": runtime.global_state(), "modes": guard_kinds.function_modes(),
            "default_device": runtime.default_device()}


def frame_state() -> dict[str, JSON]:
    """:func:`state_snapshot` for a frame Dynamo is converting now (a resume function's,
    a callee's: the eager code before it may have changed the global state), with the
    global state Dynamo took when it began converting it. Read while its guards are built
    (Dynamo restores the function modes for that)."""
    snap = state_snapshot()
    entry = dynamo.frame_entry_state()
    if entry is not None:
        snap["global_state"] = entry
    return snap


def class_files(classes: set[type]) -> set[str]:
    files: set[str] = set()
    for cls in classes:
        try:
            path = inspect.getsourcefile(cls)
        except (TypeError, OSError):
            continue
        if path:
            files.add(path)
    return files


def _short(ident: str) -> str:
    return ident if len(ident) < 80 else ident[:60] + "..."
