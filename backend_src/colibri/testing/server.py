"""A real tritonserver for the serving tests and load tools, started the way users start it
(`python -m colibri serve`) on free ports, and always stopped. Needs a checkout (the model repository)."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]  # the checkout: backend_src/colibri/testing/server.py

START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60


def missing_reason():
    """Why no tritonserver can be started here, or None. Only a missing server is a reason to skip."""
    from colibri.serving import launcher
    try:
        launcher.find_tritonserver()
    except launcher.ServeError as exc:
        return str(exc)
    return None


class Server:
    def __init__(self, http_port, grpc_port, metrics_port, log_path):
        self.http_url = f"127.0.0.1:{http_port}"
        self.grpc_url = f"127.0.0.1:{grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.log_path = log_path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def get(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.read().decode()

    def model_stats(self, model: str = "colibri_moe"):
        """(execution_count, inference_count) once settled: Triton records a request's statistics just
        after it sends the response, so a read right after the last answer can miss it."""
        def read():
            stats = json.loads(self.get(f"http://{self.http_url}/v2/models/{model}/stats"))["model_stats"][0]
            return int(stats["execution_count"]), int(stats["inference_count"])

        previous = read()
        while True:
            time.sleep(0.2)
            current = read()
            if current == previous:
                return current
            previous = current


@contextlib.contextmanager
def serving(weights: Path, log_dir: Path, *serve_args, ports=None, probes=False):
    """Yields a ready Server serving `weights` (on `ports`, else free ones); stops it on exit, whatever
    happened inside. The launcher's watchdog restarts a server that exits; its liveness probes (a
    one-token request every 5 s) only with `probes`, as they would show in the statistics and
    metrics that tests count exactly."""
    from colibri.serving.launcher import free_ports
    http_port, grpc_port, metrics_port = ports or free_ports(3)
    if not probes:
        serve_args = ("--probe-interval", "0", *serve_args)
    server = Server(http_port, grpc_port, metrics_port, log_dir / f"tritonserver-{http_port}.log")
    with open(server.log_path, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "colibri", "serve", "--weights", str(weights),
             "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
             *serve_args],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(launcher, server)
            yield server
        finally:
            _stop(launcher)


def _wait_ready(launcher, server):
    """Until the model is ready and the launcher has said so (from then on its watchdog restarts a
    server that dies; before, a death is a failed start)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    ready = f"http://{server.http_url}/v2/models/colibri_moe/ready"
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            raise RuntimeError(f"colibri serve exited ({launcher.returncode}) before it was ready:\n"
                               f"{server.log_tail()}")
        try:
            with urllib.request.urlopen(ready, timeout=2) as reply:
                if reply.status == 200 and "colibri serve: colibri_moe ready" in server.log_path.read_text(
                        errors="replace"):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"tritonserver not ready after {START_TIMEOUT_S} s:\n{server.log_tail()}")


def _stop(launcher):
    """SIGTERM to the launcher, which forwards it to tritonserver and waits for it; then SIGKILL if
    need be (the server is tied to the launcher's life, see colibri.serving.launcher)."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.wait()
