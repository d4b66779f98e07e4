"""``cachecompile.store`` and ``cachectl`` must work where torch cannot even be imported
(``cachecompile/__init__.py`` imports nothing until asked, so the package path is free)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
