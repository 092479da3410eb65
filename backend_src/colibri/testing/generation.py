"""The models the attention tier's tests generate with (tests/test_generate.py, tests/test_batching.py):
tiny random fp32 models written by transformers' save_pretrained (Qwen3-MoE of 4 layers, two of them
MoE; DeepSeek-V3 with a dense first layer, grouped sigmoid routing and a shared expert; gpt-oss, whose
block returns a tuple and whose cache has a sliding-window layer), every MoE layer packed with
`pack --layer all --verify`, and random prompts with the tokens transformers' own greedy generate gives
for them, drawn again where transformers' own top two logits, or some MoE layer's routing, are near a
tie. Needs torch and transformers."""
import types

import numpy as np

NEW_TOKENS = 16
PROMPTS = 3
# Config fields beyond colibri.testing.families': Qwen3-MoE at 4 layers (decoder_sparse_step 2: layers 1 and
# 3 MoE); DeepSeek-V3's attention (MLA) has as many key/value heads as query heads.
FAMILIES = {"qwen3_moe": dict(num_hidden_layers=4), "deepseek_v3": dict(num_key_value_heads=4), "gpt_oss": {}}
MOE_LAYERS = {"qwen3_moe": [1, 3], "deepseek_v3": [1], "gpt_oss": [0, 1]}
# A prompt is drawn again where transformers' top two logits at some step are closer than this (times
# max(1, |top|)): there fp32 rounding in another order may pick either, and neither would be wrong.
MIN_MARGIN = 1e-4
# Likewise a prompt where some MoE layer's routing was this near a tie (colibri.pack.routing_ties).
ROUTING_TIE = 1e-4


def reference_tokens(model, prompt, packed, moe_layers, new_tokens=NEW_TOKENS):
    """transformers' own greedy generate (end-of-sequence off: always new_tokens), its smallest margin
    between the two best logits over the steps, and whether some token of some MoE layer was at a routing
    near-tie (its experts' scores within ROUTING_TIE of a tie: there the attention tier's own rounding,
    some 1e-7 away from transformers', may pick other experts, and the tokens part ways)."""
    import torch
    from colibri.pack import routing_ties
    inputs, hooks = {n: [] for n in moe_layers}, []
    for n in moe_layers:
        block = model.model.layers[n].mlp
        hooks.append(block.register_forward_pre_hook(
            lambda module, args, n=n: inputs[n].append(args[0].reshape(-1, args[0].shape[-1]).numpy().copy())))
    try:
        with torch.no_grad():
            # attention_mask given: without it generate masks every id equal to pad_token_id (0 for
            # DeepSeek-V3's config) as padding, where the tier, like a server, takes the prompt as sent.
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    finally:
        for hook in hooks:
            hook.remove()
    tie = any(routing_ties(packed / f"layer{n}.colibri.safetensors", np.concatenate(inputs[n]), ROUTING_TIE).any()
              for n in moe_layers)
    margins = []
    for scores in out.scores:
        top = torch.topk(scores[0].double(), 2).values
        margins.append(float((top[0] - top[1]) / max(1.0, abs(float(top[0])))))
    return out.sequences[0, len(prompt):].tolist(), min(margins), tie


def prepare(name, hf_dir, packed, seed, prompts=PROMPTS):
    """The family's model written to hf_dir and packed into packed (both empty folders), transformers' own
    model of it, and `prompts` prompts (2-12 tokens, drawn from `seed`) with the NEW_TOKENS tokens
    transformers generates for them."""
    import transformers
    from colibri.pack import pack
    from colibri.testing.families import write_model
    write_model(name, hf_dir, **FAMILIES[name])
    configs = pack(hf_dir, packed, layer="all", verify=True, progress=False)
    assert sorted(int(p.name[5:].split(".")[0]) for p in packed.iterdir()) == MOE_LAYERS[name]
    assert len(configs) == len(MOE_LAYERS[name])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    rng = np.random.default_rng([seed, *name.encode()])
    chosen, expected = [], []
    while len(chosen) < prompts:
        prompt = [int(i) for i in rng.integers(0, model.config.vocab_size, int(rng.integers(2, 13)))]
        tokens, margin, tie = reference_tokens(model, prompt, packed, MOE_LAYERS[name])
        if margin > MIN_MARGIN and not tie:
            chosen.append(prompt)
            expected.append(tokens)
    return types.SimpleNamespace(name=name, hf_dir=hf_dir, packed=packed, model=model, prompts=chosen,
                                 expected=expected)
