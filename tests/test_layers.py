"""The import graph has floors, and docs/design.md draws them.

The floors, the module list and the warm path's imports are read from docs/design.md
("The layers") and checked against the code: no import runs up a floor or across to a
sibling package on the same floor (module level, in a function, under TYPE_CHECKING
alike); every module is listed; a warm process imports exactly the listed modules. The
check is shown to fail on trees that break it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from pathlib import Path

import pytest
from ccutil import Sandbox

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"
PKG = "cachecompile"


def _block(marker: str) -> str:
    """The table or fenced block following ``<!-- marker: ... -->`` in docs/design.md."""
    text = DESIGN.read_text(encoding="utf-8")
    at = text.index(f"<!-- {marker}:")
    rest = text[text.index("\n", at) + 1:]
    if rest.startswith("```"):
        body = rest[rest.index("\n") + 1:]
        return body[:body.index("```")]
    return rest[:rest.index("\n\n")]


def floors() -> dict[str, int]:
    """Top-level component -> floor, from the doc's floors table."""
    out: dict[str, int] = {}
    for line in _block("floors").splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([\w.]+)`", cells[1]):
            out[name] = int(cells[0])
    return out


def component(module: str) -> str:
    """``cachecompile.key.factors`` -> ``key``; the package itself -> ``__init__``."""
    parts = module.split(".")
    assert parts[0] == PKG, module
    return parts[1] if len(parts) > 1 else "__init__"


def sources() -> dict[str, str]:
    """Every module of the package by its installed name (store/ as cachecompile.store)."""
    out: dict[str, str] = {}
    for root, prefix in ((REPO / PKG, PKG), (REPO / "store", f"{PKG}.store")):
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((prefix, *rel))] = path.read_text(encoding="utf-8")
    return out


def imports(module: str, source: str, known: set[str]) -> list[tuple[int, str]]:
    """Every cachecompile module ``source`` imports, wherever the import statement is."""
    is_pkg = any(k.startswith(module + ".") for k in known) or module == PKG
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == PKG]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - node.level + 1]
                mod = ".".join(parent + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != PKG:
                continue
            for a in node.names:
                # ``from pkg import sub`` imports a submodule; any other name comes from pkg.
                sub = f"{mod}.{a.name}"
                found.append((node.lineno, sub if sub in known else mod))
    return found


def violations(srcs: Mapping[str, str], table: Mapping[str, int]) -> list[str]:
    """Imports that run up a floor, or across to a sibling package on the same floor."""
    known = set(srcs)
    out: list[str] = []
    for module, source in srcs.items():
        here = component(module)
        if here not in table:
            out.append(f"{module}: package {here!r} has no floor in docs/design.md")
            continue
        for line, target in imports(module, source, known):
            there = component(target)
            if there == here or target == PKG and here == "__init__":
                continue
            if there not in table:
                out.append(f"{module}:{line} imports {target}, which has no floor")
            elif table[there] > table[here]:
                out.append(f"{module}:{line} imports {target}: up from floor "
                           f"{table[here]} ({here}) to {table[there]} ({there})")
            elif table[there] == table[here]:
                out.append(f"{module}:{line} imports {target}: across floor {table[here]} "
                           f"({here} -> {there})")
    return out


def test_no_import_runs_up_a_floor() -> None:
    assert violations(sources(), floors()) == []


def test_the_check_fails_on_a_tree_that_breaks_it() -> None:
    table = floors()
    broken = {
        f"{PKG}.key.factors": "from cachecompile.backends.base import Adapter\n",
        f"{PKG}.key.signature_key": "def f():\n    from cachecompile import __version__\n",
        f"{PKG}.warm.lookup": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from cachecompile.cold import capture\n",
        f"{PKG}.warm.replay": "from ..procs import coop\n",
        f"{PKG}.store.disk": "import cachecompile.errors\n",
        f"{PKG}.cold.capture": "from cachecompile.warm import replay\n",  # down: fine
        f"{PKG}.backends.base": "", f"{PKG}.cold": "", f"{PKG}.warm": "", f"{PKG}.procs": "",
        f"{PKG}.procs.coop": "", f"{PKG}.errors": "", PKG: "",
    }
    found = violations(broken, table)
    assert [f.split(":")[0] for f in found] == [
        f"{PKG}.key.factors", f"{PKG}.key.signature_key", f"{PKG}.warm.lookup",
        f"{PKG}.warm.replay"], found
    assert "up from floor 3 (key) to 5 (backends)" in found[0]
    assert "(key) to 11 (__init__)" in found[1]          # the package face
    assert "up from floor 7 (warm) to 8 (cold)" in found[2]
    assert "across floor 7 (warm -> procs)" in found[3]
    # Floor 0 is below the store by the table; that the store imports nothing of
    # cachecompile at all is tests/store/test_store_torch_free.py's check.


def cycles(srcs: Mapping[str, str]) -> list[list[str]]:
    """The import cycles among ``srcs`` (strongly connected groups of two or more
    modules), wherever the import statements are: the floors forbid a cycle between
    packages, this forbids one inside a package too."""
    known = set(srcs)
    graph = {m: sorted({t for _, t in imports(m, src, known) if t in known and t != m})
             for m, src in srcs.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = [stack.pop()]
            while group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in order:
            visit(v)
    return sorted(found)


def test_no_import_cycle() -> None:
    assert cycles(sources()) == []
    # As the TorchAir adapter and its selector were (each imported the other): found.
    broken = {f"{PKG}.backends.torchair": "from cachecompile.backends import torchair_select\n",
              f"{PKG}.backends.torchair_select":
                  "def options():\n    from cachecompile.backends import torchair\n",
              f"{PKG}.backends": ""}
    assert cycles(broken) == [[f"{PKG}.backends.torchair", f"{PKG}.backends.torchair_select"]]


def test_every_module_is_in_the_design_doc() -> None:
    listed = {line.split()[0] for line in _block("modules").splitlines() if line.strip()}
    missing = []
    for module in sources():
        parts = module.split(".")
        if parts[1:2] == ["store"]:
            continue  # store/ is listed whole (docs/store.md lists its modules)
        path = "/".join(parts) + ".py"
        if (REPO / path).exists():
            covered = path in listed or any(path.startswith(e) for e in listed
                                            if e.endswith("/"))
        else:  # a package's __init__: covered by the package's own modules
            covered = (REPO / Path(*parts) / "__init__.py").exists()
        if not covered:
            missing.append(path)
    assert missing == [], f"modules docs/design.md does not list: {missing}"
    gone = [e for e in listed if not (REPO / e).exists()]
    assert gone == [], f"docs/design.md lists modules that do not exist: {gone}"


WARM = """
import json, sys, torch
from cachecompile import cache_compile

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def run(self, x):
        return torch.relu(self.lin(x)) * 2

torch.manual_seed(0)
m = M().eval()
cached = cache_compile(m.run, dynamic=False)
cached(torch.randn(4, 8))
report({"events": [e[0] for e in cached.events],
        "modules": sorted(n for n in sys.modules if n.startswith("cachecompile."))})
"""


@pytest.mark.slow
def test_warm_path_imports_what_the_doc_says(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    assert box.run(WARM)["events"] == ["miss"]
    warm = box.run(WARM)
    assert warm["events"] == ["hit"]
    listed = sorted(f"{PKG}.{n}" for n in _block("warm").split())
    assert warm["modules"] == listed, json.dumps(
        {"imported, not listed": sorted(set(warm["modules"]) - set(listed)),
         "listed, not imported": sorted(set(listed) - set(warm["modules"]))})
