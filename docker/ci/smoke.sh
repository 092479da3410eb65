#!/bin/bash
# CI: the image built and started the way README's Docker section says, with the CPU-only build, then
# one HTTP/JSON inference request (docker/ci/infer_once.py) and `down -v`. This machine has no Docker
# daemon: podman-docker.sh (a copy of ../shared/tools') drives podman through the Docker API for the
# real `docker compose`, with a local debian:bookworm-slim. Needs root (apt, rootful podman).
# Host ports are free ones (COLIBRI_*_PORT), so that a server already on 8000 does not fail the run.
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

python3 docker/ci/infer_once.py "http://127.0.0.1:$COLIBRI_HTTP_PORT" 4
"${compose[@]}" down -v
stamp "down"
