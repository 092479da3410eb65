#!/bin/sh
# Container entrypoint. Makes sure a packed checkpoint is where COLIBRI_WEIGHTS points (writing a
# synthetic demo one only where asked: docker compose asks for its own named volume), then runs the
# command (through NVIDIA's entrypoint on the NGC bases, which checks the driver). A `tritonserver ...`
# command gets one --cuda-memory-pool-byte-size per visible GPU (none without a GPU) and, in the
# Debian image, the wheel's --backend-directory; a model repository holding colibri_moe is served
# through a copy (links, in $TMPDIR) whose config names the checkpoint (path, size, time, sha256, demo
# or not: GET /v2/models/colibri_moe/config shows it); and it runs under colibri's watchdog (`python3
# -m colibri watch -- tritonserver ...`), which restarts it when it exits unbidden or stops answering
# one-token requests (a killed Python-backend stub, which tritonserver never restarts, while ready
# says 200).
#   COLIBRI_WEIGHTS          absolute path of the checkpoint (the image sets /weights/...)
#   COLIBRI_DEMO_IF_MISSING  1: write a demo checkpoint (random weights) when it is missing; 0 (default):
#                            fail instead, in one line
#   COLIBRI_WEIGHTS_DIR      the host folder mounted at the checkpoint's folder, if any (compose passes
#                            its setting on): named in that line, and never given a demo checkpoint
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
folder=$(dirname "$weights")
name=$(basename "$weights")

# A whole model: the folder holds layer{N}.colibri.safetensors files (`pack --layer all`) and no
# $name; every layer is served (colibri serve --weights DIR does the same).
if [ ! -e "$weights" ] && ls "$folder"/layer[0-9]*.colibri.safetensors >/dev/null 2>&1; then
    weights=$folder
    export COLIBRI_WEIGHTS="$folder"
    echo "colibri entrypoint: no $name in $folder: serving its layer{N}.colibri.safetensors files" >&2
fi

if [ ! -e "$weights" ]; then
    host=${COLIBRI_WEIGHTS_DIR:-}
    # A host folder is the user's: random weights there would be served as if they were theirs (a
    # typo in the path used to get exactly that). Compose resolves a relative path from docker/.
    if [ -n "$host" ]; then
        case "$host" in /*) where=$host ;; *) where="$host (relative to docker/, where the compose file is)" ;; esac
        echo "colibri entrypoint: no $name in the host folder $where, mounted at $folder (COLIBRI_WEIGHTS_DIR): put the packed checkpoint there (python -m colibri pack ... --out <that folder>/$name), correct COLIBRI_WEIGHTS_DIR, or unset it to serve a demo checkpoint from compose's own volume (a folder of layer{N}.colibri.safetensors files serves a whole model)" >&2
        exit 1
    fi
    if [ "${COLIBRI_DEMO_IF_MISSING:-0}" != 1 ]; then
        echo "colibri entrypoint: no checkpoint at $weights: mount a folder holding $name at $folder (docker run -v /path/to/folder:$folder ...), or set COLIBRI_DEMO_IF_MISSING=1 for a demo checkpoint of random weights (docker compose sets it for its own named volume; the image alone does not)" >&2
        exit 1
    fi
    mkdir -p "$folder"
    # Written aside and renamed: a second container sharing the volume never sees half a file.
    partial="$folder/.partial-$$.colibri.safetensors"
    trap 'rm -f "$partial"' EXIT
    # shellcheck disable=SC2086  # COLIBRI_DEMO_ARGS is a list of words on purpose
    python3 -m colibri demo --out "$partial" ${COLIBRI_DEMO_ARGS:-}
    mv "$partial" "$weights"
    trap - EXIT
    echo "colibri entrypoint: wrote a demo checkpoint (random weights) to $weights" >&2
elif [ ! -r "$weights" ]; then
    echo "colibri entrypoint: $weights is there but this container's user (uid $(id -u)) cannot read it: make it readable (chmod a+r on the host)" >&2
    exit 1
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

# Triton keeps the dims model.py's auto-complete adds to a config but drops parameters, so the
# checkpoint's identity reaches colibri_moe's config through a copy of its repository (links) whose
# config.pbtxt names it. If the copy cannot be made, the repository is served as it is (model.py's
# log line still names the checkpoint).
staged_repository() {  # $1: a model repository, $2: a number for its copy; prints what to serve
    copy="${TMPDIR:-/tmp}/colibri-models-$2"
    if [ -f "$1/colibri_moe/config.pbtxt" ]; then
        if rm -rf "$copy" && python3 -m colibri stage "$1" --weights "$weights" --out "$copy" >&2; then
            printf '%s\n' "$copy"
            return
        fi
        echo "colibri entrypoint: serving $1 as it is: its colibri_moe config will not name the checkpoint" >&2
    fi
    printf '%s\n' "$1"
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
    # Each argument in turn to the end of the list, model repositories replaced by their copies.
    count=$# repository_next=no copies=0
    while [ "$count" -gt 0 ]; do
        arg=$1
        shift
        count=$((count - 1))
        if [ "$repository_next" = yes ]; then
            copies=$((copies + 1))
            arg=$(staged_repository "$arg" "$copies")
            repository_next=no
        else
            case "$arg" in
                --model-repository=*)
                    copies=$((copies + 1))
                    arg="--model-repository=$(staged_repository "${arg#--model-repository=}" "$copies")" ;;
                --model-repository) repository_next=yes ;;
            esac
        fi
        set -- "$@" "$arg"
    done
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
