"""Dynamo's private names, for the cold path (tracing, capture, AOTAutograd).

Importing this module is cheap: each function imports the part of ``torch._dynamo`` it
needs when it is called, so warm-path modules may import it for a type or a constant
without pulling Dynamo in. Only a compiling process calls these functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from . import versions
from .frame_cache import transformed_code

logger = logging.getLogger(__name__)

# (module, attribute path) of every private name below: probed when a cold compile starts.
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch._dynamo.utils", "get_traced_code"),
    ("torch._dynamo.utils", "guard_failures"),
    ("torch._dynamo.exc", "Unsupported"),
    ("torch._dynamo.exc", "UserError"),
    ("torch._dynamo.exc", "FailOnRecompileLimitHit"),
    ("torch._dynamo.exc", "TorchRuntimeError"),
    ("torch._dynamo.exc", "BackendCompilerFailed"),
    ("torch._dynamo.exc", "InternalTorchDynamoError"),
    ("torch._dynamo.backends.common", "aot_autograd"),
    ("functorch.compile", "make_boxed_func"),
    ("torch", "_C._dynamo.eval_frame._debug_get_cache_entry_list"),
    ("torch", "_C._dynamo.eval_frame.reset_code"),
    # Where Dynamo resolves a name while it traces (recording_lookups): from 2.14 on,
    # LOAD_ATTR and getattr() both call object_protocol.generic_getattr; in 2.13 getattr
    # and hasattr have classes of their own; before, they are methods of BuiltinVariable,
    # reached through its cache of handlers.
    *((("torch._dynamo.variables.object_protocol", "generic_getattr"),
       ("torch._dynamo.variables.object_protocol", "_NO_DEFAULT"),
       ("torch._dynamo.variables.builtin", "HasAttrBuiltinVariable.call_function"))
      if versions.at_least(2, 14) else
      (("torch._dynamo.variables.builtin", "GetAttrBuiltinVariable._call_getattr"),
       ("torch._dynamo.variables.builtin", "HasAttrBuiltinVariable.call_function"))
      if versions.at_least(2, 13) else
      (("torch._dynamo.variables.builtin", "BuiltinVariable.call_getattr"),
       ("torch._dynamo.variables.builtin", "BuiltinVariable.call_hasattr"),
       ("torch._dynamo.variables.builtin", "BuiltinVariable.call_function_handler_cache"))),
    ("torch._dynamo.symbolic_convert", "InstructionTranslatorBase.load_builtin_from_argval"),
    ("torch._dynamo.variables.user_defined", "UserDefinedObjectVariable"),
    ("torch._dynamo.variables.user_defined", "UserDefinedClassVariable"),
    ("torch._dynamo.variables.misc", "PythonModuleVariable"),
    ("torch._dynamo.variables.misc", "GetAttrVariable"),
    ("torch._dynamo.variables.misc", "SuperVariable"),
    ("torch._dynamo.variables.nn_module", "NNModuleVariable"),
    ("torch._dynamo.convert_frame", "_compile"),
    ("torch._dynamo.convert_frame", "initial_global_state"),
    ("torch._dynamo.convert_frame", "input_codes"),
)


# -- tracing -------------------------------------------------------------------------------
def traced_code_files() -> list[str]:
    """The files of every code object Dynamo traced (inside the tracing context only)."""
    from torch._dynamo.utils import get_traced_code

    return [code.co_filename for code in get_traced_code() or ()]


def traced_code_strings() -> set[str]:
    """The string constants of every code object Dynamo traced, nested code included
    (inside the tracing context only)."""
    from torch._dynamo.utils import get_traced_code

    out: set[str] = set()
    stack = list(get_traced_code() or ())
    while stack:
        code = stack.pop()
        for const in code.co_consts:
            if isinstance(const, str):
                out.add(const)
            elif isinstance(const, types.CodeType):
                stack.append(const)
    return out


def last_guard_failure(code: types.CodeType) -> str | None:
    """Why Dynamo's last guard check on ``code``'s cache failed (it recompiled), if known."""
    from torch._dynamo.utils import guard_failures

    reasons = guard_failures.get(code) or []
    return str(reasons[-1]) if reasons else None


def graph_break_errors() -> tuple[type[BaseException], ...]:
    """What Dynamo raises when a fullgraph compile breaks; () if this torch has no such names."""
    try:
        from torch._dynamo.exc import Unsupported, UserError
    except ImportError:
        return ()
    return (Unsupported, UserError)


def backend_failures() -> tuple[type[BaseException], ...]:
    """What torch raises when its compile fails on a graph Dynamo captured: in its backend
    (``BackendCompilerFailed``; Inductor's ``InductorError`` where it surfaces as is), or in
    Dynamo itself (``InternalTorchDynamoError``: a bug of torch's, never the inputs')."""
    from torch._dynamo import exc

    out: list[type[BaseException]] = [exc.BackendCompilerFailed, exc.InternalTorchDynamoError]
    inductor_exc = sys.modules.get("torch._inductor.exc")
    inductor_error = getattr(inductor_exc, "InductorError", None)
    if isinstance(inductor_error, type) and issubclass(inductor_error, BaseException):
        out.append(inductor_error)
    return tuple(out)


def recompile_limit_errors() -> tuple[type[BaseException], ...]:
    """What Dynamo raises when a fullgraph frame passes its recompile limit (a value it
    guards changed on every call); () if this torch has no such name."""
    try:
        from torch._dynamo.exc import FailOnRecompileLimitHit
    except ImportError:
        return ()
    return (FailOnRecompileLimitHit,)


def input_errors() -> tuple[type[BaseException], ...]:
    """What Dynamo raises when an operator fails on fake tensors (a shape that does not fit)."""
    try:
        from torch._dynamo.exc import TorchRuntimeError
    except ImportError:
        return ()
    return (TorchRuntimeError,)


# Dynamo's graph breaks that mean "an operator failed on these inputs", by their type, and
# the hint Dynamo gives every break it blames on the user's code (graph_break_hints).
_INPUT_BREAKS = ("TypeError when making fake tensor call",
                 "RuntimeError when making fake tensor call",
                 "Failed to convert args/kwargs to proxy")
_USER_ERROR_HINT = "may result in an error when running in eager"


def is_input_error(exc: BaseException) -> bool:
    """Whether Dynamo's failure is an operator failing on the call's inputs (a ``str``
    where a tensor goes, shapes that do not multiply), which eager would raise too,
    rather than code Dynamo cannot trace."""
    if isinstance(exc, input_errors()):
        return True
    gb_type = getattr(exc, "gb_type", None) or ""
    return gb_type in _INPUT_BREAKS or _USER_ERROR_HINT in str(exc)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What escapes a fullgraph trace raw when a shape or a branch depends on a tensor's
    values (``lengths.tolist()`` deciding a split): the symbolic-shapes guard error and
    fake tensors' data-dependent output errors."""
    out: list[type[BaseException]] = []
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        out.append(GuardOnDataDependentSymNode)
    except ImportError:
        pass
    try:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
        )

        out += [DataDependentOutputException, DynamicOutputShapeException]
    except ImportError:
        pass
    return tuple(out)


def data_dependent_cause(exc: BaseException) -> str:
    """The user's line a data-dependent error names (its "Caused by:" line), if any."""
    for line in str(exc).splitlines():
        if line.startswith("Caused by:"):
            return line[len("Caused by:"):].strip()
    return ""


class _MetaErrorFilter(logging.Filter):
    """Drops fake tensors' "failed while attempting to run meta" log record: the error
    it logs (with a 30-line traceback) reaches the caller as an exception anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


_META_LOGGER = "torch._subclasses.fake_tensor"
_meta_filter = _MetaErrorFilter()


@contextlib.contextmanager
def quiet_meta_errors() -> Iterator[None]:
    """While tracing: no log spew for an operator that fails on fake tensors."""
    log = logging.getLogger(_META_LOGGER)
    log.addFilter(_meta_filter)
    try:
        yield
    finally:
        log.removeFilter(_meta_filter)


def graph_break_site(exc: BaseException) -> tuple[str | None, int | None, str]:
    """(file, line, reason) of a graph break, from one of :func:`graph_break_errors`."""
    frames = list(getattr(exc, "real_stack", None) or [])
    filename: str | None = None
    lineno: int | None = None
    if frames:
        filename, lineno = frames[-1].filename, frames[-1].lineno
    reason = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]
    return filename, lineno, reason


def aot_inference(on_forward: Callable[[torch.fx.GraphModule], None],
                  decompositions: Mapping[Any, Any] | None) -> Callable[..., Any]:
    """A Dynamo backend: AOTAutograd, the forward graph run by the eager kernels.

    ``on_forward`` sees each forward graph AOTAutograd produces (inputs mutated in place
    are kept in the graph, as an inference graph does).
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(fx_gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        on_forward(fx_gm)
        return make_boxed_func(fx_gm.forward)

    return aot_autograd(fw_compiler=fw_compiler,
                        decompositions=dict(decompositions) if decompositions else {},
                        keep_inference_input_mutations=True)


# -- guards handed to guard_filter_fn ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GuardEntry:
    """One guard Dynamo hands ``guard_filter_fn`` (a ``GuardFilterEntry``), as read here."""

    guard_type: str                  # Dynamo's name for it: TENSOR_MATCH, HASATTR, ...
    expr: str                        # the guarded source expression: L['self'].cfg.act
    value: Any                       # its value at trace time (if has_value)
    has_value: bool
    derived_types: frozenset[str]    # guard types this one implies (TYPE_MATCH)
    code_parts: tuple[str, ...]      # SHAPE_ENV: the shape relations as Python expressions
    _guard: Any = dataclasses.field(repr=False, compare=False)
    # Arguments read from the guard's source where a release does not pass them to its
    # builder (2.11's HASATTR: the attribute is the source's last step).
    _keywords: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False,
                                                     compare=False)

    def keyword(self, name: str) -> Any:
        """An argument the guard was built with: ``attr`` of HASATTR, ``key`` of DICT_CONTAINS."""
        if name in self._keywords:
            return self._keywords[name]
        fn = getattr(self._guard, "create_fn", None)
        kw = getattr(fn, "keywords", None) or {}
        if name in kw:
            return kw[name]
        args = getattr(fn, "args", ()) or ()
        return args[-1] if args else None

    def origin(self) -> str:
        """The traced line that made Dynamo install this guard, as ``copy.py:137 in
        deepcopy: d = id(x)``; "" where Dynamo kept no user stack for it."""
        stack = getattr(self._guard, "user_stack", None)
        if not stack:
            return ""
        f = stack[-1]
        name = str(f.filename).replace("\\", "/").rsplit("/", 1)[-1]
        return f"{name}:{f.lineno} in {f.name}: {(f.line or '').strip()}".rstrip(": ")


def guard_entries(entries: Iterable[Any]) -> list[GuardEntry]:
    """Dynamo's guard entries for one frame, read into one form across releases, plus the
    guards a release failed to build for reads made while tracing that frame
    (:func:`unguarded_reads_recorded`)."""
    out: list[GuardEntry] = []
    as_read = versions.at_least(2, 12)   # once per frame, not per guard (thousands)
    for e in entries:
        guard = e.orig_guard
        entry = GuardEntry(guard_type=e.guard_type, expr=guard.name, value=e.value,
                           has_value=bool(e.has_value),
                           derived_types=frozenset(e.derived_guard_types or ()),
                           code_parts=tuple(getattr(guard, "code_list", None) or ()),
                           _guard=guard)
        out.extend([entry] if as_read else [_as_in_2_12(entry, e),
                                            *_defaults_as_in_2_12(entry)])
    if _unguarded is not None:
        out.extend(_unguarded)
        _unguarded.clear()                # each frame's guards are built once, after it
    return out


# -- torch 2.11 and 2.12: outputs marked maybe-dynamic by the compiled graph -------------
# AOTAutograd's runtime wrapper in 2.11 and 2.12 marks each output dim it traced as
# symbolic with ``_dynamo_weak_dynamic_indices``, the attribute ``maybe_mark_dynamic``
# sets, which Dynamo (and cachecompile's signature) read as the user's mark. A replayed
# program marks nothing, as eager does, so the next cached method called on that output
# (a model's next block) saw another signature in the compiling process than in a warm
# one, and the warm process compiled it again. 2.13 stamps a separate, unguarded attribute
# instead (``_dynamo_propagated_dynamic_indices``); on 2.11 and 2.12 the live compiled
# graphs of a cached method mark nothing, as 2.13's and the warm path's do.
_MARK_HELPER = "maybe_mark_dynamic_helper"
_unmarked_depth = 0
_unmarked_lock = threading.Lock()
_real_mark: Any = None


@contextlib.contextmanager
def outputs_left_unmarked() -> Iterator[None]:
    """While a cached method's live compile runs (its cold call, and later live calls),
    its compiled graphs do not mark their outputs maybe-dynamic. Nothing on 2.13+."""
    global _unmarked_depth, _real_mark
    if versions.at_least(2, 13):
        yield
        return
    from torch._functorch._aot_autograd import runtime_wrappers

    with _unmarked_lock:
        if _unmarked_depth == 0:
            # (a 2.11/2.12 name: read and set by name, so it type-checks against 2.13+)
            _real_mark = getattr(runtime_wrappers, _MARK_HELPER)
            setattr(runtime_wrappers, _MARK_HELPER, lambda t, dims: None)
        _unmarked_depth += 1
    try:
        yield
    finally:
        with _unmarked_lock:
            _unmarked_depth -= 1
            if _unmarked_depth == 0:
                setattr(runtime_wrappers, _MARK_HELPER, _real_mark)


# -- torch 2.11: class attributes read without a guard -----------------------------------
# torch 2.11's Dynamo reads a literal or enum class attribute (``type(self).FLAG``,
# ``Cls.MODE``) as a constant with no source, so it builds no guard on it: a process whose
# class says otherwise would be served the value traced (torch.compile 2.11 is wrong there
# within one process too; a fresh process of it compiles again). 2.12 guards the read
# (CONSTANT_MATCH on ``<class source>.<name>``). On 2.11, while a frame is traced, each such
# read is recorded as the entry 2.12 would have built, and guard_entries adds it.
_unguarded: list[GuardEntry] | None = None


@contextlib.contextmanager
def unguarded_reads_recorded() -> Iterator[None]:
    """While tracing (TraceSession's first call), record the reads 2.11 leaves unguarded.
    Nothing is patched on 2.12 and later, which guard them."""
    global _unguarded
    if versions.at_least(2, 12) or _unguarded is not None:
        yield
        return
    from torch._dynamo.variables import user_defined
    from torch._dynamo.variables.constant import ConstantVariable

    cls_var = user_defined.UserDefinedClassVariable
    orig = cls_var.var_getattr

    def var_getattr(self: Any, tx: Any, name: str) -> Any:
        out = orig(self, tx, name)
        base = source_name(getattr(self, "source", None))
        if base is not None and getattr(out, "source", None) is None and _unguarded is not None:
            try:
                value = inspect.getattr_static(self.value, name)
            except AttributeError:
                return out
            if ConstantVariable.is_literal(value) or isinstance(value, enum.Enum):
                _unguarded.append(GuardEntry(
                    guard_type="CONSTANT_MATCH", expr=f"{base}.{name}", value=value,
                    has_value=True, derived_types=frozenset(), code_parts=(), _guard=None))
        return out

    _unguarded = []
    cls_var.var_getattr = var_getattr  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls_var.var_getattr = orig  # type: ignore[method-assign]
        _unguarded = None


def _defaults_as_in_2_12(entry: GuardEntry) -> list[GuardEntry]:
    """torch 2.11 reads an inlined function's literal defaults as constants with no guard
    (found by the guard sweep: ``fn.__defaults__ = (5.0,)`` in a fresh process was served
    the value traced); 2.12 guards each (CONSTANT_MATCH on ``fn.__defaults__[i]``). On 2.11
    a function matched by its code (CLOSURE_MATCH) gets the guards 2.12 builds, on its
    positional and keyword-only literal defaults."""
    fn = entry.value
    if entry.guard_type != "CLOSURE_MATCH" or not isinstance(fn, types.FunctionType):
        return []
    from torch._dynamo.variables.constant import ConstantVariable

    def const(expr: str, value: Any) -> GuardEntry:
        return GuardEntry(guard_type="CONSTANT_MATCH", expr=expr, value=value, has_value=True,
                          derived_types=frozenset(), code_parts=(), _guard=None)

    out: list[GuardEntry] = []
    defaults = fn.__defaults__ or ()
    if defaults:
        out.append(GuardEntry(guard_type="SEQUENCE_LENGTH", expr=f"{entry.expr}.__defaults__",
                              value=defaults, has_value=True, derived_types=frozenset(),
                              code_parts=(), _guard=None))
    out += [const(f"{entry.expr}.__defaults__[{i}]", v) for i, v in enumerate(defaults)
            if ConstantVariable.is_literal(v)]
    out += [const(f"{entry.expr}.__kwdefaults__[{k!r}]", v)
            for k, v in (fn.__kwdefaults__ or {}).items() if ConstantVariable.is_literal(v)]
    return out


def _as_in_2_12(entry: GuardEntry, e: Any) -> GuardEntry:
    """A torch 2.11 guard entry in the form 2.12 and later give it, so that capture reads
    one form.

    - 2.11 builds HASATTR on the attribute's own source (``base.attr``, an ``AttrSource``,
      perhaps inside an ``NNModuleSource``) and reads the name from it; 2.12 builds it on
      the base with ``attr=`` and names the base. 2.11's entry has no value for the base:
      whether the attribute was there is whether the entry could read it (``present``).
    - 2.11 has one DICT_CONTAINS / SET_CONTAINS with ``invert=``; 2.12 splits off
      DICT_NOT_CONTAINS / SET_NOT_CONTAINS."""
    if entry.guard_type == "HASATTR":
        src = getattr(entry._guard, "originating_source", None)
        src = getattr(src, "base", src) if type(src).__name__ == "NNModuleSource" else src
        base, member = getattr(src, "base", None), getattr(src, "member", None)
        name = source_name(base) if base is not None else None
        if name is None or not isinstance(member, str):
            return entry                  # capture names the guard it cannot read
        return dataclasses.replace(entry, expr=name, has_value=False, value=None,
                                   _keywords={"attr": member, "present": entry.has_value})
    if entry.guard_type in ("DICT_CONTAINS", "SET_CONTAINS") and entry.keyword("invert"):
        return dataclasses.replace(entry, guard_type=entry.guard_type.replace("_", "_NOT_", 1))
    return entry


# -- the graph Dynamo hands a backend ------------------------------------------------------
def source_name(src: Any) -> str | None:
    """A Dynamo ``Source``'s expression (``L['self'].head.weight``); ``name`` is a method
    in some releases and a property in others."""
    label = getattr(src, "name", None)
    if callable(label):
        label = label()
    return None if label is None else str(label)


def placeholder_source(node: Any) -> str | None:
    """The source expression Dynamo recorded for a placeholder (``L['x']``), if any."""
    return source_name(getattr(node.meta.get("grapharg"), "source", None)
                       or getattr(node, "_dynamo_source", None))


def example_value(node: Any) -> Any:
    """The fake value Dynamo traced a node with (a FakeTensor, a SymInt), if recorded."""
    return node.meta.get("example_value")


def known_int(d: Any) -> int | None:
    """A size as an int if it is one or its symbol is specialised; None while symbolic."""
    if type(d) is int:
        return d
    node = getattr(d, "node", None)
    return node.maybe_as_int() if node is not None else None


def size_hint(d: Any) -> Any:
    """The example value a symbolic size was traced with (None if it has none)."""
    return getattr(getattr(d, "node", None), "hint", None)


# -- the name lookups Dynamo resolves while it traces ----------------------------------------
@dataclasses.dataclass(frozen=True)
class Resolved:
    """One name Dynamo looked up while it traced a frame, and the object it looked in.

    ``how``: ``"attr"`` (``obj.name``, ``getattr(obj, "name")``), ``"default"``
    (``getattr(obj, "name", default)``), ``"hasattr"``, or ``"global"`` (a name the code
    reads as a global that its function's globals lacked: a builtin). ``source``: Dynamo's
    source expression of ``obj`` (``L['self']``, ``type(L['self'])``, ``G['helpers']``),
    None where the object has none (made during the trace). For ``"global"``, ``obj`` is
    the function's globals dict, ``source`` None, and ``root`` whether those are the
    traced frame's own globals (else a function the frame inlines from another module)."""

    how: str
    name: str
    obj: Any = dataclasses.field(repr=False, compare=False)
    source: str | None
    root: bool = False
    # Dynamo took what it found as an attribute it does not model (a GetAttrVariable: an
    # attribute of a metaclass, say), whose value it reads later without a guard.
    unguarded: bool = False
    # ``super(after, obj).name``: the lookup starts after this class in the MRO.
    after: type | None = dataclasses.field(default=None, repr=False)


_recording = threading.local()
_hooks_lock = threading.Lock()
_hooked = False
_NO_VALUE = object()


@contextlib.contextmanager
def recording_lookups() -> Iterator[None]:
    """While inside, each name lookup Dynamo resolves in this thread is kept for
    :func:`recorded_lookups` (other threads' compiles are not seen)."""
    _install_lookup_hooks()
    previous = getattr(_recording, "sink", None)
    _recording.sink = []
    try:
        yield
    finally:
        _recording.sink = previous


def recorded_lookups() -> list[Resolved] | None:
    """The lookups recorded since the last call (one frame's, when its guards are being
    built); None outside :func:`recording_lookups`: not recorded, which is not "none made"
    (a frame whose lookups were not recorded is not stored)."""
    sink: list[Resolved] | None = getattr(_recording, "sink", None)
    if sink is None:
        return None
    out = list(sink)
    sink.clear()
    return out


def _install_lookup_hooks() -> None:
    """Wrap the three places Dynamo resolves a name by Python's rules: ``getattr`` (every
    ``LOAD_ATTR`` goes through it), ``hasattr``, and a global its function's globals lack
    (then a builtin). Installed once per process; they record only inside
    :func:`recording_lookups`, and never change what Dynamo does."""
    global _hooked
    with _hooks_lock:
        if _hooked:
            return
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase

        if versions.at_least(2, 14):
            _hook_generic_getattr()
        elif versions.at_least(2, 13):
            _hook_getattr_classes()
        else:
            _hook_builtin_handlers()
        load_builtin = InstructionTranslatorBase.__dict__["load_builtin_from_argval"]

        def _load_builtin(self: Any, argval: Any) -> Any:
            sink = getattr(_recording, "sink", None)
            if sink is not None and isinstance(argval, str):
                sink.append(Resolved("global", argval, self.f_globals, None,
                                     root=self.f_globals is self.output.global_scope))
            return load_builtin(self, argval)

        InstructionTranslatorBase.load_builtin_from_argval = _load_builtin  # type: ignore[method-assign]
        _hooked = True


def _recorded_getattr(tx: Any, obj: Any, name: Any, how: str,
                      call: Callable[[], Any]) -> Any:
    """``call()`` (Dynamo's getattr), the lookup it makes recorded with what it gave."""
    sink = getattr(_recording, "sink", None)
    note = _lookup(tx, obj, name, how) if sink is not None else None
    result: Any = None
    try:
        result = call()
        return result
    finally:    # a lookup that raised (AttributeError in the trace) was made too
        if note is not None and sink is not None:
            sink.append(dataclasses.replace(note, unguarded=_unmodelled(result)))


def _recorded_hasattr(tx: Any, obj: Any, name: Any) -> None:
    sink = getattr(_recording, "sink", None)
    if sink is not None:
        note = _lookup(tx, obj, name, "hasattr")
        if note is not None:
            sink.append(note)


def _hook_hasattr_class() -> None:
    """2.13 and later: ``hasattr`` is a variable of its own."""
    from torch._dynamo.variables.builtin import HasAttrBuiltinVariable

    call_hasattr = HasAttrBuiltinVariable.call_function

    def _call_hasattr(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if len(args) == 2 and not kwargs:
            _recorded_hasattr(tx, args[0], args[1])
        return call_hasattr(self, tx, args, kwargs)

    HasAttrBuiltinVariable.call_function = _call_hasattr  # type: ignore[method-assign]


def _hook_generic_getattr() -> None:
    """2.14 and later: ``LOAD_ATTR`` and ``getattr()`` call ``generic_getattr`` (Dynamo's
    ``PyObject_GetAttr``), which the modules that use it imported by name: each binding of
    the function in Dynamo's loaded modules is replaced (modules imported later import the
    wrapper from its module)."""
    from torch._dynamo.variables import object_protocol as op

    protocol: Any = op                    # 2.14+ names: checked against 2.13 by mypy
    original = protocol.generic_getattr
    no_default = protocol._NO_DEFAULT

    def generic_getattr(tx: Any, obj: Any, name: Any, default: Any = no_default) -> Any:
        how = "attr" if default is no_default else "default"
        return _recorded_getattr(tx, obj, _Const(name), how,
                                 lambda: original(tx, obj, name, default))

    for mod in list(sys.modules.values()):
        if (getattr(mod, "__name__", "").startswith("torch._dynamo")
                and getattr(mod, "generic_getattr", None) is original):
            setattr(mod, "generic_getattr", generic_getattr)  # noqa: B010
    _hook_hasattr_class()


class _Const:
    """A name given as a string, seen as Dynamo's constant variable for it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def is_python_constant(self) -> bool:
        return True

    def as_python_constant(self) -> Any:
        return self.value


def _hook_getattr_classes() -> None:
    """2.13: ``getattr`` and ``hasattr`` are variables of their own."""
    from torch._dynamo.variables.builtin import GetAttrBuiltinVariable

    call_getattr = GetAttrBuiltinVariable._call_getattr

    def _call_getattr(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if len(args) < 2:
            return call_getattr(self, tx, args, kwargs)
        return _recorded_getattr(tx, args[0], args[1], "default" if len(args) > 2 else "attr",
                                 lambda: call_getattr(self, tx, args, kwargs))

    GetAttrBuiltinVariable._call_getattr = _call_getattr  # type: ignore[method-assign]
    _hook_hasattr_class()


def _hook_builtin_handlers() -> None:
    """2.11 and 2.12: ``BuiltinVariable.call_getattr`` / ``call_hasattr``, which its
    handlers bind when they are made: the handlers made before are dropped."""
    from torch._dynamo.variables import builtin

    BuiltinVariable: Any = builtin.BuiltinVariable     # 2.13 and later lack these names
    call_getattr = BuiltinVariable.call_getattr
    call_hasattr = BuiltinVariable.call_hasattr

    def _call_getattr(self: Any, tx: Any, obj: Any, name_var: Any, default: Any = None) -> Any:
        return _recorded_getattr(tx, obj, name_var, "attr" if default is None else "default",
                                 lambda: call_getattr(self, tx, obj, name_var, default))

    def _call_hasattr(self: Any, tx: Any, obj: Any, attr: Any) -> Any:
        _recorded_hasattr(tx, obj, attr)
        return call_hasattr(self, tx, obj, attr)

    BuiltinVariable.call_getattr = _call_getattr
    BuiltinVariable.call_hasattr = _call_hasattr
    cache = BuiltinVariable.call_function_handler_cache
    for key in [k for k in cache if k and k[0] in (getattr, hasattr)]:
        del cache[key]


def _lookup(tx: Any, obj: Any, name: Any, how: str) -> Resolved | None:
    """The lookup of ``name`` in the object ``obj`` stands for, or None where it is no
    lookup by Python's rules in a live object."""
    try:
        realize = getattr(obj, "realize", None)
        if callable(realize):
            obj = realize()
        if not name.is_python_constant():
            return None
        attr = name.as_python_constant()
        if not isinstance(attr, str):
            return None
        # An attribute the trace itself set earlier is read from there, not looked up.
        if tx.output.side_effects.has_pending_mutation_of_attr(obj, attr):
            return None
        after = None
        if _is_super(obj):
            # super(T, self).name: looked up in self's MRO after T.
            after = getattr(obj.typevar, "value", None)
            obj = obj.objvar
            if not isinstance(after, type) or obj is None:
                return None
        value = _looked_in(tx, obj)
        if value is _NO_VALUE:
            return None
        src = getattr(obj, "source", None)
        return Resolved(how, attr, value, source_name(src) if src else None, after=after)
    except Exception:  # recording must never change the trace
        logger.debug("recording a lookup failed", exc_info=True)
        return None


def _is_super(vt: Any) -> bool:
    from torch._dynamo.variables.misc import SuperVariable

    return isinstance(vt, SuperVariable)


def _unmodelled(result: Any) -> bool:
    from torch._dynamo.variables.misc import GetAttrVariable

    return isinstance(result, GetAttrVariable)


def _looked_in(tx: Any, vt: Any) -> Any:
    """The live object a variable stands for, where a name lookup in it follows Python's
    rules on a user object, class or module (else _NO_VALUE: tensors, constants,
    containers, functions, which Dynamo models itself)."""
    from torch._dynamo.variables.misc import PythonModuleVariable
    from torch._dynamo.variables.nn_module import NNModuleVariable
    from torch._dynamo.variables.user_defined import (
        UserDefinedClassVariable,
        UserDefinedObjectVariable,
    )

    if isinstance(vt, NNModuleVariable):
        return tx.output.get_submodule(vt.module_key)
    if isinstance(vt, (UserDefinedObjectVariable, UserDefinedClassVariable,
                       PythonModuleVariable)):
        return getattr(vt, "value", _NO_VALUE)
    return _NO_VALUE
# -- the frame Dynamo is compiling (graph breaks: several frames per call) ------------------
@dataclasses.dataclass(frozen=True)
class CompilingFrame:
    """The frame Dynamo is converting, as its own ``convert_frame._compile`` holds it: the
    code object, its transformed code (once made: None inside the backend), the frame's
    globals and its locals at entry (the frame's arguments)."""

    code: types.CodeType
    out_code: types.CodeType | None
    f_globals: dict[str, Any]
    f_locals: dict[str, Any]


# The functions of torch/_dynamo/convert_frame.py whose locals name the frame being
# converted: ``_compile(code, globals, locals, ...)`` and its ``_compile_inner``, which
# holds the transformed code as ``out_code`` once made (2.13 and 2.14 spell them so).
_COMPILE = "_compile"
_COMPILE_INNER = "_compile_inner"


def compiling_frame() -> CompilingFrame | None:
    """The frame Dynamo is converting, read from its own call stack; called from inside
    a backend or a ``guard_filter_fn`` (which Dynamo calls while converting one frame).
    None where the stack holds no such frame (another release's layout)."""
    f: Any = sys._getframe(1)
    inner: Any = None
    while f is not None:
        code = f.f_code
        if code.co_filename.endswith("convert_frame.py"):
            if code.co_name == _COMPILE_INNER and inner is None:
                inner = f
            elif code.co_name == _COMPILE:
                loc = f.f_locals
                frame_code, g, l_ = loc.get("code"), loc.get("globals"), loc.get("locals")
                if not (isinstance(frame_code, types.CodeType) and isinstance(g, dict)
                        and isinstance(l_, dict)):
                    return None
                out = inner.f_locals.get("out_code") if inner is not None else None
                return CompilingFrame(frame_code,
                                      out if isinstance(out, types.CodeType) else None,
                                      g, dict(l_))
        f = f.f_back
    return None


def frame_entry_state() -> str | None:
    """Dynamo's global-state snapshot taken when it began converting the current frame
    (what that frame's GLOBAL_STATE guard compares with), as :func:`runtime.global_state`
    spells it; None outside a conversion."""
    from torch._dynamo import convert_frame

    state = getattr(convert_frame, "initial_global_state", None)
    return None if state is None else str(state.__getstate__())


def graph_callable(value: Any) -> Any:
    """What a backend returned, from the ``__compiled_fn_*`` global Dynamo installed for
    it (``torch._dynamo.disable`` wraps it)."""
    seen = 0
    while seen < 8 and hasattr(value, "__wrapped__"):
        value = value.__wrapped__
        seen += 1
    return value


def resume_code(value: Any) -> types.CodeType | None:
    """The code of a resume function from the ``__resume_at_*`` global Dynamo installed:
    the function itself, or (for code with free variables) a factory taking the closure,
    whose own closure holds the code."""
    if isinstance(value, types.FunctionType):
        if value.__code__.co_name.startswith("torch_dynamo_resume_in_"):
            return value.__code__
        for cell in value.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            if isinstance(contents, types.CodeType):
                return contents
    return None


def is_resume_code(code: types.CodeType) -> bool:
    """Whether Dynamo generated ``code`` as a continuation after a graph break."""
    return code.co_name.startswith("torch_dynamo_resume_in_")


def ran_as_written(code: types.CodeType) -> bool:
    """Whether Dynamo met a frame of ``code`` and left it as written (it skipped it: no
    graph, a break it cannot resume from), rather than never meeting one: the code is
    among those Dynamo was asked to convert and it has no compiled entry."""
    from torch._dynamo.convert_frame import input_codes

    return code in input_codes and not transformed_code(code)
