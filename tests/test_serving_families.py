"""Every packed MoE family served end to end by the real tritonserver on the CPU: each family's tiny
random model (colibri.testing.families, every MoE option on) has its first MoE layer packed in fp32 as one
layer of a folder (a folder shares one request shape, so one folder, and one server start, per top-k), and
every layer is asked over HTTP/JSON and gRPC, naming it, with the server's own router; the answers must
match the family's transformers MoE block within 1e-5.

A packed layer of real MoE families, served end to end on its own: tiny random DeepSeek-V3 and Qwen2-MoE models
written by transformers (colibri.testing.families, every MoE option on), one MoE layer packed in fp32,
and a DeepSeek-V3 whose experts are stored as its fp8 release stores them (e4m3 weights, 128 x 128
weight_scale_inv blocks) packed as stored; each served on the CPU by the real tritonserver (one start
per layer) and asked over HTTP/JSON and gRPC with the server's own router. The answers must match the
family's own transformers MoE block on the same tokens in fp32 (for fp8, loaded with the dequantised
weights: the CPU computes with exactly those). Needs tritonserver, torch and transformers (skipped
without them)."""
import contextlib
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from colibri.testing.server import missing_reason, serving

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri import checkpoint  # noqa: E402
from colibri.pack import block_forward, pack, routing_ties  # noqa: E402
from colibri.testing.families import FAMILIES, dequantized_block, moe_blocks, write_fp8_model, write_model  # noqa: E402
from colibri.testing.families import H as FAMILY_H  # noqa: E402

MODEL = "colibri_moe"
TOKENS = 24
LIMIT = 1e-5  # ||served - transformers|| / ||transformers||, both fp32

# What each served layer must use, so the comparison covers every option the family has
# (DeepSeek-V3's 48: two shared experts of 24 as one; its fp8 release at H = 160, F = 128: partial
# scale blocks, and two shared experts of 128 in two slices).
DEEPSEEK_V3 = dict(routing="sigmoid_bias", n_group=4, topk_group=2, group_score="top2_sum", renormalize=True,
                   routed_scaling_factor=2.5, shared_gate=False)
SERVED = {
    "deepseek_v3": dict(DEEPSEEK_V3, weight_dtype="fp32", shared_intermediate_size=48),
    "deepseek_v3 fp8": dict(DEEPSEEK_V3, weight_dtype="fp8_e4m3", scale_block_n=128, scale_block_k=128,
                            hidden_size=160, shared_intermediate_size=256),
    "qwen2_moe": dict(weight_dtype="fp32", routing="softmax_topk", renormalize=True, shared_intermediate_size=40,
                      shared_gate=True),
}


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request, tmp_path_factory):
    """(layer name, its transformers MoE block, the packed layer's path, the running Server, H)."""
    name = request.param
    family, quantised = name.split()[0], name.endswith("fp8")
    src = tmp_path_factory.mktemp(family)
    path = tmp_path_factory.mktemp("packed") / "layer.colibri.safetensors"
    if quantised:  # the published layout, packed as stored
        model, dequantised = write_fp8_model(family, src, "block", (128, 128), hidden_size=160,
                                             moe_intermediate_size=128)
        config = pack(src, path, progress=False)  # the first MoE layer
    else:
        model = write_model(family, src)
        config = pack(src, path, dtype="fp32", progress=False)
    for field, value in SERVED[name].items():
        assert getattr(config, field) == value, field
    ckpt = checkpoint.load(path)
    if family == "deepseek_v3":  # e_score_correction_bias, random: its use shows in the routing
        assert np.abs(ckpt.router_bias).min() > 0
    index, block = min(moe_blocks(model).items())
    assert ckpt.metadata["source_layer"] == f"model.layers.{index}.mlp", ckpt.metadata["source_layer"]
    if quantised:
        block = dequantized_block(family, src, index, dequantised)
    with serving(path, tmp_path_factory.mktemp("logs"), "--device", "cpu", "--dtype", "fp32") as server:
        yield name, block, path, server, config.hidden_size


def tokens(path, rng, H, count=TOKENS):
    """Random fp32 tokens whose routing is clear: at a near-tie fp32 may pick either side."""
    x = rng.standard_normal((count, H)).astype(np.float32)
    while (ties := routing_ties(path, x)).any():
        x[ties] = rng.standard_normal((int(ties.sum()), H)).astype(np.float32)
    return x


def http_infer(url, x):
    """Over HTTP with JSON bodies both ways (no binary extension)."""
    tensor = httpclient.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=False)
    output = httpclient.InferRequestedOutput("output", binary_data=False)
    # Closed at once: tritonserver's shutdown waits up to 30 s for open HTTP connections.
    with httpclient.InferenceServerClient(url) as client:
        return client.infer(MODEL, [tensor], outputs=[output]).as_numpy("output")


def grpc_infer(url, x):
    tensor = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with grpcclient.InferenceServerClient(url) as client:
        return client.infer(MODEL, [tensor]).as_numpy("output")


PROTOCOLS = {"http": (http_infer, "http_url", "400"), "grpc": (grpc_infer, "grpc_url", "StatusCode.INVALID_ARGUMENT")}


def assert_matches_block(output, block, x, what):
    expected = block_forward(block, x)
    output = np.asarray(output)
    assert output.dtype == np.float32 and output.shape == expected.shape, (output.dtype, output.shape)
    assert np.isfinite(output).all(), f"{what}: NaN or Inf in the output"
    error = np.linalg.norm(output.astype(np.float64) - expected) / np.linalg.norm(expected)
    print(f"{what}: relative error {error:.2e}")
    assert error < LIMIT, f"{what}: relative error {error:.3g} >= {LIMIT:g}"


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_served_layer_matches_the_family_block(served, protocol, rng):
    name, block, path, server, H = served
    infer, url, _ = PROTOCOLS[protocol]
    for count in (1, TOKENS):
        x = tokens(path, rng, H, count)
        assert_matches_block(infer(getattr(server, url), x), block, x, f"{name} over {protocol}, T={count}")


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_wrong_hidden_size_is_refused_then_served(served, protocol, rng):
    name, block, path, server, H = served
    infer, url, status = PROTOCOLS[protocol]
    with pytest.raises(InferenceServerException) as refused:
        infer(getattr(server, url), rng.standard_normal((3, H + 1)).astype(np.float32))
    assert refused.value.status() == status, refused.value
    assert "hidden_states" in refused.value.message(), refused.value
    x = tokens(path, rng, H)
    assert_matches_block(infer(getattr(server, url), x), block, x, f"{name} over {protocol} after a refusal")


def test_config_gives_the_packed_dims(served):
    """auto_complete_config reads the colibri-moe/2 (fp8: /3) header: the widths clients see are the layer's."""
    _, _, path, server, H = served
    config = checkpoint.read_config(path)
    metadata = json.loads(server.get(f"http://{server.http_url}/v2/models/{MODEL}"))
    assert {t["name"]: t["shape"] for t in metadata["inputs"] + metadata["outputs"]} == {
        "hidden_states": [-1, H], "topk_ids": [-1, config.top_k], "topk_weights": [-1, config.top_k],
        "layer": [-1, 1], "output": [-1, H]}


# ---- every family, as layers of folders ---------------------------------------------------------------


@pytest.fixture(scope="module")
def every_family(tmp_path_factory):
    """family -> (its layer number, its transformers MoE block, the packed layer's path, the Server of its folder)."""
    folders, layers = {}, {}
    for number, family in enumerate(sorted(FAMILIES)):
        src = tmp_path_factory.mktemp(family)
        index, block = min(moe_blocks(write_model(family, src)).items())
        staged = tmp_path_factory.mktemp(f"{family}_packed") / "layer.colibri.safetensors"
        config = pack(src, staged, dtype="fp32", progress=False)  # the first MoE layer
        folder = folders.setdefault(config.top_k, tmp_path_factory.mktemp(f"top{config.top_k}"))
        path = staged.rename(folder / f"layer{number}.colibri.safetensors")
        layers[family] = (number, block, path, config.top_k)
    with contextlib.ExitStack() as stack:
        servers = {k: stack.enter_context(serving(folder, tmp_path_factory.mktemp("logs"), "--device", "cpu",
                                                  "--dtype", "fp32"))
                   for k, folder in folders.items()}
        yield {family: (number, block, path, servers[k]) for family, (number, block, path, k) in layers.items()}


def infer_layer(protocol, url, x, number):
    """One request naming its layer: over gRPC, or HTTP with JSON bodies both ways."""
    client_module = grpcclient if protocol == "grpc" else httpclient
    tensors = []
    for name, array, datatype in (("hidden_states", x, "FP32"), ("layer", np.full((len(x), 1), number, np.int32),
                                                                   "INT32")):
        tensor = client_module.InferInput(name, list(array.shape), datatype)
        if protocol == "grpc":
            tensor.set_data_from_numpy(array)
        else:
            tensor.set_data_from_numpy(array, binary_data=False)
        tensors.append(tensor)
    with client_module.InferenceServerClient(url) as client:
        if protocol == "grpc":
            return client.infer(MODEL, tensors).as_numpy("output")
        output = httpclient.InferRequestedOutput("output", binary_data=False)
        return client.infer(MODEL, tensors, outputs=[output]).as_numpy("output")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_served_matches_its_block(every_family, family, rng):
    number, block, path, server = every_family[family]
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        for count in (1, TOKENS):
            x = tokens(path, rng, FAMILY_H, count)
            assert_matches_block(infer_layer(protocol, url, x, number), block, x,
                                 f"{family} (layer {number}) over {protocol}, T={count}")
