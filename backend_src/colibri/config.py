"""LayerConfig: the shape and semantics of one MoE layer, shared by the layer, the checkpoint reader
and writer and the packer, apart from all of them so none imports another for it."""
import dataclasses
import math

import numpy as np

from colibri._native import EXPERT_KIND_CODES, ROUTING_CODES, invalid
from colibri.dtypes import FLOAT_DTYPES

ROUTINGS = tuple(ROUTING_CODES)
EXPERT_KINDS = tuple(EXPERT_KIND_CODES)


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
    weight_dtype: str = "fp32"             # 'fp32' | 'fp16' | 'bf16'
    routing: str = "softmax_topk"          # 'softmax_topk' | 'topk_softmax' | 'sigmoid_bias'
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    has_router: bool = False

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
        if self.weight_dtype not in FLOAT_DTYPES:
            raise bad("weight_dtype", " | ".join(FLOAT_DTYPES))
        if self.routing not in ROUTINGS:
            raise bad("routing", " | ".join(ROUTINGS))
        for field in ("num_experts", "hidden_size", "intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value < 2**31:
                raise bad(field, "an integer >= 1")
        if not isinstance(self.top_k, (int, np.integer)) or not 1 <= self.top_k <= self.num_experts:
            raise bad("top_k", f"an integer in [1, num_experts={self.num_experts}]")
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise bad("renormalize", "a bool")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise bad("routed_scaling_factor", "a finite number > 0")
