#!/usr/bin/env bash
# The Ascend tier: cachecompile's torchair adapter against the REAL torchair Python
# bundled in torch-npu 2.13.0, on CPU. torchair's 4 native modules are stood in by
# tests_npu/npu_standins.py (no CANN here); tests marked `npu` need Ascend hardware and
# are skipped with a reason. Own venv: installing torch-npu must not touch .venv.
# pytest's exit code 5 (no tests collected) is passed on: .ci/run fails on it.
set -uo pipefail
cd "$(dirname "$0")/.."

# torch-npu registers an entry point that makes plain `import torch` load libhccl.so.
export TORCH_DEVICE_BACKEND_AUTOLOAD=0

python3 -m venv .venv-npu || exit 1
. .venv-npu/bin/activate
pip install -q torch==2.13.0 torch-npu==2.13.0 packaging protobuf || exit 1
pip install -q -e '.[test]' || exit 1

python -m pytest tests_npu -p no:cacheprovider -W ignore::DeprecationWarning
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "Ascend tier collected no tests" >&2
fi
exit "$rc"
