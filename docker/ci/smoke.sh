#!/bin/bash
# CI: the image built and started the way README's Docker section says, with the CPU-only build, then
# one HTTP/JSON inference request (docker/ci/infer_once.py; the config names the demo checkpoint) and
# `down -v`. Then the same image with COLIBRI_WEIGHTS_DIR set to an empty host folder: the start must
# fail, in one line naming that folder, and write nothing into it. This machine has no Docker
# daemon: podman-docker.sh (a copy of ../shared/tools') drives podman through the Docker API for the
# real `docker compose`, with a local debian:bookworm-slim. Needs root (apt, rootful podman).
# Host ports are free ones (COLIBRI_*_PORT), so that a server already on 8000 does not fail the run.
# Last, the same image as deploy/helm/colibri runs it (docker/ci/chart_run.py: the chart rendered with
# values-cpu.yaml, its pod's user, environment with the watchdog off, read-only root, tmpfs for its
# emptyDirs, no capabilities), and its startup, readiness and liveness probes run as the kubelet would.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || exec sudo -E "$0" "$@"
compose=(docker compose -f docker/docker-compose.yml --profile cpu)
t0=$SECONDS
stamp() { echo "smoke: $((SECONDS - t0)) s: $*"; }

# bookworm only: the Dockerfile's one base (trixie would cost another debootstrap).
PD_BASES=bookworm
# shellcheck source=docker/ci/podman-docker.sh
source docker/ci/podman-docker.sh
cleanup() {
  # podman-docker.sh's functions are not written for errexit (pd_stop waits on a killed loop).
  set +e
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
  pd_prune images
  pd_stop
}
# On failure it prints why; it sets its own EXIT trap (pd_stop), replaced by ours once it is up.
podman_docker_up || { echo "smoke: no container engine (above: why)" >&2; exit 1; }
trap cleanup EXIT
stamp "engine up ($(docker version --format 'podman {{.Server.Version}}'))"

read -r COLIBRI_HTTP_PORT COLIBRI_GRPC_PORT COLIBRI_METRICS_PORT < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export COLIBRI_HTTP_PORT COLIBRI_GRPC_PORT COLIBRI_METRICS_PORT

# The README's command, as written there.
if ! COLIBRI_CUDA=0 docker compose -f docker/docker-compose.yml --profile cpu up --build --wait triton-cpu; then
  "${compose[@]}" logs --tail 80 triton-cpu || true
  exit 1
fi
stamp "built, healthy"
docker image ls colibri-triton
podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep colibri-triton

served=$(python3 docker/ci/infer_once.py "http://127.0.0.1:$COLIBRI_HTTP_PORT" 4)
echo "$served"
grep -q "demo: yes" <<<"$served" || { echo "smoke: the config does not say the checkpoint is a demo" >&2; exit 1; }
"${compose[@]}" down -v
stamp "down"

# A host folder without the checkpoint (a typo in COLIBRI_WEIGHTS_DIR, say): no demo in it, no healthy
# container, the reason in one line. The image built above, not rebuilt.
host=$(mktemp -d)
chmod 755 "$host"
if COLIBRI_CUDA=0 COLIBRI_WEIGHTS_DIR="$host" "${compose[@]}" up --no-build --wait triton-cpu; then
  echo "smoke: started with no checkpoint in $host" >&2
  exit 1
fi
reason="no weights.colibri.safetensors in the host folder $host, mounted at /weights (COLIBRI_WEIGHTS_DIR)"
logs=$(COLIBRI_CUDA=0 "${compose[@]}" logs --no-log-prefix triton-cpu 2>&1)
container=$(COLIBRI_CUDA=0 "${compose[@]}" ps --all --quiet triton-cpu)
state=$(docker inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$container")
echo "smoke: with an empty host folder: $state; $(grep -cF "$reason" <<<"$logs") start(s) said: $(grep -m1 -F "$reason" <<<"$logs")"
grep -qF "$reason" <<<"$logs" || { echo "smoke: the reason is not in the log:" >&2; echo "$logs" >&2; exit 1; }
[ "$state" = "exited 1" ] || { echo "smoke: container $state, expected exited 1" >&2; exit 1; }
[ -z "$(ls -A "$host")" ] || { echo "smoke: something was written into $host: $(ls -A "$host")" >&2; exit 1; }
COLIBRI_CUDA=0 "${compose[@]}" down -v
rmdir "$host"
stamp "an empty host folder refused"

# As the Helm chart runs it (values-cpu.yaml): compose's cpu service with the pod's settings laid over
# it, then the chart's probes against it. The image built above, not rebuilt.
chart_override=$(mktemp --suffix .yml)
.venv/bin/python docker/ci/chart_run.py override "$chart_override"
chart=("${compose[@]}" -f "$chart_override")
if ! COLIBRI_CUDA=0 "${chart[@]}" up --no-build --wait triton-cpu; then
  COLIBRI_CUDA=0 "${chart[@]}" logs --tail 80 triton-cpu || true
  exit 1
fi
stamp "as the chart runs it: healthy"
container=$(COLIBRI_CUDA=0 "${chart[@]}" ps --quiet triton-cpu)
.venv/bin/python docker/ci/chart_run.py probes "$container" "$COLIBRI_HTTP_PORT"
python3 docker/ci/infer_once.py "http://127.0.0.1:$COLIBRI_HTTP_PORT" 4
COLIBRI_CUDA=0 "${chart[@]}" down -v
rm -f "$chart_override"
stamp "as the chart runs it: probes answered"
