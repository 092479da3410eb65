"""Graph replays of bench/bench_gpu.py's forwards (same shapes and weights, an L2 flush before each replay), to run
under Nsight Compute, which then profiles each kernel of the replays alone (NOTES.md v19 D):

  ncu --csv --page details --kernel-name regex:mma_kernel --clock-control none --section SpeedOfLight \\
      python3 csrc/dev/cuda/ncu_forward.py --lib build/libcolibri.so --shapes Qwen1.5-MoE --tokens 4

Each forward runs once plainly and once as the captured graph (bench_gpu.capture), then --reps replays, on the
bench's tokens of that T (bench_gpu.row_tokens).
"""
import argparse
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench")]
import bench_gpu as bg  # noqa: E402
import decode_trace  # noqa: E402  (beside this file: bench_gpu.py's layers as contexts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libcolibri.so")
    ap.add_argument("--shapes", default="Qwen1.5-MoE")
    ap.add_argument("--tokens", default="4")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    lib = bg.load_lib(args.lib)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for name, E, k, H, F, renorm in bg.SHAPES:
        if name not in args.shapes.split(","):
            continue
        ctx = decode_trace.setup(name, E, k, H, F, renorm, [("lib", lib)])["lib"]
        try:
            for T in [int(t) for t in args.tokens.split(",") if t]:
                x = bg.row_tokens(T, H)  # the bench's tokens of this row
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
