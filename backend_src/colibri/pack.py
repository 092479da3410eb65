"""Converts one MoE layer of a Hugging Face safetensors checkpoint into a packed Colibri checkpoint
(see colibri/checkpoint.py), reading tensors lazily through memory maps so a large model is never
loaded whole. Layouts understood, under `<prefix>layers.N.<block>.` with block `block_sparse_moe` or
`mlp`:

    Mixtral        gate.weight [E,H]; experts.M.w1 / w3 / w2.weight = gate [F,H] / up [F,H] / down [H,F]
    Qwen/DeepSeek  gate.weight [E,H]; experts.M.gate_proj / up_proj / down_proj.weight (same shapes);
                   DeepSeek-V3 gate.e_score_correction_bias [E] -> router_bias (sigmoid_bias routing)
    fused          experts.gate_up_proj [E,2F,H], experts.down_proj [E,H,F]. In recent transformers
                   (e.g. Qwen3-MoE, DeepSeek-V3, Qwen3-Omni experts modules) the expert forward is
                   `gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)`: rows [0, F) are gate and
                   rows [F, 2F) up, each [F,H] like nn.Linear.weight; down_proj[e] is [H,F]. So a row of
                   `experts` is gate_up_proj[e] then down_proj[e], verbatim. Models that store it
                   transposed ([E,H,2F], GPT-OSS / Llama-4 style, some interleaved) are refused.

Routing, top-k and renormalisation come from config.json beside the weights, with overrides. Layers
with shared experts are refused (not supported yet), never silently dropped. Nothing is unpickled."""
import json
import pathlib
import re
import sys
import time

import numpy as np

from colibri import checkpoint
from colibri import safetensors_io as st
from colibri._native import STATUS_INVALID_ARGUMENT, ColibriError
from colibri.dtypes import from_float, to_float32
from colibri.config import ROUTINGS, LayerConfig

MOE_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<layer>\d+)\.(?P<block>block_sparse_moe|mlp)\."
                      r"(?:gate\.weight|experts\.)")
PER_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}
SHARED_EXPERT_PARTS = ("shared_expert.", "shared_experts.", "shared_expert_gate.")


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


def _find_layer(source: _Source, layer):
    found = {}
    for name in source.where:
        match = MOE_NAME.match(name)
        if match:
            found.setdefault(int(match["layer"]), set()).add((match["prefix"], match["block"]))
    if not found:
        raise _fail("no MoE layer found (expected tensors like model.layers.N.block_sparse_moe.gate.weight or "
                    "model.layers.N.mlp.experts.M.gate_proj.weight)")
    if layer is None:
        layer = min(found)
    elif layer not in found:
        raise _fail(f"layer {layer} is not an MoE layer; MoE layers: {', '.join(map(str, sorted(found)))}")
    prefix, block = min(found[layer], key=lambda pair: (len(pair[0]), pair[1]))
    return layer, f"{prefix}{layer}.{block}."


def _check_dtype(source, names, what) -> str:
    dtypes = {source.info(n).dtype for n in names}
    if len(dtypes) > 1:
        raise _fail(f"{what}: inconsistent dtypes {', '.join(sorted(dtypes))}")
    dtype = dtypes.pop()
    if dtype not in st.SAFETENSORS_TO_COLIBRI:
        raise _fail(f"{what}: dtype {dtype} is not supported (fp32, fp16, bf16; dequantize first)")
    return dtype


def _expect_shape(source, name, shape) -> None:
    actual = source.info(name).shape
    if actual != tuple(shape):
        raise _fail(f"{name}: shape {list(actual)}, expected {list(shape)}")


def _layout(source: _Source, base: str):
    """(layout name, E, H, F, source dtype, function m -> the arrays of expert m's packed row)."""
    router = base + "gate.weight"
    if router not in source:
        raise _fail(f"missing router {router}")
    E, H = source.info(router).shape if len(source.info(router).shape) == 2 else (None, None)
    if E is None:
        raise _fail(f"{router}: expected a 2-D [E, H] router, got shape {list(source.info(router).shape)}")
    if base + "experts.gate_up_proj" in source:
        gate_up, down = base + "experts.gate_up_proj", base + "experts.down_proj"
        if down not in source:
            raise _fail(f"missing {down} (the fused layout needs gate_up_proj and down_proj)")
        shape = source.info(gate_up).shape
        if len(shape) != 3 or shape[0] != E or shape[1] % 2 or shape[2] != H:
            hint = " (looks transposed, [E, H, 2F]: not supported)" if len(shape) == 3 and shape[1] == H else ""
            raise _fail(f"{gate_up}: shape {list(shape)}, expected [E={E}, 2F, H={H}]{hint}")
        F = shape[1] // 2
        _expect_shape(source, down, (E, H, F))
        dtype = _check_dtype(source, (gate_up, down), "expert weights")
        return "fused", E, H, F, dtype, lambda m: (source.get(gate_up)[m], source.get(down)[m])

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
    dtype = _check_dtype(source, [n for row in names for n in row], "expert weights")
    return layout, E, H, F, dtype, lambda m: tuple(source.get(n) for n in names[m])


def _read_config(folder: pathlib.Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise _fail(f"{path}: not valid JSON ({exc})") from None
    # Multimodal models keep the language model's settings under text_config.
    return {**config, **config.get("text_config", {})}


def _routing_settings(hf, layout, has_bias, E, H, F, overrides):
    for keys, value, what in ((("n_routed_experts", "num_local_experts", "num_experts"), E, "experts"),
                              (("moe_intermediate_size", "intermediate_size"), F, "expert intermediate size"),
                              (("hidden_size",), H, "hidden size")):
        key = next((k for k in keys if k in hf), None)
        if key is not None and hf[key] != value:
            raise _fail(f"config.json {key}={hf[key]} but the tensors give {what} {value}")
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or hf.get("n_group") or 1
    if n_group > 1 and topk_group < n_group and overrides["routing"] is None:
        raise _fail(f"config.json asks for group-limited routing (n_group={n_group}, topk_group={topk_group}), "
                    "which Colibri does not implement; pass --routing to accept plain top-k routing")
    scoring = hf.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise _fail(f"config.json scoring_func={scoring!r} is not supported (softmax, sigmoid)")
    routing = overrides["routing"] or ("sigmoid_bias" if scoring == "sigmoid" else "softmax_topk")
    top_k = overrides["top_k"] or hf.get("num_experts_per_tok")
    if top_k is None:
        raise _fail("top_k unknown: no num_experts_per_tok in a config.json beside the weights; pass --top-k")
    renormalize = overrides["renormalize"]
    if renormalize is None:
        # Mixtral always renormalises and its config has no norm_topk_prob.
        renormalize = bool(hf.get("norm_topk_prob", layout == "mixtral" or hf.get("model_type") == "mixtral"))
    scaling = overrides["routed_scaling_factor"] or float(hf.get("routed_scaling_factor") or 1.0)
    if routing == "sigmoid_bias" and not has_bias:
        routing_note = "sigmoid_bias routing without e_score_correction_bias: router_bias written as zeros"
    else:
        routing_note = None
    return routing, int(top_k), renormalize, scaling, routing_note


def pack(src, out, layer=None, dtype="keep", top_k=None, routing=None, renormalize=None,
         routed_scaling_factor=None, progress=True) -> LayerConfig:
    """Packs one MoE layer of `src` into `out`; returns its LayerConfig. Raises ColibriError naming
    what is missing or inconsistent."""
    if dtype not in ("keep", "fp32", "fp16", "bf16"):
        raise _fail(f"dtype: expected keep | fp32 | fp16 | bf16, got {dtype!r}")
    if routing is not None and routing not in ROUTINGS:
        raise _fail(f"routing: expected {' | '.join(ROUTINGS)}, got {routing!r}")
    if not pathlib.Path(out).parent.is_dir():  # before reading the model, not after
        raise _fail(f"{out}: folder {pathlib.Path(out).parent} does not exist")
    source = _Source(src)
    layer, base = _find_layer(source, layer)
    moe_block = base[:-1]
    decoder_layer = moe_block.rsplit(".", 1)[0] + "."
    shared = sorted(n for n in source.where if n.startswith(decoder_layer) and
                    any(part in n[len(decoder_layer):] for part in SHARED_EXPERT_PARTS))
    if shared:
        raise _fail(f"layer {layer} has shared experts ({shared[0]}, ...): shared experts are not supported yet "
                    "(packing only the routed experts would change the layer's output)")
    if base + "gate.bias" in source:
        raise _fail(f"{base}gate.bias: routers with a bias term are not supported")
    layout, E, H, F, src_dtype, expert_parts = _layout(source, base)
    bias_name = base + "gate.e_score_correction_bias"
    has_bias = bias_name in source
    if has_bias:
        _expect_shape(source, bias_name, (E,))
    hf = _read_config(source.folder)
    routing, top_k, renormalize, scaling, note = _routing_settings(
        hf, layout, has_bias, E, H, F, dict(top_k=top_k, routing=routing, renormalize=renormalize,
                                            routed_scaling_factor=routed_scaling_factor))
    src_name = st.SAFETENSORS_TO_COLIBRI[src_dtype]
    weight_dtype = src_name if dtype == "keep" else dtype
    config = LayerConfig(expert_kind="swiglu", num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=F,
                         weight_dtype=weight_dtype, routing=routing, renormalize=renormalize,
                         routed_scaling_factor=scaling, has_router=True)
    try:
        config.validate()
    except ColibriError as exc:
        raise _fail(f"the packed layer would be invalid: {exc.args[0]}") from None

    bar = _Progress(E, f"packing layer {layer} experts", progress)

    def expert_rows():
        for m in range(E):
            row = np.concatenate([np.asarray(part).reshape(-1) for part in expert_parts(m)])
            if weight_dtype != src_name:
                row = from_float(to_float32(row, src_name), weight_dtype)
            yield row
            bar.update(m + 1, row.nbytes)

    experts = st.LazyTensor(st.COLIBRI_TO_SAFETENSORS[weight_dtype], (E, config.expert_numel), expert_rows)
    router = _as_float32(source, base + "gate.weight")
    bias = _as_float32(source, bias_name) if has_bias else (
        np.zeros(E, np.float32) if routing == "sigmoid_bias" else None)
    extra = {"source": str(src), "source_layer": moe_block, "source_layout": layout, "source_dtype": src_name}
    if note:
        extra["note"] = note
    checkpoint.save(out, config, experts, router, bias, extra)
    return config


def _as_float32(source, name) -> np.ndarray:
    info = source.info(name)
    if info.dtype == "F64":
        return source.get(name).astype(np.float32)
    if info.dtype not in st.SAFETENSORS_TO_COLIBRI:
        raise _fail(f"{name}: dtype {info.dtype} is not supported")
    return to_float32(source.get(name), st.SAFETENSORS_TO_COLIBRI[info.dtype])
