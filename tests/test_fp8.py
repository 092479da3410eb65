"""fp8 e4m3 experts on the CPU: the codec against torch.float8_e4m3fn; the CPU layer against the float64
reference of the dequantised weights (block, per-channel and per-tensor scales; swiglu and linear; a
shared expert cut in slices); the packed format colibri-moe/3; pack reading the fp8 releases as stored
(DeepSeek-V3's block layout, AutoFP8's per-tensor scales with a static input_scale, fbgemm's and
compressed-tensors' per-channel ones) and quantising any family (--dtype fp8), each compared with the
family's transformers block loaded with the dequantised weights; and what is refused, by name.
Inputs are fresh each run (conftest's seed)."""
import contextlib
import io
import json

import numpy as np
import pytest

import colibri
from colibri import checkpoint, fp8, reference
from colibri import safetensors_io as st
from colibri._native import lib
from colibri.dtypes import FP8_E4M3_VALUES, float_to_fp8_e4m3, fp8_e4m3_to_float32
from colibri.testing import (FP8_ERROR_LIMIT, error_limit, random_fp8_layer, random_hidden, random_routing,
                             relative_error, routed_reference)

EXACT = 1e-5  # the CPU computes with the dequantised weights in fp32: relative to the float64 reference


# ---------------------------------------------------------------------------------------------------
# The codec


def test_decode_matches_torch_on_every_code():
    torch = pytest.importorskip("torch")
    codes = np.arange(256, dtype=np.uint8)
    expected = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    got = fp8_e4m3_to_float32(codes)
    assert np.flatnonzero(np.isnan(got)).tolist() == [0x7F, 0xFF] == np.flatnonzero(np.isnan(expected)).tolist()
    finite = ~np.isnan(expected)
    assert np.array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))  # -0.0 too
    assert got[0x7E] == 448 and got[0x01] == 2.0 ** -9 and got[0x08] == 2.0 ** -6


def test_encode_matches_torch(rng):
    """Random magnitudes from the subnormals to beyond 448, every value, every tie between neighbours
    and the floats either side of it, overflow, Inf, NaN and signed zeros: torch's clamp then
    .to(float8_e4m3fn), code for code."""
    torch = pytest.importorskip("torch")
    finite = FP8_E4M3_VALUES[np.isfinite(FP8_E4M3_VALUES)]
    positive = np.unique(finite[finite > 0]).astype(np.float64)
    ties = ((positive[:-1] + positive[1:]) / 2).astype(np.float32)
    x = np.concatenate([
        rng.standard_normal(200_000) * np.exp2(rng.uniform(-14, 11, 200_000)), finite, ties, -ties,
        np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(0)), positive[0] * rng.random(1000),
        [448, 449, 463.9, 464, 465, 480, 1e6, 3e38, np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e-45, -1e-45],
    ]).astype(np.float32)
    expected = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    got = float_to_fp8_e4m3(x)
    wrong = np.flatnonzero(got != expected)
    assert wrong.size == 0, f"{wrong.size} differ, e.g. {x[wrong[:5]]}: {got[wrong[:5]]} vs {expected[wrong[:5]]}"


def test_encode_rounds_float64_once():
    """A float64 just above a tie rounds up, where its float32 rounding (the tie itself) would go to even."""
    tie = 1.0625  # between 1.0 (0x38) and 1.125 (0x39)
    assert float_to_fp8_e4m3(np.float32(tie)) == 0x38 and float_to_fp8_e4m3(tie + 1e-12) == 0x39
    assert float_to_fp8_e4m3(np.float32(tie + 1e-12)) == 0x38


def test_every_code_round_trips():
    codes = np.arange(256, dtype=np.uint8)
    finite = codes[np.isfinite(FP8_E4M3_VALUES)]
    assert np.array_equal(float_to_fp8_e4m3(fp8_e4m3_to_float32(finite)), finite)


# ---------------------------------------------------------------------------------------------------
# Scale grids


def test_binding_carries_fp8():
    """The cffi extension, built from colibri.h's cdef block, has fp8's dtype, fields and function."""
    config, weights = colibri.ffi.new("colibri_moe_config_t *"), colibri.ffi.new("colibri_moe_weights_t *")
    config.scale_block_n, config.scale_block_k = 128, 64
    assert (config.scale_block_n, config.scale_block_k) == (128, 64)
    assert weights.expert_scales == colibri.ffi.NULL and weights.shared_scales == colibri.ffi.NULL
    assert lib.COLIBRI_DTYPE_F8E4M3 == 3 and lib.colibri_dtype_size(lib.COLIBRI_DTYPE_F8E4M3) == 1


@pytest.mark.parametrize("kind", ["swiglu", "linear"])
@pytest.mark.parametrize("block", [(128, 128), (1, 0), (0, 0), (32, 16), (0, 64), (200, 1)])
def test_scales_numel_matches_the_library(kind, block):
    for H, F in ((1, 1), (64, 96), (200, 136), (7168, 2048), (129, 127)):
        expected = lib.colibri_scales_numel(colibri.lib.COLIBRI_EXPERT_SWIGLU if kind == "swiglu"
                                            else colibri.lib.COLIBRI_EXPERT_LINEAR, H, F, *block)
        config = colibri.LayerConfig(num_experts=2, top_k=1, hidden_size=H, intermediate_size=F, expert_kind=kind,
                                     weight_dtype="fp8_e4m3", scale_block_n=block[0], scale_block_k=block[1])
        assert fp8.scales_numel(kind, H, F, *block) == config.scales_numel == expected


def test_quantize_blocks(rng):
    """amax / 448 per block (fp32), 1 for an all-zero block, and codes as torch rounds value / scale."""
    values = rng.standard_normal((200, 136)) * np.exp2(rng.uniform(-8, 8, (200, 1)))
    values[128:, :128] = 0.0
    codes, grid = fp8.quantize(values, 128, 128)
    assert grid.dtype == np.float32 and grid.shape == (2, 2) and codes.shape == values.shape
    assert grid[1, 0] == 1.0 and not codes[128:, :128].any()
    for (r, c), scale in np.ndenumerate(grid):
        block = np.abs(values[128 * r:128 * (r + 1), 128 * c:128 * (c + 1)])
        if block.max() > 0:
            assert scale == np.float32(block.max() / 448)
    dequantised = fp8.dequantize(codes, grid, 128, 128)
    scale = fp8.expand(grid.astype(np.float64), values.shape, 128, 128)
    # within half a step of e4m3: 2^-4 of the value, or 2^-10 of the scale among the subnormals
    assert (np.abs(dequantised - values) <= np.maximum(2.0 ** -4 * np.abs(values), 2.0 ** -10 * scale)).all()
    torch = pytest.importorskip("torch")
    expected = (torch.from_numpy(values / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    assert np.array_equal(codes, expected)


def test_quantize_refuses_non_finite():
    values = np.ones((3, 4))
    values[1, 2] = np.inf
    with pytest.raises(colibri.ColibriError, match=r"gate: not finite at index \(1, 2\)"):
        fp8.quantize(values, name="gate")


# ---------------------------------------------------------------------------------------------------
# The CPU layer against the float64 reference of the dequantised weights

LAYERS = {
    # name: (scale block, expert kind, H, F, Fs)
    "block 128, partial blocks": ((128, 128), "swiglu", 200, 136, 0),
    "block 128, shared in 3 slices": ((128, 128), "swiglu", 160, 128, 300),
    "block 32x16, shared in slices": ((32, 16), "swiglu", 72, 64, 150),
    "per channel, shared": ((1, 0), "swiglu", 72, 40, 100),
    "per tensor, shared": ((0, 0), "swiglu", 72, 40, 100),
    "linear block 128": ((128, 128), "linear", 200, 136, 0),
    "linear per channel": ((1, 0), "linear", 72, 40, 0),
    "linear per tensor": ((0, 0), "linear", 72, 40, 0),
}


def reference_tensors(tensors):
    return {k: v for k, v in tensors.items() if k in ("expert_scales", "shared_expert", "shared_expert_scales")}


@pytest.mark.parametrize("name", list(LAYERS))
def test_cpu_layer_is_exact(rng, name):
    block, kind, H, F, Fs = LAYERS[name]
    config, tensors = random_fp8_layer(rng, block, kind, num_experts=6, top_k=2, hidden_size=H, intermediate_size=F,
                                       shared_intermediate_size=Fs, routing="sigmoid_bias")
    layer = colibri.MoELayer(config, **tensors)
    assert (layer.config.weight_dtype, layer.config.scale_block_n, layer.config.scale_block_k) == ("fp8_e4m3", *block)
    x, x64 = random_hidden(rng, 37, H, "fp32")
    ids, weights = random_routing(rng, 37, 6, 2)
    expected = reference.moe_forward(config, tensors["experts"], x64, ids, weights, **reference_tensors(tensors))
    error = relative_error(layer.forward(x, ids, weights), expected)
    assert error < EXACT, f"{name}, given routing: relative error {error:.3g}"
    expected, *_ = routed_reference(config, tensors["experts"], x64, tensors["router"], tensors["router_bias"],
                                    layer.route(x)[0], **reference_tensors(tensors))
    error = relative_error(layer.forward(x), expected)
    assert error < EXACT, f"{name}, the layer's router: relative error {error:.3g}"


def test_cpu_layer_with_bf16_activations(rng):
    config, tensors = random_fp8_layer(rng, (128, 128), hidden_size=200, intermediate_size=136,
                                       shared_intermediate_size=136)
    layer = colibri.MoELayer(config, **tensors)
    x, x64 = random_hidden(rng, 19, 200, "bf16")
    ids, weights = random_routing(rng, 19, 8, 2)
    out = layer.forward(colibri.Tensor.from_numpy(x, "bf16"), ids, weights).numpy()  # widened to float32
    expected = reference.moe_forward(config, tensors["experts"], x64, ids, weights, **reference_tensors(tensors))
    assert relative_error(out, expected) < error_limit("bf16")


def test_the_scales_are_used(rng):
    """Doubling one expert's down-projection grid doubles exactly that expert's contribution."""
    config, tensors = random_fp8_layer(rng, (32, 16), hidden_size=72, intermediate_size=64)
    x, _ = random_hidden(rng, 5, 72, "fp32")
    ids, weights = np.full((5, 2), [3, 1], np.int32), np.full((5, 2), [1.0, 0.0], np.float32)
    before = np.asarray(colibri.MoELayer(config, **tensors).forward(x, ids, weights), np.float64)
    scales = tensors["expert_scales"].copy()
    down = 2 * fp8.blocks(64, 32) * fp8.blocks(72, 16)  # gate and up grids come first
    scales[3, down:] *= 2
    after = np.asarray(colibri.MoELayer(config, **{**tensors, "expert_scales": scales}).forward(x, ids, weights))
    assert relative_error(after, 2 * before) < EXACT


def test_layer_refuses_wrong_scales(rng):
    config, tensors = random_fp8_layer(rng, (32, 16), hidden_size=72, intermediate_size=64,
                                       shared_intermediate_size=64)
    with pytest.raises(colibri.ColibriError, match=r"expert_scales: missing, but config.scales_numel is 32"):
        colibri.MoELayer(config, **{**tensors, "expert_scales": None})
    with pytest.raises(colibri.ColibriError, match=r"expert_scales: expected shape \[8, 32\], got \[8, 31\]"):
        colibri.MoELayer(config, **{**tensors, "expert_scales": tensors["expert_scales"][:, 1:]})
    bad = tensors["shared_expert_scales"].copy()
    bad[4] = np.nan
    with pytest.raises(colibri.ColibriError, match=r"shared_expert_scales: not finite at index \(4,\)"):
        colibri.MoELayer(config, **{**tensors, "shared_expert_scales": bad})
    with pytest.raises(colibri.ColibriError, match=r"experts: weight_dtype fp8_e4m3 is stored as uint8, got float32"):
        colibri.MoELayer(config, **{**tensors, "experts": tensors["experts"].astype(np.float32)})
    bf16 = colibri.LayerConfig(num_experts=8, top_k=2, hidden_size=72, intermediate_size=64, weight_dtype="bf16")
    with pytest.raises(colibri.ColibriError, match=r"expert_scales: given, but weight_dtype is 'bf16'"):
        colibri.MoELayer(bf16, np.zeros((8, bf16.expert_numel), np.uint16), expert_scales=tensors["expert_scales"])
    with pytest.raises(colibri.ColibriError, match=r"config.scale_block_n and scale_block_k apply to fp8 weights only \(got 128, 128\)"):
        colibri.LayerConfig(num_experts=2, top_k=1, hidden_size=8, intermediate_size=8, scale_block_n=128,
                            scale_block_k=128).validate()


def test_shared_slices_must_start_on_a_block():
    """The shared expert runs in slices of width F: F must be a multiple of the scale blocks (colibri.h)."""
    config = colibri.LayerConfig(num_experts=4, top_k=1, hidden_size=64, intermediate_size=24,
                                 shared_intermediate_size=48, weight_dtype="fp8_e4m3", scale_block_n=128,
                                 scale_block_k=128)
    with pytest.raises(colibri.ColibriError, match=r"an fp8 shared expert wider than intermediate_size=24 needs it to "
                                                   r"be a multiple of the scale block \(128, 128\)") as info:
        config.validate()
    assert info.value.status == colibri.STATUS_UNSUPPORTED


def test_cuda_computes_fp8_or_says_why(rng, tmp_path):
    """On CUDA an fp8 layer of 128 x 128 blocks is computed within FP8_ERROR_LIMIT (every CUDA device has a
    path for them); without the CUDA backend or a GPU it is refused with a ColibriError naming the file."""
    path = tmp_path / "fp8.colibri.safetensors"
    checkpoint.write_demo(path, experts=8, top_k=2, hidden=256, intermediate=384, dtype="fp8_e4m3", seed=3)
    try:
        layer = colibri.MoELayer.from_file(path, device="cuda")
    except colibri.ColibriError as exc:
        assert not (colibri.cuda_built() and colibri.cuda_device_count() > 0), f"a GPU refused fp8: {exc}"
        assert str(path) in str(exc) and exc.status in (colibri.STATUS_UNSUPPORTED, colibri.STATUS_CUDA), exc
        return
    cupy = pytest.importorskip("cupy")
    ckpt = checkpoint.load(path)
    x, x64 = random_hidden(rng, 64, 256, "fp32")
    ids, weights = random_routing(rng, 64, 8, 2)
    out = cupy.asnumpy(layer.forward(cupy.asarray(x), cupy.asarray(ids), cupy.asarray(weights)))
    assert relative_error(out, reference.checkpoint_forward(ckpt, x64, ids, weights)) < FP8_ERROR_LIMIT


# ---------------------------------------------------------------------------------------------------
# The packed format: colibri-moe/3 for fp8 experts, colibri-moe/2 for the others


def saved_fp8(rng, path, shared=64):
    config, tensors = random_fp8_layer(rng, (32, 16), hidden_size=72, intermediate_size=64,
                                       shared_intermediate_size=shared)
    checkpoint.save(path, config, tensors["experts"], tensors["router"], expert_scales=tensors["expert_scales"],
                    shared_expert=tensors.get("shared_expert"),
                    shared_expert_scales=tensors.get("shared_expert_scales"))
    return config, tensors


def test_version_3_round_trip(rng, tmp_path):
    path = tmp_path / "fp8.colibri.safetensors"
    config, tensors = saved_fp8(rng, path)
    ckpt = checkpoint.load(path)
    assert ckpt.version == 3 and ckpt.config == config
    assert (ckpt.metadata["scale_block_n"], ckpt.metadata["scale_block_k"]) == ("32", "16")
    assert {n: i.dtype for n, i in ckpt.file.tensors.items()} == {
        "experts": "F8_E4M3", "shared_expert": "F8_E4M3", "expert_scales": "F32", "shared_expert_scales": "F32",
        "router": "F32"}
    for name in ("experts", "expert_scales", "shared_expert", "shared_expert_scales"):
        assert np.array_equal(np.asarray(getattr(ckpt, name)).reshape(-1), tensors[name].reshape(-1)), name
    x, x64 = random_hidden(rng, 9, 72, "fp32")
    ids, weights = random_routing(rng, 9, 8, 2)
    expected = reference.moe_forward(config, tensors["experts"], x64, ids, weights, **reference_tensors(tensors))
    assert relative_error(colibri.MoELayer.from_file(path).forward(x, ids, weights), expected) < EXACT
    assert relative_error(reference.checkpoint_forward(ckpt, x64, ids, weights), expected) == 0


def test_version_3_read_by_the_safetensors_library(rng, tmp_path):
    torch = pytest.importorskip("torch")
    safe_open = pytest.importorskip("safetensors").safe_open
    path = tmp_path / "fp8.colibri.safetensors"
    _, tensors = saved_fp8(rng, path)
    with safe_open(path, "pt") as f:
        experts = f.get_tensor("experts")
        assert experts.dtype == torch.float8_e4m3fn and f.metadata()["format"] == "colibri-moe/3"
        assert np.array_equal(experts.view(torch.uint8).numpy(), tensors["experts"])
        assert np.array_equal(f.get_tensor("expert_scales").numpy(), tensors["expert_scales"])


def test_other_dtypes_stay_version_2(tmp_path):
    path = tmp_path / "bf16.colibri.safetensors"
    checkpoint.write_demo(path, experts=4, top_k=2, hidden=32, intermediate=48)
    meta = checkpoint.load(path).metadata
    assert meta["format"] == "colibri-moe/2" and "scale_block_n" not in meta


def rewritten(path, tensors=None, metadata=None):
    """A copy of the packed file with some tensors ((dtype, array) or None: dropped) and metadata keys changed."""
    file = st.SafetensorsFile(path)
    changed = {name: (info.dtype, np.array(file.get(name))) for name, info in file.tensors.items()}
    for name, value in (tensors or {}).items():
        if value is None:
            changed.pop(name)
        else:
            changed[name] = value
    out = path.with_name("changed.colibri.safetensors")
    st.write(out, changed, {**file.metadata, **(metadata or {})})
    return out


def test_scale_tensors_checked(rng, tmp_path):
    path = tmp_path / "fp8.colibri.safetensors"
    saved_fp8(rng, path)
    cases = [
        ({"expert_scales": ("F32", np.ones((8, 31), np.float32))}, None,
         r"tensor 'expert_scales' has shape \[8, 31\], expected \[8, 32\] \(E=8 experts of scale grids "
         r"gate \[64, 72\] -> \[2, 5\], up \[64, 72\] -> \[2, 5\], down \[72, 64\] -> \[3, 4\] "
         r"for scale block \(32, 16\)\)"),
        ({"shared_expert_scales": ("F32", np.ones(33, np.float32))}, None,
         r"tensor 'shared_expert_scales' has shape \[33\], expected \[32\] \(scale grids gate \[64, 72\]"),
        ({"expert_scales": ("F16", np.ones((8, 32), np.float16))}, None,
         r"tensor 'expert_scales' has dtype F16, expected F32"),
        ({"expert_scales": None}, None, r"the metadata asks for tensor 'expert_scales' but the file has none"),
        (None, {"format": "colibri-moe/2"}, r"tensor 'experts' has dtype F8_E4M3, expected F32, F16 or BF16 "
                                            r"\(fp8 experts need format colibri-moe/3\)"),
        (None, {"scale_block_k": "-1"}, r"config.scale_block_n and scale_block_k must be >= 0, got 32, -1"),
        ({"experts": ("F8_E5M2", np.zeros((8, 13824), np.uint8))}, None,
         r"tensor 'experts' has dtype F8_E5M2, expected F32, F16, BF16 or F8_E4M3"),
    ]
    for tensors, metadata, message in cases:
        bad = rewritten(path, tensors, metadata)
        with pytest.raises(colibri.ColibriError, match=message) as info:
            colibri.MoELayer.from_file(bad)
        assert str(bad) in str(info.value)


def test_scales_of_other_dtypes_refused(rng, tmp_path):
    path = tmp_path / "bf16.colibri.safetensors"
    checkpoint.write_demo(path, experts=4, top_k=2, hidden=32, intermediate=48)
    bad = rewritten(path, {"expert_scales": ("F32", np.ones((4, 3), np.float32))}, {"format": "colibri-moe/3"})
    with pytest.raises(colibri.ColibriError, match="tensor 'expert_scales' is present but the metadata does not ask"):
        checkpoint.load(bad)
    bad = rewritten(path, {"expert_scales": ("F32", np.ones((4, 3), np.float32))})
    with pytest.raises(colibri.ColibriError, match="unknown tensor 'expert_scales' \\(a colibri-moe/2 file holds"):
        checkpoint.load(bad)


def test_demo_and_info_cli(tmp_path, colibri_cli):
    path = tmp_path / "demo.colibri.safetensors"
    result = colibri_cli("demo", "--out", path, "--dtype", "fp8", "--hidden", 200, "--intermediate", 136)
    assert result.returncode == 0, result.stderr
    ckpt = checkpoint.load(path)
    assert (ckpt.config.weight_dtype, ckpt.config.scale_block_n, ckpt.config.scale_block_k) == ("fp8_e4m3", 128, 128)
    assert ckpt.expert_scales.shape == (8, 12)
    info = colibri_cli("info", path)
    assert "scale_block_n          128" in info.stdout and "tensor expert_scales   F32   [8, 12]" in info.stdout


# ---------------------------------------------------------------------------------------------------
# pack: the fp8 releases as stored, and any family quantised (needs torch and transformers)

# name: (family, release (colibri.testing.families.FP8_RELEASES), weight_block_size, config overrides)
RELEASES = {
    # DeepSeek-V3's published layout, 128 x 128 blocks; H = 160 leaves partial blocks, and two shared
    # experts (Fs = 256) run in two slices of F = 128
    "deepseek_v3 block 128": ("deepseek_v3", "block", (128, 128), dict(hidden_size=160, moe_intermediate_size=128)),
    # small blocks, so the grids have several rows and columns (a partial one too) at the tiny sizes
    "deepseek_v3 block 12x8": ("deepseek_v3", "block", (12, 8), {}),
    "mixtral per tensor, static input_scale": ("mixtral", "tensor", None, {}),
    "qwen3_moe per channel (fbgemm_fp8)": ("qwen3_moe", "channel", None, {}),
    "glm4_moe per channel (compressed-tensors)": ("glm4_moe", "compressed-tensors", None, {}),
}
GRANULARITY = {"tensor": (0, 0), "channel": (1, 0), "compressed-tensors": (1, 0)}


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """name -> (source folder, dequantised weights, packed layers' folder, configs, pack's stderr), made once."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri.pack import pack
    from colibri.testing.families import write_fp8_model
    cache = {}

    def make(name):
        if name not in cache:
            family, release, block, overrides = RELEASES[name]
            src = tmp_path_factory.mktemp(family)
            _, dequantised = write_fp8_model(family, src, release, block or (128, 128), **overrides)
            out = tmp_path_factory.mktemp("packed") / "layers"
            errors = io.StringIO()
            with contextlib.redirect_stderr(errors):
                configs = pack(src, out, layer="all", verify=True, progress=False)
            cache[name] = (src, dequantised, out, configs, errors.getvalue())
        return cache[name]
    return make


def clear_tokens(path, rng, count, H):
    from colibri.pack import routing_ties
    x = rng.standard_normal((count, H)).astype(np.float32)
    while (ties := routing_ties(path, x)).any():
        x[ties] = rng.standard_normal((int(ties.sum()), H)).astype(np.float32)
    return x


@pytest.mark.parametrize("name", list(RELEASES))
def test_release_packed_as_stored(name, released, rng):
    """Codes and scales land in the packed file bit for bit; the CPU layer and the reference match the
    family's transformers block loaded with torch's dequantisation of the release within 1e-5."""
    import torch
    from safetensors.torch import load_file

    from colibri.pack import block_forward
    from colibri.testing.families import dequantized_block
    family, release, block, _ = RELEASES[name]
    src, dequantised, folder, configs, _ = released(name)
    source = {n: t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else t.float().numpy()
              for n, t in load_file(src / "model.safetensors").items()}
    for config in configs:
        assert config.weight_dtype == "fp8_e4m3"
        assert (config.scale_block_n, config.scale_block_k) == (block or GRANULARITY[release])
    for path in sorted(folder.iterdir()):
        ckpt = checkpoint.load(path)
        assert ckpt.version == 3 and ckpt.metadata["source_quantization"].endswith("kept as stored")
        base = ckpt.metadata["source_layer"] + "."
        names = sorted({n.split(".experts.")[1].split(".")[1] for n in dequantised if n.startswith(base + "experts.")},
                       key=["gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"].index)
        scale_suffix = "weight_scale_inv" if release == "block" else "weight_scale"
        for m in range(ckpt.config.num_experts):
            stems = [f"{base}experts.{m}.{p}." for p in names]
            assert np.array_equal(ckpt.experts[m], np.concatenate([source[s + "weight"].reshape(-1) for s in stems]))
            assert np.array_equal(ckpt.expert_scales[m],
                                  np.concatenate([source[s + scale_suffix].reshape(-1) for s in stems]))
        layer_index = int(base.split("layers.")[1].split(".")[0])
        transformers_block = dequantized_block(family, src, layer_index, dequantised)
        x = clear_tokens(path, rng, 40, ckpt.config.hidden_size)
        expected = block_forward(transformers_block, x)
        got = np.asarray(colibri.MoELayer.from_file(path).forward(x), np.float64)
        assert relative_error(got, expected) < EXACT, f"{name} {path.name}: CPU layer"
        assert relative_error(reference.checkpoint_forward(ckpt, x.astype(np.float64)), expected) < EXACT


def test_static_input_scale_is_noted(released):
    *_, folder, _, errors = released("mixtral per tensor, static input_scale")
    note = ("static activation scales (input_scale) and activation_scheme static of the fp8 checkpoint not used: "
            "Colibri quantises activations dynamically")
    assert errors.count("colibri pack: note: " + note) == 1, errors
    assert note in checkpoint.load(next(folder.iterdir())).metadata["note"]
    *_, errors = released("qwen3_moe per channel (fbgemm_fp8)")
    assert "activation_scale_ub=1200.0 of the fp8 checkpoint not used" in errors
    *_, errors = released("deepseek_v3 block 128")
    assert "note" not in errors


def test_release_dequantised_to_bf16(released, tmp_path):
    """--dtype bf16 of an fp8 release: the dequantised weights rounded to bf16, checked by --verify."""
    from colibri.pack import pack
    src, *_ = released("deepseek_v3 block 12x8")
    config = pack(src, tmp_path / "bf16.colibri.safetensors", dtype="bf16", verify=True, progress=False)
    ckpt = checkpoint.load(tmp_path / "bf16.colibri.safetensors")
    assert config.weight_dtype == "bf16" and ckpt.version == 2 and ckpt.expert_scales is None
    assert ckpt.metadata["source_quantization"] == "fp8 e4m3 (fp8), block 12x8 scales (weight_scale_inv), " \
                                                   "dequantised to bf16 by pack"


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe", "gpt_oss"])
def test_pack_quantises_any_family(family, tmp_path):
    """--dtype fp8 quantises a float checkpoint's experts (routed and shared) in 128 x 128 blocks; --verify
    compares the layer with the family's block loaded with the same quantised-then-dequantised weights."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri.pack import pack
    from colibri.testing.families import write_model
    write_model(family, tmp_path / "src")
    configs = pack(tmp_path / "src", tmp_path / "layers", layer="all", dtype="fp8", verify=True, progress=False)
    for config, path in zip(configs, sorted((tmp_path / "layers").iterdir())):
        assert (config.weight_dtype, config.scale_block_n, config.scale_block_k) == ("fp8_e4m3", 128, 128)
        ckpt = checkpoint.load(path)
        assert ckpt.metadata["source_quantization"] == \
            "fp32, quantised to fp8 e4m3 by pack (block 128x128 scales, amax / 448 per block)"
        # each scale is its block's amax / 448: the largest code of every (non-zero) matrix is +-448
        rows = fp8_e4m3_to_float32(np.asarray(ckpt.experts)).reshape(config.num_experts, -1)
        assert (np.abs(rows).max(axis=1) == 448).all()


def test_fused_layout_quantised_matrix_by_matrix(rng, tmp_path):
    """transformers 5's fused gate_up_proj [E, 2F, H] is quantised as gate and up apart (at F = 24 one
    128-row block would straddle both); --verify checks the layer against the block with the same values."""
    pytest.importorskip("transformers")
    from colibri.pack import pack
    E, H, F = 4, 40, 24
    base = "model.layers.0.mlp."
    weights = {base + "gate.weight": rng.standard_normal((E, H)) / np.sqrt(H),
               base + "experts.gate_up_proj": rng.standard_normal((E, 2 * F, H)) / np.sqrt(H),
               base + "experts.down_proj": rng.standard_normal((E, H, F)) / np.sqrt(F)}
    weights[base + "experts.gate_up_proj"][:, F:] *= 8  # up's scales differ from gate's
    (tmp_path / "src").mkdir()
    st.write(tmp_path / "src" / "model.safetensors", {n: w.astype(np.float32) for n, w in weights.items()})
    (tmp_path / "src" / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "hidden_size": H, "moe_intermediate_size": F, "num_hidden_layers": 1}))
    out = tmp_path / "fused.colibri.safetensors"
    config = pack(tmp_path / "src", out, dtype="fp8", verify=True, progress=False)
    assert config.weight_dtype == "fp8_e4m3"
    gate_up, down = (np.abs(weights[base + f"experts.{p}"]).astype(np.float32) for p in ("gate_up_proj", "down_proj"))
    expected = np.stack([gate_up[:, :F].max(axis=(1, 2)), gate_up[:, F:].max(axis=(1, 2)), down.max(axis=(1, 2))], 1)
    assert np.array_equal(checkpoint.load(out).expert_scales, (expected / 448).astype(np.float32))


def test_pack_fp8_refuses_shared_slices_off_the_blocks(tmp_path):
    pytest.importorskip("transformers")
    from colibri.pack import pack
    from colibri.testing.families import write_model
    write_model("deepseek_v3", tmp_path / "src")  # F = 24, two shared experts: Fs = 48
    with pytest.raises(colibri.ColibriError, match=r"layer 1: the packed layer would be invalid: "
                                                   r"an fp8 shared expert wider than "
                                                   r"intermediate_size=24 needs it to be a multiple of the scale "
                                                   r"block \(128, 128\)"):
        pack(tmp_path / "src", tmp_path / "x.colibri.safetensors", dtype="fp8", progress=False)
    assert not (tmp_path / "x.colibri.safetensors").exists()


def edited_release(released, tmp_path, name, change_tensors=None, change_config=None):
    """A copy of a release's folder with its tensors (dict of torch tensors) or config.json changed in place."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = released(name)[0]
    copy = tmp_path / "edited"
    shutil.copytree(src, copy)
    if change_tensors:
        tensors = load_file(copy / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    if change_config:
        config = json.loads((copy / "config.json").read_text())
        change_config(config)
        (copy / "config.json").write_text(json.dumps(config))
    return copy


EXPERTS = "model.layers.1.mlp.experts."  # of the "deepseek_v3 block 12x8" release


def _bad_scale_shape(t):
    t[EXPERTS + "2.up_proj.weight_scale_inv"] = t[EXPERTS + "2.up_proj.weight_scale_inv"][:1]


def _missing_scale(t):
    del t[EXPERTS + "5.down_proj.weight_scale_inv"]


def _e5m2(t):
    import torch
    for name in [n for n in t if n.endswith("proj.weight") and t[n].dtype == torch.float8_e4m3fn]:
        t[name] = t[name].float().to(torch.float8_e5m2)


def _nan_code(t):
    import torch
    weight = t[EXPERTS + "3.gate_proj.weight"].view(torch.uint8).clone()
    weight[1, 1] = 0xFF
    t[EXPERTS + "3.gate_proj.weight"] = weight.view(torch.float8_e4m3fn)


def _inf_scale(t):
    t["model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"][0, 0] = float("inf")


def _channel_scale(t):  # one per-channel matrix (gate [24, 32]) among block ones
    del t[EXPERTS + "4.gate_proj.weight_scale_inv"]
    t[EXPERTS + "4.gate_proj.weight_scale"] = t[EXPERTS + "0.up_proj.weight_scale_inv"][:, :1].repeat_interleave(12, 0)


def _two_scales(t):
    t[EXPERTS + "1.up_proj.weight_scale"] = t[EXPERTS + "1.up_proj.weight_scale_inv"].clone()


REFUSALS = {
    "bad scale shape": (_bad_scale_shape, None,
                        r"model.layers.1.mlp.experts.2.up_proj.weight_scale_inv: shape \[1, 4\], expected \[2, 4\] "
                        r"\(block 12x8\) for the fp8 weights model.layers.1.mlp.experts.2.up_proj.weight \[24, 32\]"),
    "missing scale": (_missing_scale, None,
                      r"model.layers.1.mlp.experts.5.down_proj.weight: fp8 weights without a scale \(expected "
                      r"model.layers.1.mlp.experts.5.down_proj.weight_scale_inv or "
                      r"model.layers.1.mlp.experts.5.down_proj.weight_scale\)"),
    "two scales": (_two_scales, None, r"experts.1.up_proj.weight: both .*weight_scale_inv and .*weight_scale"),
    "e5m2 weights": (_e5m2, None, r"expert weights: dtype F8_E5M2 \(fp8 e5m2\) is not read"),
    "fp8 NaN": (_nan_code, None, r"experts.3.gate_proj.weight: holds an fp8 NaN \(code 0x7f or 0xff\)"),
    "infinite scale": (_inf_scale, None, r"shared_experts.up_proj.weight_scale_inv: a scale is not finite"),
    "mixed granularity": (_channel_scale, None,
                          r"experts.4.gate_proj.weight_scale gives model.layers.1.mlp.experts.4.gate_proj.weight "
                          r"per-channel scales but .*experts.0.gate_proj.weight_scale_inv gives block 12x8 ones: "
                          r"every matrix of a layer must share one granularity"),
    "unknown quant_method": (None, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}),
                             r"quant_method='awq' is not read by pack"),
    "e5m2 config": (None, lambda c: c["quantization_config"].update(fmt="e5m2"),
                    r"quantization_config fmt='e5m2' \(quant_method 'fp8'\): pack reads fp8 e4m3 weights"),
    "ue8m0 scales": (None, lambda c: c["quantization_config"].update(scale_fmt="ue8m0"),
                     r"quantization_config scale_fmt='ue8m0'"),
    "no quantization_config": (None, lambda c: c.pop("quantization_config"),
                               r"expert weights: dtype F8_E4M3, but config.json has no quantization_config with an "
                               r"fp8 quant_method"),
    "block size disagrees": (None, lambda c: c["quantization_config"].update(weight_block_size=[128, 128]),
                             r"weight_scale_inv: shape \[2, 4\], expected \[1, 1\] \(block 128x128\)"),
    "integer compressed-tensors": (None, lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}),
        r"config_groups.g.weights=.*pack reads symmetric 8-bit float \(fp8 e4m3\) weights only"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_pack_refusals(case, released, tmp_path):
    from colibri.pack import pack
    change_tensors, change_config, message = REFUSALS[case]
    src = edited_release(released, tmp_path, "deepseek_v3 block 12x8", change_tensors, change_config)
    with pytest.raises(colibri.ColibriError, match=message):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)
    assert not (tmp_path / "x.colibri.safetensors").exists()


def test_pack_cli_fp8(released, tmp_path, colibri_cli):
    src, *_ = released("mixtral per tensor, static input_scale")
    out = tmp_path / "m.colibri.safetensors"
    result = colibri_cli("pack", src, "--out", out, "--verify", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "colibri pack: note: static activation scales (input_scale)" in result.stderr
    assert checkpoint.load(out).config.scale_block_n == 0
    result = colibri_cli("pack", src, "--out", tmp_path / "b.colibri.safetensors", "--dtype", "fp8", "--quiet")
    assert result.returncode == 0 and checkpoint.load(tmp_path / "b.colibri.safetensors").version == 3
