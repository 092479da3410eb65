"""Every MoE family pack knows, checked against the family's own transformers code: a tiny random model
is written by transformers itself (save_pretrained, safetensors) with every MoE option of the family
switched on, packed (every MoE layer, with --verify), and each packed layer is compared on random
tokens with the model's own MoE block in fp32: (a) colibri.reference, (b) colibri's CPU layer, once the
library has colibri_moe_context_create. Tokens at a routing near-tie are left out (fp32 may choose
either side). Needs torch and transformers (skipped without them)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri import checkpoint, reference  # noqa: E402
from colibri._native import HAS_CONTEXT_CREATE  # noqa: E402
from colibri.pack import block_forward, pack, routing_ties  # noqa: E402
from colibri.testing import relative_error  # noqa: E402

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


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family -> (its model, the folder of packed layers, the configs pack returned), made once."""
    cache = {}

    def make(family):
        if family not in cache:
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
                        gate.e_score_correction_bias.normal_(0.0, 0.3)
            src = tmp_path_factory.mktemp(family)
            model.save_pretrained(src)
            out = tmp_path_factory.mktemp(f"{family}_packed")
            configs = pack(src, out / "layers", layer="all", verify=True, progress=False)
            cache[family] = (model, out / "layers", configs)
        return cache[family]
    return make


def compare(family, written, forward):
    model, folder, configs = written(family)
    blocks = moe_blocks(model)
    assert len(configs) == len(blocks) and sorted(p.name for p in folder.iterdir()) == \
        sorted(f"layer{i}.colibri.safetensors" for i in blocks)
    errors = []
    for index, block in blocks.items():
        path = folder / f"layer{index}.colibri.safetensors"
        x = np.random.default_rng(index).standard_normal((48, H)).astype(np.float32)
        keep = ~routing_ties(path, x)
        assert keep.sum() >= 40, "too many routing near-ties to compare"
        expected = block_forward(block, x)[keep]
        errors.append(relative_error(forward(path, x)[keep], expected))
    return max(errors)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_config(family, written):
    _, expected = FAMILIES[family]
    _, folder, configs = written(family)
    for config in configs:
        for field, value in expected.items():
            assert getattr(config, field) == value, field
        assert config.weight_dtype == "fp32" and config.hidden_size == H
    assert checkpoint.load(next(folder.iterdir())).metadata["source_family"] == family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_matches_transformers(family, written):
    error = compare(family, written,
                    lambda path, x: reference.checkpoint_forward(checkpoint.load(path), x.astype(np.float64)))
    assert error < 1e-5, f"{family}: reference vs transformers relative error {error:.3g}"


@pytest.mark.skipif(not HAS_CONTEXT_CREATE, reason="this libcolibri predates colibri_moe_context_create")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_colibri_cpu_matches_transformers(family, written):
    from colibri import MoELayer
    error = compare(family, written, lambda path, x: np.asarray(MoELayer.from_file(path).forward(x), np.float64))
    assert error < 1e-5, f"{family}: colibri CPU vs transformers relative error {error:.3g}"


def test_verify_refuses_a_wrong_packing(written, tmp_path, monkeypatch):
    """--verify catches a layer that differs from the model: here routing renormalised against the
    config (an override), so the packed file is deleted."""
    from colibri import ColibriError
    model, _, _ = written("qwen3_moe")
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "x.colibri.safetensors"
    with pytest.raises(ColibriError, match="differs from transformers' Qwen3MoeSparseMoeBlock"):
        pack(src, out, renormalize=True, unverified_routing=True, verify=True, progress=False)
    assert not out.exists()
