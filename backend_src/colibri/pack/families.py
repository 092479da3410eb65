"""Families: what each model_type's MoE block computes, read from config.json with transformers'
defaults for that family (transformers 5.25, models/<family>/configuration_*.py), as a _Plan."""
import dataclasses
import json
import pathlib

from colibri.pack.formats import FP8_METHODS, _Fp8Scheme, _fp8_scheme
from colibri.pack.source import _fail


@dataclasses.dataclass
class _Plan:
    """One family's MoE layer as read from config.json: the LayerConfig fields and where the weights are."""
    family: str
    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str
    renormalize: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    activation: str = "silu"
    activation_alpha: float = 1.702
    activation_limit: float = 7.0
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    shared_name: str = None          # "shared_expert" (Qwen2-MoE) or "shared_experts" (DeepSeek, GLM)
    router: str = "gate"             # the router module's name in the block
    correction_bias: bool = False    # gate.e_score_correction_bias -> router_bias
    gpt_oss: bool = False            # gpt-oss expert layout, router bias and expert biases
    quantization: str = None         # config.json quantization_config's quant_method, where accepted
    fp8: "_Fp8Scheme" = None         # how fp8 experts are scaled, when quant_method is an fp8 one
    blocks: tuple = ("mlp",)
    moe_layers: object = None        # layer index -> whether it is an MoE layer (None: unknown)
    dense_rule: str = ""             # the config fields moe_layers follows, for messages
    num_layers: int = None
    hidden_size: int = None


def _get(hf, key, default):
    """config.json's value, or transformers' default when the key is absent or null."""
    value = hf.get(key)
    return default if value is None else value


def _require_silu(hf, family):
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise _fail(f"config.json hidden_act={act!r}: Colibri's {family} experts are SwiGLU with SiLU only")


def _mixtral(hf):
    _require_silu(hf, "mixtral")
    return _Plan("mixtral", _get(hf, "num_local_experts", 8), _get(hf, "num_experts_per_tok", 2),
                 _get(hf, "intermediate_size", 14336), "softmax_topk", True,
                 blocks=("block_sparse_moe", "mlp"), moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _qwen_moe_layers(hf):
    sparse_step, only_mlp = _get(hf, "decoder_sparse_step", 1), set(_get(hf, "mlp_only_layers", []))
    experts = _get(hf, "num_experts", 0)
    return (lambda i: i not in only_mlp and experts > 0 and (i + 1) % sparse_step == 0,
            f"decoder_sparse_step={sparse_step}, mlp_only_layers={sorted(only_mlp)}")


def _qwen2_moe(hf):
    _require_silu(hf, "qwen2_moe")
    moe, rule = _qwen_moe_layers(dict(hf, num_experts=_get(hf, "num_experts", 60)))
    return _Plan("qwen2_moe", _get(hf, "num_experts", 60), _get(hf, "num_experts_per_tok", 4),
                 _get(hf, "moe_intermediate_size", 1408), "softmax_topk", bool(_get(hf, "norm_topk_prob", False)),
                 shared_intermediate_size=_get(hf, "shared_expert_intermediate_size", 5632), shared_gate=True,
                 shared_name="shared_expert", moe_layers=moe, dense_rule=rule)


def _qwen3_moe(hf):
    _require_silu(hf, "qwen3_moe")
    moe, rule = _qwen_moe_layers(dict(hf, num_experts=_get(hf, "num_experts", 128)))
    return _Plan("qwen3_moe", _get(hf, "num_experts", 128), _get(hf, "num_experts_per_tok", 8),
                 _get(hf, "moe_intermediate_size", 768), "softmax_topk", bool(_get(hf, "norm_topk_prob", False)),
                 moe_layers=moe, dense_rule=rule)


def _olmoe(hf):
    _require_silu(hf, "olmoe")
    return _Plan("olmoe", _get(hf, "num_experts", 64), _get(hf, "num_experts_per_tok", 8),
                 _get(hf, "intermediate_size", 2048), "softmax_topk", bool(_get(hf, "norm_topk_prob", False)),
                 moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _deepseek_layers(hf, family, default_dense):
    freq = _get(hf, "moe_layer_freq", 1)
    if freq != 1:
        # DeepSeek's own code also skips layers with layer % moe_layer_freq != 0; transformers ignores it.
        raise _fail(f"config.json moe_layer_freq={freq}: DeepSeek's code and transformers' {family} disagree on "
                    "which layers are MoE (transformers ignores moe_layer_freq); refused rather than guessed")
    dense = _get(hf, "first_k_dense_replace", default_dense)
    return (lambda i: i >= dense), f"first_k_dense_replace={dense}"


def _shared_size(hf, family, moe_intermediate):
    n_shared = hf["n_shared_experts"] if "n_shared_experts" in hf else (2 if family == "deepseek_v2" else 1)
    if n_shared is None or n_shared < 1:
        raise _fail(f"config.json n_shared_experts={n_shared!r}: transformers' {family} block always builds "
                    "n_shared_experts * moe_intermediate_size shared experts and cannot run without them")
    # transformers builds n_shared_experts shared experts as one MLP this many times wider.
    return n_shared * moe_intermediate


def _deepseek_v2(hf):
    _require_silu(hf, "deepseek_v2")
    if _get(hf, "mlp_bias", False):
        raise _fail("config.json mlp_bias=true: DeepSeek-V2 experts with biases are not supported "
                    "(Colibri's shared expert has no biases)")
    scoring = _get(hf, "scoring_func", "softmax")
    if scoring != "softmax":
        raise _fail(f"config.json scoring_func={scoring!r}: transformers' DeepSeek-V2 router is softmax only")
    if _get(hf, "norm_topk_prob", False):
        # DeepSeek's code would renormalise (and not scale); transformers 5.25 never renormalises.
        raise _fail("config.json norm_topk_prob=true: DeepSeek-V2's own code renormalises the top-k weights "
                    "(without routed_scaling_factor) but transformers' DeepseekV2TopkRouter never does; "
                    "refused rather than picking one")
    method = _get(hf, "topk_method", "greedy")
    E, F = _get(hf, "n_routed_experts", 64), _get(hf, "moe_intermediate_size", 1407)
    top_k = hf.get("num_experts_per_tok")
    if top_k is None:
        raise _fail("config.json has no num_experts_per_tok (transformers' deepseek_v2 has no default)")
    groups = {}
    if method == "group_limited_greedy":
        n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
        if not n_group or not topk_group:
            raise _fail("config.json topk_method=group_limited_greedy needs n_group and topk_group")
        groups = dict(n_group=n_group, topk_group=topk_group, group_score="max")
    elif method != "greedy":
        raise _fail(f"config.json topk_method={method!r}: transformers' DeepSeek-V2 knows greedy and "
                    "group_limited_greedy only")
    moe, rule = _deepseek_layers(hf, "deepseek_v2", 0)
    return _Plan("deepseek_v2", E, top_k, F, "softmax_topk", False,
                 float(_get(hf, "routed_scaling_factor", 1.0)), shared_intermediate_size=_shared_size(hf, "deepseek_v2", F),
                 shared_name="shared_experts", moe_layers=moe, dense_rule=rule, **groups)


def _sigmoid_grouped(hf, family, defaults):
    """DeepSeek-V3 and GLM-4.5: sigmoid scores, e_score_correction_bias, group top-2 sum."""
    _require_silu(hf, family)
    scoring = hf.get("scoring_func")
    if scoring is not None and scoring != "sigmoid":
        raise _fail(f"config.json scoring_func={scoring!r}: transformers' {family} router is sigmoid only")
    method = hf.get("topk_method")
    if method is not None and method != "noaux_tc":
        raise _fail(f"config.json topk_method={method!r}: transformers' {family} router is noaux_tc only")
    if _get(hf, "mlp_bias", False):
        raise _fail(f"config.json mlp_bias=true: transformers' {family} experts have no biases")
    E, F = _get(hf, "n_routed_experts", defaults["E"]), _get(hf, "moe_intermediate_size", defaults["F"])
    n_group, topk_group = _get(hf, "n_group", defaults["n_group"]), _get(hf, "topk_group", defaults["topk_group"])
    moe, rule = _deepseek_layers(hf, family, defaults["dense"])
    # One group (GLM-4.5) keeps every expert: the same as no group limit.
    return _Plan(family, E, _get(hf, "num_experts_per_tok", 8), F, "sigmoid_bias",
                 bool(_get(hf, "norm_topk_prob", True)), float(_get(hf, "routed_scaling_factor", defaults["scale"])),
                 n_group=n_group if n_group > 1 else 1, topk_group=topk_group if n_group > 1 else 1,
                 group_score="top2_sum", shared_intermediate_size=_shared_size(hf, family, F),
                 shared_name="shared_experts", correction_bias=True, moe_layers=moe, dense_rule=rule)


def _deepseek_v3(hf):
    return _sigmoid_grouped(hf, "deepseek_v3", dict(E=256, F=2048, n_group=8, topk_group=4, dense=3, scale=2.5))


def _glm4_moe(hf):
    return _sigmoid_grouped(hf, "glm4_moe", dict(E=128, F=1408, n_group=1, topk_group=1, dense=1, scale=1.0))


def _gpt_oss(hf):
    return _Plan("gpt_oss", _get(hf, "num_local_experts", 128), _get(hf, "num_experts_per_tok", 4),
                 _get(hf, "intermediate_size", 2880), "topk_softmax", False, activation="swiglu_oai",
                 activation_alpha=float(_get(hf, "swiglu_alpha", 1.702)),
                 activation_limit=float(_get(hf, "swiglu_limit", 7.0)), router="router", gpt_oss=True,
                 moe_layers=lambda i: True, dense_rule="every layer is MoE")


FAMILIES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
            "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe, "gpt_oss": _gpt_oss}
REFUSED_FAMILIES = {
    "phimoe": "PhiMoE's sparsemixer routing is not implemented (its top-2 selection and weights differ from "
              "every Colibri routing; packing it as softmax top-k would compute something else)",
    "kimi_k2": "transformers has no kimi_k2 model to check Kimi-K2's routing against (its config names "
               "DeepseekV3ForCausalLM: --unverified-routing packs it with DeepSeek-V3's semantics)",
}
# Other names config.json may use for a key the family reads (transformers' attribute_map: e.g.
# transformers 5.25 writes qwen3_moe's expert count as num_local_experts, the hub's files num_experts).
ALIASES = {"mixtral": {"num_experts": "num_local_experts"}, "qwen3_moe": {"num_local_experts": "num_experts"},
           "olmoe": {"num_local_experts": "num_experts"}, "deepseek_v2": {"num_experts": "n_routed_experts"},
           "deepseek_v3": {"num_local_experts": "n_routed_experts"},
           "glm4_moe": {"num_local_experts": "n_routed_experts"}, "gpt_oss": {"num_experts": "num_local_experts"}}


def _resolve_aliases(hf, family):
    hf = dict(hf)
    for alias, key in ALIASES.get(family, {}).items():
        if hf.get(alias) is None:
            continue
        if hf.get(key) is not None and hf[key] != hf[alias]:
            raise _fail(f"config.json {alias}={hf[alias]} and {key}={hf[key]} disagree")
        hf[key] = hf[alias]
    return hf


# config.json `architectures` -> family, for an unknown model_type under --unverified-routing.
ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe",
                 "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 "Glm4MoeForCausalLM": "glm4_moe", "GptOssForCausalLM": "gpt_oss"}
# transformers' MoE block of each family, for --verify: (module, class).
BLOCK_CLASSES = {"mixtral": ("mixtral", "MixtralSparseMoeBlock"), "qwen2_moe": ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
                 "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"), "olmoe": ("olmoe", "OlmoeSparseMoeBlock"),
                 "deepseek_v2": ("deepseek_v2", "DeepseekV2Moe"), "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE"),
                 "glm4_moe": ("glm4_moe", "Glm4MoeMoE"), "gpt_oss": ("gpt_oss", "GptOssMLP")}


def _generic(hf, overrides):
    """The unverified reading of an unknown model: the v1 packer's heuristics over common config keys."""
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or hf.get("n_group") or 1
    scoring = hf.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise _fail(f"config.json scoring_func={scoring!r} is not supported (softmax, sigmoid)")
    routing = overrides["routing"] or ("sigmoid_bias" if scoring == "sigmoid" else "softmax_topk")
    top_k = overrides["top_k"] or hf.get("num_experts_per_tok")
    if top_k is None:
        raise _fail("top_k unknown: no num_experts_per_tok in a config.json beside the weights; pass --top-k")
    E = next((hf[k] for k in ("n_routed_experts", "num_local_experts", "num_experts") if k in hf), None)
    F = next((hf[k] for k in ("moe_intermediate_size", "intermediate_size") if k in hf), None)
    return _Plan("generic", E, int(top_k), F, routing, bool(hf.get("norm_topk_prob", True)),
                 float(hf.get("routed_scaling_factor") or 1.0),
                 n_group=n_group if topk_group < n_group else 1, topk_group=topk_group if topk_group < n_group else 1,
                 group_score="top2_sum" if routing == "sigmoid_bias" else "max",
                 correction_bias=routing == "sigmoid_bias", blocks=("block_sparse_moe", "mlp"))


def _read_config(folder: pathlib.Path):
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise _fail(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _fail(f"{path}: not a JSON object")
    return config


def _model_type(hf):
    """(config.json's model_type, the settings to read): a multimodal model's language model's where
    that is the family pack knows."""
    model_type = hf.get("model_type")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    if model_type not in FAMILIES and text.get("model_type") in FAMILIES:
        return text["model_type"], {**hf, **text}
    return model_type, hf


def _unverified_advice(hf, overrides, has_config=True) -> str:
    """What to pass to pack a model of no known family, all of it at once: --top-k too when the
    generic reading would ask for it next (no family from `architectures`, no num_experts_per_tok)."""
    family = next((a for a in hf.get("architectures") or [] if a in ARCHITECTURES), None)
    if family or overrides["top_k"] is not None or hf.get("num_experts_per_tok") is not None:
        return "pass --unverified-routing"
    where = "config.json has" if has_config else "without config.json there is"
    return f"pass --unverified-routing and --top-k K ({where} no num_experts_per_tok)"


def _plan(hf, overrides, unverified: bool) -> _Plan:
    """The family's plan for config.json `hf` (None: no config.json), overrides applied."""
    supported = ", ".join(FAMILIES)
    changed = [f"--{k.replace('_', '-')}" for k, v in overrides.items() if v is not None]
    if changed and not unverified:
        raise _fail(f"{', '.join(changed)} may make the layer compute something other than the model; pass "
                    "--unverified-routing (unverified_routing=True) to accept that")
    if hf is None:
        if not unverified:
            raise _fail(f"no config.json beside the weights, so the model family is unknown (supported: {supported}); "
                        f"{_unverified_advice({}, overrides, has_config=False)} to pack with generic settings")
        hf = {}
    model_type, hf = _model_type(hf)
    if model_type in REFUSED_FAMILIES and not (unverified and model_type == "kimi_k2"):
        raise _fail(f"model_type {model_type!r}: {REFUSED_FAMILIES[model_type]}")
    if model_type in FAMILIES:
        plan = FAMILIES[model_type](_resolve_aliases(hf, model_type))
    elif not unverified:
        unknown = "config.json has no model_type" if model_type is None else \
            f"model_type {model_type!r} is not a family pack knows"
        raise _fail(f"{unknown} (supported: {supported}); {_unverified_advice(hf, overrides)} to pack it anyway, "
                    "with settings that may differ from the model's")
    else:
        family = next((ARCHITECTURES[a] for a in hf.get("architectures") or [] if a in ARCHITECTURES), None)
        plan = FAMILIES[family](_resolve_aliases(hf, family)) if family else _generic(hf, overrides)
        plan = dataclasses.replace(plan, family=f"{plan.family} (unverified: model_type {model_type!r})")
    plan.num_layers, plan.hidden_size = hf.get("num_hidden_layers"), hf.get("hidden_size")
    plan.quantization = _quantization(hf, plan)
    plan.fp8 = _fp8_scheme(hf["quantization_config"]) if plan.quantization in FP8_METHODS else None
    if overrides["top_k"] is not None:
        plan.top_k = overrides["top_k"]
    if overrides["routing"] is not None:
        plan.routing = overrides["routing"]
    if overrides["renormalize"] is not None:
        plan.renormalize = overrides["renormalize"]
    if overrides["routed_scaling_factor"] is not None:
        plan.routed_scaling_factor = overrides["routed_scaling_factor"]
    return plan


def _quantization(hf, plan: _Plan):
    """config.json's quantization_config quant_method when pack can read it ('mxfp4' for gpt-oss, the
    fp8 ones of FP8_METHODS), None without one; refuses any other."""
    config = hf.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if (method == "mxfp4" and plan.gpt_oss) or method in FP8_METHODS:
        return method
    where = "outside gpt-oss " if method == "mxfp4" else ""
    raise _fail(f"config.json quantization_config quant_method={method!r} {where}is not read by pack (it reads "
                "fp32, fp16 and bf16 weights, fp8 e4m3 experts (quant_method " + ", ".join(FP8_METHODS) + ") and "
                "gpt-oss's MXFP4 experts); dequantise the checkpoint first")
