#!/bin/sh
# Container entrypoint. Makes sure a packed checkpoint is where COLIBRI_WEIGHTS points (writing a
# synthetic demo one on first start, so `docker compose up` serves with no model at hand), then runs
# the command through NVIDIA's entrypoint, which checks the driver and sets up CUDA compatibility.
# A `tritonserver ...` command runs under colibri's watchdog (`python3 -m colibri watch -- tritonserver
# ...`), which restarts it when it exits unbidden or stops answering one-token requests (a killed
# Python-backend stub, which tritonserver never restarts, while its ready endpoint still says 200).
#   COLIBRI_WEIGHTS          absolute path of the checkpoint (the image sets /weights/...)
#   COLIBRI_DEMO_IF_MISSING  1 (default): write a demo checkpoint when it is missing; 0: fail instead
#   COLIBRI_DEMO_ARGS        extra arguments for `python -m colibri demo` (--experts 8 --dtype bf16 ...)
#   COLIBRI_WATCHDOG         1 (default): tritonserver under the watchdog; 0: tritonserver alone
#   COLIBRI_WATCH_ARGS       extra arguments for `python -m colibri watch` (--probe-interval 5 ...)
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

if [ "${1:-}" = tritonserver ] && [ "${COLIBRI_WATCHDOG:-1}" = 1 ]; then
    # shellcheck disable=SC2086  # COLIBRI_WATCH_ARGS is a list of words on purpose
    set -- python3 -m colibri watch ${COLIBRI_WATCH_ARGS:-} -- "$@"
fi

if [ -x /opt/nvidia/nvidia_entrypoint.sh ]; then
    exec /opt/nvidia/nvidia_entrypoint.sh "$@"
fi
exec "$@"
