#!/bin/bash
# The pytest suite's GPU tests (tests/test_cuda.py, and the GPU cases of test_layer.py,
# test_model_py.py and test_cuda_shm.py) on a GPU machine that reaches no registry (the H200: python3
# 3.12 with torch, cupy, numpy and nvcc). Carry .whl/pytest (tools/gpu/wheels.sh fills it: pytest, hypothesis,
# safetensors and their dependencies, as the CI's constraints.txt pins them, and cffi, which the
# image lacks) and a library built with the CUDA backend (LIB=...; else `make lib CUDA_ARCH=90` runs
# there). The image's own pytest plugins are left out: its pytest-timeout does not load into the
# pinned pytest.
#   usage, from the repository root: OUT=/some/dir [LIB=build/libcolibri.so] tools/gpu/pytest.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/gpu-pytest}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip install -q --no-index --no-deps --target "$work" .whl/pytest/*.whl > "$out/pip.log" 2>&1 \
  || { tail -5 "$out/pip.log"; exit 1; }
lib=${LIB:-}
if [ -z "$lib" ]; then
  make lib CUDA_ARCH=90 > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
  lib=build/libcolibri.so
fi
export PYTHONPATH="$work:$PWD/backend_src${PYTHONPATH:+:$PYTHONPATH}" PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 backend_src/colibri/_ffi_build.py --lib "$lib" > "$out/ffi.log" 2>&1 || { tail -20 "$out/ffi.log"; exit 1; }
[ $# -gt 0 ] || set -- tests/test_cuda.py tests/test_layer.py tests/test_model_py.py tests/test_cuda_shm.py
python3 -m pytest -q -p no:cacheprovider -rs "$@" > "$out/pytest.log" 2>&1
status=$?
tail -15 "$out/pytest.log"
exit $status
