#!/usr/bin/env bash
# The fresh-process tests with every child a plain `python -c` (CC_TESTS_ZYGOTE=0), in
# the README command's venv, after it. The README command forks most children from a
# zygote that imported torch already (tests/zygote.py); this slice runs the tests whose
# subject is a fresh process (a cold run then a warm one, source edits, a corrupt or
# read-only store, Dynamo's marks) in real fresh interpreters, so that what a fork carries
# over (a random state, an import, a cached setting) cannot make them pass where a new
# process would fail. About 3.5 minutes of CPU: 2 minutes on 2 cores. Its children also
# keep Inductor's own pool of compile workers (CC_TESTS_INDUCTOR_POOL=1), which the README
# command turns off for speed (tests/conftest.py): the pool's path stays tested.
# pytest's exit code 5 (no tests collected) fails it: the slice vanished.
set -uo pipefail
cd "$(dirname "$0")/.."

SLICE=(tests/e2e/test_warm_start.py::test_cold_then_warm_compiles_nothing
       tests/e2e/test_fresh_process.py
       tests/key/test_marks.py
       tests/test_zygote.py)

CC_TESTS_ZYGOTE=0 CC_TESTS_INDUCTOR_POOL=1 python -m pytest -q -p no:cacheprovider -n logical --maxschedchunk=1 \
  --durations=5 "${SLICE[@]}"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "the fresh-process slice collected no tests" >&2
  exit 1
fi
exit "$rc"
