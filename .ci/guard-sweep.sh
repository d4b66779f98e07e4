#!/usr/bin/env bash
# The guard sweep (issue 47): tests/e2e/test_guard_sweep.py with CACHECOMPILE_GUARD_SWEEP
# generated cases (default 256, in batches of 64, each batch four fresh processes over one
# store; most on aot_eager, every eighth on Inductor), zero wrong hits. By default the file
# runs the fixed seed's 21 (one per kind: CI's breadth step); this tier runs many more, the
# same 21 first (guard_gen.cases is prefix-stable), on the README's venv
# (.venv, made by the README command: no install of its own), on every logical core. About
# 3 minutes on 2 idle cores. It ran 384 until issue 65 sized it to CI's time: 256 cases
# (the first 256 of the same seed's 384) still draw each of the 21 kinds 16 times or more;
# CACHECOMPILE_GUARD_SWEEP=384 runs the old size. CACHECOMPILE_GUARD_SWEEP_SEED picks
# another seed (a failure names its seed and case; tests/guard_gen.py rebuilds it).
# A tier of .ci/tiers.sh: `items`, `prepare N` (nothing to install), `test N`; on its own,
# `bash .ci/guard-sweep.sh` runs `test` for the default item.
set -uo pipefail
cd "$(dirname "$0")/.."

items() { echo "${CACHECOMPILE_GUARD_SWEEP:-256}"; }
# Its time on the reference machine (docs/performance.md, "The test suite"): 229 s for 384
# cases, and about 30 s to start (`estimate` and `fit` below).
SECS_PER_384=229
START_S=30

run_test() {
  if [ ! -x .venv/bin/python ]; then
    echo "guard sweep: no .venv (the README command makes it)" >&2
    return 1
  fi
  . .venv/bin/activate
  # With the write sweep (issue 60: tests/e2e/test_write_sweep.py, generated writes across
  # graph breaks in every form; the README command runs 12): its batch of 48 runs beside
  # the guard sweep's of 64.
  CACHECOMPILE_GUARD_SWEEP=$1 CACHECOMPILE_WRITE_SWEEP=${CACHECOMPILE_WRITE_SWEEP:-48} \
    python -m pytest -n logical --maxschedchunk=1 \
    tests/e2e/test_guard_sweep.py tests/e2e/test_write_sweep.py
  local rc=$?
  deactivate
  [ "$rc" -eq 5 ] && { echo "guard sweep: pytest collected no tests" >&2; return 1; }
  return "$rc"
}

case "${1:-}" in
  items) items ;;
  prepare) echo "== guard sweep $2: nothing to install (the README's .venv)" ;;
  # Tests' seconds on the reference machine: SECS_PER_384 for 384 cases, plus a start.
  estimate) echo $(( $2 * SECS_PER_384 / 384 + START_S )) ;;
  discard) ;;
  # The largest sweep, in whole batches of 64, whose estimate fits in $3 seconds; nothing
  # when not even one batch does (.ci/tiers.sh sizes the sweep to a slow machine's time).
  fit) n=$(( ($3 - START_S) * 384 / SECS_PER_384 / 64 * 64 )); [ "$n" -gt "$2" ] && n=$2
       [ "$n" -ge 64 ] && echo "$n" ;;
  test) start=$SECONDS; run_test "$2" || exit $?
        echo "== guard sweep $2: tests took $((SECONDS - start)) s" ;;
  "") run_test "$(items)" ;;
  *) echo "usage: $0 [items | prepare N | test N | estimate N | discard N | fit N SECONDS]" >&2; exit 2 ;;
esac
