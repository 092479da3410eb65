#!/bin/bash
# GPU serving check on a one-GPU machine with no registry access. The server's Python cannot import
# torch (a package on its path refuses it), so the GPU instance must load and serve with cupy alone.
# Serves a bf16 layer (SHAPE=E,k,H,F, default Mixtral's 8,2,4096,14336; DTYPE=fp8_e4m3 for fp8 experts
# in 128 x 128 blocks, drawn and quantised with numpy: pick a smaller SHAPE; fp32 activations on the wire)
# with --device auto (expecting KIND_GPU), runs the gRPC, HTTP, system- and CUDA-shared-memory clients
# and a few seconds of Locust's CudaShmUser (CUDA shared memory is cupy's, colibri.serving.cuda_shm: the machine's
# cupy, no cuda-python), and times the first requests with and without the instance's warm-up. Carry
# .whl/site-py312.tar.xz and .whl/tritonserver-py3.12.tar.xz (tools/gpu/wheels.sh, then
# tools/gpu/loadtest_wheels.sh) and a CUDA build (COLIBRI_LIB=...; else make lib).
# Writes $OUT (default ./gpu-check): summary.txt, first_request.json and one log per step.
#   usage, from the repository root: OUT=/some/dir [COLIBRI_LIB=build/libcolibri.so] tools/gpu/serving_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/gpu-check}
shape=${SHAPE:-8,2,4096,14336}
dtype=${DTYPE:-bf16}
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
mkdir -p "$work/site" "$work/triton" "$work/notorch/torch"
tar xJf .whl/site-py312.tar.xz -C "$work/site"
tar xJf .whl/tritonserver-py3.12.tar.xz -C "$work/triton"
echo 'raise ImportError("torch is not installed here (tools/gpu/serving_check.sh: the server must not need it)")' \
  > "$work/notorch/torch/__init__.py"
# The bundle's pytriton/ (a namespace package there) is how `colibri serve` finds tritonserver.
export PYTHONPATH="$work/site:$work/triton:$PWD/backend_src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
server_path="$work/notorch:$PYTHONPATH"

step setup "machine" bash -c 'nvidia-smi -L; python3 --version; python3 -c "import cupy, numpy; print(\"cupy\", cupy.__version__, \"numpy\", numpy.__version__)"'
step setup "no cuda-python among the carried packages" test ! -e "$work/site/cuda/bindings"
lib=${COLIBRI_LIB:-}
if [ -z "$lib" ]; then
  step build "libcolibri with the CUDA backend (sm_90)" make lib CUDA=1 CUDA_ARCH=90
  lib=build/libcolibri.so
fi
step build "the cffi extension" python3 backend_src/colibri/_ffi_build.py --lib "$lib"
weights="$work/layer.colibri.safetensors"
IFS=, read -r E k H F <<< "$shape"
step build "a $dtype checkpoint $shape" python3 -c "
from pathlib import Path; from colibri.testing import load_script; compare = load_script('bench/serving/compare.py')
compare.write_demo(Path('$weights'), $E, $k, $H, $F, '$dtype')"

serve() {  # serve LOG ARGS...: starts `colibri serve` without torch on its path; pid in $server
  local log=$1
  shift
  PYTHONPATH="$server_path" python3 -m colibri serve --weights "$weights" \
    --http-port 8000 --grpc-port 8001 --metrics-port 8002 "$@" >> "$out/$log.log" 2>&1 &
  server=$!
  step "$log" "serve $*: ready with KIND_GPU" python3 - <<'PY'
import json, sys, time, urllib.request
for _ in range(1200):
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/v2/models/colibri_moe/ready", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    time.sleep(0.5)
else:
    raise SystemExit("not ready after 600 s")
config = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v2/models/colibri_moe/config"))
print(config["instance_group"])
assert config["instance_group"][0]["kind"] == "KIND_GPU"
PY
}

stop() {
  kill -TERM "$server" 2>/dev/null
  wait "$server"
  echo "== server exit status $?" >> "$out/$1.log"
}

first_requests() {  # first_requests LABEL: the first gRPC requests' latencies, then the steady ones
  python3 - "$1" "$H" >> "$out/first_request.json" <<'PY'
import json, sys, time
import numpy as np
import tritonclient.grpc as grpcclient
label, H = sys.argv[1], int(sys.argv[2])
client = grpcclient.InferenceServerClient("127.0.0.1:8001")
def once(T):
    x = np.random.default_rng(T).standard_normal((T, H)).astype(np.float32)
    tensor = grpcclient.InferInput("hidden_states", [T, H], "FP32")
    tensor.set_data_from_numpy(x)
    start = time.perf_counter()
    client.infer("colibri_moe", [tensor])
    return round((time.perf_counter() - start) * 1e3, 2)
first = {"T=1": once(1), "T=512": once(512), "T=4096": once(4096)}
steady = {"T=1": float(np.median([once(1) for _ in range(20)])), "T=512": float(np.median([once(512) for _ in range(5)])),
          "T=4096": float(np.median([once(4096) for _ in range(5)]))}
print(json.dumps({"server": label, "first_ms": first, "steady_median_ms": steady}))
PY
}

serve server_warm --device auto
step first_request "first requests, warm-up on" first_requests "warm-up on (default)"
args=(--weights "$weights")
step clients "gRPC client, T=7" python3 client/grpc_client.py "${args[@]}"
step clients "gRPC client, T=512" python3 client/grpc_client.py "${args[@]}" --tokens 512
step clients "HTTP/JSON client, T=7" python3 client/http_client.py "${args[@]}"
step clients "system shared-memory client, T=7" python3 client/shm_client.py "${args[@]}"
step clients "CUDA shared-memory client, T=7" python3 client/cuda_shm_client.py "${args[@]}"
step clients "CUDA shared-memory client, T=512" python3 client/cuda_shm_client.py "${args[@]}" --tokens 512
step loadtest "Locust CudaShmUser, 4 users for 5 s, no failures" python3 loadtest/run.py \
  --host http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --protocols cudashm --users 4 --time 5s \
  --mix decode:1,prefill:1 --prefill-tokens 16-512 --out "$out/loadtest"
step server_warm "inputs reached model.py in GPU memory" grep -q "arrived in GPU memory" "$out/server_warm.log"
step server_warm "metrics" bash -c "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8002/metrics\").read().decode())' > '$out/metrics.txt' && grep -q '^colibri_expert_tokens_total' '$out/metrics.txt'"
stop server_warm

# The same repository with the warm-up off: what a first request paid before it.
cp -rL model_repository "$work/cold"
sed -i '/key: "COLIBRI_WARMUP"/{n;s/"yes"/"no"/}' "$work/cold/colibri_moe/config.pbtxt"
serve server_cold --device gpu --model-repository "$work/cold"
step first_request "first requests, warm-up off" first_requests "warm-up off"
stop server_cold

rm -rf "$work"
echo "$([ $failed = 0 ] && echo PASS || echo FAIL): GPU serving check, logs in $out" | tee -a "$out/summary.txt"
exit $failed
