"""CI: the container as deploy/helm/colibri runs it, under compose. Renders the chart with
values-cpu.yaml (helm-python-sdk, from the test profile) and
  override FILE   writes a compose override for triton-cpu with the pod's settings: its command, its
                  environment (watchdog off), its user, a read-only root filesystem with tmpfs where
                  the pod has emptyDirs, no capabilities, no privilege escalation, its /dev/shm size,
                  no init process, and the liveness probe's command as the health check;
  probes CONTAINER HTTP_PORT
                  checks the running container as the kubelet would: the startup and readiness
                  probes' GETs through the published HTTP port, the liveness probe's command run in
                  the container within its timeout; then that tritonserver runs alone (PID 1, no
                  watchdog) as the chart's user and that the root filesystem refuses writes.
    .venv/bin/python docker/ci/chart_run.py override OUT.yml | probes CONTAINER PORT"""
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "deploy" / "helm" / "colibri"
SERVICE = "triton-cpu"


def fail(message):
    print(f"chart_run: {message}", file=sys.stderr)
    sys.exit(1)


def pod():
    try:
        import helm_python
    except ImportError:
        fail("helm_python is missing: install the test profile (.venv/bin/pip install -c constraints.txt helm-python-sdk)")
    values = yaml.safe_load((CHART / "values-cpu.yaml").read_text())
    manifests = helm_python.Chart.load(str(CHART)).render(values, name="colibri", namespace="ci")
    deployment = yaml.safe_load(manifests["colibri/templates/deployment.yaml"])
    spec = deployment["spec"]["template"]["spec"]
    return spec, next(c for c in spec["containers"] if c["name"] == "triton")


def memory(quantity):
    """A Kubernetes quantity (512Mi, 2Gi) in compose's spelling (512m, 2g)."""
    units = {"Ki": "k", "Mi": "m", "Gi": "g"}
    for suffix, unit in units.items():
        if quantity.endswith(suffix):
            return quantity[: -len(suffix)] + unit
    fail(f"shm size {quantity!r}: expected Ki, Mi or Gi")


def override(path):
    spec, triton = pod()
    security, context = spec["securityContext"], triton["securityContext"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    tmpfs, shm = [], None
    for mount in triton["volumeMounts"]:
        volume = volumes[mount["name"]]
        if mount["mountPath"] == "/dev/shm":
            shm = memory(volume["emptyDir"]["sizeLimit"])
        elif mount["mountPath"] != "/weights":  # compose's named volume stands for the weights' emptyDir
            assert "emptyDir" in volume, f"{mount['mountPath']}: only emptyDirs are mimicked"
            tmpfs.append(f"{mount['mountPath']}:mode=1777")
    liveness = triton["livenessProbe"]
    service = {
        "command": triton["args"],
        "environment": {e["name"]: e["value"] for e in triton["env"]},
        "user": f"{security['runAsUser']}:{security['runAsGroup']}",
        "read_only": context["readOnlyRootFilesystem"],
        "cap_drop": context["capabilities"]["drop"],
        "security_opt": [] if context["allowPrivilegeEscalation"] else ["no-new-privileges:true"],
        "tmpfs": tmpfs,
        "shm_size": shm,
        "init": False,  # a pod has none: tritonserver is PID 1
        "healthcheck": {"test": ["CMD", *liveness["exec"]["command"]],
                        "interval": f"{liveness['periodSeconds']}s",
                        "timeout": f"{liveness['timeoutSeconds']}s",
                        "retries": liveness["failureThreshold"]},
    }
    Path(path).write_text(yaml.safe_dump({"services": {SERVICE: service}}, sort_keys=False))
    print(f"chart_run: {path}: {SERVICE} as the chart's pod: {json.dumps(service)}")


def get(url, timeout):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError as error:
        return f"no answer ({error})"


def probes(container, http_port):
    _, triton = pod()
    for kind in ("startupProbe", "readinessProbe"):
        probe = triton[kind]
        url = f"http://127.0.0.1:{http_port}{probe['httpGet']['path']}"
        status = get(url, probe["timeoutSeconds"])
        if not (isinstance(status, int) and 200 <= status < 400):  # the kubelet's success range
            fail(f"{kind} GET {url}: {status}")
        print(f"chart_run: {kind}: GET {probe['httpGet']['path']} -> {status}")
    liveness = triton["livenessProbe"]
    command = liveness["exec"]["command"]
    start = time.monotonic()
    try:
        done = subprocess.run(["docker", "exec", container, *command], capture_output=True, text=True,
                              timeout=liveness["timeoutSeconds"])
    except subprocess.TimeoutExpired:
        fail(f"livenessProbe {' '.join(command)}: no exit within {liveness['timeoutSeconds']} s")
    took = time.monotonic() - start
    if done.returncode != 0:
        fail(f"livenessProbe {' '.join(command)}: exit {done.returncode}: {done.stdout.strip()} {done.stderr.strip()}")
    print(f"chart_run: livenessProbe: {' '.join(command)} -> exit 0 in {took:.1f} s: {done.stdout.strip()}")

    def inside(*args):
        return subprocess.run(["docker", "exec", container, *args], capture_output=True, text=True)
    pid1 = inside("cat", "/proc/1/cmdline").stdout.split("\0")
    if Path(pid1[0]).name != "tritonserver":
        fail(f"PID 1 is {' '.join(pid1)}, expected tritonserver alone (COLIBRI_WATCHDOG=0)")
    user = inside("id", "-u").stdout.strip()
    if user != "10001":
        fail(f"the container runs as uid {user}, expected 10001")
    if inside("touch", "/models/written").returncode == 0:
        fail("the root filesystem took a write: expected read-only")
    print(f"chart_run: PID 1 is tritonserver (no watchdog), uid {user}, root filesystem read-only")


def main(argv):
    if argv[:1] == ["override"] and len(argv) == 2:
        override(argv[1])
    elif argv[:1] == ["probes"] and len(argv) == 3:
        probes(argv[1], argv[2])
    else:
        fail("usage: chart_run.py override FILE | probes CONTAINER HTTP_PORT")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
