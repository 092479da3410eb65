"""The float64 reference of an MoE layer: plain numpy following colibri.h's documented semantics, for
tests and for checking checkpoints. Inputs are float arrays (bf16 callers widen their uint16 bits
first with colibri.dtypes.to_float32); expert and shared-expert weights are taken in their storage
dtype. fp8 weights are dequantised exactly with their scale grids (colibri.fp8): the reference of record
for an fp8 layer is the layer of its dequantised weights.

Routing (colibri.h, colibri_routing_t): logits l = W x + router_logit_bias; a score p = softmax(l),
l or sigmoid(l); the selection score s = p + router_bias; with n_group > 1 only the experts of the
topk_group best groups (group score: max of s, or the sum of its two highest) can be chosen; ids = the
k highest s; weights p[ids] (topk_softmax: softmax(l[ids])), renormalised for softmax_topk and
sigmoid_bias when asked, times routed_scaling_factor. The shared expert, when there is one, is added
with weight 1 or sigmoid(shared_gate . x)."""
import numpy as np

from colibri import fp8
from colibri.dtypes import to_float64


def router_logits(x, router, router_logit_bias=None) -> np.ndarray:
    """l = x @ router.T (+ router_logit_bias) in float64: [T, E]."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    if router_logit_bias is not None:
        logits = logits + np.asarray(router_logit_bias, np.float64)
    return logits


def gate_scores(config, logits) -> np.ndarray:
    """p: softmax(l), l or sigmoid(l) per the routing."""
    if config.routing == "softmax_topk":
        return _softmax(logits)
    if config.routing == "topk_softmax":
        return logits
    return _sigmoid(logits)


def raw_selection_scores(config, logits, router_bias=None) -> np.ndarray:
    """s = p + router_bias, before any group limit."""
    if config.routing == "sigmoid_bias" and router_bias is None:
        raise ValueError("sigmoid_bias routing needs router_bias")
    scores = gate_scores(config, logits)
    if router_bias is not None:
        scores = scores + np.asarray(router_bias, np.float64)
    return scores


def group_scores(config, scores) -> np.ndarray:
    """[T, n_group]: each group's max s, or the sum of its two highest."""
    grouped = scores.reshape(scores.shape[0], config.n_group, -1)
    if config.group_score == "max":
        return grouped.max(axis=2)
    return -np.sort(-grouped, axis=2)[:, :, :2].sum(axis=2)


def kept_experts(config, scores) -> np.ndarray:
    """[T, E] bool: the experts of the topk_group best groups (all of them without a group limit)."""
    T, E = scores.shape
    if config.n_group <= 1:
        return np.ones((T, E), bool)
    groups = select_topk(group_scores(config, scores), config.topk_group)
    kept = np.zeros((T, config.n_group), bool)
    np.put_along_axis(kept, groups.astype(np.int64), True, axis=1)
    return np.repeat(kept, E // config.n_group, axis=1)


def selection_scores(config, logits, router_bias=None) -> np.ndarray:
    """The scores top-k selects on: s = p + router_bias, -inf outside the kept groups."""
    scores = raw_selection_scores(config, logits, router_bias)
    return np.where(kept_experts(config, scores), scores, -np.inf)


def select_topk(scores, k: int) -> np.ndarray:
    """Ids of the k highest scores per row, in descending order of score, ties to the lower id."""
    # A stable sort of the negated scores keeps equal scores in ascending id order.
    return np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32)


def routing_weights(config, logits, ids) -> np.ndarray:
    """The weights of the given experts per token (so weights for ids chosen elsewhere, e.g. at a
    near-tie, can be recomputed exactly)."""
    picked = np.take_along_axis(logits, ids.astype(np.int64), axis=1)
    if config.routing == "topk_softmax":
        weights = _softmax(picked)
    else:
        weights = np.take_along_axis(gate_scores(config, logits), ids.astype(np.int64), axis=1)
        if config.renormalize:
            weights = weights / weights.sum(axis=1, keepdims=True)
    return weights * float(config.routed_scaling_factor)


def route(config, x, router, router_bias=None, router_logit_bias=None):
    """(topk_ids int32 [T, k], topk_weights float64 [T, k], selection_scores float64 [T, E], -inf
    outside the kept groups)."""
    logits = router_logits(x, router, router_logit_bias)
    scores = selection_scores(config, logits, router_bias)
    ids = select_topk(scores, config.top_k)
    return ids, routing_weights(config, logits, ids), scores


def topk_margin(scores, k: int) -> np.ndarray:
    """Per row, the smallest gap between consecutive scores among the k+1 highest (the k highest when
    k == E). A row whose margin is within rounding error may legitimately select, or order, its
    experts differently from this reference."""
    ordered = -np.sort(-scores, axis=1)[:, :k + 1]
    if ordered.shape[1] < 2:
        return np.full(scores.shape[0], np.inf)
    with np.errstate(invalid="ignore"):
        gaps = ordered[:, :-1] - ordered[:, 1:]
    return np.nan_to_num(gaps, nan=np.inf).min(axis=1)  # -inf - -inf: both excluded, no tie


def group_margin(config, logits, router_bias=None) -> np.ndarray:
    """Per row, topk_margin of the group scores (inf without a group limit): a row within rounding
    error may keep a different set of groups."""
    if config.n_group <= 1 or config.topk_group == config.n_group:
        return np.full(logits.shape[0], np.inf)
    return topk_margin(group_scores(config, raw_selection_scores(config, logits, router_bias)), config.topk_group)


def _matrices(config, flat, scales, shapes):
    """The matrices of `shapes` stored back to back in `flat` (weight_dtype storage), in float64;
    fp8 codes times their scale grids (`scales`, back to back likewise)."""
    if config.weight_dtype == "fp8_e4m3":
        if scales is None:
            raise ValueError("fp8 weights need their scales")
        return tuple(fp8.dequantize_matrices(flat, scales, shapes, config.scale_block_n, config.scale_block_k))
    values, matrices, at = to_float64(np.asarray(flat).reshape(-1), config.weight_dtype), [], 0
    for rows, cols in shapes:
        matrices.append(values[at:at + rows * cols].reshape(rows, cols))
        at += rows * cols
    return tuple(matrices)


def expert_weights(config, experts, e: int, expert_scales=None):
    """Expert e's matrices in float64: swiglu (gate [F,H], up [F,H], down [H,F]); linear (w [F,H],).
    fp8: expert_scales [E, scales_numel] gives their scale grids."""
    E = config.num_experts
    scales = None if expert_scales is None else np.asarray(expert_scales).reshape(E, -1)[e]
    return _matrices(config, np.asarray(experts).reshape(E, -1)[e], scales,
                     fp8.matrix_shapes(config.expert_kind, config.hidden_size, config.intermediate_size))


def shared_weights(config, shared_expert, shared_scales=None):
    """The shared expert's gate [Fs,H], up [Fs,H], down [H,Fs] in float64 (fp8: with its scale grids)."""
    return _matrices(config, shared_expert, shared_scales,
                     fp8.matrix_shapes("swiglu", config.hidden_size, config.shared_intermediate_size))


def activation(config, g, u) -> np.ndarray:
    """act(g, u) of swiglu experts: silu(g) * u, or gpt-oss's clamped (u' + 1) * g' * sigmoid(alpha g')."""
    if config.activation == "silu":
        return g * _sigmoid(g) * u
    limit, alpha = float(config.activation_limit), float(config.activation_alpha)
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g * _sigmoid(alpha * g)


def expert_forward(config, weights, x, bias=None) -> np.ndarray:
    """One expert on tokens x [n, H] in float64; bias: its row of expert_bias, or None."""
    F = config.intermediate_size
    bias = None if bias is None else np.asarray(bias, np.float64)
    if config.expert_kind == "linear":
        y = x @ weights[0].T
        return y if bias is None else y + bias
    gate, up, down = weights
    g, u = x @ gate.T, x @ up.T
    if bias is not None:
        g, u = g + bias[:F], u + bias[F:2 * F]
    y = activation(config, g, u) @ down.T
    return y if bias is None else y + bias[2 * F:]


def shared_forward(config, shared_expert, x, shared_expert_gate=None, shared_scales=None) -> np.ndarray:
    """The shared expert (SiLU SwiGLU, no biases) on x [T, H], times sigmoid(shared_gate . x) if gated."""
    gate, up, down = shared_weights(config, shared_expert, shared_scales)
    g = x @ gate.T
    y = (g * _sigmoid(g) * (x @ up.T)) @ down.T
    if config.shared_gate:
        y = y * _sigmoid(x @ np.asarray(shared_expert_gate, np.float64))[:, None]
    return y


def moe_forward(config, experts, x, topk_ids=None, topk_weights=None, router=None, router_bias=None,
                router_logit_bias=None, expert_bias=None, shared_expert=None, shared_expert_gate=None,
                expert_scales=None, shared_expert_scales=None) -> np.ndarray:
    """output [T, out_features] float64 = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) (+ the shared
    expert); routing from the router when topk_ids / topk_weights are not given. fp8 weights come with
    expert_scales [E, scales_numel] (and shared_expert_scales for the shared expert)."""
    x = np.asarray(x, np.float64)
    if topk_ids is None:
        topk_ids, topk_weights, _ = route(config, x, router, router_bias, router_logit_bias)
    topk_ids = np.asarray(topk_ids)
    topk_weights = np.asarray(topk_weights, np.float64)
    out = np.zeros((x.shape[0], config.out_features))
    biases = None if expert_bias is None else np.asarray(expert_bias, np.float64).reshape(config.num_experts, -1)
    for e in np.unique(topk_ids):
        tokens, slots = np.nonzero(topk_ids == e)
        y = expert_forward(config, expert_weights(config, experts, int(e), expert_scales), x[tokens],
                           None if biases is None else biases[int(e)])
        np.add.at(out, tokens, topk_weights[tokens, slots, None] * y)
    if config.shared_intermediate_size:
        out += shared_forward(config, shared_expert, x, shared_expert_gate, shared_expert_scales)
    return out


def checkpoint_forward(ckpt, x, topk_ids=None, topk_weights=None) -> np.ndarray:
    """moe_forward of a loaded colibri.checkpoint.Checkpoint, every tensor it holds taken into account."""
    return moe_forward(ckpt.config, ckpt.experts, x, topk_ids, topk_weights, ckpt.router, ckpt.router_bias,
                       ckpt.router_logit_bias, ckpt.expert_bias, ckpt.shared_expert, ckpt.shared_expert_gate,
                       ckpt.expert_scales, ckpt.shared_expert_scales)


def _softmax(values) -> np.ndarray:
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _sigmoid(values) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-values))
