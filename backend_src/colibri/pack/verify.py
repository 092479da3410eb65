"""--verify: a packed layer against transformers' own MoE block of its family, in fp32 on random
tokens, the block loaded with the values the packed layer holds."""
import numpy as np

from colibri import checkpoint, fp8
from colibri import safetensors_io as st
from colibri.dtypes import from_float, to_float32
from colibri.pack.families import BLOCK_CLASSES, _gpt_oss, _model_type
from colibri.pack.locate import PER_EXPERT_NAMES, _locate
from colibri.pack.source import _as_float32, _fail

VERIFY_TOLERANCE = 1e-5


def _verify_imports():
    try:
        import torch  # noqa: F401 (only whether they import)
        import transformers  # noqa: F401
    except ImportError as exc:
        raise _fail(f"--verify needs torch and transformers ({exc})") from None


def transformers_block(family: str, hf: dict, tensors: dict):
    """transformers' MoE block of `family`, in fp32, built from config.json `hf` and loaded with the
    source tensors of the block (`tensors`: name relative to the block -> float32 array)."""
    import importlib

    import torch
    from transformers import AutoConfig
    module, name = BLOCK_CLASSES[family]
    # quantization_config left out: the block is built in fp32, loaded with dequantised weights
    # a multimodal model's text settings only (families._model_type merged them in)
    config_dict = {k: v for k, v in _model_type(hf)[1].items() if not k.endswith("_config")
                   and k not in ("model_type", "transformers_version", "quantization_config")}
    # A block built on its own never has the experts implementation a whole model would choose, so
    # transformers warns that none is set: name its plain PyTorch one ("eager") as the reference.
    config = AutoConfig.for_model(family, **{**config_dict, "experts_implementation": "eager"})
    block_class = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    block = block_class(config).to(torch.float32).eval()
    if family == "gpt_oss":
        _refuse_fixed_swiglu(block, hf)
    state = {}
    for key in block.state_dict():
        if key in tensors:
            state[key] = torch.from_numpy(np.ascontiguousarray(tensors[key]))
        elif key in ("experts.gate_up_proj", "experts.down_proj"):
            # transformers' own conversion of per-expert checkpoints: gate and up concatenated per expert.
            names = next(n for n in PER_EXPERT_NAMES.values() if f"experts.0.{n[0]}.weight" in tensors)
            E = block.experts.num_experts
            parts = [np.concatenate([tensors[f"experts.{m}.{names[0]}.weight"], tensors[f"experts.{m}.{names[1]}.weight"]])
                     if key == "experts.gate_up_proj" else tensors[f"experts.{m}.{names[2]}.weight"] for m in range(E)]
            state[key] = torch.from_numpy(np.stack(parts))
        else:
            raise _fail(f"--verify: the source has no tensor for transformers' {name}.{key}")
    block.load_state_dict(state, strict=True)
    return block


def _refuse_fixed_swiglu(block, hf):
    """Refuses a gpt-oss block whose clamped SwiGLU does not take config.json's swiglu_alpha and
    swiglu_limit: older transformers fix them at the released models' 1.702 and 7.0, so on any other
    values its output is not the model's and a relative error would blame the packed layer."""
    import transformers
    plan = _gpt_oss(hf)
    wanted = (plan.activation_alpha, plan.activation_limit)
    used = (getattr(block.experts, "alpha", None), getattr(block.experts, "limit", None))
    if None not in used and tuple(float(v) for v in used) != wanted:
        raise _fail(f"--verify: transformers {transformers.__version__}'s GptOssExperts computes with swiglu_alpha "
                    f"{used[0]:g} and swiglu_limit {used[1]:g} whatever config.json says (here {wanted[0]:g} and "
                    f"{wanted[1]:g}), so it cannot check this layer; transformers 5.19 and later read both")


def block_forward(block, x: np.ndarray) -> np.ndarray:
    """transformers' block on tokens x [T, H] (float32), as [T, H] float64."""
    import torch
    with torch.no_grad():
        y = block(torch.from_numpy(np.asarray(x, np.float32))[None])
    y = y[0] if isinstance(y, tuple) else y  # gpt-oss's block also returns its router scores
    return y[0].double().numpy()


def colibri_forward(path, x: np.ndarray) -> np.ndarray:
    """The packed layer on x [T, H]: colibri's CPU layer, in fp32."""
    from colibri.layer import MoELayer
    return np.asarray(MoELayer.from_file(path).forward(np.asarray(x, np.float32)), np.float64)


def routing_ties(path, x: np.ndarray, tolerance=1e-5) -> np.ndarray:
    """[T] bool: tokens whose choice of experts (or groups) is within `tolerance` of a tie, where fp32
    rounding may legitimately choose differently."""
    from colibri import reference
    ckpt = checkpoint.load(path)
    config = ckpt.config
    logits = reference.router_logits(np.asarray(x, np.float64), ckpt.router, ckpt.router_logit_bias)
    scores = reference.selection_scores(config, logits, ckpt.router_bias)
    scale = np.maximum(1.0, np.abs(np.where(np.isfinite(scores), scores, 0)).max(axis=1))
    return ((reference.topk_margin(scores, config.top_k) <= tolerance * scale)
            | (reference.group_margin(config, logits, ckpt.router_bias) <= tolerance * scale))


def _transformers_mxfp4(source, prefix) -> np.ndarray:
    """prefix_blocks / prefix_scales dequantised by transformers (float32, its bf16 layout)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    blocks, scales = (torch.from_numpy(np.array(source.get(prefix + s))) for s in ("_blocks", "_scales"))
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()


def _as_packed(value, relative, layout, packed) -> np.ndarray:
    """A source weight tensor (float32, in its source layout) with the values the packed layer holds:
    rounded to the packed dtype, or for fp8 quantised and dequantised matrix by matrix as pack did."""
    if packed != "fp8_e4m3":
        return to_float32(from_float(value, packed), packed)

    def round_trip(matrix):  # [N, K] as packed -> its fp8 values
        return fp8.dequantize(*fp8.quantize(matrix, *fp8.BLOCK), *fp8.BLOCK).astype(np.float32)
    if value.ndim == 2:  # per-expert and shared matrices are [N, K] as packed
        return round_trip(value)
    out = np.empty_like(value)  # [E, ...]: one expert at a time, in pack's matrices
    for e, matrix in enumerate(value):
        if layout.startswith("gpt_oss"):  # [H, 2F] interleaved gate/up, or down [F, H]: transposed
            if relative.endswith("gate_up_proj"):
                out[e][:, 0::2], out[e][:, 1::2] = round_trip(matrix[:, 0::2].T).T, round_trip(matrix[:, 1::2].T).T
            else:
                out[e] = round_trip(matrix.T).T
        elif relative.endswith("gate_up_proj"):  # [2F, H]: gate and up each on its own grid
            half = matrix.shape[0] // 2
            out[e] = np.concatenate([round_trip(matrix[:half]), round_trip(matrix[half:])])
        else:
            out[e] = round_trip(matrix)
    return out


def _renamed(relative, renames):
    """A checkpoint tensor's name in transformers' block (plan.renames)."""
    for stored, block in renames:
        if relative.startswith(stored):
            return block + relative[len(stored):]
    return relative


def _verify(source, hf, plan, base, path, tokens=64, seed=0):
    family = plan.family
    if family not in BLOCK_CLASSES:
        raise _fail(f"--verify: {family} has no transformers block to check against")
    ckpt = checkpoint.load(path)
    packed = ckpt.config.weight_dtype
    layout = ckpt.metadata.get("source_layout", "")
    quantised = _locate(source, base, plan).fp8  # fp8 source weights and their scales
    scales = quantised.names if quantised else set()
    tensors = {}
    for name in source.where:
        if name.startswith(base) and not name.endswith("_scales") and name not in scales:
            relative = _renamed(name[len(base):], plan.renames)
            if name.endswith("_blocks"):
                # The check uses transformers' own dequantisation, not pack's.
                relative = relative[:-len("_blocks")]
                value = _transformers_mxfp4(source, name[:-len("_blocks")])
            elif quantised and name in quantised.scales:
                value = quantised.dequantize(name).astype(np.float32)  # the block gets the dequantised weights
            else:
                value = _as_float32(source, name)
            is_weight = (relative.startswith("experts.") and not relative.endswith("_bias")) \
                or relative.startswith(("shared_expert.", "shared_experts."))
            if is_weight and packed != st.SAFETENSORS_TO_COLIBRI.get(source.info(name).dtype):
                value = _as_packed(value, relative, layout, packed)  # the block sees the packed layer's values
            tensors[relative] = value
    block = transformers_block(family, hf, tensors)
    x = np.random.default_rng(seed).standard_normal((tokens, ckpt.config.hidden_size)).astype(np.float32)
    keep = ~routing_ties(path, x)
    if keep.sum() < tokens // 2:
        raise _fail(f"--verify: {tokens - int(keep.sum())} of {tokens} random tokens sit at a routing tie")
    expected, got = block_forward(block, x)[keep], colibri_forward(path, x)[keep]
    error = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))
    if not error <= VERIFY_TOLERANCE:
        raise _fail(f"--verify: {path} differs from transformers' {BLOCK_CLASSES[family][1]} by relative error "
                    f"{error:.3g} > {VERIFY_TOLERANCE:g}; the file was not kept")
    return error
