"""Locust load test of a Triton MoE-layer model (colibri_moe, or any model with its inputs and outputs,
such as bench/serving's torch_moe and identity) over gRPC and HTTP.

Each user is a closed-loop client: it sends a request, waits for the answer, checks its shape and
sends the next. A request is one of two profiles, drawn by weight:
  prefill  N tokens, N uniform in the prefill range (default 128-2048, clipped to the model's
           max_batch_size): its latency is this layer's share of time-to-first-token
  decode   1 token: with many users the dynamic batcher joins them, as in a serving engine's step
Each request is reported through Locust's request event: request_type "grpc" or "http", name the
profile; an error answer or one of the wrong shape is a failure.

Settings, as Locust options or environment variables (defaults in brackets):
  --host                 http://HOST:PORT of Triton's HTTP endpoint [http://127.0.0.1:8000]
  --grpc-url  LOADTEST_GRPC_URL  host:port of the gRPC endpoint [the --host host, port 8001: only a
                                 gRPC endpoint elsewhere needs it]
  --model     LOADTEST_MODEL     model name [colibri_moe]
  --mix       LOADTEST_MIX       profile weights "decode:9,prefill:1", or a preset: decode-heavy,
                                 prefill-heavy, decode, prefill [decode-heavy]
  --prefill-tokens LOADTEST_PREFILL_TOKENS  "MIN-MAX" tokens of a prefill request [128-2048]
  --hidden    LOADTEST_HIDDEN    H, when the model's config does not give it (see model_shape)
  --layer     LOADTEST_LAYER     N: every request names layer N (a server of a folder of layers); -1: none
  --samples-dir LOADTEST_SAMPLES_DIR  folder for one CSV row per request (loadtest/summary.py reads
                                 them for exact percentiles and P99 against concurrency)
  LOADTEST_STEPS, LOADTEST_STEP_TIME  "1,4,16" and seconds: a stepped user ramp (P99 against
                                 concurrency in one run); without them -u/-t apply
  --rate      LOADTEST_RATE      requests per second per user (an open-loop, fixed offered load:
                                 Locust's constant_throughput); 0 = closed loop, the next request as
                                 soon as the answer is in [0]
Pick the protocols by naming the user classes: `locust -f loadtest/locustfile.py GrpcUser HttpUser`.
CudaShmUser sends over gRPC with hidden_states and output in CUDA shared memory (one input and one
output region per user, registered once): the path of a client whose hidden states already live on
a GPU. It needs an NVIDIA GPU on the server's host, cupy (`pip install -c constraints.txt cupy-cuda12x`;
cupy-cuda11x on CUDA 11 drivers) and the colibri package, whose colibri.serving.cuda_shm makes the regions;
without them the run stops at once with one line saying what is missing. This file imports none of
them unless CudaShmUser is asked for, so GrpcUser and HttpUser run anywhere (the compose loadtest image
has neither a GPU nor colibri).

Those users time one layer: their latency is that layer's, not a model's time to first token. The
`generate` workload (GenerateUser, loadtest/generate.py) times what a user feels: a prompt of random
token ids (lengths from --prefill-tokens) through every layer to its first new token (TTFT), then
--new-tokens more (TPOT), run by an attention tier built once in each load-generating process:
  --tier          LOADTEST_TIER          module:function building the tier, called (protocol, options);
                                         default: AttentionTier.from_pretrained(--tier-model)
  --tier-protocol LOADTEST_TIER_PROTOCOL inprocess, grpc, cudashm (the expert tier's transport), eager
                                         (transformers' own MoE blocks: the baseline) or fake [inprocess]
  --tier-model    LOADTEST_TIER_MODEL    the Hugging Face model folder; --weights the packed folder
                                         (inprocess); --tier-device cpu or cuda; --model and --grpc-url
                                         name the Triton model and endpoint (grpc, cudashm)
  --arrivals      LOADTEST_ARRIVALS      open: Poisson arrivals at --arrival-rate requests per second in
                                         all (split evenly over the users), TTFT counted from each
                                         scheduled arrival; closed: each user sends its next request when
                                         the last is answered [open]
A process has one tier and serves its requests one at a time, first come first served: users of one
process queue for it (that wait is in their TTFT). For more concurrency, more processes (--processes),
each with its own tier. Locust's request name is "generate", its response time the TTFT.

With a master and workers (or --processes), each worker writes its own samples file and the master
none (workers started on their own build their tier from their own command line: give them the same
generate options; the arrival rate per user comes from the master); when the test stops the master asks every worker to stop its users, flush its samples and send
its last statistics, and waits for all of them before Locust's final counts are taken (Locust's own
quit waits 0.5 s for them, and drops what arrives later). With workers on other hosts, copy their
samples-*.csv into one folder for loadtest/summary.py.
"""
import atexit
import csv
import itertools
import json
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

# Locust patches the standard library for gevent when it is imported; gRPC's C core has its own
# threads and must be told to hand its waits to gevent, before any channel exists, or one user's
# blocking call stalls every greenlet in the process.
from locust import LoadTestShape, User, constant_throughput, events, task
from locust.runners import MasterRunner, WorkerRunner
import gevent
import gevent.lock
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import numpy as np  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import triton_to_np_dtype  # noqa: E402

PROFILES = ("decode", "prefill")
MIX_PRESETS = {"decode-heavy": "decode:9,prefill:1", "prefill-heavy": "decode:1,prefill:3",
               "decode": "decode:1", "prefill": "prefill:1"}
# Triton activation types -> wire datatype. The numpy dtype of each is tritonclient's own
# (triton_to_np_dtype): BF16 is ml_dtypes.bfloat16, which InferInput packs with one tobytes() and
# as_numpy reads with one frombuffer, where tritonclient 2.5x packed BF16 element by element in Python
# and saturated this load generator (bench/serving/README.md, "On the CPU").
WIRE_TYPES = {"TYPE_FP32": "FP32", "TYPE_FP16": "FP16", "TYPE_BF16": "BF16"}
REQUEST_TIMEOUT_S = 120.0
GRPC_PORT = 8001  # Triton's default, and `make serve`'s


def wire_array(values: np.ndarray, wire: str) -> np.ndarray:
    """values as the numpy array tritonclient sends for datatype `wire` (BF16: rounded to nearest even,
    as colibri.dtypes.float32_to_bf16 rounds)."""
    return np.ascontiguousarray(values).astype(triton_to_np_dtype(wire))


def storage_bits(array: np.ndarray) -> np.ndarray:
    """The array's bytes as the server holds them: bf16 as uint16 bits (cupy and DLPack consumers know
    no bfloat16 dtype), other dtypes unchanged."""
    return array.view(np.uint16) if array.dtype == triton_to_np_dtype("BF16") else array


def parse_mix(text: str) -> dict:
    """{profile: weight} from "decode:9,prefill:1" or a preset name."""
    text = MIX_PRESETS.get(text.strip(), text)
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        if name not in PROFILES:
            raise ValueError(f"mix: unknown profile {name!r} (profiles: {', '.join(PROFILES)})")
        mix[name] = float(weight or 1)
    if not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
        raise ValueError(f"mix {text!r}: give positive weights, e.g. decode:9,prefill:1")
    return mix


def parse_range(text: str) -> tuple:
    low, _, high = text.partition("-")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise ValueError(f"token range {text!r}: expected MIN-MAX with 1 <= MIN <= MAX")
    return low, high


def parse_steps(text: str) -> list:
    steps = [int(s) for s in text.split(",") if s.strip()]
    if not steps or min(steps) < 1:
        raise ValueError(f"LOADTEST_STEPS={text!r}: expected user counts such as 1,4,16")
    return steps


@events.init_command_line_parser.add_listener
def add_arguments(parser):
    group = parser.add_argument_group("Colibri (loadtest/locustfile.py)")
    group.add_argument("--model", env_var="LOADTEST_MODEL", default="colibri_moe", help="Triton model name")
    group.add_argument("--grpc-url", env_var="LOADTEST_GRPC_URL", default="",
                       help="gRPC host:port (default: the --host host, port 8001)")
    group.add_argument("--mix", env_var="LOADTEST_MIX", default="decode-heavy",
                       help="profile weights, e.g. decode:9,prefill:1, or " + ", ".join(MIX_PRESETS))
    group.add_argument("--prefill-tokens", env_var="LOADTEST_PREFILL_TOKENS", default="128-2048",
                       help="MIN-MAX tokens of a prefill request (clipped to max_batch_size)")
    group.add_argument("--hidden", env_var="LOADTEST_HIDDEN", type=int, default=0,
                       help="hidden size H, when the model config leaves it -1 (default: asked of the server)")
    group.add_argument("--layer", env_var="LOADTEST_LAYER", type=int, default=-1,
                       help="the layer every request names (input `layer`), for a server of a folder of layers "
                            "(default -1: none)")
    group.add_argument("--samples-dir", env_var="LOADTEST_SAMPLES_DIR", default="",
                       help="write one CSV row per request into this folder")
    group.add_argument("--rate", env_var="LOADTEST_RATE", type=float, default=0.0,
                       help="requests per second per user (fixed offered load); 0: closed loop")
    group.add_argument("--tier", env_var="LOADTEST_TIER", default="",
                       help="generate: module:function building the attention tier (default: from --tier-model)")
    group.add_argument("--tier-protocol", env_var="LOADTEST_TIER_PROTOCOL", default="inprocess",
                       help="generate: inprocess, grpc, cudashm, eager or fake")
    group.add_argument("--tier-model", env_var="LOADTEST_TIER_MODEL", default="",
                       help="generate: the Hugging Face model folder")
    group.add_argument("--tier-device", env_var="LOADTEST_TIER_DEVICE", default="cpu", help="generate: cpu or cuda")
    group.add_argument("--tier-dtype", env_var="LOADTEST_TIER_DTYPE", default="",
                       help="generate: the attention tier's torch dtype, e.g. bfloat16 (default: the model's)")
    group.add_argument("--tier-warmup", env_var="LOADTEST_TIER_WARMUP", type=int, default=1,
                       help="generate: untimed requests of the longest prompt after the tier is built")
    group.add_argument("--weights", env_var="LOADTEST_WEIGHTS", default="",
                       help="generate, inprocess: the packed folder of layers")
    group.add_argument("--new-tokens", env_var="LOADTEST_NEW_TOKENS", type=int, default=16,
                       help="generate: tokens after the first (TPOT); a request asks for 1 + this many")
    group.add_argument("--vocab-size", env_var="LOADTEST_VOCAB_SIZE", type=int, default=0,
                       help="generate: prompt token ids below this (default: the tier's vocabulary)")
    group.add_argument("--arrivals", env_var="LOADTEST_ARRIVALS", default="open", choices=("open", "closed"),
                       help="generate: open (Poisson at --arrival-rate) or closed (each user waits for its answer)")
    group.add_argument("--arrival-rate", env_var="LOADTEST_ARRIVAL_RATE", type=float, default=1.0,
                       help="generate, open: requests per second offered in all, split over the users")
    group.add_argument("--seed", env_var="LOADTEST_SEED", type=int, default=0,
                       help="generate: seed of arrivals and prompts (with the process and user number)")


@events.test_start.add_listener
def check_options(environment, **_kwargs):
    options = environment.parsed_options
    if options is not None:  # fail before the first user, with the option's own message
        parse_mix(options.mix)
        parse_range(options.prefill_tokens)
        if not options.rate >= 0:
            raise ValueError(f"--rate {options.rate}: expected requests per second per user, >= 0")
        if options.new_tokens < 0:
            raise ValueError(f"--new-tokens {options.new_tokens}: expected >= 0")
        if options.arrivals == "open" and not 0 < options.arrival_rate < float("inf"):
            raise ValueError(f"--arrival-rate {options.arrival_rate}: expected requests per second, > 0")


# --- the model, as the server describes it ---------------------------------------------------------

_shapes = {}
_shapes_lock = threading.Lock()


def model_shape(client, model: str, hidden_override: int) -> dict:
    """{hidden, wire, np_dtype, max_tokens} of a model, asked once per process and model.

    H is hidden_states' dims in the loaded config: colibri_moe (and bench/serving's models) fill it
    in from the checkpoint at load (auto_complete_config), so only a model declaring -1 needs --hidden."""
    with _shapes_lock:
        if model in _shapes:
            return _shapes[model]
        config = client.get_model_config(model, **({"as_json": True} if isinstance(
            client, grpcclient.InferenceServerClient) else {}))
        config = config.get("config", config)
        hidden_states = next(t for t in config["input"] if t["name"] == "hidden_states")
        wire = WIRE_TYPES[hidden_states.get("data_type", "TYPE_FP32")]
        np_dtype = triton_to_np_dtype(wire)
        dims = [int(d) for d in hidden_states.get("dims", [])]
        hidden = hidden_override or (dims[-1] if dims and dims[-1] > 0 else 0)
        if not hidden:
            raise RuntimeError(f"{model}: its config gives hidden_states dims {dims}, no width; give --hidden")
        max_tokens = int(config.get("max_batch_size", 0)) or 1 << 30
        _shapes[model] = dict(hidden=hidden, wire=wire, np_dtype=np_dtype, max_tokens=max_tokens)
        return _shapes[model]


_pools = {}


def input_pool(shape: dict, tokens: int) -> np.ndarray:
    """Random hidden states shared by the process's users: a request sends the first N rows, so no
    user spends load-generator time drawing numbers while others wait."""
    key = (shape["hidden"], np.dtype(shape["np_dtype"]).name)
    pool = _pools.get(key)
    if pool is None or pool.shape[0] < tokens:
        pool = wire_array(np.random.default_rng(0).standard_normal((tokens, shape["hidden"])), shape["wire"])
        _pools[key] = pool
    return pool


# --- per-request samples (exact percentiles; P99 against concurrency) -------------------------------

_samples = {"writer": None, "file": None}


@events.test_start.add_listener
def open_samples(environment, **_kwargs):
    options = environment.parsed_options
    folder = getattr(options, "samples_dir", "") if options is not None else ""
    if not folder or _samples["file"] is not None or isinstance(environment.runner, MasterRunner):
        return  # the master runs no users: only the processes that do write samples
    Path(folder).mkdir(parents=True, exist_ok=True)
    # One file per process: with --processes each worker writes its own.
    _samples["file"] = open(Path(folder) / f"samples-{os.getpid()}.csv", "w", newline="")
    _samples["writer"] = csv.writer(_samples["file"])
    _samples["writer"].writerow(SAMPLE_COLUMNS)
    _samples["rows"] = 0


# Layer requests fill the first six; a generate request all of them (latency_ms: its TTFT).
SAMPLE_COLUMNS = ["end_time", "protocol", "profile", "tokens", "latency_ms", "failed",
                  "arrival_time", "ttft_ms", "tpot_ms", "new_tokens", "error"]


@events.request.add_listener
def write_sample(request_type, name, response_time, exception=None, context=None, **_kwargs):
    if _samples["writer"] is not None:
        context = context or {}
        sample = context.get("sample")
        extra = ["", "", "", "", ""] if sample is None else [
            f"{sample.arrival:.6f}", f"{sample.ttft_ms:.4f}", f"{sample.tpot_ms:.4f}", sample.new_tokens,
            sample.error.replace("\n", " ")]
        _samples["writer"].writerow([f"{time.time():.6f}", request_type, name, context.get("tokens", ""),
                                     f"{response_time:.4f}", int(exception is not None), *extra])
        _samples["rows"] += 1


# --- every worker's last statistics before Locust's final counts -----------------------------------

FLUSH_TIMEOUT_S = 60.0  # past the stop timeout: a worker still silent by then is named as such


@events.init.add_listener
def register_flush(environment, runner=None, **_kwargs):
    """A worker asked to flush stops its users (the answers in flight come in), writes its samples to
    disk, sends Locust its statistics and then says how many samples it wrote; the master asks every
    worker when the test stops and waits for all of them. Without this, what a worker did in its last
    report interval (up to 3 s) and its requests in flight reach Locust after the master has stopped
    listening (it waits 0.5 s), and Locust's totals fall short of the samples."""
    if isinstance(runner, WorkerRunner):
        def flush(environment, msg, **_kw):
            runner.stop()
            if _samples["file"] is not None:
                _samples["file"].flush()
            runner._send_stats()  # Locust's own final-report call (its quit makes the same one)
            runner.send_message("colibri_flushed", {"samples": _samples.get("rows", 0)})
        runner.register_message("colibri_flush", flush, concurrent=True)
    elif isinstance(runner, MasterRunner):
        flushed = {}
        runner.register_message("colibri_flushed", lambda environment, msg, **_kw: flushed.__setitem__(
            msg.node_id, msg.data["samples"]))

        @environment.events.test_stopping.add_listener
        def ask_workers(**_kw):
            flushed.clear()
            workers = [client.id for client in runner.clients.all]
            for worker in workers:
                runner.send_message("colibri_flush", None, worker)
            deadline = time.monotonic() + environment.stop_timeout + FLUSH_TIMEOUT_S
            while set(workers) - set(flushed) and time.monotonic() < deadline:
                gevent.sleep(0.05)
            missing = set(workers) - set(flushed)
            if missing:
                logging.error("loadtest: no final report from worker(s) %s: Locust's counts will miss their last "
                              "requests", ", ".join(sorted(missing)))


@events.quitting.add_listener
def close_samples(**_kwargs):
    if _samples["file"] is not None:
        _samples["file"].close()
        _samples["file"] = _samples["writer"] = None


# --- users -------------------------------------------------------------------------------------------

# Clients of users that never reached on_stop (on_start failed, the run was cut): a gRPC channel left
# open keeps the process from exiting under gevent, so every one is closed when Locust quits.
_open_clients = set()


@events.quit.add_listener
def close_clients(exit_code=0, **_kwargs):
    while _open_clients:
        _open_clients.pop().close()
    # Even then, gRPC's clean-up at interpreter exit sometimes waits forever under gevent (seen here
    # after runs that had ended cleanly, their files written). atexit runs after Locust has closed its
    # files, and this handler, registered last, runs first: leave from there with Locust's status.
    atexit.register(_leave, exit_code)


def _leave(exit_code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class WrongAnswer(Exception):
    """A successful reply whose output is not [N, H]."""


class TritonUser(User):
    abstract = True
    host = "http://127.0.0.1:8000"  # `make serve`; --host replaces it
    protocol = ""
    client_module = None

    def on_start(self):
        options = self.environment.parsed_options
        self.model = options.model
        self.mix = parse_mix(options.mix)
        self.client = self.make_client(options)
        _open_clients.add(self.client)
        self.shape = model_shape(self.client, self.model, options.hidden)
        low, high = parse_range(options.prefill_tokens)
        self.prefill_range = (min(low, self.shape["max_tokens"]), min(high, self.shape["max_tokens"]))
        self.pool = input_pool(self.shape, self.prefill_range[1])
        self.profiles, self.weights = list(self.mix), list(self.mix.values())
        self.layer = options.layer
        self._pace = constant_throughput(options.rate) if options.rate > 0 else (lambda _user: 0.0)

    def on_stop(self):
        _open_clients.discard(self.client)
        self.client.close()

    def wait_time(self):
        """0 in a closed loop; with --rate, Locust's constant_throughput pacing."""
        return self._pace(self)

    def prepare(self, tokens: int):
        """(inputs, outputs) of a request of `tokens` rows; not timed (the client's own work)."""
        tensor = self.client_module.InferInput("hidden_states", [tokens, self.shape["hidden"]], self.shape["wire"])
        tensor.set_data_from_numpy(self.pool[:tokens])
        outputs = [self.client_module.InferRequestedOutput("output", **self.output_options)]
        return self.with_layer([tensor], tokens), outputs

    def with_layer(self, inputs, tokens: int):
        """inputs, plus `layer` [tokens, 1] (plain, not in shared memory: it is small) with --layer N."""
        if self.layer >= 0:
            tensor = self.client_module.InferInput("layer", [tokens, 1], "INT32")
            tensor.set_data_from_numpy(np.full((tokens, 1), self.layer, np.int32))
            inputs.append(tensor)
        return inputs

    def output_shape(self, result):
        output = result.as_numpy("output")
        return None if output is None else list(output.shape), 0 if output is None else output.nbytes

    @task
    def request(self):
        profile = random.choices(self.profiles, self.weights)[0]
        tokens = 1 if profile == "decode" else random.randint(*self.prefill_range)
        exception, length = None, 0
        start = time.perf_counter()
        try:
            inputs, outputs = self.prepare(tokens)
            start = time.perf_counter()
            result = self.client.infer(self.model, inputs, outputs=outputs, **self.infer_options)
            elapsed_ms = (time.perf_counter() - start) * 1000.0
            shape, length = self.output_shape(result)
            if shape != [tokens, self.shape["hidden"]]:
                raise WrongAnswer(f"output shape {shape}, expected [{tokens}, {self.shape['hidden']}]")
        except Exception as exc:  # every failure is the request's, reported to Locust, never raised
            elapsed_ms = (time.perf_counter() - start) * 1000.0
            exception = exc
        self.environment.events.request.fire(
            request_type=self.protocol, name=profile, response_time=elapsed_ms, response_length=length,
            exception=exception, context={"tokens": tokens, "model": self.model})


def _host_port(hostname: str, port: int) -> str:
    return f"[{hostname}]:{port}" if ":" in hostname else f"{hostname}:{port}"  # IPv6 in brackets


def http_address(host: str) -> str:
    """host:port of Triton's HTTP endpoint from --host (http://HOST:PORT, or HOST:PORT)."""
    parts = urlsplit(host if "://" in host else f"http://{host}")
    return _host_port(parts.hostname or "127.0.0.1", parts.port or 8000)


def grpc_address(host: str, grpc_url: str = "") -> str:
    """host:port of the gRPC endpoint: --grpc-url when given, else --host's host on port 8001, so a
    run pointed at another machine sends every protocol there."""
    if grpc_url:
        return grpc_url
    parts = urlsplit(host if "://" in host else f"http://{host}")
    return _host_port(parts.hostname or "127.0.0.1", GRPC_PORT)


class GrpcUser(TritonUser):
    protocol = "grpc"
    client_module = grpcclient
    output_options = {}
    infer_options = {"client_timeout": REQUEST_TIMEOUT_S}

    def make_client(self, options):
        return grpcclient.InferenceServerClient(grpc_address(self.host, options.grpc_url))


class HttpUser(TritonUser):
    protocol = "http"
    client_module = httpclient
    output_options = {"binary_data": True}  # JSON numbers would cost more than the layer
    infer_options = {}

    def make_client(self, options):
        return httpclient.InferenceServerClient(http_address(self.host), connection_timeout=REQUEST_TIMEOUT_S,
                                                network_timeout=REQUEST_TIMEOUT_S)


_gpu_pools = {}


def cuda_problem(device_id: int = 0):
    """None when CudaShmUser can run here, else one line saying what is missing (colibri, the NVIDIA
    driver, cupy, GPU device_id: LOADTEST_CUDA_DEVICE). Imported here only: the other users need none
    of these."""
    try:
        from colibri.serving.cuda_shm import host_problem
    except ImportError as exc:
        return f"CudaShmUser needs the colibri package (its cuda_shm module) on the server's host: {exc}"
    problem = host_problem(device_id)
    return f"CudaShmUser {problem}" if problem else None


@events.init.add_listener
def refuse_cudashm_without_gpu(environment, **_kwargs):
    """A run with CudaShmUser on a host that cannot run it stops here with one line, rather than every
    user failing in on_start with a traceback."""
    if CudaShmUser in (environment.user_classes or []):
        problem = cuda_problem(CudaShmUser.device_id)
        if problem:
            sys.stderr.write(f"loadtest: {problem}\n")
            sys.stderr.flush()
            os._exit(2)  # before any gRPC channel exists; SystemExit would be logged with a traceback


class CudaShmUser(GrpcUser):
    """gRPC with hidden_states and output in CUDA shared memory, registered once per user: a request
    copies its rows device to device into the input region (not timed, like the other users' encoding)
    and names both regions; nothing crosses the wire but the request header. Latency is the round
    trip; the output stays on the GPU, as a GPU consumer would take it, its shape checked from the
    reply. GPU arrays are cupy's; bf16 rows are held as their uint16 bits (cupy has no bfloat16), which
    is all a byte copy into the region needs. Regions are colibri.serving.cuda_shm's."""
    protocol = "cudashm"
    device_id = int(os.environ.get("LOADTEST_CUDA_DEVICE", "0"))

    def on_start(self):
        problem = cuda_problem(self.device_id)
        if problem:
            raise RuntimeError(problem)
        import cupy
        from colibri.serving.cuda_shm import CudaShmRegion
        self.regions = []
        super().on_start()
        key = (self.shape["hidden"], self.shape["wire"])
        pool = _gpu_pools.get(key)
        if pool is None or pool.shape[0] < self.pool.shape[0]:
            with cupy.cuda.Device(self.device_id):
                pool = cupy.asarray(storage_bits(self.pool))  # C-contiguous, as the region copy needs
            _gpu_pools[key] = pool
        self.gpu_pool = pool
        self.row_bytes = self.shape["hidden"] * pool.itemsize
        nbytes = self.prefill_range[1] * self.row_bytes
        tag = f"locust_{os.getpid()}_{id(self):x}"
        for suffix in ("in", "out"):
            region = CudaShmRegion(f"{tag}_{suffix}", nbytes, self.device_id)
            self.regions.append(region)
            region.register(self.client)
        self.input_region, self.output_region = self.regions

    def on_stop(self):
        for region in reversed(getattr(self, "regions", [])):
            try:
                region.unregister(self.client)
            except Exception:  # Triton may still hold an output region for a moment; the server frees it
                pass
            region.free()
        self.regions = []
        if getattr(self, "client", None) is not None:
            super().on_stop()

    def prepare(self, tokens: int):
        nbytes = tokens * self.row_bytes
        # a leading-rows slice of a C-contiguous array is C-contiguous: one copy into the region
        self.input_region.write(self.gpu_pool[:tokens])
        tensor = grpcclient.InferInput("hidden_states", [tokens, self.shape["hidden"]], self.shape["wire"])
        tensor.set_shared_memory(self.input_region.name, nbytes)
        output = grpcclient.InferRequestedOutput("output")
        output.set_shared_memory(self.output_region.name, nbytes)
        return self.with_layer([tensor], tokens), [output]

    def output_shape(self, result):
        output = result.get_output("output")
        return (None, 0) if output is None else ([int(d) for d in output.shape],
                                                 int(np.prod(output.shape)) * self.gpu_pool.itemsize)


if os.environ.get("LOADTEST_STEPS"):
    class SteppedUsers(LoadTestShape):
        """LOADTEST_STEPS user counts, LOADTEST_STEP_TIME seconds each, then stop: P99 against
        concurrency in one run (summary.py maps each request to the user count of its time)."""
        steps = parse_steps(os.environ["LOADTEST_STEPS"])
        step_time = float(os.environ.get("LOADTEST_STEP_TIME", "10"))

        def tick(self):
            step = int(self.get_run_time() // self.step_time)
            if step >= len(self.steps):
                return None
            return self.steps[step], max(self.steps)  # spawn at once: each step is a level, not a ramp


# --- the generate workload: whole-model requests through an attention tier -------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generate.py beside this file, for Locust too
import generate as gen  # noqa: E402

_tier = {"tier": None, "error": None, "protocol": None}
_unserved = {"count": 0, "oldest_wait_s": 0.0, "stopping_at": None}


@events.test_stopping.add_listener
def note_the_end(**_kwargs):
    """When this process was told to stop: arrivals after it are not the run's."""
    if _unserved["stopping_at"] is None:
        _unserved["stopping_at"] = time.time()


def write_unserved(environment, protocol):
    folder = getattr(environment.parsed_options, "samples_dir", "")
    if folder:
        Path(folder, f"unserved-{os.getpid()}.json").write_text(json.dumps({
            "protocol": protocol, "count": _unserved["count"], "oldest_wait_s": _unserved["oldest_wait_s"]}))
_tier_lock = gevent.lock.Semaphore()  # one request on the tier at a time; gevent wakes waiters in order
_user_numbers = itertools.count()


def build_tier(environment):
    """The process's tier, built once (before the first user starts, so the build is not in the run)."""
    if _tier["tier"] is not None or _tier["error"] is not None:
        return
    options = environment.parsed_options
    settings = type(options)(**vars(options))
    settings.grpc_url = grpc_address(environment.host or TritonUser.host, options.grpc_url)
    protocol = options.tier_protocol
    try:
        factory = gen.load_factory(options.tier or ("fake" if protocol == "fake" else ""))
        tier = factory(protocol, settings)
        # warm-up requests of the longest prompt (one-time costs: kernels, connections, caches), not timed
        rng, vocab = random.Random(options.seed), gen.vocab_size(tier, options.vocab_size)
        for _ in range(options.tier_warmup):
            tier.generate(gen.prompt_ids(rng, parse_range(options.prefill_tokens)[1], vocab), 2)
        _tier["tier"], _tier["protocol"] = tier, protocol
    except Exception as exc:
        _tier["error"] = f"building the {protocol} tier: {type(exc).__name__}: {exc}"


@events.test_start.add_listener
def share_arrival_rate(environment, **_kwargs):
    """Each open-loop stream's rate, --arrival-rate over the run's users, as the master (or the only
    process) knows them: it reaches workers with the master's options, whatever -u they were given."""
    options = environment.parsed_options
    if options is not None and not isinstance(environment.runner, WorkerRunner):
        options.arrival_rate_per_user = options.arrival_rate / max(1, options.num_users or 1)


@events.test_start.add_listener
def write_settings(environment, **_kwargs):
    """settings.json beside the samples (by the master, or the only process): what summary.py cannot
    tell from the samples, the arrival mode and the offered rate above all."""
    options = environment.parsed_options
    folder = getattr(options, "samples_dir", "") if options is not None else ""
    if not folder or isinstance(environment.runner, WorkerRunner):
        return
    classes = [cls.__name__ for cls in environment.user_classes or []]
    settings = {"user_classes": classes, "users": options.num_users, "prefill_tokens": options.prefill_tokens,
                "processes": getattr(options, "expect_workers", None) if isinstance(environment.runner, MasterRunner)
                else 1}
    if "GenerateUser" in classes:
        tier = options.tier or ("fake" if options.tier_protocol == "fake" else "default")
        settings.update(arrivals=options.arrivals, tier_protocol=options.tier_protocol, tier=tier,
                        new_tokens=options.new_tokens, seed=options.seed,
                        **({"arrival_rate": options.arrival_rate} if options.arrivals == "open" else {}))
    else:
        settings.update(arrivals="per-user rate" if options.rate > 0 else "closed", rate_per_user=options.rate)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")


@events.quitting.add_listener
def close_tier(**_kwargs):
    """The tier's connections and shared-memory regions (a cudashm tier's are registered with Triton)."""
    tier, _tier["tier"] = _tier["tier"], None
    if tier is not None and hasattr(tier, "close"):
        try:
            tier.close()
        except Exception as exc:  # the run's results are in; say it and go
            logging.warning("loadtest: closing the tier: %s", exc)


def fresh_loop_time():
    """gevent's loop reads the clock once per turn: after a call that held the process (building the tier,
    a request computed on the CPU) a timer made now would count from a stale time and fire that much early
    (Locust's run-time limit fired 5 ms after it was set, behind a 10 s tier build)."""
    gevent.get_hub().loop.update_now()


@events.init.add_listener
def build_tier_at_start(environment, runner=None, **_kwargs):
    if GenerateUser in (environment.user_classes or []) and not isinstance(runner, MasterRunner):
        if environment.parsed_options is not None:
            build_tier(environment)
            fresh_loop_time()
        if _tier["error"] is not None and isinstance(runner, WorkerRunner):
            logging.error("loadtest: %s", _tier["error"])
        elif _tier["error"] is not None:
            # one process and no tier: say so and stop now rather than run users that cannot start (a
            # worker carries on, its users failing at start, so that its master is not left waiting)
            sys.stderr.write(f"loadtest: {_tier['error']}\n")
            sys.stderr.flush()
            os._exit(2)


class GenerateUser(User):
    """Whole-model requests through the process's attention tier (see the module docstring): open-loop
    Poisson arrivals at --arrival-rate / users each, or a closed loop; every request waits its turn on the
    tier, first come first served, and that wait is part of its TTFT."""
    host = "http://127.0.0.1:8000"

    def on_start(self):
        options = self.environment.parsed_options
        build_tier(self.environment)
        if _tier["error"] is not None:
            raise RuntimeError(_tier["error"])
        self.tier, self.protocol = _tier["tier"], _tier["protocol"]
        # the same seed, the same prompts and arrivals in each process and user, run after run
        stream = f"{options.seed}-{getattr(self.environment.runner, 'worker_index', 0)}-{next(_user_numbers)}"
        self.rng = random.Random(f"{stream}-prompts")
        self.prompt_range = parse_range(options.prefill_tokens)
        self.vocab = gen.vocab_size(self.tier, options.vocab_size)
        self.max_new_tokens = 1 + options.new_tokens
        self.open = options.arrivals == "open"
        self.pending = None  # an arrival drawn and not yet served
        if self.open:
            per_user = getattr(options, "arrival_rate_per_user", 0.0) or options.arrival_rate / max(
                1, getattr(options, "num_users", 1) or 1)
            self.arrivals = gen.poisson_arrivals(per_user, random.Random(f"{stream}-arrivals"), time.time())

    def on_stop(self):
        """Arrivals due before the process was told to stop and never served (a tier that could not keep
        up) are no samples; they are counted, with the longest wait among them up to that moment, in
        unserved-PID.json for the summary."""
        if not getattr(self, "open", False):
            return
        now, waits = _unserved["stopping_at"] or time.time(), []
        arrival = self.pending if self.pending is not None else next(self.arrivals)
        while arrival <= now:
            waits.append(now - arrival)
            arrival = next(self.arrivals)
        _unserved["count"] += len(waits)
        _unserved["oldest_wait_s"] = max([_unserved["oldest_wait_s"], *waits])
        write_unserved(self.environment, self.protocol)

    def wait_time(self):
        return 0.0

    @task
    def request(self):
        # A tier computing on the CPU never yields, and the gevent.sleep(0) between tasks runs no timers:
        # without this, Locust's run-time timer (and a worker's heartbeats) waited for minutes.
        gevent.idle()
        if self.open:
            arrival = self.pending = next(self.arrivals)
            while arrival > time.time():  # never before the arrival: a timer can fire early (fresh_loop_time)
                fresh_loop_time()
                gevent.sleep(arrival - time.time())
        else:
            arrival = time.time()
        prompt = gen.prompt_ids(self.rng, self.rng.randint(*self.prompt_range), self.vocab)
        with _tier_lock:
            sample = gen.serve(self.tier, arrival, prompt, self.max_new_tokens)
        self.pending = None
        self.environment.events.request.fire(
            request_type=self.protocol, name="generate", response_time=sample.ttft_ms if not sample.error else
            (sample.end - arrival) * 1000.0, response_length=sample.new_tokens,
            exception=gen.WrongAnswer(sample.error) if sample.error else None,
            context={"tokens": sample.prompt_tokens, "sample": sample})
