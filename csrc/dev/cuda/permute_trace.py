"""Where the one-block permute kernel's time goes: a build with permute_trace.patch (-DPERMUTE_TRACE) records
clock64 of block 0's thread 0 at each phase of permute_kernel; this replays the bench's CUDA graph of each
shape at each T (bench_gpu.py's weights and seeded tokens, L2 flushed before each replay, as the bench does)
and prints the median cycles of each phase. Rows whose assignments take permute_warp or the multi-block
permutation (n <= 128 or n >= 4096) are not traced (their marks stay those of the last traced run).
The patched kernel then runs the same steps a second time, their code warm in the SM's instruction caches
(same outputs); its phases print beside the first pass's, so the difference is what fetching cold code costs
(NOTES.md v27 B: nothing). The scan's phase is also split into its first loop, its block scans, its tile table.
With -DPERMUTE_TOTALS_LAST as well, the patch adds the per-expert totals after the scatter instead of in the
scan (a probe: the multi-block permutation then counts none); with -DPERMUTE_EARLY_TRIGGER the kernel lets the
expert projection launch at its start, as before NOTES.md v28 B, instead of once the tile table is written.

  git apply csrc/dev/cuda/permute_trace.patch
  make lib CUDA_ARCH=90 CPPFLAGS="-Icsrc/include -Icsrc/src -D_POSIX_C_SOURCE=200809L -DPERMUTE_TRACE"
  python3 csrc/dev/cuda/permute_trace.py build/libcolibri.so [--tokens 256,512] [--reps 30] [--flush read]
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

PHASES = ["wait (pdl_wait)", "histogram", "scan + tile table", "scatter: ids, zeroed counts", "rank rounds",
          "warp-base scan", "place"]


def pass_cycles(buf, w):
    """Cycles of one pass whose marks start at buf[w] (the first pass 0, the warm second one 16): its six
    phases after the wait (histogram .. place), and its scan in four parts ([w + 8] the scan's first loop
    done, [w + 9] its block scans, [w + 10] its tile table). Zeros for a second pass that did not run."""
    if w and not buf[w + 1]:
        return [0] * 6, [0] * 4
    phases = [buf[w + i + 1] - buf[w + i] for i in range(1, 7)]
    scan = [buf[w + 8] - buf[w + 2], buf[w + 9] - buf[w + 8], buf[w + 10] - buf[w + 9], buf[w + 3] - buf[w + 10]]
    return phases, scan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--tokens", default="256,512")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default=",".join(s[0] for s in bg.SHAPES))
    ap.add_argument("--flush", choices=("zero", "read"), default="zero",
                    help="how L2 is emptied before each replay, as bench_gpu.py's --flush (zero: dirty lines left)")
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
                dt.timed(g, flush, args.flush)  # the bench's flush, one replay, its end waited for
                buf = (ctypes.c_ulonglong * 32)()
                assert take(ctypes.byref(buf)) == 0
                first, scan = pass_cycles(buf, 0)
                warm, wscan = pass_cycles(buf, 16)
                rows.append([buf[1] - buf[0]] + first + [buf[7] - buf[0]] + warm + scan + wscan)
            med = [statistics.median(r[i] for r in rows) for i in range(22)]
            print(f"{shape[0]} T={T} (n={T * shape[2]}): permute kernel {med[7]:.0f} cycles "
                  f"({med[7] / 1980:.2f} us at 1.98 GHz), median of {args.reps}; first pass, second (warm) pass")
            for j, (name, c) in enumerate(zip(PHASES, med[:7])):
                w = f"{med[7 + j]:8.0f}" if j else "       -"
                print(f"  {name:30s} {c:8.0f} {w} cycles  {c / 1980:6.2f} us")
            print(f"  {'after the wait':30s} {sum(med[1:7]):8.0f} {sum(med[8:14]):8.0f} cycles")
            for j, name in enumerate(["scan: counts and tiles of its experts", "scan: block scans",
                                      "scan: offsets, tile table, totals", "scan: the totals' row, return"]):
                print(f"    {name:36s} {med[14 + j]:8.0f} {med[18 + j]:8.0f} cycles")
            del g


if __name__ == "__main__":
    main()
