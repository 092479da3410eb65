"""What an expert's partial 128-row tile costs in the compute-bound forwards, and what cuBLAS does on the
same per-expert GEMMs (NOTES.md v22).

  python3 csrc/dev/cuda/tile_probe.py --lib PATH [--tokens 1024,4096] [--reps 30] [--json probe.json]
                                      [--extra 8,64] [--counts tiny8,bench] [--rows 128,152]

Mixtral-shaped layer (bench_gpu.py's weights, seed 0), the routing given (topk_ids, topk_weights), so that the
count of rows per expert is chosen: `even` (T*k/E rows each: no partial tile), `tinyR` (three experts R rows
above it, the others below: three tiles of R rows more; R from --extra), `bench` (the bench's own draw: its
router on its random tokens), `rowsR` (--rows: R rows per expert at T = 4R, e.g. 128 against 152 to time
folded tiles against whole ones). Each count is timed three ways, interleaved, one call of each per round, an
L2 flush before each call (bench_gpu.py's Timer): Colibri's graph replay; `cublas`, a CUDA graph of the bare
per-expert GEMMs through torch (x_e @ [w1_e; w3_e]^T, silu * up, @ w2_e^T on tokens already grouped by expert:
no routing, no gather, no combine); and Colibri's up and down kernels' durations (torch.profiler's kernel
records of the replays, medians; they overlap through programmatic dependent launch, so they do not add up to
the forward). Prints ms, the FLOP rate of the useful rows, and the tiles of 128 rows the counts take without a
fold (ceil(count / 128) per expert; since NOTES.md v23 and v24 an expert up to 24 rows past whole tiles, or 48
past two or more, has one tile fewer in the library's table).
"""
import argparse
import json
import os
import re
import statistics
import sys

import torch
import torch.nn.functional as Fn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "..", "bench")]
import bench_gpu as bg  # noqa: E402
import decode_trace  # noqa: E402
from replay_kernels import is_flush, kernel_records, short_name  # noqa: E402

E, K, H, F = 8, 2, 4096, 14336


def given_ids(counts, T):
    """topk_ids [T, 2] whose column counts are `counts` and whose two slots of a token differ: the ids
    sorted by expert, slot 0 from the first half, slot 1 from the second (no expert has more than T)."""
    flat = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    assert flat.numel() == T * K and max(counts) <= T
    ids = torch.stack([flat[:T], flat[T:]], dim=1)
    assert bool((ids[:, 0] != ids[:, 1]).all())
    return ids[torch.randperm(T)].to(torch.int32).cuda()


def spread(total, parts):
    return [total // parts + (i < total % parts) for i in range(parts)]


def counts_of(T, router, x, extra=(8, 64)):
    n = T * K
    out = {"even": spread(n, E)}
    for r in extra:
        out[f"tiny{r}"] = [n // E + r] * 3 + spread(n - 3 * (n // E + r), E - 3)
    ids = bg.route(x, router, K, 1)[1]
    out["bench"] = torch.bincount(ids.flatten(), minlength=E).tolist()
    return out


def cublas_graph(xs, w13, w2, counts):
    """A CUDA graph of the bare per-expert GEMMs on tokens grouped by expert (xs [T*k, H])."""
    outs = []

    def run():
        outs.clear()
        start = 0
        for e, n in enumerate(counts):
            h = xs[start:start + n] @ w13[e].T
            a = Fn.silu(h[:, :F]) * h[:, F:]
            outs.append(a @ w2[e].T)
            start += n

    return bg.graph_of(run), outs


def glu_arg(name):
    """`wgmma_ws_kernel<bf16, true, false>` -> "true" (its GLU argument: the up projection), else None"""
    m = re.match(r"\w+_kernel<\w+, (true|false)", name)
    return m.group(1) if m else None


def kernel_ms(graph, flush, reps):
    """Median duration of each kernel of the replays, by name (ms)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    per = {}
    for name, s, e in kernel_records(prof):
        if is_flush(name):
            continue
        per.setdefault(short_name(name), []).append((e - s) / 1e3)
    return {n: statistics.median(v) for n, v in per.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--extra", default="8,64", help="R of the tinyR counts (three experts R rows above T*k/E)")
    ap.add_argument("--counts", default="", help="time only these counts, e.g. tiny32,bench (default: all)")
    ap.add_argument("--rows", default="",
                    help="also even counts of R rows per expert for each R here (T = R * 8 / 2), e.g. 128,152")
    ap.add_argument("--max-err", type=float, default=2e-2,
                    help="limit of Colibri's error against the cuBLAS chain (a diagnostic build may need it lifted)")
    args = ap.parse_args()
    lib = bg.load_lib(args.lib)
    timer = bg.Timer(args.reps)
    ctx = decode_trace.setup("Mixtral-8x7B", E, K, H, F, 1, [("lib", lib)])["lib"]
    w1, w3, w2, router = bg.random_layer(E, H, F)  # the context's weights again (the same seed), for cuBLAS
    w13 = torch.cat([w1, w3], dim=1)  # [E, 2F, H]
    torch.manual_seed(1)
    rows = []
    print(f"{'T':>5s} {'counts':8s} {'tiles':>5s} {'colibri ms':>10s} {'cublas ms':>9s} {'col/cub':>7s} "
          f"{'TFLOP/s col':>11s} {'cub':>5s} {'up ms':>6s} {'down ms':>7s}")

    def cases():
        """(T, tokens, label, counts): --tokens' counts, then --rows' even ones"""
        for T in [int(t) for t in args.tokens.split(",") if t]:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            for label, counts in counts_of(T, router, x, [int(r) for r in args.extra.split(",")]).items():
                if not args.counts or label in args.counts.split(","):
                    yield T, x, label, counts
        for r in [int(r) for r in args.rows.split(",") if r]:
            assert r * E % K == 0, f"--rows {r}: T = {r} * {E} / {K} is not whole"
            T = r * E // K
            yield T, torch.randn(T, H, device="cuda", dtype=torch.bfloat16), f"rows{r}", [r] * E

    for T, x, label, counts in cases():
        out = torch.empty_like(x)
        weights = torch.full((T, K), 0.5, device="cuda", dtype=torch.float32)
        ids = given_ids(counts, T)
        g = bg.capture(lib, ctx, T, x, out, ids, weights)
        # tokens grouped by expert, as the permutation leaves them; the check: Colibri's output against
        # the cuBLAS chain's rows combined (both bf16, so a loose limit)
        order = torch.argsort(ids.flatten().long(), stable=True)
        xs = x[order // K].contiguous()
        cg, outs = cublas_graph(xs, w13, w2, counts)
        ref = torch.zeros(T, H, device="cuda", dtype=torch.float32)
        ref.index_add_(0, order // K, torch.cat(outs).float() * 0.5)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < args.max_err, f"{label} T={T}: rel err {err}"
        t_col, t_cub = timer.interleaved([g.replay, cg.replay])
        ks = kernel_ms(g, timer.flush, args.reps)
        up, down = (max((v for n, v in ks.items() if glu_arg(n) == glu), default=float("nan"))
                    for glu in ("true", "false"))
        flops = 2 * T * K * 3 * H * F
        tiles = sum((c + 127) // 128 for c in counts)
        rows.append(dict(T=T, counts=label, per_expert=counts, tiles=tiles, colibri_ms=t_col, cublas_ms=t_cub,
                         kernels_ms=ks, rel_err=err))
        print(f"{T:5d} {label:8s} {tiles:5d} {t_col:10.3f} {t_cub:9.3f} {t_col / t_cub:7.2f} "
              f"{flops / t_col / 1e9:11.0f} {flops / t_cub / 1e9:5.0f} {up:6.3f} {down:7.3f}   {counts}",
              flush=True)
        print("      kernels: " + ", ".join(f"{n} {v:.3f}" for n, v in ks.items()), flush=True)
        del g, cg, outs
    lib.colibri_moe_context_destroy(ctx)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
