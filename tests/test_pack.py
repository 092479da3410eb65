"""The packer on small Hugging Face checkpoints written here in the three layouts (Mixtral naming,
Qwen/DeepSeek naming, the fused gate_up_proj layout), sharded with an index or as a folder, each
with its config.json; packed through the CLI and the function, loaded, and checked against a forward
computed from the original HF tensors. Also the refusals (unknown or unsupported families, dense
layers, tensors a family does not use, overrides without --unverified-routing, missing tensors,
pickles, inconsistent dtypes). tests/test_families.py checks each family against transformers."""
import json
import os
import pathlib

import numpy as np
import pytest

import colibri
from colibri import reference
from colibri import safetensors_io as st
from colibri.dtypes import from_float, to_float64
from colibri.pack import pack
from colibri.pack.families import FAMILIES
from colibri.testing import assert_close, error_limit, random_hidden

ST_DTYPE = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}


def hf_weights(rng, E, H, F):
    return dict(gate=rng.standard_normal((E, F, H)) / np.sqrt(H), up=rng.standard_normal((E, F, H)) / np.sqrt(H),
                down=rng.standard_normal((E, H, F)) / np.sqrt(F), router=rng.standard_normal((E, H)) / np.sqrt(H),
                bias=0.3 * rng.standard_normal(E))


def hf_tensors(w, layout, dtype, layer=1, with_bias=False, shared=None):
    """The HF tensor names of a 3-layer model whose layer `layer` is the MoE layer (layer 0 dense);
    shared: (module name, Fs) of shared experts to add."""
    def stored(a):
        return ST_DTYPE[dtype], from_float(np.asarray(a, np.float32), dtype)
    E, F, H = w["gate"].shape
    tensors = {"model.embed_tokens.weight": stored(np.zeros((11, H))),
               "model.layers.0.mlp.gate_proj.weight": stored(np.zeros((F, H))),
               "model.layers.0.self_attn.q_proj.weight": stored(np.zeros((H, H)))}
    block = "block_sparse_moe" if layout == "mixtral" else "mlp"
    base = f"model.layers.{layer}.{block}."
    tensors[base + "gate.weight"] = stored(w["router"])
    if with_bias:
        tensors[base + "gate.e_score_correction_bias"] = ("F32", w["bias"].astype(np.float32))
    if layout == "fused":
        tensors[base + "experts.gate_up_proj"] = stored(np.concatenate([w["gate"], w["up"]], axis=1))
        tensors[base + "experts.down_proj"] = stored(w["down"])
    else:
        names = ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for m in range(E):
            for name, part in zip(names, ("gate", "up", "down")):
                tensors[base + f"experts.{m}.{name}.weight"] = stored(w[part][m])
    if shared:
        name, Fs = shared
        for part, shape in (("gate", (Fs, H)), ("up", (Fs, H)), ("down", (H, Fs))):
            tensors[base + f"{name}.{part}_proj.weight"] = stored(w.get(f"shared_{part}", np.ones(shape)))
    tensors[f"model.layers.{layer + 1}.self_attn.q_proj.weight"] = stored(np.zeros((H, H)))
    return tensors


def write_hf(folder: pathlib.Path, tensors, config, shards=2, index=True):
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        st.write(folder / shard, part, {"format": "pt"})
        weight_map.update({n: shard for n in part})
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def hf_forward(w, dtype, x64, ids, weights):
    """The MoE layer computed straight from the HF tensors (as stored), independent of the packer."""
    q = {k: to_float64(from_float(np.asarray(w[k], np.float32), dtype), dtype) for k in ("gate", "up", "down")}
    out = np.zeros_like(x64)
    for t in range(len(x64)):
        for e, wt in zip(ids[t], weights[t]):
            g = q["gate"][e] @ x64[t]
            out[t] += wt * (q["down"][e] @ (g / (1 + np.exp(-g)) * (q["up"][e] @ x64[t])))
    return out


def check_packed(path, w, src_dtype, packed_dtype, expected, rng):
    layer = colibri.MoELayer.from_file(path)
    for field, value in expected.items():
        assert getattr(layer.config, field) == value, field
    stored, x64 = random_hidden(rng, 33, layer.config.hidden_size, "fp32")
    router = to_float64(from_float(np.asarray(w["router"], np.float32), src_dtype), src_dtype)
    bias = w["bias"].astype(np.float32) if layer.config.routing == "sigmoid_bias" else None
    ids, weights, scores = reference.route(layer.config, x64, router, bias)
    lib_ids, _ = layer.route(stored)
    near = reference.topk_margin(scores, layer.config.top_k) <= 1e-5
    assert (lib_ids[~near] == ids[~near]).all()
    ids = np.where(near[:, None], lib_ids, ids)
    weights = reference.routing_weights(layer.config, reference.router_logits(x64, router), ids)
    assert_close(layer.forward(stored), hf_forward(w, src_dtype, x64, ids, weights),
                 error_limit(src_dtype, packed_dtype), "packed layer vs the HF tensors")


def test_mixtral_index_via_cli(rng, tmp_path, colibri_cli):
    w = hf_weights(rng, 8, 48, 40)
    src = write_hf(tmp_path / "mixtral", hf_tensors(w, "mixtral", "bf16"),
                   {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                    "hidden_size": 48, "intermediate_size": 40}, shards=3)
    out = tmp_path / "mixtral.colibri.safetensors"
    result = colibri_cli("pack", src / "model.safetensors.index.json", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "packing layer 1 experts" in result.stderr and "8/8" in result.stderr
    check_packed(out, w, "bf16", "bf16", dict(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40,
                                              weight_dtype="bf16", routing="softmax_topk", renormalize=True), rng)
    info = colibri_cli("info", out)
    assert info.returncode == 0 and "source_layout" in info.stdout and "mixtral" in info.stdout


@pytest.mark.parametrize("dtype", ["keep", "fp32"])
def test_qwen_folder_via_function(rng, tmp_path, dtype):
    w = hf_weights(rng, 6, 32, 24)
    src = write_hf(tmp_path / "qwen", hf_tensors(w, "qwen", "fp16"),
                   {"model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": False,
                    "hidden_size": 32, "intermediate_size": 5632, "moe_intermediate_size": 24}, index=False)
    out = tmp_path / "qwen.colibri.safetensors"
    config = pack(src, out, dtype=dtype, progress=False)
    packed = "fp16" if dtype == "keep" else dtype
    assert config.weight_dtype == packed
    check_packed(out, w, "fp16", packed, dict(num_experts=6, top_k=3, routing="softmax_topk", renormalize=False), rng)


def test_deepseek_v3_without_scoring_func_packs_sigmoid(rng, tmp_path):
    """transformers writes DeepSeek-V3's config.json without scoring_func or topk_method: still sigmoid
    scores with the correction bias, group top-2 sums and the shared experts."""
    w = hf_weights(rng, 8, 32, 16)
    w.update(shared_gate=rng.standard_normal((32, 32)), shared_up=rng.standard_normal((32, 32)),
             shared_down=rng.standard_normal((32, 32)))
    src = write_hf(tmp_path / "ds", hf_tensors(w, "qwen", "bf16", layer=1, with_bias=True, shared=("shared_experts", 32)),
                   {"model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 4,
                    "routed_scaling_factor": 2.5, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
                    "first_k_dense_replace": 1, "num_hidden_layers": 3, "hidden_size": 32, "moe_intermediate_size": 16})
    out = tmp_path / "ds.colibri.safetensors"
    config = pack(src, out, progress=False)
    assert (config.routing, config.renormalize, config.routed_scaling_factor, config.top_k) == ("sigmoid_bias", True, 2.5, 4)
    assert (config.n_group, config.topk_group, config.group_score, config.shared_intermediate_size) == (4, 2, "top2_sum", 32)
    ckpt = colibri.checkpoint.load(out)
    assert (ckpt.router_bias == w["bias"].astype(np.float32)).all()
    shared = np.concatenate([from_float(w[f"shared_{p}"].astype(np.float32), "bf16").reshape(-1) for p in ("gate", "up", "down")])
    assert (np.asarray(ckpt.shared_expert) == shared).all()


@pytest.mark.parametrize("dtype", ["keep", "bf16"])
def test_fused_layout_single_file(rng, tmp_path, dtype, colibri_cli):
    w = hf_weights(rng, 4, 40, 24)
    folder = tmp_path / "fused"
    folder.mkdir()
    st.write(folder / "model.safetensors", hf_tensors(w, "fused", "fp32"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                                    "norm_topk_prob": True, "hidden_size": 40,
                                                    "moe_intermediate_size": 24}))
    out = tmp_path / "fused.colibri.safetensors"
    result = colibri_cli("pack", folder / "model.safetensors", "--out", out, "--dtype", dtype, "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    packed = "fp32" if dtype == "keep" else dtype
    check_packed(out, w, "fp32", packed, dict(num_experts=4, routing="softmax_topk", renormalize=True,
                                              weight_dtype=packed), rng)


def test_overrides_and_layer_choice(rng, tmp_path):
    w = hf_weights(rng, 4, 16, 8)
    tensors = {**hf_tensors(w, "qwen", "fp32", layer=1), **hf_tensors(w, "qwen", "fp32", layer=3)}
    src = write_hf(tmp_path / "m", tensors, {"num_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(colibri.ColibriError, match="--top-k, --routing, --renormalize, --routed-scaling-factor may "
                                                   "make the layer compute something other than the model"):
        pack(src, tmp_path / "a.colibri.safetensors", layer=3, top_k=3, routing="topk_softmax", renormalize=True,
             routed_scaling_factor=0.5, progress=False)
    config = pack(src, tmp_path / "a.colibri.safetensors", layer=3, top_k=3, routing="topk_softmax",
                  renormalize=True, routed_scaling_factor=0.5, progress=False, unverified_routing=True)
    assert (config.top_k, config.routing, config.renormalize, config.routed_scaling_factor) == (3, "topk_softmax", True, 0.5)
    assert colibri.checkpoint.load(tmp_path / "a.colibri.safetensors").metadata["source_layer"] == "model.layers.3.mlp"
    with pytest.raises(colibri.ColibriError, match="layer 0 is not an MoE layer; MoE layers: 1, 3"):
        pack(src, tmp_path / "b.colibri.safetensors", layer=0, progress=False, unverified_routing=True)
    assert "unverified" in colibri.checkpoint.load(tmp_path / "a.colibri.safetensors").metadata["source_family"]


# ---------------------------------------------------------------------------------------------------
# Refusals


def small_qwen(rng, tmp_path, mutate=None, config=None, dtype="fp32"):
    w = hf_weights(rng, 4, 16, 8)
    tensors = hf_tensors(w, "qwen", dtype)
    if mutate:
        mutate(tensors)
    return write_hf(tmp_path / "src", tensors,
                    config or {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 8})


@pytest.mark.parametrize("extra", ["mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                                   "mlp.shared_expert_gate.weight", "mlp.gate.bias", "mlp.gate.e_score_correction_bias",
                                   "mlp.experts.0.gate_proj.bias"])
def test_tensors_the_family_does_not_use_refused(rng, tmp_path, extra, colibri_cli):
    """A qwen3_moe block has no shared expert, router bias or expert biases: one in the file is refused,
    never silently dropped (the v1 packer ignored some of these)."""
    src = small_qwen(rng, tmp_path, lambda t: t.update({f"model.layers.1.{extra}": ("F32", np.zeros((8, 16), np.float32))}))
    result = colibri_cli("pack", src, "--out", tmp_path / "x.colibri.safetensors")
    assert result.returncode == 1
    assert "a tensor of the MoE block that qwen3_moe's layer does not use" in result.stderr and extra in result.stderr
    assert not (tmp_path / "x.colibri.safetensors").exists()


@pytest.mark.parametrize("model_type, message", [
    ("phimoe", "PhiMoE's sparsemixer routing is not implemented"),
    ("kimi_k2", "transformers has no kimi_k2 model"),
    ("jetmoe", "JetMoE's attention experts (mixture of attention heads, MoA)"),
    ("my_moe", f"model_type 'my_moe' is not a family pack knows (supported: {', '.join(FAMILIES)}); pass "
               "--unverified-routing"),
    (None, f"config.json has no model_type (supported: {', '.join(FAMILIES)}); pass --unverified-routing to pack it "
           "anyway")])
def test_unsupported_families_refused(rng, tmp_path, colibri_cli, model_type, message):
    config = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2}
    if model_type:
        config["model_type"] = model_type
    src = small_qwen(rng, tmp_path, config=config)
    result = colibri_cli("pack", src, "--out", tmp_path / "x.colibri.safetensors")
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "x.colibri.safetensors").exists()
    if model_type in ("phimoe", "jetmoe"):  # no override packs a family that needs a missing feature
        with pytest.raises(colibri.ColibriError, match=message.split(" (")[0]):
            pack(src, tmp_path / "x.colibri.safetensors", progress=False, unverified_routing=True)
    elif model_type == "my_moe":
        assert pack(src, tmp_path / "x.colibri.safetensors", progress=False, unverified_routing=True).top_k == 2


def test_dense_layers_refused(rng, tmp_path):
    w = hf_weights(rng, 4, 16, 8)
    base = {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
            "topk_group": 1, "n_shared_experts": 1, "num_hidden_layers": 3, "moe_intermediate_size": 8}
    tensors = hf_tensors(w, "qwen", "fp32", layer=1, with_bias=True, shared=("shared_experts", 8))
    src = write_hf(tmp_path / "a", tensors, {**base, "first_k_dense_replace": 1})
    with pytest.raises(colibri.ColibriError, match=r"layer 0 is a dense layer \(first_k_dense_replace=1\): it has no "
                                                   "experts to pack; MoE layers here: 1"):
        pack(src, tmp_path / "x.colibri.safetensors", layer=0, progress=False)
    src = write_hf(tmp_path / "b", tensors, {**base, "first_k_dense_replace": 2})
    with pytest.raises(colibri.ColibriError, match="layer 1 has MoE tensors but config.json makes it dense"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)
    src = write_hf(tmp_path / "c", tensors, {**base, "first_k_dense_replace": 1, "num_hidden_layers": 1})
    with pytest.raises(colibri.ColibriError, match="layer 1 is beyond config.json num_hidden_layers=1"):
        pack(src, tmp_path / "x.colibri.safetensors", layer=1, progress=False)


def test_config_semantics_refused(rng, tmp_path):
    """Settings whose meaning transformers and the model's own code disagree on, or that Colibri lacks."""
    w = hf_weights(rng, 4, 16, 8)
    tensors = hf_tensors(w, "qwen", "fp32", layer=1, shared=("shared_experts", 16))
    v2 = {"model_type": "deepseek_v2", "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2,
          "moe_intermediate_size": 8, "num_hidden_layers": 3}
    for change, message in (({"norm_topk_prob": True}, "never does"), ({"mlp_bias": True}, "mlp_bias=true"),
                            ({"moe_layer_freq": 2}, "moe_layer_freq=2"), ({"hidden_act": "gelu"}, "SiLU only"),
                            ({"topk_method": "noaux_tc"}, "greedy and group_limited_greedy only")):
        src = write_hf(tmp_path / str(len(message)), tensors, {**v2, **change})
        with pytest.raises(colibri.ColibriError, match=message):
            pack(src, tmp_path / "x.colibri.safetensors", progress=False)
    assert pack(write_hf(tmp_path / "ok", tensors, v2), tmp_path / "x.colibri.safetensors",
                progress=False).shared_intermediate_size == 16
    src = write_hf(tmp_path / "v3", hf_tensors(w, "qwen", "fp32", with_bias=True, shared=("shared_experts", 8)),
                   {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                    "scoring_func": "softmax", "moe_intermediate_size": 8, "first_k_dense_replace": 1})
    with pytest.raises(colibri.ColibriError, match="scoring_func='softmax': transformers' deepseek_v3 router is sigmoid"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)


def test_gpt_oss_mxfp4_refused(tmp_path):
    E, H, F = 4, 64, 32
    base = "model.layers.0.mlp."
    tensors = {base + "router.weight": np.zeros((E, H), np.float32), base + "router.bias": np.zeros(E, np.float32),
               base + "experts.gate_up_proj_blocks": np.zeros((E, 2 * F, H // 32, 16), np.uint8),
               base + "experts.gate_up_proj_scales": np.zeros((E, 2 * F, H // 32), np.uint8)}
    src = write_hf(tmp_path / "oss", tensors, {"model_type": "gpt_oss", "num_local_experts": E, "intermediate_size": F,
                                               "hidden_size": H, "num_experts_per_tok": 2}, shards=1)
    with pytest.raises(colibri.ColibriError, match="config.json has no quantization_config with quant_method .mxfp4."):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)


def test_all_layers_via_cli(rng, tmp_path, colibri_cli):
    w = hf_weights(rng, 4, 16, 8)
    tensors = {**hf_tensors(w, "qwen", "fp32", layer=1), **hf_tensors(w, "qwen", "fp32", layer=3)}
    src = write_hf(tmp_path / "m", tensors, {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                             "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                             "moe_intermediate_size": 8})
    result = colibri_cli("pack", src, "--out", tmp_path / "layers", "--layer", "all")
    assert result.returncode == 0, result.stderr
    assert "wrote 2 layers" in result.stdout and "packing layer 3 experts" in result.stderr
    assert sorted(p.name for p in (tmp_path / "layers").iterdir()) == ["layer1.colibri.safetensors",
                                                                       "layer3.colibri.safetensors"]
    with pytest.raises(colibri.ColibriError, match=r"layer 2 is a dense layer \(decoder_sparse_step=2"):
        pack(src, tmp_path / "x.colibri.safetensors", layer=2, progress=False)


def test_missing_expert_tensor_named(rng, tmp_path):
    src = small_qwen(rng, tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(colibri.ColibriError, match=r"missing expert tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)


def test_wrong_shape_named(rng, tmp_path):
    def bad(t):
        t["model.layers.1.mlp.experts.2.down_proj.weight"] = ("F32", np.zeros((8, 16), np.float32))
    src = small_qwen(rng, tmp_path, bad)
    with pytest.raises(colibri.ColibriError, match=r"experts\.2\.down_proj\.weight: shape \[8, 16\], expected \[16, 8\]"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)


def test_inconsistent_dtype_refused(rng, tmp_path):
    def bad(t):
        t["model.layers.1.mlp.experts.1.gate_proj.weight"] = ("F16", np.zeros((8, 16), np.float16))
    src = small_qwen(rng, tmp_path, bad)
    with pytest.raises(colibri.ColibriError, match="expert weights: inconsistent dtypes F16, F32"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)


def test_config_mismatch_and_missing_top_k(rng, tmp_path):
    src = small_qwen(rng, tmp_path, config={"model_type": "qwen3_moe", "num_experts": 5, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 8})
    with pytest.raises(colibri.ColibriError, match=r"config.json gives num_experts=5 but model.layers.1.mlp.gate.weight "
                                                   r"has shape \[4, 16\]"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)
    os.remove(src / "config.json")
    with pytest.raises(colibri.ColibriError, match="no config.json beside the weights"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False)
    with pytest.raises(colibri.ColibriError, match="top_k unknown"):
        pack(src, tmp_path / "x.colibri.safetensors", progress=False, unverified_routing=True)
    assert pack(src, tmp_path / "x.colibri.safetensors", top_k=2, progress=False, unverified_routing=True).top_k == 2


def test_pickles_refused(tmp_path, colibri_cli):
    folder = tmp_path / "pt"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")
    (folder / "config.json").write_text("{}")
    for src in (folder, folder / "pytorch_model.bin"):
        result = colibri_cli("pack", src, "--out", tmp_path / "x.colibri.safetensors")
        assert result.returncode == 1 and "never loads" in result.stderr and "pickle" in result.stderr


def dense_tensors(H=16, F=24, layers=2):
    """A dense Llama-style decoder's tensors: attention and a gate/up/down MLP in every layer."""
    tensors = {"model.embed_tokens.weight": np.zeros((11, H), np.float32), "lm_head.weight": np.zeros((11, H), np.float32)}
    for i in range(layers):
        for name, shape in (("self_attn.q_proj", (H, H)), ("mlp.gate_proj", (F, H)), ("mlp.up_proj", (F, H)),
                            ("mlp.down_proj", (H, F))):
            tensors[f"model.layers.{i}.{name}.weight"] = np.zeros(shape, np.float32)
    return tensors


@pytest.mark.parametrize("config", [{"model_type": "llama", "num_hidden_layers": 2}, {"model_type": "qwen2"}, None],
                         ids=["llama", "qwen2", "no-config"])
@pytest.mark.parametrize("options", [[], ["--unverified-routing"], ["--unverified-routing", "--top-k", "2"],
                                     ["--top-k", "2"], ["--layer", "all"]], ids=" ".join)
def test_a_dense_model_is_refused_at_once(tmp_path, colibri_cli, config, options):
    """A dense model has nothing to pack: the first answer says so, whatever else was or was not given
    (it used to advise --unverified-routing, then --top-k, before saying there is no MoE layer)."""
    src = tmp_path / "dense"
    src.mkdir()
    st.write(src / "model.safetensors", dense_tensors())
    if config is not None:
        (src / "config.json").write_text(json.dumps(config))
    result = colibri_cli("pack", src, "--out", tmp_path / "x.colibri.safetensors", *options)
    model = f"model_type '{config['model_type']}'; " if config else ""
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"colibri pack: invalid argument: {src}: no MoE layer found: a dense model ({model}none of its 10 tensors "
        "is an expert or a router like model.layers.N.mlp.experts.M.gate_proj.weight); pack converts MoE layers "
        "only"], result.stderr
    assert not (tmp_path / "x.colibri.safetensors").exists()


def test_no_moe_layer_where_the_config_says_moe_or_experts_elsewhere(rng, tmp_path):
    """Without tensors pack reads as MoE, the message tells a shard of an MoE model, and expert tensors
    in a layout pack does not read, from a dense model."""
    shard = tmp_path / "shard"
    shard.mkdir()
    st.write(shard / "model-00001-of-00002.safetensors", dense_tensors(layers=1))
    (shard / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 4}))
    with pytest.raises(colibri.ColibriError, match="no MoE layer found in these 6 tensors, though config.json's "
                                                   "model_type 'mixtral' is an MoE family; pass the whole model"):
        pack(shard / "model-00001-of-00002.safetensors", tmp_path / "x.colibri.safetensors", progress=False)
    st.write(tmp_path / "dbrx.safetensors", {"transformer.blocks.0.ffn.experts.mlp.w1": np.zeros((4, 4), np.float32)})
    with pytest.raises(colibri.ColibriError, match=r"no MoE layer pack can read: expert tensors such as "
                                                   r"transformer\.blocks\.0\.ffn\.experts\.mlp\.w1 are not under"):
        pack(tmp_path / "dbrx.safetensors", tmp_path / "x.colibri.safetensors", progress=False,
             unverified_routing=True, top_k=2)


@pytest.mark.parametrize("config", [{"model_type": "my_moe", "num_local_experts": 4}, None], ids=["my_moe", "no-config"])
def test_an_unknown_family_is_told_everything_it_needs_at_once(rng, tmp_path, colibri_cli, config):
    """An MoE model of no family pack knows, without num_experts_per_tok: the first refusal names both
    --unverified-routing and --top-k, and following it packs the layer."""
    src = write_hf(tmp_path / "src", hf_tensors(hf_weights(rng, 4, 16, 8), "qwen", "fp32"), config or {})
    if config is None:
        (src / "config.json").unlink()
    out = tmp_path / "x.colibri.safetensors"
    result = colibri_cli("pack", src, "--out", out)
    where = "config.json has" if config else "without config.json there is"
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert f"; pass --unverified-routing and --top-k K ({where} no num_experts_per_tok) to pack" in result.stderr
    result = colibri_cli("pack", src, "--out", out, "--unverified-routing", "--top-k", "2", "--quiet")
    assert result.returncode == 0, result.stderr
    assert colibri.checkpoint.load(out).config.top_k == 2


@pytest.mark.parametrize("layer, num_hidden_layers", [("7", 4), ("6", 4), ("4", 4), ("-1", 4), ("7", None)])
def test_a_layer_out_of_range_names_the_range(rng, tmp_path, colibri_cli, layer, num_hidden_layers):
    """--layer past the model's last layer, or negative, is out of range, named with the range and the
    MoE layers (it used to be "not an MoE layer", or "a dense layer" where decoder_sparse_step rules
    that index dense). Without num_hidden_layers the range comes from the tensor names (layers 0-4 here)."""
    w = hf_weights(rng, 4, 16, 8)
    config = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
              "moe_intermediate_size": 8}
    if num_hidden_layers:
        config["num_hidden_layers"] = num_hidden_layers
    src = write_hf(tmp_path / "m", {**hf_tensors(w, "qwen", "fp32", layer=1), **hf_tensors(w, "qwen", "fp32", layer=3)},
                   config)
    result = colibri_cli("pack", src, "--out", tmp_path / "x.colibri.safetensors", "--layer", layer)
    count, where = (4, "config.json num_hidden_layers=4") if num_hidden_layers else (5, "counted from the tensor names")
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"colibri pack: invalid argument: layer {layer} is out of range: the model has {count} decoder layers, "
        f"0 to {count - 1} ({where}); MoE layers: 1, 3"], result.stderr


@pytest.mark.parametrize("command", ["pack", "demo"])
def test_out_into_a_missing_folder_is_one_line(rng, tmp_path, colibri_cli, command):
    src = small_qwen(rng, tmp_path)
    out = tmp_path / "missing" / "x.colibri.safetensors"
    result = colibri_cli(*([command, src] if command == "pack" else [command]), "--out", out)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [f"colibri {command}: --out {out}: folder {out.parent} does not exist "
                                          f"(create it first: mkdir -p {out.parent})"], result.stderr
    result = colibri_cli(command, *([src] if command == "pack" else []), "--out", tmp_path)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1 and "is a folder" in result.stderr
    with pytest.raises(colibri.ColibriError, match="does not exist"):  # the function checks before reading
        pack(src, out, progress=False)
