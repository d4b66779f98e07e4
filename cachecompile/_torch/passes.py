"""Inductor's custom-pass objects, read without importing Inductor.

A ``PatternMatcherPass`` filled by ``register_replacement`` holds what the pass does in
private places: its ``patterns`` dict of ``PatternEntry`` objects, and, for a replacement
rule, the user's search and replacement functions inside the closure of the ``check_fn``
that ``register_replacement`` builds. :func:`pattern_rules` reads them out so that
:mod:`cachecompile.key.passes` can key each rule by the code of those functions.

This runs when a cached method's key is computed, also in a warm process, so it never
imports ``torch._inductor``: a pass object can only exist if the user's code imported its
module already, so looking the class up in ``sys.modules`` is enough.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable
from typing import Any

# (module, attribute path) for every private name below: probed with the Inductor part
# (they matter only where a pattern pass exists, i.e. where Inductor is imported anyway).
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch._inductor.pattern_matcher", "PatternMatcherPass"),
    ("torch._inductor.pattern_matcher", "PatternPrettyPrinter"),
    ("torch._inductor.pattern_matcher", "ReplacementPatternEntry"),
    ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
)

_PATTERN_MATCHER = "torch._inductor.pattern_matcher"
_CUSTOM_GRAPH_PASS = "torch._inductor.custom_graph_pass"
# Free variables of register_replacement's check_fn that carry what the rule does.
_REPLACEMENT_FUNCTIONS = ("search_fn", "replace_fn", "extra_check")
_REPLACEMENT_VALUES = ("scalar_workaround", "exclusive_arg_names")


def _loaded_class(module: str, name: str) -> type | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def is_pattern_pass(obj: Any) -> bool:
    """Whether ``obj`` is an Inductor ``PatternMatcherPass`` (never imports Inductor)."""
    cls = _loaded_class(_PATTERN_MATCHER, "PatternMatcherPass")
    return cls is not None and isinstance(obj, cls)


@dataclasses.dataclass
class PatternRule:
    """One entry of a pattern pass, as data."""

    kind: str                          # the entry's class: ReplacementPatternEntry, ...
    target: str                        # the (op, target) it is registered under
    pattern: str                       # the pattern it matches, as Inductor prints it
    functions: dict[str, Callable[..., Any]]  # the user's code: search/replace/handler
    values: dict[str, Any]             # other inputs of the rule (scalar_workaround, ...)
    opaque: dict[str, Any]             # callables of unknown role (keyed as they are)


def pass_settings(p: Any) -> dict[str, Any]:
    """The pass's own settings that change what it does."""
    return {"pass_name": getattr(p, "pass_name", None),
            "prevent_match_across_mutations": getattr(p, "prevent_match_across_mutations", None)}


def pattern_rules(p: Any) -> list[PatternRule]:
    """Every rule of a ``PatternMatcherPass``, in the order the pass tries them."""
    rules: list[PatternRule] = []
    for (op, target), entries in list(p.patterns.items()):
        for entry in entries:
            rules.append(_rule(f"{op}:{target}", entry))
    return rules


def _pattern_text(pattern: Any) -> str:
    printer = getattr(sys.modules.get(_PATTERN_MATCHER), "PatternPrettyPrinter", None)
    if printer is not None:
        try:
            return str(printer.run(pattern))
        except Exception:  # a pattern the printer does not know: its repr
            pass
    return repr(pattern)


def _closure(fn: Any) -> dict[str, Any] | None:
    """A function's free variables by name (None if it is not a plain function)."""
    if not isinstance(fn, types.FunctionType):
        return None
    out: dict[str, Any] = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            out[name] = None
    return out


def _rule(target: str, entry: Any) -> PatternRule:
    kind = type(entry).__name__
    rule = PatternRule(kind=kind, target=target, pattern=_pattern_text(entry.pattern),
                       functions={}, values={}, opaque={})
    check = getattr(entry, "extra_check", None)
    cells = _closure(check)
    if (kind == "ReplacementPatternEntry" and cells is not None
            and all(n in cells for n in _REPLACEMENT_FUNCTIONS)):
        # register_replacement's check_fn: the user's functions are in its closure.
        for n in _REPLACEMENT_FUNCTIONS:
            rule.functions[n] = cells[n]
        for n in _REPLACEMENT_VALUES:
            rule.values[n] = cells.get(n)
        given = cells.get("search_fn_pattern")
        rule.values["search_fn_pattern"] = None if given is None else _pattern_text(given)
        trace_fn = cells.get("trace_fn")
        rule.values["trace_fn"] = getattr(trace_fn, "__name__", None)
        return rule
    handler = getattr(entry, "handler", None)
    if handler is not None:
        rule.functions["handler"] = handler
    if check is not None:
        rule.functions["extra_check"] = check
    for name, value in sorted(vars(entry).items()):
        if name in ("pattern", "handler", "extra_check"):
            continue
        if callable(value):
            rule.opaque[name] = value
        else:
            rule.values[name] = value
    return rule
