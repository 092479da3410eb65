#!/bin/bash
# bench/serving/compare.py on a GPU node that reaches no registry (the H200: python3 3.12 with torch,
# nvcc, make). Carry `.whl`, filled here by client/gpu_wheels.sh (colibri's binding, the tritonserver
# bundle) and bench/serving/wheels.sh (.whl/loadtest: Locust, gevent, tritonclient 2.53). Writes
# build.log, compare.log, compare.json, compare.png, tritonserver.log and each run's Locust files to $OUT.
#   usage, from the repository root: OUT=/some/dir bench/serving/gpu_compare.sh [compare.py options]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/serving-gpu}
mkdir -p "$out"
work=$(mktemp -d)
# One version of each package (two stop the install): .whl/loadtest's tritonclient 2.53, protobuf 5
# and python-rapidjson replace gpu_wheels.sh's.
# shellcheck disable=SC2046
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
  $(ls .whl/*.whl | grep -v -E '/(tritonclient|protobuf|python_rapidjson)-') .whl/loadtest/*.whl
mkdir -p "$work/triton" && tar xJf .whl/tritonserver-py3.12.tar.xz -C "$work/triton"
# The bundle's pytriton/ (a namespace package there) is how `colibri serve` finds tritonserver.
export PYTHONPATH="$work/site:$work/triton:$PWD/backend_src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
make lib CUDA=1 CUDA_ARCH=90 > "$out/build.log" 2>&1
python3 backend_src/colibri/_ffi_build.py --lib build/libcolibri.so >> "$out/build.log" 2>&1
python3 bench/serving/compare.py --device gpu --out "$out" "$@" 2>&1 | tee "$out/compare.log"
