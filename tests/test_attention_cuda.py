"""The attention tier on a GPU: the drop-in ColibriBlock captured in a torch CUDA graph (its forward
enqueues the layer on torch's current stream with no host synchronisation and allocates only its output,
from torch) and replayed on fresh inputs, bitwise equal to eager calls and close to the family's own
block; greedy generation on the GPU in fp32, in-process (the Python API and the CLI) and, where a
tritonserver is installed, over CUDA shared memory and gRPC, giving exactly transformers' own tokens on
the same GPU. Skipped, with the reason, without a GPU, the CUDA backend, torch or transformers."""
import json
import types

import numpy as np
import pytest

import colibri

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.attention import AttentionTier, ColibriBlock, expert_tier  # noqa: E402
from colibri.pack import pack  # noqa: E402
from colibri.testing import error_limit  # noqa: E402
from colibri.testing.families import write_model  # noqa: E402
from colibri.testing.server import missing_reason, serving  # noqa: E402
from colibri.testing.generation import MIN_MARGIN, NEW_TOKENS  # noqa: E402

gpu = colibri.cuda_built() and colibri.cuda_device_count() > 0 and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not gpu, reason="needs the CUDA backend built, a CUDA device and torch with CUDA")

FAMILY, FIELDS, MOE_LAYERS = "qwen3_moe", dict(num_hidden_layers=4), [1, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen3-MoE written by save_pretrained, its MoE layers packed in fp32 and in bf16."""
    hf_dir = tmp_path_factory.mktemp(FAMILY)
    write_model(FAMILY, hf_dir, **FIELDS)
    packed = {dtype: tmp_path_factory.mktemp(f"packed_{dtype}") for dtype in ("fp32", "bf16")}
    for dtype, folder in packed.items():
        pack(hf_dir, folder, layer="all", dtype=dtype, progress=False)
    return types.SimpleNamespace(hf_dir=hf_dir, packed=packed)


@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_drop_in_block_is_captured_in_a_cuda_graph_and_replayed(model, dtype, tokens, rng):
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model.hf_dir).eval()
    n = MOE_LAYERS[-1]
    own = reference.model.layers[n].mlp
    block = ColibriBlock.from_file(model.packed[dtype] / f"layer{n}.colibri.safetensors", device="cuda",
                                   family=FAMILY)
    H = reference.config.hidden_size
    static_x = torch.zeros((1, tokens, H), dtype=torch_dtype, device="cuda")
    with torch.no_grad():
        block(static_x)  # the first call's one-time work, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = block(static_x)
        for _ in range(3):
            fresh = torch.from_numpy(rng.standard_normal((1, tokens, H)).astype(np.float32))
            static_x.copy_(fresh.to(device="cuda", dtype=torch_dtype))
            static_out.fill_(float("nan"))
            graph.replay()
            eager = block(static_x)
            torch.cuda.synchronize()
            assert static_out.shape == (1, tokens, H) and static_out.dtype == torch_dtype
            assert torch.isfinite(static_out.float()).all()
            assert torch.equal(static_out, eager), "a replay differs from an eager forward"
            expected = own(static_x.float().cpu()).double()
            error = float((static_out.double().cpu() - expected).abs().max() / expected.abs().max())
            assert error <= error_limit(dtype), error


def gpu_reference(model_dir, rng, prompts=3):
    """transformers' fp32 model on the GPU, and prompts whose greedy tokens have a clear top logit at every
    step, with those tokens."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to("cuda").eval()
    found = []
    while len(found) < prompts:
        prompt = [int(i) for i in rng.integers(0, reference.config.vocab_size, int(rng.integers(2, 40)))]
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")  # the mask: else ids equal to pad_token_id are padding
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, eos_token_id=None, output_scores=True,
                                     return_dict_in_generate=True)
        tops = [torch.topk(s[0].double(), 2).values for s in out.scores]
        if min(float((t[0] - t[1]) / max(1.0, abs(float(t[0])))) for t in tops) > MIN_MARGIN:
            found.append((prompt, out.sequences[0, len(prompt):].tolist()))
    return reference, found


def test_generate_on_the_gpu_gives_transformers_tokens(model, rng, tmp_path, colibri_cli):
    reference, cases = gpu_reference(model.hf_dir, rng)
    tier = AttentionTier.from_pretrained(model.hf_dir, expert_tier("inprocess", weights=model.packed["fp32"],
                                                                   device="cuda"), device="cuda")
    assert tier.device.type == "cuda" and tier.moe_layers == MOE_LAYERS
    baseline = AttentionTier.eager(reference)
    for prompt, expected in cases:
        result = tier.generate(prompt, NEW_TOKENS)
        assert result.tokens == expected and result.ttft_s > 0 and result.tpot_s > 0
        assert baseline.generate(prompt, NEW_TOKENS).tokens == expected
    out = tmp_path / "out.json"
    prompt, expected = cases[0]
    result = colibri_cli("generate", "--model", model.hf_dir, "--protocol", "inprocess", "--weights",
                         model.packed["fp32"], "--device", "cuda", "--prompt-ids", ",".join(map(str, prompt)),
                         "--max-new-tokens", NEW_TOKENS, "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(out.read_text())["tokens"] == expected


@pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")
def test_cudashm_and_grpc_give_transformers_tokens(model, rng, tmp_path):
    _, cases = gpu_reference(model.hf_dir, rng, prompts=2)
    with serving(model.packed["fp32"], tmp_path, "--device", "gpu", "--dtype", "fp32") as server:
        for protocol in ("cudashm", "grpc"):
            experts = expert_tier(protocol, url=server.grpc_url, device="cuda")
            tier = AttentionTier.from_pretrained(model.hf_dir, experts, device="cuda")
            for prompt, expected in cases:
                assert tier.generate(prompt, NEW_TOKENS).tokens == expected, protocol
            tier.close()
