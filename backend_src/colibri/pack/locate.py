"""Where one MoE layer's weights are: the decoder layers holding MoE blocks, and each family's
layouts of experts, shared experts and biases, checked against the plan (families.py)."""
import dataclasses
import re

import numpy as np

from colibri import safetensors_io as st
from colibri.pack.families import FAMILIES, _model_type, _Plan
from colibri.pack.formats import FP8_METHODS, _exact_bf16, _expect_mxfp4, _Fp8Weights, dequantize_mxfp4
from colibri.pack.source import _as_float32, _expect_shape, _fail, _Source

MOE_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<layer>\d+)\.(?P<block>block_sparse_moe|mlp|feed_forward)\."
                      r"(?:gate\.weight|gate\.wg\.weight|router\.weight|router\.layer\.weight|experts\.)")
LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PER_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}


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
    if _found_layers(source, ("block_sparse_moe", "mlp", "feed_forward")):
        return
    expert = next((n for n in sorted(source.where) if "expert" in n.lower()), None)
    if expert is not None:
        raise _fail(f"{src}: no MoE layer pack can read: expert tensors such as {expert} are not under "
                    "layers.N.mlp, layers.N.block_sparse_moe or layers.N.feed_forward, the layouts pack reads")
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
        layer = _locate_swiglu(source, base, E, H, plan.intermediate_size, router, plan.fp8, plan.fused)
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
        name = base + plan.correction_bias_name
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


def _locate_swiglu(source, base, E, H, F_config, router, fp8_scheme=None,
                   fused=("experts.gate_up_proj", "experts.down_proj")) -> _Layer:
    if base + fused[0] in source:
        gate_up, down = base + fused[0], base + fused[1]
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
