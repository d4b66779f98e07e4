"""ruff and mypy over the repository, with the configuration in pyproject.toml; torch's
private names only in cachecompile/_torch."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool(name: str) -> list[str]:
    # Prefer the tool next to this interpreter (the venv), then PATH.
    local = Path(sys.executable).parent / name
    if local.exists():
        return [str(local)]
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return [found]


def test_ruff() -> None:
    p = subprocess.run([*_tool("ruff"), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


# -- the complexity gate: its exceptions only shrink ------------------------------------------
# Today's functions over C901 12 (issue 52): 21 marked noqa on their def line, and no file in
# per-file-ignores (entry/'s four went with the Checker class and its splits). Lower these
# when a split lands; a new exception is a function to split, not a number to raise.
C901_NOQA_MAX = 21
C901_FILES_MAX = 0


def test_complexity_gate_is_on_and_its_exceptions_do_not_grow() -> None:
    import tomllib

    lint = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C901" in lint["select"] and lint["mccabe"]["max-complexity"] <= 12
    files = [f for f, codes in lint["per-file-ignores"].items() if "C901" in codes]
    assert len(files) <= C901_FILES_MAX, files
    marked = [f"{path.relative_to(REPO)}:{n}"
              for top in ("cachecompile", "store", "tests", "tests_npu", "tools")
              for path in sorted((REPO / top).rglob("*.py"))
              for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
              if re.search(r"#\s*noqa:[^#]*\bC901\b", line)]
    assert len(marked) <= C901_NOQA_MAX, marked


# -- no long function in entry/: every wrong-hit fix and guard kind passes through it ------------
ENTRY_MAX_LINES = 60


def long_functions(root: Path, limit: int) -> list[str]:
    """Every function (methods and nested ones too) under ``root`` over ``limit`` lines,
    decorators left out."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_in_entry_is_over_60_lines(tmp_path: Path) -> None:
    assert long_functions(REPO / "cachecompile" / "entry", ENTRY_MAX_LINES) == []
    # The check can fail: a function nested in a method, one line over, is found (with
    # the method around it); one at the limit is not.
    body = "".join(f"            x{i} = {i}\n" for i in range(ENTRY_MAX_LINES))
    (tmp_path / "over.py").write_text(f"class C:\n    def f(self):\n        def g():\n{body}")
    (tmp_path / "at.py").write_text("def h():\n" + body[:-len(f"            x{ENTRY_MAX_LINES - 1} = {ENTRY_MAX_LINES - 1}\n")])
    assert long_functions(tmp_path, ENTRY_MAX_LINES) == ["over.py:2 f (62 lines)",
                                                         "over.py:3 g (61 lines)"]


def test_mypy() -> None:
    # Packages to check come from [tool.mypy] in pyproject.toml; tools/typecheck.py puts
    # store/ in its installed place (cachecompile.store) so the store is checked with its
    # callers, not typed as Any.
    _tool("mypy")
    p = subprocess.run([sys.executable, str(REPO / "tools" / "typecheck.py")], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "cachecompile/store/" not in p.stdout, p.stdout


# -- torch's private names stay in cachecompile/_torch ----------------------------------------
LAYER = REPO / "cachecompile" / "_torch"
# A string that is a dotted name with a private part under torch: a module name the code
# imports or compares with ("torch._dynamo.utils", "torch._ops").
_PRIVATE_MODULE_STRING = re.compile(r"(?:torch|functorch)(?:\.\w+)*\._\w+(?:\.\w+)*")


def _private(parts: list[str]) -> bool:
    """torch.x._y (any private, non-dunder part under torch), or functorch itself."""
    if not parts or parts[0] not in ("torch", "functorch"):
        return False
    return parts[0] == "functorch" or any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])


def _dotted(node: ast.AST) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return []


def private_torch_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every use of a private torch name in ``source``: imports, attributes, module strings.

    The backstop to ruff's TID251 list (which names modules one by one): any ``torch._x``,
    ``torch.a._b`` or ``x._C._y`` outside the layer, however it is spelled.
    """
    found: list[str] = []
    tree = ast.parse(source, filename)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                    ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    # An attribute chain is reported once, at its outermost attribute.
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if _private(a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [f"{where} from {node.module} import {a.name}" for a in node.names
                      if _private([*node.module.split("."), a.name])]
        elif isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if id(node) not in inner and (_private(parts) or "_C" in parts[1:]):
                found.append(f"{where} {'.'.join(parts)}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings
              and _PRIVATE_MODULE_STRING.fullmatch(node.value)):
            found.append(f"{where} {node.value!r}")
    return sorted(found, key=lambda f: int(f.split(" ", 1)[0].rsplit(":", 1)[1]))


def test_private_torch_names_only_in_the_layer() -> None:
    found: list[str] = []
    for path in sorted((REPO / "cachecompile").rglob("*.py")):
        if LAYER in path.parents:
            continue
        found += private_torch_uses(path.read_text(encoding="utf-8"),
                                    str(path.relative_to(REPO)))
    assert found == [], "private torch names outside cachecompile/_torch:\n" + "\n".join(found)


_LEAKS = """\
import torch
import torch._inductor.config
from torch._dynamo.utils import get_traced_code
from torch.utils import _device

state = torch._C._dynamo.guards.GlobalStateGuard()
utils = "torch._dynamo.utils"
"""


def test_private_name_check_catches_each_spelling() -> None:
    found = private_torch_uses(_LEAKS)
    assert [f.split(" ", 1)[0] for f in found] == [
        "<source>:2", "<source>:3", "<source>:4", "<source>:6", "<source>:7"], found
    # Public names, dunders and prose about private ones are fine.
    assert private_torch_uses('"""Not ``torch._dynamo``."""\nimport torch\n'
                              "v = torch.__version__\nx = torch.nn.functional.relu\n"
                              'msg = "run torch._dynamo.explain() on it"\n') == []


def test_ruff_bans_private_names_outside_the_layer(tmp_path: Path) -> None:
    # The repository's own ruff configuration, over a copy holding a leaking module
    # outside the layer and the same module inside it.
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for rel in ("cachecompile/leak.py", "cachecompile/_torch/ok.py", "tests/ok.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(_LEAKS)
    p = subprocess.run([*_tool("ruff"), "check", "--no-cache", "--select", "TID251",
                        "--output-format", "concise", "."],
                       cwd=tmp_path, capture_output=True, text=True)
    flagged = sorted({":".join(line.split(":")[:2])
                      for line in p.stdout.splitlines() if "TID251" in line})
    assert p.returncode == 1, p.stdout + p.stderr
    # Lines 2-4 (imports) and 6 (attribute access); the string on line 7 is the AST check's.
    assert flagged == ["cachecompile/leak.py:2", "cachecompile/leak.py:3",
                       "cachecompile/leak.py:4", "cachecompile/leak.py:6"], p.stdout


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by their basename (tests/'s folders are not packages):
    two files of one name fail the whole suite's collection, after the other tests ran."""
    from collections import Counter

    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []


# -- module size: a module is one role; past ~600 lines it is usually two ----------------------
MODULE_MAX_LINES = 600
# Today's exceptions, each capped at its size when the gate came (issue 60): it may shrink,
# never grow. A new module over the limit is a module to split.
MODULE_EXCEPTIONS: dict[str, tuple[int, str]] = {
    "store/remote/base.py": (889, "the remote tier's one protocol: transfer, breaker, "
                                  "repair; its transports are the other modules"),
    "cachecompile/_torch/dynamo.py": (831, "every private Dynamo name the cold side reads, "
                                           "version branches side by side (one layer)"),
    "cachecompile/entry/guard_kinds.py": (779, "the guard-kinds table: one row per kind"),
    "store/index.py": (722, "the index and its schema, migrations beside it"),
    "cachecompile/entry/guard_tree.py": (753, "the C++ guard tree built from portable guards"),
    "store/maintenance.py": (701, "gc, purge, verify and repair: the maintenance protocol"),
    "store/remote/s3.py": (655, "S3's requests, signing and the servers that differ"),
    "store/remote/file.py": (640, "the shared-filesystem tier: leases, ownership, repair"),
}


def oversized_modules(root: Path, tops: tuple[str, ...], limit: int,
                      allowed: dict[str, tuple[int, str]]) -> list[str]:
    out: list[str] = []
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            n = len(path.read_text(encoding="utf-8").splitlines())
            cap = allowed.get(rel, (limit, ""))[0]
            if n > cap:
                out.append(f"{rel}: {n} lines (limit {cap})")
    return out


def test_no_module_grows_past_its_limit(tmp_path: Path) -> None:
    assert oversized_modules(REPO, ("cachecompile", "store"), MODULE_MAX_LINES,
                             MODULE_EXCEPTIONS) == []
    # Every exception is still needed (a module that shrank under the limit leaves the list).
    for rel, (_cap, why) in MODULE_EXCEPTIONS.items():
        n = len((REPO / rel).read_text(encoding="utf-8").splitlines())
        assert n > MODULE_MAX_LINES and why, f"{rel} ({n} lines) needs no exception now"
    # The check can fail: one line over the limit is found, one at it is not.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * (MODULE_MAX_LINES + 1))
    (tmp_path / "pkg" / "ok.py").write_text("x = 1\n" * MODULE_MAX_LINES)
    assert oversized_modules(tmp_path, ("pkg",), MODULE_MAX_LINES, {}) == [
        f"pkg/big.py: {MODULE_MAX_LINES + 1} lines (limit {MODULE_MAX_LINES})"]


def test_the_performance_page_leads_with_today() -> None:
    """docs/performance.md holds today's figures, under 500 lines; its history is in the
    CHANGELOG and the file's git history (issue 60)."""
    page = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")
    assert len(page.splitlines()) < 500
    assert "## How we got here" not in page
