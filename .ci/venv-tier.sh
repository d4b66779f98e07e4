# Sourced by the tiers that run in a venv of their own (.ci/torch-matrix.sh,
# .ci/npu-tier.sh): one way to enter such a venv and to leave it removed, so the disk
# holds one multi-GB torch install at a time.

# enter_tier_venv VENV [PYTHON]: create it (with PYTHON, default python3) and activate it.
enter_tier_venv() {
  "${2:-python3}" -m venv "$1" || return 1
  . "$1/bin/activate"
}

# find_python X.Y: an interpreter of that version, from pyenv ($PYENV_ROOT, else
# /root/.pyenv: versions/X.Y.*) or PATH (pythonX.Y); nothing when there is none.
find_python() {
  local v=$1 root=${PYENV_ROOT:-/root/.pyenv} found
  found=$(ls -d "$root/versions/$v".*/bin/python 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$found" ]; then
    found=$(command -v "python$v" || true)
  fi
  [ -n "$found" ] && echo "$found"
}

# leave_tier_venv VENV RC LABEL: deactivate, remove VENV, say so when pytest collected
# no tests (exit code 5), and return RC.
leave_tier_venv() {
  deactivate
  rm -rf "$1"
  if [ "$2" -eq 5 ]; then
    echo "$3: pytest collected no tests" >&2
  fi
  return "$2"
}

# tier_main LABEL [items | prepare ITEM | test ITEM | estimate ITEM | discard ITEM |
# fit ITEM SECONDS]: the one way a tier script runs. A tier script defines tier_items (its
# items, e.g. torch releases), tier_venv ITEM (the venv's path), tier_prepare ITEM (make
# the venv and install into it), tier_test ITEM (run the tests in it, then leave_tier_venv)
# and tier_estimate ITEM (the seconds its tests took on the reference machine: .ci/tiers.sh
# keeps CI's deadline with it); discard removes an item's venv untested; fit ITEM SECONDS
# prints a smaller item that fits in SECONDS, where the tier has one (the guard sweep's
# fewer cases). With no arguments every item is prepared and tested in turn (a tier run on
# its own); .ci/tiers.sh runs the halves separately, so that the next item installs
# (network and disk) while this one's tests use the cores.
# A failed install removes its venv; exit code 5 (no tests collected) fails the item.
tier_main() {
  local label=$1 rc
  shift
  case "${1:-}" in
    prepare)
      local start=$SECONDS
      tier_prepare "$2"
      rc=$?
      deactivate 2>/dev/null || true
      if [ "$rc" -ne 0 ]; then
        rm -rf "$(tier_venv "$2")"
        echo "$label $2: the install failed" >&2
        return "$rc"
      fi
      echo "== $label $2: installed in $((SECONDS - start)) s"
      ;;
    test)
      local start=$SECONDS
      tier_test "$2"
      rc=$?
      [ "$rc" -eq 5 ] && return 1
      [ "$rc" -eq 0 ] || return "$rc"
      echo "== $label $2: tests took $((SECONDS - start)) s"
      ;;
    items)
      tier_items
      ;;
    estimate)
      tier_estimate "$2"
      ;;
    discard)
      rm -rf "$(tier_venv "$2")"
      ;;
    fit)
      # A release cannot be run in part: no smaller item fits.
      ;;
    "")
      local item
      for item in $(tier_items); do
        echo "== $label $item"
        tier_main "$label" prepare "$item" || return $?
        tier_main "$label" test "$item" || return $?
      done
      ;;
    *)
      echo "usage: $0 [items | prepare ITEM | test ITEM | estimate ITEM | discard ITEM | fit ITEM SECONDS]" >&2
      return 2
      ;;
  esac
}
