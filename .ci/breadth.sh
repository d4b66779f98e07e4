#!/usr/bin/env bash
# The breadth cases (tests/breadth.py), in the README command's venv, right after it: the
# second and further cases of a promise that a README-command test already checks (the
# aot_eager twin of every backend pair, more model families, remote servers, settings).
# The README command deselects them (-m 'not breadth') to keep a contributor's run short
# (issue 65); here every one of them runs on every CI run, so CI runs the whole suite.
# pytest's exit code 5 (no tests collected) fails it: the breadth cases vanished.
set -uo pipefail
cd "$(dirname "$0")/.."

# The README's .venv, or the venv already active (as .ci/fresh-processes.sh). On its own it
# sets none of .ci/run's CACHECOMPILE_REQUIRE_* variables: a server test whose server is
# missing here skips, saying why, where CI fails it.
if [ -x .venv/bin/python ]; then
  . .venv/bin/activate
elif [ -z "${VIRTUAL_ENV:-}" ]; then
  echo "breadth: no .venv (the README command makes it) and no venv active" >&2
  exit 1
fi
python -m pytest -n logical --maxschedchunk=1 --durations=10 -m breadth
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "the breadth step collected no tests" >&2
  exit 1
fi
exit "$rc"
