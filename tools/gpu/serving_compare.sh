#!/bin/bash
# bench/serving/compare.py on a GPU node that reaches no registry (the H200: python3 3.12 with torch,
# nvcc, make). Carry .whl/site-py312.tar.xz and .whl/tritonserver-py3.12.tar.xz (tools/gpu/loadtest_wheels.sh
# and tools/gpu/wheels.sh make them here) and, to skip the build there, a library built here
# (COLIBRI_LIB=build/libcolibri.so; else `make lib` runs there). Writes build.log, compare.log,
# compare.json, compare.png, sweep.png, and runs.tgz (tritonserver.log and every Locust run) to $OUT.
#   usage, from the repository root: OUT=/some/dir [COLIBRI_LIB=...] tools/gpu/serving_compare.sh [compare.py options]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/serving-gpu}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" "$work/triton"
tar xJf .whl/site-py312.tar.xz -C "$work/site"
tar xJf .whl/tritonserver-py3.12.tar.xz -C "$work/triton"
# The bundle's pytriton/ (a namespace package there) is how `colibri serve` finds tritonserver.
export PYTHONPATH="$work/site:$work/triton:$PWD/backend_src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
lib=${COLIBRI_LIB:-}
if [ -z "$lib" ]; then
  make lib CUDA=1 CUDA_ARCH=90 > "$out/build.log" 2>&1
  lib=build/libcolibri.so
fi
python3 backend_src/colibri/_ffi_build.py --lib "$lib" >> "$out/build.log" 2>&1
status=0
python3 bench/serving/compare.py --device gpu --out "$out/runs" "$@" > "$out/compare.log" 2>&1 || status=$?
cp "$out/runs/compare.json" "$out/runs/compare.png" "$out/runs/sweep.png" "$out/" 2>/dev/null || true
tar czf "$out/runs.tgz" -C "$out" runs && rm -rf "$out/runs"
grep -v "^  " "$out/compare.log" | tail -60
exit $status
