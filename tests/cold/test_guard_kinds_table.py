"""The guard kinds table (entry/guard_kinds.py) and capture (cold/guard_capture.py) name
the same Dynamo guard types: a type capture turns into a kind is listed on that kind, and
a type a kind lists is one capture handles. A torch release that adds a guard type then
fails here until both sides know it."""

from __future__ import annotations

import ast
import inspect

from cachecompile.cold import guard_capture
from cachecompile.entry.guard_kinds import TABLE

# Relations cachecompile derives itself (over the tensors capture collected), not from a
# Dynamo guard entry of that type.
_DERIVED = {"NO_TENSOR_ALIASING", "STORAGE_OVERLAPPING"}


def _types_capture_handles() -> set[str]:
    """Every guard type ``_Builder.entry`` compares ``gt`` with."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(guard_capture._Builder.entry).strip())):
        if not (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name)
                and node.left.id == "gt"):
            continue
        for comp in node.comparators:
            if isinstance(comp, ast.Constant) and isinstance(comp.value, str):
                found.add(comp.value)
            elif isinstance(comp, (ast.Tuple, ast.Set, ast.List)):
                found |= {e.value for e in comp.elts if isinstance(e, ast.Constant)}
            elif isinstance(comp, ast.Name):
                found |= set(getattr(guard_capture, comp.id))
    return found


def test_capture_and_the_table_name_the_same_dynamo_guard_types() -> None:
    handled = _types_capture_handles()
    dropped = guard_capture._IN_GLOBAL_STATE | guard_capture._AUTOGRAD_ONLY
    assert "TENSOR_MATCH" in handled and "GRAD_MODE" in dropped   # the parse found them
    listed = {t for kind in TABLE.values() for t in kind.dynamo}
    assert handled - dropped - listed == set(), "captured into a kind that does not list it"
    assert listed - handled - _DERIVED == set(), "listed on a kind, but capture never sees it"
    assert not listed & dropped
