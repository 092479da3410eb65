"""`python -m colibri pack`: converts the MoE layers of a Hugging Face safetensors checkpoint into
packed Colibri checkpoints (colibri.checkpoint). What it reads, computes, refuses and checks is in
docs/packing.md. families: config.json to a plan; formats: fp8 and MXFP4; source: shards and
tensors; locate: a layer's weights; verify: the packed layer against transformers."""
import pathlib
import sys
import time

import numpy as np

from colibri import checkpoint, fp8
from colibri import safetensors_io as st
from colibri._native import ColibriError
from colibri.config import ROUTINGS, LayerConfig
from colibri.dtypes import from_float, to_float32
from colibri.pack.families import _plan, _read_config
from colibri.pack.formats import FP4_E2M1, _granularity, dequantize_mxfp4
from colibri.pack.locate import _choose_layers, _found_layers, _layer_count, _locate, _refuse_without_moe
from colibri.pack.source import _as_float32, _fail, _Source
from colibri.pack.verify import (_verify, _verify_imports, block_forward, colibri_forward, routing_ties,
                                 transformers_block)

__all__ = ["pack", "FP4_E2M1", "dequantize_mxfp4", "block_forward", "colibri_forward", "routing_ties",
           "transformers_block"]


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
        # A family whose sigmoid router has no bias (Flint) selects on sigmoid(l) alone: zeros, no note.
        bias = np.zeros(E, np.float32)
        note = ("sigmoid_bias routing without e_score_correction_bias: router_bias zeros" if plan.correction_bias
                else None)
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
