"""The float64 reference of an MoE layer: plain numpy following colibri.h's documented semantics, for
tests and for checking checkpoints. Inputs are float arrays (bf16 callers widen their uint16 bits
first with colibri.dtypes.to_float32); expert weights are taken in their storage dtype."""
import numpy as np

from colibri.dtypes import to_float64


def router_logits(x, router) -> np.ndarray:
    """l = x @ router.T in float64: [T, E]."""
    return np.asarray(x, np.float64) @ np.asarray(router, np.float64).T


def selection_scores(config, logits, router_bias=None) -> np.ndarray:
    """The scores top-k selects on: softmax(l), l, or sigmoid(l) + router_bias."""
    if config.routing == "softmax_topk":
        return _softmax(logits)
    if config.routing == "topk_softmax":
        return logits
    if router_bias is None:
        raise ValueError("sigmoid_bias routing needs router_bias")
    return _sigmoid(logits) + np.asarray(router_bias, np.float64)


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
        gate = _softmax(logits) if config.routing == "softmax_topk" else _sigmoid(logits)
        weights = np.take_along_axis(gate, ids.astype(np.int64), axis=1)
        if config.renormalize:
            weights = weights / weights.sum(axis=1, keepdims=True)
    return weights * float(config.routed_scaling_factor)


def route(config, x, router, router_bias=None):
    """(topk_ids int32 [T, k], topk_weights float64 [T, k], selection_scores float64 [T, E])."""
    logits = router_logits(x, router)
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
    return (ordered[:, :-1] - ordered[:, 1:]).min(axis=1)


def expert_weights(config, experts, e: int):
    """Expert e's matrices in float64: swiglu (gate [F,H], up [F,H], down [H,F]); linear (w [F,H],)."""
    H, F = config.hidden_size, config.intermediate_size
    row = to_float64(np.asarray(experts).reshape(config.num_experts, -1)[e], config.weight_dtype)
    if config.expert_kind == "linear":
        return (row.reshape(F, H),)
    return row[:F * H].reshape(F, H), row[F * H:2 * F * H].reshape(F, H), row[2 * F * H:].reshape(H, F)


def expert_forward(config, weights, x) -> np.ndarray:
    """One expert on tokens x [n, H] in float64."""
    if config.expert_kind == "linear":
        return x @ weights[0].T
    gate, up, down = weights
    g = x @ gate.T
    return (g / (1.0 + np.exp(-g)) * (x @ up.T)) @ down.T


def moe_forward(config, experts, x, topk_ids=None, topk_weights=None, router=None, router_bias=None) -> np.ndarray:
    """output [T, out_features] float64 = sum_j w[t, j] * expert_{ids[t, j]}(x[t]); routing from the
    router when topk_ids / topk_weights are not given."""
    x = np.asarray(x, np.float64)
    if topk_ids is None:
        topk_ids, topk_weights, _ = route(config, x, router, router_bias)
    topk_ids = np.asarray(topk_ids)
    topk_weights = np.asarray(topk_weights, np.float64)
    out = np.zeros((x.shape[0], config.out_features))
    for e in np.unique(topk_ids):
        tokens, slots = np.nonzero(topk_ids == e)
        y = expert_forward(config, expert_weights(config, experts, int(e)), x[tokens])
        np.add.at(out, tokens, topk_weights[tokens, slots, None] * y)
    return out


def _softmax(values) -> np.ndarray:
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _sigmoid(values) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-values))
