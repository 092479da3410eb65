"""Quantisation formats pack reads: fp8 e4m3 weights and their scales as released, and gpt-oss's
MXFP4 experts (dequantised to bf16, exactly)."""
import dataclasses

import numpy as np

from colibri import fp8
from colibri.pack.source import _as_float32, _expect_shape, _fail


# fp8 e4m3 experts as released, read as stored (colibri.fp8 describes the scale grids):
#
#   block       <proj>.weight F8_E4M3 [N, K] and <proj>.weight_scale_inv F32 [ceil(N/bn), ceil(K/bk)],
#               quantization_config {quant_method: "fp8", fmt: "e4m3", weight_block_size: [bn, bk]}
#               (DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8; transformers' FineGrainedFP8);
#               compressed-tensors' "block" strategy stores the same grid as <proj>.weight_scale
#   per tensor  <proj>.weight_scale [] or [1] (AutoFP8's quant_method "fp8", compressed-tensors "tensor";
#               transformers' FineGrainedFP8 with weight_block_size null: weight_scale_inv [])
#   per channel <proj>.weight_scale [N] or [N, 1] (fbgemm_fp8, compressed-tensors "channel")
#
# Every scale multiplies (DeepSeek's "_inv" too: w = fp8 * weight_scale_inv). A static activation scale
# (<proj>.input_scale, or transformers' <proj>.activation_scale) is accepted and not used: Colibri's
# GPU quantises activations itself, per token and 128 inputs, and the CPU not at all; the reference
# of record is the layer of the dequantised weights. Every matrix of a layer (routed and shared
# experts) must have the same granularity; e5m2, ue8m0 scales, fp4 experts and any other shape are
# refused by name.

FP8_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
FP8_SCALE_DTYPES = ("F32", "BF16", "F16")  # each exact in float32
STATIC_INPUT_SCALES = ("input_scale", "activation_scale")


@dataclasses.dataclass
class _Fp8Scheme:
    """What config.json's quantization_config says about fp8 weights."""
    method: str
    block: tuple = None            # (bn, bk) the 2-D scale grids are blocks of; None: per tensor or channel
    static_activations: bool = False
    ignored: tuple = ()            # settings Colibri does not apply, for the note


def _fp8_scheme(config: dict) -> _Fp8Scheme:
    method = config["quant_method"]

    def refuse(setting, why):
        return _fail(f"config.json quantization_config {setting} (quant_method {method!r}): {why}")
    if method == "fp8":
        for key, wanted in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
            if config.get(key, wanted) != wanted:
                raise refuse(f"{key}={config[key]!r}", f"pack reads fp8 e4m3 weights with float32 scales ({key} "
                                                       f"{wanted!r})")
        block = config.get("weight_block_size", (128, 128))  # transformers' default when the key is absent
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise refuse(f"weight_block_size={block!r}", "expected two integers > 0")
            block = tuple(block)
        static = config.get("activation_scheme", "dynamic") == "static"
        return _Fp8Scheme(method, block, static, ("activation_scheme static",) if static else ())
    if method == "fbgemm_fp8":
        bound = config.get("activation_scale_ub")
        return _Fp8Scheme(method, None, False, (f"activation_scale_ub={bound}",) if bound is not None else ())
    # compressed-tensors: every group must hold 8-bit float weights, symmetric (no zero points)
    groups = config.get("config_groups")
    if config.get("format", "float-quantized") != "float-quantized":
        raise refuse(f"format={config['format']!r}", "pack reads 'float-quantized' (fp8) compressed-tensors only")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups", "missing: pack cannot tell how the weights are quantised")
    blocks, static = set(), False
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict) or (weights.get("type"), weights.get("num_bits")) != ("float", 8) \
                or weights.get("symmetric", True) is not True:
            raise refuse(f"config_groups.{group_name}.weights={weights!r}",
                         "pack reads symmetric 8-bit float (fp8 e4m3) weights only")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise refuse(f"config_groups.{group_name}.weights.strategy={strategy!r}",
                         "pack reads the tensor, channel and block strategies")
        if strategy == "block":
            structure = weights.get("block_structure")
            if not (isinstance(structure, list) and len(structure) == 2 and all(isinstance(b, int) and b > 0
                                                                               for b in structure)):
                raise refuse(f"config_groups.{group_name}.weights.block_structure={structure!r}",
                             "expected two integers > 0")
            blocks.add(tuple(structure))
        activations = group.get("input_activations")
        static |= isinstance(activations, dict) and activations.get("dynamic") is False
    if len(blocks) > 1:
        raise refuse("config_groups", f"block structures {sorted(blocks)} differ: one layer has one")
    return _Fp8Scheme(method, blocks.pop() if blocks else None, static,
                      ("static input_activations",) if static else ())


def _granularity(block) -> str:
    return {(0, 0): "per-tensor", (1, 0): "per-channel"}.get(tuple(block), f"block {block[0]}x{block[1]}")


def _fp8_scale(source, weight: str, shape, scheme: _Fp8Scheme):
    """(the scale tensor of fp8 weight `weight` [N, K], its (bn, bk), its static activation scales' names),
    checked against the scheme; refuses a missing, doubled or misshapen scale by name."""
    stem = weight[:-len("weight")]  # "...proj." of "...proj.weight"
    found = [name for name in (weight + "_scale_inv", stem + "weight_scale") if name in source]
    if not found:
        raise _fail(f"{weight}: fp8 weights without a scale (expected {weight}_scale_inv or {stem}weight_scale)")
    if len(found) > 1:
        raise _fail(f"{weight}: both {found[0]} and {found[1]}: refused rather than guessed which one applies")
    name = found[0]
    info = source.info(name)
    if info.dtype not in FP8_SCALE_DTYPES:
        raise _fail(f"{name}: dtype {info.dtype}, expected float32 scales (F32; BF16 and F16 are widened exactly)"
                    + (" (ue8m0 scales are not read)" if info.dtype in ("U8", "F8_E8M0") else ""))
    N, K = shape
    tensor_shapes, channel_shapes = ((), (1,)), ((N,), (N, 1))
    # transformers writes a per-tensor scale_inv when weight_block_size is null; blocks otherwise.
    if scheme.block is not None and (name.endswith("_scale_inv") or scheme.method == "compressed-tensors"):
        bn, bk = scheme.block
        expected = {fp8.grid_shape(shape, bn, bk): (bn, bk)}
    elif name.endswith("_scale_inv"):
        expected = {s: (0, 0) for s in tensor_shapes}
    else:
        expected = {**{s: (0, 0) for s in tensor_shapes}, **{s: (1, 0) for s in channel_shapes}}
    if info.shape not in expected:
        wanted = " or ".join(f"{list(s)} ({_granularity(b)})" for s, b in expected.items())
        raise _fail(f"{name}: shape {list(info.shape)}, expected {wanted} for the fp8 weights {weight} "
                    f"{list(shape)} (quant_method {scheme.method!r})")
    static = [stem + s for s in STATIC_INPUT_SCALES if stem + s in source]
    for static_name in static:
        if source.info(static_name).numel != 1:
            raise _fail(f"{static_name}: shape {list(source.info(static_name).shape)}, expected one static "
                        "activation scale ([] or [1])")
    return name, expected[info.shape], static


def _fp8_grid(source, name, shape, block) -> np.ndarray:
    """The scale tensor `name` of a matrix [N, K] as its float32 grid, refused if not finite."""
    grid = _as_float32(source, name).reshape(fp8.grid_shape(shape, *block))
    if not np.isfinite(grid).all():
        raise _fail(f"{name}: a scale is not finite")
    return grid


def _fp8_codes(source, name) -> np.ndarray:
    codes = source.get(name)
    if ((codes & 0x7F) == 0x7F).any():  # S.1111.111: e4m3fn's NaN
        raise _fail(f"{name}: holds an fp8 NaN (code 0x7f or 0xff)")
    return codes


class _Fp8Weights:
    """A layer's fp8 matrices and their scales (_fp8_scale), checked to share one granularity."""

    def __init__(self, source, scheme: _Fp8Scheme):
        self.source, self.scheme = source, scheme
        self.block = self.first = None
        self.scales = {}   # weight name -> (scale name, matrix shape)
        self.static = []   # names of the static activation scales (accepted, not used)

    def add(self, weight, shape) -> None:
        scale, block, static = _fp8_scale(self.source, weight, shape, self.scheme)
        if self.block is None:
            self.block, self.first = block, scale
        elif block != self.block:
            raise _fail(f"{scale} gives {weight} {_granularity(block)} scales but {self.first} gives "
                        f"{_granularity(self.block)} ones: every matrix of a layer must share one granularity")
        self.scales[weight] = (scale, tuple(shape))
        self.static += static

    def grid(self, weight) -> np.ndarray:
        scale, shape = self.scales[weight]
        return _fp8_grid(self.source, scale, shape, self.block)

    def codes(self, weight) -> np.ndarray:
        return _fp8_codes(self.source, weight)

    def dequantize(self, weight) -> np.ndarray:
        """The matrix's weights in float64, exactly."""
        return fp8.dequantize(self.codes(weight), self.grid(weight), *self.block)

    @property
    def names(self) -> set:
        return {scale for scale, _ in self.scales.values()} | set(self.static)

    def describe(self) -> str:
        suffix = "weight_scale_inv" if self.first.endswith("_scale_inv") else "weight_scale"
        return f"fp8 e4m3 ({self.scheme.method}), {_granularity(self.block)} scales ({suffix})"


# ---------------------------------------------------------------------------------------------------
# MXFP4 (OCP Microscaling FP4), as gpt-oss ships its experts; read from transformers 5.25's
# integrations/mxfp4.py (convert_moe_packed_tensors) and its quantizer's serialized names.
#
# A projection with `rows` outputs and `cols` inputs is stored per expert as
#   <proj>_blocks [E, rows, cols/32, 16] uint8: blocks of 32 consecutive inputs; byte j of a block
#                 holds input 2j in its low nibble and input 2j+1 in its high nibble;
#   <proj>_scales [E, rows, cols/32]     uint8: one E8M0 exponent s per block, the factor 2^(s-127).
# A nibble is an FP4 E2M1 code: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
# gate_up_proj has rows = 2F (gate and up interleaved: even rows gate, odd rows up) and cols = H;
# down_proj has rows = H and cols = F. transformers transposes the dequantised [E, rows, cols] into
# its bf16 layouts [E, H, 2F] and [E, F, H]; pack wants [outputs, inputs] rows, so it keeps them.
#
# Every value is code * 2^(s-127) with at most two significant bits and magnitude >= 2^-128, so it
# is exact in float32 and in bf16 (whose subnormals reach 2^-133) unless it exceeds their range
# (s >= 253): refused, as is s = 255, E8M0's NaN, which transformers reads as 2^128 instead.

MXFP4_BLOCK = 32
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
# byte -> its two values (low nibble first), so one gather decodes a block.
_FP4_PAIRS = np.stack([FP4_E2M1[np.arange(256) & 0x0F], FP4_E2M1[np.arange(256) >> 4]], axis=-1)
# E8M0 code -> 2^(code-127) in float32 (2^-127 is a float32 subnormal: exact); 255 is refused.
_E8M0 = np.ldexp(np.float32(1.0), np.arange(255) - 127).astype(np.float32)


def dequantize_mxfp4(blocks, scales, name="MXFP4 tensor") -> np.ndarray:
    """MXFP4 blocks [..., G, 16] and scales [..., G] (uint8) -> their values [..., 32G] in float32,
    inputs in order (not transposed). Raises ColibriError on a NaN scale or a value beyond bf16."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1:] != (MXFP4_BLOCK // 2,) \
            or blocks.shape[:-1] != scales.shape:
        raise _fail(f"{name}: MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales {list(scales.shape)} "
                    f"{scales.dtype} do not match (expected uint8 [..., G, 16] and [..., G])")
    if (scales == 255).any():
        raise _fail(f"{name}: an E8M0 scale of 255 (NaN in the MX format; transformers reads it as 2^128): "
                    "refused rather than guessed")
    values = np.take(_FP4_PAIRS, blocks, axis=0).reshape(*scales.shape, MXFP4_BLOCK)
    with np.errstate(over="ignore"):
        values *= _E8M0[scales][..., None]
    if not np.isfinite(values).all():
        raise _fail(f"{name}: an MXFP4 value beyond bf16's range (scale {int(scales.max())}): refused")
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK)


def _exact_bf16(values: np.ndarray, name) -> np.ndarray:
    """float32 values that bf16 holds exactly -> their bf16 bits (the top half: no rounding to do)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    if (bits & 0xFFFF).any():
        raise _fail(f"{name}: a dequantised MXFP4 value is not exact in bf16")  # cannot happen, see above
    return (bits >> 16).astype(np.uint16)


def _expect_mxfp4(source, prefix, E, rows, cols) -> None:
    """Checks prefix_blocks / prefix_scales hold an [E, rows, cols] projection."""
    if cols % MXFP4_BLOCK:
        raise _fail(f"{prefix}_blocks: {cols} inputs are not a whole number of {MXFP4_BLOCK}-value MXFP4 blocks")
    _expect_shape(source, prefix + "_blocks", (E, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2))
    _expect_shape(source, prefix + "_scales", (E, rows, cols // MXFP4_BLOCK))
    for suffix in ("_blocks", "_scales"):
        if source.info(prefix + suffix).dtype != "U8":
            raise _fail(f"{prefix}{suffix}: dtype {source.info(prefix + suffix).dtype}, MXFP4 is stored as U8")
