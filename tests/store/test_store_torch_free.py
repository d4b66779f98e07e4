"""``cachecompile.store`` and ``cachectl`` must work where torch cannot even be imported
(``cachecompile/__init__.py`` imports nothing until asked, so the package path is free),
and the store imports nothing of cachecompile: ``cachectl`` (cachecompile.cli) sits above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

STORE = Path(__file__).resolve().parents[2] / "store"

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None
sys.meta_path.insert(0, _NoTorch())
try:
    import torch  # noqa
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not work")
"""


@pytest.mark.parametrize("module", ["cachecompile.store", "cachecompile.cli.main"])
def test_import_without_torch(module: str, child_env: dict[str, str]) -> None:
    code = BLOCK_TORCH + f"""
import {module}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
assert not heavy, heavy
if {module!r} == "cachecompile.store":
    lazy = sorted(m for m in ("click", "rich", "diskcache", "filelock") if m in sys.modules)
    assert not lazy, lazy
"""
    p = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_store_works_without_torch(tmp_path, child_env: dict[str, str]) -> None:
    code = BLOCK_TORCH + f"""
from cachecompile.store import open_store, make_key, Hit
from cachecompile.cli.main import main
st = open_store({str(tmp_path / 'c')!r})
k = make_key({{"a": 1}})
st.put(k, {{"f": b"x"}})
assert isinstance(st.get(k), Hit)
try:
    main(["ls", "--cache-dir", {str(tmp_path / 'c')!r}])
except SystemExit as e:
    assert e.code in (0, None), e.code
"""
    p = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "torch" not in p.stderr


def test_cachectl_verbs_run_with_torch_unimportable(tmp_path, child_env: dict[str, str]) -> None:
    """``import cachecompile.cli.main`` and the verbs that need no torch, with
    ``sys.modules['torch'] = None`` (any ``import torch`` raises)."""
    root = str(tmp_path / "c")
    code = f"""
import json, marshal, sys
sys.modules["torch"] = None
import cachecompile.cli.main as m
from cachecompile.entry.files import BYTECODE_FILE, CONST_PREFIX
from cachecompile.store import make_key, open_store
def heavy():  # the None that blocks torch is no import
    return sorted(n for n, v in sys.modules.items()
                  if v is not None and n.split(".")[0] in ("torch", "numpy"))
assert not heavy(), heavy()
assert "cachecompile.build" not in sys.modules
py = "CPython " + sys.version.split()[0]
code = compile("y = " + repr(CONST_PREFIX + "0"), "<entry>", "exec")
st = open_store({root!r})
e = st.put(make_key({{"versions": {{"python": py}}, "fn": "run"}}),
           {{BYTECODE_FILE: marshal.dumps(code), "program.py": b"def call(args):\\n    return args\\n"}},
           labels={{"model": "M", "function": "run"}}, meta={{"consts": ["stored"]}})
for argv in (["ls"], ["stats"], ["verify"], ["show", e.key[:12]], ["program", e.key[:12]]):
    try:
        m.main([*argv, "--cache-dir", {root!r}])
    except SystemExit as x:
        assert x.code in (0, None), (argv, x.code)
assert not heavy(), heavy()
assert "cachecompile.build" not in sys.modules
"""
    p = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "checked 1 entry: ok" in p.stdout
    assert "# ---- Dynamo's transformed bytecode" in p.stdout and '<"stored">' in p.stdout
    assert "# ---- program.py" in p.stdout and "def call(args):" in p.stdout


def cachecompile_imports(source: str, depth: int = 0) -> list[str]:
    """The imports of cachecompile in a store module's ``source`` (the module ``depth``
    folders below store/): absolute ones, relative ones that climb out of the store (it
    installs as cachecompile.store, so ``from .. import x`` is cachecompile.x), and
    ``importlib.import_module`` / ``__import__`` of a literal cachecompile name."""
    def ours(name: str | None) -> bool:
        return name is not None and (name == "cachecompile" or name.startswith("cachecompile."))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if ours(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if (node.level == 0 and ours(node.module)) or node.level > depth + 1:
                found.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import")
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            arg = node.args[0]
            if (name in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and ours(arg.value)):
                found.append(f"line {node.lineno}: {name}({arg.value!r})")
    return found


def test_the_store_imports_nothing_of_cachecompile() -> None:
    files = sorted(STORE.rglob("*.py"))
    assert len(files) > 10 and (STORE / "disk.py") in files
    bad = {str(f.relative_to(STORE)): hits for f in files
           if (hits := cachecompile_imports(f.read_text(encoding="utf-8"),
                                            depth=len(f.relative_to(STORE).parts) - 1))}
    assert not bad, f"the store imports cachecompile (cachectl lives in cachecompile/cli): {bad}"


@pytest.mark.parametrize("source", [
    "import cachecompile",
    "import json, cachecompile.build as b",
    "from cachecompile.build import prebuild",
    "from cachecompile import store",
    "def verb():\n    from cachecompile.entry.files import BYTECODE_FILE\n",
    "if TYPE_CHECKING:\n    from cachecompile.api import cache_compile\n",
    "from .. import api",
    "from ..entry import files",
    "import importlib\nmod = importlib.import_module('cachecompile.build')",
    "__import__('cachecompile')",
])
def test_the_store_check_finds_an_import_of_cachecompile(source: str) -> None:
    assert len(cachecompile_imports(source)) == 1, source


@pytest.mark.parametrize("source", [
    "from . import errors\nfrom .disk import Store\nimport json",
    '"""Used by cachecompile.cli and cachecompile.api."""\nNAME = "cachecompile.store"',
    "import cachecompiler\nfrom cachecompile_extra import x",
    "importlib.import_module(f'.{name}', __package__)",
])
def test_the_store_check_passes_the_stores_own_imports(source: str) -> None:
    assert cachecompile_imports(source) == []


def test_the_store_check_allows_a_subpackage_to_reach_the_store() -> None:
    assert cachecompile_imports("from .. import errors", depth=1) == []
    assert cachecompile_imports("from ... import api", depth=1) != []
