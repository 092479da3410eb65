"""Graph replays of bench/bench_gpu.py's forwards (same shapes, weights and tokens of each T, an L2 flush
before each replay), to run under Nsight Compute, which then profiles each kernel of the replays alone:

  ncu --csv --page details --kernel-name regex:mma_kernel --clock-control none --section SpeedOfLight \\
      python3 bench/ncu_forward.py --lib build/libcolibri.so --shapes Qwen1.5-MoE --tokens 4

Each forward runs once plainly and once as the captured graph (bench_gpu.capture), then --reps replays.
Shapes: bench_gpu.py's bf16 rows, family rows and fp8 rows' layers, by name; --fp8 quantises the layer's experts
as the fp8 rows do.
"""
import argparse
import ctypes

import torch

import bench_gpu as bg  # bench/, beside this script


def context(lib, E, k, H, F, renorm):
    """A CUDA context of bench_gpu's bf16 layer of this shape (seed 0), as bench_gpu.bench_shape makes it."""
    w1, w3, w2, router = bg.random_layer(E, H, F)
    packed = torch.cat([w1.reshape(E, -1), w3.reshape(E, -1), w2.reshape(E, -1)], dim=1).cpu()
    del w1, w3, w2
    offsets = (ctypes.c_uint64 * E)(*[e * 3 * H * F for e in range(E)])
    router_host = router.cpu().contiguous()
    cfg = bg.Config(expert_kind=0, weight_dtype=2, num_experts=E, top_k=k, hidden_size=H, intermediate_size=F,
                    routing=0, renormalize=renorm, routed_scaling_factor=1.0, workspace_tokens=0, device=1,
                    device_id=0, num_threads=0, routing_fn=None, routing_user_data=None)
    ctx = ctypes.c_void_p()
    bg.check(lib, lib.colibri_moe_context_init(ctypes.byref(ctx), ctypes.byref(cfg), packed.data_ptr(), offsets,
                                               packed.numel(), router_host.data_ptr(), None), "init")
    return ctx


def layer_contexts(libs, name, fp8=False):
    """Every build's context of the named layer: a bench_gpu bf16 row (SHAPES), or a family or fp8 row's layer
    (FAMILY_SHAPES, FP8_SHAPES) with its routing and shared expert, in bf16 or (fp8) its experts quantised as
    the fp8 rows quantise them. Returns ([(label, lib, ctx)], H, the host copies the contexts borrow)."""
    for sname, E, k, H, F, renorm in bg.SHAPES:
        if sname == name and not fp8:
            return [(label, lib, context(lib, E, k, H, F, renorm)) for label, lib in libs], H, []
    spec = bg.FAMILY_SHAPES.get(name) or bg.FP8_SHAPES.get(name)
    if spec is None:
        raise SystemExit(f"unknown shape {name!r}: bench_gpu.py's FAMILY_SHAPES or FP8_SHAPES name it"
                         f"{'' if fp8 else ', or SHAPES'}")
    L = bg.family_layer(spec)
    Q = None
    if fp8:  # as bench_gpu.bench_fp8: the bf16 experts make way for the fp8 copies (DeepSeek-V3's are 22.5 GB)
        Q = bg.fp8_layer(L, spec)
        for key in ("w1", "w3", "w2"):
            del L[key]
        torch.cuda.empty_cache()
    labelled, hosts = [], []
    for label, lib in libs:
        ctx, why, host = bg.layer_context(lib, spec, L, Q)
        if ctx is None:
            raise SystemExit(f"{label}: {name} refused: {why}")
        labelled.append((label, lib, ctx))
        hosts.append(host)
    del L, Q
    return labelled, spec["H"], hosts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libcolibri.so")
    ap.add_argument("--shapes", default="Qwen1.5-MoE")
    ap.add_argument("--tokens", default="4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="the shapes' fp8 layers (block scales, as bench_gpu's fp8 rows)")
    args = ap.parse_args()
    lib = bg.load_lib(args.lib)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for name in args.shapes.split(","):
        labelled, H, hosts = layer_contexts([("", lib)], name, args.fp8)
        ctx = labelled[0][2]
        try:
            for T in [int(t) for t in args.tokens.split(",") if t]:
                x = bg.row_tokens(T, H)
                out = torch.empty_like(x)
                graph = bg.capture(lib, ctx, T, x, out)
                for _ in range(args.reps):
                    flush.zero_()
                    graph.replay()
                torch.cuda.synchronize()
                print(f"{name} T={T}: {args.reps} replays", flush=True)
        finally:
            lib.colibri_moe_context_destroy(ctx)


if __name__ == "__main__":
    main()
