#!/bin/sh
# Container entrypoint. Makes sure a packed checkpoint is where COLIBRI_WEIGHTS points (writing a
# synthetic demo one on first start, so `docker compose up` serves with no model at hand), then runs
# the command (through NVIDIA's entrypoint on the NGC bases, which checks the driver). A `tritonserver
# ...` command gets one --cuda-memory-pool-byte-size per visible GPU (none without a GPU) and, in the
# Debian image, the wheel's --backend-directory, and runs under colibri's watchdog (`python3 -m colibri
# watch -- tritonserver ...`), which restarts it when it exits unbidden or stops answering one-token
# requests (a killed Python-backend stub, which tritonserver never restarts, while ready says 200).
#   COLIBRI_WEIGHTS          absolute path of the checkpoint (the image sets /weights/...)
#   COLIBRI_DEMO_IF_MISSING  1 (default): write a demo checkpoint when it is missing; 0: fail instead
#   COLIBRI_DEMO_ARGS        extra arguments for `python -m colibri demo` (--experts 8 --dtype bf16 ...)
#   COLIBRI_WATCHDOG         1 (default): tritonserver under the watchdog; 0: tritonserver alone
#   COLIBRI_WATCH_ARGS       extra arguments for `python -m colibri watch` (--probe-interval 5 ...)
#   COLIBRI_CUDA_MEMORY_POOL_MB  CUDA memory pool per GPU, through which the Python backend hands GPU
#                            tensors to tritonserver (default 1024; 0: Triton's 64 MB default). A
#                            command that sets --cuda-memory-pool-byte-size itself is left alone.
set -eu

weights="${COLIBRI_WEIGHTS:?COLIBRI_WEIGHTS must name the packed checkpoint to serve}"
case "$weights" in
    /*) ;;
    # model.py would resolve a relative path against its version folder, this script against its
    # working directory: refuse rather than write the demo where the model does not look.
    *) echo "colibri entrypoint: COLIBRI_WEIGHTS must be an absolute path, got '$weights'" >&2; exit 2 ;;
esac

if [ ! -e "$weights" ]; then
    if [ "${COLIBRI_DEMO_IF_MISSING:-1}" != 1 ]; then
        echo "colibri entrypoint: no checkpoint at $weights (mount one, or set COLIBRI_DEMO_IF_MISSING=1)" >&2
        exit 1
    fi
    folder=$(dirname "$weights")
    mkdir -p "$folder"
    # Written aside and renamed: a second container sharing the volume never sees half a file.
    partial="$folder/.partial-$$.colibri.safetensors"
    trap 'rm -f "$partial"' EXIT
    # shellcheck disable=SC2086  # COLIBRI_DEMO_ARGS is a list of words on purpose
    python3 -m colibri demo --out "$partial" ${COLIBRI_DEMO_ARGS:-}
    mv "$partial" "$weights"
    trap - EXIT
    echo "colibri entrypoint: wrote a demo checkpoint to $weights" >&2
fi

# GPUs tritonserver numbers 0..n-1: those the NVIDIA container toolkit mounted (nvidia-smi lists them;
# without it, their device nodes), and no more than CUDA_VISIBLE_DEVICES lists when it is set.
gpu_count() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || n=0
    else
        n=0
        for node in /dev/nvidia[0-9]*; do
            [ -e "$node" ] && n=$((n + 1))
        done
    fi
    if [ "${CUDA_VISIBLE_DEVICES+set}" = set ]; then
        listed=0
        # CUDA stops at the first entry that names no device (-1, "", NoDevFiles).
        for entry in $(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' '); do
            case "$entry" in -*|*[!0-9A-Za-z-]*|NoDevFiles) break ;; esac
            listed=$((listed + 1))
        done
        [ "$listed" -lt "$n" ] && n=$listed
    fi
    echo "$n"
}

if [ "${1:-}" = tritonserver ]; then
    shift
    pool=yes
    backends=${COLIBRI_TRITON_BACKENDS:-}
    for arg in "$@"; do
        case "$arg" in
            --cuda-memory-pool-byte-size*) pool=no ;;
            --backend-directory*) backends= ;;
        esac
    done
    mb=${COLIBRI_CUDA_MEMORY_POOL_MB:-1024}
    case "$mb" in
        ''|*[!0-9]*) echo "colibri entrypoint: COLIBRI_CUDA_MEMORY_POOL_MB must be a number of MB, got '$mb'" >&2; exit 2 ;;
    esac
    if [ "$pool" = yes ] && [ "$mb" -gt 0 ]; then
        gpus=$(gpu_count)
        gpu=0
        while [ "$gpu" -lt "$gpus" ]; do
            set -- "$@" "--cuda-memory-pool-byte-size=$gpu:$((mb * 1048576))"
            gpu=$((gpu + 1))
        done
    fi
    [ -n "$backends" ] && set -- "--backend-directory=$backends" "$@"
    set -- tritonserver "$@"
fi

if [ "${1:-}" = tritonserver ] && [ "${COLIBRI_WATCHDOG:-1}" = 1 ]; then
    # shellcheck disable=SC2086  # COLIBRI_WATCH_ARGS is a list of words on purpose
    set -- python3 -m colibri watch ${COLIBRI_WATCH_ARGS:-} -- "$@"
fi

if [ -x /opt/nvidia/nvidia_entrypoint.sh ]; then
    exec /opt/nvidia/nvidia_entrypoint.sh "$@"
fi
exec "$@"
