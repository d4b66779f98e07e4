#!/usr/bin/env bash
# The wheel as a user gets it: built from the checkout's files (in a copy, with the build
# requirements pyproject names, so no stale build/ of the checkout leaks in), checked to hold
# every module of cachecompile/ and store/, the py.typed markers and the license, then
# installed (not editable) into a fresh venv WITHOUT torch, where the torch-free half must
# work: import cachecompile.store, cachectl --help, cachectl ls over an empty store.
# The editable install of the README command maps store/ by its finder; only a real install
# shows whether the wheel itself holds the store and the CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PY=${PYTHON:-python3}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/cachecompile-wheel-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
unset PYTHONPATH

echo "-- build the wheel"
mkdir "$tmp/src" "$tmp/dist"
# What git would ship (tracked, plus untracked files it does not ignore).
git ls-files -z -co --exclude-standard -- cachecompile store pyproject.toml README.md LICENSE \
  | tar --null -cf - -T - | tar -xf - -C "$tmp/src"
"$PY" -m pip wheel -q --no-deps -w "$tmp/dist" "$tmp/src"
wheel=$(ls "$tmp"/dist/cachecompile-*.whl)
echo "   $(basename "$wheel")"

echo "-- what the wheel holds"
"$PY" - "$wheel" "$tmp/src" <<'EOF'
import sys
import zipfile
from pathlib import Path

wheel, src = zipfile.ZipFile(sys.argv[1]), Path(sys.argv[2])
names = set(wheel.namelist())
want = set()
for root, installed in (("cachecompile", "cachecompile"), ("store", "cachecompile/store")):
    for p in (src / root).rglob("*"):
        if p.is_file() and (p.suffix == ".py" or p.name == "py.typed"):
            want.add(f"{installed}/{p.relative_to(src / root).as_posix()}")
missing = sorted(want - names)
if missing:
    sys.exit(f"missing from the wheel: {missing}")
for need in ("cachecompile/py.typed", "cachecompile/store/py.typed"):
    if need not in names:
        sys.exit(f"missing from the wheel: {need}")
licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
if not licenses or wheel.read(licenses[0]) != (src / "LICENSE").read_bytes():
    sys.exit("the wheel does not carry LICENSE")
tops = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
if tops != {"cachecompile"}:
    sys.exit(f"the wheel installs other top-level names: {sorted(tops)}")
print(f"   {len(want)} modules and markers, LICENSE, one top-level package")
EOF

echo "-- install it into a venv without torch"
"$PY" -m venv "$tmp/venv"
vpy="$tmp/venv/bin/python"
# The runtime requirements but torch, as the wheel's metadata states them.
mapfile -t deps < <("$vpy" - "$wheel" <<'EOF'
import re
import sys
import zipfile

wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        req = line.split(": ", 1)[1]
        if re.match(r"torch\b", req) is None:
            print(req)
EOF
)
echo "   ${deps[*]}"
"$vpy" -m pip install -q "${deps[@]}"
"$vpy" -m pip install -q --no-deps "$wheel"

echo "-- the torch-free half, installed"
cd "$tmp"  # nothing of the checkout on sys.path
if "$vpy" -c "import torch" 2>/dev/null; then
  echo "torch is importable in the torch-free venv: the check would prove nothing" >&2
  exit 1
fi
"$vpy" - "$tmp/venv" <<'EOF'
import sys
from importlib.metadata import version
from pathlib import Path

import cachecompile
import cachecompile.store
import cachecompile.store.remote

venv = Path(sys.argv[1]).resolve()
for mod in (cachecompile, cachecompile.store):
    where = Path(mod.__file__).resolve()
    assert venv in where.parents, f"{mod.__name__} imported from {where}, not the install"
    assert (where.parent / "py.typed").is_file(), f"no py.typed beside {where}"
assert cachecompile.__version__ == version("cachecompile"), (
    cachecompile.__version__, version("cachecompile"))
assert "torch" not in sys.modules
print(f"   cachecompile {cachecompile.__version__} and cachecompile.store import without torch")
EOF
"$tmp/venv/bin/cachectl" --help >/dev/null
store="$tmp/store"
"$vpy" -c "import sys; from cachecompile.store import open_store; open_store(sys.argv[1])" "$store"
"$tmp/venv/bin/cachectl" ls --cache-dir "$store"
listed=$("$tmp/venv/bin/cachectl" ls --json --cache-dir "$store")
if [ "$(echo "$listed" | tr -d '[:space:]')" != "[]" ]; then
  echo "cachectl ls --json over an empty store printed: $listed" >&2
  exit 1
fi
echo "   cachectl --help and cachectl ls (an empty store) run without torch"
echo "-- wheel check passed in $((SECONDS - start)) s"
