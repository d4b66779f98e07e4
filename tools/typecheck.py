"""mypy over cachecompile, tests/ and tools/ (pyproject's ``files``) with the store in its
installed place (``cachecompile.store``); an unused ``type: ignore`` is an error.

``store/`` is a top-level folder that installs as ``cachecompile.store`` (pyproject's
package-dir). mypy finds modules by path, so on the checkout alone it cannot see the store
under that name and types it as ``Any``. This builds a view (a folder whose
``cachecompile/`` links each entry of the real package, plus ``store`` -> ``store/``) and
runs mypy with the view first on its path, so the store and every caller of it are checked
together. ``python tools/typecheck.py [mypy args]``; tests/test_lint.py runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_view(dest: Path) -> Path:
    pkg = dest / "cachecompile"
    pkg.mkdir(parents=True)
    for child in (REPO / "cachecompile").iterdir():
        if child.name != "__pycache__":
            (pkg / child.name).symlink_to(child)
    (pkg / "store").symlink_to(REPO / "store")
    return dest


def main(argv: list[str]) -> int:
    mypy = Path(sys.executable).parent / "mypy"
    cmd = [str(mypy)] if mypy.exists() else [sys.executable, "-m", "mypy"]
    with tempfile.TemporaryDirectory(prefix="cachecompile-typecheck-") as tmp:
        view = build_view(Path(tmp))
        env = {**os.environ, "MYPYPATH": str(view)}
        return subprocess.run([*cmd, *argv], cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
