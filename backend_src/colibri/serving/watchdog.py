"""Liveness of a served colibri_moe, and a watchdog that restarts the server when it is lost.

Readiness is not liveness: tritonserver 2.51 never restarts a Python-backend stub that died (an OOM
kill, a crash in model code), and /v2/health/ready keeps answering 200 while every request fails
with "Stub process ... is not healthy". So the probe sends a real request: one token, its width H
and datatype read from the model's config endpoint, inputs and output in the binary extension of
Triton's HTTP protocol (bf16 included), and checks that the answer is one finite row of the output's
width. Standard library only: it runs in the tritonserver images (Python 3.8 in the CUDA 11.8 one).

    python -m colibri probe --url http://127.0.0.1:8000          exit 0 alive, 1 not, one line
    python -m colibri watch [--url ...] -- tritonserver ARGS...  runs the server, restarts it

`Watchdog` runs the server command and restarts it (the same command, so the same ports) when the
process exits unbidden or when `failures` probes in a row fail while it runs: every `interval` s
while it answers, every `retry_interval` s after a failure. A signal (SIGINT, SIGTERM) is passed to
the server and ends the watch with the server's status. `colibri serve` uses it around its server.
"""
import argparse
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL = "colibri_moe"
INTERVAL_S = 5.0        # between probes while the server answers
RETRY_INTERVAL_S = 1.0  # after a failed probe
FAILURES = 3            # failed probes in a row that make a restart
PROBE_TIMEOUT_S = 10.0  # generous: a busy server answering slowly is alive
# SIGTERM, then SIGKILL after this long. Short: a server that failed its probes serves nothing, and
# with a dead stub tritonserver 2.51 spends its whole --exit-timeout-secs (30 s) waiting for it.
STOP_GRACE_S = 2.0
GIVE_UP_RESTARTS = 5    # restarts in a row with no good probe between them: stop trying
SHM_PREFIX = "/dev/shm/triton_python_backend_shm_region_"  # the Python backend's regions

# Triton datatype -> (struct format of one element, bytes); BF16 travels as the top half of an FP32.
_ELEMENT = {"FP32": ("f", 4), "FP16": ("e", 2), "BF16": ("H", 2)}


class ProbeError(Exception):
    """Why the model is not alive, in one line."""


def _http(url, body=None, headers=None, timeout=PROBE_TIMEOUT_S):
    """(HTTP status, response headers, body); an error status is returned, not raised."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()
    except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
        reason = getattr(error, "reason", error)
        raise ProbeError(f"no answer from {url}: {reason}") from None


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body[:200].decode(errors="replace")))
    except ValueError:
        return body[:200].decode(errors="replace")


def _tensor(config: dict, kind: str, name: str):
    """(datatype without TYPE_, width) of tensor `name` in the config's 'input' or 'output' list."""
    for tensor in config.get(kind, []):
        if tensor.get("name") == name:
            dims = [int(d) for d in tensor.get("dims", [])]
            if len(dims) != 1 or dims[0] <= 0:
                raise ProbeError(f"{name}: config dims {dims}, expected one positive width")
            return tensor.get("data_type", "").replace("TYPE_", ""), dims[0]
    raise ProbeError(f"the model's config has no {kind} {name!r}")


def _served_layers(config: dict) -> list:
    """The layer numbers of the config's COLIBRI_LAYERS parameter (the launcher writes it for a folder of
    layers: colibri.serving.triton_config); read here so the probe imports nothing of the engine."""
    text = config.get("parameters", {}).get("COLIBRI_LAYERS", {}).get("string_value", "")
    return [int(n) for n in text.split(",") if n.strip().isdigit()]


def _encode(values, datatype: str) -> bytes:
    if datatype == "BF16":
        return b"".join(struct.pack("<f", v)[2:] for v in values)  # little-endian: the high half
    return struct.pack(f"<{len(values)}{_ELEMENT[datatype][0]}", *values)


def _decode(raw: bytes, datatype: str):
    count = len(raw) // _ELEMENT[datatype][1]
    if datatype == "BF16":
        return [struct.unpack("<f", b"\0\0" + raw[2 * i:2 * i + 2])[0] for i in range(count)]
    return list(struct.unpack(f"<{count}{_ELEMENT[datatype][0]}", raw))


def probe(url: str = DEFAULT_URL, model: str = DEFAULT_MODEL, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Sends one token to `model` at `url` (http://host:port); returns what answered, in a line, or
    raises ProbeError saying why the model is not alive."""
    base = url.rstrip("/")
    status, _, body = _http(f"{base}/v2/models/{model}/config", timeout=timeout)
    if status != 200:
        raise ProbeError(f"config of {model}: HTTP {status}: {_error_text(body)}")
    try:
        config = json.loads(body)
    except ValueError:
        raise ProbeError(f"config of {model}: not JSON: {body[:100]!r}") from None
    datatype, hidden = _tensor(config, "input", "hidden_states")
    out_datatype, out_width = _tensor(config, "output", "output")
    if datatype not in _ELEMENT or out_datatype not in _ELEMENT:
        raise ProbeError(f"hidden_states {datatype} / output {out_datatype}: not a float datatype the probe sends")

    raw = _encode([0.5 * math.sin(i) for i in range(hidden)], datatype)  # small and varied: a real token
    inputs = [{"name": "hidden_states", "shape": [1, hidden], "datatype": datatype,
               "parameters": {"binary_data_size": len(raw)}}]
    layers = _served_layers(config)
    if layers:  # a folder of layers: the token goes to the first
        inputs.append({"name": "layer", "shape": [1, 1], "datatype": "INT32", "data": [layers[0]]})
    header = json.dumps({
        "inputs": inputs,
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
    }).encode()
    start = time.monotonic()
    status, headers, body = _http(f"{base}/v2/models/{model}/infer", header + raw,
                                  {"Content-Type": "application/octet-stream",
                                   "Inference-Header-Content-Length": str(len(header))}, timeout)
    seconds = time.monotonic() - start
    if status != 200:
        raise ProbeError(f"one token to {model}: HTTP {status}: {_error_text(body)}")
    try:
        header_length = int(headers.get("Inference-Header-Content-Length", len(body)))
        outputs = json.loads(body[:header_length])["outputs"]
        output = next(o for o in outputs if o["name"] == "output")
    except (ValueError, KeyError, TypeError, StopIteration):
        raise ProbeError(f"one token to {model}: an answer without its output: {body[:200]!r}") from None
    values = _decode(body[header_length:], output["datatype"]) if output.get("datatype") in _ELEMENT else []
    if output.get("shape") != [1, out_width] or len(values) != out_width:
        raise ProbeError(f"one token to {model}: output {output.get('datatype')} {output.get('shape')} with "
                         f"{len(values)} values, expected [1, {out_width}]")
    if not all(math.isfinite(v) for v in values):
        raise ProbeError(f"one token to {model}: the output is not finite")
    return f"{model} at {base} answered one token (H={hidden}, {datatype}) in {1e3 * seconds:.1f} ms"


# ---------------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} colibri watchdog: {message}", file=sys.stderr, flush=True)


class Watchdog:
    """Starts the server with `launch()` (-> subprocess.Popen) and `wait_ready(server)` (raises if it
    does not become ready), then keeps it alive (see the module docstring)."""

    def __init__(self, launch, wait_ready, url=DEFAULT_URL, model=DEFAULT_MODEL, interval=INTERVAL_S,
                 retry_interval=RETRY_INTERVAL_S, failures=FAILURES, timeout=PROBE_TIMEOUT_S,
                 stop_grace=STOP_GRACE_S, give_up=GIVE_UP_RESTARTS):
        self._launch, self._wait_ready = launch, wait_ready
        self.url, self.model, self.interval, self.retry_interval = url, model, interval, retry_interval
        self.failures, self.timeout, self.stop_grace, self.give_up = failures, timeout, stop_grace, give_up
        self.server, self.started_at, self.regions = None, None, []
        self.stopping, self.stop_signal, self._signalled = False, None, set()
        self.restarts = 0

    def forward_signal(self, signum, _frame=None) -> None:
        """Signal handler: passes the signal to the server and ends the watch."""
        self.stopping, self.stop_signal = True, signum
        if self.server is not None and self.server.poll() is None:
            self._signalled.add(self.server.pid)
            self.server.send_signal(signum)

    def start(self) -> None:
        """Launches the server and waits until it is ready; if it is not, stops it and raises."""
        server = self._launch()
        self.server, self.started_at = server, time.monotonic()
        if self.stopping and server.pid not in self._signalled:  # the signal came while it launched
            self._signalled.add(server.pid)
            server.send_signal(self.stop_signal)
        try:
            self._wait_ready(server)
        except BaseException:
            if server.poll() is None:
                server.kill()
            server.wait()
            raise
        self.regions = backend_shared_memory(server.pid)

    def watch(self) -> int:
        """Keeps the started server alive until a signal stops it; its exit status (1 or 2 when the
        watchdog gave up restarting it)."""
        failed, restarts_in_a_row = 0, 0
        while True:
            wait_s = None if self.interval <= 0 else self.interval if failed == 0 else self.retry_interval
            try:
                status = self.server.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                status = None
            if self.stopping:
                return self.server.wait()
            if status is None:
                try:
                    self.probe()
                    failed, restarts_in_a_row = 0, 0
                    continue
                except ProbeError as error:
                    failed += 1
                    _log(f"liveness probe {failed}/{self.failures} failed: {error}")
                    if failed < self.failures:
                        continue
                _log(f"{self.failures} probes in a row failed while tritonserver (pid {self.server.pid}) runs: "
                     "restarting it")
                self._stop_server()
            else:
                _log(f"tritonserver (pid {self.server.pid}) exited with status {status} unbidden: restarting it")
                if time.monotonic() - self.started_at > 60:  # it had served a while: not a crash loop
                    restarts_in_a_row = 0
            self._remove_regions()
            if self.stopping:
                return self.server.wait()
            restarts_in_a_row += 1
            if restarts_in_a_row > self.give_up:
                _log(f"{self.give_up} restarts in a row without one good probe: giving up")
                return 1
            failed = 0
            began = time.monotonic()
            try:
                self.start()
            except Exception as error:  # the launcher's own errors say what is wrong
                if self.stopping:
                    return self.server.wait()
                # e.g. it died between answering ready and the launcher noticing: the next round sees
                # it exited and starts it again, within the give-up bound
                _log(f"restart failed: {error}")
                continue
            self.restarts += 1
            if not self.stopping:
                _log(f"tritonserver restarted (pid {self.server.pid}), ready {time.monotonic() - began:.1f} s "
                     f"after its launch (restart {self.restarts})")

    def probe(self) -> str:
        return probe(self.url, self.model, self.timeout)

    def _remove_regions(self) -> None:
        """What a server that died leaves behind: its Python-backend stubs, which outlive a killed
        tritonserver (reparented, they keep running and, on a GPU, keep their CUDA context and a
        copy of the weights), and its shared-memory regions in /dev/shm (restarts would fill it)."""
        for pid in backend_stubs(self.regions):
            try:
                os.kill(pid, signal.SIGKILL)
                _log(f"killed the Python-backend stub (pid {pid}) left by the server that died")
            except OSError:
                pass  # gone meanwhile
        for path in self.regions:
            try:
                os.unlink(path)
                _log(f"removed {path}, left by the server that died")
            except OSError:
                pass  # removed by the server itself
        self.regions = []

    def _stop_server(self) -> None:
        self.server.terminate()
        try:
            self.server.wait(self.stop_grace)
        except subprocess.TimeoutExpired:
            _log(f"tritonserver did not stop {self.stop_grace:.0f} s after SIGTERM: SIGKILL")
            self.server.kill()
            self.server.wait()


def backend_shared_memory(pid: int) -> list:
    """Paths of the Python backend's shared-memory regions the process `pid` holds open (Linux /proc;
    none elsewhere)."""
    regions = []
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return regions
    for fd in descriptors:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(SHM_PREFIX) and target not in regions:
            regions.append(target)
    return regions


def backend_stubs(regions) -> list:
    """Pids of the Python-backend stubs serving through these shared-memory regions: each stub gets
    its region's name on its command line (Linux /proc; none elsewhere). By region, not by parent,
    so that a stub already reparented after its server died is found, and no other server's is."""
    names = {os.path.basename(path) for path in regions}
    stubs = []
    if not names:
        return stubs
    try:
        entries = os.listdir("/proc")
    except OSError:
        return stubs
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith("triton_python_backend_stub") and names.intersection(argv[1:]):
            stubs.append(int(entry))
    return stubs


def add_probe_arguments(parser) -> None:
    parser.add_argument("--probe-interval", type=float, default=INTERVAL_S, metavar="SECONDS",
                        help="Seconds between liveness probes (one-token requests) while the server answers "
                             "(default: %(default)g; 0: no probes, restart only a server that exits).")
    parser.add_argument("--probe-failures", type=int, default=FAILURES, metavar="N",
                        help="Failed probes in a row that make the watchdog restart tritonserver "
                             "(default: %(default)s).")
    parser.add_argument("--probe-retry-interval", type=float, default=RETRY_INTERVAL_S, metavar="SECONDS",
                        help="Seconds between probes after a failed one (default: %(default)g).")
    parser.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S, metavar="SECONDS",
                        help="Seconds a probe waits for its answer (default: %(default)g).")


def watchdog_from_args(launch, wait_ready, url, model, args) -> Watchdog:
    return Watchdog(launch, wait_ready, url=url, model=model, interval=args.probe_interval,
                    retry_interval=args.probe_retry_interval, failures=args.probe_failures,
                    timeout=args.probe_timeout)


def wait_until_alive(server, url, model, timeout_s):
    """Until a probe passes while `server` runs; raises ProbeError if it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no probe yet"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ProbeError(f"tritonserver exited with status {server.returncode} before it answered")
        try:
            return probe(url, model, timeout=min(PROBE_TIMEOUT_S, max(1.0, deadline - time.monotonic())))
        except ProbeError as error:
            last = str(error)
        time.sleep(0.5)
    raise ProbeError(f"no good answer after {timeout_s:.0f} s: {last}")


def url_of(command) -> str:
    """The HTTP address a tritonserver command line serves on, as seen from this machine."""
    options = {}
    for n, word in enumerate(command):
        name, equals, value = word.partition("=")
        if name in ("--http-port", "--http-address"):
            options[name] = value if equals else command[n + 1] if n + 1 < len(command) else ""
    address = options.get("--http-address", "127.0.0.1")
    if address in ("", "0.0.0.0", "::"):  # every interface: this machine's loopback among them
        address = "127.0.0.1"
    return f"http://{address}:{options.get('--http-port', '8000')}"


def main_probe(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m colibri probe",
                                     description="Liveness: one real one-token request; exit 0 alive, 1 not")
    parser.add_argument("--url", default=DEFAULT_URL, help="the server's HTTP address (default %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S, help="seconds per HTTP request")
    args = parser.parse_args(argv)
    try:
        print(f"colibri probe: OK: {probe(args.url, args.model, args.timeout)}", flush=True)
        return 0
    except ProbeError as error:
        print(f"colibri probe: FAIL: {args.model} at {args.url}: {error}", flush=True)
        return 1


def main_watch(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m colibri watch", usage="python -m colibri watch [options] -- COMMAND [ARGS...]",
        description="Runs a server command (tritonserver ...) and restarts it when it exits unbidden or stops "
                    "answering one-token requests")
    parser.add_argument("--url", help="the server's HTTP address (default: http://127.0.0.1 and the command's "
                                      "--http-port, else 8000)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds a (re)started server has to answer its first probe")
    add_probe_arguments(parser)
    if "--" not in argv:
        parser.parse_args(argv)  # --help prints the help and exits; anything else is refused below
        parser.error("give the server command after --")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("give the server command after --")
    args.url = args.url or url_of(command)

    watchdog = watchdog_from_args(lambda: subprocess.Popen(command),
                                  lambda server: _log(wait_until_alive(server, args.url, args.model,
                                                                       args.ready_timeout)),
                                  args.url, args.model, args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, watchdog.forward_signal)
    try:
        watchdog.start()
    except (ProbeError, OSError) as error:
        _log(f"tritonserver did not start: {error}")
        return 2
    return watchdog.watch()
