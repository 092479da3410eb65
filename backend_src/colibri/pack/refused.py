"""The MoE model_types of transformers 5.25 that pack refuses, each with what is missing in one line:
a feature the library does not compute (a routing, an activation, a part of the block), or a mapping
pack has not yet checked against the family's transformers block. README.md's family table lists them;
tests/test_family_table.py keeps both in step with the pinned transformers."""

# Features the C library lacks; each line below that names one says which.
_INPUT_SCALED = "the router's score multiplies the expert's input (x * sigmoid(l)), not its output"
_CLAMPED_SILU = "clamped SiLU SwiGLU (gate <= swiglu_limit, |up| <= swiglu_limit, then silu(gate) * up)"
_CLAMP_AFTER_SILU = "SwiGLU with its SiLU output clamped (min(silu(gate), limit) * clamp(up))"
_SOFTMAX_BIAS = "a selection bias added to softmax probabilities (only sigmoid scores take a bias)"
_NOT_MAPPED = "computable with Colibri's features ({what}), but pack has no mapping checked against its " \
              "transformers block yet"
_NOT_TEXT = "not a decoder-only text model ({what}); pack converts the MoE layers of text models"

REFUSED_FAMILIES = {
    "phimoe": "PhiMoE's sparsemixer routing is not implemented (its top-2 selection and weights differ from "
              "every Colibri routing; packing it as softmax top-k would compute something else)",
    "kimi_k2": "transformers has no kimi_k2 model to check Kimi-K2's routing against (its config names "
               "DeepseekV3ForCausalLM: --unverified-routing packs it with DeepSeek-V3's semantics)",
    "llama4_text": f"Llama 4's MoE: {_INPUT_SCALED}",
    "llama4": f"Llama 4's MoE: {_INPUT_SCALED}",
    "longcat_flash": "LongCat-Flash's zero experts (picks that add the input itself, unweighted by any matrix)",
    "zaya": "ZAYA's router is an MLP over a down-projection carried from layer to layer, with a skip expert",
    "jetmoe": "JetMoE's attention experts (mixture of attention heads, MoA) beside its MoE MLP",
    "doge": "Doge's cross-domain MoE retrieves single-vector experts by product keys",
    "deepseek_v4": f"DeepSeek-V4's hash routing (experts chosen by token id) and {_CLAMPED_SILU}",
    "glm5_next_text": f"GLM-5-Next's experts: {_CLAMPED_SILU}",
    "glm5_next": f"GLM-5-Next's experts: {_CLAMPED_SILU}",
    "hy_v4": f"HY-V4's experts: {_CLAMPED_SILU}",
    "hy_v4_vl_text": f"HY-V4's experts: {_CLAMPED_SILU}",
    "hy_v4_vl": f"HY-V4's experts: {_CLAMPED_SILU}",
    "step3p5": f"Step-3.5's experts: {_CLAMP_AFTER_SILU}",
    "step3p7": f"Step-3.5's experts: {_CLAMP_AFTER_SILU}",
    "bailing_hybrid": f"Bailing-hybrid's experts: {_CLAMP_AFTER_SILU} where swiglu_limit is set; otherwise "
                      + _NOT_MAPPED.format(what="DeepSeek-V3's block"),
    "minimax_m3_vl_text": "gpt-oss's clamped SwiGLU beside a shared expert, which the CUDA backend refuses (the CPU "
                          "computes both)",
    "minimax_m3_vl": "gpt-oss's clamped SwiGLU beside a shared expert, which the CUDA backend refuses (the CPU "
                     "computes both)",
    "kolibri1": "Kolibri's router selects on logits plus a bias and weights by sigmoid(logit): no Colibri routing",
    "kolibri1_1": "Kolibri's router selects on logits plus a bias and weights by sigmoid(logit): no Colibri routing",
    "ernie4_5_moe": f"ERNIE 4.5's router: {_SOFTMAX_BIAS}",
    "ernie4_5_vl_moe_text": f"ERNIE 4.5-VL's router: {_SOFTMAX_BIAS}; and experts split by modality",
    "ernie4_5_vl_moe": f"ERNIE 4.5-VL's router: {_SOFTMAX_BIAS}; and experts split by modality",
    "mistral_large4_text": "Mistral Large 4's groups rank by the sum of two softmax probabilities (Colibri ranks "
                           "logits) when n_group > 1; " + _NOT_MAPPED.format(what="Mistral4's block") + " otherwise",
    "mistral_large4": "Mistral Large 4's groups rank by the sum of two softmax probabilities (Colibri ranks "
                      "logits) when n_group > 1; " + _NOT_MAPPED.format(what="Mistral4's block") + " otherwise",
    "axk1": "A.X-K1's MoE block ends in an RMSNorm of its output (post_mlp_layernorm)",
    "muse_spark_text": "Muse-Spark's experts sit between projections and norms (pre_expert_proj, post_expert_norm)",
    "muse_spark": "Muse-Spark's experts sit between projections and norms (pre_expert_proj, post_expert_norm)",
    "ergo": "Ergo's experts end in a per-expert output norm (post_expert_norm)",
    "nemotron_h": "Nemotron-H's experts are not gated (relu^2 of one up-projection) and sit between latent "
                  "projections",
    "nemotron_h_omni": "its language model is Nemotron-H, whose experts are not gated (relu^2) and sit between "
                       "latent projections",
    "nemo_speechlm": "its language model is Nemotron-H, whose experts are not gated (relu^2) and sit between "
                     "latent projections",
    "gemma4_text": "Gemma 4's router normalises its input (RMSNorm times a learned scale) and scales each expert's "
                   "weight (per_expert_scale); its experts are GeLU-tanh",
    "gemma4": "Gemma 4's router normalises its input (RMSNorm times a learned scale) and scales each expert's "
              "weight (per_expert_scale); its experts are GeLU-tanh",
    "diffusion_gemma_text": "Gemma 4's MoE (router input RMSNorm and per_expert_scale, GeLU-tanh experts) in a "
                            "diffusion model",
    "diffusion_gemma": "Gemma 4's MoE (router input RMSNorm and per_expert_scale, GeLU-tanh experts) in a "
                       "diffusion model",
    "inkling_text": "Inkling weights its shared experts by the router too (one normalisation of routed and shared "
                    "sigmoid scores)",
    "inkling_mm_model": "Inkling weights its shared experts by the router too (one normalisation of routed and "
                        "shared sigmoid scores)",
    "inkling2_text": "Inkling2's router scores with config.json scoring_func and its experts with a two-input "
                     "activation of its own",
    "inkling2": "Inkling2's router scores with config.json scoring_func and its experts with a two-input "
                "activation of its own",
    "inkling2_loop_text": "Inkling2's router scores with config.json scoring_func and its experts with a two-input "
                          "activation of its own",
    "inkling2_loop": "Inkling2's router scores with config.json scoring_func and its experts with a two-input "
                     "activation of its own",
    "kimi_k25": "Kimi-K2.5's language model is DeepSeek-V3's, but pack has not checked the layout transformers "
                "writes for it (language_model.model.blocks.N)",
    "switch_transformers": "an encoder-decoder model with expert capacity (tokens beyond it skip the experts)",
    "nllb-moe": "an encoder-decoder model with expert capacity (tokens beyond it skip the experts)",
    "vitpose_backbone": _NOT_TEXT.format(what="a vision backbone"),
    "dots3_note_vision_encoder": _NOT_TEXT.format(what="a vision encoder"),
    # Computable with today's features; what is missing is pack's side.
    "dbrx": _NOT_MAPPED.format(what="softmax top-k renormalised by moe_normalize_expert_weights = 1; experts as "
                                    "transformer.blocks.N.ffn.experts.mlp.w1/v1/w2"),
    **{name: _NOT_MAPPED.format(what="Granite-MoE's block, plus the decoder layer's shared_mlp beside it, which "
                                     "pack would fold into the layer as its shared expert")
       for name in ("granitemoeshared", "granitemoehybrid", "granitemoe_swa")},
    "aria_text": _NOT_MAPPED.format(what="top-k then softmax and shared experts; transposed fused experts"),
    "aria": _NOT_MAPPED.format(what="top-k then softmax and shared experts; transposed fused experts"),
    "qwen3_omni_moe_text": _NOT_MAPPED.format(what="Qwen3-MoE's block"),
    "qwen3_omni_moe_thinker": _NOT_MAPPED.format(what="Qwen3-MoE's block"),
    "qwen3_omni_moe": _NOT_MAPPED.format(what="Qwen3-MoE's block, in thinker_config.text_config"),
    "qwen3_omni_moe_talker_text": _NOT_MAPPED.format(what="Qwen2-MoE's block"),
    "qwen4_exp_text": _NOT_MAPPED.format(what="Qwen3-Next's block"),
    "qwen4_exp": _NOT_MAPPED.format(what="Qwen3-Next's block"),
    "dots3_note_text": _NOT_MAPPED.format(what="DeepSeek-V3.2's block"),
    "dots3_note": _NOT_MAPPED.format(what="DeepSeek-V3.2's block"),
    "axk2": _NOT_MAPPED.format(what="DeepSeek-V3's router with optional groups"),
    "deepseek_ocr2_text": _NOT_MAPPED.format(what="DeepSeek-V2's block"),
    "deepseek_ocr2": _NOT_MAPPED.format(what="DeepSeek-V2's block"),
    "unlimited_ocr_text": _NOT_MAPPED.format(what="DeepSeek-V2's block"),
    "unlimited_ocr": _NOT_MAPPED.format(what="DeepSeek-V2's block"),
    "openai_privacy_filter": _NOT_MAPPED.format(what="gpt-oss's block with its weights divided by top_k; a token "
                                                     "classifier"),
}
