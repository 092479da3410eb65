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
  --grpc-url  LOADTEST_GRPC_URL  host:port of the gRPC endpoint [the --host host, port 8001]
  --model     LOADTEST_MODEL     model name [colibri_moe]
  --mix       LOADTEST_MIX       profile weights "decode:9,prefill:1", or a preset: decode-heavy,
                                 prefill-heavy, decode, prefill [decode-heavy]
  --prefill-tokens LOADTEST_PREFILL_TOKENS  "MIN-MAX" tokens of a prefill request [128-2048]
  --hidden    LOADTEST_HIDDEN    H, when the model's config does not give it (see model_shape)
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
a GPU. It needs a GPU, torch and cuda-python; its latency includes the device copy into the region.
"""
import atexit
import csv
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
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import numpy as np  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
import tritonclient.grpc._infer_input  # noqa: E402  (serialize_bf16_tensor below)
import tritonclient.grpc._infer_result  # noqa: E402
import tritonclient.http._infer_input  # noqa: E402
import tritonclient.http._infer_result  # noqa: E402
import tritonclient.utils  # noqa: E402

PROFILES = ("decode", "prefill")
MIX_PRESETS = {"decode-heavy": "decode:9,prefill:1", "prefill-heavy": "decode:1,prefill:3",
               "decode": "decode:1", "prefill": "prefill:1"}
# Triton activation types -> (wire datatype, numpy dtype tritonclient takes). BF16 travels as float32
# values that tritonclient truncates to bf16 (serialize_bf16_tensor, below); over CUDA shared memory
# bf16 is written as bits instead.
WIRE_TYPES = {"TYPE_FP32": ("FP32", np.float32), "TYPE_FP16": ("FP16", np.float16),
              "TYPE_BF16": ("BF16", np.float32)}
REQUEST_TIMEOUT_S = 120.0


def serialize_bf16_tensor(input_tensor: np.ndarray) -> np.ndarray:
    """tritonclient.utils.serialize_bf16_tensor without its loop: the same bytes (each float32's upper
    two bytes, little-endian, row-major) as a 0-d object array holding them. tritonclient packs BF16 one
    element at a time in Python (struct.pack per element), which for prompts of thousands of elements
    saturated the load generator and stalled every user's timing with it (bench/serving/README.md, "On
    the CPU"). tests/test_loadtest.py checks the bytes against tritonclient's own."""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.object_)
    if input_tensor.dtype != np.float32:
        raise tritonclient.utils.InferenceServerException("cannot serialize bf16 tensor: invalid datatype")
    upper = (np.ascontiguousarray(input_tensor).view(np.uint32) >> 16).astype("<u2")
    return np.asarray(upper.tobytes(), dtype=np.object_)


def deserialize_bf16_tensor(encoded_tensor: bytes) -> np.ndarray:
    """tritonclient.utils.deserialize_bf16_tensor without its loop (struct.unpack per element, for the
    answers): the same float32 values, the same [n, 1] array."""
    upper = np.frombuffer(encoded_tensor, dtype="<u2", count=len(encoded_tensor) // 2)
    return (upper.astype(np.uint32) << 16).view(np.float32).reshape(-1, 1)


# The InferInput and InferResult modules of both protocols call these by the names they imported;
# this process's requests and answers use the versions above.
for _module, _name, _function in (
        (tritonclient.grpc._infer_input, "serialize_bf16_tensor", serialize_bf16_tensor),
        (tritonclient.http._infer_input, "serialize_bf16_tensor", serialize_bf16_tensor),
        (tritonclient.grpc._infer_result, "deserialize_bf16_tensor", deserialize_bf16_tensor),
        (tritonclient.http._infer_result, "deserialize_bf16_tensor", deserialize_bf16_tensor)):
    if hasattr(_module, _name):
        setattr(_module, _name, _function)


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
    group.add_argument("--samples-dir", env_var="LOADTEST_SAMPLES_DIR", default="",
                       help="write one CSV row per request into this folder")
    group.add_argument("--rate", env_var="LOADTEST_RATE", type=float, default=0.0,
                       help="requests per second per user (fixed offered load); 0: closed loop")


@events.test_start.add_listener
def check_options(environment, **_kwargs):
    options = environment.parsed_options
    if options is not None:  # fail before the first user, with the option's own message
        parse_mix(options.mix)
        parse_range(options.prefill_tokens)
        if not options.rate >= 0:
            raise ValueError(f"--rate {options.rate}: expected requests per second per user, >= 0")


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
        wire, np_dtype = WIRE_TYPES[hidden_states.get("data_type", "TYPE_FP32")]
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
        pool = np.random.default_rng(0).standard_normal((tokens, shape["hidden"])).astype(shape["np_dtype"])
        _pools[key] = pool
    return pool


# --- per-request samples (exact percentiles; P99 against concurrency) -------------------------------

_samples = {"writer": None, "file": None}


@events.test_start.add_listener
def open_samples(environment, **_kwargs):
    options = environment.parsed_options
    folder = getattr(options, "samples_dir", "") if options is not None else ""
    if not folder or _samples["file"] is not None:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    # One file per process: with --processes each worker writes its own.
    _samples["file"] = open(Path(folder) / f"samples-{os.getpid()}.csv", "w", newline="")
    _samples["writer"] = csv.writer(_samples["file"])
    _samples["writer"].writerow(["end_time", "protocol", "profile", "tokens", "latency_ms", "failed"])


@events.request.add_listener
def write_sample(request_type, name, response_time, exception=None, context=None, **_kwargs):
    if _samples["writer"] is not None:
        _samples["writer"].writerow([f"{time.time():.6f}", request_type, name, (context or {}).get("tokens", ""),
                                     f"{response_time:.4f}", int(exception is not None)])


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
        return [tensor], [self.client_module.InferRequestedOutput("output", **self.output_options)]

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


def http_address(host: str) -> str:
    parts = urlsplit(host if "://" in host else f"http://{host}")
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 8000}"


class GrpcUser(TritonUser):
    protocol = "grpc"
    client_module = grpcclient
    output_options = {}
    infer_options = {"client_timeout": REQUEST_TIMEOUT_S}

    def make_client(self, options):
        url = options.grpc_url or f"{http_address(self.host).rsplit(':', 1)[0]}:8001"
        return grpcclient.InferenceServerClient(url)


class HttpUser(TritonUser):
    protocol = "http"
    client_module = httpclient
    output_options = {"binary_data": True}  # JSON numbers would cost more than the layer
    infer_options = {}

    def make_client(self, options):
        return httpclient.InferenceServerClient(http_address(self.host), connection_timeout=REQUEST_TIMEOUT_S,
                                                network_timeout=REQUEST_TIMEOUT_S)


# torch element types of the wire datatypes (bf16 regions hold bf16 bits, not tritonclient's float32)
_TORCH_WIRE = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}
_gpu_pools = {}


class CudaShmUser(GrpcUser):
    """gRPC with hidden_states and output in CUDA shared memory, registered once per user: a request
    copies its rows device to device into the input region (not timed, like the other users' encoding)
    and names both regions; nothing crosses the wire but the request header. Latency is the round
    trip; the output stays on the GPU, as a GPU consumer would take it, its shape checked from the
    reply."""
    protocol = "cudashm"
    device_id = int(os.environ.get("LOADTEST_CUDA_DEVICE", "0"))

    def on_start(self):
        import torch  # here, not at import: only this user needs a GPU
        import tritonclient.utils.cuda_shared_memory as cudashm
        self.cudashm, self.regions = cudashm, []
        super().on_start()
        key = (self.shape["hidden"], self.shape["wire"])
        pool = _gpu_pools.get(key)
        if pool is None or pool.shape[0] < self.pool.shape[0]:
            dtype = getattr(torch, _TORCH_WIRE[self.shape["wire"]])
            pool = torch.from_numpy(self.pool).to(f"cuda:{self.device_id}").to(dtype).contiguous()
            _gpu_pools[key] = pool
        self.gpu_pool = pool
        self.row_bytes = self.shape["hidden"] * pool.element_size()
        nbytes = self.prefill_range[1] * self.row_bytes
        tag = f"locust_{os.getpid()}_{id(self):x}"
        self.input_region, self.output_region = f"{tag}_in", f"{tag}_out"
        for name in (self.input_region, self.output_region):
            handle = cudashm.create_shared_memory_region(name, nbytes, self.device_id)
            self.regions.append((name, handle))
            self.client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), self.device_id, nbytes)
        self.handle_in = self.regions[0][1]

    def on_stop(self):
        for name, handle in reversed(self.regions):
            try:
                self.client.unregister_cuda_shared_memory(name)
            except Exception:  # Triton may still hold an output region for a moment; the server frees it
                pass
            self.cudashm.destroy_shared_memory_region(handle)
        self.regions = []
        super().on_stop()

    def prepare(self, tokens: int):
        nbytes = tokens * self.row_bytes
        self.cudashm.set_shared_memory_region_from_dlpack(self.handle_in, [self.gpu_pool[:tokens]])
        tensor = grpcclient.InferInput("hidden_states", [tokens, self.shape["hidden"]], self.shape["wire"])
        tensor.set_shared_memory(self.input_region, nbytes)
        output = grpcclient.InferRequestedOutput("output")
        output.set_shared_memory(self.output_region, nbytes)
        return [tensor], [output]

    def output_shape(self, result):
        output = result.get_output("output")
        return (None, 0) if output is None else ([int(d) for d in output.shape],
                                                 int(np.prod(output.shape)) * self.gpu_pool.element_size())


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
