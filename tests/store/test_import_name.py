"""The store installs as ``cachecompile.store``, never as a top-level ``store``: a user's
own ``store`` module or package (or PyPI's) and cachecompile never shadow each other.

These run the installed package (no PYTHONPATH to the checkout), as a user's process does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHECTL = Path(sys.executable).parent / "cachectl"


def _installed_env(first_on_path: Path) -> dict[str, str]:
    """The environment of a user's process whose own directory comes first on sys.path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECOMPILE_")}
    env["PYTHONPATH"] = str(first_on_path)
    return env


@pytest.fixture(params=["module", "package"])
def user_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A directory named ``store`` holding an unrelated ``store`` module or package."""
    d = tmp_path / "store"
    d.mkdir()
    if request.param == "module":
        (d / "store.py").write_text("WHOSE = 'the user'\n")
    else:
        (d / "store").mkdir()
        (d / "store" / "__init__.py").write_text("WHOSE = 'the user'\n")
    return d


def test_a_users_store_module_and_cachecompile_coexist(user_dir: Path) -> None:
    code = (
        "import store, cachecompile, cachecompile.store as cs\n"
        "assert store.WHOSE == 'the user', store.__file__\n"
        "assert cs.__name__ == 'cachecompile.store' and callable(cs.open_store)\n"
        "from cachecompile import cache_compile\n"
        "assert callable(cache_compile)\n"
        "assert store.WHOSE == 'the user'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=user_dir, env=_installed_env(user_dir),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr


def test_cachectl_runs_beside_a_users_store_module(user_dir: Path) -> None:
    if not CACHECTL.exists():
        pytest.skip("cachectl is not installed next to this interpreter")
    for cmd in ([str(CACHECTL), "--help"],
                [sys.executable, "-m", "cachecompile.cli.main", "--help"]):
        p = subprocess.run(cmd, cwd=user_dir, env=_installed_env(user_dir),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "cachectl" in p.stdout, (cmd, p.stderr)


def test_the_project_provides_no_top_level_store(tmp_path: Path) -> None:
    code = ("import importlib.util\n"
            "spec = importlib.util.find_spec('store')\n"
            "print(spec.origin if spec is not None else '')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                       env=_installed_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert str(REPO) not in p.stdout, f"`import store` finds the project's folder: {p.stdout}"
