"""Converts the MoE layers of a Hugging Face safetensors checkpoint into packed Colibri checkpoints
(see colibri/checkpoint.py), reading tensors lazily through memory maps so a large model is never
loaded whole. Nothing is unpickled.

pack knows what it packs: config.json's model_type names the family, and every MoE setting is read
from config.json with that family's transformers 5.25 defaults (configuration_*.py), so the packed
layer computes what transformers' MoE block of that family computes:

    family                   model_type    routing                       also packed
    Mixtral                  mixtral       softmax, top-k, renormalised
    Qwen1.5/Qwen2-MoE        qwen2_moe     softmax, top-k, norm_topk_prob shared expert + sigmoid gate
    Qwen3-MoE                qwen3_moe     softmax, top-k, norm_topk_prob
    OLMoE                    olmoe         softmax, top-k, norm_topk_prob
    DeepSeek-V2              deepseek_v2   softmax, greedy or group_limited_greedy (group max),
                                           times routed_scaling_factor, never renormalised (as
                                           transformers' DeepseekV2TopkRouter)   shared experts
    DeepSeek-V3              deepseek_v3   sigmoid + e_score_correction_bias, group top-2 sum,
                                           norm_topk_prob, routed_scaling_factor  shared experts
    GLM-4.5                  glm4_moe      as DeepSeek-V3                          shared experts
    gpt-oss                  gpt_oss       logits + router bias, top-k then softmax; clamped SwiGLU
                                           (swiglu_alpha, swiglu_limit) with expert biases

gpt-oss's MXFP4-quantised experts (the released checkpoints: `*_blocks`/`*_scales` tensors, config.json
quantization_config quant_method "mxfp4") are, for now, dequantised by pack to bf16, exactly as
transformers' dequantisation does (every MXFP4 value is exact in bf16), and packed as bf16 experts;
the packed file's metadata says so (source_quantization). Colibri does not compute in MXFP4.

fp8 e4m3 experts (DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8 in 128 x 128 blocks; per-tensor and
per-channel releases) are packed as stored, codes and scales bit for bit, as a colibri-moe/3 file
(the fp8 section below says which layouts); `dtype="fp8"` quantises any other checkpoint's experts in
128 x 128 blocks, and fp32 / fp16 / bf16 dequantise an fp8 one.

Refused, naming the reason: PhiMoE (sparsemixer routing is not implemented), Kimi-K2 (transformers
has no kimi_k2 to check it against), any other quantization_config (quant_method other than mxfp4 and
the fp8 ones, or mxfp4 outside gpt-oss: dequantise first), MXFP4 blocks with E8M0's NaN scale (255)
or a value beyond bf16's range, fp8 weights that are e5m2, NaN or without a well-shaped scale, any
tensor in an MoE block that the family does not explain (a bias, a quantisation scale), a dense
layer, and any other model_type or a folder without config.json.
`unverified_routing=True` (`--unverified-routing`) lets through an unknown model_type (a family named
by config.json's `architectures`, else the generic reading below) and the overrides of top_k, routing,
renormalize and routed_scaling_factor, each of which may make the layer compute something other than
the model.

Weight layouts, under `<prefix>layers.N.<block>.` (block `block_sparse_moe` or `mlp`):

    per expert     experts.M.w1 / w3 / w2.weight (Mixtral) or experts.M.gate_proj / up_proj /
                   down_proj.weight = gate [F,H] / up [F,H] / down [H,F]: hub checkpoints, and what
                   transformers 5.25's save_pretrained writes
    fused          experts.gate_up_proj [E,2F,H] (rows [0,F) gate, [F,2F) up), experts.down_proj
                   [E,H,F]: transformers 5's in-memory layout
    gpt-oss        experts.gate_up_proj [E,H,2F] with gate and up interleaved (gate = [..., ::2],
                   up = [..., 1::2]), gate_up_proj_bias [E,2F], down_proj [E,F,H], down_proj_bias
                   [E,H]: de-interleaved and transposed into gate [F,H], up [F,H], down [H,F]
    gpt-oss MXFP4  experts.gate_up_proj_blocks / _scales and down_proj_blocks / _scales in place of
                   gate_up_proj and down_proj, the biases as above (layout: see MXFP4 below)

`verify=True` (`--verify`, needs torch and transformers) builds the family's MoE block with
transformers from config.json and the source tensors and compares it, in fp32 on random tokens, with
the packed layer (colibri's CPU layer, or colibri.reference where the library predates
colibri_moe_context_create); on a relative error above 1e-5 the packed file is deleted and pack fails.
Where the installed transformers' gpt-oss block ignores config.json's swiglu_alpha or swiglu_limit (older
releases fix 1.702 and 7.0), a layer of other values is refused the same way, naming why.
The block is loaded with the values the packed layer holds: fp8 weights dequantised, weights packed
in another dtype rounded (or quantised) as pack did."""
import dataclasses
import json
import pathlib
import re
import sys
import time

import numpy as np

from colibri import checkpoint, fp8
from colibri import safetensors_io as st
from colibri._native import STATUS_INVALID_ARGUMENT, ColibriError
from colibri.dtypes import from_float, to_float32
from colibri.config import ROUTINGS, LayerConfig

MOE_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<layer>\d+)\.(?P<block>block_sparse_moe|mlp)\."
                      r"(?:gate\.weight|router\.weight|experts\.)")
LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PER_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}
VERIFY_TOLERANCE = 1e-5


def _fail(message) -> ColibriError:
    return ColibriError(message, STATUS_INVALID_ARGUMENT)


class _Source:
    """Tensor name -> the shard holding it, for a file, a folder of shards or an index json."""

    def __init__(self, src):
        path = pathlib.Path(src)
        if path.suffix in st.PICKLE_SUFFIXES:
            raise _fail(f"{path}: {st.PICKLE_REFUSAL}")
        if not path.exists():
            raise _fail(f"{path}: no such file or folder")
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            self.folder = path
            if index.is_file():
                shards = self._read_index(index)
            else:
                files = sorted(p for p in path.glob("*.safetensors") if not p.name.endswith(".colibri.safetensors"))
                if not files:
                    pickles = sorted(p.name for p in path.iterdir() if p.suffix in st.PICKLE_SUFFIXES)
                    raise _fail(f"{path}: no .safetensors files" + (
                        f" (only {', '.join(pickles)}: {st.PICKLE_REFUSAL})" if pickles else ""))
                shards = {f: None for f in files}
        elif path.name.endswith(".json"):
            self.folder = path.parent
            shards = self._read_index(path)
        elif path.suffix == ".safetensors":
            self.folder = path.parent
            shards = {path: None}
        else:
            raise _fail(f"{path}: expected a .safetensors file, a folder of shards or a model.safetensors.index.json")
        self.files, self.where = {}, {}
        for shard, names in shards.items():
            try:
                file = st.SafetensorsFile(shard)
            except FileNotFoundError:
                raise _fail(f"{shard}: shard listed in the index does not exist") from None
            except st.SafetensorsError as exc:
                raise _fail(str(exc)) from None
            self.files[shard] = file
            for name in (file.keys() if names is None else names):
                if name not in file:
                    raise _fail(f"{shard}: the index lists tensor {name!r} but the shard lacks it")
                self.where[name] = file

    @staticmethod
    def _read_index(index: pathlib.Path) -> dict:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _fail(f"{index}: not a safetensors index with a weight_map ({exc})") from None
        shards = {}
        for name, shard in weight_map.items():
            shards.setdefault(index.parent / shard, []).append(name)
        return shards

    def __contains__(self, name) -> bool:
        return name in self.where

    def info(self, name) -> st.TensorInfo:
        return self.where[name].tensors[name]

    def get(self, name) -> np.ndarray:
        return self.where[name].get(name)


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.start = self.last = time.monotonic()
        self.bytes = 0

    def update(self, done: int, nbytes: int) -> None:
        self.bytes += nbytes
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and done < self.total):
            return
        self.last = now
        filled = 30 * done // self.total
        rate = self.bytes / max(now - self.start, 1e-9) / 1e6
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} "
                         f"{self.bytes / 1e6:.1f} MB {rate:.0f} MB/s")
        if done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# ---------------------------------------------------------------------------------------------------
# Families: what each model_type's MoE block computes, read from config.json with transformers'
# defaults for that family (transformers 5.25, models/<family>/configuration_*.py).


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


# ---------------------------------------------------------------------------------------------------
# fp8 e4m3 experts as released, read as stored (colibri.fp8 describes the scale grids):
#
#   block       <proj>.weight F8_E4M3 [N, K] and <proj>.weight_scale_inv F32 [ceil(N/bn), ceil(K/bk)],
#               quantization_config {quant_method: "fp8", fmt: "e4m3", weight_block_size: [bn, bk]}
#               (DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8; transformers' FineGrainedFP8);
#               compressed-tensors' "block" strategy stores the same grid as <proj>.weight_scale
#   per tensor  <proj>.weight_scale [] or [1] (AutoFP8's quant_method "fp8", compressed-tensors "tensor";
#               transformers' FineGrainedFP8 with weight_block_size null: weight_scale_inv [])
#   per channel <proj>.weight_scale [N] or [N, 1] (fbgemm_fp8, compressed-tensors "channel")
#
# Every scale multiplies (DeepSeek's "_inv" too: w = fp8 * weight_scale_inv). A static activation scale
# (<proj>.input_scale, or transformers' <proj>.activation_scale) is accepted and not used: Colibri's
# GPU quantises activations itself, per token and 128 inputs, and the CPU not at all; the reference
# of record is the layer of the dequantised weights. Every matrix of a layer (routed and shared
# experts) must have the same granularity; e5m2, ue8m0 scales, fp4 experts and any other shape are
# refused by name.

FP8_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
FP8_SCALE_DTYPES = ("F32", "BF16", "F16")  # each exact in float32
STATIC_INPUT_SCALES = ("input_scale", "activation_scale")


@dataclasses.dataclass
class _Fp8Scheme:
    """What config.json's quantization_config says about fp8 weights."""
    method: str
    block: tuple = None            # (bn, bk) the 2-D scale grids are blocks of; None: per tensor or channel
    static_activations: bool = False
    ignored: tuple = ()            # settings Colibri does not apply, for the note


def _fp8_scheme(config: dict) -> _Fp8Scheme:
    method = config["quant_method"]

    def refuse(setting, why):
        return _fail(f"config.json quantization_config {setting} (quant_method {method!r}): {why}")
    if method == "fp8":
        for key, wanted in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
            if config.get(key, wanted) != wanted:
                raise refuse(f"{key}={config[key]!r}", f"pack reads fp8 e4m3 weights with float32 scales ({key} "
                                                       f"{wanted!r})")
        block = config.get("weight_block_size", (128, 128))  # transformers' default when the key is absent
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise refuse(f"weight_block_size={block!r}", "expected two integers > 0")
            block = tuple(block)
        static = config.get("activation_scheme", "dynamic") == "static"
        return _Fp8Scheme(method, block, static, ("activation_scheme static",) if static else ())
    if method == "fbgemm_fp8":
        bound = config.get("activation_scale_ub")
        return _Fp8Scheme(method, None, False, (f"activation_scale_ub={bound}",) if bound is not None else ())
    # compressed-tensors: every group must hold 8-bit float weights, symmetric (no zero points)
    groups = config.get("config_groups")
    if config.get("format", "float-quantized") != "float-quantized":
        raise refuse(f"format={config['format']!r}", "pack reads 'float-quantized' (fp8) compressed-tensors only")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups", "missing: pack cannot tell how the weights are quantised")
    blocks, static = set(), False
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict) or (weights.get("type"), weights.get("num_bits")) != ("float", 8) \
                or weights.get("symmetric", True) is not True:
            raise refuse(f"config_groups.{group_name}.weights={weights!r}",
                         "pack reads symmetric 8-bit float (fp8 e4m3) weights only")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise refuse(f"config_groups.{group_name}.weights.strategy={strategy!r}",
                         "pack reads the tensor, channel and block strategies")
        if strategy == "block":
            structure = weights.get("block_structure")
            if not (isinstance(structure, list) and len(structure) == 2 and all(isinstance(b, int) and b > 0
                                                                               for b in structure)):
                raise refuse(f"config_groups.{group_name}.weights.block_structure={structure!r}",
                             "expected two integers > 0")
            blocks.add(tuple(structure))
        activations = group.get("input_activations")
        static |= isinstance(activations, dict) and activations.get("dynamic") is False
    if len(blocks) > 1:
        raise refuse("config_groups", f"block structures {sorted(blocks)} differ: one layer has one")
    return _Fp8Scheme(method, blocks.pop() if blocks else None, static,
                      ("static input_activations",) if static else ())


def _granularity(block) -> str:
    return {(0, 0): "per-tensor", (1, 0): "per-channel"}.get(tuple(block), f"block {block[0]}x{block[1]}")


def _fp8_scale(source, weight: str, shape, scheme: _Fp8Scheme):
    """(the scale tensor of fp8 weight `weight` [N, K], its (bn, bk), its static activation scales' names),
    checked against the scheme; refuses a missing, doubled or misshapen scale by name."""
    stem = weight[:-len("weight")]  # "...proj." of "...proj.weight"
    found = [name for name in (weight + "_scale_inv", stem + "weight_scale") if name in source]
    if not found:
        raise _fail(f"{weight}: fp8 weights without a scale (expected {weight}_scale_inv or {stem}weight_scale)")
    if len(found) > 1:
        raise _fail(f"{weight}: both {found[0]} and {found[1]}: refused rather than guessed which one applies")
    name = found[0]
    info = source.info(name)
    if info.dtype not in FP8_SCALE_DTYPES:
        raise _fail(f"{name}: dtype {info.dtype}, expected float32 scales (F32; BF16 and F16 are widened exactly)"
                    + (" (ue8m0 scales are not read)" if info.dtype in ("U8", "F8_E8M0") else ""))
    N, K = shape
    tensor_shapes, channel_shapes = ((), (1,)), ((N,), (N, 1))
    # transformers writes a per-tensor scale_inv when weight_block_size is null; blocks otherwise.
    if scheme.block is not None and (name.endswith("_scale_inv") or scheme.method == "compressed-tensors"):
        bn, bk = scheme.block
        expected = {fp8.grid_shape(shape, bn, bk): (bn, bk)}
    elif name.endswith("_scale_inv"):
        expected = {s: (0, 0) for s in tensor_shapes}
    else:
        expected = {**{s: (0, 0) for s in tensor_shapes}, **{s: (1, 0) for s in channel_shapes}}
    if info.shape not in expected:
        wanted = " or ".join(f"{list(s)} ({_granularity(b)})" for s, b in expected.items())
        raise _fail(f"{name}: shape {list(info.shape)}, expected {wanted} for the fp8 weights {weight} "
                    f"{list(shape)} (quant_method {scheme.method!r})")
    static = [stem + s for s in STATIC_INPUT_SCALES if stem + s in source]
    for static_name in static:
        if source.info(static_name).numel != 1:
            raise _fail(f"{static_name}: shape {list(source.info(static_name).shape)}, expected one static "
                        "activation scale ([] or [1])")
    return name, expected[info.shape], static


def _fp8_grid(source, name, shape, block) -> np.ndarray:
    """The scale tensor `name` of a matrix [N, K] as its float32 grid, refused if not finite."""
    grid = _as_float32(source, name).reshape(fp8.grid_shape(shape, *block))
    if not np.isfinite(grid).all():
        raise _fail(f"{name}: a scale is not finite")
    return grid


def _fp8_codes(source, name) -> np.ndarray:
    codes = source.get(name)
    if ((codes & 0x7F) == 0x7F).any():  # S.1111.111: e4m3fn's NaN
        raise _fail(f"{name}: holds an fp8 NaN (code 0x7f or 0xff)")
    return codes


# ---------------------------------------------------------------------------------------------------
# MXFP4 (OCP Microscaling FP4), as gpt-oss ships its experts; read from transformers 5.25's
# integrations/mxfp4.py (convert_moe_packed_tensors) and its quantizer's serialized names.
#
# A projection with `rows` outputs and `cols` inputs is stored per expert as
#   <proj>_blocks [E, rows, cols/32, 16] uint8: blocks of 32 consecutive inputs; byte j of a block
#                 holds input 2j in its low nibble and input 2j+1 in its high nibble;
#   <proj>_scales [E, rows, cols/32]     uint8: one E8M0 exponent s per block, the factor 2^(s-127).
# A nibble is an FP4 E2M1 code: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
# gate_up_proj has rows = 2F (gate and up interleaved: even rows gate, odd rows up) and cols = H;
# down_proj has rows = H and cols = F. transformers transposes the dequantised [E, rows, cols] into
# its bf16 layouts [E, H, 2F] and [E, F, H]; pack wants [outputs, inputs] rows, so it keeps them.
#
# Every value is code * 2^(s-127) with at most two significant bits and magnitude >= 2^-128, so it
# is exact in float32 and in bf16 (whose subnormals reach 2^-133) unless it exceeds their range
# (s >= 253): refused, as is s = 255, E8M0's NaN, which transformers reads as 2^128 instead.

MXFP4_BLOCK = 32
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
# byte -> its two values (low nibble first), so one gather decodes a block.
_FP4_PAIRS = np.stack([FP4_E2M1[np.arange(256) & 0x0F], FP4_E2M1[np.arange(256) >> 4]], axis=-1)
# E8M0 code -> 2^(code-127) in float32 (2^-127 is a float32 subnormal: exact); 255 is refused.
_E8M0 = np.ldexp(np.float32(1.0), np.arange(255) - 127).astype(np.float32)


def dequantize_mxfp4(blocks, scales, name="MXFP4 tensor") -> np.ndarray:
    """MXFP4 blocks [..., G, 16] and scales [..., G] (uint8) -> their values [..., 32G] in float32,
    inputs in order (not transposed). Raises ColibriError on a NaN scale or a value beyond bf16."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1:] != (MXFP4_BLOCK // 2,) \
            or blocks.shape[:-1] != scales.shape:
        raise _fail(f"{name}: MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales {list(scales.shape)} "
                    f"{scales.dtype} do not match (expected uint8 [..., G, 16] and [..., G])")
    if (scales == 255).any():
        raise _fail(f"{name}: an E8M0 scale of 255 (NaN in the MX format; transformers reads it as 2^128): "
                    "refused rather than guessed")
    values = np.take(_FP4_PAIRS, blocks, axis=0).reshape(*scales.shape, MXFP4_BLOCK)
    with np.errstate(over="ignore"):
        values *= _E8M0[scales][..., None]
    if not np.isfinite(values).all():
        raise _fail(f"{name}: an MXFP4 value beyond bf16's range (scale {int(scales.max())}): refused")
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK)


def _exact_bf16(values: np.ndarray, name) -> np.ndarray:
    """float32 values that bf16 holds exactly -> their bf16 bits (the top half: no rounding to do)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    if (bits & 0xFFFF).any():
        raise _fail(f"{name}: a dequantised MXFP4 value is not exact in bf16")  # cannot happen, see above
    return (bits >> 16).astype(np.uint16)


def _expect_mxfp4(source, prefix, E, rows, cols) -> None:
    """Checks prefix_blocks / prefix_scales hold an [E, rows, cols] projection."""
    if cols % MXFP4_BLOCK:
        raise _fail(f"{prefix}_blocks: {cols} inputs are not a whole number of {MXFP4_BLOCK}-value MXFP4 blocks")
    _expect_shape(source, prefix + "_blocks", (E, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2))
    _expect_shape(source, prefix + "_scales", (E, rows, cols // MXFP4_BLOCK))
    for suffix in ("_blocks", "_scales"):
        if source.info(prefix + suffix).dtype != "U8":
            raise _fail(f"{prefix}{suffix}: dtype {source.info(prefix + suffix).dtype}, MXFP4 is stored as U8")


# ---------------------------------------------------------------------------------------------------
# Layers and weights


def _found_layers(source: _Source, blocks) -> dict:
    """Decoder layer index -> its MoE block's tensor prefix, for the layers with MoE tensors."""
    found = {}
    for name in source.where:
        match = MOE_NAME.match(name)
        if match and match["block"] in blocks:
            found.setdefault(int(match["layer"]), set()).add((match["prefix"], match["block"]))
    return {layer: "{0}{layer}.{1}.".format(*min(pairs, key=lambda p: (len(p[0]), p[1])), layer=layer)
            for layer, pairs in found.items()}


def _refuse_without_moe(source: _Source, hf, src) -> None:
    """Refuses weights without any MoE block at once, before the family or the routing is asked
    about: a dense model has nothing to pack whatever --unverified-routing or --top-k say."""
    if _found_layers(source, ("block_sparse_moe", "mlp")):
        return
    expert = next((n for n in sorted(source.where) if "expert" in n.lower()), None)
    if expert is not None:
        raise _fail(f"{src}: no MoE layer pack can read: expert tensors such as {expert} are not under "
                    "layers.N.mlp or layers.N.block_sparse_moe, the layouts pack reads")
    model_type, _ = _model_type(hf or {})
    count = f"{len(source.where)} tensors"
    if model_type in FAMILIES:  # the config says MoE, the tensors do not: e.g. one shard of several
        raise _fail(f"{src}: no MoE layer found in these {count}, though config.json's model_type {model_type!r} "
                    "is an MoE family; pass the whole model (its folder or model.safetensors.index.json)")
    model = f"model_type {model_type!r}; " if model_type else ""
    raise _fail(f"{src}: no MoE layer found: a dense model ({model}none of its {count} is an expert or a router "
                "like model.layers.N.mlp.experts.M.gate_proj.weight); pack converts MoE layers only")


def _layer_count(source: _Source):
    """1 + the highest decoder layer index in the tensors' names (layers.N.), or None without any."""
    indices = [int(m[1]) for m in map(LAYER_NAME.search, source.where) if m]
    return max(indices) + 1 if indices else None


def _choose_layers(plan: _Plan, found: dict, layer, layer_count=None):
    """The (layer, prefix) pairs to pack: one layer, the first MoE layer, or all ('all'). layer_count:
    the decoder layers the tensors name, for the range when config.json has no num_hidden_layers."""
    def moe(i):
        return plan.moe_layers is None or plan.moe_layers(i)
    if plan.num_layers is not None:
        beyond = sorted(i for i in found if i >= plan.num_layers)
        found = {i: base for i, base in found.items() if i < plan.num_layers}
        if isinstance(layer, int) and layer in beyond:
            raise _fail(f"layer {layer} is beyond config.json num_hidden_layers={plan.num_layers} (e.g. a "
                        "multi-token-prediction layer), which transformers does not run")
    count = plan.num_layers if plan.num_layers is not None else layer_count
    if isinstance(layer, int) and count is not None and not 0 <= layer < count:
        # Before asking whether it is MoE: a family's rule (e.g. decoder_sparse_step) says so of any index.
        where = f"config.json num_hidden_layers={count}" if plan.num_layers is not None else \
            "counted from the tensor names"
        raise _fail(f"layer {layer} is out of range: the model has {count} decoder layers, 0 to {count - 1} "
                    f"({where}); MoE layers: {', '.join(map(str, sorted(found))) or 'none'}")
    dense_with_experts = sorted(i for i in found if not moe(i))
    if dense_with_experts:
        raise _fail(f"layer {dense_with_experts[0]} has MoE tensors but config.json makes it dense "
                    f"({plan.dense_rule}): the config and the weights disagree")
    if not found:
        raise _fail("no MoE layer found (expected tensors like model.layers.N.mlp.gate.weight and "
                    "model.layers.N.mlp.experts.M.gate_proj.weight)")
    listing = ", ".join(map(str, sorted(found)))
    if layer is None:
        first = min(found)
        return [(first, found[first])]
    if layer == "all":
        return sorted(found.items())
    if not moe(layer):
        raise _fail(f"layer {layer} is a dense layer ({plan.dense_rule}): it has no experts to pack; "
                    f"MoE layers here: {listing}")
    if layer not in found:
        raise _fail(f"layer {layer} is not an MoE layer; MoE layers: {listing}")
    return [(layer, found[layer])]


def _check_dtype(source, names, what, fp8_scheme=None) -> str:
    """The one safetensors dtype of the tensors `names`; F8_E4M3 only with an fp8 quantization_config."""
    dtypes = {source.info(n).dtype for n in names}
    if len(dtypes) > 1:
        raise _fail(f"{what}: inconsistent dtypes {', '.join(sorted(dtypes))}")
    dtype = dtypes.pop()
    if dtype == "F8_E5M2":
        raise _fail(f"{what}: dtype F8_E5M2 (fp8 e5m2) is not read: Colibri's fp8 weights are e4m3")
    if dtype == "F8_E4M3" and fp8_scheme is None:
        raise _fail(f"{what}: dtype F8_E4M3, but config.json has no quantization_config with an fp8 quant_method "
                    f"({', '.join(FP8_METHODS)}) saying how the weights are scaled; refused rather than guessed")
    if dtype not in st.SAFETENSORS_TO_COLIBRI:
        raise _fail(f"{what}: dtype {dtype} is not supported (fp32, fp16, bf16, fp8 e4m3; dequantize first)")
    return dtype


def _expect_shape(source, name, shape) -> None:
    if name not in source:
        raise _fail(f"missing tensor {name}")
    actual = source.info(name).shape
    if actual != tuple(shape):
        raise _fail(f"{name}: shape {list(actual)}, expected {list(shape)}")


class _Fp8Weights:
    """A layer's fp8 matrices and their scales (_fp8_scale), checked to share one granularity."""

    def __init__(self, source, scheme: _Fp8Scheme):
        self.source, self.scheme = source, scheme
        self.block = self.first = None
        self.scales = {}   # weight name -> (scale name, matrix shape)
        self.static = []   # names of the static activation scales (accepted, not used)

    def add(self, weight, shape) -> None:
        scale, block, static = _fp8_scale(self.source, weight, shape, self.scheme)
        if self.block is None:
            self.block, self.first = block, scale
        elif block != self.block:
            raise _fail(f"{scale} gives {weight} {_granularity(block)} scales but {self.first} gives "
                        f"{_granularity(self.block)} ones: every matrix of a layer must share one granularity")
        self.scales[weight] = (scale, tuple(shape))
        self.static += static

    def grid(self, weight) -> np.ndarray:
        scale, shape = self.scales[weight]
        return _fp8_grid(self.source, scale, shape, self.block)

    def codes(self, weight) -> np.ndarray:
        return _fp8_codes(self.source, weight)

    def dequantize(self, weight) -> np.ndarray:
        """The matrix's weights in float64, exactly."""
        return fp8.dequantize(self.codes(weight), self.grid(weight), *self.block)

    @property
    def names(self) -> set:
        return {scale for scale, _ in self.scales.values()} | set(self.static)

    def describe(self) -> str:
        suffix = "weight_scale_inv" if self.first.endswith("_scale_inv") else "weight_scale"
        return f"fp8 e4m3 ({self.scheme.method}), {_granularity(self.block)} scales ({suffix})"


@dataclasses.dataclass
class _Layer:
    """Where one MoE layer's weights are, checked against the plan: the tensor names it uses and
    functions giving each packed row."""
    E: int
    H: int
    F: int
    layout: str
    dtype: str                      # safetensors dtype of the expert weights
    expert_row: object              # m -> list of matrices (source dtype) making expert m's packed row
    used: set
    bias_row: object = None         # m -> float32 [2F+H]
    shared: list = None             # names of gate, up, down
    shared_gate: str = None
    correction_bias: str = None
    logit_bias: str = None
    expert_names: object = None     # m -> the names of expert m's matrices (per-expert layouts)
    fp8: _Fp8Weights = None         # fp8 experts: their scales


def _locate(source: _Source, base: str, plan: _Plan) -> _Layer:
    router = base + plan.router + ".weight"
    if router not in source:
        raise _fail(f"missing router {router}")
    shape = source.info(router).shape
    if len(shape) != 2:
        raise _fail(f"{router}: expected a 2-D [E, H] router, got shape {list(shape)}")
    E, H = shape
    for key, value, what in (("num_experts", plan.num_experts, E), ("hidden_size", plan.hidden_size, H)):
        if value is not None and value != what:
            raise _fail(f"config.json gives {key}={value} but {router} has shape {list(shape)}")
    if plan.gpt_oss:
        layer = _locate_gpt_oss(source, base, E, H, plan.intermediate_size, plan.quantization)
    else:
        layer = _locate_swiglu(source, base, E, H, plan.intermediate_size, router, plan.fp8)
    layer.used.add(router)
    if plan.shared_intermediate_size:
        Fs = plan.shared_intermediate_size
        names = [f"{base}{plan.shared_name}.{p}_proj.weight" for p in ("gate", "up", "down")]
        for name, shape in zip(names, ((Fs, H), (Fs, H), (H, Fs))):
            _expect_shape(source, name, shape)
        if _check_dtype(source, names, "shared expert weights", plan.fp8) != layer.dtype:
            raise _fail(f"{names[0]}: dtype {source.info(names[0]).dtype}, the experts' is {layer.dtype}: "
                        "the shared expert is packed beside them, in their dtype")
        if layer.fp8 is not None:
            for name, shape in zip(names, ((Fs, H), (Fs, H), (H, Fs))):
                layer.fp8.add(name, shape)
        layer.shared = names
        layer.used.update(names)
        if plan.shared_gate:
            layer.shared_gate = f"{base}{plan.shared_name}_gate.weight"
            _expect_shape(source, layer.shared_gate, (1, H))
            layer.used.add(layer.shared_gate)
    if plan.correction_bias:
        name = base + "gate.e_score_correction_bias"
        if name in source or not plan.family.startswith("generic"):
            _expect_shape(source, name, (E,))
            layer.correction_bias = name
            layer.used.add(name)
    if layer.fp8 is not None:
        layer.used.update(layer.fp8.names)
    unexplained = sorted(n for n in source.where if n.startswith(base) and n not in layer.used)
    if unexplained:
        raise _fail(f"{unexplained[0]}{f' (and {len(unexplained) - 1} more)' if len(unexplained) > 1 else ''}: "
                    f"a tensor of the MoE block that {plan.family}'s layer does not use; packing without it "
                    "would change what the layer computes")
    return layer


def _locate_swiglu(source, base, E, H, F_config, router, fp8_scheme=None) -> _Layer:
    if base + "experts.gate_up_proj" in source:
        gate_up, down = base + "experts.gate_up_proj", base + "experts.down_proj"
        if down not in source:
            raise _fail(f"missing {down} (the fused layout needs gate_up_proj and down_proj)")
        shape = source.info(gate_up).shape
        if len(shape) != 3 or shape[0] != E or shape[1] % 2 or shape[2] != H:
            hint = " (looks transposed, [E, H, 2F]: gpt-oss's layout, for model_type gpt_oss only)" \
                if len(shape) == 3 and shape[1] == H else ""
            raise _fail(f"{gate_up}: shape {list(shape)}, expected [E={E}, 2F, H={H}]{hint}")
        F = shape[1] // 2
        _expect_shape(source, down, (E, H, F))
        if source.info(gate_up).dtype.startswith("F8"):
            raise _fail(f"{gate_up}: fp8 experts in the fused layout are not read (the released fp8 checkpoints "
                        "store each expert's projections apart: experts.M.gate_proj.weight and its scale)")
        dtype = _check_dtype(source, (gate_up, down), "expert weights")
        # gate and up apart: fp8 quantises each matrix on its own scale grid
        layer = _Layer(E, H, F, "fused", dtype,
                       lambda m: [source.get(gate_up)[m][:F], source.get(gate_up)[m][F:], source.get(down)[m]],
                       {gate_up, down})
    else:
        for layout, (g, u, d) in PER_EXPERT_NAMES.items():
            if base + f"experts.0.{g}.weight" in source:
                break
        else:
            raise _fail(f"no experts under {base}experts. (expected experts.M.w1/w3/w2.weight, "
                        "experts.M.gate_proj/up_proj/down_proj.weight or experts.gate_up_proj)")
        names = [[base + f"experts.{m}.{part}.weight" for part in (g, u, d)] for m in range(E)]
        missing = [n for row in names for n in row if n not in source]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise _fail(f"missing expert tensors: {', '.join(missing[:3])}{more} (router {router} has E={E})")
        extra = base + f"experts.{E}.{g}.weight"
        if extra in source:
            raise _fail(f"{extra} exists but the router {router} has only E={E} experts")
        F = source.info(names[0][0]).shape[0]
        for gate_name, up_name, down_name in names:
            _expect_shape(source, gate_name, (F, H))
            _expect_shape(source, up_name, (F, H))
            _expect_shape(source, down_name, (H, F))
        dtype = _check_dtype(source, [n for row in names for n in row], "expert weights", fp8_scheme)
        layer = _Layer(E, H, F, layout, dtype, lambda m: [source.get(n) for n in names[m]],
                       {n for row in names for n in row}, expert_names=lambda m: names[m])
        if dtype == "F8_E4M3":
            layer.fp8 = _Fp8Weights(source, fp8_scheme)
            for row in names:
                for name, shape in zip(row, ((F, H), (F, H), (H, F))):
                    layer.fp8.add(name, shape)
    if F_config is not None and F_config != layer.F:
        raise _fail(f"config.json gives the expert intermediate size {F_config} but the tensors give {layer.F}")
    return layer


def _locate_gpt_oss(source, base, E, H, F, quantization=None) -> _Layer:
    experts = base + "experts."
    gate_up, down = experts + "gate_up_proj", experts + "down_proj"
    gate_up_bias, down_bias, logit_bias = experts + "gate_up_proj_bias", experts + "down_proj_bias", base + "router.bias"
    quantised = [p + "_blocks" in source or p + "_scales" in source for p in (gate_up, down)]
    if any(quantised) and quantization != "mxfp4":
        raise _fail(f"{experts}*_blocks / *_scales: MXFP4-quantised experts, but config.json has no "
                    "quantization_config with quant_method 'mxfp4' saying so; refused rather than guessed")
    if any(quantised) and not all(quantised):
        raise _fail(f"{experts}: one of gate_up_proj and down_proj is MXFP4 (_blocks, _scales) and the other is not")
    _expect_shape(source, gate_up_bias, (E, 2 * F))
    _expect_shape(source, down_bias, (E, H))
    _expect_shape(source, logit_bias, (E,))
    if all(quantised):
        _expect_mxfp4(source, gate_up, E, 2 * F, H)
        _expect_mxfp4(source, down, E, H, F)

        def mxfp4_row(m):
            # Per expert, so a layer is never dequantised whole; rows are already [outputs, inputs].
            gu = dequantize_mxfp4(source.get(gate_up + "_blocks")[m], source.get(gate_up + "_scales")[m],
                                  f"{gate_up}_blocks[{m}]")
            dn = dequantize_mxfp4(source.get(down + "_blocks")[m], source.get(down + "_scales")[m],
                                  f"{down}_blocks[{m}]")
            return [_exact_bf16(gu[0::2], gate_up), _exact_bf16(gu[1::2], gate_up), _exact_bf16(dn, down)]
        used = {p + s for p in (gate_up, down) for s in ("_blocks", "_scales")}
        return _Layer(E, H, F, "gpt_oss_mxfp4", "BF16", mxfp4_row, used | {gate_up_bias, down_bias, logit_bias},
                      bias_row=lambda m: _gpt_oss_bias_row(source, gate_up_bias, down_bias, m), logit_bias=logit_bias)
    _expect_shape(source, gate_up, (E, H, 2 * F))
    _expect_shape(source, down, (E, F, H))
    if source.info(gate_up).dtype.startswith("F8"):
        raise _fail(f"{gate_up}: fp8 gpt-oss experts are not read (gpt-oss ships MXFP4 or bf16)")
    dtype = _check_dtype(source, (gate_up, down), "expert weights")

    def row(m):
        # x @ gate_up[m] with columns interleaved: gate = [:, ::2], up = [:, 1::2]; as [F, H] rows.
        gu = source.get(gate_up)[m]
        return [np.ascontiguousarray(gu[:, 0::2].T), np.ascontiguousarray(gu[:, 1::2].T),
                np.ascontiguousarray(source.get(down)[m].T)]

    layer = _Layer(E, H, F, "gpt_oss", dtype, row, {gate_up, down, gate_up_bias, down_bias, logit_bias},
                   bias_row=lambda m: _gpt_oss_bias_row(source, gate_up_bias, down_bias, m), logit_bias=logit_bias)
    return layer


def _gpt_oss_bias_row(source, gate_up_bias, down_bias, m) -> np.ndarray:
    gu = _as_float32(source, gate_up_bias)[m]
    return np.concatenate([gu[0::2], gu[1::2], _as_float32(source, down_bias)[m]])


def _as_float32(source, name) -> np.ndarray:
    info = source.info(name)
    if info.dtype == "F64":
        return source.get(name).astype(np.float32)
    if info.dtype not in st.SAFETENSORS_TO_COLIBRI:
        raise _fail(f"{name}: dtype {info.dtype} is not supported")
    return to_float32(source.get(name), st.SAFETENSORS_TO_COLIBRI[info.dtype])


# ---------------------------------------------------------------------------------------------------
# pack


def pack(src, out, layer=None, dtype="keep", top_k=None, routing=None, renormalize=None,
         routed_scaling_factor=None, progress=True, unverified_routing=False, verify=False):
    """Packs MoE layers of `src` into `out`; returns the LayerConfig (a list of them for layer='all').
    layer: a decoder layer index, None (the first MoE layer) or 'all' (every MoE layer, one file
    layer{N}.colibri.safetensors per layer in the folder `out`). dtype: keep (the source's), fp32,
    fp16, bf16 (fp8 sources dequantised), or fp8 (fp8_e4m3: fp8 sources as stored, others quantised in
    128 x 128 blocks). Notes on what the packed layer does not use (a static activation scale) go to
    stderr and the file's metadata. Raises ColibriError naming what is refused, missing or inconsistent."""
    dtype = "fp8_e4m3" if dtype == "fp8" else dtype
    if dtype not in ("keep", "fp32", "fp16", "bf16", "fp8_e4m3"):
        raise _fail(f"dtype: expected keep | fp32 | fp16 | bf16 | fp8, got {dtype!r}")
    if routing is not None and routing not in ROUTINGS:
        raise _fail(f"routing: expected {' | '.join(ROUTINGS)}, got {routing!r}")
    # A negative index is refused with the model's range, once its layers are known (_choose_layers).
    if not (layer is None or layer == "all" or (isinstance(layer, int) and not isinstance(layer, bool))):
        raise _fail(f"layer: expected a layer index or 'all', got {layer!r}")
    out = pathlib.Path(out)
    if layer == "all":
        if out.exists() and not out.is_dir():
            raise _fail(f"{out}: with layer 'all', out is the folder to write layer files into")
        if not out.parent.is_dir():
            raise _fail(f"{out}: folder {out.parent} does not exist")
    elif not out.parent.is_dir():  # before reading the model, not after
        raise _fail(f"{out}: folder {out.parent} does not exist")
    if verify:
        _verify_imports()
    source = _Source(src)
    overrides = dict(top_k=top_k, routing=routing, renormalize=renormalize, routed_scaling_factor=routed_scaling_factor)
    hf = _read_config(source.folder)
    _refuse_without_moe(source, hf, src)
    plan = _plan(hf, overrides, unverified_routing)
    chosen = _choose_layers(plan, _found_layers(source, plan.blocks), layer, _layer_count(source))
    if layer == "all":
        out.mkdir(exist_ok=True)
    configs, notes = [], []
    for index, base in chosen:
        path = out / f"layer{index}.colibri.safetensors" if layer == "all" else out
        config, note = _pack_layer(source, plan, index, base, path, dtype, progress, src)
        if note and note not in notes:
            notes.append(note)
            print(f"colibri pack: note: {note}", file=sys.stderr, flush=True)
        if verify:
            try:
                _verify(source, hf, plan, base, path)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        configs.append(config)
    return configs if layer == "all" else configs[0]


def _pack_layer(source, plan, index, base, out, dtype, progress, src):
    """Packs one layer into `out`: (its LayerConfig, a note for the user or None)."""
    where = _locate(source, base, plan)
    src_name = st.SAFETENSORS_TO_COLIBRI[where.dtype]
    weight_dtype = src_name if dtype == "keep" else dtype
    # fp8 scale blocks: the source's when its fp8 weights are kept, else those pack quantises in
    block = (0, 0) if weight_dtype != "fp8_e4m3" else where.fp8.block if where.fp8 else fp8.BLOCK
    config = LayerConfig(
        expert_kind="swiglu", num_experts=where.E, top_k=plan.top_k, hidden_size=where.H,
        intermediate_size=where.F, weight_dtype=weight_dtype, routing=plan.routing, renormalize=plan.renormalize,
        routed_scaling_factor=plan.routed_scaling_factor, has_router=True, n_group=plan.n_group,
        topk_group=plan.topk_group, group_score=plan.group_score, activation=plan.activation,
        activation_alpha=plan.activation_alpha, activation_limit=plan.activation_limit,
        expert_bias=where.bias_row is not None, shared_intermediate_size=plan.shared_intermediate_size,
        shared_gate=plan.shared_gate, has_router_logit_bias=where.logit_bias is not None,
        scale_block_n=block[0], scale_block_k=block[1])
    try:
        config.validate()
    except ColibriError as exc:
        raise _fail(f"layer {index}: the packed layer would be invalid: {exc.args[0]}") from None
    E = where.E
    bar = _Progress(E, f"packing layer {index} experts", progress)

    def packed(matrices, names):
        """Matrices as one packed row in weight_dtype, and its scales (fp8) or None. matrices: arrays in
        the source dtype; for fp8 sources, `names`: the tensors holding them (their scales beside)."""
        if where.fp8 is not None:
            if weight_dtype == "fp8_e4m3":  # as stored
                return (np.concatenate([where.fp8.codes(n).reshape(-1) for n in names]),
                        np.concatenate([where.fp8.grid(n).reshape(-1) for n in names]))
            values = [where.fp8.dequantize(n) for n in names]
        elif weight_dtype != "fp8_e4m3":
            row = np.concatenate([np.asarray(p).reshape(-1) for p in matrices])
            return (row if weight_dtype == src_name else from_float(to_float32(row, src_name), weight_dtype)), None
        else:
            values = [to_float32(np.asarray(p), src_name) for p in matrices]
        if weight_dtype == "fp8_e4m3":
            return fp8.quantize_matrices(values, *block, name=f"{base}experts")
        return from_float(np.concatenate([v.reshape(-1) for v in values]), weight_dtype), None

    # The scales are filled as the experts stream by, and written after them (checkpoint.save's order).
    scale_rows = np.zeros((E, config.scales_numel), np.float32)
    done = []

    def expert_rows():
        for m in range(E):
            row, scales = packed(where.expert_row(m) if where.fp8 is None else None,
                                 where.expert_names(m) if where.fp8 is not None else None)
            if scales is not None:
                scale_rows[m] = scales
            done.append(m)
            yield row
            bar.update(m + 1, row.nbytes)

    def scale_chunks():
        if len(done) != E:
            raise AssertionError("expert_scales written before the experts were")
        yield scale_rows

    experts = st.LazyTensor(st.COLIBRI_TO_SAFETENSORS[weight_dtype], (E, config.expert_numel), expert_rows)
    expert_scales = st.LazyTensor("F32", scale_rows.shape, scale_chunks) if config.fp8 else None
    shared = shared_scales = None
    if where.shared:
        shared, shared_scales = packed([source.get(n) for n in where.shared] if where.fp8 is None else None,
                                       where.shared)
    if plan.routing == "sigmoid_bias" and where.correction_bias is None:
        bias, note = np.zeros(E, np.float32), "sigmoid_bias routing without e_score_correction_bias: router_bias zeros"
    else:
        bias, note = (None if where.correction_bias is None else _as_float32(source, where.correction_bias)), None
    told = None  # what the user is told on stderr too
    extra = {"source": str(src), "source_layer": base[:-1], "source_layout": where.layout, "source_dtype": src_name,
             "source_family": plan.family}
    if where.layout == "gpt_oss_mxfp4":
        extra["source_quantization"] = "mxfp4, dequantised to bf16 by pack (exact)"
    elif where.fp8 is not None:
        what = "kept as stored" if weight_dtype == "fp8_e4m3" else f"dequantised to {weight_dtype} by pack"
        extra["source_quantization"] = f"{where.fp8.describe()}, {what}"
        ignored = ([f"static activation scales ({', '.join(sorted({n.rsplit('.', 1)[1] for n in where.fp8.static}))})"]
                   if where.fp8.static else []) + list(where.fp8.scheme.ignored)
        if ignored:
            told = (f"{' and '.join(ignored)} of the fp8 checkpoint not used: Colibri quantises activations "
                    "dynamically (the GPU per token and 128 inputs; the CPU does not quantise them), and the "
                    "layer of the dequantised weights is the reference it is checked against")
            note = f"{note}; {told}" if note else told
    elif weight_dtype == "fp8_e4m3":
        extra["source_quantization"] = (f"{src_name}, quantised to fp8 e4m3 by pack ({_granularity(block)} scales, "
                                        "amax / 448 per block)")
    if note:
        extra["note"] = note
    checkpoint.save(
        out, config, experts, _as_float32(source, base + plan.router + ".weight"), bias, extra,
        router_logit_bias=None if where.logit_bias is None else _as_float32(source, where.logit_bias),
        expert_bias=None if where.bias_row is None else np.stack([where.bias_row(m) for m in range(E)]),
        shared_expert=shared,
        shared_expert_gate=None if where.shared_gate is None else _as_float32(source, where.shared_gate).reshape(-1),
        expert_scales=expert_scales, shared_expert_scales=shared_scales)
    return config, told


# ---------------------------------------------------------------------------------------------------
# --verify: the packed layer against transformers' own MoE block of the family


def _verify_imports():
    try:
        import torch  # noqa: F401 (only whether they import)
        import transformers  # noqa: F401
    except ImportError as exc:
        raise _fail(f"--verify needs torch and transformers ({exc})") from None


def transformers_block(family: str, hf: dict, tensors: dict):
    """transformers' MoE block of `family`, in fp32, built from config.json `hf` and loaded with the
    source tensors of the block (`tensors`: name relative to the block -> float32 array)."""
    import importlib

    import torch
    from transformers import AutoConfig
    module, name = BLOCK_CLASSES[family]
    # quantization_config left out: the block is built in fp32, loaded with dequantised weights
    config_dict = {k: v for k, v in hf.items()
                   if k not in ("model_type", "transformers_version", "quantization_config")}
    # A block built on its own never has the experts implementation a whole model would choose, so
    # transformers warns that none is set: name its plain PyTorch one ("eager") as the reference.
    config = AutoConfig.for_model(family, **{**config_dict, "experts_implementation": "eager"})
    block_class = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    block = block_class(config).to(torch.float32).eval()
    if family == "gpt_oss":
        _refuse_fixed_swiglu(block, hf)
    state = {}
    for key in block.state_dict():
        if key in tensors:
            state[key] = torch.from_numpy(np.ascontiguousarray(tensors[key]))
        elif key in ("experts.gate_up_proj", "experts.down_proj"):
            # transformers' own conversion of per-expert checkpoints: gate and up concatenated per expert.
            names = next(n for n in PER_EXPERT_NAMES.values() if f"experts.0.{n[0]}.weight" in tensors)
            E = block.experts.num_experts
            parts = [np.concatenate([tensors[f"experts.{m}.{names[0]}.weight"], tensors[f"experts.{m}.{names[1]}.weight"]])
                     if key == "experts.gate_up_proj" else tensors[f"experts.{m}.{names[2]}.weight"] for m in range(E)]
            state[key] = torch.from_numpy(np.stack(parts))
        else:
            raise _fail(f"--verify: the source has no tensor for transformers' {name}.{key}")
    block.load_state_dict(state, strict=True)
    return block


def _refuse_fixed_swiglu(block, hf):
    """Refuses a gpt-oss block whose clamped SwiGLU does not take config.json's swiglu_alpha and
    swiglu_limit: older transformers fix them at the released models' 1.702 and 7.0, so on any other
    values its output is not the model's and a relative error would blame the packed layer."""
    import transformers
    plan = _gpt_oss(hf)
    wanted = (plan.activation_alpha, plan.activation_limit)
    used = (getattr(block.experts, "alpha", None), getattr(block.experts, "limit", None))
    if None not in used and tuple(float(v) for v in used) != wanted:
        raise _fail(f"--verify: transformers {transformers.__version__}'s GptOssExperts computes with swiglu_alpha "
                    f"{used[0]:g} and swiglu_limit {used[1]:g} whatever config.json says (here {wanted[0]:g} and "
                    f"{wanted[1]:g}), so it cannot check this layer; transformers 5.19 and later read both")


def block_forward(block, x: np.ndarray) -> np.ndarray:
    """transformers' block on tokens x [T, H] (float32), as [T, H] float64."""
    import torch
    with torch.no_grad():
        y = block(torch.from_numpy(np.asarray(x, np.float32))[None])
    y = y[0] if isinstance(y, tuple) else y  # gpt-oss's block also returns its router scores
    return y[0].double().numpy()


def colibri_forward(path, x: np.ndarray) -> np.ndarray:
    """The packed layer on x [T, H]: colibri's CPU layer in fp32 where the library can hold it, else
    colibri.reference (float64)."""
    from colibri import reference
    from colibri._native import HAS_CONTEXT_CREATE
    ckpt = checkpoint.load(path)
    if HAS_CONTEXT_CREATE or not ckpt.config.uses_v2_features:
        from colibri.layer import MoELayer
        return np.asarray(MoELayer.from_file(path).forward(np.asarray(x, np.float32)), np.float64)
    return reference.checkpoint_forward(ckpt, np.asarray(x, np.float64))


def routing_ties(path, x: np.ndarray, tolerance=1e-5) -> np.ndarray:
    """[T] bool: tokens whose choice of experts (or groups) is within `tolerance` of a tie, where fp32
    rounding may legitimately choose differently."""
    from colibri import reference
    ckpt = checkpoint.load(path)
    config = ckpt.config
    logits = reference.router_logits(np.asarray(x, np.float64), ckpt.router, ckpt.router_logit_bias)
    scores = reference.selection_scores(config, logits, ckpt.router_bias)
    scale = np.maximum(1.0, np.abs(np.where(np.isfinite(scores), scores, 0)).max(axis=1))
    return ((reference.topk_margin(scores, config.top_k) <= tolerance * scale)
            | (reference.group_margin(config, logits, ckpt.router_bias) <= tolerance * scale))


def _transformers_mxfp4(source, prefix) -> np.ndarray:
    """prefix_blocks / prefix_scales dequantised by transformers (float32, its bf16 layout)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    blocks, scales = (torch.from_numpy(np.array(source.get(prefix + s))) for s in ("_blocks", "_scales"))
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()


def _as_packed(value, relative, layout, packed) -> np.ndarray:
    """A source weight tensor (float32, in its source layout) with the values the packed layer holds:
    rounded to the packed dtype, or for fp8 quantised and dequantised matrix by matrix as pack did."""
    if packed != "fp8_e4m3":
        return to_float32(from_float(value, packed), packed)

    def round_trip(matrix):  # [N, K] as packed -> its fp8 values
        return fp8.dequantize(*fp8.quantize(matrix, *fp8.BLOCK), *fp8.BLOCK).astype(np.float32)
    if value.ndim == 2:  # per-expert and shared matrices are [N, K] as packed
        return round_trip(value)
    out = np.empty_like(value)  # [E, ...]: one expert at a time, in pack's matrices
    for e, matrix in enumerate(value):
        if layout.startswith("gpt_oss"):  # [H, 2F] interleaved gate/up, or down [F, H]: transposed
            if relative.endswith("gate_up_proj"):
                out[e][:, 0::2], out[e][:, 1::2] = round_trip(matrix[:, 0::2].T).T, round_trip(matrix[:, 1::2].T).T
            else:
                out[e] = round_trip(matrix.T).T
        elif relative.endswith("gate_up_proj"):  # [2F, H]: gate and up each on its own grid
            half = matrix.shape[0] // 2
            out[e] = np.concatenate([round_trip(matrix[:half]), round_trip(matrix[half:])])
        else:
            out[e] = round_trip(matrix)
    return out


def _verify(source, hf, plan, base, path, tokens=64, seed=0):
    family = plan.family
    if family not in BLOCK_CLASSES:
        raise _fail(f"--verify: {family} has no transformers block to check against")
    ckpt = checkpoint.load(path)
    packed = ckpt.config.weight_dtype
    layout = ckpt.metadata.get("source_layout", "")
    quantised = _locate(source, base, plan).fp8  # fp8 source weights and their scales
    scales = quantised.names if quantised else set()
    tensors = {}
    for name in source.where:
        if name.startswith(base) and not name.endswith("_scales") and name not in scales:
            relative = name[len(base):]
            if name.endswith("_blocks"):
                # The check uses transformers' own dequantisation, not pack's.
                relative = relative[:-len("_blocks")]
                value = _transformers_mxfp4(source, name[:-len("_blocks")])
            elif quantised and name in quantised.scales:
                value = quantised.dequantize(name).astype(np.float32)  # the block gets the dequantised weights
            else:
                value = _as_float32(source, name)
            is_weight = (relative.startswith("experts.") and not relative.endswith("_bias")) \
                or relative.startswith(("shared_expert.", "shared_experts."))
            if is_weight and packed != st.SAFETENSORS_TO_COLIBRI.get(source.info(name).dtype):
                value = _as_packed(value, relative, layout, packed)  # the block sees the packed layer's values
            tensors[relative] = value
    block = transformers_block(family, hf, tensors)
    x = np.random.default_rng(seed).standard_normal((tokens, ckpt.config.hidden_size)).astype(np.float32)
    keep = ~routing_ties(path, x)
    if keep.sum() < tokens // 2:
        raise _fail(f"--verify: {tokens - int(keep.sum())} of {tokens} random tokens sit at a routing tie")
    expected, got = block_forward(block, x)[keep], colibri_forward(path, x)[keep]
    error = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))
    if not error <= VERIFY_TOLERANCE:
        raise _fail(f"--verify: {path} differs from transformers' {BLOCK_CLASSES[family][1]} by relative error "
                    f"{error:.3g} > {VERIFY_TOLERANCE:g}; the file was not kept")
    return error
