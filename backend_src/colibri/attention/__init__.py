"""The attention tier: a Hugging Face MoE model's own non-expert parts (embeddings, attention with a
KV cache, norms, dense MLP layers, lm_head) run by transformers on the CPU or a GPU, and every MoE block
computed by Colibri's expert tier: a Triton server of every packed layer (over gRPC, or CUDA shared
memory on the same host), or colibri.MoELayer in-process. Needs torch and transformers (the
`attention` extra: pip install 'colibri-moe[attention]'); the engine `colibri` never imports this.

    from colibri.attention import AttentionTier, expert_tier
    experts = expert_tier("grpc", url="127.0.0.1:8001")     # serve --weights PACKED_DIR
    experts = expert_tier("inprocess", weights="PACKED_DIR", device="cpu")   # or in-process
    tier = AttentionTier.from_pretrained("HF_DIR", experts)  # reads no expert weight
    r = tier.generate([1, 2, 3], max_new_tokens=16)          # r.tokens, r.ttft_s, r.tpot_s

Exported:
    expert_tier(protocol, url=, weights=, device=, model=)
                    the expert tier: inprocess | grpc | cudashm (colibri.attention.experts)
    AttentionTier   from_pretrained(model_dir, experts, device, dtype), from_config(config, experts, device,
                    dtype, seed) (random non-expert weights), AttentionTier(model, experts) for a
                    model already built, AttentionTier.eager(model) (the transformers baseline), generate()
    GenerateResult  tokens, ttft_s, tpot_s, prompt_tokens
    ContinuousBatcher
                    continuous batching over an AttentionTier: submit(), step(); run_open_loop(batcher,
                    arrivals, requests) drives it from a schedule (colibri.attention.batching)
    ColibriBlock    the drop-in for PyTorch users: a module that replaces a transformers MoE block by a
                    packed colibri.MoELayer, in-process, capturable in a CUDA graph on a GPU
    ExpertBlock     the module AttentionTier puts in place of each MoE block

`python -m colibri generate --help` runs it from the command line (colibri.attention.cli).
"""
_EXPORTS = {"AttentionTier": "tier", "GenerateResult": "tier", "expert_tier": "experts",
            "ColibriBlock": "blocks", "ExpertBlock": "blocks", "ContinuousBatcher": "batching",
            "BatchedResult": "batching", "run_open_loop": "batching"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    # torch and transformers are imported on first use of a name that needs them, not by `import`.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'colibri.attention' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"colibri.attention.{_EXPORTS[name]}"), name)
