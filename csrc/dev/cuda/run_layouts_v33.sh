#!/bin/bash
# NOTES.md v33: main (b0) against the 64-k block layouts of kb_weights_v33.patch, on the device machine.
# Stage first, here (nvcc 13, sm_90a; see NOTES.md v29-v33 for the flags), into an ignored folder D:
#   D/b0.so   main's library                      (make lib CUDA_ARCH=90 NVCCFLAGS="... -gencode=arch=compute_90a,code=sm_90a")
#   D/kb4.so  the patch built with -DCOLIBRI_CUDA_KB_WEIGHTS=2 (layout 2: the blocks through the tensor map)
#   D/kb6.so  the patch built with -DCOLIBRI_CUDA_KB_WEIGHTS=3 (layout 3: stored swizzled, 1-d bulk copies)
#   D/h6/     check_cuda.cu linked to a copy of kb6.so named libcolibri.so (rpath $ORIGIN)
# then run it with D carried: `bash csrc/dev/cuda/run_layouts_v33.sh D`. On an H200 it times the whole table of the
# three builds, the timelines of Mixtral T=256 and the read-flush decode rows; on another card the same three at
# Mixtral T=4096 (timelines) and T=1, 4, 4096 (bench).
# $OUT keeps at most 8 files (the device tool returns no more).
D=${1:-.device/c33}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S='s/  */ /g'
(cd $D/h6 && for m in 3 0; do COLIBRI_CUDA_KB_WEIGHTS=$m timeout 100 ./check_dyn --quick 2>&1 | tail -1; done) | tee $OUT/q.txt
if grep -q H200 $OUT/gpu.txt; then
  timeout 200 python3 bench/bench_gpu.py --lib $D/b0.so --compare kb4=$D/kb4.so,kb6=$D/kb6.so --reps 30 --json $OUT/w1.json --plot $OUT/w1.png > $OUT/w1.txt 2>&1; echo "bench1 rc=$?"
  grep -E '^(Mixtral|DeepSeek|Qwen)' $OUT/w1.txt | head -21 | sed "$S" | awk "{print \$1,\$2,\$3,\$12,\$18,\$20,\$26}"
  grep 'met on' $OUT/w1.txt
  timeout 60 python3 csrc/dev/cuda/replay_kernels.py --libs b0=$D/b0.so,kb4=$D/kb4.so,kb6=$D/kb6.so --shapes Mixtral-8x7B --tokens 256 --reps 15 > $OUT/t.txt 2>&1; echo "timelines rc=$?"; grep -v Warn $OUT/t.txt | grep -v _warn | tail -30
  timeout 100 python3 bench/bench_gpu.py --lib $D/b0.so --compare kb4=$D/kb4.so,kb6=$D/kb6.so --reps 30 --flush read --tokens 1,4,256 --json $OUT/r.json > $OUT/r.txt 2>&1; echo "read rc=$?"
  grep -E '^(Mixtral|DeepSeek|Qwen)' $OUT/r.txt | head -9 | sed "$S" | awk "{print \$1,\$2,\$3,\$12,\$18,\$20,\$26}"
else
  timeout 90 python3 csrc/dev/cuda/replay_kernels.py --libs b0=$D/b0.so,kb4=$D/kb4.so,kb6=$D/kb6.so --shapes Mixtral-8x7B --tokens 4096 --reps 15 > $OUT/t.txt 2>&1; echo "timelines rc=$?"; grep -E 'span|gemv_kernel|wgmma_ws' $OUT/t.txt
  timeout 90 python3 bench/bench_gpu.py --lib $D/b0.so --compare kb4=$D/kb4.so,kb6=$D/kb6.so --reps 30 --tokens 1,4,4096 --json $OUT/w.json > $OUT/w.txt 2>&1; echo "bench rc=$?"
  grep -E '^(Mixtral|DeepSeek|Qwen)' $OUT/w.txt | head -9 | sed "$S" | awk "{print \$1,\$2,\$3,\$12,\$18,\$20,\$26}"
fi
