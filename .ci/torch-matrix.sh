#!/usr/bin/env bash
# The torch matrix beyond the README's 2.13.0: torch 2.11.0, 2.12.1, 2.14.1 and 2.15.0,
# each in its own venv, each running the subset that covers the warm path, guards, graph
# breaks and the private-torch layer (ranks, a remote node and an HF model on the end
# releases; 2.12.1 and 2.14.1, between the ends and the README's 2.13, less: SUBSET, ENDS,
# NEAR_SUBSET below). These PyPI
# builds are CUDA builds (~5 GB each, 2-3 minutes to install) that run on CPU; each venv is
# removed after its run to keep the disk small.
#
# It is the Python matrix too (issue 65: it was a tier of its own, two more 5 GB installs
# of torch 2.13 for the same fast tests): 2.11.0 runs on Python 3.10, the oldest the
# package claims, and 2.15.0 on 3.12, each adding the fast tests of the store, the key,
# the entry format and the layer check (what a Python release changes most: bytecode, the
# standard library, the libraries pip picks for it); 2.12.1 and 2.14.1 run on the README
# command's 3.11. (3.12 was 2.12.1's until issue 65: on an end release it also runs the
# whole subset, the guard sweep's super() cases through 3.12's LOAD_SUPER_ATTR among
# them.) An item is "RELEASE" or "RELEASE@PYTHON"; a Python with no interpreter here
# (pyenv or pythonX.Y on PATH) is said and skipped.
#
# It also proves the install contract: `pip install -e .` next to an installed torch
# keeps that torch (no downgrade to 2.13, no upgrade).
# pytest's exit code 5 (no tests collected) fails the tier: the subset vanished.
set -uo pipefail
cd "$(dirname "$0")/.."
. .ci/venv-tier.sh

# Some machines carry a pip constraints file (pip.conf's global.constraint) that caps torch
# at the release cached on their disk (torch<=2.14.1). It would refuse 2.15.0 and, worse,
# let `pip install -e .` move an installed 2.15.0 back down. The matrix names its torch
# exactly, so it opts out of any such cap; every other pip setting (indexes, find-links)
# stays as the machine has it.
export PIP_CONSTRAINT=/dev/null

# One test per promise, not the whole suite: the full suite runs on 2.13 (the README's
# command). Per release (2.12.1 and 2.14.1 less: NEAR_SUBSET below): the warm path (no
# torch._dynamo/_inductor import, zero compiler calls), Dynamo's guards (the guard matrix,
# and the generated guard cases' fixed seed: the lookups Dynamo resolves are read through
# its private names) and the C++ guard tree,
# the private-torch layer and its probe, the API contract, a bare backend callable's
# Dynamo half rebuilt from data, and the traced floats' tensors made
# once (torch._as_tensor_fullprec, which 2.11 and 2.12 also call in shape guards). (The
# diffusers UNet and DiT, and the other LLM families, run on 2.13.)
# Guards, graph breaks and writes differ between releases in what Dynamo captures, not in
# what the backend builds from it: their tests run on aot_eager here (on both backends in
# the README command); the warm path, the zoo model and the plugin test keep Inductor per
# release (issue 65: the guard matrix's Inductor half alone was ~4 minutes a release).
# The remote tier runs its file:// case on the end releases (ENDS below): what a release
# changes is the entry a node publishes and another loads, not how a tier moves its bytes
# (the store is torch-free);
# its Redis, S3, HTTP and OCI cases, ~20 s each a release, run on 2.13 (the README command
# and the breadth step after it).
# A training graph's layout is read from AOTAutograd's metadata, whose fields move between
# releases (_torch/aot.py): one in-process training test per backend, on a stored entry.
# NEAR_SUBSET is what every release runs; SUBSET adds the rest for all but NEAR_RELEASES.
# 2.14.1 is one minor from the README command's 2.13 and from 2.15, and 2.12.1 from 2.11
# and 2.13, each of which runs the whole SUBSET: they run their private-torch layer,
# guards, warm path, the API and a training hit, not the generated sweeps, live frames,
# floats, plugins and the cross-release miss, which reach Dynamo through the same private
# names (issue 65: 2.14.1's tests took 132 s instead of 189 s on a 2-core VM, 2.12.1's
# subset 305 s). What this leaves to the neighbours: a behaviour one release changed and
# the next changed back. Every branch on the release in cachecompile/_torch/ (at_least
# 2.12, 2.13, 2.14) has its both sides in 2.11, 2.13 and 2.15; 2.12 is the one release
# on the newer side of 2.12's branches and the older of 2.13's, which are about other
# things (guard entries as read, against Inductor's cpp.march), and its guard matrix runs.
NEAR_RELEASES="2.12.1 2.14.1"
NEAR_SUBSET=(tests/e2e/test_warm_start.py::test_cold_then_warm_compiles_nothing
             "tests/e2e/test_guard_matrix.py::test_guard_matrix[aot_eager]"
             tests/entry/test_guard_tree.py
             tests/_torch/test_torch_layer.py
             tests/e2e/test_cache_compile_api.py
             "tests/e2e/test_training.py::test_retain_graph_create_graph_and_double_backward_on_a_hit")
SUBSET=("${NEAR_SUBSET[@]}"
        tests/e2e/test_guard_sweep.py
        tests/backends/test_plugins.py::test_a_bare_backend_callable_skips_the_trace_in_a_warm_process
        tests/e2e/test_cross_release.py
        tests/e2e/test_float_inputs.py
        "tests/e2e/test_live_frames.py::test_a_frame_compiled_live_carries_every_guard_of_a_cold_capture[aot_eager]"
        tests/e2e/test_write_sweep.py)
# On the oldest and the newest release only (ENDS), what goes through the layers above
# the private-torch one without a private name of its own: ranks sharing one compile (the
# graph's digest), a node loading another's entry through the remote tier, and a real HF
# model's decorated forward end to end. A release between two ends differs from both in
# private names, which the subset above exercises on it (issue 65: ~50 s a release at the
# reference speed). The bundle test, torch-free like the whole store, runs in the Python
# matrix (PYTHON_TESTS) and the README command.
ENDS=(tests/procs/test_ranks.py::test_four_ranks_compile_one_shared_graph_once
      "tests/procs/test_remote_procs.py::test_node_b_loads_node_a_entry_with_zero_compiles[file]"
      "tests/e2e/test_zoo.py::test_zoo_model[llama-forward]")
END_RELEASES="2.11.0 2.15.0"
# On another Python than the README command's: the fast tests of what a Python release
# changes most. Left out: the store's stats test (it compiles a model in fresh processes),
# the S3 and Redis tiers' (servers, 45 and 33 s; the Redis client's URL handling still runs
# in test_remote_secrets) and the manifest-integrity cases (hashed alike on every Python);
# all of them run on 3.11 in the README command or the breadth step after it.
PYTHON_TESTS=(tests/store tests/entry tests/key tests/test_layers.py
              --ignore=tests/store/test_stats.py --ignore=tests/store/test_s3.py
              --ignore=tests/store/test_remote.py
              --ignore=tests/store/test_store_manifest_integrity.py)

# 2.11.0: the release the lent GPU machines run (torch 2.11.0+cu130); 2.12.1: the last of
# 2.12. Both differ from 2.13 in private names and guards (cachecompile/_torch/). In the
# order a slow machine keeps them (.ci/tiers.sh: CI's deadline): the oldest (and Python
# 3.10), the newest (and 3.12), then 2.12, then 2.14.1, the nearest to the README's 2.13.
tier_items() { echo "${CACHECOMPILE_TORCH_MATRIX:-2.11.0@3.10 2.15.0@3.12 2.12.1 2.14.1}"; }
tier_venv() { echo ".venv-torch-${1/@/-py}"; }
# Tests' seconds on the reference machine (docs/performance.md, "The test suite"): an item on
# another Python adds that Python's fast tests.
is_end() { [[ " $END_RELEASES " == *" $(item_torch "$1") "* ]]; }
is_near() { [[ " $NEAR_RELEASES " == *" $(item_torch "$1") "* ]]; }
tier_estimate() {
  local e=140
  is_near "$1" && e=90
  is_end "$1" && e=$((e + 50))
  [[ $1 == *@* ]] && e=$((e + 155))
  echo "$e"
}
item_torch() { echo "${1%%@*}"; }
item_python() { [[ $1 == *@* ]] && echo "${1#*@}"; }

tier_prepare() {
  local tv py pv got
  tv=$(item_torch "$1")
  pv=$(item_python "$1")
  py=python3
  if [ -n "$pv" ]; then
    py=$(find_python "$pv")
    if [ -z "$py" ]; then
      echo "== torch $tv on Python $pv: no interpreter (pyenv or python$pv on PATH), skipped"
      return 0
    fi
  fi
  enter_tier_venv "$(tier_venv "$1")" "$py" || return 1
  pip install -q "torch==$tv" || return 1
  pip install -q -e '.[test]' || return 1
  got=$(python -c 'import torch; print(torch.__version__.split("+")[0])')
  if [ "$got" != "$tv" ]; then
    echo "pip install -e . changed torch $tv into $got" >&2
    return 1
  fi
}

tier_test() {
  local venv rc
  venv=$(tier_venv "$1")
  [ -d "$venv" ] || return 0   # skipped in tier_prepare (no interpreter)
  . "$venv/bin/activate"
  # The README command's venv (torch 2.13) is the other release of the cross-release test
  # (tests/e2e/test_cross_release.py: an entry of one release is a named miss on another).
  if [ -x .venv/bin/python ]; then
    export CACHECOMPILE_TEST_OTHER_PYTHON=$PWD/.venv/bin/python
  fi
  local tests=("${SUBSET[@]}")
  is_near "$1" && tests=("${NEAR_SUBSET[@]}")
  is_end "$1" && tests+=("${ENDS[@]}")
  python -m pytest -q -p no:cacheprovider -n logical --maxschedchunk=1 --durations=10 "${tests[@]}"
  rc=$?
  if [ "$rc" -eq 0 ] && [ -n "$(item_python "$1")" ]; then
    python -m pytest -q -p no:cacheprovider -m "not slow" -n logical "${PYTHON_TESTS[@]}"
    rc=$?
  fi
  leave_tier_venv "$venv" "$rc" "torch $1"
}

tier_main torch "$@"
exit $?
