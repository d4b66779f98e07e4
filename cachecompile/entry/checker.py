"""An entry's portable guards compiled into a checker: plain Python over the method's own
arguments, checked in a warm process without Dynamo.

:mod:`cachecompile.entry.guards` says what a portable guard is; this module turns an
entry's list of them back into two functions over the method's own arguments:

* ``per_call``: the guards that read the call's arguments (tensor metadata of inputs,
  shape relations such as ``x.size(0) <= 8``, argument values Dynamo specialised on,
  aliasing between inputs). They run on every call, like Dynamo's.
* ``full``: every guard, including the module's attributes, globals, inlined functions
  and global state. With ``GuardMode.ALWAYS`` (the default) it runs on every call; with
  ``GuardMode.FIRST`` on each signature's first call in a process.

A :class:`Checker` is built in named steps: *translate* (each guard to a Python condition
in the checker's namespace), the closure *prologue*, the *bodies* (with each object path
bound once where ``full`` runs on every call), *compile* (or load the code object the
entry stores). Only on a miss: the *first failure*, *explain* and *failure* say which guard
failed and what the call had. The two compiled functions are plain attributes, so a warm
call pays for no Python beyond them.

This module is on the warm path: it imports ``torch`` only (private names through
:mod:`cachecompile._torch.runtime`).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import xxhash

from cachecompile._torch import runtime
from cachecompile.entry import codeobj
from cachecompile.entry.guard_kinds import KINDS, TABLE
from cachecompile.entry.guards import (
    GLOBAL_RE,
    LOCAL_RE,
    GuardDict,
    compared_operand,
    describe,
    guard_lines,
    indent,
    user_text,
)
from cachecompile.errors import UnsupportedProgramError

logger = logging.getLogger(__name__)

# The pure helpers Dynamo's source expressions and shape guards may name
# (``___odict_getitem(L['self']._modules, 'lin')``, ``not __math_isnan(...)``).
_EXPR_HELPERS: dict[str, Any] = {
    "math": math, "torch": torch, "inf": float("inf"), "device": torch.device,
    "___odict_getitem": collections.OrderedDict.__getitem__,
    "___dict_contains": lambda a, b: dict.__contains__(b, a),
    "___namedtuple_fields": lambda x: x._fields,
    "___dataclass_fields": dataclasses.fields,
    "__math_isnan": math.isnan,
    "___as_tensor": runtime.as_tensor_fullprec,
    # Whether an environment variable is set (guard_capture: variables read while unset).
    "___environ_has": lambda name: name in os.environ,
    "___environ_get": lambda name: os.environ.get(name),
    # Whether a module defines a global (guard_capture: a builtin the method calls is not
    # shadowed by one); a module not in sys.modules has none we could see.
    "___module_has": lambda module, name: name in getattr(sys.modules.get(module), "__dict__", ()),
    "___module_get": lambda module, name: getattr(sys.modules.get(module), "__dict__", {})[name],
    # Helpers added since entries stored their checkers' lines come last, and do not
    # count in the constants' names (``_LATER_HELPERS``): a stored body keeps its digest.
    # A numpy value Dynamo traced as a tensor (``np.lcm(...) % k``), guarded as one.
    "___from_numpy": runtime.from_numpy,
}
_LATER_HELPERS = 1

# The order a checker runs the kinds in, by name.
_KIND_RANK = {k: i for i, k in enumerate(KINDS)}

# What ``_first_failure`` returns besides a guard's index.
_ALL_HOLD, _RAISED = -1, -2


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the checker was compiled from, for :mod:`cachecompile.entry.guard_tree`:
    the guards in check order, each one's Python condition, and the namespace and
    parameter text those conditions run in."""

    func: types.FunctionType
    guards: list[GuardDict]
    conds: list[str]
    env: dict[str, Any]
    params: str
    names: list[str]

    def function(self, name: str, src: str) -> Callable[..., Any]:
        """``src`` (defining ``name``) compiled in the checker's namespace."""
        exec(compile(src, f"<cachecompile {name} {self.func.__qualname__}>", "exec"),
             self.env)
        fn: Callable[..., Any] = self.env[name]
        return fn


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a kind's Python check is compiled with (guard_kinds.Source)."""

    const: Callable[[Any], str]
    rewrite: Callable[[str], str]


@dataclasses.dataclass(frozen=True)
class _Cond:
    """One guard, translated: its Python condition and what a miss report needs."""

    python: str       # the condition, over the checker's parameters and namespace
    per_call: bool    # it reads the call's arguments
    text: str         # the guard in the user's terms
    expr: str         # the guarded expression, translated ("" for state guards)
    guard: GuardDict  # the portable guard itself


def build_checker(func: types.FunctionType, guards: Sequence[GuardDict],
                  globals_: Mapping[str, Any], *, every_call: bool = False,
                  lines: Mapping[str, Any] | None = None) -> Checker:
    """Compile ``guards`` into functions that take exactly the method's arguments
    (the entry point; see :class:`Checker`)."""
    return Checker(func, guards, globals_, every_call=every_call, lines=lines)


class Checker:
    """The compiled guard functions of one entry, bound to the live method.

    ``every_call``: ``full`` will run on every call (``guards="always"``), so its object
    paths are shared (see ``guard_lines``). Otherwise it runs once per signature and is
    compiled as it is: sharing parses every guard, which costs a warm start more than
    the one check saves (~0.2 s for a decoder's few hundred guards on a slow core).

    ``lines``: the entry's stored :meth:`lines` (``meta["checker"]``), the shared bodies
    the compiling process derived from these very conditions: used only where their
    digest is that of the conditions derived here, so a warm process parses no guard (one
    ``compile`` per entry) and never runs a body made for other guards."""

    # The checks, plain functions (no method binding on the hot path).
    per_call: Callable[..., bool]
    full: Callable[..., bool]

    def __init__(self, func: types.FunctionType, guards: Sequence[GuardDict],
                 globals_: Mapping[str, Any], *, every_call: bool = False,
                 lines: Mapping[str, Any] | None = None) -> None:
        self._func = func
        self._params, names = _params(func)
        # The namespace every body runs in; the order of its first names fixes the
        # constants' names (``__cc_c<n>``), which the stored bodies' digest covers.
        self._env: dict[str, Any] = {"__cc_G": globals_, "__cc_closure": func.__closure__ or (),
                                     **_EXPR_HELPERS}
        self._conds = self._translate(guards, (tuple(names), tuple(func.__code__.co_freevars)))
        self._prologue = self._closure_prologue()
        self._digest = _conds_digest(self._conds, self._params, self._prologue)
        stored = lines if lines is not None and lines.get("digest") == self._digest else None
        # The bodies by function name, derived once (or as stored): the first compile and
        # ``lines`` share them.
        self._shared: dict[str, str] = {}
        if stored is not None:
            self._shared["per_call"], self._shared["full"] = (str(stored["per_call"]),
                                                              str(stored["full"]))
        self.per_call, self.full = self._compile(stored if every_call else None, every_call)
        self.n_guards = len(self._conds)
        self.n_per_call = len(self._per_call_conds)
        self.parts = Parts(func=func, guards=[c.guard for c in self._conds],
                           conds=self._all_conds, env=self._env, params=self._params,
                           names=names)

    # -- translate ----------------------------------------------------------------------
    def _translate(self, guards: Sequence[GuardDict],
                   known: tuple[tuple[str, ...], tuple[str, ...]]) -> list[_Cond]:
        """Each guard, in check order, as a Python condition over the method's parameters
        (its kind's row of guard_kinds.TABLE writes it)."""
        src = _Source(self._const, lambda expr: _rewrite(expr, known))
        out: list[_Cond] = []
        for g in sorted(guards, key=lambda g: _KIND_RANK.get(g["kind"], 99)):
            kind = g["kind"]
            e = _rewrite(g.get("expr", ""), known) if g.get("expr") else ""
            if kind not in TABLE:
                raise UnsupportedProgramError(f"entry holds a guard of unknown kind {kind!r}")
            out.append(_Cond(TABLE[kind].python(src, e, g.get("value")), bool(g.get("args")),
                             g.get("text", ""), e, g))
        return out

    def _const(self, v: Any) -> str:
        """A value a condition compares with, bound in the namespace under a fresh name."""
        name = f"__cc_c{len(self._env) - _LATER_HELPERS}"
        self._env[name] = v
        return name

    @property
    def _all_conds(self) -> list[str]:
        return [c.python for c in self._conds]

    @property
    def _per_call_conds(self) -> list[str]:
        return [c.python for c in self._conds if c.per_call]

    # -- prologue and bodies --------------------------------------------------------------
    def _closure_prologue(self) -> str:
        """The closure variables a condition reads, bound from the method's cells."""
        freevars = self._func.__code__.co_freevars
        every = "\n".join(self._all_conds) if freevars else ""
        return "".join(f"    {n} = __cc_closure[{i}].cell_contents\n"
                       for i, n in enumerate(freevars) if n in every)

    def _body(self, which: str, selected: list[str], share: bool) -> str:
        if not share:
            return guard_lines(selected, False)
        if which not in self._shared:
            self._shared[which] = guard_lines(selected, True)
        return self._shared[which]

    def _function(self, name: str, body_text: str) -> str:
        # Guards run in order and stop at the first that fails; with path sharing each
        # object path they read (``self.m._modules['h']...``) is evaluated once, where a
        # guard first needs it, as Dynamo's guard tree shares its accessors. A guard that
        # raises (a missing attribute, a wrong type) is a failed guard.
        return (f"def {name}({self._params}):\n    try:\n{indent(self._prologue)}"
                f"{indent(indent(body_text))}"
                "        return True\n    except Exception:\n        return False\n")

    def _source(self, share_full: bool) -> str:
        return (self._function("__cc_per_call",
                               self._body("per_call", self._per_call_conds, True))
                + self._function("__cc_full",
                                 self._body("full", self._all_conds, share_full)))

    # -- compile --------------------------------------------------------------------------
    def _compile(self, stored: Mapping[str, Any] | None, every_call: bool
                 ) -> tuple[Callable[..., bool], Callable[..., bool]]:
        """``per_call`` and ``full``: from the stored code object where there is one for
        ``guards="always"`` (no parse and no compile here: its constants are plain, and
        codeobj checks them), else compiled from the bodies."""
        names = ("__cc_per_call", "__cc_full")
        code = _stored_code(stored) if stored is not None else None
        if code is not None:
            per_call, full = self._loaded(code, names)
        else:
            per_call, full = self._compiled(self._source(every_call), names, "guards")
        return per_call, full

    def _compiled(self, src: str, names: Sequence[str], where: str
                  ) -> list[Callable[..., Any]]:
        try:
            code = compile(src, f"<cachecompile {where} {self._func.__qualname__}>", "exec")
        except SyntaxError as err:
            raise UnsupportedProgramError(f"guards do not compile: {err}") from err
        return self._loaded(code, names)

    def _loaded(self, code: types.CodeType, names: Sequence[str]) -> list[Callable[..., Any]]:
        """The functions ``code`` defines, run in the namespace, with the method's defaults
        (a guard reads an argument left out as the method would see it)."""
        exec(code, self._env)
        out: list[Callable[..., Any]] = []
        for n in names:
            f = self._env[n]
            f.__defaults__ = self._func.__defaults__
            f.__kwdefaults__ = self._func.__kwdefaults__
            out.append(f)
        return out

    def lines(self) -> dict[str, str]:
        """What the entry stores so that a warm process builds this checker without
        parsing a guard or compiling (``meta["checker"]``): the shared bodies and their
        code object (marshal, base64), for ``guards="always"``."""
        out = {"digest": self._digest,
               "per_call": self._body("per_call", self._per_call_conds, True),
               "full": self._body("full", self._all_conds, True)}
        data, consts = codeobj.dumps(compile(self._source(True), f"<cachecompile guards "
                                             f"{self._func.__qualname__}>", "exec"))
        if not consts:
            out["code"] = base64.b64encode(data).decode("ascii")
        return out

    # -- on a miss: which guard failed, and what the call had ----------------------------------
    def _first_failure(self, *args: Any, **kwargs: Any) -> int:
        # Only on a miss: which guard failed first, compiled when first needed (a warm hit
        # never pays for it). A guard that raises (it reads an attribute that is gone) is
        # that guard failing, named as such, not an anonymous error.
        if "__cc_first_failure" not in self._env:
            try:
                self._compiled(self._report_source(), ("__cc_first_failure",),
                               "guard report")
            except UnsupportedProgramError:  # the same guards compiled as ``full``: unseen
                return _RAISED
        return int(self._env["__cc_first_failure"](*args, **kwargs))

    def _report_source(self) -> str:
        """A function returning the index of the first guard that fails (or raises),
        ``_ALL_HOLD`` when none does, ``_RAISED`` when the prologue raises."""
        lines = [f"        try:\n            if not ({c.python}): return {i}\n"
                 f"        except Exception:\n            return {i}\n"
                 for i, c in enumerate(self._conds)]
        return (f"def __cc_first_failure({self._params}):\n    try:\n{indent(self._prologue)}"
                + "".join(lines) + f"    except Exception:\n        return {_RAISED}\n"
                f"    return {_ALL_HOLD}\n")

    def explain(self, *args: Any, **kwargs: Any) -> str | None:
        """The first failing guard in the user's terms with what the call had; None when
        every guard holds."""
        return self._explain_at(self._first_failure(*args, **kwargs), args, kwargs)

    def failure(self, *args: Any, **kwargs: Any) -> tuple[str, str, str] | None:
        """The first failing guard, found once: (the explanation, what the guard is about:
        ``input_ids``, ``self.n``, ``global state``, bounded by the code, not the values,
        so counters can be kept per subject, and the value this entry was made for, as
        text); None when every guard holds."""
        i = self._first_failure(*args, **kwargs)
        if i == _ALL_HOLD:
            return None
        wanted = "" if i < 0 else json.dumps(self._conds[i].guard.get("value"), sort_keys=True,
                                               default=repr)
        return self._explain_at(i, args, kwargs) or "a guard failed", self._subject_at(i), wanted

    def _explain_at(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        if i == _ALL_HOLD:
            return None
        if i == _RAISED:
            return "a guard raised while being checked"
        cond = self._conds[i]
        text, kind = cond.text or cond.python, str(cond.guard["kind"])
        if kind == "global_state":
            # Say which setting changed (autocast, grad mode, threads, ...), with both values.
            diff = runtime.global_state_difference(str(cond.guard.get("value")))
            return f"{text} (changed: {diff})" if diff else text
        if not cond.expr:
            return text
        return f"{text} (got {self._observed(cond, args, kwargs)})"

    def _observed(self, cond: _Cond, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """What the call had where ``cond`` failed: its guarded expression evaluated (only
        on a miss), or why it could not be."""
        kind, expr = str(cond.guard["kind"]), cond.expr
        if kind == "expr":
            # ``n == 2`` failed: say what ``n`` was (3), not what the comparison was (False).
            expr = compared_operand(expr) or expr
        src = f"def __cc_observe({self._params}):\n{self._prologue}    return {expr}\n"
        try:
            scope = dict(self._env)
            exec(compile(src, "<cachecompile observe>", "exec"), scope)
            obs = scope["__cc_observe"]
            obs.__defaults__, obs.__kwdefaults__ = (self._func.__defaults__,
                                                    self._func.__kwdefaults__)
            return describe(obs(*args, **kwargs), kind, cond.guard.get("value"))
        except AttributeError as e:  # the attribute is gone: say which
            return f"no attribute {e.name!r}: it is gone" if e.name else f"nothing: {e}"
        except (KeyError, IndexError) as e:
            return f"no item {e.args[0]!r}: it is gone" if e.args else "nothing: an item is gone"
        except Exception as e:  # the expression itself failed: say so
            return f"the expression could not be read ({type(e).__name__}: {e})"

    def _subject_at(self, i: int) -> str:
        if i < 0:
            return "a guard that raised"
        g = self._conds[i].guard
        kind = str(g.get("kind"))
        if kind in ("global_state", "modes", "default_device"):
            return kind.replace("_", " ")
        expr = str(g.get("expr") or "")
        if kind == "expr":
            expr = compared_operand(expr) or expr
        return user_text(expr) or kind


def _params(func: types.FunctionType) -> tuple[str, list[str]]:
    """The parameter list text of ``func`` (defaults filled in afterwards) and its names."""
    sig = inspect.signature(func, follow_wrapped=False)
    parts: list[str] = []
    names: list[str] = []
    star_done = False
    for p in sig.parameters.values():
        names.append(p.name)
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star_done:
                parts.append("*")
                star_done = True
            parts.append(f"{p.name}=None" if p.default is not p.empty else p.name)
        else:  # positional-only or positional-or-keyword ("/" is placed below)
            parts.append(f"{p.name}=None" if p.default is not p.empty else p.name)
    if any(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values()):
        last = max(i for i, p in enumerate(sig.parameters.values()) if p.kind is p.POSITIONAL_ONLY)
        parts.insert(last + 1, "/")
    return ", ".join(parts), names


@functools.lru_cache(maxsize=1 << 16)
def _rewrite(expr: str, known: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    """Dynamo's source expression in the checker's names (``L['x']`` -> ``x``,
    ``G['n']`` -> ``__cc_G['n']``); ``known``: the method's parameters and free
    variables, the only locals a guard may read. Cached: the entries of one method (its
    sizes, its variants) hold mostly the same expressions."""
    names, freevars = known

    def local(m: re.Match[str]) -> str:
        n = m.group(1)
        if n not in names and n not in freevars:
            raise UnsupportedProgramError(f"guard reads an unknown local {n!r}: {expr}")
        return n
    return GLOBAL_RE.sub(lambda m: f"__cc_G[{m.group(1)!r}]", LOCAL_RE.sub(local, expr))


def _stored_code(stored: Mapping[str, Any]) -> types.CodeType | None:
    """The checker's code object an entry stores (see ``Checker.lines``); None where it
    holds none or it does not load (then the bodies are compiled)."""
    data = stored.get("code")
    if not isinstance(data, str):
        return None
    try:
        return codeobj.loads(base64.b64decode(data, validate=True), [])
    except (UnsupportedProgramError, ValueError):
        logger.debug("stored guard code does not load: compiling its bodies", exc_info=True)
        return None


def _conds_digest(conds: Sequence[_Cond], params: str, prologue: str) -> str:
    """What a stored body was derived from: the checker's parameters and closure prologue,
    every condition, in order, and which run per call."""
    h = xxhash.xxh3_128()
    h.update(f"{params}\0{prologue}\0".encode())
    for c in conds:
        h.update(f"{int(c.per_call)}{c.python}\0".encode())
    return h.hexdigest()
