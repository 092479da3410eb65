"""Packed Colibri checkpoints (*.colibri.safetensors), format colibri-moe/1:

    experts      [E, expert_numel]  fp32 | fp16 | bf16   row e = expert e (swiglu: gate [F,H], up [F,H],
                                                         down [H,F]; linear: [F,H]; row-major)
    router       [E, H] fp32        optional
    router_bias  [E] fp32           optional (required by sigmoid_bias routing)
    metadata     format, expert_kind, num_experts, top_k, hidden_size, intermediate_size, routing,
                 renormalize (true|false), routed_scaling_factor (optional, default 1)

Also the synthetic demo checkpoint (`write_demo`)."""
import dataclasses
import pathlib

import numpy as np

from colibri import safetensors_io as st
from colibri._native import ColibriError, STATUS_INVALID_ARGUMENT
from colibri.dtypes import from_float
from colibri.config import EXPERT_KINDS, ROUTINGS, LayerConfig

FORMAT = "colibri-moe/1"
REQUIRED_METADATA = ("expert_kind", "num_experts", "top_k", "hidden_size", "intermediate_size", "routing",
                     "renormalize")


@dataclasses.dataclass
class Checkpoint:
    config: LayerConfig
    experts: np.ndarray                 # [E, expert_numel], read-only view into the mmap
    router: np.ndarray = None           # [E, H] float32
    router_bias: np.ndarray = None      # [E] float32
    file: st.SafetensorsFile = None     # keeps the mmap open
    metadata: dict = None


def _fail(path, message) -> ColibriError:
    return ColibriError(f"{path}: {message}", STATUS_INVALID_ARGUMENT)


def config_metadata(config: LayerConfig) -> dict:
    return {
        "format": FORMAT, "expert_kind": config.expert_kind, "num_experts": str(config.num_experts),
        "top_k": str(config.top_k), "hidden_size": str(config.hidden_size),
        "intermediate_size": str(config.intermediate_size), "routing": config.routing,
        "renormalize": "true" if config.renormalize else "false",
        "routed_scaling_factor": repr(float(config.routed_scaling_factor)),
    }


def _parse_config(path, meta, weight_dtype, has_router) -> LayerConfig:
    if meta.get("format") != FORMAT:
        raise _fail(path, f"metadata format is {meta.get('format')!r}, expected {FORMAT!r} "
                          "(pack a Hugging Face checkpoint with `python -m colibri pack`)")
    missing = [key for key in REQUIRED_METADATA if key not in meta]
    if missing:
        raise _fail(path, f"metadata lacks {', '.join(missing)}")

    def integer(key):
        try:
            return int(meta[key])
        except ValueError:
            raise _fail(path, f"metadata {key}={meta[key]!r} is not an integer") from None
    if meta["expert_kind"] not in EXPERT_KINDS:
        raise _fail(path, f"metadata expert_kind={meta['expert_kind']!r} is not one of {', '.join(EXPERT_KINDS)}")
    if meta["routing"] not in ROUTINGS:
        raise _fail(path, f"metadata routing={meta['routing']!r} is not one of {', '.join(ROUTINGS)}")
    if meta["renormalize"].lower() not in ("true", "false", "1", "0"):
        raise _fail(path, f"metadata renormalize={meta['renormalize']!r} is not true or false")
    try:
        scaling = float(meta.get("routed_scaling_factor", "1.0"))
    except ValueError:
        raise _fail(path, f"metadata routed_scaling_factor={meta['routed_scaling_factor']!r} is not a number") from None
    config = LayerConfig(
        expert_kind=meta["expert_kind"], num_experts=integer("num_experts"), top_k=integer("top_k"),
        hidden_size=integer("hidden_size"), intermediate_size=integer("intermediate_size"),
        weight_dtype=weight_dtype, routing=meta["routing"], renormalize=meta["renormalize"].lower() in ("true", "1"),
        routed_scaling_factor=scaling, has_router=has_router)
    try:
        config.validate()
    except ColibriError as exc:
        raise _fail(path, f"metadata describes an invalid layer ({exc.args[0]})") from None
    return config


def read_config(path) -> LayerConfig:
    """The layer a checkpoint describes, from its header alone (no tensor data is read): Triton's
    auto-complete asks for H and k before any model instance loads the weights."""
    return _open(path)[1]


def _open(path):
    """(the open file, its LayerConfig), checked as far as the header allows."""
    try:
        file = st.SafetensorsFile(path)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except st.SafetensorsError as exc:
        raise ColibriError(str(exc), STATUS_INVALID_ARGUMENT) from None
    if "experts" not in file:
        raise _fail(path, "has no 'experts' tensor")
    info = file.tensors["experts"]
    weight_dtype = st.SAFETENSORS_TO_COLIBRI.get(info.dtype)
    if weight_dtype is None:
        raise _fail(path, f"tensor 'experts' has dtype {info.dtype}, expected F32, F16 or BF16")
    return file, _parse_config(path, file.metadata, weight_dtype, "router" in file)


def load(path) -> Checkpoint:
    """Opens and checks a packed checkpoint; the tensors are views into a read-only memory map."""
    path = pathlib.Path(path)
    file, config = _open(path)
    E, H = config.num_experts, config.hidden_size
    expected = {"experts": (E, config.expert_numel), "router": (E, H), "router_bias": (E,)}
    for name, shape in expected.items():
        if name in file and file.tensors[name].shape != shape:
            raise _fail(path, f"tensor {name!r} has shape {list(file.tensors[name].shape)}, expected {list(shape)}")
        if name != "experts" and name in file and file.tensors[name].dtype != "F32":
            raise _fail(path, f"tensor {name!r} has dtype {file.tensors[name].dtype}, expected F32")
    if config.routing == "sigmoid_bias" and "router" in file and "router_bias" not in file:
        raise _fail(path, "sigmoid_bias routing needs a 'router_bias' tensor")
    router = file.get("router") if "router" in file else None
    bias = file.get("router_bias") if "router_bias" in file else None
    return Checkpoint(config, file.get("experts"), router, bias, file, dict(file.metadata))


def save(path, config: LayerConfig, experts, router=None, router_bias=None, extra_metadata=None) -> None:
    """Writes a packed checkpoint; `experts` may be an array or a safetensors_io.LazyTensor."""
    config.validate()
    tensors = {"experts": experts if isinstance(experts, st.LazyTensor)
               else (st.COLIBRI_TO_SAFETENSORS[config.weight_dtype], np.asarray(experts).reshape(config.num_experts, -1))}
    if router is not None:
        tensors["router"] = np.asarray(router, np.float32)
    if router_bias is not None:
        tensors["router_bias"] = np.asarray(router_bias, np.float32)
    st.write(path, tensors, {**(extra_metadata or {}), **config_metadata(config)})


DEMO_DEFAULTS = dict(experts=8, top_k=2, hidden=256, intermediate=512, dtype="bf16", seed=0,
                     routing="softmax_topk", kind="swiglu")


def demo_config(experts=8, top_k=2, hidden=256, intermediate=512, dtype="bf16", routing="softmax_topk",
                kind="swiglu", renormalize=None, routed_scaling_factor=1.0) -> LayerConfig:
    """The validated config of a demo checkpoint (with a router; renormalize defaults to True)."""
    config = LayerConfig(expert_kind=kind, num_experts=experts, top_k=top_k, hidden_size=hidden,
                         intermediate_size=intermediate, weight_dtype=dtype, routing=routing,
                         renormalize=True if renormalize is None else renormalize,
                         routed_scaling_factor=routed_scaling_factor, has_router=True)
    config.validate()
    return config


def write_demo(path, experts=8, top_k=2, hidden=256, intermediate=512, dtype="bf16", seed=0,
               routing="softmax_topk", kind="swiglu", renormalize=None, routed_scaling_factor=1.0) -> LayerConfig:
    """A synthetic checkpoint with a router. Weights ~ N(0, 1/fan_in) so activations stay O(1).
    bf16 by default: the dtype real MoE checkpoints ship in, and half the bytes a read-bound decode
    step streams, so the demo exercises the path real models take. renormalize defaults to True
    for softmax_topk and sigmoid_bias routing."""
    config = demo_config(experts, top_k, hidden, intermediate, dtype, routing, kind, renormalize,
                         routed_scaling_factor)
    rng = np.random.default_rng(seed)
    H, F = hidden, intermediate

    def expert_rows():
        for _ in range(experts):
            if kind == "swiglu":
                parts = (rng.standard_normal((2 * F, H), np.float32) / np.sqrt(H),
                         rng.standard_normal((H, F), np.float32) / np.sqrt(F))
            else:
                parts = (rng.standard_normal((F, H), np.float32) / np.sqrt(H),)
            yield from_float(np.concatenate([p.reshape(-1) for p in parts]), dtype)

    packed = np.stack(list(expert_rows()))
    router = rng.standard_normal((experts, H), np.float32) / np.sqrt(H)
    bias = (0.1 * rng.standard_normal(experts)).astype(np.float32) if routing == "sigmoid_bias" else None
    save(path, config, packed, router, bias, {"source": f"colibri demo (seed {seed})"})
    return config
