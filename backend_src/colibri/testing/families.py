"""Tiny random models of each MoE family pack knows, written by transformers itself (save_pretrained,
safetensors) with every MoE option of the family switched on: the models the family tests pack and
compare with the family's own MoE block. Needs torch and transformers (imported when a model is made)."""
import numpy as np

H = 32
COMMON = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_hidden_layers=2)
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
    # A small swiglu_limit so the clamps bite on these activations.
    "gpt_oss": (dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=24, head_dim=8,
                     swiglu_limit=0.9, swiglu_alpha=1.3),
                dict(routing="topk_softmax", activation="swiglu_oai", activation_limit=0.9, activation_alpha=1.3,
                     expert_bias=True, has_router_logit_bias=True)),
}


def moe_blocks(model):
    """Decoder layer index -> its MoE block (the layers whose mlp has experts)."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}


def write_model(family, folder):
    """The family's tiny random model (float32, eval mode), written into folder by save_pretrained;
    the same model for the same family every time."""
    import torch
    import transformers
    fields, _ = FAMILIES[family]
    torch.manual_seed(sum(family.encode()))
    config = transformers.AutoConfig.for_model(family, **COMMON, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for block in moe_blocks(model).values():
            for name, tensor in block.named_parameters():
                # Weights large enough that routing is clear and every part of the block matters.
                tensor.normal_(0.0, 0.5 if "bias" in name else 1.0 / np.sqrt(tensor.shape[-1]))
            gate = getattr(block, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                # A buffer, not a parameter: transformers leaves it at zero, which would hide its use.
                gate.e_score_correction_bias.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model
