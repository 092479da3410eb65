"""Every layer of a model resident: weights that are a folder of layer{N}.colibri.safetensors files.
The folder's rules (colibri.model_folder), the memory check before loading (colibri.memory), model.py
grouping a batch by the requests' `layer` (fake backend, exact batches), and a real tritonserver
serving a folder of three layers, its answers compared with each layer computed alone."""
import concurrent.futures
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import colibri
from colibri import checkpoint, memory, model_folder
from colibri.serving import identity, triton_config
from colibri.testing import error_limit, fake_backend, relative_error
from colibri.testing.fake_backend import load_model, request
from colibri.testing.server import REPO_ROOT, missing_reason, serving

# Layer numbers as a model's decoder layers are (not 0..L-1), and layers that differ in E, F and dtype.
LAYERS = {0: dict(experts=8, intermediate=96, dtype="bf16", seed=11),
          2: dict(experts=4, intermediate=64, dtype="fp32", seed=12),
          5: dict(experts=6, intermediate=80, dtype="bf16", seed=13)}
H, K = 64, 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    for n, spec in LAYERS.items():
        checkpoint.write_demo(path / f"layer{n}.colibri.safetensors", top_k=K, hidden=H, **spec)
    (path / "README.txt").write_text("not a layer: ignored")
    return path


@pytest.fixture(scope="module")
def alone(folder):
    """Each layer as MoELayer.from_file loads it on its own."""
    return {n: colibri.MoELayer.from_file(folder / f"layer{n}.colibri.safetensors") for n in LAYERS}


def layer_input(n, tokens):
    return np.full((tokens, 1), n, np.int32)


# ---- the folder's rules -----------------------------------------------------------------------------


def test_a_folder_serves_its_layers_by_the_number_in_their_names(folder):
    served = model_folder.read(folder)
    assert served.is_folder and served.numbers == [0, 2, 5]
    assert served.describe_numbers() == "layers 0, 2, 5"
    assert [c.num_experts for c in served.configs.values()] == [8, 4, 6]
    single = model_folder.read(folder / "layer2.colibri.safetensors")
    assert not single.is_folder and single.numbers == [] and single.config.num_experts == 4


def test_a_folder_of_layers_that_disagree_is_refused_naming_the_files(tmp_path):
    checkpoint.write_demo(tmp_path / "layer1.colibri.safetensors", hidden=64, intermediate=96)
    checkpoint.write_demo(tmp_path / "layer3.colibri.safetensors", hidden=64, intermediate=96, top_k=3)
    with pytest.raises(colibri.ColibriError, match=r"one top_k .*layer1.colibri.safetensors has 2, "
                                                   r"layer3.colibri.safetensors has 3$"):
        model_folder.read(tmp_path)
    checkpoint.write_demo(tmp_path / "layer3.colibri.safetensors", hidden=32, intermediate=96)
    with pytest.raises(colibri.ColibriError, match="one hidden size"):
        model_folder.read(tmp_path)
    (tmp_path / "layer3.colibri.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(colibri.ColibriError, match=r"layer3.colibri.safetensors: "):
        model_folder.read(tmp_path)


def test_a_folder_without_layer_files_is_refused(tmp_path):
    (tmp_path / "weights.colibri.safetensors").write_bytes(b"")
    with pytest.raises(colibri.ColibriError, match=r"no layer\{N\}.colibri.safetensors files .*--layer all"):
        model_folder.read(tmp_path)


def test_a_folders_identity_is_its_sha256sum_listing(folder):
    ident = identity.of(folder)
    assert [p.path for p in ident.files] == [str(folder / f"layer{n}.colibri.safetensors") for n in LAYERS]
    assert ident.size == sum(p.size for p in ident.files) and ident.demo
    listing = subprocess.run("LC_ALL=C sha256sum layer*.colibri.safetensors | sha256sum", shell=True, cwd=folder,
                             capture_output=True, text=True, check=True).stdout.split()[0]
    assert ident.sha256 == listing
    assert triton_config.identity_parameters(ident)["COLIBRI_LAYERS"] == "0,2,5"
    assert "3 layer files" in ident.describe()


def test_memory_needed_counts_what_stays_on_each_device(folder):
    served = model_folder.read(folder)
    configs, sizes = list(served.configs.values()), [p.stat().st_size for p in served.files.values()]
    experts = sum(c.num_experts * c.expert_numel * {"bf16": 2, "fp32": 4}[c.weight_dtype] for c in configs)
    gpu = memory.needed(configs, sizes, "cuda")
    assert gpu > experts and memory.needed(configs, sizes, "cuda", instances=2) == 2 * gpu
    cpu = memory.needed(configs, sizes, "cpu")  # the files once, a workspace per instance
    assert cpu > sum(sizes) and memory.needed(configs, sizes, "cpu", 2) - cpu == cpu - sum(sizes)
    with pytest.raises(colibri.ColibriError, match=r"X does not fit on GPU 0: needs 0.00 GiB \(100 bytes\), "
                                                   r"0.00 GiB \(99 bytes\) available$"):
        memory.check(100, 99, "GPU 0", "X")


# ---- model.py grouping a batch by layer (fake backend) ----------------------------------------------


def test_a_mixed_batch_is_grouped_one_forward_per_layer(folder, alone, monkeypatch, rng):
    model = load_model(monkeypatch, folder)
    assert sorted(model.layers) == [0, 2, 5]
    forwards = []
    for n, layer in model.layers.items():
        forward = layer.forward
        monkeypatch.setattr(layer, "forward", lambda x, *rest, n=n, f=forward: forwards.append(n) or f(x, *rest))
    numbers = [int(n) for n in rng.choice(list(LAYERS), 12)]
    inputs = [rng.standard_normal((int(rng.integers(1, 6)), H)).astype(np.float32) for _ in numbers]
    responses = model.execute([request(hidden_states=x, layer=layer_input(n, len(x))) for n, x in zip(numbers, inputs)])
    for n, x, response in zip(numbers, inputs, responses):
        assert response.error is None, response.error.message
        np.testing.assert_array_equal(fake_backend_output(response), np.asarray(alone[n].forward(x)))
    assert sorted(forwards) == sorted(set(numbers))  # one forward per layer named


def fake_backend_output(response):
    out = response.output_tensors[0].array
    return out.numpy() if isinstance(out, colibri.Tensor) else np.asarray(out)


BAD_LAYERS = {"not served": (layer_input(3, 2), "layer: 3 is not served; this server serves layers 0, 2, 5"),
              "negative": (layer_input(-1, 2), "layer: -1 is not served; this server serves layers 0, 2, 5"),
              "two in one request": (np.array([[0], [2]], np.int32), "layer: one layer per request, got 0, 2; "),
              "missing": (None, "layer: required: this server serves layers 0, 2, 5")}


@pytest.mark.parametrize("case", sorted(BAD_LAYERS))
def test_a_bad_layer_is_refused_alone_naming_it(folder, alone, monkeypatch, rng, case):
    model = load_model(monkeypatch, folder, parameters={"COLIBRI_WARMUP": "no"})
    value, message = BAD_LAYERS[case]
    x = rng.standard_normal((2, H)).astype(np.float32)
    bad = request(hidden_states=x) if value is None else request(hidden_states=x, layer=value)
    responses = model.execute([request(hidden_states=x, layer=layer_input(5, 2)), bad,
                               request(hidden_states=x, layer=layer_input(0, 2))])
    assert responses[1].error.code == "INVALID_ARG" and responses[1].error.message.startswith(message)
    for n, response in ((5, responses[0]), (0, responses[2])):
        np.testing.assert_array_equal(fake_backend_output(response), np.asarray(alone[n].forward(x)))


def test_a_single_file_refuses_a_layer_and_serves_without(folder, alone, monkeypatch, rng):
    model = load_model(monkeypatch, folder / "layer2.colibri.safetensors", parameters={"COLIBRI_WARMUP": "no"})
    x = rng.standard_normal((3, H)).astype(np.float32)
    refused, answered = model.execute([request(hidden_states=x, layer=layer_input(2, 3)), request(hidden_states=x)])
    assert refused.error.message == ("layer: this server serves one layer (its weights are one checkpoint file); "
                                     "send no layer")
    np.testing.assert_array_equal(fake_backend_output(answered), np.asarray(alone[2].forward(x)))


def test_metrics_carry_the_layer(folder, alone, monkeypatch, rng):
    model = load_model(monkeypatch, folder, parameters={"COLIBRI_METRICS_INTERVAL_S": "0", "COLIBRI_WARMUP": "no"})
    x = rng.standard_normal((4, H)).astype(np.float32)
    model.execute([request(hidden_states=x, layer=layer_input(2, 4)), request(hidden_states=x[:1], layer=layer_input(5, 1))])
    tokens = fake_backend.MetricFamily.families["colibri_expert_tokens_total"].metrics
    by_layer = {}
    for labels, calls in tokens.items():
        labels = dict(labels)
        by_layer.setdefault(labels["layer"], 0)
        by_layer[labels["layer"]] += sum(calls)
    assert by_layer == {"0": 0, "2": 4 * K, "5": 1 * K}
    seconds = fake_backend.MetricFamily.families["colibri_forward_seconds"].metrics
    assert {dict(labels)["layer"]: len(calls) for labels, calls in seconds.items()} == {"0": 0, "2": 1, "5": 1}


def test_model_py_refuses_layers_that_do_not_fit(folder, monkeypatch):
    monkeypatch.setenv(memory.AVAILABLE_OVERRIDE, "1000")
    with pytest.raises(colibri.ColibriError, match=r" \(layers 0, 2, 5\) does not fit on the host .*: needs "
                                                   r".* 0.00 GiB \(1000 bytes\) available$"):
        load_model(monkeypatch, folder)


# ---- the launcher -----------------------------------------------------------------------------------


def test_serve_refuses_a_folder_that_does_not_fit_in_one_line(folder):
    env = {**os.environ, memory.AVAILABLE_OVERRIDE: "1000000"}
    result = subprocess.run([sys.executable, "-m", "colibri", "serve", "--weights", str(folder), "--device", "cpu",
                             "--probe-interval", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"colibri serve: --weights {folder} (layers 0, 2, 5, 1 instance) "
                                                   "does not fit on the host"), result.stderr
    assert lines[0].endswith("(1000000 bytes) available"), lines


def test_serve_refuses_a_folder_whose_layers_disagree_in_one_line(tmp_path):
    checkpoint.write_demo(tmp_path / "layer1.colibri.safetensors", hidden=64, intermediate=96)
    checkpoint.write_demo(tmp_path / "layer2.colibri.safetensors", hidden=32, intermediate=96)
    result = subprocess.run([sys.executable, "-m", "colibri", "serve", "--weights", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "one hidden size" in result.stderr and "layer2.colibri.safetensors has 32" in result.stderr


# ---- a real tritonserver serving the folder ---------------------------------------------------------

needs_server = pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    with serving(folder, tmp_path_factory.mktemp("logs")) as running:
        yield running


def infer(url, x, n=None, protocol="grpc"):
    """One request; n: the layer (None: no `layer` input)."""
    if protocol == "grpc":
        import tritonclient.grpc as client_module
    else:
        import tritonclient.http as client_module
    tensors = []
    for name, array, datatype in [("hidden_states", x, "FP32")] + ([] if n is None else
                                                                    [("layer", layer_input(n, len(x)), "INT32")]):
        tensor = client_module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    with client_module.InferenceServerClient(url) as client:
        return client.infer("colibri_moe", tensors).as_numpy("output")


def assert_layer_answer(output, alone, n, x):
    expected = np.asarray(alone[n].forward(x)).astype(np.float64)
    assert relative_error(output, expected) <= error_limit("fp32"), n


@needs_server
def test_each_served_layer_answers_as_alone(server, alone, rng):
    for n in LAYERS:
        for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
            x = rng.standard_normal((int(rng.integers(1, 9)), H)).astype(np.float32)
            assert_layer_answer(infer(url, x, n, protocol), alone, n, x)
    config = json.loads(server.get(f"http://{server.http_url}/v2/models/colibri_moe/config"))
    assert config["parameters"]["COLIBRI_LAYERS"]["string_value"] == "0,2,5"
    assert {t["name"]: t["dims"] for t in config["input"]}["layer"] == [1]


@needs_server
def test_concurrent_requests_of_mixed_layers_are_batched_by_layer(server, alone, rng):
    sends = [(int(n), rng.standard_normal((int(rng.integers(1, 6)), H)).astype(np.float32))
             for n in rng.choice(list(LAYERS), 24)]
    executions_before, _ = server.model_stats()
    start = threading.Barrier(len(sends))

    def send(item):
        start.wait()
        return infer(server.grpc_url, item[1], item[0])

    with concurrent.futures.ThreadPoolExecutor(len(sends)) as pool:
        outputs = list(pool.map(send, sends))
    executions_after, _ = server.model_stats()
    for (n, x), output in zip(sends, outputs):
        assert_layer_answer(output, alone, n, x)
    assert executions_after - executions_before < len(sends), "no two requests were batched together"
    metrics = server.get(server.metrics_url)
    for n in LAYERS:
        assert f'colibri_forward_seconds_count{{layer="{n}",model="colibri_moe",version="1"}}' in metrics


@needs_server
@pytest.mark.parametrize("protocol, status", [("http", "400"), ("grpc", "StatusCode.INVALID_ARGUMENT")])
def test_a_bad_layer_gets_invalid_argument_and_the_next_request_is_right(server, alone, rng, protocol, status):
    from tritonclient.utils import InferenceServerException
    url = server.grpc_url if protocol == "grpc" else server.http_url
    x = rng.standard_normal((3, H)).astype(np.float32)
    for bad, named in ((7, "layer: 7 is not served; this server serves layers 0, 2, 5"),
                       (None, "layer: required: this server serves layers 0, 2, 5")):
        with pytest.raises(InferenceServerException) as refused:
            infer(url, x, bad, protocol)
        assert refused.value.status() == status and named in refused.value.message(), refused.value
        assert_layer_answer(infer(url, x, 2, protocol), alone, 2, x)


@needs_server
def test_the_probe_and_the_clients_name_a_layer(server, folder, rng):
    probe = subprocess.run([sys.executable, "-m", "colibri", "probe", "--url", f"http://{server.http_url}"],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    for client, url in (("grpc_client.py", server.grpc_url), ("http_client.py", server.http_url)):
        result = subprocess.run([sys.executable, str(REPO_ROOT / "client" / client), "--url", url, "--weights",
                                 str(folder), "--layer", "5", "--tokens", "3"], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "PASS", result.stdout + result.stderr


@needs_server
def test_the_load_test_names_a_layer(server, tmp_path):
    """LOADTEST_LAYER (the locustfile's --layer) makes every request name it: without it, each would be
    refused by a server of a folder of layers."""
    out = tmp_path / "loadtest"
    env = {**os.environ, "LOADTEST_LAYER": "5"}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "loadtest" / "run.py"), "--host", f"http://{server.http_url}", "--grpc-url",
         server.grpc_url, "--mix", "decode:1,prefill:1", "--prefill-tokens", "2-8", "--users", "2", "--time", "4s",
         "--out", str(out)], capture_output=True, text=True, timeout=55, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    total = json.loads((out / "summary.json").read_text())["total"]
    assert total["requests"] > 0 and total["failures"] == 0, total
