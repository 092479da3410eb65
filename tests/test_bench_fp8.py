"""bench/bench_gpu.py's fp8 machinery on the CPU (torch, no GPU): the block quantiser, the layer it hands
Colibri through ctypes (packing, scale grids, the appended config and weights fields), its float64 reference,
and the glue of its baselines, checked against Colibri's CPU backend, which is exact against the dequantised
weights. The GPU rows compare with the same reference, so a fault here would show there as error, not speed."""
import ctypes
import math
from pathlib import Path

import pytest

import colibri
from colibri.testing import load_script

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
load_script(ROOT / "bench" / "gpu_report.py")  # bench_gpu imports its sibling by name
bench = load_script(ROOT / "bench" / "bench_gpu.py")


def small(name, **dims):
    """A family row of bench_gpu's FAMILY_SHAPES with its features (routing, top-k, shared expert and gate) at a
    small size."""
    return dict(bench.FAMILY_SHAPES[name], **dims)


# small layers with each feature the GPU rows have: softmax top-k renormalised with ragged scale blocks
# (H, F not multiples of 128), DeepSeek-V3's routing with groups, scaling and a shared expert, Qwen3-Next's
# top-10 beside a gated shared expert, and the top-1 row's sigmoid without bias or renormalisation
SPECS = {
    "softmax, ragged blocks": dict(E=8, k=2, H=160, F=96, routing=0, renorm=1, scale=1.0),
    "DeepSeek-V3 features": dict(E=16, k=4, H=256, F=128, routing=2, n_group=4, topk_group=2, renorm=1, scale=2.5,
                                 shared_F=128),
    "Qwen3-Next features": small("Qwen3-Next-80B-A3B", E=64, H=128, F=64, shared_F=64),
    "top-1 + shared features": small("top1+shared@Maverick", E=16, H=160, F=96, shared_F=96),
}


@pytest.fixture(scope="module")
def lib():
    path = Path(colibri.__file__).parent / "libcolibri.so"
    lib = bench.load_lib(str(path))
    if not hasattr(lib, "colibri_scales_numel"):
        pytest.skip(f"{path} predates fp8 weights (no colibri_scales_numel)")
    lib.colibri_moe_route.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@pytest.fixture
def seed(rng):
    torch.manual_seed(int(rng.integers(2**31)))  # conftest's seed: a failure replays


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("block", [(128, 128), (1, 0), (0, 0), (32, 48)])
def test_quantise_blocks_round_trip(seed, block):
    w = torch.randn(3, 200, 300) * torch.rand(3, 200, 1) * 4  # rows of different sizes, 200 and 300 ragged
    q, s = bench.quantise_blocks(w, *block)
    bn, bk = block[0] or 200, block[1] or 300
    assert q.dtype == bench.FP8 and q.shape == w.shape and s.shape == (3, -(-200 // bn), -(-300 // bk))
    full = s.repeat_interleave(bn, 1)[:, :200].repeat_interleave(bk, 2)[:, :, :300]

    def block_amax(t):  # [3, blocks down, blocks across], block by block
        return torch.stack([torch.stack([t[:, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax((1, 2))
                                         for j in range(s.shape[2])], -1) for i in range(s.shape[1])], 1)
    # scale = the block's amax / 448, so each block's largest element lands on +-448
    assert torch.equal(s, block_amax(w) / 448) and bool((block_amax(q.float()) == 448).all())
    back = bench.dequant(q, s, *block, torch.float64)
    assert torch.equal(back, q.double() * full.double())  # both ways of spreading the scales agree exactly
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 * s steps are 2^-9 * s
    assert bool(((back - w.double()).abs() <= w.double().abs() / 16 + full.double() / 2**10 + 1e-12).all())


def test_quantise_rows(seed):
    w = torch.randn(5, 64, 96)
    q, s = bench.quantise_rows(w)
    assert s.shape == (5, 64) and torch.allclose(s, w.abs().amax(-1) / 448)
    assert rel(q.float() * s[..., None], w) < 0.04


def cpu_layer(lib, spec, fp8):
    """The bench's layer, its fp8 quantisation and a CPU context of either (kept with its host buffers)."""
    L = bench.family_layer(spec, device="cpu")
    Q = bench.fp8_layer(L, spec, chunk=3)  # a chunk that does not divide E
    ctx, why, host = bench.layer_context(lib, spec, L, Q if fp8 else None, device=0)
    assert ctx is not None, why
    return L, Q, ctx, host


@pytest.mark.parametrize("name", SPECS)
def test_fp8_context_is_exact_against_the_reference(lib, seed, name):
    spec = SPECS[name]
    L, Q, ctx, host = cpu_layer(lib, spec, fp8=True)
    try:
        T, k = 12, spec["k"]
        x = torch.randn(T, spec["H"]).bfloat16()
        ref = bench.fp8_reference(x, L, spec, Q)
        # the layer's own router: the bench's family_route must pick what the library picks
        ids, w = torch.empty(T, k, dtype=torch.int32), torch.empty(T, k)
        xf = x.float()
        assert lib.colibri_moe_route(ctx, T, 0, xf.data_ptr(), ids.data_ptr(), w.data_ptr(), None) == 0
        w_ref, ids_ref = bench.family_route(x, L, spec)
        assert torch.equal(ids.long(), ids_ref) and torch.allclose(w, w_ref, rtol=1e-5, atol=1e-6)
        out = torch.full_like(xf, float("nan"))  # poisoned: every element must be written
        assert lib.colibri_moe_forward(ctx, T, 0, xf.data_ptr(), None, None, out.data_ptr(), None) == 0, \
            lib.colibri_last_error().decode()
        assert bench.rel_err(out, ref) < 1e-5  # fp32 on the CPU, exact products of values and scales
        # the eager baseline: the same function, bf16 rounding only
        assert bench.rel_err(bench.fp8_eager(x, L, spec, Q), ref) < 2e-2
    finally:
        lib.colibri_moe_context_destroy(ctx)
    del host


def wide(L):
    """L with its weights in float64 and its router and biases as drawn (fp32, the library's routing dtype): the
    bench's eager loop on it is its reference's math in float64."""
    return {key: v if key in ("router", "sel_bias", "logit_bias") else v.double() for key, v in L.items()}


def reference_of_record(spec, L, x):
    """colibri.reference's float64 layer (colibri.h's semantics, independent of the bench) of a bench layer."""
    from colibri import reference
    Fs = spec.get("shared_F", 0)
    config = colibri.LayerConfig(
        num_experts=spec["E"], top_k=spec["k"], hidden_size=spec["H"], intermediate_size=spec["F"],
        weight_dtype="fp32", routing=("softmax_topk", "topk_softmax", "sigmoid_bias")[spec["routing"]],
        renormalize=bool(spec["renorm"]), routed_scaling_factor=spec["scale"], n_group=max(1, spec.get("n_group", 1)),
        topk_group=spec.get("topk_group", 1), group_score="top2_sum", shared_intermediate_size=Fs,
        shared_gate=bool(spec.get("shared_gate")))

    def np32(*keys):
        return torch.cat([L[key].float().flatten(1 if L[key].dim() == 3 else 0) for key in keys], -1).numpy()
    return torch.from_numpy(reference.moe_forward(
        config, np32("w1", "w3", "w2"), x.double().numpy(), router=L["router"].numpy(),
        router_bias=L["sel_bias"].numpy() if "sel_bias" in L else None,
        shared_expert=np32("s1", "s3", "s2") if Fs else None,
        shared_expert_gate=L["sgate"].numpy() if "sgate" in L else None))


@pytest.mark.parametrize("name", SPECS)
def test_bf16_context_matches_its_weights(lib, seed, name):
    # layer_context's bf16 packing, shared by the family rows and the fp8 rows' bf16 forward, and the family
    # rows' eager reference (routing, top-k, shared expert and its gate) in float64, against colibri.reference
    spec = SPECS[name]
    L, _, ctx, host = cpu_layer(lib, spec, fp8=False)
    try:
        T = 9
        x = torch.randn(T, spec["H"]).bfloat16()
        ref = bench.family_eager(x.double(), wide(L), spec)
        # the bench routes in fp32 as the library does (weights within 1e-7), the reference in float64; a
        # token routed to another expert would read orders of magnitude above it
        assert bench.rel_err(ref, reference_of_record(spec, L, x)) < 1e-6
        xf, out = x.float(), torch.full((T, spec["H"]), float("nan"))
        assert lib.colibri_moe_forward(ctx, T, 0, xf.data_ptr(), None, None, out.data_ptr(), None) == 0
        assert bench.rel_err(out, ref) < 1e-5
        # the bf16 loop the GPU rows time and compare with: the same layer, bf16 rounding only
        assert bench.rel_err(bench.family_eager(x, L, spec), ref) < 2e-2
    finally:
        lib.colibri_moe_context_destroy(ctx)
    del host


def fake_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """torch._scaled_grouped_mm's 2d x 3d contract in float64: group g holds rows offs[g-1]:offs[g] of a."""
    assert a.dtype == b.dtype == bench.FP8 and b.stride(-2) == 1  # b column-major, as the GPU kernel needs
    assert scale_a.shape == a.shape[:1] and scale_b.shape == (b.shape[0], b.shape[2]) and offs.dtype == torch.int32
    out = torch.empty(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].double() * scale_a[start:end, None].double()) @ (
            b[g].double() * scale_b[g][None, :].double())
        start = end
    assert start == a.shape[0]
    return out.to(out_dtype)


@pytest.mark.parametrize("name", SPECS)
def test_scaled_grouped_baseline_computes_the_layer(seed, name, monkeypatch):
    # the sorting, offsets, shared expert as expert E and scatter of the _scaled_grouped_mm baseline, with the
    # GEMM itself replaced by its documented arithmetic (the CPU has no fp8 grouped GEMM)
    spec = SPECS[name]
    L = bench.family_layer(spec, device="cpu")
    Q = bench.fp8_layer(L, spec)
    C = bench.channel_layer(Q, chunk=5)
    assert C[0][0].shape[0] == spec["E"] + ("shared_F" in spec)
    for (qc, sc), (q, s) in zip(C, Q["experts"]):  # per-channel weights: the block-fp8 ones requantised
        back = qc.transpose(1, 2).double() * sc[..., None].double()
        assert rel(back[:spec["E"]], bench.dequant(q, s, *Q["block"], torch.float64)) < 0.04
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm, raising=False)
    x = torch.randn(10, spec["H"]).bfloat16()
    err = bench.rel_err(bench.fp8_scaled_grouped(x, L, spec, C), bench.fp8_reference(x, L, spec, Q))
    # both operands of each GEMM rounded to fp8 (about 2^-4 / sqrt(3) rms each), twice in a row: 5-8% here;
    # a token scattered to the wrong row or expert would read near 1
    assert err < 0.15 and not math.isnan(err)


def test_ceiling_work_is_the_layers_gemms(seed):
    # the per-expert ceilings (torch.matmul for bf16 rows, torch._scaled_mm for fp8) take each expert that got
    # rows with its own weights against its routed rows (fp8: rounded up to 16), and the shared expert against
    # all T rows
    spec, T = SPECS["DeepSeek-V3 features"], 7
    L = bench.family_layer(spec, device="cpu")
    counts = torch.bincount(bench.family_route(torch.randn(T, spec["H"]).bfloat16(), L, spec)[1].flatten(),
                            minlength=spec["E"]).tolist()
    experts, shared = (L["w1"], L["w3"], L["w2"]), (L["s1"], L["s3"], L["s2"])
    hit = [e for e, m in enumerate(counts) if m]
    work = bench.expert_gemms(counts, T, experts, shared)
    assert [m for m, *_ in work] == [counts[e] for e in hit] + [T] and sum(counts) == T * spec["k"]
    for (_, *mats), e in zip(work, hit):
        assert all(torch.equal(a, b[e]) for a, b in zip(mats, experts))
    assert all(a is b for a, b in zip(work[-1][1:], shared))
    assert [m for m, *_ in bench.expert_gemms(counts, T, experts, (), pad=16)] == [16] * len(hit)
