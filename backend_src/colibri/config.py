"""LayerConfig: the shape and semantics of one MoE layer, shared by the layer, the checkpoint reader
and writer and the packer, apart from all of them so none imports another for it."""
import dataclasses
import math

import numpy as np

from colibri._native import (ACTIVATION_CODES, EXPERT_KIND_CODES, GROUP_SCORE_CODES, ROUTING_CODES,
                             STATUS_UNSUPPORTED, ColibriError, invalid)
from colibri.dtypes import WEIGHT_DTYPES
from colibri.fp8 import scales_numel

# A bound far above any model's experts (hundreds), so that a file cannot make a loader build per-expert
# structures by the hundred million.
MAX_EXPERTS = 1 << 16
ROUTINGS = tuple(ROUTING_CODES)
EXPERT_KINDS = tuple(EXPERT_KIND_CODES)
ACTIVATIONS = tuple(ACTIVATION_CODES)
GROUP_SCORES = tuple(GROUP_SCORE_CODES)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Shape and semantics of one MoE layer (see colibri.h for the routing definitions).

    Construct it with keywords. The fields without a default come first because the runtime must
    import on Python 3.8 (tritonserver 22.12, the CUDA 11.8 image), which has no kw_only dataclasses;
    positional arguments follow this order but are not part of the interface."""
    num_experts: int                       # E
    top_k: int                             # k
    hidden_size: int                       # H
    intermediate_size: int                 # F (linear: the output width)
    expert_kind: str = "swiglu"            # 'swiglu' | 'linear'
    weight_dtype: str = "fp32"             # 'fp32' | 'fp16' | 'bf16' | 'fp8_e4m3' (with scale grids)
    routing: str = "softmax_topk"          # 'softmax_topk' | 'topk_softmax' | 'sigmoid_bias'
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    has_router: bool = False
    # Defaults below mean "absent": a layer with them computes what a colibri-moe/1 layer computes.
    n_group: int = 1                       # group-limited routing when > 1 (E % n_group == 0)
    topk_group: int = 1                    # groups kept, 1 <= topk_group <= n_group
    group_score: str = "max"               # 'max' | 'top2_sum'
    activation: str = "silu"               # 'silu' | 'swiglu_oai' (swiglu experts only)
    activation_alpha: float = 1.702        # swiglu_oai only
    activation_limit: float = 7.0          # swiglu_oai only
    expert_bias: bool = False              # fp32 biases [E, 2F+H] (swiglu) or [E, F] (linear)
    shared_intermediate_size: int = 0      # Fs: a shared SiLU SwiGLU expert when > 0
    shared_gate: bool = False              # shared expert output times sigmoid(shared_gate . x)
    has_router_logit_bias: bool = False    # router_logit_bias [E] added to the logits
    # fp8 weights only (else 0): rows and columns of a matrix one scale covers, 0 = all of them
    # ((128, 128) DeepSeek-V3's blocks, (1, 0) per output channel, (0, 0) per tensor; colibri.fp8).
    scale_block_n: int = 0
    scale_block_k: int = 0

    @property
    def out_features(self) -> int:
        return self.hidden_size if self.expert_kind == "swiglu" else self.intermediate_size

    @property
    def expert_numel(self) -> int:
        """Elements of one expert: swiglu gate [F,H] + up [F,H] + down [H,F]; linear [F,H]."""
        return (3 if self.expert_kind == "swiglu" else 1) * self.hidden_size * self.intermediate_size

    def validate(self) -> None:
        """Raises ColibriError naming the first bad field."""
        def bad(field, wanted):
            return invalid(f"config.{field}: expected {wanted}, got {getattr(self, field)!r}")
        if self.expert_kind not in EXPERT_KINDS:
            raise bad("expert_kind", " | ".join(EXPERT_KINDS))
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise bad("weight_dtype", " | ".join(WEIGHT_DTYPES))
        if self.routing not in ROUTINGS:
            raise bad("routing", " | ".join(ROUTINGS))
        for field in ("num_experts", "hidden_size", "intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value < 2**31:
                raise bad(field, "an integer >= 1")
        if self.num_experts > MAX_EXPERTS:
            raise bad("num_experts", f"at most {MAX_EXPERTS} (models ship hundreds)")
        if not isinstance(self.top_k, (int, np.integer)) or not 1 <= self.top_k <= self.num_experts:
            raise bad("top_k", f"an integer in [1, num_experts={self.num_experts}]")
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise bad("renormalize", "a bool")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise bad("routed_scaling_factor", "a finite number > 0")
        E = self.num_experts
        if not _is_int(self.n_group) or not 1 <= self.n_group <= E or E % self.n_group:
            raise bad("n_group", f"an integer >= 1 dividing num_experts={E}")
        if not _is_int(self.topk_group) or not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", f"an integer in [1, n_group={self.n_group}]")
        if self.top_k > self.topk_group * (E // self.n_group):
            raise invalid(f"config.top_k: {self.top_k} experts cannot be chosen from topk_group={self.topk_group} "
                          f"groups of {E // self.n_group}")
        if self.group_score not in GROUP_SCORES:
            raise bad("group_score", " | ".join(GROUP_SCORES))
        if self.group_score == "top2_sum" and self.n_group > 1 and E // self.n_group < 2:
            raise invalid(f"config.group_score: top2_sum needs groups of >= 2 experts, got {E // self.n_group}")
        if self.activation not in ACTIVATIONS:
            raise bad("activation", " | ".join(ACTIVATIONS))
        if self.activation != "silu" and self.expert_kind != "swiglu":
            raise invalid(f"config.activation: {self.activation} applies to swiglu experts, not {self.expert_kind}")
        for field in ("activation_alpha", "activation_limit"):
            value = getattr(self, field)
            if not isinstance(value, (int, float, np.floating)) or not (math.isfinite(value) and value > 0):
                raise bad(field, "a finite number > 0")
        for field in ("expert_bias", "shared_gate", "has_router_logit_bias"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                raise bad(field, "a bool")
        if not _is_int(self.shared_intermediate_size) or not 0 <= self.shared_intermediate_size < 2**31:
            raise bad("shared_intermediate_size", "an integer >= 0")
        if self.shared_intermediate_size and self.expert_kind != "swiglu":
            raise invalid("config.shared_intermediate_size: a shared expert needs swiglu experts (its output is [T, H])")
        if self.shared_gate and not self.shared_intermediate_size:
            raise invalid("config.shared_gate: set without a shared expert (shared_intermediate_size is 0)")
        self._validate_scale_blocks()

    def _validate_scale_blocks(self) -> None:
        bn, bk = self.scale_block_n, self.scale_block_k
        if self.weight_dtype != "fp8_e4m3":
            if (bn, bk) != (0, 0):
                raise invalid(f"config.scale_block_n, scale_block_k: ({bn!r}, {bk!r}) apply to fp8_e4m3 weights "
                              f"only, these are {self.weight_dtype}: expected (0, 0)")
            return
        for field in ("scale_block_n", "scale_block_k"):
            value = getattr(self, field)
            if not _is_int(value) or not 0 <= value < 2**31:
                raise invalid(f"config.{field}: expected an integer >= 0 (0: the whole dimension), got {value!r}")
        # The shared expert runs as slices of width F (colibri.h): each slice must start on a scale block.
        F = self.intermediate_size
        if self.shared_intermediate_size > F and ((bn and F % bn) or (bk and F % bk)):
            raise ColibriError(f"config.shared_intermediate_size: an fp8 shared expert wider than intermediate_size="
                               f"{F} needs it to be a multiple of the scale block ({bn}, {bk})", STATUS_UNSUPPORTED)

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
