#!/bin/bash
# One call on the GPU machine: build, then the stages named in STAGES (check bench memcheck racecheck),
# each under its own time limit, logs under $OUT. Usage there: STAGES="check bench" csrc/dev/cuda/run_device.sh
set -u
OUT=${OUT:-/tmp/colibri-out}
mkdir -p "$OUT"
STAGES=${STAGES:-check bench memcheck}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$OUT/env.txt" 2>&1
{ time make lib CUDA_ARCH=90 -j16 && nvcc -O2 -std=c++17 -Icsrc/include -Xcompiler -fopenmp -o build/check_cuda \
    csrc/dev/cuda/check_cuda.cu build/libcolibri.a -lgomp; } >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep real "$OUT/build.log"
for s in $STAGES; do
  case $s in
  check)
    timeout "${CHECK_S:-180}" build/check_cuda >"$OUT/check.log" 2>&1; echo "check rc=$?"
    grep -E "^FAIL" "$OUT/check.log" | head -20; tail -13 "$OUT/check.log" ;;
  bench)
    PYTHONUNBUFFERED=1 timeout "${BENCH_S:-240}" python3 bench/bench_gpu.py --json "$OUT/gpu.json" >"$OUT/bench.log" 2>&1
    echo "bench rc=$?"; cat "$OUT/bench.log" ;;
  memcheck|racecheck)
    timeout "${SAN_S:-120}" compute-sanitizer --tool "$s" --print-limit 20 build/check_cuda --quick >"$OUT/$s.log" 2>&1
    echo "$s rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL|PASS:|FAIL:" "$OUT/$s.log" | tail -5 ;;
  esac
done
