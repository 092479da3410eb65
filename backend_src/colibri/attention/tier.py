"""AttentionTier: a Hugging Face MoE model's own non-expert parts run by transformers (embeddings,
attention with its KV cache, norms, dense MLP layers, lm_head) with every MoE block computed by an
expert tier, and greedy generation timed as a user feels it."""
import dataclasses
import inspect
import time

import torch

from colibri._native import invalid
from colibri.attention import loading
from colibri.attention.blocks import ExpertBlock


@dataclasses.dataclass
class GenerateResult:
    """One greedy generation.

    tokens: the new token ids (max_new_tokens of them: an end-of-sequence token does not stop it).
    ttft_s: seconds from the prompt's ids in to the first new token out (the prefill through every layer).
    tpot_s: mean seconds per later token (0.0 when max_new_tokens == 1).
    prompt_tokens: the prompt's length."""
    tokens: list
    ttft_s: float
    tpot_s: float
    prompt_tokens: int


class AttentionTier:
    """A transformers causal LM whose MoE blocks call `experts` (colibri.attention.expert_tier), or its
    own blocks (AttentionTier.eager: the baseline).

    Parameters
    ----------
    model : transformers PreTrainedModel
        An already built MoE causal LM (its MoE blocks are replaced in place and their weights freed).
    experts : expert tier
        Must serve exactly the model's MoE layers, at the model's hidden size."""

    def __init__(self, model, experts):
        if experts is not None:
            _check_served(loading.moe_layers(model), experts, model.config)  # before the model is changed
            family = model.config.model_type
            loading.replace_moe_blocks(model, lambda index: ExpertBlock(experts, index, family))
        self._attach(model, experts)

    def _attach(self, model, experts):
        self.model, self.experts = model.eval(), experts
        self.moe_layers = loading.moe_layers(model)
        self.device = next(model.parameters()).device
        # transformers 5.25 names the KV cache argument `cache`, earlier 5.x `past_key_values`; a wrong name
        # would be swallowed by **kwargs and every step would run without the cache.
        parameters = inspect.signature(model.forward).parameters
        self._cache_name = "cache" if "cache" in parameters else "past_key_values"
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    @classmethod
    def from_pretrained(cls, model_dir, experts, device="cpu", dtype=None):
        """The model of the Hugging Face folder model_dir (config.json and safetensors shards) on `device`,
        loading none of its expert weights; dtype: torch dtype or name (bf16, fp16, fp32; None: the one
        config.json names). Refuses, in one line, a family it does not know, a model without MoE blocks,
        a missing non-expert weight and an expert tier that does not serve exactly the MoE layers (before
        any weight is read)."""
        family = loading.read_config(model_dir).model_type
        model, _ = loading.load_without_experts(
            model_dir, lambda index: ExpertBlock(experts, index, family), device, dtype,
            check=lambda layers, config: _check_served(layers, experts, config))
        tier = cls.__new__(cls)
        tier._attach(model, experts)
        return tier

    @classmethod
    def from_config(cls, config, experts, device="cpu", dtype=None, seed=0):
        """A model of a transformers config (e.g. transformers.Qwen3MoeConfig(): Qwen3-30B-A3B's shape) with
        random non-expert weights drawn as transformers initialises them (seeded), built on `device`
        without ever allocating the experts: for figures of a released shape without its weights."""
        family = config.model_type
        model, _ = loading.random_without_experts(
            config, lambda index: ExpertBlock(experts, index, family), device, dtype,
            check=lambda layers, cfg: _check_served(layers, experts, cfg), seed=seed)
        tier = cls.__new__(cls)
        tier._attach(model, experts)
        return tier

    @classmethod
    def eager(cls, model):
        """The baseline: the model as transformers runs it, its own MoE blocks included."""
        return cls(model, None)

    def close(self):
        if self.experts is not None:
            self.experts.close()

    def check_prompt(self, prompt_ids):
        """The prompt as a list of ints, or a one-line refusal naming the first id out of the vocabulary."""
        try:
            ids = [int(i) for i in prompt_ids]
        except (TypeError, ValueError):
            raise invalid(f"prompt_ids: expected a list of token ids (integers), got {prompt_ids!r:.60}") from None
        if not ids:
            raise invalid("prompt_ids: empty; a prompt has at least one token")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"prompt_ids: {bad} is outside the model's vocabulary [0, {self.vocab_size})")
        return ids

    def generate(self, prompt_ids, max_new_tokens):
        """Greedy decoding of max_new_tokens tokens after prompt_ids, with transformers' DynamicCache:
        one prefill forward of the prompt, then one forward per token. The device is synchronised before
        each clock is read, and each token is read back to the host as it comes, as a server streams it."""
        from transformers import DynamicCache
        ids = self.check_prompt(prompt_ids)
        if int(max_new_tokens) < 1:
            raise invalid(f"max_new_tokens: expected at least 1, got {max_new_tokens}")
        tokens = []
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            self._synchronize()
            started = time.perf_counter()
            inputs = torch.tensor([ids], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=inputs, **{self._cache_name: cache}, use_cache=True, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1)
            tokens.append(int(token))
            self._synchronize()
            first = time.perf_counter()
            for _ in range(int(max_new_tokens) - 1):
                logits = self.model(input_ids=token[:, None], **{self._cache_name: cache}, use_cache=True).logits
                token = logits[:, -1].argmax(-1)
                tokens.append(int(token))
            self._synchronize()
            done = time.perf_counter()
        later = len(tokens) - 1
        return GenerateResult(tokens, first - started, (done - first) / later if later else 0.0, len(ids))

    def _synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _check_served(moe_layers, experts, config):
    """The expert tier serves exactly the model's MoE layers, at its hidden size; else one line."""
    wanted, served = set(moe_layers), set(experts.layers)
    if wanted != served:
        parts = []
        if wanted - served:
            parts.append(f"missing {_numbers(wanted - served)}")
        if served - wanted:
            parts.append(f"{_numbers(served - wanted)} not MoE layers of this model")
        raise invalid(f"the expert tier serves layers {_numbers(served) or 'none'}, the model's MoE layers are "
                      f"{_numbers(wanted)}: {'; '.join(parts)} (pack --layer all packs every MoE layer)")
    hidden = getattr(experts, "hidden_size", None)
    if hidden is not None and hidden != config.hidden_size:
        raise invalid(f"the expert tier's layers take hidden size {hidden}, the model's is {config.hidden_size}")
    # What the model's config.json says each MoE layer is, as pack reads it: a packed folder of another
    # model with the same layer numbers and width is refused here, not run.
    from colibri.pack.families import _plan
    plan = _plan(config.to_dict(), dict(top_k=None, routing=None, renormalize=None, routed_scaling_factor=None),
                 False)
    wanted = dict(num_experts=plan.num_experts, top_k=plan.top_k, routing=plan.routing)
    for number, layer in sorted(getattr(experts, "configs", {}).items()):
        got = {field: getattr(layer, field) for field in wanted}
        if got != wanted:
            raise invalid(f"the expert tier's layer {number} is {_describe(got)}, the model's MoE layers are "
                          f"{_describe(wanted)}: packed from another model?")
    top_k = getattr(experts, "top_k", None)
    if top_k is not None and top_k != plan.top_k:
        raise invalid(f"the expert tier's layers route each token to {top_k} experts, the model's to {plan.top_k}")


def _numbers(numbers):
    return ", ".join(map(str, sorted(numbers)))


def _describe(layer):
    return f"{layer['num_experts']} experts, top-{layer['top_k']}, {layer['routing']} routing"
