"""GPU benchmark of one MoE layer: Colibri (CUDA-graph replay) against PyTorch eager (the Hugging Face
loop over experts) and torch._grouped_mm, bf16, on Mixtral-, DeepSeek-V2-Lite- and Qwen1.5-MoE-shaped
layers, in one process. The copy bandwidth and the bf16 matmul rate are measured in the same run and
give the floor = max((bytes of the experts touched + activations) / copy BW, FLOPs / matmul rate).
Every time is the median of many CUDA-event timings of one call, with L2 flushed before each call
(the weights a call touches are then read from HBM, as in a server that runs other layers between).
The weights are drawn with seed 0, each row's tokens with seed T: a row routes the same in every run.
Beside each bf16 row, the vendor library's ceiling on the same work: torch.matmul (cuBLAS) per expert on
exactly the GEMMs the layer does (each expert's routed rows, gate and up, SwiGLU, down), one CUDA graph.
The family rows (FAMILY_SHAPES: DeepSeek-V3, gpt-oss-120b, Qwen3-Next-80B-A3B and a top-1 layer with a
shared expert at Llama 4 Maverick's shape) add each family's routing and shared expert, timed alike
against the transformers loop over experts; --shapes picks any of them by name.

    python3 bench/bench_gpu.py [--lib build/libcolibri.so] [--json bench/gpu.json] [--reps 30] [--flush zero|read]
                               [--compare old=build-old/libcolibri.so,...] [--tokens 1,4,16] [--plot gpu.png]
                               [--shapes A,B] [--fp8-shapes Qwen3-30B-A3B,...] [--plot-fp8 fp8.png]

Colibri is called through ctypes on build/libcolibri.so, so this needs no Python binding. --compare
times other builds of the library on the same inputs in the same run (old code against new), each
loaded into its own ctypes handle with its own copy of the weights; the builds' replays are timed in
turn, one of each per round, so that the GPU's clock drift over the run reaches them alike.
At the end it prints each row against DESIGN.md's target (bench/gpu_report.py, which also redraws a
saved run: `python3 bench/gpu_report.py bench/gpu.json --plot gpu.png`); --plot draws the run too.

fp8 rows (--fp8-shapes; Mixtral-8x7B, DeepSeek-V3 and Qwen3-30B-A3B shapes): the layer's experts quantised to
fp8 e4m3 with an fp32 scale per 128 x 128 block (amax / 448, DeepSeek-V3's checkpoint layout), Colibri's fp8
forward timed in turn with its bf16 forward of the original layer on the same tokens, against
torch._scaled_grouped_mm (rowwise fp8: activations per token, weights requantised per output channel) and
the eager loop that dequantises each expert's weights to bf16 on every call. The fp8 floor is
max((fp8 bytes of the touched experts + their scales + activations) / copy rate, FLOPs / fp8 matmul rate),
that rate from torch._scaled_mm on an 8192^3 GEMM in the same run. Errors are against the float64 layer of
the dequantised weights and against Colibri's bf16 output. Beside each row, its practical ceilings: a plain
read of the same scattered fp8 bytes (memory-bound rows) and torch._scaled_mm on the same GEMMs, per expert
with its own weights (compute-bound rows). A library that refuses fp8 (CUDA before its fp8 kernels) or a
torch without the baseline leaves the reason in the row. --plot-fp8 draws them.
"""
import argparse
import ctypes
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as Fn

import gpu_report  # bench/, beside this script

SHAPES = [  # name, E, k, H, F, renormalize
    ("Mixtral-8x7B", 8, 2, 4096, 14336, 1),
    ("DeepSeek-V2-Lite", 64, 6, 2048, 1408, 0),
    ("Qwen1.5-MoE", 60, 4, 2048, 1408, 0),
]
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
# The model families' layers: each row's features beyond softmax top-k (colibri.h), timed like the rows
# above. DeepSeek-V3: sigmoid scores with a selection bias, 8 groups of which 4 kept by their top-2 sums,
# renormalised x 2.5, one shared expert. gpt-oss-120b: a router logit bias, top-k then softmax, expert
# biases and the clamped SwiGLU. Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults are its values:
# 512 experts, top-10, hidden 2048, moe_intermediate 512, shared expert 512, norm_topk_prob true): Qwen2-MoE's
# block, softmax top-k renormalised beside a shared expert scaled by sigmoid(shared_expert_gate . x).
# top1+shared@Maverick: Llama 4 Maverick's MoE layer shape (128 experts, top-1, hidden 5120, experts and
# shared expert 8192 wide; Llama4TextConfig's defaults are Scout's 16 experts) computing Flint's block with
# norm_topk_prob false: the expert of the highest logit, its output times sigmoid(logit), and an ungated
# shared expert. Llama 4 multiplies the expert's input by that sigmoid, which Colibri refuses
# (pack/refused.py); the GEMMs and the bytes read are the same.
FAMILY_SHAPES = {
    "DeepSeek-V3": dict(E=256, k=8, H=7168, F=2048, routing=2, n_group=8, topk_group=4, renorm=1, scale=2.5,
                        shared_F=2048),
    "gpt-oss-120b": dict(E=128, k=4, H=2880, F=2880, routing=1, renorm=0, scale=1.0, logit_bias=True,
                         expert_bias=True, alpha=1.702, limit=7.0),
    "Qwen3-Next-80B-A3B": dict(E=512, k=10, H=2048, F=512, routing=0, renorm=1, scale=1.0, shared_F=512,
                               shared_gate=True),
    "top1+shared@Maverick": dict(E=128, k=1, H=5120, F=8192, routing=2, sel_bias=False, renorm=0, scale=1.0,
                                 shared_F=8192),
}
NAME_W = max(len(name) for name in [s[0] for s in SHAPES] + list(FAMILY_SHAPES))  # the tables' first column


class Config(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "expert_kind", "weight_dtype", "num_experts", "top_k", "hidden_size", "intermediate_size", "routing",
        "renormalize")] + [("routed_scaling_factor", ctypes.c_float)] + [
        (name, ctypes.c_int32) for name in ("workspace_tokens", "device", "device_id", "num_threads")] + [
        ("routing_fn", ctypes.c_void_p), ("routing_user_data", ctypes.c_void_p)] + [
        # colibri.h's appended fields, left zero (a library older than them reads only its own prefix)
        (name, ctypes.c_int32) for name in ("n_group", "topk_group", "group_score", "activation")] + [
        ("activation_alpha", ctypes.c_float), ("activation_limit", ctypes.c_float)] + [
        (name, ctypes.c_int32) for name in ("expert_bias", "shared_intermediate_size", "shared_gate", "scale_block_n",
                                            "scale_block_k")]


class Weights(ctypes.Structure):
    _fields_ = [("expert_weights", ctypes.c_void_p), ("expert_offsets", ctypes.POINTER(ctypes.c_uint64)),
                ("expert_weights_numel", ctypes.c_uint64)] + [
        (name, ctypes.c_void_p) for name in ("expert_bias", "router_weight", "router_logit_bias", "router_bias",
                                             "shared_weights", "shared_gate_weight", "expert_scales", "shared_scales")]


def load_lib(path):
    lib = ctypes.CDLL(path)
    if hasattr(lib, "colibri_moe_context_create"):
        lib.colibri_moe_context_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(Config),
                                                   ctypes.POINTER(Weights)]
    lib.colibri_moe_context_init.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(Config), ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64, ctypes.c_void_p,
                                             ctypes.c_void_p]
    lib.colibri_moe_forward.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.colibri_moe_context_destroy.argtypes = [ctypes.c_void_p]
    lib.colibri_moe_context_take_device_error.argtypes = [ctypes.c_void_p]
    lib.colibri_last_error.restype = ctypes.c_char_p
    return lib


def check(lib, status, what):
    if status != 0:
        raise RuntimeError(f"{what}: status {status}: {lib.colibri_last_error().decode()}")


def graph_of(fn):
    """A CUDA graph of fn(), captured after a plain call (which does the first-call work) and replayed once."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def capture(lib, ctx, T, x, out, ids=None, weights=None):
    """A CUDA graph of one bf16 forward of x [T, H] into out (the routing given by ids [T, k] int32 and
    weights [T, k] fp32, else the layer's router); device errors raise."""
    def call():
        check(lib, lib.colibri_moe_forward(ctx, T, 2, x.data_ptr(), None if ids is None else ids.data_ptr(),
                                           None if weights is None else weights.data_ptr(), out.data_ptr(),
                                           torch.cuda.current_stream().cuda_stream), "forward")

    graph = graph_of(call)
    check(lib, lib.colibri_moe_context_take_device_error(ctx), "device error")
    return graph


class Timer:
    """Median of `reps` CUDA-event timings of fn(), each after an L2 flush: `zero` writes 512 MB (L2 is
    left full of dirty lines, which the timed call's reads then write back to HBM beside its own
    reads), `read` reads 512 MB (L2 left clean, as after layers that mostly read)."""

    def __init__(self, reps, flush="zero"):
        self.reps = reps
        self.flush = torch.ones(512 << 20, dtype=torch.uint8, device="cuda")
        self.flush_mode = flush

    def evict(self):
        if self.flush_mode == "read":
            torch.amax(self.flush.view(torch.int32))
        else:
            self.flush.zero_()

    def __call__(self, fn, warmup=3):
        return self.interleaved([fn], warmup)[0]

    def interleaved(self, fns, warmup=3):
        """Medians of several functions timed in turn, one call of each per round: a drift of the clocks
        during the run (these GEMMs are power-limited, and the GPU slows as it warms) then reaches all of
        them alike instead of favouring whichever ran first."""
        for _ in range(warmup):
            for fn in fns:
                fn()
        times = [[] for _ in fns]
        for _ in range(self.reps):
            for fn, ts in zip(fns, times):
                self.evict()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
        return [statistics.median(ts) for ts in times]


def ceilings(timer):
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = timer(lambda: a @ b)
    return copy_bw, 2 * n ** 3 / (mm_ms * 1e-3)


def expert_gemms(counts, T, experts, shared=(), pad=1):
    """The work of a per-expert ceiling: (rows, gate, up, down) of every expert that got rows (counts[e] of
    them; experts: the gate, up and down stacks [E, N, K]), then of the shared expert (its three matrices,
    none for no shared expert) against all T rows, rows rounded up to a multiple of pad."""
    def up_to(m):
        return -(-m // pad) * pad
    gate, up, down = experts
    work = [(up_to(m), gate[e], up[e], down[e]) for e, m in enumerate(counts) if m]
    return work + [(up_to(T), *shared)] if shared else work


def time_ceiling(timer, what, build):
    """The median replay of one CUDA graph of build()'s function (build makes its inputs), timed as the rows
    are; nan and the reason where this torch or card cannot run it."""
    try:
        graph = graph_of(build())
        return timer(graph.replay), "ok"
    except (AttributeError, RuntimeError, ValueError, NotImplementedError) as err:
        return float("nan"), f"{what} ceiling failed: {str(err).splitlines()[0][:200]}"


def matmul_ceiling(timer, experts, shared, counts, T):
    """What the vendor library does on a bf16 row's GEMMs: torch.matmul (cuBLAS) per expert with its own
    weights, gate and up against its routed rows, silu(gate) * up, down against that (the shared expert
    against all T rows), in one CUDA graph; no routing, biases, shared gate or combine. experts: the bf16
    gate, up and down stacks [E, F, H], [E, F, H], [E, H, F]; shared: the shared expert's three or ()."""
    def build():
        work = expert_gemms(counts, T, experts, shared)
        H = experts[0].shape[2]
        acts = {m: torch.randn(m, H, device="cuda", dtype=torch.bfloat16) for m in {m for m, *_ in work}}

        def gemms():
            for m, gate, up, down in work:
                swiglu(acts[m], gate, up, down)
        return gemms
    return time_ceiling(timer, "torch.matmul", build)


def print_row(row, extra=""):
    """One bf16 row as the live table prints it (main prints the header)."""
    print(f"{row['shape']:{NAME_W}s} {row['T']:5d} {row['colibri_ms']:8.3f} {row['eager_ms']:8.3f} "
          f"{row['grouped_ms']:8.3f} {row['matmul_ceiling_ms']:8.3f} {row['speedup_vs_eager']:7.2f} "
          f"{row['speedup_vs_grouped']:7.2f} {row['fraction_of_matmul_ceiling']:8.2f} {row['floor_ms']:8.3f} "
          f"{row['fraction_of_floor']:6.2f} {row['rel_err_vs_eager']:8.1e}"
          + ("" if row["matmul_ceiling_status"] == "ok" else f"   {row['matmul_ceiling_status']}") + extra, flush=True)


def route(x, router, k, renormalize):
    probs = torch.softmax(x.float() @ router.T, dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def hf_eager(x, router, w1, w3, w2, k, renormalize):
    """The Hugging Face Mixtral/Qwen2-MoE loop: one matmul chain per expert that got tokens."""
    w, ids = route(x, router, k, renormalize)
    out = torch.zeros_like(x)
    mask = Fn.one_hot(ids, num_classes=w1.shape[0]).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit.flatten().tolist():
        slot, tok = torch.where(mask[e])
        xs = x[tok]
        h = Fn.silu(xs @ w1[e].T) * (xs @ w3[e].T)
        out.index_add_(0, tok, (h @ w2[e].T) * w[tok, slot, None].to(x.dtype))
    return out


def grouped(x, router, w1t, w3t, w2t, k, renormalize):
    """Tokens sorted by expert, three torch._grouped_mm calls, weighted scatter-add back."""
    w, ids = route(x, router, k, renormalize)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1t.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = Fn.silu(torch._grouped_mm(xs, w1t, offs=offs)) * torch._grouped_mm(xs, w3t, offs=offs)
    y = torch._grouped_mm(h, w2t, offs=offs) * w.flatten()[order, None].to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, order // k, y)
    return out


def random_layer(E, H, F):
    """The bench's bf16 experts w1, w3 [E, F, H], w2 [E, H, F] and fp32 router [E, H], seed 0, on the GPU."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    w1 = (torch.randn(E, F, H, device="cuda") / H ** 0.5).to(dt)
    w3 = (torch.randn(E, F, H, device="cuda") / H ** 0.5).to(dt)
    w2 = (torch.randn(E, H, F, device="cuda") / F ** 0.5).to(dt)
    return w1, w3, w2, torch.randn(E, H, device="cuda") / H ** 0.5


def row_tokens(T, H):
    """The bf16 tokens [T, H] of a row, drawn with seed T: a row's tokens, and so its rows per expert, depend on
    its shape and T alone (before v25 they came from the random stream after the run's earlier rows, and the
    same T drew differently in runs of different --tokens). bench/ncu_forward.py profiles the same."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(T)
    return torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)


def bench_shape(lib, others, timer, name, E, k, H, F, renorm, copy_bw, mm_rate, rows, tokens=TOKENS):
    w1, w3, w2, router = random_layer(E, H, F)
    packed = torch.cat([w1.reshape(E, -1), w3.reshape(E, -1), w2.reshape(E, -1)], dim=1).cpu()
    per_expert = 3 * H * F
    offsets = (ctypes.c_uint64 * E)(*[e * per_expert for e in range(E)])
    router_host = router.cpu().contiguous()
    cfg = Config(expert_kind=0, weight_dtype=2, num_experts=E, top_k=k, hidden_size=H, intermediate_size=F,
                 routing=0, renormalize=renorm, routed_scaling_factor=1.0, workspace_tokens=0, device=1, device_id=0,
                 num_threads=0, routing_fn=None, routing_user_data=None)
    ctxs = {}
    for label, l in [("", lib)] + others:
        ctxs[label] = ctypes.c_void_p()
        check(l, l.colibri_moe_context_init(ctypes.byref(ctxs[label]), ctypes.byref(cfg), packed.data_ptr(), offsets,
                                            packed.numel(), router_host.data_ptr(), None), f"init {label}")
    del packed
    w1t, w3t, w2t = w1.transpose(1, 2), w3.transpose(1, 2), w2.transpose(1, 2)
    expert_bytes = per_expert * 2
    try:
        for T in tokens:
            x = row_tokens(T, H)
            out = torch.empty_like(x)

            ref = hf_eager(x, router, w1, w3, w2, k, renorm)
            graphs, errs, outs = {}, {}, {}
            for label, l in others + [("", lib)]:  # every build's graph, each checked right after its capture
                graphs[label] = capture(l, ctxs[label], T, x, out)
                errs[label] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if others:
                    outs[label] = out.clone()
            labels = [""] + [label for label, _ in others]
            times = dict(zip(labels, timer.interleaved([graphs[label].replay for label in labels])))
            # same_bits: whether that build's output is bit for bit this build's (a change that should not
            # alter the arithmetic, such as an order of work, shows it here)
            compare = {label: dict(colibri_ms=times[label], rel_err_vs_eager=errs[label],
                                   same_bits=bool(torch.equal(outs[label], outs[""]))) for label, _ in others}
            rel_err, t_col = errs[""], times[""]
            t_eager = timer(lambda: hf_eager(x, router, w1, w3, w2, k, renorm))
            try:
                t_grouped = timer(lambda: grouped(x, router, w1t, w3t, w2t, k, renorm))
            except RuntimeError as err:
                print(f"  torch._grouped_mm failed: {err}", file=sys.stderr)
                t_grouped = float("nan")
            # rows per expert of this draw (by the reference router): what the tile counts depend on
            counts = torch.bincount(route(x, router, k, renorm)[1].flatten(), minlength=E)
            touched = int((counts > 0).sum())
            t_mm, mm_status = matmul_ceiling(timer, (w1, w3, w2), (), counts.tolist(), T)
            nbytes = touched * expert_bytes + 2 * T * H * 2
            flops = 2 * T * k * 3 * H * F
            floor_ms = max(nbytes / copy_bw, flops / mm_rate) * 1e3
            row = dict(shape=name, E=E, k=k, H=H, F=F, T=T, colibri_ms=t_col, eager_ms=t_eager, grouped_ms=t_grouped,
                       floor_ms=floor_ms, fraction_of_floor=floor_ms / t_col, speedup_vs_eager=t_eager / t_col,
                       speedup_vs_grouped=t_grouped / t_col, experts_touched=touched, rel_err_vs_eager=rel_err,
                       rows_per_expert=counts.tolist(), matmul_ceiling_ms=t_mm,
                       fraction_of_matmul_ceiling=t_mm / t_col, matmul_ceiling_status=mm_status)
            for c in compare.values():
                c["fraction_of_floor"] = floor_ms / c["colibri_ms"]
            if compare:
                row["compare"] = compare
            rows.append(row)
            print_row(row, "".join(f"   {lb} {c['colibri_ms']:.3f} ms, frac {c['fraction_of_floor']:.2f}, this build "
                                   f"x{c['colibri_ms'] / t_col:.2f}{'' if c['same_bits'] else ', other bits'}"
                                   for lb, c in compare.items()))
            del graphs, outs
    finally:
        for label, l in [("", lib)] + others:
            if label in ctxs:
                l.colibri_moe_context_destroy(ctxs[label])


def family_layer(spec, device="cuda"):
    """A family row's bf16 experts and shared expert, fp32 router and biases, seed 0, on the GPU (drawn in
    bf16 and scaled in place: DeepSeek-V3's experts are 22.5 GB)."""
    torch.manual_seed(0)
    E, H, F, dt = spec["E"], spec["H"], spec["F"], torch.bfloat16

    def draw(*shape, fan_in):
        return torch.randn(*shape, device=device, dtype=dt).mul_(fan_in ** -0.5)
    L = dict(w1=draw(E, F, H, fan_in=H), w3=draw(E, F, H, fan_in=H), w2=draw(E, H, F, fan_in=F),
             router=torch.randn(E, H, device=device) / H ** 0.5)
    if spec["routing"] == 2:  # zeros where the family has no selection bias (the library takes one)
        L["sel_bias"] = 0.1 * torch.randn(E, device=device) if spec.get("sel_bias", True) else \
            torch.zeros(E, device=device)
    if spec.get("logit_bias"):
        L["logit_bias"] = 0.5 * torch.randn(E, device=device)
    if spec.get("expert_bias"):  # bf16 as the checkpoint ships them; colibri takes them as fp32
        for key, n in (("b1", F), ("b3", F), ("b2", H)):
            L[key] = (0.1 * torch.randn(E, n, device=device)).to(dt)
    if spec.get("shared_F"):
        Fs = spec["shared_F"]
        L["s1"], L["s3"], L["s2"] = draw(Fs, H, fan_in=H), draw(Fs, H, fan_in=H), draw(H, Fs, fan_in=Fs)
    if spec.get("shared_gate"):  # drawn last: the other rows' weights stay those of before
        L["sgate"] = torch.randn(H, device=device) / H ** 0.5
    return L


def family_route(x, L, spec):
    """The family's routing in torch, as its transformers block computes it: (weights [T, k], ids [T, k])."""
    E, k = spec["E"], spec["k"]
    logits = x.float() @ L["router"].T
    if "logit_bias" in L:
        logits = logits + L["logit_bias"]
    if spec["routing"] == 1:  # gpt-oss: top-k of the logits, softmax over them
        top, ids = torch.topk(logits, k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    if spec["routing"] == 0:  # Mixtral, Qwen: softmax, top-k of it, renormalised where the model does
        w, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        return (w / w.sum(-1, keepdim=True) if spec["renorm"] else w) * spec["scale"], ids
    scores = logits.sigmoid()
    choice = scores + L["sel_bias"]
    G = spec.get("n_group", 0)
    if G > 1:  # DeepSeek-V3's groups, ranked by their top-2 sums
        group = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group).scatter_(1, torch.topk(group, spec["topk_group"], dim=-1)[1], 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1)[1]
    w = scores.gather(1, ids)
    if spec["renorm"]:
        w = w / w.sum(-1, keepdim=True)
    return w * spec["scale"], ids


def family_act(g, u, spec):
    if "alpha" in spec:  # gpt-oss's clamped SwiGLU
        g, u = g.clamp(max=spec["limit"]), u.clamp(-spec["limit"], spec["limit"])
        return (u + 1) * g * torch.sigmoid(g * spec["alpha"])
    return Fn.silu(g) * u


def shared_weight(x, L):
    """sigmoid(shared_gate . x) per token [T] in x's dtype (Qwen2-MoE's gate), computed in the wider of x's and
    the gate's dtypes (fp32 for bf16 tokens, float64 in the reference)."""
    dtype = torch.promote_types(x.dtype, L["sgate"].dtype)
    return torch.sigmoid(x.to(dtype) @ L["sgate"].to(dtype)).to(x.dtype)


def gate_shared(shared, L):
    """shared(xs) scaled by the layer's shared gate per token, where it has one; else shared itself."""
    if shared is None or "sgate" not in L:
        return shared
    return lambda xs: shared(xs) * shared_weight(xs, L)[:, None]


def family_shared(x, L):
    return gate_shared(lambda xs: swiglu(xs, L["s1"], L["s3"], L["s2"]), L)(x) if "s1" in L else 0


def family_eager(x, L, spec):
    """The transformers loop over experts, with the family's routing, biases, activation and shared expert."""
    w, ids = family_route(x, L, spec)
    out = torch.zeros_like(x)
    mask = Fn.one_hot(ids, num_classes=spec["E"]).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        xs = x[tok]
        g, u = xs @ L["w1"][e].T, xs @ L["w3"][e].T
        if "b1" in L:
            g, u = g + L["b1"][e], u + L["b3"][e]
        y = family_act(g, u, spec) @ L["w2"][e].T
        if "b2" in L:
            y = y + L["b2"][e]
        out.index_add_(0, tok, y * w[tok, slot, None].to(x.dtype))
    return out + family_shared(x, L)


def family_grouped(x, L, spec, w1t, w3t, w2t):
    """Tokens sorted by expert, torch._grouped_mm per projection, biases gathered by each row's expert."""
    k = spec["k"]
    w, ids = family_route(x, L, spec)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=spec["E"]), 0).to(torch.int32)
    xs, expert = x[order // k], flat[order]
    g, u = torch._grouped_mm(xs, w1t, offs=offs), torch._grouped_mm(xs, w3t, offs=offs)
    if "b1" in L:
        g, u = g + L["b1"][expert], u + L["b3"][expert]
    y = torch._grouped_mm(family_act(g, u, spec), w2t, offs=offs)
    if "b2" in L:
        y = y + L["b2"][expert]
    out = torch.zeros_like(x)
    out.index_add_(0, order // k, y * w.flatten()[order, None].to(x.dtype))
    return out + family_shared(x, L)


def layer_context(lib, spec, L, Q=None, device=1):
    """Colibri's context of a family layer (family_layer's L): its bf16 experts, or with Q (fp8_layer) the fp8
    experts and their scale grids. Returns (ctx, None, host) or (None, the library's message, host); host holds
    the packed weights, which a CPU context (device=0) borrows: keep it as long as the context."""
    E, k, H, F, Fs = spec["E"], spec["k"], spec["H"], spec["F"], spec.get("shared_F", 0)
    if Q is None:
        mats, shared = [L["w1"], L["w3"], L["w2"]], [L[key] for key in ("s1", "s3", "s2") if Fs]
    else:
        mats, shared = [q for q, _ in Q["experts"]], [q for q, _ in Q["shared"] or []]

    def raw(t):  # fp8 travels as its bytes (ctypes sees only the pointer)
        return t if Q is None else t.view(torch.uint8)
    packed = torch.empty(E, 3 * H * F, dtype=torch.bfloat16 if Q is None else torch.uint8)  # host, an expert at a time
    for e in range(E):
        packed[e] = torch.cat([raw(m[e]).flatten() for m in mats]).cpu()
    offsets = (ctypes.c_uint64 * E)(*[e * 3 * H * F for e in range(E)])
    host = {key: L[key].float().cpu().contiguous() for key in ("router", "sel_bias", "logit_bias", "sgate")
            if key in L}
    host["experts"] = packed
    if "b1" in L:
        host["bias"] = torch.cat([L["b1"], L["b3"], L["b2"]], dim=1).float().cpu().contiguous()
    if Fs:
        host["shared"] = torch.cat([raw(m).flatten() for m in shared]).cpu()
    if Q is not None:  # each expert's grids back to back, gate, up, down, as colibri.h lays them
        host["scales"] = torch.cat([s.flatten(1) for _, s in Q["experts"]], dim=1).float().cpu().contiguous()
        if Fs:
            host["shared_scales"] = torch.cat([s.flatten() for _, s in Q["shared"]]).float().cpu().contiguous()
    bn, bk = Q["block"] if Q is not None else (0, 0)
    cfg = Config(expert_kind=0, weight_dtype=2 if Q is None else 3, num_experts=E, top_k=k, hidden_size=H,
                 intermediate_size=F, routing=spec["routing"], renormalize=spec["renorm"],
                 routed_scaling_factor=spec["scale"], device=device, n_group=spec.get("n_group", 0),
                 topk_group=spec.get("topk_group", 0), group_score=1, activation=1 if "alpha" in spec else 0,
                 activation_alpha=spec.get("alpha", 0.0), activation_limit=spec.get("limit", 0.0),
                 expert_bias=int("bias" in host), shared_intermediate_size=Fs, shared_gate=int("sgate" in host),
                 scale_block_n=bn, scale_block_k=bk)
    ptr = lambda key: host[key].data_ptr() if key in host else None  # noqa: E731
    weights = Weights(packed.data_ptr(), offsets, packed.numel(), ptr("bias"), ptr("router"), ptr("logit_bias"),
                      ptr("sel_bias"), ptr("shared"), ptr("sgate"), ptr("scales"), ptr("shared_scales"))
    ctx = ctypes.c_void_p()
    if lib.colibri_moe_context_create(ctypes.byref(ctx), ctypes.byref(cfg), ctypes.byref(weights)) != 0:
        return None, lib.colibri_last_error().decode(), host
    return ctx, None, host


def bench_family(lib, timer, name, copy_bw, mm_rate, rows, tokens=TOKENS):
    """One family row per T (this build only: builds before colibri_moe_context_create cannot run them)."""
    spec = FAMILY_SHAPES[name]
    E, k, H, F, Fs = spec["E"], spec["k"], spec["H"], spec["F"], spec.get("shared_F", 0)
    if not hasattr(lib, "colibri_moe_context_create"):
        print(f"{name}: skipped (this library has no colibri_moe_context_create)")
        return
    L = family_layer(spec)
    torch.cuda.empty_cache()  # torch's cached blocks would leave the library's copy (32 GB at Maverick's) no room
    ctx, why = layer_context(lib, spec, L)[:2]  # the host copy goes here: the CUDA context has its own
    if ctx is None:
        print(f"{name}: skipped ({why})")
        return
    w1t, w3t, w2t = L["w1"].transpose(1, 2), L["w3"].transpose(1, 2), L["w2"].transpose(1, 2)
    expert_bytes, gated = 3 * H * F * 2, int("sgate" in L)
    try:
        for T in tokens:
            x = row_tokens(T, H)
            out = torch.empty_like(x)
            ref = family_eager(x, L, spec)
            graph = capture(lib, ctx, T, x, out)
            rel_err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t_col = timer(graph.replay)
            t_eager = timer(lambda: family_eager(x, L, spec))
            try:
                t_grouped = timer(lambda: family_grouped(x, L, spec, w1t, w3t, w2t))
            except RuntimeError as err:
                print(f"  torch._grouped_mm failed: {err}", file=sys.stderr)
                t_grouped = float("nan")
            counts = torch.bincount(family_route(x, L, spec)[1].flatten(), minlength=E)
            touched = int((counts > 0).sum())
            shared = tuple(L[key] for key in ("s1", "s3", "s2") if key in L)
            t_mm, mm_status = matmul_ceiling(timer, (L["w1"], L["w3"], L["w2"]), shared, counts.tolist(), T)
            # the floor as the fine-grained rows take it, plus the shared expert (and its gate: H fp32, a dot a token)
            nbytes = touched * expert_bytes + 3 * H * Fs * 2 + 4 * H * gated + 2 * T * H * 2
            flops = 2 * T * (k * 3 * H * F + 3 * H * Fs + H * gated)
            floor_ms = max(nbytes / copy_bw, flops / mm_rate) * 1e3
            row = dict(shape=name, E=E, k=k, H=H, F=F, T=T, shared_F=Fs, shared_gate=bool(gated), colibri_ms=t_col,
                       eager_ms=t_eager, grouped_ms=t_grouped, floor_ms=floor_ms, fraction_of_floor=floor_ms / t_col,
                       speedup_vs_eager=t_eager / t_col, speedup_vs_grouped=t_grouped / t_col,
                       experts_touched=touched, rel_err_vs_eager=rel_err, rows_per_expert=counts.tolist(),
                       matmul_ceiling_ms=t_mm, fraction_of_matmul_ceiling=t_mm / t_col, matmul_ceiling_status=mm_status)
            rows.append(row)
            print_row(row)
    finally:
        lib.colibri_moe_context_destroy(ctx)


# fp8 experts (issue 45): each layer quantised to fp8 e4m3 with an fp32 scale per 128 x 128 block, as
# DeepSeek-V3, Qwen3-*-FP8 and GLM-4.5-FP8 ship their experts, timed beside Colibri's bf16 forward of the same
# layer and tokens. Mixtral and Qwen3-30B-A3B: softmax top-k renormalised; DeepSeek-V3 as FAMILY_SHAPES has it.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
FP8_BLOCK = (128, 128)  # quantization_config.weight_block_size of those checkpoints
FP8_SHAPES = {
    "Mixtral-8x7B": dict(E=8, k=2, H=4096, F=14336, routing=0, renorm=1, scale=1.0),
    "DeepSeek-V3": FAMILY_SHAPES["DeepSeek-V3"],
    "Qwen3-30B-A3B": dict(E=128, k=8, H=2048, F=768, routing=0, renorm=1, scale=1.0),
}


def quantise_blocks(w, bn, bk):
    """w [..., N, K] as fp8 e4m3 values q and fp32 scales s [..., ceil(N / bn), ceil(K / bk)] (0: the whole
    dimension), w ~ q * s blockwise, s = the block's amax / 448 (a block of zeros gets scale 0)."""
    N, K = w.shape[-2:]
    bn, bk = bn or N, bk or K
    nb, kb = -(-N // bn), -(-K // bk)
    blocks = Fn.pad(w.float(), (0, kb * bk - K, 0, nb * bn - N)).unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))
    s = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX
    # clamped: amax / (amax / 448) can round a hair above 448, which the cast would turn into NaN
    q = (blocks / torch.where(s > 0, s, 1)[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-4, -3).flatten(-2, -1)[..., :N, :K].contiguous(), s


def quantise_rows(w):
    """w [..., N, K] as fp8 with one fp32 scale per row (s [..., N]): torch._scaled_grouped_mm's rowwise
    scaling, for its activations (per token) and weights (per output channel)."""
    s = w.float().abs().amax(dim=-1) / FP8_MAX
    return (w.float() / torch.where(s > 0, s, 1)[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), s


def dequant(q, s, bn, bk, dtype):
    """q [..., N, K] fp8 times its block scales s, computed in dtype (float64: exact)."""
    N, K = q.shape[-2:]
    bn, bk = bn or N, bk or K
    if N % bn or K % bk:  # ragged edge blocks: a full-size scale map
        full = s.to(dtype).repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
        return q.to(dtype) * full
    blocks = q.to(dtype).unflatten(-1, (K // bk, bk)).unflatten(-3, (N // bn, bn))
    return (blocks * s.to(dtype)[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1)


def fp8_layer(L, spec, block=FP8_BLOCK, chunk=8):
    """L's experts and shared expert as fp8 with block scales: {"block", "experts": [(q, s) of gate, up, down],
    "shared": the same or None}; quantised `chunk` experts at a time (DeepSeek-V3's are 22.5 GB in bf16)."""
    bn, bk = block
    Q = dict(block=block, experts=[], shared=None)
    for key in ("w1", "w3", "w2"):
        w = L[key]
        E, N, K = w.shape
        q = torch.empty(E, N, K, dtype=FP8, device=w.device)
        s = torch.empty(E, -(-N // bn), -(-K // bk), device=w.device)
        for i in range(0, E, chunk):
            q[i:i + chunk], s[i:i + chunk] = quantise_blocks(w[i:i + chunk], bn, bk)
        Q["experts"].append((q, s))
    if "s1" in L:
        Q["shared"] = [quantise_blocks(L[key], bn, bk) for key in ("s1", "s3", "s2")]
    return Q


def channel_layer(Q, chunk=8):
    """The block-fp8 layer requantised per output channel for torch._scaled_grouped_mm (rowwise scales are what
    its fp8 path takes): [(q [E', K, N] column-major, s [E', N])] of gate, up, down, the shared expert appended
    as expert E where it has one (it must then be as wide as the routed experts)."""
    bn, bk = Q["block"]
    out = []
    for j, (q, s) in enumerate(Q["experts"]):
        mats = [(q, s)]
        if Q["shared"]:
            mats.append((Q["shared"][j][0][None], Q["shared"][j][1][None]))
        if any(m.shape[1:] != q.shape[1:] for m, _ in mats):
            raise ValueError("a shared expert of another width than the routed experts")
        E = sum(m.shape[0] for m, _ in mats)
        qc = torch.empty(E, *q.shape[1:], dtype=FP8, device=q.device)
        sc = torch.empty(E, q.shape[1], device=q.device)
        at = 0
        for m, ms in mats:
            for i in range(0, m.shape[0], chunk):
                n = min(chunk, m.shape[0] - i)
                qc[at:at + n], sc[at:at + n] = quantise_rows(dequant(m[i:i + n], ms[i:i + n], bn, bk, torch.float32))
                at += n
        out.append((qc.transpose(1, 2), sc))
    return out


def expert_loop(x, w, ids, E, expert, shared=None):
    """sum_j w[t, j] expert(ids[t, j], x[t]) (+ shared(x)) in x's dtype, one call per expert that got tokens."""
    out = torch.zeros_like(x)
    mask = Fn.one_hot(ids, num_classes=E).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        out.index_add_(0, tok, expert(e, x[tok]) * w[tok, slot, None].to(x.dtype))
    return out + shared(x) if shared else out


def swiglu(x, gate, up, down):
    return (Fn.silu(x @ gate.T) * (x @ up.T)) @ down.T


def fp8_experts(Q, dtype, out_dtype):
    """(expert(e, xs), shared(xs) or None) of the fp8 layer, each call dequantising the weights it uses in
    dtype and rounding them to out_dtype."""
    bn, bk = Q["block"]

    def deq(q, s):
        return dequant(q, s, bn, bk, dtype).to(out_dtype)

    def expert(e, xs):
        return swiglu(xs, *(deq(q[e], s[e]) for q, s in Q["experts"]))
    shared = (lambda xs: swiglu(xs, *(deq(q, s) for q, s in Q["shared"]))) if Q["shared"] else None
    return expert, shared


def fp8_reference(x, L, spec, Q):
    """The fp8 layer in float64 on the dequantised weights (exact products of the stored values and scales),
    routed by family_route: the reference of record."""
    w, ids = family_route(x, L, spec)
    expert, shared = fp8_experts(Q, torch.float64, torch.float64)
    return expert_loop(x.double(), w.double(), ids, spec["E"], expert, gate_shared(shared, L))


def fp8_eager(x, L, spec, Q):
    """The transformers-style loop over experts, each hit expert's fp8 weights dequantised to bf16 on every call."""
    w, ids = family_route(x, L, spec)
    expert, shared = fp8_experts(Q, torch.float32, x.dtype)
    return expert_loop(x, w, ids, spec["E"], expert, gate_shared(shared, L))


def fp8_scaled_grouped(x, L, spec, C):
    """Tokens sorted by expert (the shared expert as expert E, every token at weight 1 or its shared gate's
    sigmoid), activations quantised per row, three torch._scaled_grouped_mm calls on channel_layer's weights,
    weighted scatter-add back."""
    (g1, s1), (g3, s3), (g2, s2) = C
    T, k = x.shape[0], spec["k"]
    w, ids = family_route(x, L, spec)
    flat, wflat, tok = ids.flatten(), w.flatten(), torch.arange(T * k, device=x.device) // k
    if g1.shape[0] > spec["E"]:
        flat = torch.cat([flat, torch.full((T,), spec["E"], device=x.device, dtype=flat.dtype)])
        gate = shared_weight(x, L) if "sgate" in L else torch.ones(T, device=x.device)
        wflat = torch.cat([wflat, gate.to(wflat.dtype)])
        tok = torch.cat([tok, torch.arange(T, device=x.device)])
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=g1.shape[0]), 0).to(torch.int32)
    tok = tok[order]
    xq, xs = quantise_rows(x[tok])

    def mm(a, sa, b, sb):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
    h = Fn.silu(mm(xq, xs, g1, s1)) * mm(xq, xs, g3, s3)
    y = mm(*quantise_rows(h), g2, s2)
    out = torch.zeros_like(x)
    out.index_add_(0, tok, y * wflat[order, None].to(x.dtype))
    return out


def fp8_matmul_rate(timer, n=8192):
    """torch._scaled_mm on an n x n x n fp8 GEMM (per-tensor scales, fast accumulation: the card's best fp8
    rate), random data; nan with the reason where this torch or card has none."""
    try:
        a = torch.randn(n, n, device="cuda").to(FP8)
        b = torch.randn(n, n, device="cuda").to(FP8)
        one = torch.ones((), device="cuda")
        ms = timer(lambda: torch._scaled_mm(a, b.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                            use_fast_accum=True))
        return 2 * n ** 3 / (ms * 1e-3), "ok"
    except (AttributeError, RuntimeError, ValueError, NotImplementedError) as err:  # TORCH_CHECK_VALUE: ValueError
        return float("nan"), f"torch._scaled_mm failed: {err}"


def read_ceiling(timer, Q, counts):
    """The practical ceiling of a memory-bound row: one plain read (torch._foreach_norm, a few kernels) of the
    same scattered bytes, every fp8 matrix of the touched experts and the shared expert's, as fp32 words."""
    try:
        mats = [q[e] for e, m in enumerate(counts) if m for q, _ in Q["experts"]]
        mats += [q for q, _ in Q["shared"]] if Q["shared"] else []
        words = [m.view(torch.float32) for m in mats]
        return timer(lambda: torch._foreach_norm(words)), "ok"
    except (AttributeError, RuntimeError, ValueError, NotImplementedError) as err:
        return float("nan"), f"read ceiling failed: {str(err)[:200]}"


def scaled_mm_ceiling(timer, Q, counts, T):
    """The practical ceiling of a compute-bound row: torch._scaled_mm on the forward's GEMMs, each expert's
    own fp8 gate, up and down against its rows (padded to 16; the shared expert against all T rows), with
    per-tensor scales and fast accumulation (the card's best fp8 GEMMs), in one CUDA graph; no routing,
    activation quantisation, SwiGLU or combine. nan with the reason where this torch or card cannot."""
    def build():
        one = torch.ones((), device="cuda")
        work = expert_gemms(counts, T, [q for q, _ in Q["experts"]], [q for q, _ in Q["shared"] or []], pad=16)
        acts = {(m, w.shape[1]): None for m, *ws in work for w in ws}  # one activation block per (rows, K)
        acts = {key: torch.randn(*key, device="cuda").to(FP8) for key in acts}

        def gemms():
            for m, *ws in work:
                for w in ws:
                    torch._scaled_mm(acts[m, w.shape[1]], w.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                     use_fast_accum=True)
        return gemms
    return time_ceiling(timer, "torch._scaled_mm", build)


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere in out gives nan (never a pass)."""
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def bench_fp8(lib, timer, name, copy_bw, fp8_rate, rows, tokens=TOKENS):
    """One fp8 row per T: Colibri's fp8 forward of the block-quantised layer and its bf16 forward of the
    original layer (replays timed in turn), torch._scaled_grouped_mm, the eager dequantise-then-matmul loop,
    and the fp8 floor. A library that refuses fp8 (or this layer) leaves the row with the reason."""
    spec = FP8_SHAPES[name]
    E, k, H, F, Fs = spec["E"], spec["k"], spec["H"], spec["F"], spec.get("shared_F", 0)
    if not hasattr(lib, "colibri_moe_context_create"):
        print(f"fp8 {name}: skipped (this library has no colibri_moe_context_create)")
        return
    L = family_layer(spec)
    ctx16, why16 = layer_context(lib, spec, L)[:2]
    Q = fp8_layer(L, spec)
    for key in ("w1", "w3", "w2"):  # the bf16 experts now live in ctx16; DeepSeek-V3 needs the room
        del L[key]
    torch.cuda.empty_cache()
    ctx8, why8 = layer_context(lib, spec, L, Q)[:2]
    fp8_status = "ok" if ctx8 is not None else f"refused by the library: {why8}"
    if not hasattr(torch, "_scaled_grouped_mm"):
        C, sg_status = None, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    else:
        try:
            C, sg_status = channel_layer(Q), "ok"
        except (ValueError, RuntimeError, NotImplementedError) as err:
            C, sg_status = None, f"torch._scaled_grouped_mm not run: {str(err)[:200]}"
    bn, bk = Q["block"]
    scale_bytes = 4 * sum(s[0].numel() for _, s in Q["experts"])
    expert_bytes = 3 * H * F + scale_bytes  # one byte per weight
    shared_bytes = 3 * H * Fs + (4 * sum(s.numel() for _, s in Q["shared"]) if Q["shared"] else 0)
    if ctx8 is None:
        print(f"fp8 {name}: Colibri's fp8 forward {fp8_status}")
    if ctx16 is None:
        print(f"fp8 {name}: Colibri's bf16 forward refused: {why16}")
    if C is None:
        print(f"fp8 {name}: {sg_status}")
    try:
        for T in tokens:
            x = row_tokens(T, H)
            ref = fp8_reference(x, L, spec, Q)
            replays, status = [], fp8_status
            # poisoned: an element a forward leaves unwritten reads NaN, and NaN never passes
            out16, out8 = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            if ctx16 is not None:
                replays.append(capture(lib, ctx16, T, x, out16).replay)
            if ctx8 is not None:
                try:
                    replays.append(capture(lib, ctx8, T, x, out8).replay)
                except RuntimeError as err:
                    status = f"forward failed: {str(err)[:200]}"
            t16 = t8 = float("nan")
            if replays:
                times = timer.interleaved(replays)
                t16 = times[0] if ctx16 is not None else t16
                t8 = times[-1] if status == "ok" else t8
            err8 = rel_err(out8, ref) if status == "ok" else float("nan")
            err8_16 = rel_err(out8, out16) if status == "ok" and ctx16 is not None else float("nan")
            eager_out = fp8_eager(x, L, spec, Q)
            t_eager = timer(lambda: fp8_eager(x, L, spec, Q))
            t_sg, err_sg, row_sg = float("nan"), float("nan"), sg_status
            if C is not None:
                try:
                    err_sg = rel_err(fp8_scaled_grouped(x, L, spec, C), ref)
                    t_sg = timer(lambda: fp8_scaled_grouped(x, L, spec, C))
                except (RuntimeError, ValueError, NotImplementedError) as err:  # its shape checks raise ValueError
                    row_sg = f"torch._scaled_grouped_mm failed: {str(err).splitlines()[0][:200]}"
            counts = torch.bincount(family_route(x, L, spec)[1].flatten(), minlength=E)
            touched = int((counts > 0).sum())
            t_read, read_status = read_ceiling(timer, Q, counts.tolist())
            t_mm, mm_status = scaled_mm_ceiling(timer, Q, counts.tolist(), T)
            nbytes = touched * expert_bytes + shared_bytes + 2 * T * H * 2
            flops = 2 * T * (k * 3 * H * F + 3 * H * Fs)
            # no fp8 matmul rate measured: no floor (max() would quietly keep the bytes term alone)
            floor_ms = float("nan") if math.isnan(fp8_rate) else max(nbytes / copy_bw, flops / fp8_rate) * 1e3
            row = dict(shape=name, E=E, k=k, H=H, F=F, T=T, shared_F=Fs, block=[bn, bk], fp8_ms=t8, bf16_ms=t16,
                       fp8_vs_bf16=t8 / t16, fp8_floor_ms=floor_ms, fraction_of_fp8_floor=floor_ms / t8,
                       scaled_grouped_ms=t_sg, eager_ms=t_eager, speedup_vs_scaled_grouped=t_sg / t8,
                       speedup_vs_eager=t_eager / t8, rel_err_vs_ref64=err8, rel_err_vs_bf16=err8_16,
                       scaled_grouped_rel_err_vs_ref64=err_sg, eager_rel_err_vs_ref64=rel_err(eager_out, ref),
                       fp8_status=status, scaled_grouped_status=row_sg, experts_touched=touched, fp8_bytes=nbytes,
                       flops=flops, rows_per_expert=counts.tolist(), read_ceiling_ms=t_read,
                       fraction_of_read_ceiling=t_read / t8, read_ceiling_status=read_status,
                       scaled_mm_ceiling_ms=t_mm, fraction_of_scaled_mm_ceiling=t_mm / t8,
                       scaled_mm_ceiling_status=mm_status)
            rows.append(row)
            print(f"{name:17s} {T:5d} {t8:8.3f} {t16:8.3f} {row['fp8_vs_bf16']:6.2f} {t_sg:8.3f} {t_eager:8.3f} "
                  f"{row['speedup_vs_scaled_grouped']:7.2f} {row['speedup_vs_eager']:7.2f} {floor_ms:8.3f} "
                  f"{row['fraction_of_fp8_floor']:6.2f} {err8:8.1e} {err8_16:8.1e}   sg err {err_sg:.1e}, "
                  f"eager err {row['eager_rel_err_vs_ref64']:.1e}, ceilings read {t_read:.3f} _scaled_mm {t_mm:.3f}"
                  + ("" if status == "ok" else f"   fp8: {status}")
                  + ("" if row_sg == "ok" or C is None else f"   {row_sg}"), flush=True)
    finally:
        for ctx in (ctx16, ctx8):
            if ctx is not None:
                lib.colibri_moe_context_destroy(ctx)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default="build/libcolibri.so")
    ap.add_argument("--json", default="bench/gpu.json")
    ap.add_argument("--reps", type=int, default=30)
    bf16_names = [s[0] for s in SHAPES] + list(FAMILY_SHAPES)
    ap.add_argument("--shapes", default=",".join(bf16_names),
                    help=f"bf16 rows, of {', '.join(bf16_names)} ('' for none): the family rows run after the others")
    ap.add_argument("--fp8-shapes", default=",".join(FP8_SHAPES),
                    help="fp8 rows, each beside Colibri's bf16 forward of the same layer ('' for none), in this order")
    ap.add_argument("--compare", default="", help="NAME=PATH,...: other builds timed on the same inputs (bf16 rows)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts T to time, e.g. 1,4,16")
    ap.add_argument("--flush", choices=("zero", "read"), default="zero",
                    help="L2 flush before each timing: write 512 MB (default) or read it (clean L2)")
    ap.add_argument("--plot", default="", help="also draw the bf16 rows into this PNG (needs matplotlib)")
    ap.add_argument("--plot-fp8", default="", help="also draw the fp8 rows into this PNG (needs matplotlib)")
    args = ap.parse_args()
    wanted, fp8_wanted = [s for s in args.shapes.split(",") if s], [s for s in args.fp8_shapes.split(",") if s]
    for name in [n for n in wanted if n not in bf16_names] + [n for n in fp8_wanted if n not in FP8_SHAPES]:
        ap.error(f"unknown shape {name!r} (bf16: {', '.join(bf16_names)}; fp8: {', '.join(FP8_SHAPES)})")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    lib = load_lib(args.lib)
    others = [(c.split("=", 1)[0], load_lib(c.split("=", 1)[1])) for c in args.compare.split(",") if c]
    timer = Timer(args.reps, args.flush)
    copy_bw, mm_rate = ceilings(timer)
    fp8_rate, fp8_rate_status = fp8_matmul_rate(timer) if fp8_wanted else (float("nan"), "not measured: no fp8 rows")
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s, "
          f"fp8 matmul {fp8_rate / 1e12:.0f} TFLOP/s" + ("" if fp8_rate_status == "ok" else f" ({fp8_rate_status})"))
    rows, fp8_rows = [], []
    run = dict(device=torch.cuda.get_device_name(), copy_bw=copy_bw, bf16_matmul_rate=mm_rate,
               fp8_matmul_rate=fp8_rate, fp8_matmul_status=fp8_rate_status, torch=torch.__version__, reps=args.reps,
               flush=args.flush, rows=rows, fp8_rows=fp8_rows)

    def save():  # after every shape: a run cut short (a device's time limit) keeps the rows it finished
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    if wanted:
        print("cuBLAS: torch.matmul per expert on the same GEMMs (the vendor library's ceiling); x: its time, "
              "eager's or grouped's over Colibri's")
        print(f"{'shape':{NAME_W}s} {'T':>5s} {'colibri':>8s} {'eager':>8s} {'grouped':>8s} {'cuBLAS':>8s} "
              f"{'x eager':>7s} {'x group':>7s} {'x cuBLAS':>8s} {'floor':>8s} {'frac':>6s} {'rel err':>8s}   "
              f"(ms, medians of {args.reps})")
    for shape in SHAPES:
        if shape[0] in wanted:
            bench_shape(lib, others, timer, *shape, copy_bw, mm_rate, rows, tokens=tokens)
            save()
            torch.cuda.empty_cache()
    for name in FAMILY_SHAPES:
        if name in wanted:
            try:  # a family row that fails still leaves the run's other rows in the JSON
                bench_family(lib, timer, name, copy_bw, mm_rate, rows, tokens=tokens)
            except (RuntimeError, torch.OutOfMemoryError) as err:
                print(f"{name}: failed: {err}", file=sys.stderr)
            save()
            torch.cuda.empty_cache()
    if fp8_wanted:
        print(f"fp8 experts, {FP8_BLOCK[0]}x{FP8_BLOCK[1]} block scales; fp8/bf16: Colibri's two forwards of the "
              f"layer; sg: torch._scaled_grouped_mm (rowwise); eager: dequantise-then-matmul loop; errors against the "
              f"float64 reference of the dequantised layer (err64) and Colibri's bf16 output (err16)")
        print(f"{'shape':17s} {'T':>5s} {'fp8':>8s} {'bf16':>8s} {'ratio':>6s} {'sg':>8s} {'eager':>8s} {'x sg':>7s} "
              f"{'x eager':>7s} {'floor':>8s} {'frac':>6s} {'err64':>8s} {'err16':>8s}   (ms, medians of {args.reps})")
    for name in fp8_wanted:
        try:  # as for the families: one shape failing leaves the others
            bench_fp8(lib, timer, name, copy_bw, fp8_rate, fp8_rows, tokens=tokens)
        except (RuntimeError, ValueError, torch.OutOfMemoryError) as err:
            print(f"fp8 {name}: failed: {err}", file=sys.stderr)
        save()
        torch.cuda.empty_cache()
    save()
    if rows:
        print("\n".join(gpu_report.summary(run)[0]))
    if fp8_rows:
        print("\n".join(gpu_report.fp8_summary(run)[0]))
    if args.plot and rows:
        gpu_report.plot(run, args.plot)
        print(f"plot: {args.plot}")
    if args.plot_fp8 and fp8_rows:
        gpu_report.plot_fp8(run, args.plot_fp8)
        print(f"fp8 plot: {args.plot_fp8}")


if __name__ == "__main__":
    main()
