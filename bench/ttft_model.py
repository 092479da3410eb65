"""A whole MoE model of a real model's shape with random weights, built on the GPU for the TTFT benchmark
(bench/bench_ttft.py): transformers' Qwen3-MoE in bf16, and the same model's experts packed for the
expert tier as fp8 e4m3 with an fp32 scale per 128 x 128 block (amax / 448, DeepSeek-V3's checkpoint
layout), one `layer{N}.colibri.safetensors` per MoE layer, as `pack --layer all` writes a folder.

Nothing here touches disk beyond the packed folder: a 30B-parameter bf16 checkpoint (61 GB) would not
fit beside it on the GPU machine's disk, so the model is drawn in place (transformers' own init) and
its experts are quantised from GPU memory.

    model = build(qwen3_30b_a3b(), "cuda")          # the eager baseline as it stands
    pack_fp8(model, folder)                        # writes the folder; frees each layer's experts
"""
import functools
import time
from pathlib import Path

import numpy as np
import torch

from colibri import checkpoint
from colibri.config import LayerConfig

BLOCK = 128


def qwen3_30b_a3b(layers=48, **overrides):
    """Qwen3-30B-A3B's shape (its config.json: 48 layers, 128 experts, top-8, H 2048, F 768, 32 query
    and 4 key-value heads of 128); transformers 5.25's Qwen3MoeConfig defaults give all of it but the
    layer count (24)."""
    from transformers import Qwen3MoeConfig
    settings = dict(num_hidden_layers=layers, num_experts=128, num_experts_per_tok=8, hidden_size=2048,
                    moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, norm_topk_prob=True, vocab_size=151936,
                    max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False)
    settings.update(overrides)
    return Qwen3MoeConfig(**settings)


def build(config, device, dtype=torch.bfloat16, seed=0):
    """The model with transformers' own random init, drawn directly on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def moe_blocks(model):
    """{layer index: the layer's MoE block} of a Qwen3-MoE model."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}


def quantise_blocks(w):
    """w [..., N, K] as fp8 e4m3 codes and fp32 scales [..., N/128, K/128]: bench_gpu.py's quantiser, so
    the whole-model figures and the layer rows quantise alike."""
    return _bench_gpu().quantise_blocks(w, BLOCK, BLOCK)


@functools.lru_cache(maxsize=None)
def _bench_gpu():
    from colibri.testing import load_script
    return load_script(Path(__file__).with_name("bench_gpu.py"))


def layer_config(config) -> LayerConfig:
    layer = LayerConfig(expert_kind="swiglu", num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                        hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                        weight_dtype="fp8_e4m3", routing="softmax_topk", renormalize=bool(config.norm_topk_prob),
                        routed_scaling_factor=1.0, has_router=True, scale_block_n=BLOCK, scale_block_k=BLOCK)
    layer.validate()
    return layer


def pack_fp8(model, folder, free=True, log=print):
    """Writes every MoE layer's experts as fp8 into `folder` (layer{N}.colibri.safetensors), with the
    layer's router; with `free`, each layer's bf16 experts are released once written (what the
    attention tier keeps is then the model without them)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = layer_config(model.config)
    F = config.intermediate_size
    start = time.perf_counter()
    blocks = moe_blocks(model)
    for n, (index, block) in enumerate(blocks.items()):
        experts = block.experts
        with torch.no_grad():
            gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2F, H], [E, H, F]
            codes, scales = [], []
            for w in (gate_up[:, :F], gate_up[:, F:], down):
                q, s = quantise_blocks(w)
                codes.append(q.view(torch.uint8).flatten(1))
                scales.append(s.flatten(1))
            packed = torch.cat(codes, 1).cpu().numpy()
            grid = torch.cat(scales, 1).cpu().numpy().astype(np.float32)
            router = block.gate.weight.float().cpu().numpy()
        checkpoint.save(folder / f"layer{index}.colibri.safetensors", config, packed, router,
                        extra_metadata={"source": "bench/ttft_model.py: Qwen3-MoE of random weights",
                                        "source_family": "qwen3_moe"}, expert_scales=grid)
        if free:
            experts.gate_up_proj = torch.nn.Parameter(gate_up.new_empty(0), requires_grad=False)
            experts.down_proj = torch.nn.Parameter(down.new_empty(0), requires_grad=False)
        log(f"packed layer {index} ({n + 1}/{len(blocks)}) in {time.perf_counter() - start:.0f} s")
    if free and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return config
