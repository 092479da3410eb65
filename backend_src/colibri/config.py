"""LayerConfig: the shape and semantics of one MoE layer, shared by the layer, the checkpoint reader
and writer and the packer, apart from all of them so none imports another for it.

Each field says once how it travels (dataclasses field metadata): its kind, the checkpoint format
version that first stores it under its own name, and whether colibri_moe_config_t has it under the
same name. The checkpoint's metadata, the C struct and the validation (the library's own
colibri_moe_config_check) all follow from that."""
import dataclasses

import numpy as np

from colibri._native import (ACTIVATION_CODES, DTYPE_CODES, EXPERT_KIND_CODES, GROUP_SCORE_CODES, ROUTING_CODES,
                             STATUS_OK, ColibriError, ffi, invalid, lib)
from colibri.fp8 import scales_numel

MAX_EXPERTS = lib.COLIBRI_MAX_EXPERTS
ROUTINGS = tuple(ROUTING_CODES)
EXPERT_KINDS = tuple(EXPERT_KIND_CODES)
ACTIVATIONS = tuple(ACTIVATION_CODES)
GROUP_SCORES = tuple(GROUP_SCORE_CODES)


def _field(default=dataclasses.MISSING, kind="int", since=1, required=False, in_c=True, codes=None):
    """A LayerConfig field: kind int | float | bool | choice (one of `codes`, the C enum's values);
    since: the format version whose metadata first holds it (None: never, it comes from the tensors);
    required: a file of that version must hold it; in_c: colibri_moe_config_t has a member of its name."""
    return dataclasses.field(default=default, metadata=dict(kind=kind, since=since, required=required, in_c=in_c,
                                                            codes=codes))


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Shape and semantics of one MoE layer (see colibri.h for the routing definitions).

    Construct it with keywords. The fields without a default come first because the runtime must
    import on Python 3.8 (tritonserver 22.12, the CUDA 11.8 image), which has no kw_only dataclasses;
    positional arguments follow this order but are not part of the interface."""
    num_experts: int = _field(required=True)                       # E
    top_k: int = _field(required=True)                             # k
    hidden_size: int = _field(required=True)                       # H
    intermediate_size: int = _field(required=True)                 # F (linear: the output width)
    expert_kind: str = _field("swiglu", "choice", required=True, codes=EXPERT_KIND_CODES)
    # 'fp32' | 'fp16' | 'bf16' | 'fp8_e4m3' (with scale grids); a checkpoint stores it as the experts' dtype
    weight_dtype: str = _field("fp32", "choice", since=None, codes=DTYPE_CODES)
    routing: str = _field("softmax_topk", "choice", required=True, codes=ROUTING_CODES)
    renormalize: bool = _field(True, "bool", required=True)
    routed_scaling_factor: float = _field(1.0, "float")
    has_router: bool = _field(False, "bool", since=None, in_c=False)   # a checkpoint: whether it has one
    # Defaults below mean "absent": a layer with them computes what a colibri-moe/1 layer computes.
    n_group: int = _field(1, since=2)                      # group-limited routing when > 1 (E % n_group == 0)
    topk_group: int = _field(1, since=2)                   # groups kept, 1 <= topk_group <= n_group
    group_score: str = _field("max", "choice", since=2, codes=GROUP_SCORE_CODES)   # 'max' | 'top2_sum'
    activation: str = _field("silu", "choice", since=2, codes=ACTIVATION_CODES)    # swiglu_oai: swiglu only
    activation_alpha: float = _field(1.702, "float", since=2)   # swiglu_oai only
    activation_limit: float = _field(7.0, "float", since=2)     # swiglu_oai only
    expert_bias: bool = _field(False, "bool", since=2)     # fp32 biases [E, 2F+H] (swiglu) or [E, F] (linear)
    shared_intermediate_size: int = _field(0, since=2)     # Fs: a shared SiLU SwiGLU expert when > 0
    shared_gate: bool = _field(False, "bool", since=2)     # shared expert output times sigmoid(shared_gate . x)
    has_router_logit_bias: bool = _field(False, "bool", since=None, in_c=False)  # router_logit_bias [E]
    # fp8 weights only (else 0): rows and columns of a matrix one scale covers, 0 = all of them
    # ((128, 128) DeepSeek-V3's blocks, (1, 0) per output channel, (0, 0) per tensor; colibri.fp8).
    scale_block_n: int = _field(0, since=3)
    scale_block_k: int = _field(0, since=3)

    def validate(self) -> None:
        """Raises ColibriError naming the first bad field: its type here, then the library's rules
        (colibri_moe_config_check, the checks colibri_moe_context_create makes)."""
        for field in dataclasses.fields(self):
            _check_type(field, getattr(self, field.name))
        status = lib.colibri_moe_config_check(self.to_c())
        if status != STATUS_OK:
            raise ColibriError(ffi.string(lib.colibri_last_error()).decode(errors="replace"), status)

    def to_c(self, cfg=None):
        """The fields colibri_moe_config_t shares, written into `cfg` (a new struct by default; its
        device, workspace and routing_fn members are the caller's to set)."""
        cfg = ffi.new("colibri_moe_config_t *") if cfg is None else cfg
        for field in dataclasses.fields(self):
            spec, value = field.metadata, getattr(self, field.name)
            if spec["in_c"]:
                setattr(cfg, field.name, spec["codes"][value] if spec["kind"] == "choice"
                        else int(bool(value)) if spec["kind"] == "bool" else value)
        return cfg

    @property
    def out_features(self) -> int:
        return self.hidden_size if self.expert_kind == "swiglu" else self.intermediate_size

    @property
    def expert_numel(self) -> int:
        """Elements of one expert: swiglu gate [F,H] + up [F,H] + down [H,F]; linear [F,H]."""
        return (3 if self.expert_kind == "swiglu" else 1) * self.hidden_size * self.intermediate_size

    @property
    def expert_bias_width(self) -> int:
        """Biases per expert: swiglu gate F + up F + down H; linear F."""
        F = self.intermediate_size
        return 2 * F + self.hidden_size if self.expert_kind == "swiglu" else F

    @property
    def shared_numel(self) -> int:
        """Elements of the shared expert: gate [Fs,H] + up [Fs,H] + down [H,Fs]."""
        return 3 * self.shared_intermediate_size * self.hidden_size

    @property
    def fp8(self) -> bool:
        return self.weight_dtype == "fp8_e4m3"

    @property
    def scales_numel(self) -> int:
        """fp8 scales of one expert (its grids back to back: gate, up, down; linear w); 0 otherwise."""
        if not self.fp8:
            return 0
        return scales_numel(self.expert_kind, self.hidden_size, self.intermediate_size, self.scale_block_n,
                            self.scale_block_k)

    @property
    def shared_scales_numel(self) -> int:
        """fp8 scales of the shared expert (gate [Fs,H], up [Fs,H], down [H,Fs] grids); 0 without one or fp8."""
        if not self.fp8 or not self.shared_intermediate_size:
            return 0
        return scales_numel("swiglu", self.hidden_size, self.shared_intermediate_size, self.scale_block_n,
                            self.scale_block_k)

    @property
    def uses_v2_features(self) -> bool:
        """Whether the layer needs more than colibri_moe_context_init (and colibri-moe/1) can express."""
        return (self.n_group > 1 or self.activation != "silu" or self.expert_bias or self.shared_intermediate_size > 0
                or self.has_router_logit_bias or self.fp8)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_type(field, value) -> None:
    """What the C struct can hold: int32 integers, real numbers, bools, names of its enums' values."""
    kind, codes = field.metadata["kind"], field.metadata["codes"]
    if kind == "int" and not (_is_int(value) and -2**31 <= value < 2**31):
        wanted = "an integer"
    elif kind == "float" and not (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)):
        wanted = "a number"
    elif kind == "bool" and not isinstance(value, (bool, np.bool_)):
        wanted = "a bool"
    elif kind == "choice" and not (isinstance(value, str) and value in codes):
        wanted = " | ".join(codes)
    else:
        return
    raise invalid(f"config.{field.name}: expected {wanted}, got {value!r}")
