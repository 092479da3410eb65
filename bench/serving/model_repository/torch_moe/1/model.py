"""The PyTorch-eager baseline of colibri_moe for bench/serving/compare.py: the same MoE layer from the
same packed checkpoint (COLIBRI_WEIGHTS, as colibri_moe reads it), the same inputs and outputs, and
the same config (compare.py copies colibri_moe's config.pbtxt with the name changed), computed the
way Hugging Face's Mixtral/Qwen-MoE blocks do: route, then loop over the experts that got tokens,
w2(silu(w1 x) * w3 x) on each one's tokens, index_add_ of the weighted results. It runs in the
checkpoint's weight dtype (as a model loaded in bf16 does), routing in fp32 with colibri's built-in
semantics (colibri.h; colibri.reference). Requests of a batch are joined along the token axis and
computed in one forward, as colibri_moe does; a request with bad inputs gets its own INVALID_ARG.
"""
import os

import numpy as np
import torch
import torch.nn.functional as F
import triton_python_backend_utils as pb_utils

from colibri import checkpoint
from colibri.serving import triton_config

INPUTS = ("hidden_states", "topk_ids", "topk_weights")


class InvalidInput(ValueError):
    pass


class TorchMoE:
    def __init__(self, path, device):
        ckpt = checkpoint.load(path)
        self.config = c = ckpt.config
        self.device = device
        experts = torch.from_numpy(np.array(ckpt.experts))  # a copy: the checkpoint is a read-only mmap
        if c.weight_dtype == "bf16":
            experts = experts.view(torch.bfloat16)  # bf16 is stored as its uint16 bits
        experts = experts.to(device)
        self.dtype = experts.dtype
        H, Fdim = c.hidden_size, c.intermediate_size
        if c.expert_kind == "swiglu":
            self.w1 = [row[:Fdim * H].view(Fdim, H) for row in experts]                # gate
            self.w3 = [row[Fdim * H:2 * Fdim * H].view(Fdim, H) for row in experts]    # up
            self.w2 = [row[2 * Fdim * H:].view(H, Fdim) for row in experts]            # down
        else:
            self.w1 = [row.view(Fdim, H) for row in experts]
        self.router = None if ckpt.router is None else torch.from_numpy(np.array(ckpt.router)).to(device)
        self.router_bias = None if ckpt.router_bias is None else torch.from_numpy(np.array(ckpt.router_bias)).to(device)

    def route(self, x):
        c = self.config
        logits = x.float() @ self.router.T
        if c.routing == "topk_softmax":
            picked, ids = torch.topk(logits, c.top_k, dim=1)
            weights = torch.softmax(picked, dim=1)
        else:
            gate = torch.softmax(logits, dim=1) if c.routing == "softmax_topk" else torch.sigmoid(logits)
            scores = gate if c.routing == "softmax_topk" else gate + self.router_bias
            ids = torch.topk(scores, c.top_k, dim=1).indices
            weights = gate.gather(1, ids)
            if c.renormalize:
                weights = weights / weights.sum(dim=1, keepdim=True)
        return ids, weights * c.routed_scaling_factor

    def expert(self, e, x):
        if self.config.expert_kind == "linear":
            return F.linear(x, self.w1[e])
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])

    @torch.inference_mode()
    def forward(self, x, ids=None, weights=None):
        if ids is None:
            ids, weights = self.route(x)
        h = x.to(self.dtype)
        out = torch.zeros((h.shape[0], self.config.out_features), dtype=self.dtype, device=h.device)
        # [E, k, T]: which (slot, token) pairs chose each expert, as transformers' MixtralSparseMoeBlock.
        mask = F.one_hot(ids.long(), self.config.num_experts).permute(2, 1, 0)
        for e in torch.nonzero(mask.sum(dim=(1, 2))).flatten().tolist():
            slot, token = torch.where(mask[e])
            y = self.expert(e, h[token]) * weights[token, slot, None].to(self.dtype)
            out.index_add_(0, token, y)
        return out.to(x.dtype)

    def check(self, x, ids, weights):
        c = self.config
        if x.dim() != 2 or x.shape[1] != c.hidden_size or x.shape[0] == 0:
            raise InvalidInput(f"hidden_states: expected shape [T, {c.hidden_size}], got {list(x.shape)}")
        if not x.is_floating_point() or x.dtype == torch.float64:
            raise InvalidInput(f"hidden_states: expected dtype fp32 | fp16 | bf16, got {x.dtype}")
        if (ids is None) != (weights is None):
            raise InvalidInput(f"{'topk_weights' if weights is None else 'topk_ids'}: give topk_ids and "
                               "topk_weights together")
        if ids is None:
            if self.router is None:
                raise InvalidInput("hidden_states: this layer has no router; give topk_ids and topk_weights")
            return
        shape = [x.shape[0], c.top_k]
        if ids.dtype != torch.int32 or list(ids.shape) != shape or bool(((ids < 0) | (ids >= c.num_experts)).any()):
            raise InvalidInput(f"topk_ids: expected int32 [{shape[0]}, {shape[1]}] in [0, {c.num_experts})")
        if list(weights.shape) != shape or not bool(torch.isfinite(weights).all()):
            raise InvalidInput(f"topk_weights: expected finite fp32 [{shape[0]}, {shape[1]}]")


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        # colibri_moe's config leaves the dims out: the checkpoint's header gives them (as there).
        return triton_config.complete(auto_complete_model_config, os.path.dirname(os.path.abspath(__file__)))

    def initialize(self, args):
        path = triton_config.instance_settings(args).weights
        on_gpu = args["model_instance_kind"] == "GPU"
        device = torch.device("cuda", int(args["model_instance_device_id"])) if on_gpu else torch.device("cpu")
        self.layer = TorchMoE(path, device)
        pb_utils.Logger.log_info(f"torch_moe: {self.layer.config} from {path} on {device}, torch {torch.__version__}")

    def execute(self, requests):
        responses = [None] * len(requests)
        groups = {}
        for index, request in enumerate(requests):
            tensors = [pb_utils.get_input_tensor_by_name(request, name) for name in INPUTS]
            try:
                x, ids, weights = [None if t is None else torch.from_dlpack(t.to_dlpack()).to(self.layer.device)
                                   for t in tensors]
                self.layer.check(x, ids, weights)
            except InvalidInput as exc:
                responses[index] = error(str(exc), pb_utils.TritonError.INVALID_ARG)
                continue
            groups.setdefault((ids is None, x.dtype), []).append((index, x, ids, weights))
        for members in groups.values():
            try:
                joined = [None if members[0][j] is None else torch.cat([m[j] for m in members]) for j in (1, 2, 3)]
                out = self.layer.forward(*joined)
                start = 0
                for index, x, _, _ in members:
                    part = out[start:start + x.shape[0]].contiguous()
                    responses[index] = pb_utils.InferenceResponse(
                        [pb_utils.Tensor.from_dlpack("output", torch.utils.dlpack.to_dlpack(part))])
                    start += x.shape[0]
            except Exception as exc:  # execute must not raise: that would fail every request of the batch
                for index, *_ in members:
                    responses[index] = error(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
        return responses


def error(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
