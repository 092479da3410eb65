#!/bin/bash
# Serves colibri_moe from a GPU instance (KIND_GPU) on a machine with one GPU and no registry access,
# and checks it with the CUDA shared-memory client (inputs and output stay on the GPU) and the gRPC
# client. Needs python3 (3.12) with torch, numpy and safetensors, nvcc, make and a C compiler there,
# and .whl/ filled here by client/gpu_wheels.sh (wheels + tritonserver-py3.12.tar.xz).
# Writes to $OUT (default ./gpu-check): summary.txt, setup.log, build.log, server.log,
# grpc_client.log, cuda_shm_client.log, metrics.txt. Exits non-zero if any step failed.
#   usage, from the repository root: OUT=/some/dir client/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-check}
mkdir -p "$out"
work=$(mktemp -d)
failed=0

step() {  # step LOG DESCRIPTION COMMAND...: runs COMMAND, output appended to $out/LOG.log
  local log=$1 what=$2
  shift 2
  echo "== $what" >> "$out/$log.log"
  if "$@" >> "$out/$log.log" 2>&1; then
    echo "ok     $what" | tee -a "$out/summary.txt"
  else
    echo "FAILED $what (exit $?, see $log.log)" | tee -a "$out/summary.txt"
    failed=1
  fi
}

: > "$out/summary.txt"
step setup "machine" bash -c 'nvidia-smi -L; python3 --version; python3 -c "import torch, numpy; print(\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available(), \"numpy\", numpy.__version__)"; nvcc --version | tail -2'
step setup "install carried wheels into $work/site" \
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .whl/*.whl
step setup "unpack the tritonserver bundle" bash -c "mkdir -p '$work/triton' && tar xJf .whl/tritonserver-py3.12.tar.xz -C '$work/triton'"
# cuda-bindings 12.9 opens libcudart.so.12 by that name: the bundle's CUDA 12.6 runtime answers to it.
mkdir -p "$work/cudart"
ln -sf "$(ls "$work"/triton/nvidia_pytriton.libs/libcudart-*.so.12*)" "$work/cudart/libcudart.so.12"
export LD_LIBRARY_PATH="$work/cudart:${LD_LIBRARY_PATH:-}"
# The bundle's pytriton/ (a namespace package there) is how `colibri serve` finds tritonserver.
export PYTHONPATH="$work/site:$work/triton:$PWD/backend_src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

step build "libcolibri with the CUDA backend (sm_90)" make lib CUDA=1 CUDA_ARCH=90
step build "the cffi extension" python3 backend_src/colibri/_ffi_build.py --lib build/libcolibri.so
step build "a demo checkpoint" python3 -m colibri demo --out "$work/weights.colibri.safetensors"

serve() {  # serve DEVICE EXPECTED_KIND: starts `colibri serve --device DEVICE`, waits until ready and
           # checks the instance kind Triton resolved; the launcher's pid lands in $server
  python3 -m colibri serve --device "$1" --weights "$work/weights.colibri.safetensors" \
    --http-port 8000 --grpc-port 8001 --metrics-port 8002 >> "$out/server.log" 2>&1 &
  server=$!
  step server "--device $1: tritonserver ready with $2" python3 - "$2" <<'PY'
import json, sys, time, urllib.request
for _ in range(600):
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/v2/models/colibri_moe/ready", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    time.sleep(0.5)
else:
    raise SystemExit("not ready after 300 s")
config = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v2/models/colibri_moe/config"))
print(config["instance_group"])
assert config["instance_group"][0]["kind"] == sys.argv[1]
PY
}

stop() {
  kill -TERM "$server" 2>/dev/null
  wait "$server"
  echo "== server exit status $?" >> "$out/server.log"
}

# The repository's KIND_AUTO must become one GPU instance per GPU on a GPU host.
serve auto KIND_GPU
stop
serve gpu KIND_GPU
weights=(--weights "$work/weights.colibri.safetensors")
step grpc_client "gRPC client, T=7" python3 client/grpc_client.py "${weights[@]}"
step grpc_client "gRPC client, T=512" python3 client/grpc_client.py "${weights[@]}" --tokens 512
step cuda_shm_client "CUDA shared-memory client, T=7" python3 client/cuda_shm_client.py "${weights[@]}"
step cuda_shm_client "CUDA shared-memory client, T=512" python3 client/cuda_shm_client.py "${weights[@]}" --tokens 512
step server "metrics" bash -c "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8002/metrics\").read().decode())' > '$out/metrics.txt' && grep -q '^colibri_expert_tokens_total' '$out/metrics.txt'"

stop
rm -rf "$work"
echo "$([ $failed = 0 ] && echo PASS || echo FAIL): GPU serving check, logs in $out" | tee -a "$out/summary.txt"
exit $failed
