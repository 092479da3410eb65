"""gpt-oss's MXFP4 experts: pack's dequantiser against transformers' own (bit for bit in bf16, on
random blocks and scales), and a tiny random gpt-oss quantised here to MXFP4 and written with the
released checkpoints' names (`*_blocks`, `*_scales`, quantization_config mxfp4), packed with --verify
and compared with the model transformers loads from that checkpoint (Mxfp4Config(dequantize=True)).
Also the refusals: other quant_methods, MXFP4 without its config, NaN scales, values beyond bf16."""
import json

import numpy as np
import pytest

import colibri
from colibri import checkpoint
from colibri import safetensors_io as st
from colibri.dtypes import from_float, to_float32
from colibri.pack import FP4_E2M1, dequantize_mxfp4, pack
from colibri.testing.families import GAINS

H, F, E, LAYERS = 64, 32, 8, 2
# The released clamped SwiGLU (swiglu_limit 7.0, no swiglu_alpha), which every transformers computes alike
GPT_OSS = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
               num_hidden_layers=LAYERS, num_local_experts=E, num_experts_per_tok=3, intermediate_size=F,
               swiglu_limit=7.0)
MXFP4_CONFIG = {"quant_method": "mxfp4",  # as the released gpt-oss config.json says
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}


def torch_and_transformers():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def quantise_mxfp4(weight):
    """Our own MXFP4 quantiser: weight [..., rows, cols] -> blocks [..., rows, cols/32, 16] and scales
    [..., rows, cols/32] (uint8). Each block's scale puts its largest magnitude in [4, 8), then every
    value takes the nearest FP4 code (6 at most)."""
    w = np.asarray(weight, np.float64).reshape(*weight.shape[:-1], weight.shape[-1] // 32, 32)
    amax = np.abs(w).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, 0).astype(np.int64)
    exponent = np.clip(exponent, -127, 127)
    scaled = w / np.exp2(exponent)[..., None]
    magnitudes = FP4_E2M1[:8].astype(np.float64)
    codes = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(axis=-1) | np.where(scaled < 0, 8, 0)
    codes = codes.astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the even input in the low nibble
    return blocks.astype(np.uint8), (exponent + 127).astype(np.uint8)


def write_mxfp4_checkpoint(folder, model, config):
    """The model as gpt-oss is released: experts MXFP4 ([E, rows, cols] = the transposed bf16 layout),
    everything else bf16, config.json with quantization_config."""
    folder.mkdir()
    tensors = {}
    for name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantise_mxfp4(value.transpose(0, 2, 1))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = ("BF16", from_float(value, "bf16"))
    st.write(folder / "model.safetensors", tensors, {"format": "pt"})
    config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "quantization_config": MXFP4_CONFIG}))
    return folder


def test_dequantiser_matches_transformers_bit_for_bit():
    torch, _ = torch_and_transformers()
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 40, 4), dtype=np.uint8)
    scales[0, :3] = [[0, 1, 2, 126], [127, 128, 200, 252], [250, 251, 252, 252]]  # the extremes bf16 holds
    ours = from_float(dequantize_mxfp4(blocks, scales), "bf16")
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    theirs = theirs.view(torch.int16).numpy().view(np.uint16)
    assert theirs.shape == (3, 128, 40)  # transformers transposes to [E, cols, rows]
    np.testing.assert_array_equal(ours, theirs.transpose(0, 2, 1))
    # Every MXFP4 value is exact in bf16: the float32 values survive the round trip unchanged.
    exact = dequantize_mxfp4(blocks, scales)
    np.testing.assert_array_equal(to_float32(from_float(exact, "bf16"), "bf16"), exact)


def test_dequantiser_refuses_nan_scales_and_overflow():
    blocks = np.full((1, 1, 16), 0x11, np.uint8)  # every value 0.5
    assert dequantize_mxfp4(blocks, np.full((1, 1), 254, np.uint8)).max() == 2.0 ** 126
    with pytest.raises(colibri.ColibriError, match="E8M0 scale of 255"):
        dequantize_mxfp4(blocks, np.full((1, 1), 255, np.uint8))
    with pytest.raises(colibri.ColibriError, match="beyond bf16's range"):
        dequantize_mxfp4(np.full((1, 1, 16), 0x77, np.uint8), np.full((1, 1), 253, np.uint8))  # 6 * 2^126
    with pytest.raises(colibri.ColibriError, match="do not match"):
        dequantize_mxfp4(blocks, np.zeros((1, 2), np.uint8))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A tiny random gpt-oss written as MXFP4, and the model transformers loads back from it."""
    torch, transformers = torch_and_transformers()
    torch.manual_seed(5)
    config = transformers.AutoConfig.for_model("gpt_oss", **GPT_OSS)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for name, tensor in layer.mlp.named_parameters():
                tensor.normal_(0.0, 0.5 if "bias" in name else 1.0 / np.sqrt(tensor.shape[-1]))
                tensor.mul_(GAINS["gpt_oss"].get(name, 1.0))  # so the clamps at 7 bite, as in the family tests
    src = write_mxfp4_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "src", model, config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        src, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    # Older transformers dequantise MXFP4 to bf16 whatever dtype says; every MXFP4 value is exact in bf16,
    # so float() changes no value, only what the fp32 tokens can be multiplied with.
    return src, loaded.float()


def test_pack_dequantises_released_layout(released, tmp_path):
    from colibri import MoELayer
    from colibri.pack import block_forward, routing_ties
    src, loaded = released
    configs = pack(src, tmp_path / "layers", layer="all", verify=True, progress=False)
    assert len(configs) == LAYERS and all(c.weight_dtype == "bf16" and c.expert_bias for c in configs)
    errors = []
    for index, layer in enumerate(loaded.model.layers):
        path = tmp_path / "layers" / f"layer{index}.colibri.safetensors"
        ckpt = checkpoint.load(path)
        assert ckpt.metadata["source_quantization"].startswith("mxfp4, dequantised to bf16")
        assert ckpt.metadata["source_layout"] == "gpt_oss_mxfp4"
        # The packed experts are transformers' dequantised weights, value for value.
        experts = to_float32(np.asarray(ckpt.experts), "bf16").reshape(E, -1)
        gate_up = layer.mlp.experts.gate_up_proj.detach().numpy()  # [E, H, 2F], interleaved
        down = layer.mlp.experts.down_proj.detach().numpy()        # [E, F, H]
        expected = np.concatenate([gate_up[:, :, 0::2].transpose(0, 2, 1).reshape(E, -1),
                                   gate_up[:, :, 1::2].transpose(0, 2, 1).reshape(E, -1),
                                   down.transpose(0, 2, 1).reshape(E, -1)], axis=1)
        np.testing.assert_array_equal(experts, expected)
        x = np.random.default_rng(index).standard_normal((48, H)).astype(np.float32)
        keep = ~routing_ties(path, x)
        assert keep.sum() >= 40, "too many routing near-ties to compare"
        want = block_forward(layer.mlp, x)[keep]
        got = np.asarray(MoELayer.from_file(path).forward(x), np.float64)[keep]
        errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
    print(f"colibri CPU vs transformers (MXFP4 dequantised), relative error {max(errors):.3g}")
    assert max(errors) < 1e-5


def small_mxfp4(tmp_path, config_changes=None, scale=127):
    """One gpt-oss MoE layer stored as MXFP4, written with our own writer (no torch needed)."""
    rng = np.random.default_rng(1)
    base = "model.layers.0.mlp."
    tensors = {base + "router.weight": rng.standard_normal((E, H)).astype(np.float32),
               base + "router.bias": np.zeros(E, np.float32),
               base + "experts.gate_up_proj_bias": np.zeros((E, 2 * F), np.float32),
               base + "experts.down_proj_bias": np.zeros((E, H), np.float32)}
    for proj, rows, cols in (("gate_up_proj", 2 * F, H), ("down_proj", H, F)):
        tensors[base + f"experts.{proj}_blocks"] = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
        tensors[base + f"experts.{proj}_scales"] = np.full((E, rows, cols // 32), scale, np.uint8)
    config = {"model_type": "gpt_oss", **GPT_OSS, "quantization_config": MXFP4_CONFIG, **(config_changes or {})}
    folder = tmp_path / "src"
    folder.mkdir()
    st.write(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


def test_packs_without_torch_and_keeps_dtype(tmp_path):
    src = small_mxfp4(tmp_path)
    config = pack(src, tmp_path / "a.colibri.safetensors", progress=False)
    assert config.weight_dtype == "bf16" and config.intermediate_size == F
    # --dtype fp32 widens the dequantised values exactly.
    wide = pack(src, tmp_path / "b.colibri.safetensors", dtype="fp32", progress=False)
    assert wide.weight_dtype == "fp32"
    a = to_float32(np.asarray(checkpoint.load(tmp_path / "a.colibri.safetensors").experts), "bf16")
    b = np.asarray(checkpoint.load(tmp_path / "b.colibri.safetensors").experts, np.float32)
    np.testing.assert_array_equal(a.reshape(b.shape), b)


@pytest.mark.parametrize("changes, message", [
    (dict(quantization_config=None), "no quantization_config with quant_method 'mxfp4'"),
    (dict(quantization_config={"quant_method": "awq", "bits": 4}), "quant_method='awq' is not read by pack"),
    # an fp8 quantization_config does not describe MXFP4 blocks
    (dict(quantization_config={"quant_method": "fp8"}), "no quantization_config with quant_method 'mxfp4'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quant_method='gptq' is not read by pack"),
])
def test_refusals(tmp_path, changes, message):
    with pytest.raises(colibri.ColibriError, match=message):
        pack(small_mxfp4(tmp_path, changes), tmp_path / "x.colibri.safetensors", progress=False)
    assert not (tmp_path / "x.colibri.safetensors").exists()


def test_mxfp4_outside_gpt_oss_refused(tmp_path):
    src = small_mxfp4(tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(colibri.ColibriError, match="'mxfp4' outside gpt-oss is not read by pack"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)


def test_overflowing_scale_refused(tmp_path):
    with pytest.raises(colibri.ColibriError, match="beyond bf16's range"):
        pack(small_mxfp4(tmp_path, scale=254), tmp_path / "x.colibri.safetensors", progress=False)
    assert not (tmp_path / "x.colibri.safetensors").exists()
