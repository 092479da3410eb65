"""End-to-end serving: a real tritonserver (from the nvidia-pytriton wheel) serving colibri_moe on the
CPU, reached over HTTP, gRPC and system shared memory, checked against the float64 reference."""
import concurrent.futures
import hashlib
import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import colibri
from colibri import reference
from colibri.serving import identity, launcher
from colibri.testing import error_limit
from colibri.testing import load_script
from colibri.testing.server import REPO_ROOT, missing_reason, serving

common = load_script(REPO_ROOT / "client" / "common.py")  # the clients' reference check, shared

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")

MODEL = common.MODEL
TOKENS = 3


@pytest.fixture(scope="module")
def weights(serving_weights):
    return serving_weights


@pytest.fixture(scope="module")
def layer(weights):
    return common.Layer(weights)


@pytest.fixture(scope="module")
def server(colibri_server):
    return colibri_server  # one server for the session (conftest.py), shared with test_loadtest.py


def grpc_infer(url, inputs):
    tensors = []
    for name, array, datatype in inputs:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    # closed at once: tritonserver's shutdown waits (up to 30 s) for open client connections
    with grpcclient.InferenceServerClient(url) as client:
        return client.infer(MODEL, tensors).as_numpy("output")


def http_infer(url, inputs):
    tensors = []
    for name, array, datatype in inputs:
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)  # binary: JSON cannot carry NaN or Inf
        tensors.append(tensor)
    with httpclient.InferenceServerClient(url) as client:
        return client.infer(MODEL, tensors).as_numpy("output")


def good_request(layer, rng, tokens=TOKENS, explicit=True):
    x = layer.hidden_states(tokens, rng, "fp32")
    if not explicit:
        return [("hidden_states", x, "FP32")], layer.expected(x)
    ids, weights = layer.routing(tokens, rng)
    return ([("hidden_states", x, "FP32"), ("topk_ids", ids, "INT32"), ("topk_weights", weights, "FP32")],
            layer.expected(x, ids, weights))


def assert_close(output, expected):
    assert common.relative_error(output, expected) <= error_limit("fp32")


def model_stats(server):
    return server.model_stats(MODEL)


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("client, url", [("grpc_client.py", "grpc_url"), ("http_client.py", "http_url"),
                                         ("shm_client.py", "grpc_url")])
def test_client_passes(server, weights, client, url, rng):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "client" / client), "--url", getattr(server, url), "--weights",
         str(weights), "--tokens", str(int(rng.integers(1, 33))), "--seed", str(int(rng.integers(2**31)))],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "PASS" and sum(line.startswith("PASS ") for line in lines) == 2, result.stdout


def test_concurrent_requests_are_batched_and_equal_single_requests(server, layer, rng):
    requests = [good_request(layer, rng, int(rng.integers(1, 9)), explicit=bool(i % 2)) for i in range(24)]
    alone = [grpc_infer(server.grpc_url, inputs) for inputs, _ in requests]
    for output, (_, expected) in zip(alone, requests):
        assert_close(output, expected)

    executions_before, inferences_before = model_stats(server)
    start = threading.Barrier(len(requests))

    def send(inputs):
        start.wait()
        return grpc_infer(server.grpc_url, inputs)

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(send, [inputs for inputs, _ in requests]))
    executions_after, inferences_after = model_stats(server)

    for n, (batched, single) in enumerate(zip(together, alone)):
        # Each token's output depends on that token alone; batching may only change the rounding.
        error = common.relative_error(batched, single.astype(np.float64))
        assert error <= 1e-5, (f"request {n} ({[a.shape for _, a, _ in requests[n][0]]}): batched output "
                               f"{batched.shape} differs from the single one by {error:.2e}")
    assert inferences_after - inferences_before == sum(inputs[0][1].shape[0] for inputs, _ in requests)
    assert executions_after - executions_before < len(requests), "no two requests were batched together"


def bad_requests(layer, rng):
    """name -> (inputs, the input the error must name)."""
    E, k, H, T = layer.config.num_experts, layer.config.top_k, layer.config.hidden_size, TOKENS
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, weights = layer.routing(T, rng)

    def with_routing(ids=ids, weights=weights, ids_type="INT32"):
        return [("hidden_states", x, "FP32"), ("topk_ids", ids, ids_type), ("topk_weights", weights, "FP32")]

    def replaced(array, row, col, value):
        array = array.copy()
        array[row, col] = value
        return array

    return {
        "wrong hidden size": ([("hidden_states", rng.standard_normal((T, H + 1)).astype(np.float32), "FP32")],
                              "hidden_states"),
        "no tokens": ([("hidden_states", np.zeros((0, H), np.float32), "FP32")], "hidden_states"),
        "hidden_states fp64": ([("hidden_states", x.astype(np.float64), "FP64")], "hidden_states"),
        "expert id too large": (with_routing(ids=replaced(ids, 1, 0, E)), "topk_ids"),
        "negative expert id": (with_routing(ids=replaced(ids, 2, 1, -1)), "topk_ids"),
        # Triton checks each input's width against the dims auto-completed from the checkpoint; with
        # both too wide it names whichever it checks first, so each is made wrong alone.
        "topk_ids k mismatch": (with_routing(ids=np.argsort(rng.random((T, E)), axis=1)[:, :k + 1].astype(np.int32)),
                                "topk_ids"),
        "topk_weights k mismatch": (with_routing(weights=np.full((T, k + 1), 0.5, np.float32)), "topk_weights"),
        # Triton compares the inputs' batch sizes itself and names the first input.
        "token count mismatch": (with_routing(ids=ids[:T - 1], weights=weights[:T - 1]), "hidden_states"),
        "NaN hidden state": ([("hidden_states", replaced(x, 2, 5, np.nan), "FP32")], "hidden_states: not finite at row 2"),
        "infinite hidden state": ([("hidden_states", replaced(x, 1, 0, -np.inf), "FP32")] + with_routing()[1:],
                                  "hidden_states: not finite at row 1"),
        "NaN weight": (with_routing(weights=replaced(weights, 0, 1, np.nan)), "topk_weights"),
        "infinite weight": (with_routing(weights=replaced(weights, 1, 0, np.inf)), "topk_weights"),
        "topk_weights missing": (with_routing()[:2], "topk_weights"),
        "topk_ids missing": ([with_routing()[0], with_routing()[2]], "topk_ids"),
        "topk_ids int64": (with_routing(ids=ids.astype(np.int64), ids_type="INT64"), "topk_ids"),
        # Triton checks only the number of inputs (1 to 3), so the model says which one is missing.
        "hidden_states missing": (with_routing()[1:], "hidden_states: required"),
    }


BAD_REQUEST_NAMES = ["wrong hidden size", "no tokens", "hidden_states fp64", "expert id too large",
                     "negative expert id", "NaN hidden state", "infinite hidden state", "topk_ids k mismatch",
                     "topk_weights k mismatch", "token count mismatch", "NaN weight", "infinite weight",
                     "topk_weights missing", "topk_ids missing", "topk_ids int64", "hidden_states missing"]
PROTOCOLS = {"http": (http_infer, "http_url", "400"), "grpc": (grpc_infer, "grpc_url", "StatusCode.INVALID_ARGUMENT")}


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("case", BAD_REQUEST_NAMES)
def test_bad_input_is_refused_naming_it(server, layer, rng, case, protocol):
    infer, url, status = PROTOCOLS[protocol]
    inputs, named = bad_requests(layer, rng)[case]
    with pytest.raises(InferenceServerException) as refused:
        infer(getattr(server, url), inputs)
    assert refused.value.status() == status, refused.value
    assert named in refused.value.message(), refused.value
    good_inputs, expected = good_request(layer, rng)
    assert_close(infer(getattr(server, url), good_inputs), expected)


def test_bad_request_batched_with_good_ones_fails_alone(server, layer, rng):
    requests = [good_request(layer, rng) for _ in range(15)]
    bad_inputs, _ = bad_requests(layer, rng)["expert id too large"]
    sends = [inputs for inputs, _ in requests] + [bad_inputs]
    executions_before, _ = model_stats(server)
    start = threading.Barrier(len(sends))

    def send(inputs):
        start.wait()
        try:
            return grpc_infer(server.grpc_url, inputs)
        except InferenceServerException as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(sends)) as pool:
        results = list(pool.map(send, sends))
    executions_after, _ = model_stats(server)
    for output, (_, expected) in zip(results, requests):
        assert not isinstance(output, Exception), output
        assert_close(output, expected)
    refused = results[-1]
    assert isinstance(refused, InferenceServerException)
    assert refused.status() == "StatusCode.INVALID_ARGUMENT" and "topk_ids" in refused.message()
    assert executions_after - executions_before < len(sends), "the requests were never batched together"


def expert_metrics(server):
    """colibri_expert_tokens_total per expert id, and colibri_forward_seconds' count."""
    text = server.get(server.metrics_url)
    tokens = {int(e): float(v) for e, v in re.findall(
        r'^colibri_expert_tokens_total\{[^}]*expert="(\d+)"[^}]*\} (\S+)$', text, re.M)}
    forwards = re.search(r"^colibri_forward_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    return tokens, float(forwards.group(1)) if forwards else 0.0


def test_metrics_count_tokens_per_expert(server, layer, rng):
    """The counters go out with the first batch after each COLIBRI_METRICS_INTERVAL_S (1 s here):
    one request after a pause flushes what earlier tests left, then two requests and, after another
    pause, a third that flushes all three."""
    E = layer.config.num_experts
    flush = good_request(layer, rng, tokens=1)[0]
    time.sleep(1.1)
    grpc_infer(server.grpc_url, flush)
    before, forwards_before = expert_metrics(server)
    assert sorted(before) == list(range(E))
    expected = np.zeros(E, np.int64)
    explicit, _ = good_request(layer, rng, tokens=5)
    grpc_infer(server.grpc_url, explicit)
    expected += np.bincount(explicit[1][1].ravel(), minlength=E)
    routed, _ = good_request(layer, rng, tokens=6, explicit=False)
    grpc_infer(server.grpc_url, routed)
    ids, _, _ = reference.route(layer.config, routed[0][1], layer.router, layer.router_bias)
    expected += np.bincount(ids.ravel(), minlength=E)
    time.sleep(1.1)
    last, _ = good_request(layer, rng, tokens=3)
    grpc_infer(server.grpc_url, last)
    expected += np.bincount(last[1][1].ravel(), minlength=E)

    after, forwards_after = expert_metrics(server)
    assert [after[e] - before[e] for e in range(E)] == expected.tolist()
    assert forwards_after - forwards_before == 3


def test_auto_instance_kind_follows_the_host(server):
    config = json.loads(server.get(f"http://{server.http_url}/v2/models/{MODEL}/config"))
    expected = "KIND_GPU" if colibri.cuda_device_count() > 0 else "KIND_CPU"
    assert [group["kind"] for group in config["instance_group"]] == [expected]


def test_launcher_rewrites_instance_kind_and_activation_dtype():
    text = (REPO_ROOT / "model_repository" / MODEL / "config.pbtxt").read_text()
    rewritten = launcher.configure_model(text, "gpu", "bf16")
    assert re.findall(r"kind:\s*(KIND_\w+)", rewritten) == ["KIND_GPU"]
    types = dict(re.findall(r'name:\s*"(\w+)"\s*data_type:\s*(TYPE_\w+)', rewritten))
    assert types == {"hidden_states": "TYPE_BF16", "topk_ids": "TYPE_INT32", "topk_weights": "TYPE_FP32",
                     "layer": "TYPE_INT32", "output": "TYPE_BF16"}


def test_metadata_and_config_give_the_checkpoints_dims(server, layer):
    """config.pbtxt declares no dims; model.py's auto_complete_config fills them in from the checkpoint."""
    c = layer.config
    expected = {"hidden_states": [-1, c.hidden_size], "topk_ids": [-1, c.top_k], "topk_weights": [-1, c.top_k],
                "layer": [-1, 1], "output": [-1, c.hidden_size]}
    metadata = json.loads(server.get(f"http://{server.http_url}/v2/models/{MODEL}"))
    assert {t["name"]: t["shape"] for t in metadata["inputs"] + metadata["outputs"]} == expected
    grpc_config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config(MODEL, as_json=True)["config"]
    assert {t["name"]: [-1] + [int(d) for d in t["dims"]] for t in grpc_config["input"] + grpc_config["output"]} \
        == expected


def test_ready_line_says_what_a_request_sends(server, layer):
    """A request of another width gets Triton's own refusal, whose note advises max_batch_size 0 (not
    the fix); the launcher's ready line says what is: hidden_states [T, H] with the served H."""
    H = layer.config.hidden_size
    assert (f"  input   hidden_states [T, {H}] FP32 (H = {H}, the checkpoint's hidden size; T up to 4096 tokens)\n"
            in server.log_path.read_text()), server.log_tail()
    assert launcher.request_shape({"input": [{"name": "topk_ids", "dims": [2]}]}) is None


def test_config_and_log_name_the_checkpoint_served(server, weights):
    """GET .../config tells what is served: the launcher writes the checkpoint's identity into the config
    Triton reads (auto-complete cannot add parameters: tritonserver drops them), and model.py logs it."""
    config = json.loads(server.get(f"http://{server.http_url}/v2/models/{MODEL}/config"))
    named = {key: value["string_value"] for key, value in config["parameters"].items()
             if key.startswith("COLIBRI_CHECKPOINT_")}
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert named == {"COLIBRI_CHECKPOINT_FILE": str(weights.resolve()),
                     "COLIBRI_CHECKPOINT_BYTES": str(weights.stat().st_size),
                     "COLIBRI_CHECKPOINT_MODIFIED": identity.utc(weights.stat().st_mtime_ns),
                     "COLIBRI_CHECKPOINT_SHA256": digest, "COLIBRI_CHECKPOINT_DEMO": "yes",
                     "COLIBRI_CHECKPOINT_SOURCE": "colibri demo (seed 7)"}
    logged = [line for line in server.log_path.read_text().splitlines() if f"sha256 {digest}" in line]
    assert logged and all(line.endswith("DEMO checkpoint (random weights)\"") for line in logged), logged


def test_second_launch_on_a_taken_port_fails_naming_it(server, weights):
    http_port = int(server.http_url.rsplit(":", 1)[1])
    grpc_port, metrics_port = launcher.free_ports(2)
    second = subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--weights", str(weights), "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode != 0, second.stdout + second.stderr
    assert f"HTTP port {http_port}" in second.stderr and "ready" not in second.stdout, second.stdout + second.stderr
    assert server.get(f"http://{server.http_url}/v2/health/ready") == ""  # the first one is untouched


def test_readiness_wait_refuses_a_server_that_is_not_ours(server):
    """The launcher's readiness wait accepts only the server reporting its --id: here a live process
    stands in for our tritonserver while the session's server, with another id, answers the port."""
    ready_url = f"http://{server.http_url}/v2/health/ready"
    session_id = json.loads(server.get(f"http://{server.http_url}/v2"))["name"]
    assert session_id.startswith("colibri-"), session_id
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        launcher.wait_until_ready(stand_in, ready_url, 10, server_id=session_id)
        with pytest.raises(launcher.ServeError, match=f"another server .*{server.http_url}.*--http-port"):
            launcher.wait_until_ready(stand_in, ready_url, 10, server_id="colibri-someone-else")
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_server_on_the_cpu(weights, tmp_path_factory, dtype):
    with serving(weights, tmp_path_factory.mktemp("logs"), "--device", "cpu", "--dtype", dtype) as half:
        results = [subprocess.run(
            [sys.executable, str(REPO_ROOT / "client" / client), "--url", half.grpc_url, "--weights", str(weights),
             "--dtype", dtype, "--tokens", "9"], capture_output=True, text=True, timeout=120)
            for client in ("grpc_client.py", "shm_client.py")]
        config = json.loads(half.get(f"http://{half.http_url}/v2/models/{MODEL}/config"))
    for result in results:
        assert result.returncode == 0 and result.stdout.strip().endswith("PASS"), result.stdout + result.stderr
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["input"][0]["data_type"] == f"TYPE_{dtype.upper()}"
    # The dtype rewrite and the auto-completed dims live together.
    assert config["input"][0]["dims"] == [common.Layer(weights).config.hidden_size]


def test_cuda_pool_option_per_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert launcher.cuda_pool_options(1024) == ["--cuda-memory-pool-byte-size=0:1073741824",
                                             "--cuda-memory-pool-byte-size=1:1073741824"]
    assert launcher.cuda_pool_options(0) == []  # Triton's own default
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert launcher.cuda_pool_options(64) == ["--cuda-memory-pool-byte-size=0:67108864"]  # harmless without GPU


def test_compare_reads_what_the_server_did_from_its_statistics(server, layer, rng):
    """bench/serving/compare.py's per-run server figures, against this real tritonserver."""
    compare = load_script(REPO_ROOT / "bench" / "serving" / "compare.py")
    host = f"http://{server.http_url}"
    before = compare.model_stats(host, MODEL, server.metrics_url)
    for tokens in (3, 5):
        inputs, expected = good_request(layer, rng, tokens)
        assert_close(grpc_infer(server.grpc_url, inputs), expected)
    # A backend reports a request's statistics after it has sent the response (then releases the
    # request), so the client can hold both answers before the second is counted: one run read 1
    # request of 2 right after. Wait for the count (at most 10 s).
    deadline = time.monotonic() + 10
    while True:
        side = compare.server_side(before, compare.model_stats(host, MODEL, server.metrics_url))
        if side["requests"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert side["requests"] == 2 and 1 <= side["executions"] <= 2, side
    assert side["requests_per_execution"] == pytest.approx(2 / side["executions"])
    assert side["compute_infer_ms"] > 0 and all(side[f"{s}_ms"] >= 0 for s in compare.STAGES), side
    # colibri_forward_seconds: one observation per execution, within that execution's compute_infer
    # (compute_infer_ms is per request, so a request's batch time; the forward span is part of it).
    assert 0 < side["forward_ms_per_execution"] <= side["compute_infer_ms"] * side["requests_per_execution"], side
    assert compare.server_side(before, before)["forward_ms_per_execution"] is None
    assert "inside tritonserver" in compare.server_table([{"run": "r", "model": MODEL, **side}])


def test_launcher_sets_the_instance_count():
    text = (REPO_ROOT / "model_repository" / MODEL / "config.pbtxt").read_text()
    assert re.findall(r"count:\s*(\d+)", launcher.configure_model(text, "gpu", "fp32", 3)) == ["3"]
    assert launcher.parse_args(["--instances", "2"]).instances == 2
    with pytest.raises(SystemExit):
        launcher.parse_args(["--instances", "0"])
