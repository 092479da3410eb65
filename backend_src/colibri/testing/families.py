"""Tiny random models of each MoE family pack knows, written by transformers itself (save_pretrained,
safetensors) with every MoE option of the family switched on: the models the family tests pack and
compare with the family's own MoE block; and the same models re-saved as the fp8 releases store their
experts (write_fp8_model). Needs torch and transformers (imported when a model is made)."""
import importlib
import json
import pathlib
import re

import numpy as np

H = 32
COMMON = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_hidden_layers=2,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)

# family -> (config fields beyond COMMON, what the packed LayerConfig must say)
FAMILIES = {
    "mixtral": (dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24),
                dict(routing="softmax_topk", renormalize=True, top_k=2)),
    "qwen2_moe": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                       shared_expert_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[0]),
                  dict(routing="softmax_topk", renormalize=True, shared_intermediate_size=40, shared_gate=True)),
    "qwen3_moe": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                       norm_topk_prob=False, decoder_sparse_step=2),
                  dict(routing="softmax_topk", renormalize=False)),
    "olmoe": (dict(num_experts=8, num_experts_per_tok=3, intermediate_size=24, norm_topk_prob=True),
              dict(routing="softmax_topk", renormalize=True)),
    "deepseek_v2": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                         n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                         routed_scaling_factor=1.7, first_k_dense_replace=1, q_lora_rank=None, **MLA),
                    dict(routing="softmax_topk", renormalize=False, n_group=4, topk_group=2, group_score="max",
                         routed_scaling_factor=1.7, shared_intermediate_size=48)),
    "deepseek_v3": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                         n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                         first_k_dense_replace=1, q_lora_rank=16, **MLA),
                    dict(routing="sigmoid_bias", renormalize=True, n_group=4, topk_group=2, group_score="top2_sum",
                         routed_scaling_factor=2.5, shared_intermediate_size=48)),
    "glm4_moe": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                      n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                      first_k_dense_replace=1, head_dim=8),
                 dict(routing="sigmoid_bias", renormalize=True, n_group=2, topk_group=1, group_score="top2_sum",
                      routed_scaling_factor=1.5, shared_intermediate_size=24)),
    # The released models' clamped SwiGLU (config.json swiglu_limit 7.0, no swiglu_alpha: 1.702), which every
    # transformers computes alike; GAINS makes the clamps bite. Other values: GPT_OSS_SWIGLU.
    "gpt_oss": (dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=24, head_dim=8, swiglu_limit=7.0),
                dict(routing="topk_softmax", activation="swiglu_oai", activation_limit=7.0, activation_alpha=1.702,
                     expert_bias=True, has_router_logit_bias=True)),
    # The families below compute one of the blocks above under another name and other defaults.
    "minimax": (dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24), dict(routing="softmax_topk")),
    "qwen3_next": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                        shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[0],
                        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, head_dim=8, layer_types=["linear_attention", "full_attention"]),
                   dict(routing="softmax_topk", renormalize=False, shared_intermediate_size=40, shared_gate=True)),
    "glm4v_moe_text": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                            n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                            first_k_dense_replace=1, head_dim=8),
                       dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=1.5,
                            shared_intermediate_size=24)),
    "qwen3_vl_moe_text": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                               mlp_only_layers=[0], head_dim=8),
                          dict(routing="softmax_topk", renormalize=True)),
    "qwen3_5_moe_text": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                              shared_expert_intermediate_size=40, linear_num_value_heads=2, linear_num_key_heads=2,
                              linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8,
                              layer_types=["linear_attention", "full_attention"]),
                         dict(routing="softmax_topk", renormalize=True, shared_intermediate_size=40, shared_gate=True)),
    "mellum": (dict(num_local_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                    norm_topk_prob=False, mlp_layer_types=["dense", "sparse"]),
               dict(routing="softmax_topk", renormalize=False)),
    "flex_olmo": (dict(num_experts=8, num_experts_per_tok=3, intermediate_size=24, norm_topk_prob=True),
                  dict(routing="softmax_topk", renormalize=True)),
    "deepseek_v32": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                          n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                          first_k_dense_replace=1, q_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
                          **MLA),
                     dict(routing="sigmoid_bias", n_group=4, topk_group=2, group_score="top2_sum",
                          routed_scaling_factor=2.5, shared_intermediate_size=48)),
    "glm_moe_dsa": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                         n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                         first_k_dense_replace=1, q_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
                         **MLA),
                    dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=1.5,
                         shared_intermediate_size=24)),
    "dots1": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                   n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=1.3, norm_topk_prob=True,
                   first_k_dense_replace=1),
              dict(routing="sigmoid_bias", renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=1.3,
                   shared_intermediate_size=48)),
    "kimi_linear": (dict(num_experts=8, num_experts_per_token=3, moe_intermediate_size=24, intermediate_size=40,
                         num_shared_experts=2, num_expert_group=4, topk_group=2, routed_scaling_factor=2.0,
                         moe_renormalize=True, mlp_layer_types=["dense", "sparse"], head_dim=8),
                    dict(routing="sigmoid_bias", renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.0,
                         shared_intermediate_size=48)),
    "glm4_moe_lite": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                           n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                           mlp_layer_types=["dense", "sparse"], q_lora_rank=16, **MLA),
                      dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=1.5,
                           shared_intermediate_size=24)),
    "solar_open": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                        n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                        head_dim=8),
                   dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=1.5,
                        shared_intermediate_size=48)),
    "minicpm5_moe": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                          n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0, norm_topk_prob=True,
                          mlp_layer_types=["dense", "sparse"]),
                     dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=2.0,
                          shared_intermediate_size=24)),
    "exaone_moe": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                        num_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        first_k_dense_replace=1, head_dim=8),
                   dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                        shared_intermediate_size=48)),
    "mimo_v2_flash": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                           n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, head_dim=8,
                           mlp_layer_types=["dense", "sparse"]),
                      dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=1.5,
                           shared_intermediate_size=0)),
    "param2moe": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                       n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                       first_k_dense_replace=1, head_dim=8),
                  dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=1.5,
                       shared_intermediate_size=48)),
    "sarvam_moe": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                        n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                        first_k_dense_replace=1, head_dim=8),
                   dict(routing="sigmoid_bias", n_group=2, topk_group=1, routed_scaling_factor=1.5,
                        shared_intermediate_size=48)),
    "sarvam_mla": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        first_k_dense_replace=1, q_lora_rank=16, **MLA),
                   dict(routing="sigmoid_bias", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        shared_intermediate_size=48)),
    "cohere2_moe": (dict(num_experts=8, num_experts_per_tok=3, intermediate_size=24, num_shared_experts=2,
                         shared_expert_combination_strategy="sum", expert_selection_fn="softmax", head_dim=8),
                    dict(routing="topk_softmax", renormalize=False, shared_intermediate_size=48)),
    "granitemoe": (dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=24),
                   dict(routing="topk_softmax", renormalize=False)),
    "afmoe": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                   num_shared_experts=2, route_scale=1.7, num_dense_layers=1, head_dim=8),
              dict(routing="sigmoid_bias", renormalize=True, routed_scaling_factor=1.7, shared_intermediate_size=48)),
    "beam": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, mlp_layer_types=["dense", "sparse"],
                  head_dim=8),
             dict(routing="sigmoid_bias", renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  shared_intermediate_size=0)),
    "jamba": (dict(num_experts=8, num_experts_per_tok=3, intermediate_size=24, expert_layer_period=2,
                   expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0, mamba_d_state=4, mamba_d_conv=2,
                   mamba_expand=1, mamba_dt_rank=4, use_mamba_kernels=False),
              dict(routing="softmax_topk", renormalize=False)),
    "mistral4": (dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                      n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=True, first_k_dense_replace=1,
                      q_lora_rank=16, **MLA),
                 dict(routing="softmax_topk", renormalize=True, routed_scaling_factor=1.5,
                      shared_intermediate_size=48)),
    "minimax_m2": (dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=24, head_dim=8),
                   dict(routing="sigmoid_bias", renormalize=True)),
    "hy_v3": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                   num_shared_experts=2, router_scaling_factor=1.7, mlp_layer_types=["dense", "sparse"], head_dim=8),
              dict(routing="sigmoid_bias", renormalize=True, routed_scaling_factor=1.7, shared_intermediate_size=48)),
    "laguna": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                    shared_expert_intermediate_size=40, moe_routed_scaling_factor=1.7,
                    mlp_layer_types=["dense", "sparse"], head_dim=8),
               dict(routing="sigmoid_bias", renormalize=True, routed_scaling_factor=1.7, shared_intermediate_size=40)),
    "flint": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                   shared_expert_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[0], head_dim=8),
              dict(routing="sigmoid_bias", renormalize=True, shared_intermediate_size=40, shared_gate=False)),
    "lfm2_moe": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                      norm_topk_prob=True, routed_scaling_factor=1.7, use_expert_bias=True, num_dense_layers=1,
                      layer_types=["full_attention", "conv"]),
                 dict(routing="sigmoid_bias", renormalize=True, routed_scaling_factor=1.7)),
    "hunyuan_v1_moe": (dict(num_experts=8, moe_topk=3, intermediate_size=24, head_dim=8),
                       dict(routing="softmax_topk", renormalize=True, top_k=3, shared_intermediate_size=24)),
    "lara_mini": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, norm_topk_prob=False, head_dim=8),
                  dict(routing="softmax_topk", renormalize=False, shared_intermediate_size=40, shared_gate=False)),
}
# Factors on write_model's weights, by family and parameter: gpt-oss's gate_up_proj large enough that a good
# share of gate and up values on unit tokens pass the limit 7 (tests/test_families.py checks that share).
GAINS = {"gpt_oss": {"experts.gate_up_proj": 7.0}}
# A clamped SwiGLU other than the released one (config.json overrides), which older transformers ignore: their
# GptOssExperts fixes 1.702 and 7.0.
GPT_OSS_SWIGLU = dict(swiglu_limit=5.0, swiglu_alpha=1.3)


# Families written as the multimodal model around them (their text_config), as released: family -> the
# multimodal model_type.
WRAPPERS = {"qwen3_vl_moe_text": "qwen3_vl_moe", "glm4v_moe_text": "glm4v_moe", "qwen3_5_moe_text": "qwen3_5_moe"}
CAUSAL_LM = {"mistral4": ("mistral4", "Mistral4ForCausalLM")}
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=H)


def moe_blocks(model):
    """Decoder layer index -> its MoE block (the layers whose mlp, feed_forward or block_sparse_moe has experts)."""
    blocks = {}
    decoder = getattr(model.model, "language_model", model.model)
    for i, layer in enumerate(decoder.layers):
        block = next((getattr(layer, name) for name in ("mlp", "feed_forward", "block_sparse_moe")
                      if hasattr(getattr(layer, name, None), "experts")), None)
        if block is not None:
            blocks[i] = block
    return blocks


def write_model(family, folder, **overrides):
    """The family's tiny random model (float32, eval mode), written into folder by save_pretrained;
    the same model for the same family (and overrides of its config fields) every time."""
    import torch
    import transformers
    fields, _ = FAMILIES[family]
    torch.manual_seed(sum(family.encode()))
    text = {**COMMON, **fields, **overrides}
    if family in WRAPPERS:
        config = transformers.AutoConfig.for_model(WRAPPERS[family], text_config=text,
                                                   vision_config=TINY_VISION)
        model = transformers.AutoModelForImageTextToText.from_config(config).float().eval()
    else:
        config = transformers.AutoConfig.for_model(family, **text)
        if family in CAUSAL_LM:  # not in AutoModelForCausalLM's mapping
            module, name = CAUSAL_LM[family]
            model = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
        model = model.float().eval()
    with torch.no_grad():
        for block in moe_blocks(model).values():
            for name, tensor in block.named_parameters():
                # Weights large enough that routing is clear and every part of the block matters.
                tensor.normal_(0.0, 0.5 if "bias" in name else 1.0 / np.sqrt(tensor.shape[-1]))
                tensor.mul_(GAINS.get(family, {}).get(name, 1.0))
            for name, buffer in block.named_buffers():
                if name.endswith(("e_score_correction_bias", "expert_bias")):
                    # A buffer, not a parameter: transformers leaves it at zero, which would hide its use.
                    buffer.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model


# How the fp8 releases store a quantised projection <proj>.weight [N, K] (F8_E4M3) beside it, and the
# quantization_config in their config.json (colibri/pack/formats.py reads each).
FP8_RELEASES = {
    # DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8: 128 x 128 blocks, weight_scale_inv [ceil(N/bn), ceil(K/bk)]
    "block": lambda block: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": list(block)},
    # AutoFP8 (e.g. Mixtral-8x7B-Instruct-v0.1-FP8): weight_scale [] and a static input_scale []
    "tensor": lambda block: {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    # fbgemm_fp8: weight_scale [N, 1], activations quantised per row with an upper bound
    "channel": lambda block: {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                              "modules_to_not_convert": ["lm_head"]},
    # compressed-tensors "channel" strategy: weight_scale [N, 1], dynamic per-token activations
    "compressed-tensors": lambda block: {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                  "symmetric": True, "dynamic": False},
                                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                            "symmetric": True, "dynamic": True}}}},
}
# The projections of routed and shared experts (Mixtral's w1/w3/w2; the others' gate/up/down_proj).
EXPERT_WEIGHT = re.compile(r"\.(experts\.\d+\.(w[123]|(gate|up|down)_proj)|shared_experts?\.(gate|up|down)_proj)"
                           r"\.weight$")


def write_fp8_model(family, folder, release="block", block=(128, 128), **overrides):
    """write_model's model, its experts' projections (routed and shared) then re-saved as the fp8
    release `release` (FP8_RELEASES) stores them: quantised by torch (scale = amax / 448 per block, row or
    tensor; torch.float8_e4m3fn rounding), written by the safetensors library, with config.json's
    quantization_config. Returns (model, dequantised): each quantised weight's name -> the float32 values
    its codes and scales stand for (torch's float32 product), the weights of the layer of record."""
    import torch
    from safetensors.torch import load_file, save_file
    folder = pathlib.Path(folder)
    model = write_model(family, folder, **overrides)
    path = folder / "model.safetensors"
    tensors, dequantised = load_file(path), {}
    bn, bk = {"block": block, "tensor": (0, 0)}.get(release, (1, 0))
    rng = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if EXPERT_WEIGHT.search(n)]:
        weight = tensors[name].float()
        (N, K), stem = weight.shape, name[:-len("weight")]
        rows, cols = -(-N // (bn or N)), -(-K // (bk or K))
        padded = torch.zeros(rows * (bn or N), cols * (bk or K))
        padded[:N, :K] = weight.abs()
        amax = padded.reshape(rows, bn or N, cols, bk or K).amax(dim=(1, 3))
        grid = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        scale = grid.repeat_interleave(bn or N, 0)[:N].repeat_interleave(bk or K, 1)[:, :K]
        codes = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name] = codes
        dequantised[name] = (codes.float() * scale).numpy()
        if release == "block":
            tensors[name + "_scale_inv"] = grid
        elif release == "tensor":
            tensors[stem + "weight_scale"] = grid.reshape(())
            tensors[stem + "input_scale"] = torch.rand((), generator=rng) + 0.5  # calibrated: unused by Colibri
        else:
            tensors[stem + "weight_scale"] = grid.reshape(N, 1)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = FP8_RELEASES[release](block)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return model, dequantised


def dequantized_block(family, folder, layer, dequantised):
    """transformers' MoE block of `family` (fp32) for decoder layer `layer` of the fp8 model written into
    folder (write_fp8_model), loaded with that block's tensors, the quantised ones dequantised."""
    from safetensors.torch import load_file

    from colibri.pack import transformers_block
    config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    ours = [n for n in dequantised if f"layers.{layer}." in n]
    base = re.split(r"\.(?:experts|shared_experts?)\.", ours[0])[0] + "."
    tensors = {}
    for name, value in load_file(pathlib.Path(folder) / "model.safetensors").items():
        if name.startswith(base) and not name.endswith(("_scale", "_scale_inv")):
            tensors[name[len(base):]] = dequantised[name] if name in dequantised else value.float().numpy()
    return transformers_block(family, config, tensors)
