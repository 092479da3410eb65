"""Helpers for checking Colibri against the float64 reference (used by tests/ and benchmarks):
random layers and inputs, per-dtype error limits normalised by the reference's scale, and the
comparison of built-in routing with near-ties allowed to go either way."""
import numpy as np

from colibri import fp8, reference
from colibri.dtypes import from_float, to_float64
from colibri.config import LayerConfig

# fp8 weights, against the reference of their dequantised weights: the CPU computes with exactly those
# weights in fp32 (within 1e-5). A GPU's fp8 tensor cores also quantise each token's activations to
# e4m3 per 128 inputs (3 mantissa bits: up to 2^-4 of a value off) before both
# projections and round intermediates to bf16 (colibri.h): simulated in numpy on the demo layers, that
# puts an answer 4-5% (of its largest value) from the reference; this leaves twice that.
FP8_ERROR_LIMIT = 0.1

# max |out - ref| / max |ref| allowed, by the least precise dtype involved. fp32: accumulation order
# over a few hundred products; fp16 / bf16: a few roundings of the input, intermediate and output
# (unit roundoff 2^-11 and 2^-8); fp8_e4m3: FP8_ERROR_LIMIT, for any backend.
ERROR_LIMITS = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 3e-2, "fp8_e4m3": FP8_ERROR_LIMIT}

# Selection scores closer than this (times the row's score scale) count as tied: the library works
# in fp32, so which of two such experts it picks is rounding, not a bug.
TIE_TOLERANCE = 1e-5


def error_limit(*dtypes) -> float:
    return max(ERROR_LIMITS[d] for d in dtypes)


def random_layer(rng, expert_kind="swiglu", num_experts=8, top_k=2, hidden_size=64, intermediate_size=96,
                 weight_dtype="fp32", routing="softmax_topk", renormalize=True, routed_scaling_factor=1.0,
                 with_router=True):
    """(config, experts [E, numel] in weight_dtype storage, router [E, H] float32 or None,
    router_bias [E] float32 or None); weights ~ N(0, 1/fan_in). fp8 layers: random_fp8_layer."""
    config = LayerConfig(expert_kind=expert_kind, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, weight_dtype=weight_dtype, routing=routing,
                         renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
                         has_router=with_router)
    H, F = hidden_size, intermediate_size
    rows = []
    for _ in range(num_experts):
        if expert_kind == "swiglu":
            parts = (rng.standard_normal(2 * F * H) / np.sqrt(H), rng.standard_normal(H * F) / np.sqrt(F))
        else:
            parts = (rng.standard_normal(F * H) / np.sqrt(H),)
        rows.append(np.concatenate(parts))
    experts = from_float(np.stack(rows).astype(np.float32), weight_dtype)
    router = (rng.standard_normal((num_experts, H)) / np.sqrt(H)).astype(np.float32) if with_router else None
    bias = (0.3 * rng.standard_normal(num_experts)).astype(np.float32) if routing == "sigmoid_bias" else None
    return config, experts, router, bias


def random_fp8_layer(rng, scale_block=fp8.BLOCK, expert_kind="swiglu", num_experts=8, top_k=2, hidden_size=64,
                     intermediate_size=96, shared_intermediate_size=0, routing="softmax_topk"):
    """(config, tensors): a random layer of fp8 e4m3 weights with a router, and the keyword tensors of
    MoELayer and colibri.reference.moe_forward (experts, router, router_bias, expert_scales and, with a
    shared expert, shared_expert and shared_expert_scales). Weights ~ N(0, 1/fan_in) quantised in
    scale_block blocks, then every scale multiplied by a random factor in [0.5, 2) with the codes kept:
    no scale is the amax / 448 a quantiser would choose, so the layer must use the ones given."""
    config = LayerConfig(expert_kind=expert_kind, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, weight_dtype="fp8_e4m3", routing=routing,
                         has_router=True, shared_intermediate_size=shared_intermediate_size,
                         scale_block_n=scale_block[0], scale_block_k=scale_block[1])
    config.validate()

    def quantised(shapes):
        matrices = [rng.standard_normal(shape) / np.sqrt(shape[1]) for shape in shapes]
        codes, scales = fp8.quantize_matrices(matrices, *scale_block)
        return codes, (scales * rng.uniform(0.5, 2.0, scales.shape)).astype(np.float32)
    rows = [quantised(fp8.matrix_shapes(expert_kind, hidden_size, intermediate_size)) for _ in range(num_experts)]
    H, E = hidden_size, num_experts
    tensors = dict(experts=np.stack([codes for codes, _ in rows]), expert_scales=np.stack([s for _, s in rows]),
                   router=(rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32),
                   router_bias=(0.3 * rng.standard_normal(E)).astype(np.float32) if routing == "sigmoid_bias" else None)
    if shared_intermediate_size:
        tensors["shared_expert"], tensors["shared_expert_scales"] = quantised(
            fp8.matrix_shapes("swiglu", hidden_size, shared_intermediate_size))
    return config, tensors


def random_hidden(rng, T: int, H: int, dtype: str):
    """(values in `dtype` storage (bf16: uint16 bits), the same values exactly in float64)."""
    stored = from_float(rng.standard_normal((T, H)).astype(np.float32), dtype)
    return stored, to_float64(stored, dtype)


def random_routing(rng, T: int, E: int, k: int):
    """Distinct expert ids per token (int32) and positive weights (float32)."""
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
    return ids, rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)


def relative_error(out, ref) -> float:
    """max |out - ref| / max |ref|; inf if out has a NaN or Inf (they never pass)."""
    out = np.asarray(out, np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {out.shape} != reference shape {ref.shape}")
    if not np.isfinite(out).all():
        return np.inf
    return float(np.abs(out - ref).max(initial=0.0) / max(np.abs(ref).max(initial=0.0), 1e-30))


def assert_close(out, ref, limit: float, what: str = "output") -> None:
    err = relative_error(out, ref)
    if not err <= limit:
        bad = "NaN/Inf in the output" if err == np.inf else f"relative error {err:.3g} > {limit:.3g}"
        raise AssertionError(f"{what}: {bad}")


def routed_reference(config, experts, x64, router, router_bias, library_ids, **layer_tensors):
    """The reference output for built-in routing, checking the library's choice of experts.

    Rows whose top-k is clear must select exactly the reference's ids (in order); rows with a near-tie
    may select differently, but only among experts whose score is within TIE_TOLERANCE of the k-th
    (rows whose choice of groups is a near-tie may select any experts). layer_tensors: the other
    tensors of reference.moe_forward (router_logit_bias, expert_bias, shared_expert, shared_expert_gate).
    Returns (reference output, ids used, weights used, mask of near-tie rows)."""
    logits = reference.router_logits(x64, router, layer_tensors.get("router_logit_bias"))
    scores = reference.selection_scores(config, logits, router_bias)
    ids = reference.select_topk(scores, config.top_k)
    finite = np.where(np.isfinite(scores), scores, 0.0)
    scale = np.maximum(1.0, np.abs(finite).max(axis=1))
    group_near = reference.group_margin(config, logits, router_bias) <= TIE_TOLERANCE * scale
    near = (reference.topk_margin(scores, config.top_k) <= TIE_TOLERANCE * scale) | group_near
    library_ids = np.asarray(library_ids)
    clear_mismatch = (library_ids != ids).any(axis=1) & ~near
    if clear_mismatch.any():
        row = int(np.argmax(clear_mismatch))
        raise AssertionError(f"routing row {row}: library chose {library_ids[row].tolist()}, "
                             f"reference {ids[row].tolist()} (scores {scores[row].tolist()})")
    if near.any():
        kth = -np.sort(-scores[near], axis=1)[:, config.top_k - 1]
        chosen = np.take_along_axis(scores[near], library_ids[near].astype(np.int64), axis=1)
        if (chosen < (kth - TIE_TOLERANCE * scale[near])[:, None])[~group_near[near]].any():
            raise AssertionError("at a near-tie the library chose an expert below the k-th score")
        if any(len(set(row)) != config.top_k for row in library_ids[near].tolist()):
            raise AssertionError("at a near-tie the library chose an expert twice")
        ids = np.where(near[:, None], library_ids, ids)
    weights = reference.routing_weights(config, logits, ids)
    return reference.moe_forward(config, experts, x64, ids, weights, **layer_tensors), ids, weights, near


def load_script(path, name=None):
    """A Python file that lives outside any package (a client, a load-test or benchmark script) as a
    module, loaded by its path: tests reach the code they test without putting folders on sys.path.
    Registered in sys.modules under `name` (default: the file's stem), so its siblings' imports of it
    find it."""
    import importlib.util
    import pathlib
    import sys
    path = pathlib.Path(path)
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
