"""Packed Colibri checkpoints (*.colibri.safetensors), format colibri-moe/2, or colibri-moe/3 for fp8 experts:

    experts            [E, expert_numel] fp32 | fp16 | bf16 | F8_E4M3 (v3)   row e = expert e (swiglu: gate
                                         [F,H], up [F,H], down [H,F]; linear: [F,H]; row-major)
    router             [E, H] fp32       optional
    router_bias        [E] fp32          optional: added to the selection scores only (DeepSeek-V3's
                                         e_score_correction_bias); required by sigmoid_bias routing
    router_logit_bias  [E] fp32          optional: added to the router logits (gpt-oss router.bias)
    expert_bias        [E, 2F+H] fp32    when expert_bias=true (swiglu: gate F, up F, down H; linear: [E, F])
    shared_expert      [3*Fs*H]          when shared_intermediate_size=Fs > 0, in the experts' dtype:
                                         gate [Fs,H], up [Fs,H], down [H,Fs], row-major, back to back
    shared_expert_gate [H] fp32          when shared_gate=true (the shared expert is scaled by
                                         sigmoid(shared_expert_gate . x))
    expert_scales      [E, S] fp32       v3, fp8 experts: row e = expert e's scale grids, back to back in
                                         the order of its matrices, each [ceil(N / bn), ceil(K / bk)]
                                         row-major for a matrix [N, K] (bn, bk: scale_block_n, _k; 0 = the
                                         whole dimension); S = colibri_scales_numel (colibri.fp8)
    shared_expert_scales [S_shared] fp32 v3, fp8 experts with a shared expert: its gate, up, down grids
    metadata           format, expert_kind, num_experts, top_k, hidden_size, intermediate_size, routing,
                       renormalize (true|false), routed_scaling_factor, n_group, topk_group, group_score
                       (max|top2_sum), activation (silu|swiglu_oai), activation_alpha, activation_limit,
                       expert_bias (true|false), shared_intermediate_size, shared_gate (true|false);
                       v3 also scale_block_n, scale_block_k

The semantics of every field are colibri.h's (and colibri.reference's): an fp8 weight stands for its
e4m3 value times its scale. A tensor is present exactly when the metadata asks for it, so nothing in a
file goes silently unused. The writer writes the lowest version that describes the layer: version 3
for fp8 experts, else version 2, so readers that predate fp8 keep reading every other file. Version 1
files (format colibri-moe/1: experts, router, router_bias and the first eight keys) still load, as
layers without the version-2 features; their router_bias counts only under sigmoid_bias routing, as it
did. A reader refuses a version it does not know.

Also the synthetic demo checkpoint (`write_demo`)."""
import dataclasses
import pathlib
import re

import numpy as np

from colibri import fp8
from colibri import safetensors_io as st
from colibri._native import ColibriError, STATUS_INVALID_ARGUMENT
from colibri.dtypes import DTYPES, FLOAT_DTYPES, from_float
from colibri.config import LayerConfig

FORMAT_PREFIX = "colibri-moe/"
FORMAT_VERSION = 3  # the newest this code reads and writes; files get the lowest that describes them
KNOWN_VERSIONS = (1, 2, 3)
REQUIRED_METADATA = tuple(f.name for f in dataclasses.fields(LayerConfig) if f.metadata["required"])
V1_TENSORS = ("experts", "router", "router_bias")
V2_TENSORS = V1_TENSORS + ("router_logit_bias", "expert_bias", "shared_expert", "shared_expert_gate")
V3_TENSORS = V2_TENSORS + ("expert_scales", "shared_expert_scales")
# A packed file's header is small (at most ten tensors and some forty metadata keys); a larger one is refused
# before it is parsed.
MAX_HEADER_BYTES = 1024 * 1024
# Metadata numbers as the writer writes them (str(int), repr(float)): ASCII, no spaces or underscores,
# and short, so no digit string Python's int() would refuse or take long over reaches it.
_INTEGER = re.compile(r"-?[0-9]{1,10}")
_DECIMAL = re.compile(r"[-+]?(?:[0-9]{1,40}(?:\.[0-9]{0,40})?|\.[0-9]{1,40})(?:[eE][-+]?[0-9]{1,3})?")
_VERSION = re.compile(r"[0-9]{1,6}")
# The experts' safetensors dtypes each version may hold: the float dtypes, and fp8 from version 3.
_FLOAT_EXPERTS = tuple(DTYPES[name].safetensors for name in FLOAT_DTYPES)
EXPERT_DTYPES = {1: _FLOAT_EXPERTS, 2: _FLOAT_EXPERTS, 3: tuple(d.safetensors for d in DTYPES.values())}


@dataclasses.dataclass
class Checkpoint:
    config: LayerConfig
    experts: np.ndarray                 # [E, expert_numel], read-only view into the mmap
    router: np.ndarray = None           # [E, H] float32
    router_bias: np.ndarray = None      # [E] float32 (selection only)
    file: st.SafetensorsFile = None     # keeps the mmap open
    metadata: dict = None
    router_logit_bias: np.ndarray = None   # [E] float32
    expert_bias: np.ndarray = None         # [E, 2F+H] (linear [E, F]) float32
    shared_expert: np.ndarray = None       # [3*Fs*H], the experts' dtype storage
    shared_expert_gate: np.ndarray = None  # [H] float32
    expert_scales: np.ndarray = None       # fp8: [E, scales_numel] float32
    shared_expert_scales: np.ndarray = None  # fp8 with a shared expert: [shared_scales_numel] float32

    @property
    def version(self) -> int:
        return format_version(self.metadata or {})


def version_for(config: LayerConfig) -> int:
    """The lowest format version whose EXPERT_DTYPES hold the layer's experts: 2 for the float dtypes, 3 for
    a weights-only dtype (fp8)."""
    return min(v for v, held in EXPERT_DTYPES.items() if v >= 2 and DTYPES[config.weight_dtype].safetensors in held)


def _fail(path, message) -> ColibriError:
    return ColibriError(f"{path}: {message}", STATUS_INVALID_ARGUMENT)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _stored_fields(version: int):
    """The LayerConfig fields a file of this version stores in its metadata, by their own names."""
    return [f for f in dataclasses.fields(LayerConfig) if f.metadata["since"] is not None
            and f.metadata["since"] <= version]


def config_metadata(config: LayerConfig) -> dict:
    """The metadata that describes the layer, in the lowest version that can (every field it stores)."""
    version = version_for(config)
    text = {"int": str, "float": lambda v: repr(float(v)), "bool": _flag, "choice": str}
    return {"format": f"{FORMAT_PREFIX}{version}",
            **{f.name: text[f.metadata["kind"]](getattr(config, f.name)) for f in _stored_fields(version)}}


def format_version(meta: dict):
    """The version number of a colibri-moe/N format string, or None for anything else."""
    value = meta.get("format")
    if isinstance(value, str) and value.startswith(FORMAT_PREFIX) and _VERSION.fullmatch(value[len(FORMAT_PREFIX):]):
        return int(value[len(FORMAT_PREFIX):])
    return None


def _parse_config(path, meta, weight_dtype, tensors) -> LayerConfig:
    version = format_version(meta)
    known = ", ".join(f"{FORMAT_PREFIX}{v}" for v in KNOWN_VERSIONS)
    if version is None:
        shown = _shown(meta["format"]) if "format" in meta else "missing"
        raise _fail(path, f"metadata format is {shown}, expected one of {known} "
                          "(pack a Hugging Face checkpoint with `python -m colibri pack`)")
    if version not in KNOWN_VERSIONS:
        raise _fail(path, f"format version {version} ({meta['format']!r}) is not known to this reader, which "
                          f"reads {known}: it was written by a newer Colibri")
    missing = [key for key in REQUIRED_METADATA if key not in meta]
    if missing:
        raise _fail(path, f"metadata lacks {', '.join(missing)}")

    def integer(key, default):
        value = meta.get(key, str(default))
        if not _INTEGER.fullmatch(value):
            raise _fail(path, f"metadata {key}={_shown(value)} is not an integer (ASCII digits)")
        return int(value)

    def number(key, default):
        value = meta.get(key, repr(float(default)))
        if not _DECIMAL.fullmatch(value):
            raise _fail(path, f"metadata {key}={_shown(value)} is not a finite decimal number")
        return float(value)

    def flag(key, default):
        value = meta.get(key, _flag(default))
        if value.lower() not in ("true", "false", "1", "0"):
            raise _fail(path, f"metadata {key}={_shown(value)} is not true or false")
        return value.lower() in ("true", "1")

    def choice(key, default, codes):
        value = meta.get(key, default)
        if value not in codes:
            raise _fail(path, f"metadata {key}={_shown(value)} is not one of {', '.join(codes)}")
        return value

    parse = {"int": integer, "float": number, "bool": flag, "choice": choice}
    fields = {f.name: parse[f.metadata["kind"]](f.name, f.default, *([f.metadata["codes"]] if f.metadata["codes"]
                                                                       else []))
              for f in _stored_fields(version)}
    fields.update(weight_dtype=weight_dtype, has_router="router" in tensors,
                  has_router_logit_bias=version >= 2 and "router_logit_bias" in tensors)
    config = LayerConfig(**fields)
    try:
        config.validate()
    except ColibriError as exc:
        raise _fail(path, f"metadata describes an invalid layer ({exc.args[0]})") from None
    return config


def _shown(value: str) -> str:
    """A metadata value for a message: quoted, escaped, and cut short."""
    return repr(value[:60]) + ("..." if len(value) > 60 else "")


def read_config(path) -> LayerConfig:
    """The layer a checkpoint describes, from its header alone (no tensor data is read): Triton's
    auto-complete asks for H and k before any model instance loads the weights."""
    return _open(path)[1]


def _open(path):
    """(the open file, its LayerConfig), checked as far as the header allows."""
    try:
        file = st.SafetensorsFile(path, max_header_bytes=MAX_HEADER_BYTES)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except st.SafetensorsError as exc:
        raise ColibriError(str(exc), STATUS_INVALID_ARGUMENT) from None
    if "experts" not in file:
        raise _fail(path, "has no 'experts' tensor")
    info = file.tensors["experts"]
    weight_dtype = st.SAFETENSORS_TO_COLIBRI.get(info.dtype)
    version = format_version(file.metadata)
    if weight_dtype is None or (version in EXPERT_DTYPES and info.dtype not in EXPERT_DTYPES[version]):
        allowed = EXPERT_DTYPES.get(version, EXPERT_DTYPES[FORMAT_VERSION])
        newer = " (fp8 experts need format colibri-moe/3)" if info.dtype == "F8_E4M3" else ""
        raise _fail(path, f"tensor 'experts' has dtype {info.dtype}, expected {', '.join(allowed[:-1])} or "
                          f"{allowed[-1]}{newer}")
    return file, _parse_config(path, file.metadata, weight_dtype, file.tensors)


def load(path) -> Checkpoint:
    """Opens and checks a packed checkpoint; the tensors are views into a read-only memory map."""
    path = pathlib.Path(path)
    file, config = _open(path)
    version = format_version(file.metadata)
    E, H = config.num_experts, config.hidden_size
    expected = {"experts": (E, config.expert_numel), "router": (E, H), "router_bias": (E,)}
    if version >= 2:
        known = V3_TENSORS if version >= 3 else V2_TENSORS
        unknown = sorted(set(file.tensors) - set(known))
        if unknown:
            raise _fail(path, f"unknown tensor {unknown[0]!r} (a colibri-moe/{version} file holds {', '.join(known)})")
        wanted = {"expert_bias": config.expert_bias, "shared_expert": config.shared_intermediate_size > 0,
                  "shared_expert_gate": config.shared_gate, "expert_scales": config.fp8,
                  "shared_expert_scales": config.fp8 and config.shared_intermediate_size > 0}
        for name, asked in wanted.items():
            if asked and name not in file:
                raise _fail(path, f"the metadata asks for tensor {name!r} but the file has none")
            if name in file and not asked:
                raise _fail(path, f"tensor {name!r} is present but the metadata does not ask for it "
                                  "(it would go unused)")
        if "router_logit_bias" in file and "router" not in file:
            raise _fail(path, "tensor 'router_logit_bias' without a 'router'")
        expected.update(router_logit_bias=(E,), expert_bias=(E, config.expert_bias_width),
                        shared_expert=(config.shared_numel,), shared_expert_gate=(H,),
                        expert_scales=(E, config.scales_numel), shared_expert_scales=(config.shared_scales_numel,))
    for name, shape in expected.items():
        if name in file and file.tensors[name].shape != shape:
            raise _fail(path, f"tensor {name!r} has shape {list(file.tensors[name].shape)}, expected {list(shape)}"
                              + _grids_explained(config, name))
        if name not in ("experts", "shared_expert") and name in file and file.tensors[name].dtype != "F32":
            raise _fail(path, f"tensor {name!r} has dtype {file.tensors[name].dtype}, expected F32")
    if "shared_expert" in file and file.tensors["shared_expert"].dtype != file.tensors["experts"].dtype:
        raise _fail(path, f"tensor 'shared_expert' has dtype {file.tensors['shared_expert'].dtype}, expected the "
                          f"experts' {file.tensors['experts'].dtype}")
    if config.routing == "sigmoid_bias" and "router" in file and "router_bias" not in file:
        raise _fail(path, "sigmoid_bias routing needs a 'router_bias' tensor")

    def get(name):
        return file.get(name) if name in file else None
    router_bias = get("router_bias")
    if version == 1 and config.routing != "sigmoid_bias":
        router_bias = None  # colibri-moe/1 used it for sigmoid_bias routing only
    return Checkpoint(config, file.get("experts"), get("router"), router_bias, file, dict(file.metadata),
                      get("router_logit_bias"), get("expert_bias"), get("shared_expert"), get("shared_expert_gate"),
                      get("expert_scales"), get("shared_expert_scales"))


def _grids_explained(config: LayerConfig, name: str) -> str:
    """For a scale tensor, where its expected shape comes from: the grids of each matrix."""
    if name not in ("expert_scales", "shared_expert_scales"):
        return ""
    F, count = (config.intermediate_size, f"E={config.num_experts} experts of ") if name == "expert_scales" \
        else (config.shared_intermediate_size, "")
    kind = config.expert_kind if name == "expert_scales" else "swiglu"
    names = ("gate", "up", "down") if kind == "swiglu" else ("w",)
    grids = ", ".join(f"{n} {list(s)} -> {list(fp8.grid_shape(s, config.scale_block_n, config.scale_block_k))}"
                      for n, s in zip(names, fp8.matrix_shapes(kind, config.hidden_size, F)))
    return f" ({count}scale grids {grids} for scale block ({config.scale_block_n}, {config.scale_block_k}))"


def save(path, config: LayerConfig, experts, router=None, router_bias=None, extra_metadata=None,
         router_logit_bias=None, expert_bias=None, shared_expert=None, shared_expert_gate=None,
         expert_scales=None, shared_expert_scales=None) -> None:
    """Writes a packed checkpoint (format colibri-moe/2, or 3 for fp8 experts); `experts`, `shared_expert`
    and `expert_scales` may be arrays (in the weight dtype's storage; scales float32) or
    safetensors_io.LazyTensors. The tensors are written in that order, so a lazy expert_scales may be
    filled while the experts are streamed. The config's flags must match the tensors given
    (config.has_router_logit_bias follows router_logit_bias; fp8 experts come with their scales)."""
    config = dataclasses.replace(config, has_router=router is not None,
                                 has_router_logit_bias=router_logit_bias is not None)
    config.validate()
    for name, value, asked in (("expert_bias", expert_bias, config.expert_bias),
                               ("shared_expert", shared_expert, config.shared_intermediate_size > 0),
                               ("shared_expert_gate", shared_expert_gate, config.shared_gate),
                               ("expert_scales", expert_scales, config.fp8),
                               ("shared_expert_scales", shared_expert_scales,
                                config.fp8 and config.shared_intermediate_size > 0)):
        if (value is not None) != asked:
            raise ColibriError(f"{path}: {name} {'missing' if asked else 'given'} but the config "
                               f"{'asks for it' if asked else 'does not ask for it'}", STATUS_INVALID_ARGUMENT)
    if router_logit_bias is not None and router is None:
        raise ColibriError(f"{path}: router_logit_bias given without a router", STATUS_INVALID_ARGUMENT)
    dtype = st.COLIBRI_TO_SAFETENSORS[config.weight_dtype]
    tensors = {"experts": experts if isinstance(experts, st.LazyTensor)
               else (dtype, np.asarray(experts).reshape(config.num_experts, -1))}
    if shared_expert is not None:  # beside the experts: same dtype, so it stays aligned as they are
        tensors["shared_expert"] = shared_expert if isinstance(shared_expert, st.LazyTensor) \
            else (dtype, np.asarray(shared_expert).reshape(-1))
    if expert_scales is not None:
        tensors["expert_scales"] = expert_scales if isinstance(expert_scales, st.LazyTensor) \
            else _scales(path, "expert_scales", expert_scales, (config.num_experts, config.scales_numel))
    if shared_expert_scales is not None:
        tensors["shared_expert_scales"] = _scales(path, "shared_expert_scales", shared_expert_scales,
                                                  (config.shared_scales_numel,))
    if router is not None:
        tensors["router"] = np.asarray(router, np.float32)
    if router_bias is not None:
        tensors["router_bias"] = np.asarray(router_bias, np.float32)
    if router_logit_bias is not None:
        tensors["router_logit_bias"] = np.asarray(router_logit_bias, np.float32)
    if expert_bias is not None:
        tensors["expert_bias"] = np.asarray(expert_bias, np.float32).reshape(config.num_experts, -1)
    if shared_expert_gate is not None:
        tensors["shared_expert_gate"] = np.asarray(shared_expert_gate, np.float32).reshape(-1)
    st.write(path, tensors, {**(extra_metadata or {}), **config_metadata(config)})


def _scales(path, name, value, shape) -> np.ndarray:
    """A scale tensor as float32 of `shape` (any layout with that many elements), or ColibriError."""
    array = np.asarray(value, np.float32)
    if array.size != int(np.prod(shape)):
        raise ColibriError(f"{path}: {name} has {array.size} scales, expected {int(np.prod(shape))} "
                           f"({list(shape)})", STATUS_INVALID_ARGUMENT)
    return array.reshape(shape)


DEMO_DEFAULTS = dict(experts=8, top_k=2, hidden=256, intermediate=512, dtype="bf16", seed=0,
                     routing="softmax_topk", kind="swiglu")


def demo_config(experts=8, top_k=2, hidden=256, intermediate=512, dtype="bf16", routing="softmax_topk",
                kind="swiglu", renormalize=None, routed_scaling_factor=1.0) -> LayerConfig:
    """The validated config of a demo checkpoint (with a router; renormalize defaults to True; fp8
    weights in 128 x 128 scale blocks)."""
    blocks = fp8.BLOCK if dtype == "fp8_e4m3" else (0, 0)
    config = LayerConfig(expert_kind=kind, num_experts=experts, top_k=top_k, hidden_size=hidden,
                         intermediate_size=intermediate, weight_dtype=dtype, routing=routing,
                         renormalize=True if renormalize is None else renormalize,
                         routed_scaling_factor=routed_scaling_factor, has_router=True,
                         scale_block_n=blocks[0], scale_block_k=blocks[1])
    config.validate()
    return config


def write_demo(path, experts=8, top_k=2, hidden=256, intermediate=512, dtype="bf16", seed=0,
               routing="softmax_topk", kind="swiglu", renormalize=None, routed_scaling_factor=1.0) -> LayerConfig:
    """A synthetic checkpoint with a router. Weights ~ N(0, 1/fan_in) so activations stay O(1).
    bf16 by default: the dtype real MoE checkpoints ship in, and half the bytes a read-bound decode
    step streams, so the demo exercises the path real models take. dtype fp8_e4m3 quantises the same
    weights to fp8 in 128 x 128 blocks (colibri.fp8.quantize). renormalize defaults to True for
    softmax_topk and sigmoid_bias routing."""
    config = demo_config(experts, top_k, hidden, intermediate, dtype, routing, kind, renormalize,
                         routed_scaling_factor)
    rng = np.random.default_rng(seed)
    H, F = hidden, intermediate

    def expert_matrices():
        for _ in range(experts):
            if kind == "swiglu":
                gate_up = rng.standard_normal((2 * F, H), np.float32) / np.sqrt(H)
                yield gate_up[:F], gate_up[F:], rng.standard_normal((H, F), np.float32) / np.sqrt(F)
            else:
                yield (rng.standard_normal((F, H), np.float32) / np.sqrt(H),)

    if config.fp8:
        quantised = [fp8.quantize_matrices(m, *fp8.BLOCK) for m in expert_matrices()]
        packed, scales = np.stack([q[0] for q in quantised]), np.stack([q[1] for q in quantised])
    else:
        packed = np.stack([from_float(np.concatenate([m.reshape(-1) for m in ms]), dtype) for ms in expert_matrices()])
        scales = None
    router = rng.standard_normal((experts, H), np.float32) / np.sqrt(H)
    bias = (0.1 * rng.standard_normal(experts)).astype(np.float32) if routing == "sigmoid_bias" else None
    save(path, config, packed, router, bias, {"source": f"colibri demo (seed {seed})"}, expert_scales=scales)
    return config
