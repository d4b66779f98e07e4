# Sourced by .ci/run: the tiers after the README command (.ci/guard-sweep.sh,
# .ci/python-matrix.sh, .ci/torch-matrix.sh, .ci/npu-tier.sh), pipelined. Each tier item
# (a Python, a torch release, a torch-npu release) has an install half (a venv of its own: mostly download and
# unpack, several GB for the CUDA builds) and a test half (the cores). Item k+1 installs
# in the background while item k's tests run, and item 0 installs while the README command
# runs, so the installs (about 15 minutes of CI in a row) overlap the tests. At most two
# tier venvs exist at once (the one under test, the next one), as the disk allows.
# Every background install logs to a file that is printed when the item's turn comes.

TIERS_PATH=$PATH                      # before .ci/run activates the README's .venv
TIERS_LOGS=$(mktemp -d "${TMPDIR:-/tmp}/cachecompile-ci-tiers.XXXXXX")
TIERS_ITEMS=()
TIERS_PIDS=()

# Run a tier script outside any activated venv (its own venvs come from the system python3).
_tier_script() {
  PATH=$TIERS_PATH VIRTUAL_ENV='' bash ".ci/$1.sh" "${@:2}"
}

_tiers_start() {
  local k=$1 script item
  read -r script item <<<"${TIERS_ITEMS[$k]}"
  _tier_script "$script" prepare "$item" >"$TIERS_LOGS/$k.log" 2>&1 &
  TIERS_PIDS[k]=$!
}

# List the items and start installing the first.
tiers_init() {
  local script item
  for script in guard-sweep python-matrix torch-matrix npu-tier; do
    [ -f ".ci/$script.sh" ] || continue
    for item in $(_tier_script "$script" items); do
      TIERS_ITEMS+=("$script $item")
    done
  done
  [ "${#TIERS_ITEMS[@]}" -gt 0 ] && _tiers_start 0
  return 0
}

# Stop a background install (CI is failing) and remove what it made.
tiers_abort() {
  local k
  for k in "${!TIERS_PIDS[@]}"; do
    kill "${TIERS_PIDS[$k]}" 2>/dev/null && wait "${TIERS_PIDS[$k]}" 2>/dev/null
  done
  rm -rf .venv-py* .venv-torch-* .venv-npu-* "$TIERS_LOGS"
}

# Test every item in turn, each after its install, the next installing meanwhile.
tiers_run() {
  local k n=${#TIERS_ITEMS[@]} script item rc
  for ((k = 0; k < n; k++)); do
    read -r script item <<<"${TIERS_ITEMS[$k]}"
    echo "== $script $item"
    wait "${TIERS_PIDS[$k]}"
    rc=$?
    unset 'TIERS_PIDS[k]'
    cat "$TIERS_LOGS/$k.log"
    if [ "$rc" -ne 0 ]; then
      echo "$script $item: the install failed (exit $rc)" >&2
      tiers_abort
      return 1
    fi
    [ $((k + 1)) -lt "$n" ] && _tiers_start $((k + 1))
    _tier_script "$script" test "$item"
    rc=$?
    if [ "$rc" -ne 0 ]; then
      tiers_abort
      return "$rc"
    fi
    echo "== through $script $item: ${SECONDS} s"
  done
  rm -rf "$TIERS_LOGS"
}
