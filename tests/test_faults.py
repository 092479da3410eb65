"""Faults while serving, against a real tritonserver: the Python-backend stub killed under load and
tritonserver killed under load (both recovered by the launcher's watchdog), the server restarted
under load, and checkpoints that are missing or corrupt.

Under load, several gRPC clients send requests with known answers in a loop; every answer is checked
(bitwise, against colibri.MoELayer on the same checkpoint), every failure is recorded with its time
and message, and the recovery time is from the fault to the first moment after which every answer is
right. A wrong answer is never acceptable; failures while the fault lasts are, and are counted.
The figures are printed (pytest -s) and quoted in README.md, section Operations.

The restarts by an outside hand (test_server_restarted_under_load) take about a minute and run with
COLIBRI_SLOW_TESTS=1 (not in CI); the recoveries by the launcher and the checkpoint tests always run.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import colibri
from colibri import checkpoint
from colibri.serving import launcher, watchdog
from colibri.testing.server import REPO_ROOT, missing_reason, serving

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")

MODEL = "colibri_moe"
CLIENTS = 4
RECOVERY_LIMIT_S = 60  # the test fails if answers are not all right again this long after the fault
SETTLED_S = 2          # ... and all right for this long
slow = pytest.mark.skipif(os.environ.get("COLIBRI_SLOW_TESTS") != "1", reason="slow: set COLIBRI_SLOW_TESTS=1")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "faults.colibri.safetensors"
    checkpoint.write_demo(path, experts=8, top_k=2, hidden=64, intermediate=96, dtype="bf16", seed=5)
    return path


@dataclass
class Outcome:
    sent: float
    done: float
    ok: bool
    error: str = ""


@dataclass
class Load:
    """CLIENTS threads sending known requests to grpc_url until stopped; outcomes in time order."""
    grpc_url: str
    layer: colibri.MoELayer
    outcomes: list = field(default_factory=list)
    wrong: list = field(default_factory=list)

    def __post_init__(self):
        rng = np.random.default_rng(1)
        self.requests = []
        for tokens in (1, 3, 8, 32):
            x = rng.standard_normal((tokens, self.layer.config.hidden_size)).astype(np.float32)
            self.requests.append((x, np.asarray(self.layer.forward(x))))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _client(self, index):
        client, n = None, index
        while not self.stop.is_set():
            x, expected = self.requests[n % len(self.requests)]
            n += 1
            sent = time.monotonic()
            try:
                client = client or grpcclient.InferenceServerClient(self.grpc_url)
                tensor = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                out = client.infer(MODEL, [tensor], client_timeout=30).as_numpy("output")
                outcome = Outcome(sent, time.monotonic(), True)
                if not np.array_equal(out, expected):
                    self.wrong.append((sent, x.shape))
                    outcome.ok, outcome.error = False, "WRONG ANSWER"
            except InferenceServerException as exc:
                outcome = Outcome(sent, time.monotonic(), False, f"{exc.status()}: {exc.message()}"[:200])
                client = None  # a new channel, as a client would reconnect
                time.sleep(0.05)
            with self.lock:
                self.outcomes.append(outcome)

    def wait_recovered(self, since: float) -> float:
        """Seconds from `since` until every answer is right, once that has lasted SETTLED_S."""
        deadline = since + RECOVERY_LIMIT_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
            with self.lock:
                after = [o for o in self.outcomes if o.sent >= since]
            failures = [o.done for o in after if not o.ok]
            last_failure = max(failures, default=since)
            if any(o.ok and o.sent > last_failure for o in after) and time.monotonic() - last_failure > SETTLED_S:
                return min(o.done for o in after if o.ok and o.sent > last_failure) - since
        raise AssertionError(f"answers not all right {RECOVERY_LIMIT_S} s after the fault: {self.summary(since)}")

    def summary(self, since: float) -> str:
        with self.lock:
            after = [o for o in self.outcomes if o.sent >= since - 1]
        errors = {}
        for o in after:
            if not o.ok:
                key = re.sub(r"\d+", "N", o.error)
                errors[key] = errors.get(key, 0) + 1
        return f"{sum(o.ok for o in after)} right, {sum(not o.ok for o in after)} failed: {errors}"


def processes():
    """pid -> (parent pid, command line) for every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            table[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), command)
    return table


def server_processes(server):
    """(tritonserver pid, its Python-backend stub pids) for the server listening on server.http_url."""
    table = processes()
    port = server.http_url.rsplit(":", 1)[1]
    triton = [pid for pid, (_, cmd) in table.items()
              if "bin/tritonserver" in cmd.split(" ")[0] and f"--http-port {port} " in cmd + " "]
    assert len(triton) == 1, triton
    stubs = [pid for pid, (parent, cmd) in table.items() if parent == triton[0] and "triton_python_backend_stub" in cmd]
    return triton[0], stubs


def ready(server, path="/v2/health/ready") -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


# --------------------------------------------------------------------------------------------------


def test_stub_killed_under_load_is_recovered_by_the_launcher(weights, tmp_path):
    """SIGKILL to the stub process (what an OOM kill or a crash in model code does). tritonserver 2.51
    never restarts it: every request then fails with INTERNAL "Stub process ... is not healthy" while
    /v2/health/ready still says 200. The launcher's watchdog (default settings: a one-token probe
    every 5 s, 3 failures in a row) sees it, restarts tritonserver on the same ports, and answers are
    right again; the dead server's shared-memory region is removed. Once (a CI run) the backend threw
    boost::interprocess::lock_exception instead, uncaught, and tritonserver aborted: most likely the kill
    landed while the stub held the backend's shared-memory lock. The watchdog then restarts it on its
    exit (right answers again after 2.8 s in that run)."""
    layer = colibri.MoELayer.from_file(weights)
    with serving(weights, tmp_path, probes=True) as server, Load(server.grpc_url, layer) as load:
        time.sleep(2)
        triton, stubs = server_processes(server)
        assert len(stubs) == 1, stubs
        regions = watchdog.backend_shared_memory(triton)
        assert regions, "no Python-backend shared memory found for tritonserver"
        fault = time.monotonic()
        os.kill(stubs[0], signal.SIGKILL)
        recovery = load.wait_recovered(fault)
        summary = load.summary(fault)
        new_triton, new_stubs = server_processes(server)
        assert ready(server) and ready(server, f"/v2/models/{MODEL}/ready")
        log = server.log_path.read_text(errors="replace")
    print(f"\nstub killed under load: right answers again after {recovery:.2f} s; {summary}; "
          f"tritonserver {triton} -> {new_triton}, stub {stubs[0]} -> {new_stubs}")
    assert not load.wrong, load.wrong
    if "Stub process 'colibri_moe_N_N' is not healthy" in summary:  # digits read N
        assert "liveness probe 3/3 failed" in log and f"while tritonserver (pid {triton}) runs: restarting it" in log
    else:  # the abort: requests failed only while no server listened
        assert "boost::interprocess::lock_exception" in log, summary
        assert f"tritonserver (pid {triton}) exited with status -6 unbidden: restarting it" in log, summary
        assert "UNAVAILABLE" in summary, summary
    assert new_triton != triton and new_stubs and new_stubs != stubs
    assert log.count(f"from {weights}") == 2, "model.py initialize must have run twice"
    assert not any(os.path.exists(region) for region in regions), f"{regions} left in /dev/shm"


def test_crashed_server_under_load_is_restarted_by_the_launcher(weights, tmp_path):
    """SIGKILL to tritonserver itself (a crash: e.g. the std::bad_alloc abort a huge JSON shape
    causes, see test_robustness.py): the launcher starts it again on the same ports."""
    layer = colibri.MoELayer.from_file(weights)
    with serving(weights, tmp_path) as server, Load(server.grpc_url, layer) as load:
        time.sleep(2)
        triton, stubs = server_processes(server)
        assert len(stubs) == 1, stubs
        fault = time.monotonic()
        os.kill(triton, signal.SIGKILL)
        recovery = load.wait_recovered(fault)
        summary = load.summary(fault)
        new_triton, _ = server_processes(server)
        log = server.log_path.read_text(errors="replace")
        # the dead server's stub outlives it (reparented); the launcher must not leave it running (a
        # zombie's command line is empty, so one not yet reaped does not count)
        table = processes()
        left = [pid for pid in stubs if "triton_python_backend_stub" in table.get(pid, (0, ""))[1]]
    print(f"\ntritonserver killed under load: right answers again after {recovery:.2f} s through the launcher; "
          f"{summary}")
    assert not load.wrong, load.wrong
    assert f"tritonserver (pid {triton}) exited with status -9 unbidden: restarting it" in log
    assert new_triton != triton
    assert not left, f"the killed server's stub {left} still runs"
    assert f"killed the Python-backend stub (pid {stubs[0]}) left by the server that died" in log


@slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_server_restarted_under_load(weights, tmp_path, how):
    """The server stopped (SIGTERM: graceful, as `docker stop` does; SIGKILL of tritonserver: a crash)
    and started again on the same ports while clients keep sending."""
    layer = colibri.MoELayer.from_file(weights)
    ports = launcher.free_ports(3)
    first = serving(weights, tmp_path / "first", ports=ports)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    server = first.__enter__()
    with Load(server.grpc_url, layer) as load:
        try:
            time.sleep(2)
            triton, _ = server_processes(server)
            fault = time.monotonic()
            os.kill(triton, getattr(signal, how))
        finally:
            first.__exit__(None, None, None)
        stopped = time.monotonic() - fault
        with serving(weights, tmp_path / "second", ports=ports) as again:
            restarted = time.monotonic() - fault
            recovery = load.wait_recovered(fault)
            summary = load.summary(fault)
            assert ready(again)
    print(f"\nserver {how} under load: stopped after {stopped:.2f} s, ready again after {restarted:.2f} s, "
          f"right answers again after {recovery:.2f} s; {summary}")
    assert not load.wrong, load.wrong


# --------------------------------------------------------------------------------------------------
# missing and corrupt checkpoints: the model fails to load, naming the file and the problem
# (the reader's refusals themselves are tested in test_checkpoint.py)
# --------------------------------------------------------------------------------------------------

def truncated(good: Path, path: Path):
    path.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
    return "truncated"


def pickled(good: Path, path: Path):
    path.write_bytes(b"\x80\x04\x95" + b"\0" * 64)  # a pickle stream's first bytes
    return "pickle / PyTorch file, which Colibri never loads"


def not_json(good: Path, path: Path):
    path.write_bytes((6).to_bytes(8, "little") + b"{nope}")
    return "header is not valid JSON"


def nan_router(good: Path, path: Path):
    from colibri import safetensors_io
    file = safetensors_io.SafetensorsFile(good)
    tensors = {name: (info.dtype, np.array(file.get(name))) for name, info in file.tensors.items()}
    tensors["router"][1][3, 5] = np.nan
    safetensors_io.write(path, tensors, dict(file.metadata))
    return "router: not finite at index (3, 5)"


def nan_expert(good: Path, path: Path):
    from colibri import safetensors_io
    file = safetensors_io.SafetensorsFile(good)
    tensors = {name: (info.dtype, np.array(file.get(name))) for name, info in file.tensors.items()}
    assert tensors["experts"][0] == "BF16"
    tensors["experts"][1][1, 1] = 0x7FC0  # expert 1's gate [0, 1]: a bf16 NaN
    safetensors_io.write(path, tensors, dict(file.metadata))
    return "expert 1's gate [0, 1] is NaN"


# Refused by the launcher from the header, before a server starts: one line.
HEADER_CORRUPTIONS = {"truncated": truncated, "pickle": pickled, "not_json": not_json}
# Found when the model loads the weights (the library's one pass over them).
CORRUPTIONS = {"nan_router": nan_router, "nan_expert": nan_expert}


@pytest.mark.parametrize("corruption", sorted(HEADER_CORRUPTIONS))
def test_corrupt_header_refused_before_the_server_starts(weights, tmp_path, corruption):
    path = tmp_path / f"{corruption}.colibri.safetensors"
    problem = HEADER_CORRUPTIONS[corruption](weights, path)
    status, log, ever_ready, seconds = serve_until_exit(path, tmp_path)
    print(f"\n{corruption}: launcher exit {status} after {seconds:.1f} s")
    assert status == 2 and not ever_ready, log[-2000:]
    assert log.strip().splitlines() == [log.strip()], log[-2000:]  # one line, no server log
    assert log.startswith(f"colibri serve: --weights {path}: ") and problem in log, log


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_fails_to_load(weights, tmp_path, corruption):
    path = tmp_path / f"{corruption}.colibri.safetensors"
    problem = CORRUPTIONS[corruption](weights, path)
    status, log, ever_ready, seconds = serve_until_exit(path, tmp_path)
    print(f"\n{corruption}: launcher exit {status} after {seconds:.1f} s")
    assert status != 0 and not ever_ready, log[-2000:]
    failure = re.search(rf"failed to load '{MODEL}' version 1: (.*)", log)
    assert failure, log[-2000:]
    assert str(path) in failure.group(1) and problem in failure.group(1), failure.group(1)
    assert "failed to load all models" in log
    # The reason is the launcher's last line, not only somewhere in the server's log above it.
    assert status == 2, log[-2000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith(f"colibri serve: {MODEL} failed to load: ColibriError: invalid argument: {path}"), last
    assert problem in last and "\\n" not in last, last


def test_load_failure_reason_is_read_from_the_server_log():
    line = ("E1206 10:26:49.110569 9578 model_lifecycle.cc:642] \"failed to load 'colibri_moe' version 1: Internal: "
            "ColibriError: invalid argument: /w.colibri.safetensors: tensor 'experts': data ends at byte 294912 but "
            "the file holds only 2552 data bytes (truncated?)\\n\\nAt:\\n  /x/checkpoint.py(98): _open\\n\"\n")
    assert launcher.load_failure_reason(line) == (
        "colibri_moe failed to load: ColibriError: invalid argument: /w.colibri.safetensors: tensor 'experts': "
        "data ends at byte 294912 but the file holds only 2552 data bytes (truncated?)")
    assert launcher.load_failure_reason("I1206 model_lifecycle.cc:472] \"loading: colibri_moe:1\"\n") is None


def test_missing_checkpoint_is_refused_before_the_server_starts(tmp_path):
    path = tmp_path / "absent.colibri.safetensors"
    status, log, ever_ready, _ = serve_until_exit(path, tmp_path)
    assert status == 2 and not ever_ready and f"--weights {path}: no such file" in log, log


def serve_until_exit(weights: Path, log_dir: Path, limit_s=120):
    """Runs `colibri serve` until it exits; (status, log, whether the server was ever ready, seconds)."""
    http_port, grpc_port, metrics_port = launcher.free_ports(3)
    log_path = log_dir / "serve.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "colibri", "serve", "--weights", str(weights), "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    ever_ready = False
    try:
        while process.poll() is None and time.monotonic() - start < limit_s:
            for path in ("/v2/health/ready", f"/v2/models/{MODEL}/ready"):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=2) as reply:
                        ever_ready |= reply.status == 200
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    return process.returncode, log_path.read_text(errors="replace"), ever_ready, time.monotonic() - start
