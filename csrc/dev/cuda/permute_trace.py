"""Where the one-block permute kernel's time goes: a build with permute_trace.patch (-DPERMUTE_TRACE) records
clock64 of block 0's thread 0 at each phase of permute_kernel; this replays the bench's CUDA graph of each
shape at each T (bench_gpu.py's weights and seeded tokens, L2 flushed before each replay, as the bench does)
and prints the median cycles of each phase. Rows whose assignments take permute_warp or the multi-block
permutation (n <= 128 or n >= 4096) are not traced (their marks stay those of the last traced run).

  git apply csrc/dev/cuda/permute_trace.patch
  make lib CUDA_ARCH=90 CPPFLAGS="-Icsrc/include -Icsrc/src -D_POSIX_C_SOURCE=200809L -DPERMUTE_TRACE"
  python3 csrc/dev/cuda/permute_trace.py build/libcolibri.so [--tokens 256,512] [--reps 30]
"""
import argparse
import ctypes
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "..", "bench"), HERE]
import bench_gpu as bg  # noqa: E402
import decode_trace as dt  # noqa: E402  (bench_gpu.py's layers as contexts)

PHASES = ["wait (pdl_begin)", "histogram", "scan + tile table", "scatter: ids, zeroed counts", "rank rounds",
          "warp-base scan", "place"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--tokens", default="256,512")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default=",".join(s[0] for s in bg.SHAPES))
    args = ap.parse_args()
    lib = bg.load_lib(args.lib)
    take = lib.colibri_permute_trace_take
    take.argtypes = [ctypes.c_void_p]
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for shape in bg.SHAPES:
        if shape[0] not in args.shapes.split(","):
            continue
        ctxs = dt.setup(*shape, [("t", lib)])
        for T in [int(t) for t in args.tokens.split(",")]:
            x = bg.row_tokens(T, shape[3])
            out = torch.empty_like(x)
            g = bg.capture(lib, ctxs["t"], T, x, out)
            rows = []
            for _ in range(args.reps):
                dt.timed(g, flush, "zero")  # the bench's flush, one replay, its end waited for
                buf = (ctypes.c_ulonglong * 16)()
                assert take(ctypes.byref(buf)) == 0
                rows.append([buf[i + 1] - buf[i] for i in range(7)] + [buf[7] - buf[0]])
            med = [statistics.median(r[i] for r in rows) for i in range(8)]
            print(f"{shape[0]} T={T} (n={T * shape[2]}): permute kernel {med[7]:.0f} cycles "
                  f"({med[7] / 1980:.2f} us at 1.98 GHz), median of {args.reps}")
            for name, c in zip(PHASES, med[:7]):
                print(f"  {name:30s} {c:8.0f} cycles {c / 1980:6.2f} us")
            del g


if __name__ == "__main__":
    main()
