#!/bin/bash
# One call on the GPU machine: build (or take a build made elsewhere), then the stages named in STAGES
# (check bench memcheck racecheck), each under its own time limit, logs under $OUT.
# Usage there:  STAGES="check bench" csrc/dev/cuda/run_device.sh
# PREBUILT=DIR: DIR holds libcolibri.so and check_cuda built off the GPU (e.g. here with nvcc 13:
#   make lib CUDA_ARCH=90 BUILD=DIR && nvcc -O2 -std=c++17 -Icsrc/include -Xcompiler -fopenmp \
#   -o DIR/check_cuda csrc/dev/cuda/check_cuda.cu DIR/libcolibri.a -lgomp), carried to the machine:
#   no build time there. BASE=PATH: the bench also times that library (--compare base=PATH).
set -u
OUT=${OUT:-/tmp/colibri-out}
mkdir -p "$OUT"
STAGES=${STAGES:-check bench memcheck}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$OUT/env.txt" 2>&1
dir=${PREBUILT:-build}
if [ -z "${PREBUILT:-}" ]; then
  { time make lib CUDA_ARCH=90 -j16 && nvcc -O2 -std=c++17 -Icsrc/include -Xcompiler -fopenmp -o build/check_cuda \
      csrc/dev/cuda/check_cuda.cu build/libcolibri.a -lgomp; } >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  grep real "$OUT/build.log"
fi
compare=()
[ -n "${BASE:-}" ] && compare=(--compare "base=$BASE")
for s in $STAGES; do
  case $s in
  check)
    timeout "${CHECK_S:-180}" "$dir/check_cuda" >"$OUT/check.log" 2>&1; echo "check rc=$?"
    grep -E "^FAIL" "$OUT/check.log" | head -20; tail -13 "$OUT/check.log" ;;
  bench)
    PYTHONUNBUFFERED=1 timeout "${BENCH_S:-240}" python3 bench/bench_gpu.py --lib "$dir/libcolibri.so" ${compare[@]+"${compare[@]}"} \
      --json "$OUT/gpu.json" >"$OUT/bench.log" 2>&1
    echo "bench rc=$?"; cat "$OUT/bench.log" ;;
  memcheck|racecheck)
    timeout "${SAN_S:-120}" compute-sanitizer --tool "$s" --print-limit 20 "$dir/check_cuda" --quick >"$OUT/$s.log" 2>&1
    echo "$s rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL|PASS:|FAIL:" "$OUT/$s.log" | tail -5 ;;
  esac
done
