#!/usr/bin/env bash
# The fast tests on the other Pythons the package claims (requires-python >= 3.10): 3.10,
# the oldest, and 3.12, beside the README command's 3.11. Each in its own venv, removed
# after its run: torch 2.13.0 (PyPI's CUDA build, run on CPU), the package editable and the
# test tools, then the tests not marked slow of the store, the key, the entry format
# (guards, the guard tree, bytecode) and the layer check: what a Python release changes
# most (bytecode, the standard library, the libraries pip picks for it).
# Left out to stay within about 5 minutes a Python (the install alone takes about 2): the
# store's stats test (it compiles a model in fresh processes: 50 s of test time), the S3
# tier's (a moto server: 45 s; its obstore has no build for 3.10), the Redis tier's (a
# redis-server: 33 s; the Redis client's URL handling still runs, in test_remote_secrets)
# and the manifest-integrity cases (31 s of edits to a manifest, hashed alike on every
# Python). All of them run on 3.11 in the README command.
# Where torch 2.13.0 has no build for a Python, only the torch-free tests run there (the
# store, the layer check's static half), and the log says so.
# An interpreter comes from pyenv ($PYENV_ROOT, else /root/.pyenv: versions/X.Y.*) or PATH
# (pythonX.Y); one that is absent is skipped with a message. CACHECOMPILE_PYTHONS picks
# the versions (default "3.10 3.12").
# pytest's exit code 5 (no tests collected) fails the tier: the selection vanished.
set -uo pipefail
cd "$(dirname "$0")/.."
. .ci/venv-tier.sh

# As in the torch matrix: the script names its torch exactly, so a machine's pip
# constraint (torch<=2.14.1 on some) must not move it.
export PIP_CONSTRAINT=/dev/null
TORCH=2.13.0
LEFT_OUT=(--ignore=tests/store/test_stats.py --ignore=tests/store/test_s3.py
          --ignore=tests/store/test_remote.py --ignore=tests/store/test_store_manifest_integrity.py)
TESTS=(tests/store tests/entry tests/key tests/test_layers.py "${LEFT_OUT[@]}")
# Without torch: the store's tests but the two that call into the torch side (test_stats.py
# is left out above), and the layer check's static half (its warm-path test is slow).
TORCH_FREE_TESTS=(tests/store tests/test_layers.py "${LEFT_OUT[@]}"
  --deselect "tests/store/test_import_name.py::test_a_users_store_module_and_cachecompile_coexist"
  --deselect "tests/store/test_remote_secrets.py::test_open_store_and_a_serving_process_never_show_it")
# What these tests use of the [test] extra, and numpy, which the extra's transformers brings
# to the README command's venv (torch warns on import without it). The extra itself does
# not install on 3.10: its obstore>=0.12 needs Python 3.11.
TEST_TOOLS=("pytest>=8" "pytest-xdist>=3.5" numpy)
# With torch: transformers too, for the guard tree's PretrainedConfig reads
# (tests/entry/test_guard_tree.py), whose attribute mapping differs by release; pip picks
# the newest release for each Python (5.20 on 3.10).
TORCH_TEST_TOOLS=("transformers>=5.0")

find_python() {
  local v=$1 root=${PYENV_ROOT:-/root/.pyenv} found
  found=$(ls -d "$root/versions/$v".*/bin/python 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$found" ]; then
    found=$(command -v "python$v" || true)
  fi
  [ -n "$found" ] && echo "$found"
}

tier_items() { echo "${CACHECOMPILE_PYTHONS:-3.10 3.12}"; }
tier_venv() { echo ".venv-py$1"; }

# Make the venv and install into it; the test selection is left in the venv for tier_test.
# Exit 0 with no venv: no interpreter for this version (skipped, said so).
tier_prepare() {
  local v=$1 py venv=".venv-py$1" versions
  py=$(find_python "$v")
  if [ -z "$py" ]; then
    echo "== Python $v: no interpreter (pyenv or python$v on PATH), skipped"
    return 0
  fi
  "$py" -m venv "$venv" || return 1
  . "$venv/bin/activate"
  # pip's index query lists only the releases with a build for this interpreter; a query
  # that fails (no index) fails the tier rather than quietly running fewer tests.
  versions=$(python -m pip index versions torch 2>/dev/null) \
    || { echo "Python $v: could not ask the index for torch" >&2; return 1; }
  if grep -q "Available versions:.*\b${TORCH//./\\.}\b" <<<"$versions"; then
    python -m pip install -q "torch==$TORCH" -e . "${TEST_TOOLS[@]}" "${TORCH_TEST_TOOLS[@]}" \
      || return 1
    echo torch > "$venv/tier-selection"
  else
    echo "== Python $v: torch $TORCH has no build for this Python: the torch-free tests only"
    python -m pip install -q --no-deps -e . || return 1
    # The runtime requirements but torch, and the test tools.
    python -m pip install -q filelock xxhash click rich redis zstandard \
      "${TEST_TOOLS[@]}" || return 1
    echo torch-free > "$venv/tier-selection"
  fi
  deactivate
}

tier_test() {
  local v=$1 venv=".venv-py$1" selection
  [ -d "$venv" ] || return 0   # skipped in tier_prepare (no interpreter)
  . "$venv/bin/activate"
  if [ "$(cat "$venv/tier-selection")" = torch ]; then
    selection=("${TESTS[@]}")
  else
    selection=("${TORCH_FREE_TESTS[@]}")
  fi
  python -m pytest -q -p no:cacheprovider -m "not slow" -n 2 "${selection[@]}"
  leave_tier_venv "$venv" $? "Python $v"
}

tier_main Python "$@"
exit $?
