"""Where the time of a decode forward goes, measured the way bench/bench_gpu.py times it (CUDA-graph
replay after an L2 flush, CUDA events).

  python3 csrc/dev/cuda/decode_trace.py --libs base=PATH,new=PATH [--trace base=PATH,...] [--tokens 1]

--libs: builds timed under three flushes before each replay: `zero` (bench_gpu.py's: a 512 MB
zero-fill, which leaves L2 full of dirty lines that the forward's reads must write back first), `read`
(a 512 MB read: L2 full of clean lines) and `none` (L2 warm from the previous replay).
--eager: one plain forward per build and shape, nothing timed (run under ncu for per-kernel times).
--trace: builds made with csrc/dev/cuda/trace.patch and -DCOLIBRI_TRACE; for each kernel of the
forward, the median over replays of its blocks' first/last entry, first/last dependency-wait release
(for the early second gemv projection: its entry; it waits later) and first/last warp exit, in us from
the first block's entry, plus the event time of the replay (which also holds the graph launch), and
(where the build has trace.patch's clock64 marks, colibri_trace_clk_route) the cycles of each phase of
the route kernel's last block, whose top-k the patched kernel runs twice: "cold" is the forward's own,
"warm" the same code again right after it.
(The patch's sums of timestamps overflow; they are not read.)
Shapes and weights are bench_gpu.py's (same seed).
"""
import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), "bench"]
import bench_gpu as bg  # noqa: E402

# ids 5-7: trace.patch's marks in the route kernel (last block past its counter, top-k done, gemv done)
KERNELS = ["route", "up", "down", "other-gemv", "combine/fold", "rt-last", "rt-topk", "rt-gemv"]
FIELDS = ["start_min", "start_max", "wait_min", "wait_max", "end_min", "end_max", "start_sum", "end_sum", "blocks",
          "warps"]


class TraceRec(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in FIELDS]


TraceArr = TraceRec * (8 * 32)


def take(lib):
    """Folded records per kernel id from every translation unit, and reset."""
    out = {}
    for tu in ("route", "experts", "combine"):
        arr = TraceArr()
        fn = getattr(lib, f"colibri_trace_take_{tu}")
        fn.argtypes = [ctypes.c_void_p]
        assert fn(ctypes.byref(arr)) == 0
        for kid in range(8):
            recs = [arr[kid * 32 + j] for j in range(32)]
            blocks = sum(r.blocks for r in recs)
            if blocks == 0:
                continue
            live = [r for r in recs if r.blocks or r.warps]
            d = dict(blocks=blocks, warps=sum(r.warps for r in recs))
            for f in ("start", "wait", "end"):
                mins = [getattr(r, f + "_min") for r in live if getattr(r, f + "_min") != 2 ** 64 - 1]
                d[f + "_min"] = min(mins) if mins else None
                d[f + "_max"] = max(getattr(r, f + "_max") for r in live)
            out[kid] = d
    return out


def setup(name, E, k, H, F, renorm, libs):
    w1, w3, w2, router = bg.random_layer(E, H, F)
    packed = torch.cat([w1.reshape(E, -1), w3.reshape(E, -1), w2.reshape(E, -1)], dim=1).cpu()
    del w1, w3, w2
    offsets = (ctypes.c_uint64 * E)(*[e * 3 * H * F for e in range(E)])
    router_host = router.cpu().contiguous()
    cfg = bg.Config(expert_kind=0, weight_dtype=2, num_experts=E, top_k=k, hidden_size=H, intermediate_size=F,
                    routing=0, renormalize=renorm, routed_scaling_factor=1.0, workspace_tokens=0, device=1,
                    device_id=0, num_threads=0, routing_fn=None, routing_user_data=None)
    ctxs = {}
    for label, lib in libs:
        ctxs[label] = ctypes.c_void_p()
        bg.check(lib, lib.colibri_moe_context_init(ctypes.byref(ctxs[label]), ctypes.byref(cfg), packed.data_ptr(),
                                                   offsets, packed.numel(), router_host.data_ptr(), None), label)
    return ctxs


def timed(g, flush, mode):
    if mode == "zero":
        flush.zero_()
    elif mode == "read":
        flush.view(torch.int64).sum()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--libs", default="")
    ap.add_argument("--trace", default="")
    ap.add_argument("--shapes", default="DeepSeek-V2-Lite,Qwen1.5-MoE,Mixtral-8x7B")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--eager", action="store_true", help="only one plain forward per build (for ncu)")
    args = ap.parse_args()
    parse = lambda s: [(c.split("=", 1)[0], bg.load_lib(c.split("=", 1)[1])) for c in s.split(",") if c]
    libs, traces = parse(args.libs), parse(args.trace)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for shape in bg.SHAPES:
        if shape[0] not in args.shapes.split(","):
            continue
        ctxs = setup(*shape, libs + traces)
        for T in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(T, shape[3], device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(x)
            if args.eager:
                for label, lib in libs:
                    bg.check(lib, lib.colibri_moe_forward(ctxs[label], T, 2, x.data_ptr(), None, None,
                                                          out.data_ptr(), None), "forward")
                    torch.cuda.synchronize()
                continue
            for label, lib in libs:
                g = bg.capture(lib, ctxs[label], T, x, out)
                res = {}
                for mode in ("zero", "read", "none"):
                    for _ in range(3):
                        timed(g, flush, mode)
                    res[mode] = statistics.median(timed(g, flush, mode) for _ in range(args.reps))
                print(f"{shape[0]:17s} T={T:<4d} {label:8s} us: " +
                      "  ".join(f"flush {m} {v:7.1f}" for m, v in res.items()), flush=True)
                del g
            for label, lib in traces:
                g = bg.capture(lib, ctxs[label], T, x, out)
                take(lib)
                rows, totals, clks = [], [], []
                clk_fn = getattr(lib, "colibri_trace_clk_route", None)
                clk_arr = (ctypes.c_uint64 * 32)()
                up_fn = getattr(lib, "colibri_trace_clk_experts", None)
                up_arr, ups = (ctypes.c_uint64 * 32)(), []
                def take_clocks():  # copies out and resets the builds' clock64 marks
                    for fn, arr in ((clk_fn, clk_arr), (up_fn, up_arr)):
                        if fn:
                            fn(ctypes.byref(arr))

                for rep in range(args.reps + 3):
                    take(lib)
                    take_clocks()
                    t = timed(g, flush, "zero")
                    r = take(lib)
                    take_clocks()
                    if rep >= 3:
                        rows.append(r)
                        totals.append(t)
                        if clk_fn:
                            clks.append(list(clk_arr))
                        if up_fn:
                            ups.append(list(up_arr))
                t0s = [min(d["start_min"] for d in r.values()) for r in rows]
                print(f"{shape[0]:17s} T={T:<4d} {label:8s} trace, replay {statistics.median(totals):.1f} us "
                      "(event); per kernel, us from the first block's entry (median of replays):")
                print(f"    {'kernel':10s} {'blocks':>6s} {'entry':>13s} {'wait done':>13s} {'exit':>13s}")
                for kid in sorted(rows[0]):
                    def med(f):
                        vals = [(r[kid][f] - t0) / 1e3 for r, t0 in zip(rows, t0s) if r.get(kid) and r[kid][f] is not None]
                        return statistics.median(vals) if vals else float("nan")
                    if kid >= 5:  # marks inside the route kernel (trace.patch): one timestamp each
                        print(f"    {KERNELS[kid]:10s} {rows[0][kid]['blocks']:6d} {med('start_min'):6.1f}-"
                              f"{med('start_max'):<6.1f} (mark)", flush=True)
                        continue
                    print(f"    {KERNELS[kid]:10s} {rows[0][kid]['blocks']:6d} {med('start_min'):6.1f}-{med('start_max'):<6.1f}"
                          f" {med('wait_min'):6.1f}-{med('wait_max'):<6.1f} {med('end_min'):6.1f}-{med('end_max'):<6.1f}",
                          flush=True)
                def cycles(samples, i, j):  # median of mark j - mark i over the replays
                    return statistics.median(c[j] - c[i] for c in samples)

                if clks and clks[0][14]:
                    names = ["logits+score", "softmax max/sum", "pick loop", "weights/norm", "stores", "return"]
                    dmed = lambda i, j: cycles(clks, i, j)  # noqa: E731
                    for pass_, base in (("cold", 0), ("warm", 8)):
                        marks = [0 if base == 0 else 6] + [base + i for i in range(1, 6)] + [6 if base == 0 else 14]
                        print(f"    top-k pass {pass_} (cycles): " + ", ".join(
                            f"{n} {dmed(marks[i], marks[i + 1]):.0f}" for i, n in enumerate(names)))
                    print(f"    last block: both passes {dmed(0, 14):.0f} cycles")
                if ups and ups[0][4]:  # direct mode's up projection, block (0, 0), thread 0
                    um = lambda i, j: cycles(ups, i, j)  # noqa: E731
                    print(f"    up block (0,0) after its wait (cycles): setup {um(0, 1):.0f}, the same setup again "
                          f"{um(1, 2):.0f}, warp 0's first row {um(2, 3):.0f}, its other rows {um(3, 4):.0f}")
                del g
            del x, out
        for label, lib in libs + traces:
            lib.colibri_moe_context_destroy(ctxs[label])
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
