# Sourced by .ci/run: the tiers after the README command (.ci/guard-sweep.sh,
# .ci/torch-matrix.sh, .ci/npu-tier.sh), pipelined. Each tier item (a Python, a torch
# release, a torch-npu release) has an install half (a venv of its own: mostly download and
# unpack, several GB for the CUDA builds) and a test half (the cores). Items k+1 and k+2
# install in the background while item k's tests run, and item 0 installs while the README
# command runs, so the installs (about 15 minutes of CI in a row) overlap the tests. At
# most three tier venvs exist at once (the one under test, the next two:
# _tiers_install_next), and only while the disk has room: a CUDA build's venv is about
# 5.5 GB and its install needs about 3 GB more while pip unpacks, so an item installs
# beside tests only with CACHECOMPILE_TIER_PREFETCH_GB (default 16) free for it and for
# each install ahead of it; with less it installs after them, when this item's venv is
# gone (slower, but a CI machine with a small disk passes). A CI run ran out of disk here
# (the Python 3.12 install, beside 3.10's venv and pip's cache of every CUDA wheel so
# far): pip's cache is off for the tiers (each wheel is installed once,
# so a cache only fills the disk), and each item's tests run with a TMPDIR of their own,
# removed after them (pytest's directories, Inductor's precompiled headers: 150 MB each).
# Every background install logs to a file that is printed when the item's turn comes.
#
# CI's deadline (CACHECOMPILE_CI_DEADLINE_S, default 4800 s: 80 of CI's 90 minutes). The
# same CI machine has run the same commit 2.6x slower one afternoon than that morning, which
# put CI past 90 minutes with every test green. When an item's turn comes, and again when
# its install ends, its estimate (its tests' seconds on the reference machine, `estimate
# ITEM`) times this machine's slowness (TIERS_FACTOR: .ci/run sets it to the README
# command's time over its time on the reference machine) must end before the deadline. On
# a machine slower than the reference (factor over 1.25) the sweep runs fewer batches
# (`fit`) and any other item that cannot is skipped, each said at once and again at the
# end; on one as fast as the reference it fails CI, since then the tests themselves have
# grown past the budget. An item that will not fit is not installed: the next that will
# installs instead. The items run most valuable first, so what a slow machine skips is what
# other items cover best: the torch matrix (2.11, the GPU machines' release, then the
# newest), then the Ascend tier, then the generated sweep (CI's breadth step runs its
# fixed seed).

TIERS_PATH=$PATH                      # before .ci/run activates the README's .venv
# Short: each item's tests get a TMPDIR under it, and paths there reach cachectl's tables.
TIERS_LOGS=$(mktemp -d "${TMPDIR:-/tmp}/cct.XXXXXX")
TIERS_ITEMS=()
TIERS_PIDS=()
TIERS_SKIPPED=()
TIERS_FACTOR=${TIERS_FACTOR:-1}
TIERS_DEADLINE=${CACHECOMPILE_CI_DEADLINE_S:-4800}

# Run a tier script outside any activated venv (its own venvs come from the system python3).
_tier_script() {
  PATH=$TIERS_PATH VIRTUAL_ENV='' PIP_NO_CACHE_DIR=1 bash ".ci/$1.sh" "${@:2}"
}

# Free space where the venvs go, in whole GB.
_tiers_free_gb() {
  df -P -k . | awk 'NR == 2 { print int($4 / 1048576) }'
}

# Start item K's install now if the disk has room for it beside what exists and for the
# PENDING installs ahead of it (room kept for each, even one already done: a margin), else
# say that it waits for the tests before it.
_tiers_prefetch() {
  local k=$1 pending=${2:-0} free need=${CACHECOMPILE_TIER_PREFETCH_GB:-16}
  free=$(_tiers_free_gb)
  need=$((need * (pending + 1)))
  if [ "$free" -ge "$need" ]; then
    _tiers_start "$k"
  else
    echo "== disk: ${free} GB free, under ${need} GB (CACHECOMPILE_TIER_PREFETCH_GB): the next" \
         "tier item installs after these tests, not beside them"
  fi
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
  for script in torch-matrix npu-tier guard-sweep; do
    [ -f ".ci/$script.sh" ] || continue
    for item in $(_tier_script "$script" items); do
      TIERS_ITEMS+=("$script $item")
    done
  done
  [ "${#TIERS_ITEMS[@]}" -gt 0 ] && _tiers_start 0
  return 0
}

# Stop a background install and the pip under it (a killed bash leaves its pip running,
# still writing into the venv about to be removed).
_tiers_kill() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do
    _tiers_kill "$child"
  done
  kill "$1" 2>/dev/null
}

# Stop a background install (CI is failing) and remove what it made.
tiers_abort() {
  local k
  for k in "${!TIERS_PIDS[@]}"; do
    _tiers_kill "${TIERS_PIDS[$k]}" && wait "${TIERS_PIDS[$k]}" 2>/dev/null
  done
  rm -rf .venv-py* .venv-torch-* .venv-npu-* "$TIERS_LOGS"
}

# 0 on a machine at about the reference speed: there a misfit is the tests' fault, not the
# machine's, and fails CI.
_tiers_at_reference_speed() {
  awk -v f="$TIERS_FACTOR" 'BEGIN { exit !(f <= 1.25) }'
}

# When item K's tests, started at AT (default now), end at this machine's speed.
_tiers_end() {
  local script item est
  read -r script item <<<"${TIERS_ITEMS[$1]}"
  est=$(_tier_script "$script" estimate "$item")
  awk -v at="${2:-$SECONDS}" -v est="$est" -v f="$TIERS_FACTOR" 'BEGIN { print int(at + est * f) }'
}

# 0 when item K's tests, started at AT (default now), end before the deadline.
_tiers_fits() {
  [ "$(_tiers_end "$1" "${2:-$SECONDS}")" -le "$TIERS_DEADLINE" ]
}

# Start installing the first items after K (of N) whose tests, started at AT, still end in
# time (on a machine at the reference speed, K+1 and K+2), until CACHECOMPILE_TIER_AHEAD
# (default 2) items after K are installed or installing. Two, not one: an install (150-230 s
# on a 2-core VM) outlasts the short items' tests (2.14.1's 114 s, torch-npu's 97 s), and
# with one ahead CI waited for them (110 s in one run); started earlier, beside the longer
# items' tests, they are done at their turn. On a slow machine an item may be skipped at its
# turn, its install wasted; the items run most valuable first, so it is a later one. MODE:
# prefetch (beside tests: only with the disk to spare) or now (one, the tests before it
# done).
_tiers_install_next() {
  local k=$1 n=$2 at=$3 mode=$4 j pending=0 ahead=${CACHECOMPILE_TIER_AHEAD:-2}
  for ((j = k + 1; j < n; j++)); do
    [ -n "${TIERS_PIDS[$j]:-}" ] && pending=$((pending + 1))
  done
  [ "$mode" = now ] && ahead=1
  for ((j = k + 1; j < n && pending < ahead; j++)); do
    [ -n "${TIERS_PIDS[$j]:-}" ] && continue
    if _tiers_at_reference_speed || _tiers_fits "$j" "$at"; then
      if [ "$mode" = prefetch ]; then
        _tiers_prefetch "$j" "$pending"
        [ -n "${TIERS_PIDS[$j]:-}" ] || return 0   # no room on the disk: none further
      else
        _tiers_start "$j"
      fi
      pending=$((pending + 1))
    fi
  done
}

# Item K does not fit: on a slow machine run a smaller one where the tier has one (the
# sweep's fewer cases), else skip it (its install stopped, its venv removed); on a machine
# as fast as the reference, fail. Returns 0 when skipped, 2 when shrunk, 1 to fail CI.
_tiers_skip() {
  local k=$1 script item left smaller
  read -r script item <<<"${TIERS_ITEMS[$k]}"
  if _tiers_at_reference_speed; then
    echo "$script $item would end past CI's deadline (${TIERS_DEADLINE} s) on a machine as" \
         "fast as the reference: the tests have outgrown CI's time (docs/testing.md," \
         "\"The budget, and how to keep it\")" >&2
    return 1
  fi
  left=$(awk -v now="$SECONDS" -v f="$TIERS_FACTOR" -v d="$TIERS_DEADLINE" \
    'BEGIN { print int((d - now) / f) }')
  smaller=$(_tier_script "$script" fit "$item" "$left")
  if [ -n "$smaller" ]; then
    echo "== SHRUNK for time: $script $item runs as $script $smaller (${TIERS_FACTOR}x the" \
         "reference machine's time, ${left} s of it left before the ${TIERS_DEADLINE} s deadline)"
    TIERS_ITEMS[k]="$script $smaller"
    TIERS_SKIPPED+=("$script $item (ran as $smaller)")
    return 2
  fi
  echo "== SKIPPED for time: $script $item (at ${SECONDS} s, ${TIERS_FACTOR}x the reference" \
       "machine's time, its tests would end past the ${TIERS_DEADLINE} s deadline)"
  if [ -n "${TIERS_PIDS[$k]:-}" ]; then
    _tiers_kill "${TIERS_PIDS[$k]}"
    wait "${TIERS_PIDS[$k]}" 2>/dev/null
  fi
  unset 'TIERS_PIDS[k]'
  _tier_script "$script" discard "$item"
  TIERS_SKIPPED+=("$script $item")
}

# Whether item K (of N) runs: 0 to run it (perhaps shrunk), 1 when skipped (the install
# of the next that fits started, if none is under way), 2 to fail CI.
_tiers_keep() {
  local k=$1 n=$2 rc
  _tiers_fits "$k" && return 0
  _tiers_skip "$k"
  rc=$?
  case $rc in
    2) return 0 ;;
    1) return 2 ;;
  esac
  _tiers_install_next "$k" "$n" "$SECONDS" now
  return 1
}

# Test every item in turn, each after its install, the next installing meanwhile.
tiers_run() {
  local k n=${#TIERS_ITEMS[@]} script item rc
  for ((k = 0; k < n; k++)); do
    read -r script item <<<"${TIERS_ITEMS[$k]}"
    echo "== $script $item"
    _tiers_keep "$k" "$n"
    rc=$?
    [ "$rc" -eq 2 ] && { tiers_abort; return 1; }
    [ "$rc" -eq 1 ] && continue
    read -r script item <<<"${TIERS_ITEMS[$k]}"
    if [ -z "${TIERS_PIDS[$k]:-}" ]; then
      _tiers_start "$k"
    fi
    wait "${TIERS_PIDS[$k]}"
    rc=$?
    unset 'TIERS_PIDS[k]'
    cat "$TIERS_LOGS/$k.log"
    if [ "$rc" -ne 0 ]; then
      echo "$script $item: the install failed (exit $rc)" >&2
      tiers_abort
      return 1
    fi
    # Again after the install, which may have run long (a slow mirror, a disk too small to
    # install beside the tests before).
    _tiers_keep "$k" "$n"
    rc=$?
    [ "$rc" -eq 2 ] && { tiers_abort; return 1; }
    [ "$rc" -eq 1 ] && continue
    read -r script item <<<"${TIERS_ITEMS[$k]}"
    echo "== disk: $(_tiers_free_gb) GB free"
    _tiers_install_next "$k" "$n" "$(_tiers_end "$k")" prefetch
    mkdir -p "$TIERS_LOGS/t$k"
    TMPDIR=$TIERS_LOGS/t$k _tier_script "$script" test "$item"
    rc=$?
    rm -rf "$TIERS_LOGS/t$k"
    if [ "$rc" -ne 0 ]; then
      tiers_abort
      return "$rc"
    fi
    echo "== through $script $item: ${SECONDS} s"
    # Deferred for want of disk: install it now that this item's venv is gone.
    _tiers_install_next "$k" "$n" "$SECONDS" now
  done
  rm -rf "$TIERS_LOGS"
  if [ "${#TIERS_SKIPPED[@]}" -gt 0 ]; then
    echo "== CI passed WITHOUT ${#TIERS_SKIPPED[@]} tier item(s) whole, skipped or shrunk for time" \
         "on a machine ${TIERS_FACTOR}x slower than the reference: ${TIERS_SKIPPED[*]}"
  fi
}
