"""One error tree per package: every exception class defined in ``store/`` derives from
StoreError and every one in ``cachecompile/`` from CacheCompileError, and the errors
module's docstring draws it; a class outside the tree (a warning, a private control-flow
signal, the CLI's exit) is there only if that docstring lists it as deliberately outside.

Read from the source with ast (no import: the torch side needs no torch for this), so it
fails when someone adds an exception anywhere without placing it."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# A package, its errors module and the root of its tree.
PACKAGES = [("store", "store/errors.py", "StoreError"),
            ("cachecompile", "cachecompile/errors.py", "CacheCompileError")]
# The line of the errors module's docstring that starts the list of classes outside the tree.
OUTSIDE = "Outside the tree, deliberately"
# Exception bases from elsewhere, by their last name.
_FOREIGN = {name for name, v in vars(builtins).items()
            if isinstance(v, type) and issubclass(v, BaseException)} | {"ClickException"}


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _classes(package: str) -> dict[str, tuple[str, list[str]]]:
    """Every class of the package: name -> (its files, the base names of all classes of
    that name). Private helpers share names across modules (``_Holder``); an exception
    among them is one name in one list, so bases are merged by name."""
    out: dict[str, tuple[str, list[str]]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ClassDef):
                bases = [b for b in map(_base_name, node.bases) if b is not None]
                files, known = out.get(node.name, ("", []))
                out[node.name] = (f"{files}, {rel}" if files else rel, known + bases)
    return out


def _ancestors(name: str, classes: dict[str, tuple[str, list[str]]]) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for b in classes.get(todo.pop(), ("", []))[1]:
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def _docstring_names(errors_module: str) -> tuple[set[str], set[str]]:
    """(names drawn in the tree, names listed as outside it) of the module's docstring."""
    doc = ast.get_docstring(ast.parse((REPO / errors_module).read_text())) or ""
    tree, sep, outside = doc.partition(OUTSIDE)
    words = re.compile(r"\b_?[A-Z]\w*\b")
    return set(words.findall(tree)), set(words.findall(outside)) if sep else set()


@pytest.mark.parametrize(("package", "errors_module", "root"), PACKAGES,
                         ids=[p[0] for p in PACKAGES])
def test_every_exception_is_in_its_package_tree(package: str, errors_module: str,
                                                root: str) -> None:
    classes = _classes(package)
    drawn, outside = _docstring_names(errors_module)
    exceptions = {n for n in classes if _ancestors(n, classes) & (_FOREIGN | {root}) or n == root}
    assert root in exceptions and len(exceptions) > 5  # the reading found the tree
    in_tree = {n for n in exceptions if n == root or root in _ancestors(n, classes)}
    strays = sorted(f"{classes[n][0]}: {n}" for n in exceptions - in_tree - outside)
    assert not strays, (f"exceptions outside {root} ({errors_module} lists none of them "
                        f"as deliberately outside): {strays}")
    undrawn = sorted(f"{classes[n][0]}: {n}" for n in in_tree - drawn)
    assert not undrawn, f"{errors_module}'s docstring does not draw: {undrawn}"
    misfiled = sorted(n for n in in_tree & outside)
    assert not misfiled, f"in the tree, yet listed as outside it: {misfiled}"
    others = {r for _, _, r in PACKAGES}
    stale = sorted((outside - exceptions) & set(classes) | {
        n for n in outside if n.endswith(("Error", "Warning"))
        and n not in classes and n not in _FOREIGN | others})
    assert not stale, f"{errors_module} lists classes that are gone: {stale}"
