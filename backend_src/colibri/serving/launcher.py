"""`python -m colibri serve`: runs the real tritonserver shipped in the nvidia-pytriton wheel on the
Colibri model repository, bound to 127.0.0.1, until Ctrl-C.

The wheel carries the server, its Python backend and one backend stub per Python version, but not
laid out as a backend directory for *this* interpreter. Rather than editing site-packages, each launch
builds a throw-away run folder:

    RUN/backends/python/   the wheel's libtriton_python.so and utils, plus the stub for this Python
    RUN/models/<model>/    the repository's files, with config.pbtxt rewritten for --device / --dtype
    RUN/python/            a virtual environment that sees what this interpreter sees

The stub embeds libpython in isolated mode (PYTHONPATH ignored) and takes its sys.prefix from the
first `python3` on PATH. RUN/python's bin goes first on PATH, and a .pth file there adds this
interpreter's PYTHONPATH entries, colibri's folder and site-packages, so model.py imports the same
packages (numpy<2, cffi, colibri) as the launcher, from a venv, a --target folder or a checkout.

The launcher owns the tritonserver process and keeps it alive (colibri.serving.watchdog): it restarts it, on
the same ports, when it exits unbidden or when --probe-failures one-token probes in a row fail while
it runs (a Python-backend stub that died, which tritonserver 2.51 never restarts).
"""

import argparse
import ctypes
import os
import json
import re
import secrets
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from colibri.serving import triton_config, watchdog
from colibri.serving.triton_config import TRITON_DTYPES

MODEL_NAME = "colibri_moe"
DEFAULT_WEIGHTS_NAME = "weights.colibri.safetensors"

# Activation dtypes the model can serve, as Triton names them in config.pbtxt.
DEFAULT_CUDA_POOL_MB = 1024
INSTANCE_KINDS = {"auto": "KIND_AUTO", "cpu": "KIND_CPU", "gpu": "KIND_GPU"}


class ServeError(RuntimeError):
    """A problem the user can fix (missing server, bad repository); printed without a traceback.
    `reason`, when known, is what the server itself said went wrong (printed as the last line)."""

    def __init__(self, message: str, reason: str = None):
        super().__init__(message)
        self.message, self.reason = message, reason

    def __str__(self) -> str:
        return self.message if self.reason is None else f"{self.message}: {self.reason}"


# tritonserver's log line for a model that did not load, e.g.
#   E1206 ... model_lifecycle.cc:642] "failed to load 'colibri_moe' version 1: Internal: ColibriError: ...\n\nAt:\n ..."
# (one line: the message's newlines are written as \n), and its last word before it exits.
LOAD_FAILURE = re.compile(r"failed to load '(?P<model>[^']+)' version \d+: (?P<reason>.*)")
SERVER_ERROR = re.compile(r"^error: (?P<reason>.*)")


def load_failure_reason(line: str):
    """The first line of the reason in a "failed to load" log line, or None: "ColibriError: ..."
    without Triton's status name ("Internal: ") or the Python traceback after it."""
    match = LOAD_FAILURE.search(line)
    if match is None:
        return None
    reason = match["reason"].split("\\n", 1)[0].rstrip().rstrip('"').replace('\\"', '"')
    reason = re.sub(r"^Internal: ", "", reason)
    return f"{match['model']} failed to load: {reason}"


class ServerOutput:
    """Copies a server's stdout and stderr to ours as they come, line by line, remembering why it
    failed: the first model load failure, else its last "error: ..." line. tritonserver prints that
    reason among some 70 lines of its own log; the launcher repeats it as its last line."""

    def __init__(self, server: subprocess.Popen):
        self.load_failure = self.server_error = None
        self._threads = [threading.Thread(target=self._copy, args=(pipe, target), daemon=True)
                         for pipe, target in ((server.stdout, sys.stdout), (server.stderr, sys.stderr))]
        for thread in self._threads:
            thread.start()

    def _copy(self, pipe, target) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace")
                try:
                    target.write(line)
                    target.flush()
                except (OSError, ValueError):
                    pass  # our own stream is gone: keep reading, so the server never blocks on a full pipe
                if self.load_failure is None:
                    self.load_failure = load_failure_reason(line)
                error = SERVER_ERROR.match(line)
                if error:
                    self.server_error = error["reason"].strip()

    def reason(self, wait_s: float = 2.0):
        """Why the server failed, once it has exited: waits (a little) for its last lines. A backend
        stub outliving it may hold the pipes open, so the wait is bounded."""
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.load_failure or self.server_error


def find_tritonserver() -> Path:
    """Folder `tritonserver/` of the installed nvidia-pytriton wheel (holds bin/, backends/, stubs)."""
    try:
        import pytriton
    except ImportError as exc:
        raise ServeError("nvidia-pytriton is not installed: `make venv` installs it "
                         "(pinned in constraints.txt)") from exc
    # __path__, not __file__: an unpacked server bundle (../shared/tools/tritonserver-bundle.sh) on
    # PYTHONPATH holds pytriton/tritonserver without pytriton/__init__.py, a namespace package.
    root = Path(next(iter(pytriton.__path__))).resolve() / "tritonserver"
    if not os.access(root / "bin" / "tritonserver", os.X_OK):
        raise ServeError(f"no tritonserver binary in {root}/bin")
    return root


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def install_python_backend(server_root: Path, run_dir: Path) -> Path:
    """Backend directory holding the Python backend with the stub matching this interpreter."""
    stub = server_root / "python_backend_stubs" / python_version() / "triton_python_backend_stub"
    if not stub.exists():
        raise ServeError(f"nvidia-pytriton has no Python backend stub for Python {python_version()}")
    backend = run_dir / "backends" / "python"
    backend.mkdir(parents=True)
    wheel_backend = server_root / "backends" / "python"
    for source in (wheel_backend / "libtriton_python.so",
                   wheel_backend / "triton_python_backend_utils.py", stub):
        (backend / source.name).symlink_to(source)
    return backend.parent


def configure_model(config_text: str, device: str, dtype: str, instances: int = 1) -> str:
    """config.pbtxt with the instance kind and count (per GPU, or in all on the CPU) and the activation
    dtype (hidden_states, output) replaced."""
    def replace_once(pattern: str, replacement: str, text: str) -> str:
        text, count = re.subn(pattern, replacement, text, flags=re.S)
        if count != 1:
            raise ServeError(f"config.pbtxt: expected one match of {pattern!r}, found {count}")
        return text

    text = replace_once(r"kind:\s*KIND_\w+", f"kind: {INSTANCE_KINDS[device]}", config_text)
    text = replace_once(r"count:\s*\d+", f"count: {instances}", text)
    for tensor in ("hidden_states", "output"):
        text = replace_once(rf'(name:\s*"{tensor}"\s*data_type:\s*)TYPE_\w+',
                            rf"\g<1>{TRITON_DTYPES[dtype]}", text)
    return text


def stage_repository(repository: Path, run_dir: Path, weights: Path, device: str, dtype: str,
                     instances: int = 1) -> Path:
    """A copy of the repository made of links, with colibri_moe's config rewritten and naming the
    checkpoint served (colibri.serving.triton_config.stage_repository)."""
    staged = run_dir / "models"
    try:
        ident = triton_config.stage_repository(repository, staged, MODEL_NAME, weights,
                                               lambda text: configure_model(text, device, dtype, instances))
    except FileNotFoundError as exc:
        raise ServeError(str(exc)) from None
    if ident.note:  # hashed now: say what it cost, and whether the next start pays it again
        print(f"colibri serve: {ident.note}", flush=True)
    return staged


def checkout_repository() -> Path | None:
    """The model repository of the checkout this package runs from (three folders above this file's
    backend_src/colibri/serving/), or None: an installed package carries none."""
    repository = Path(__file__).resolve().parents[3] / "model_repository"
    return repository if (repository / MODEL_NAME / "config.pbtxt").is_file() else None


def ensure_weights(weights: Path | None, repository: Path) -> Path:
    """The checkpoint to serve (a file, or a folder of layer files); without --weights, a demo one
    written once into the version folder."""
    if weights is not None:
        if not weights.exists():
            raise ServeError(f"--weights {weights}: no such file or folder")
        for path in read_served(weights).files.values():
            check_checkpoint(path)
        return weights.resolve()
    default = repository / MODEL_NAME / "1" / DEFAULT_WEIGHTS_NAME
    if not default.exists():
        from colibri import checkpoint
        checkpoint.write_demo(default)
        print(f"colibri serve: wrote a demo checkpoint to {default}", flush=True)
    else:
        check_checkpoint(default)
    return default.resolve()


def read_served(weights: Path):
    """The layers --weights serves (colibri.model_folder), or ServeError saying why not."""
    from colibri import model_folder
    from colibri._native import ColibriError
    try:
        return model_folder.read(weights)
    except ColibriError as exc:
        raise ServeError(f"--weights {exc.args[0]}") from None
    except OSError as exc:  # e.g. a folder it may not list
        raise ServeError(f"--weights {weights}: {exc.strerror or exc}") from None


def gpu_free_bytes() -> list | None:
    """Free memory of each GPU tritonserver will see, from nvidia-smi (the launcher opens no CUDA
    context of its own: it would hold GPU memory for as long as the server runs), or None where it
    cannot tell (no nvidia-smi, GPUs named by UUID): model.py checks again before loading."""
    try:
        lines = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
        free = {int(i): int(mib) << 20 for i, mib in (line.split(",") for line in lines if line.strip())}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [free[i] for i in sorted(free)]
    try:
        return [free[int(d)] for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    except (ValueError, KeyError):
        return None


def check_memory(weights: Path, device: str, instances: int) -> None:
    """Refuses, before the server starts, layers that cannot fit where they would run (colibri.memory):
    every GPU holds `instances` copies of them; on the CPU the mapped files and each instance's workspace."""
    from colibri import memory
    from colibri._native import ColibriError
    served = read_served(weights)
    sizes = [path.stat().st_size for path in served.files.values()]
    what = f"--weights {weights} ({served.describe_numbers()}, {instances} instance{'s' * (instances > 1)})"
    try:
        if device == "cpu" or (device == "auto" and visible_gpu_count() == 0):
            memory.check(memory.needed(served.configs.values(), sizes, "cpu", instances), memory.host_available(),
                         "the host (memory-mapped, used in place)", what)
            return
        override = os.environ.get(memory.AVAILABLE_OVERRIDE)
        free = [int(override)] * max(1, visible_gpu_count()) if override else gpu_free_bytes()
        for gpu, available in enumerate(free or []):
            memory.check(memory.needed(served.configs.values(), sizes, "cuda", instances), available,
                         f"GPU {gpu}", what)
    except ColibriError as exc:
        raise ServeError(exc.args[0]) from None


def check_checkpoint(weights: Path) -> None:
    """Refuses, before the server starts, a file the reader refuses from its header (not a checkpoint,
    truncated, malformed, a FIFO): one line instead of a server that starts and fails to load. Weights
    that are not finite are found when the model loads them (one pass, by the library)."""
    from colibri import checkpoint
    from colibri._native import ColibriError
    try:
        checkpoint.load(weights)
    except ColibriError as exc:
        message = exc.args[0]
        for prefix in (f"{weights}: ", f"{weights.resolve()}: "):
            message = message[len(prefix):] if message.startswith(prefix) else message
        raise ServeError(f"--weights {weights}: {message}") from None
    except OSError as exc:  # e.g. no permission to read it
        raise ServeError(f"--weights {weights}: {exc.strerror or exc}") from None


def stub_python(run_dir: Path) -> Path:
    """bin folder of a virtual environment whose sys.path matches this interpreter's (see above)."""
    import colibri
    venv = run_dir / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths.append(str(Path(colibri.__file__).resolve().parents[1]))
    site_dirs = site.getsitepackages() + [site.getusersitepackages()]
    # addsitedir, not plain lines, so the .pth files of those folders (editable installs) count too.
    (venv / "lib" / f"python{python_version()}" / "site-packages" / "colibri_serve.pth").write_text(
        "".join(f"{os.path.abspath(p)}\n" for p in paths)
        + f"import site; list(map(site.addsitedir, {site_dirs!r}))\n")
    return venv / "bin"


def server_environment(weights: Path, python_bin: Path) -> dict:
    env = dict(os.environ)
    libs = [str(find_tritonserver().parents[1] / "nvidia_pytriton.libs"),
            sysconfig.get_config_var("LIBDIR") or ""]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    env["PATH"] = os.pathsep.join([str(python_bin), env.get("PATH", "")])
    env["COLIBRI_WEIGHTS"] = str(weights)
    return env


def _die_with_parent():
    """Runs in the child: the server gets SIGTERM if the launcher dies without forwarding a signal."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def check_ports_free(host: str, ports: dict) -> None:
    """Refuses to start when one of the ports is taken: tritonserver loads the model before it binds
    its endpoints, so without this a server already on the port answers the readiness probe."""
    for name, port in ports.items():
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            # As servers do: a port left in TIME_WAIT is free, one with a listener is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise ServeError(f"{name} port {port} on {host} is not free ({exc.strerror}): another server "
                                 f"holds it? Choose another with --{name.lower()}-port") from None


def free_ports(count: int, host: str = "127.0.0.1") -> list:
    """count ports the system has just handed out as free on host (for tests and benchmarks that
    start servers side by side; `serve` itself takes the ports it is given)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_until_ready(server: subprocess.Popen, url: str, timeout_s: float, server_id: str = None) -> None:
    """Until `url` (a Triton readiness endpoint) answers 200 while `server` still runs. With
    server_id, the server answering must also report it as its --id (GET /v2): one that took the
    port after check_ports_free reports another, and is not taken for ours."""
    base_url = url.split("/v2/", 1)[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ServeError(f"tritonserver exited with status {server.returncode} before it was ready")
        try:
            if server_id is not None:
                with urllib.request.urlopen(f"{base_url}/v2", timeout=2) as reply:
                    answered_id = json.loads(reply.read()).get("name")
                if answered_id != server_id:
                    raise ServeError(f"another server (id {answered_id!r}) answers at {base_url}: its HTTP port "
                                     "is taken; choose another with --http-port")
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass  # not listening yet, not ready yet (400) or a partial answer: ask again
        time.sleep(0.25)
    raise ServeError(f"tritonserver was not ready after {timeout_s:.0f} s ({url})")


def request_shape(config: dict):
    """What a request to the served model sends, from its Triton config (GET .../config), for the
    ready line: Triton refuses another width with a note about max_batch_size that is not the fix."""
    hidden = next((t for t in config.get("input", []) if t.get("name") == "hidden_states"), None)
    if hidden is None or len(hidden.get("dims", [])) != 1:
        return None
    width, datatype = hidden["dims"][0], hidden.get("data_type", "").replace("TYPE_", "")
    return (f"hidden_states [T, {width}] {datatype} (H = {width}, the checkpoint's hidden size; T up to "
            f"{config.get('max_batch_size')} tokens)")


def served_request_shape(url: str):
    """request_shape of the model answering at `url` (http://host:port), or None if it cannot say."""
    try:
        with urllib.request.urlopen(f"{url}/v2/models/{MODEL_NAME}/config", timeout=5) as reply:
            return request_shape(json.loads(reply.read()))
    except (urllib.error.URLError, OSError, ValueError, AttributeError, TypeError):
        return None


def visible_gpu_count() -> int:
    """GPUs tritonserver will number 0..n-1: CUDA_VISIBLE_DEVICES' entries where it is set, else the
    /dev/nvidiaN device nodes (none on a host without GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([d for d in Path("/dev").glob("nvidia[0-9]*") if d.name[6:].isdigit()])


def cuda_pool_options(megabytes: int) -> list:
    """--cuda-memory-pool-byte-size for every visible GPU. The Python backend hands GPU tensors between
    the stub and tritonserver through this pool; Triton's default of 64 MB holds about one 4096-token
    fp32 batch of a 4096-wide layer, and when it is full every output falls back to a CUDA IPC handle
    opened per tensor (the log says "will use CUDA IPC for GPU output transfer")."""
    if megabytes <= 0:
        return []
    size = megabytes << 20
    return [f"--cuda-memory-pool-byte-size={gpu}:{size}" for gpu in range(max(1, visible_gpu_count()))]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


DESCRIPTION = (
    "Runs the real tritonserver of the nvidia-pytriton wheel on the Colibri model repository, serving "
    f"{MODEL_NAME} over HTTP and gRPC, until Ctrl-C or SIGTERM. The launcher restarts tritonserver, on the same "
    "ports, when it exits unbidden or stops answering its liveness probes.")
EPILOG = (
    f"A request sends hidden_states [T, H], with H the served checkpoint's hidden size: GET "
    f"/v2/models/{MODEL_NAME}/config shows it (the dims of hidden_states), and so does `python -m colibri info "
    "FILE`. Check a running server with `python -m colibri probe --url http://127.0.0.1:8000`.")


def parse_args(argv):
    # Every help text is a whole sentence: tests/test_help.py reads them as printed at 80 columns.
    parser = argparse.ArgumentParser(prog="python -m colibri serve", description=DESCRIPTION, epilog=EPILOG,
                                     add_help=False)
    parser.add_argument("-h", "--help", action="help", help="Show this help and exit.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address the HTTP, gRPC and metrics endpoints bind to (default: %(default)s; "
                             "0.0.0.0: every interface).")
    parser.add_argument("--http-port", type=int, default=8000, metavar="PORT",
                        help="Port of the HTTP/REST endpoint (default: %(default)s).")
    parser.add_argument("--grpc-port", type=int, default=8001, metavar="PORT",
                        help="Port of the gRPC endpoint (default: %(default)s).")
    parser.add_argument("--metrics-port", type=int, default=8002, metavar="PORT",
                        help="Port of the Prometheus metrics endpoint (default: %(default)s).")
    parser.add_argument("--model-repository", type=Path, default=None, metavar="DIR",
                        help="The Triton model repository to serve (default: the model_repository of the checkout "
                             "colibri runs from; an installed package has none, so give it).")
    parser.add_argument("--weights", type=Path, default=None, metavar="FILE|DIR",
                        help="The packed checkpoint to serve: a *.colibri.safetensors file, or a folder of "
                             "layer{N}.colibri.safetensors files (what `pack --layer all` writes), every layer "
                             "served and named by the input `layer` (default: "
                             f"{MODEL_NAME}/1/{DEFAULT_WEIGHTS_NAME} in the model repository, where a demo "
                             "checkpoint is written if there is none).")
    parser.add_argument("--device", choices=sorted(INSTANCE_KINDS), default="auto",
                        help="Where the model runs: auto (one instance per GPU, or one CPU instance on a host "
                             "without a GPU), cpu or gpu (default: %(default)s).")
    parser.add_argument("--dtype", choices=sorted(TRITON_DTYPES), default="fp32",
                        help="The datatype of hidden_states and output on the wire (default: %(default)s).")
    parser.add_argument("--instances", type=positive_int, default=1, metavar="N",
                        help="Model instances per GPU, or in all on the CPU (default: %(default)s). Each is a "
                             "process with its own copy of the weights; one instance's host work overlaps "
                             "another's GPU work.")
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="How long tritonserver has to load the model and report ready, at the start and "
                             "after each restart (default: %(default)g).")
    parser.add_argument("--cuda-memory-pool-mb", type=int, default=DEFAULT_CUDA_POOL_MB, metavar="MB",
                        help="The per-GPU CUDA memory pool through which the Python backend passes GPU tensors "
                             "(default: %(default)s; 0: Triton's own 64 MB; ignored without a GPU).")
    watchdog.add_probe_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        repository = args.model_repository or checkout_repository()
        if repository is None:
            raise ServeError("no model repository: this colibri package is installed, not run from a checkout; "
                             "pass --model-repository DIR (a Colibri checkout's model_repository)")
        repository = repository.resolve()
        weights = ensure_weights(args.weights, repository)
        check_memory(weights, args.device, args.instances)
        server_root = find_tritonserver()
        check_ports_free(args.host, {"HTTP": args.http_port, "gRPC": args.grpc_port, "metrics": args.metrics_port})
        with tempfile.TemporaryDirectory(prefix="colibri-serve-") as run_dir:
            run_dir = Path(run_dir)
            args.server_id = f"colibri-{secrets.token_hex(6)}"  # how wait_until_ready knows its server
            command = [
                str(server_root / "bin" / "tritonserver"), "--id", args.server_id,
                "--model-repository", str(stage_repository(repository, run_dir, weights, args.device, args.dtype,
                                                          args.instances)),
                "--backend-directory", str(install_python_backend(server_root, run_dir)),
                "--model-control-mode", "none",
                "--http-address", args.host, "--http-port", str(args.http_port),
                "--grpc-address", args.host, "--grpc-port", str(args.grpc_port),
                "--metrics-address", args.host, "--metrics-port", str(args.metrics_port),
            ] + cuda_pool_options(args.cuda_memory_pool_mb)
            return run_server(command, server_environment(weights, stub_python(run_dir)), args, weights)
    except ServeError as exc:
        print(f"colibri serve: {exc.message}", file=sys.stderr)
        if exc.reason:
            print(f"colibri serve: {exc.reason}", file=sys.stderr)
        return 2


def run_server(command, env, args, weights) -> int:
    url = f"http://{args.host}:{args.http_port}"

    def launch():
        # Own session: a terminal's Ctrl-C reaches only the launcher, which forwards it once. Its
        # output passes through the launcher, which keeps the reason should it fail (ServerOutput).
        server = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        server.colibri_output = ServerOutput(server)
        return server

    def wait_ready(server):
        try:
            wait_until_ready(server, f"{url}/v2/health/ready", args.ready_timeout, server_id=args.server_id)
        except ServeError as exc:
            if server.poll() is None or exc.reason is not None:
                raise
            reason = server.colibri_output.reason()
            if reason is None:
                raise
            if MODEL_NAME in reason:  # most often the checkpoint: say how to check one without a server
                exc.message += f"; `python -m colibri info {weights}` checks the checkpoint as loading it does"
            raise ServeError(exc.message, reason) from None

    guard = watchdog.watchdog_from_args(launch, wait_ready, url, MODEL_NAME, args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, guard.forward_signal)
    guard.start()
    shape = served_request_shape(url)
    print(f"colibri serve: {MODEL_NAME} ready (weights {weights}, device {args.device}, dtype {args.dtype})\n"
          + (f"  input   {shape}\n" if shape else "") +
          f"  HTTP    {url}/v2/models/{MODEL_NAME}/infer\n"
          f"  gRPC    {args.host}:{args.grpc_port}\n"
          f"  metrics http://{args.host}:{args.metrics_port}/metrics\n"
          f"  watchdog: {guard_summary(args)}\n"
          f"  stop with Ctrl-C (or SIGTERM to pid {os.getpid()})", flush=True)
    return guard.watch()


def guard_summary(args) -> str:
    if args.probe_interval <= 0:
        return "restarts tritonserver if it exits (no liveness probes)"
    return (f"a one-token probe every {args.probe_interval:g} s; {args.probe_failures} failures in a row (or an "
            "exit) restart tritonserver")
