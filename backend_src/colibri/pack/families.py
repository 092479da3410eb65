"""Families: what each model_type's MoE block computes, read from config.json with transformers'
defaults for that family (transformers 5.25, models/<family>/configuration_*.py), as a _Plan."""
import dataclasses
import json
import pathlib

from colibri.pack.formats import FP8_METHODS, _Fp8Scheme, _fp8_scheme
from colibri.pack.refused import REFUSED_FAMILIES
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
    shared_name: str = None          # "shared_expert" (Qwen2-MoE), "shared_experts" (DeepSeek, GLM), "shared_mlp"
    router: str = "gate"             # the router's weight's name in the block, less ".weight"
    correction_bias: bool = False    # the block's e_score_correction_bias -> router_bias
    correction_bias_name: str = "gate.e_score_correction_bias"   # relative to the block
    gpt_oss: bool = False            # gpt-oss expert layout, router bias and expert biases
    quantization: str = None         # config.json quantization_config's quant_method, where accepted
    fp8: "_Fp8Scheme" = None         # how fp8 experts are scaled, when quant_method is an fp8 one
    blocks: tuple = ("mlp",)
    # (name in the checkpoint, name in transformers' block) prefixes, where the released layout that
    # save_pretrained writes names a tensor otherwise than the block does (for --verify)
    renames: tuple = ()
    fused: tuple = ("experts.gate_up_proj", "experts.down_proj")   # fused experts [E, 2F, H] and [E, H, F]
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


def _mixtral(hf, family="mixtral", F=14336):
    _require_silu(hf, family)
    return _Plan(family, _get(hf, "num_local_experts", 8), _get(hf, "num_experts_per_tok", 2),
                 _get(hf, "intermediate_size", F), "softmax_topk", True,
                 blocks=("block_sparse_moe", "mlp"), moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _qwen_moe_layers(hf):
    sparse_step, only_mlp = _get(hf, "decoder_sparse_step", 1), set(_get(hf, "mlp_only_layers", []))
    experts = _get(hf, "num_experts", 0)
    return (lambda i: i not in only_mlp and experts > 0 and (i + 1) % sparse_step == 0,
            f"decoder_sparse_step={sparse_step}, mlp_only_layers={sorted(only_mlp)}")


def _qwen2_moe(hf, family="qwen2_moe", E=60, k=4, F=1408, Fs=5632, norm=False, every_layer=False):
    """Qwen2-MoE's block: softmax top-k and a shared expert scaled by sigmoid(shared_expert_gate . x).
    norm None: the router always renormalises (Qwen3.5-MoE); every_layer: no decoder_sparse_step rule."""
    _require_silu(hf, family)
    moe, rule = _qwen_moe_layers(dict(hf, num_experts=_get(hf, "num_experts", E)))
    if every_layer:
        moe, rule = (lambda i: True), "every layer is MoE"
    return _Plan(family, _get(hf, "num_experts", E), _get(hf, "num_experts_per_tok", k),
                 _get(hf, "moe_intermediate_size", F), "softmax_topk",
                 True if norm is None else bool(_get(hf, "norm_topk_prob", norm)),
                 shared_intermediate_size=_get(hf, "shared_expert_intermediate_size", Fs), shared_gate=True,
                 shared_name="shared_expert", moe_layers=moe, dense_rule=rule)


def _qwen3_moe(hf, family="qwen3_moe", E=128, k=8, F=768, norm=False):
    _require_silu(hf, family)
    moe, rule = _qwen_moe_layers(dict(hf, num_experts=_get(hf, "num_experts", E)))
    return _Plan(family, _get(hf, "num_experts", E), _get(hf, "num_experts_per_tok", k),
                 _get(hf, "moe_intermediate_size", F), "softmax_topk", bool(_get(hf, "norm_topk_prob", norm)),
                 moe_layers=moe, dense_rule=rule)


def _olmoe(hf, family="olmoe", E=64, k=8, F=2048):
    _require_silu(hf, family)
    return _Plan(family, _get(hf, "num_experts", E), _get(hf, "num_experts_per_tok", k),
                 _get(hf, "intermediate_size", F), "softmax_topk", bool(_get(hf, "norm_topk_prob", False)),
                 moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _deepseek_layers(hf, family, default_dense):
    freq = _get(hf, "moe_layer_freq", 1)
    if freq != 1:
        # DeepSeek's own code also skips layers with layer % moe_layer_freq != 0; transformers ignores it.
        raise _fail(f"config.json moe_layer_freq={freq}: DeepSeek's code and transformers' {family} disagree on "
                    "which layers are MoE (transformers ignores moe_layer_freq); refused rather than guessed")
    dense = _get(hf, "first_k_dense_replace", default_dense)
    return (lambda i: i >= dense), f"first_k_dense_replace={dense}"


def _shared_size(hf, family, moe_intermediate, default=1):
    n_shared = hf["n_shared_experts"] if "n_shared_experts" in hf else (2 if family == "deepseek_v2" else default)
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
    """DeepSeek-V3 and GLM-4.5: sigmoid scores, e_score_correction_bias, group top-2 sum. defaults:
    E, F, n_group, topk_group, dense (first_k_dense_replace), scale, and optionally k, norm, shared
    (n_shared_experts; 0: the block has none, MiMo-V2-Flash)."""
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
    if E is None:
        raise _fail(f"config.json has no n_routed_experts (transformers' {family} has no default)")
    n_group, topk_group = _get(hf, "n_group", defaults["n_group"]), _get(hf, "topk_group", defaults["topk_group"])
    moe, rule = _deepseek_layers(hf, family, defaults["dense"])
    top_k = _get(hf, "num_experts_per_tok", defaults.get("k", 8))
    if top_k is None:
        raise _fail(f"config.json has no num_experts_per_tok (transformers' {family} has no default)")
    n_shared = defaults.get("shared", 1)   # transformers' default n_shared_experts; 0: the block has none
    shared = 0 if n_shared == 0 else _shared_size(hf, family, F, n_shared)
    # One group (GLM-4.5) keeps every expert: the same as no group limit.
    return _Plan(family, E, top_k, F, "sigmoid_bias",
                 bool(_get(hf, "norm_topk_prob", defaults.get("norm", True))),
                 float(_get(hf, "routed_scaling_factor", defaults["scale"])),
                 n_group=n_group if n_group > 1 else 1, topk_group=topk_group if n_group > 1 else 1,
                 group_score="top2_sum", shared_intermediate_size=shared,
                 shared_name="shared_experts" if shared else None, correction_bias=True, moe_layers=moe,
                 dense_rule=rule, **_bias_where(defaults.get("bias")))


def _bias_where(name):
    """Plan fields for a selection bias the released layout stores as `name` in the block, not at
    gate.e_score_correction_bias where transformers' router holds it."""
    return dict(correction_bias_name=name, renames=((name, "gate.e_score_correction_bias"),)) if name else {}


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


def _mistral4(hf):
    """DeepSeek-V3's block with a softmax router that renormalises and scales; its groups rank by the sum of
    the two highest softmax probabilities, which Colibri's softmax routing does not compute (it ranks logits)."""
    n_group = _get(hf, "n_group", 1)
    if n_group > 1:
        raise _fail(f"config.json n_group={n_group}: Mistral4's groups are ranked by the sum of their two highest "
                    "softmax probabilities; Colibri's group scores for softmax routing are taken on the logits")
    _require_silu(hf, "mistral4")
    F = _get(hf, "moe_intermediate_size", 2048)
    moe, rule = _deepseek_layers(hf, "mistral4", 0)
    return _Plan("mistral4", _get(hf, "n_routed_experts", 128), _get(hf, "num_experts_per_tok", 4), F,
                 "softmax_topk", bool(_get(hf, "norm_topk_prob", True)), float(_get(hf, "routed_scaling_factor", 1.0)),
                 shared_intermediate_size=_shared_size(hf, "mistral4", F), shared_name="shared_experts",
                 moe_layers=moe, dense_rule=rule)


def _sigmoid_topk(hf, family, E, k, F, *, F_key="moe_intermediate_size", norm=None, scale_key=None, scale=1.0,
                  shared=None, bias=None, layers=None):
    """Sigmoid scores, top-k on them (plus a selection-only bias where the block has one), renormalised
    (norm None: always; else norm_topk_prob's default), times a scale; no groups. shared: (its name, its
    width) or None; bias: the bias's name in the block (None: no bias, zeros); layers: (rule, its words)."""
    _require_silu(hf, family)
    if _get(hf, "mlp_bias", False):
        raise _fail(f"config.json mlp_bias=true: transformers' {family} experts have no biases")
    moe, rule = layers or ((lambda i: True), "every layer is MoE")
    return _Plan(family, _get(hf, "num_experts", E), _get(hf, "num_experts_per_tok", k), _get(hf, F_key, F),
                 "sigmoid_bias", True if norm is None else bool(_get(hf, "norm_topk_prob", norm)),
                 float(_get(hf, scale_key, scale)) if scale_key else 1.0,
                 shared_intermediate_size=shared[1] if shared else 0, shared_name=shared[0] if shared else None,
                 correction_bias=bias is not None, correction_bias_name=bias or "", moe_layers=moe, dense_rule=rule)


def _minimax_m2(hf):
    plan = _sigmoid_topk(hf, "minimax_m2", 256, 8, 1536, F_key="intermediate_size", bias="e_score_correction_bias")
    plan.blocks = ("block_sparse_moe",)
    return plan


def _hy_v3(hf):
    F = _get(hf, "moe_intermediate_size", 1536)
    plan = _sigmoid_topk(hf, "hy_v3", 192, 8, 1536, scale_key="router_scaling_factor", scale=2.826,
                         shared=("shared_mlp", F * _get(hf, "num_shared_experts", 1)), bias="expert_bias",
                         layers=_typed_layers(hf))
    plan.router = "router.gate"
    plan.renames = (("router.gate.", "gate."), ("expert_bias", "e_score_correction_bias"),
                    ("shared_mlp.", "shared_experts."))
    return plan


def _laguna(hf):
    softcap = _get(hf, "moe_router_logit_softcapping", 0.0)
    if softcap > 0:
        raise _fail(f"config.json moe_router_logit_softcapping={softcap}: Laguna's router caps its logits with "
                    "tanh, which no Colibri routing does")
    plan = _sigmoid_topk(hf, "laguna", 256, 8, 512, scale_key="moe_routed_scaling_factor",
                         shared=("shared_expert", _get(hf, "shared_expert_intermediate_size", 512)),
                         bias="experts.e_score_correction_bias", layers=_typed_layers(hf))
    plan.renames = (("experts.e_score_correction_bias", "gate.e_score_correction_bias"),
                    ("shared_expert.", "shared_experts."))
    return plan


def _flint(hf):
    return _sigmoid_topk(hf, "flint", 256, 6, 512, norm=True,
                         shared=("shared_expert", _get(hf, "shared_expert_intermediate_size", 1024)),
                         layers=_qwen_moe_layers(dict(hf, num_experts=_get(hf, "num_experts", 256),
                                                      mlp_only_layers=_get(hf, "mlp_only_layers", [0, 1]))))


def _lfm2_moe(hf):
    dense = _get(hf, "num_dense_layers", 2)
    plan = _sigmoid_topk(hf, "lfm2_moe", 32, 4, 1792, norm=True, scale_key="routed_scaling_factor",
                         bias="expert_bias" if _get(hf, "use_expert_bias", True) else None,
                         layers=((lambda i: i >= dense), f"num_dense_layers={dense}"))
    plan.blocks = ("feed_forward",)
    return plan


def _hunyuan_v1_moe(hf):
    _require_silu(hf, "hunyuan_v1_moe")
    E, k = _get(hf, "num_experts", 1), _get(hf, "moe_topk", 1)
    if isinstance(E, list) or isinstance(k, list):
        raise _fail("config.json num_experts or moe_topk is a list (per-layer): a different layer shape per layer "
                    "is not read by pack")
    F = _get(hf, "intermediate_size", 11008)
    # shared_mlp, as wide as the experts and always added; the router is gate.wg
    return _Plan("hunyuan_v1_moe", E, k, F, "softmax_topk", True, shared_intermediate_size=F,
                 shared_name="shared_mlp", router="gate.wg", moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _lara_mini(hf):
    _require_silu(hf, "lara_mini")
    return _Plan("lara_mini", _get(hf, "num_experts", 128), _get(hf, "num_experts_per_tok", 4),
                 _get(hf, "moe_intermediate_size", 512), "softmax_topk", bool(_get(hf, "norm_topk_prob", True)),
                 shared_intermediate_size=_get(hf, "shared_expert_intermediate_size", 512), shared_name="shared_expert",
                 moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _cohere2_moe(hf):
    """Top-k on the logits, then a softmax over the k (gpt-oss's order) or their sigmoids (renormalised with
    norm_topk_prob); shared experts as wide as the routed ones, summed (or averaged, refused)."""
    _require_silu(hf, "cohere2_moe")
    select = _get(hf, "expert_selection_fn", "softmax")
    if select not in ("softmax", "sigmoid"):
        raise _fail(f"config.json expert_selection_fn={select!r}: transformers' cohere2_moe knows softmax and sigmoid")
    n_shared, F = _get(hf, "num_shared_experts", 0), _get(hf, "intermediate_size", 14336)
    combine = _get(hf, "shared_expert_combination_strategy", "average")
    if n_shared > 0 and combine != "sum":
        raise _fail(f"config.json shared_expert_combination_strategy={combine!r}: Cohere2-MoE then halves the sum "
                    "of the routed and shared outputs, and Colibri's shared expert has no scale of its own")
    return _Plan("cohere2_moe", _get(hf, "num_experts", 8), _get(hf, "num_experts_per_tok", 2), F,
                 "topk_softmax" if select == "softmax" else "sigmoid_bias",
                 select == "sigmoid" and bool(_get(hf, "norm_topk_prob", True)),
                 shared_intermediate_size=F * n_shared, shared_name="shared_experts" if n_shared else None,
                 moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _afmoe(hf):
    F, dense = _get(hf, "moe_intermediate_size", 1408), _get(hf, "num_dense_layers", 1)
    n_shared = _get(hf, "num_shared_experts", 2)
    plan = _sigmoid_topk(hf, "afmoe", 64, 6, 1408, scale_key="route_scale",
                         shared=("shared_experts", F * n_shared) if n_shared else None, bias="expert_bias",
                         layers=((lambda i: i >= dense), f"num_dense_layers={dense}"))
    plan.router = "router.gate"
    return plan


def _beam(hf):
    """DeepSeek-V3's router (sigmoid, bias, group top-2 sums) without shared experts; the scale applies to the
    routed output, which is the weights times it."""
    plan = _sigmoid_grouped(dict(hf, n_routed_experts=_get(hf, "num_experts", 256)), "beam",
                            dict(E=256, F=2560, n_group=8, topk_group=4, dense=3, scale=2.5, shared=0))
    moe, rule = _typed_layers(hf)
    if moe is not None:
        plan.moe_layers, plan.dense_rule = moe, rule
    return plan


def _jamba(hf):
    _require_silu(hf, "jamba")
    period, offset = _get(hf, "expert_layer_period", 2), _get(hf, "expert_layer_offset", 1)
    return _Plan("jamba", _get(hf, "num_experts", 16), _get(hf, "num_experts_per_tok", 2),
                 _get(hf, "intermediate_size", 14336), "softmax_topk", False, blocks=("feed_forward",),
                 router="router", moe_layers=lambda i: i % period == offset,
                 dense_rule=f"expert_layer_period={period}, expert_layer_offset={offset}")


def _granitemoe(hf):
    """Top-k on the logits, then a softmax over the k; experts fused as input_linear [E, 2F, H] (gate rows
    first) and output_linear [E, H, F], the router as router.layer."""
    _require_silu(hf, "granitemoe")
    return _Plan("granitemoe", _get(hf, "num_local_experts", 8), _get(hf, "num_experts_per_tok", 2),
                 _get(hf, "intermediate_size", 11008), "topk_softmax", False, blocks=("block_sparse_moe",),
                 router="router.layer", fused=("input_linear.weight", "output_linear.weight"),
                 renames=(("input_linear.weight", "experts.gate_up_proj"), ("output_linear.weight", "experts.down_proj"),
                          ("router.layer.", "router.")),
                 moe_layers=lambda i: True, dense_rule="every layer is MoE")


def _typed_layers(hf):
    """config.json's mlp_layer_types ('dense' / 'sparse' per layer), which the newer families' decoder
    layers follow; None (the tensors tell) without it."""
    types = hf.get("mlp_layer_types")
    if not isinstance(types, list):
        return None, "mlp_layer_types not in config.json"
    return (lambda i: i < len(types) and types[i] == "sparse"), f"mlp_layer_types={types}"


def _with_layer_types(build):
    """A family whose decoder layers follow config.json's mlp_layer_types where it has them."""
    def plan(hf):
        result = build(hf)
        moe, rule = _typed_layers(hf)
        if moe is not None:
            result.moe_layers, result.dense_rule = moe, rule
        return result
    return plan


def _dsv3_like(family, blocks=("mlp",), **defaults):
    """DeepSeek-V3's block (_sigmoid_grouped) under another name; blocks: where the released layout keeps it."""
    def plan(hf):
        result = _sigmoid_grouped(hf, family, defaults)
        result.blocks = blocks
        return result
    return _with_layer_types(plan)


FAMILIES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
            "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe, "gpt_oss": _gpt_oss,
            # The same blocks under other names and defaults (transformers' modular files derive them).
            "minimax": lambda hf: _mixtral(hf, "minimax"),
            "qwen3_next": lambda hf: _qwen2_moe(hf, "qwen3_next", 512, 10, 512, 512, True),
            "qwen3_5_moe_text": lambda hf: _qwen2_moe(hf, "qwen3_5_moe_text", 256, 8, 512, 512, None, True),
            "qwen3_vl_moe_text": lambda hf: _qwen3_moe(hf, "qwen3_vl_moe_text", 60, 4, 1408, norm=True),
            "mellum": _with_layer_types(lambda hf: _qwen3_moe(hf, "mellum", 64, 8, 896, norm=True)),
            "flex_olmo": lambda hf: _olmoe(hf, "flex_olmo", 7, 5, 11008),
            "deepseek_v32": _dsv3_like("deepseek_v32", E=256, F=2048, n_group=8, topk_group=4, dense=3, scale=2.5),
            "glm_moe_dsa": _dsv3_like("glm_moe_dsa", E=256, F=2048, n_group=1, topk_group=1, dense=3, scale=2.5),
            "dots1": _dsv3_like("dots1", E=None, F=1408, n_group=1, topk_group=1, dense=0, scale=1.0, k=None,
                                norm=False, shared=None),
            "kimi_linear": _dsv3_like("kimi_linear", ("block_sparse_moe",), E=256, F=1024, n_group=1, topk_group=1,
                                      dense=1, scale=2.446),
            "glm4_moe_lite": _dsv3_like("glm4_moe_lite", E=64, F=1536, n_group=1, topk_group=1, dense=1, scale=1.8,
                                        k=4),
            "glm4v_moe_text": _dsv3_like("glm4v_moe_text", E=128, F=1408, n_group=1, topk_group=1, dense=1, scale=1.0),
            "solar_open": _dsv3_like("solar_open", E=128, F=1280, n_group=1, topk_group=1, dense=0, scale=1.0),
            "minicpm5_moe": _dsv3_like("minicpm5_moe", E=160, F=512, n_group=1, topk_group=1, dense=1, scale=3.66,
                                       k=16),
            "exaone_moe": _dsv3_like("exaone_moe", E=64, F=1024, n_group=1, topk_group=1, dense=1, scale=2.5,
                                     bias="e_score_correction_bias"),
            "mimo_v2_flash": _dsv3_like("mimo_v2_flash", E=256, F=2048, n_group=1, topk_group=1, dense=1, scale=1.0,
                                        shared=0),
            # Configurations of their own over Glm4MoeForCausalLM and DeepseekV3ForCausalLM.
            "param2moe": _dsv3_like("param2moe", E=64, F=2048, n_group=1, topk_group=1, dense=1, scale=2.5, k=6,
                                    shared=2, bias="gate.expert_bias"),
            "sarvam_moe": _dsv3_like("sarvam_moe", E=128, F=1024, n_group=1, topk_group=1, dense=1, scale=2.5, k=6,
                                     bias="gate.expert_bias"),
            "sarvam_mla": _dsv3_like("sarvam_mla", E=128, F=2048, n_group=1, topk_group=1, dense=1, scale=2.5),
            "cohere2_moe": _cohere2_moe, "granitemoe": _granitemoe, "afmoe": _afmoe, "beam": _beam, "jamba": _jamba, "mistral4": _mistral4,
            "minimax_m2": _minimax_m2, "hy_v3": _hy_v3, "laguna": _laguna, "flint": _flint,
            "lfm2_moe": _lfm2_moe, "hunyuan_v1_moe": _hunyuan_v1_moe, "lara_mini": _lara_mini}
# Multimodal model_types whose language model (config.json text_config) is one of FAMILIES: pack reads
# that model's MoE layers (_model_type), checked by tests/test_families.py with the multimodal model written.
WRAPPERS = {"qwen3_vl_moe": "qwen3_vl_moe_text", "qwen3_5_moe": "qwen3_5_moe_text", "glm4v_moe": "glm4v_moe_text"}
# Other names config.json may use for a key the family reads (transformers' attribute_map: e.g.
# transformers 5.25 writes qwen3_moe's expert count as num_local_experts, the hub's files num_experts).
_TO_N_ROUTED = {"num_local_experts": "n_routed_experts"}
_TO_NUM_EXPERTS = {"num_local_experts": "num_experts"}
ALIASES = {"mixtral": {"num_experts": "num_local_experts"}, "qwen3_moe": _TO_NUM_EXPERTS, "olmoe": _TO_NUM_EXPERTS,
           "deepseek_v2": {"num_experts": "n_routed_experts"}, "deepseek_v3": _TO_N_ROUTED, "glm4_moe": _TO_N_ROUTED,
           "gpt_oss": {"num_experts": "num_local_experts"}, "minimax": {"num_experts": "num_local_experts"},
           "qwen3_vl_moe_text": _TO_NUM_EXPERTS, "mellum": _TO_NUM_EXPERTS, "flex_olmo": _TO_NUM_EXPERTS,
           "minimax_m2": _TO_NUM_EXPERTS, "hy_v3": _TO_NUM_EXPERTS,
           "hunyuan_v1_moe": {"num_experts_per_tok": "moe_topk"},
           **{family: _TO_N_ROUTED for family in ("deepseek_v32", "glm_moe_dsa", "dots1", "glm4_moe_lite",
                                                  "glm4v_moe_text", "solar_open", "minicpm5_moe", "mimo_v2_flash",
                                                  "mistral4")},
           **{family: {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts",
                       "num_shared_experts": "n_shared_experts"}
              for family in ("exaone_moe", "param2moe", "sarvam_moe", "sarvam_mla")},
           "kimi_linear": {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
                           "num_shared_experts": "n_shared_experts", "num_expert_group": "n_group",
                           "moe_renormalize": "norm_topk_prob", "num_experts_per_token": "num_experts_per_tok"}}


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
                 "Glm4MoeForCausalLM": "glm4_moe", "GptOssForCausalLM": "gpt_oss",
                 "MiniMaxForCausalLM": "minimax", "Qwen3NextForCausalLM": "qwen3_next",
                 "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "MellumForCausalLM": "mellum",
                 "FlexOlmoForCausalLM": "flex_olmo", "DeepseekV32ForCausalLM": "deepseek_v32",
                 "GlmMoeDsaForCausalLM": "glm_moe_dsa", "GraniteMoeForCausalLM": "granitemoe", "Dots1ForCausalLM": "dots1",
                 "KimiLinearForCausalLM": "kimi_linear", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
                 "SolarOpenForCausalLM": "solar_open", "MiniCPM5MoeForCausalLM": "minicpm5_moe",
                 "ExaoneMoeForCausalLM": "exaone_moe", "MiMoV2FlashForCausalLM": "mimo_v2_flash",
                 "MiniMaxM2ForCausalLM": "minimax_m2", "HYV3ForCausalLM": "hy_v3", "LagunaForCausalLM": "laguna",
                 "FlintForCausalLM": "flint", "Lfm2MoeForCausalLM": "lfm2_moe",
                 "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe", "LaraMiniForCausalLM": "lara_mini"}
# transformers' MoE block of each family, for --verify: (module, class).
BLOCK_CLASSES = {"mixtral": ("mixtral", "MixtralSparseMoeBlock"), "qwen2_moe": ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
                 "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"), "olmoe": ("olmoe", "OlmoeSparseMoeBlock"),
                 "deepseek_v2": ("deepseek_v2", "DeepseekV2Moe"), "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE"),
                 "glm4_moe": ("glm4_moe", "Glm4MoeMoE"), "gpt_oss": ("gpt_oss", "GptOssMLP"),
                 "minimax": ("minimax", "MiniMaxSparseMoeBlock"),
                 "qwen3_next": ("qwen3_next", "Qwen3NextSparseMoeBlock"),
                 "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock"),
                 "qwen3_vl_moe_text": ("qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock"),
                 "mellum": ("mellum", "MellumSparseMoeBlock"), "flex_olmo": ("flex_olmo", "FlexOlmoSparseMoeBlock"),
                 "deepseek_v32": ("deepseek_v32", "DeepseekV32MoE"), "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaMoE"),
                 "dots1": ("dots1", "Dots1MoE"), "kimi_linear": ("kimi_linear", "KimiLinearMoE"),
                 "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteMoE"),
                 "glm4v_moe_text": ("glm4v_moe", "Glm4vMoeTextMoE"), "solar_open": ("solar_open", "SolarOpenMoE"),
                 "minicpm5_moe": ("minicpm5_moe", "MiniCPM5MoeMoE"),
                 "exaone_moe": ("exaone_moe", "ExaoneMoeSparseMoEBlock"),
                 "mimo_v2_flash": ("mimo_v2_flash", "MiMoV2FlashMoE"), "mistral4": ("mistral4", "Mistral4MoE"),
                 "minimax_m2": ("minimax_m2", "MiniMaxM2SparseMoeBlock"), "hy_v3": ("hy_v3", "HYV3MoE"),
                 "laguna": ("laguna", "LagunaSparseMoeBlock"), "flint": ("flint", "FlintSparseMoeBlock"),
                 "lfm2_moe": ("lfm2_moe", "Lfm2MoeSparseMoeBlock"),
                 "hunyuan_v1_moe": ("hunyuan_v1_moe", "HunYuanMoEV1Moe"),
                 "lara_mini": ("lara_mini", "LaraMiniSparseMoeBlock"), "param2moe": ("glm4_moe", "Glm4MoeMoE"),
                 "cohere2_moe": ("cohere2_moe", "Cohere2MoeSparseMoeBlock"), "granitemoe": ("granitemoe", "GraniteMoeMoE"), "afmoe": ("afmoe", "AfmoeSparseMoeBlock"),
                 "beam": ("beam", "BeamMoE"), "jamba": ("jamba", "JambaSparseMoeBlock"),
                 "sarvam_moe": ("glm4_moe", "Glm4MoeMoE"), "sarvam_mla": ("deepseek_v3", "DeepseekV3MoE")}


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
    if model_type not in FAMILIES and model_type not in REFUSED_FAMILIES and text.get("model_type") in FAMILIES:
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
