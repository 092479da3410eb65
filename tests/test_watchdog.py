"""colibri.serving.watchdog against a stand-in server (tests/fake_tritonserver.py), fast and without Triton:
the probe's verdicts and messages, and `python -m colibri watch` restarting a server that exits or
stops answering, leaving one that answers, and stopping on a signal. The same against the real
tritonserver through `colibri serve` is in test_faults.py."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colibri.serving import launcher, watchdog

FAKE = Path(__file__).resolve().parent / "fake_tritonserver.py"


class Watched:
    """`python -m colibri watch -- <fake tritonserver>` in folder, with quick probes."""

    def __init__(self, folder: Path, *watch_args):
        self.folder = folder
        self.port = launcher.free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "watch.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "colibri", "watch", "--probe-interval", "0.3", "--probe-retry-interval", "0.1",
                 "--probe-failures", "3", *watch_args, "--", sys.executable, str(FAKE), f"--http-port={self.port}"],
                cwd=folder, stdout=log, stderr=subprocess.STDOUT)

    def starts(self):
        path = self.folder / "starts.log"
        return [int(pid) for pid in path.read_text().split()] if path.exists() else []

    def wait_for(self, condition, what, limit_s=30):
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if condition():
                return
            assert self.process.poll() is None, f"the watchdog exited ({self.process.returncode}):\n{self.text()}"
            time.sleep(0.05)
        raise AssertionError(f"not {what} after {limit_s} s:\n{self.text()}")

    def alive(self):
        try:
            watchdog.probe(self.url, timeout=2)
            return True
        except watchdog.ProbeError:
            return False

    def text(self):
        return self.log.read_text()

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)
        return self.process.returncode


@pytest.fixture
def watched(tmp_path):
    running = Watched(tmp_path)
    running.wait_for(lambda: "answered one token" in running.text(), "started (the watchdog's first probe passed)")
    yield running
    running.stop()


def test_probe_verdicts(watched):
    message = watchdog.probe(watched.url)
    assert message.startswith(f"colibri_moe at {watched.url} answered one token (H=8, FP32) in ")
    (watched.folder / f"broken-{watched.starts()[0]}").touch()
    with pytest.raises(watchdog.ProbeError, match="HTTP 500: Stub process 'colibri_moe_0_0' is not healthy"):
        watchdog.probe(watched.url)
    with pytest.raises(watchdog.ProbeError, match="no answer from .*Connection refused"):
        watchdog.probe(f"http://127.0.0.1:{launcher.free_ports(1)[0]}")
    with pytest.raises(watchdog.ProbeError, match="config of nothing: HTTP 404"):
        watchdog.probe(watched.url, model="nothing")


def test_probe_cli(watched, colibri_cli):
    ok = colibri_cli("probe", "--url", watched.url)
    assert ok.returncode == 0 and ok.stdout.startswith("colibri probe: OK: colibri_moe at"), ok.stdout + ok.stderr
    dead = f"http://127.0.0.1:{launcher.free_ports(1)[0]}"
    refused = colibri_cli("probe", "--url", dead)
    assert refused.returncode == 1 and refused.stdout.startswith(f"colibri probe: FAIL: colibri_moe at {dead}: no answer")


def test_watch_restarts_a_server_that_stops_answering(watched):
    first = watched.starts()[0]
    (watched.folder / f"broken-{first}").touch()
    watched.wait_for(lambda: len(watched.starts()) == 2 and watched.alive(), "restarted and answering")
    text = watched.text()
    assert text.count("liveness probe") == 3 and "liveness probe 3/3 failed: one token to colibri_moe: HTTP 500" in text
    assert f"3 probes in a row failed while tritonserver (pid {first}) runs: restarting it" in text
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # stopped (SIGTERM) before the new one started


def test_watch_restarts_a_server_that_exits(watched):
    first = watched.starts()[0]
    os.kill(first, signal.SIGKILL)
    watched.wait_for(lambda: len(watched.starts()) == 2 and watched.alive(), "restarted and answering")
    assert f"tritonserver (pid {first}) exited with status -9 unbidden: restarting it" in watched.text()


def test_watch_retries_a_restart_that_fails(watched):
    """A restart whose server dies before it is ready (a crash during loading, or between answering
    ready and the launcher noticing) is tried again, not the end of the service."""
    first = watched.starts()[0]
    (watched.folder / "fail-next-start").touch()
    os.kill(first, signal.SIGKILL)
    watched.wait_for(lambda: len(watched.starts()) == 2 and watched.alive(), "restarted after a failed restart")
    text = watched.text()
    assert "restart failed: " in text and "exited with status 3 unbidden: restarting it" in text, text
    assert not (watched.folder / "fail-next-start").exists()


def test_watch_stops_on_a_signal_without_restarting(watched):
    server = watched.starts()[0]
    assert watched.stop() == 0, watched.text()  # the fake exits 0 on SIGTERM; the watchdog returns that
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)
    assert watched.starts() == [server] and "restarting" not in watched.text()


def test_watch_gives_up_on_a_server_that_never_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "colibri", "watch", "--", sys.executable, "-c", "exit(3)"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "tritonserver did not start: tritonserver exited with status 3 before it answered" in result.stderr


def test_url_of_a_tritonserver_command():
    assert watchdog.url_of(["tritonserver", "--model-repository=/models"]) == "http://127.0.0.1:8000"
    assert watchdog.url_of(["tritonserver", "--http-port=9000", "--http-address=0.0.0.0"]) == "http://127.0.0.1:9000"
    assert watchdog.url_of(["tritonserver", "--http-port", "9001", "--http-address", "10.1.2.3"]) == \
        "http://10.1.2.3:9001"


def test_watch_help_prints_the_help(colibri_cli):
    """`watch --help` shows the options; only a run without `-- COMMAND` is told to give one."""
    result = colibri_cli("watch", "--help")
    assert result.returncode == 0 and "--probe-interval" in result.stdout, result.stderr
    result = colibri_cli("watch", "--probe-interval", "2")
    assert result.returncode == 2 and "give the server command after --" in result.stderr
