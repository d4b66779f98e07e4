# Sourced by the tiers that run in a venv of their own (.ci/torch-matrix.sh,
# .ci/npu-tier.sh): one way to enter such a venv and to leave it removed, so the disk
# holds one multi-GB torch install at a time.

# enter_tier_venv VENV: create and activate it.
enter_tier_venv() {
  python3 -m venv "$1" || return 1
  . "$1/bin/activate"
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
