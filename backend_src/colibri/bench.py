"""python -m colibri bench: the CPU benchmark.

Times, in one process and one run, a SwiGLU MoE layer computed three ways on the same routing:
  colibri  MoELayer on the CPU, bf16 weights used in place, bf16 activations (--act fp32 to change)
  torch    PyTorch eager, the Hugging Face loop over experts (select the expert's tokens,
           w2(silu(w1 x) * w3 x), index_add_ weighted), bf16 weights and activations
  numpy    the same loop in numpy, fp32 weights and activations (numpy has no bf16)
and prints, per shape and token count, the median time of each, Colibri's speed-up over the better
of the other two, and at T = 1 the bandwidth Colibri reaches on the weights of the experts it touched
against the machine's copy bandwidth measured in the same run. Results also go to a JSON file.
All three see the same values: the random weights and inputs are rounded to bf16 first.
"""
import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from colibri.dlpack import Tensor
from colibri.dtypes import bf16_to_float32, float32_to_bf16
from colibri.config import LayerConfig
from colibri.layer import MoELayer

SHAPES = (  # name, E, k, H, F
    ("E8 k2 H1024 F2816", 8, 2, 1024, 2816),
    ("E64 k6 H1024 F512", 64, 6, 1024, 512),
)
TOKENS = (1, 16, 256)
# Each call takes the next of this many routings, so that repeated calls do not find the same few
# experts' weights in the last-level cache (a decode step reads weights from memory).
ROUTINGS_PER_SIZE = 8


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m colibri bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench-cpu.json", help="where to write the results (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="threads for Colibri and torch (default: %(default)s)")
    p.add_argument("--act", choices=("bf16", "fp32"), default="bf16", help="Colibri's activations (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts (default: 1 16 256)")
    p.add_argument("--budget", type=float, default=1.5,
                   help="seconds of timing per implementation and size, after warm-up (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _time_ms(fn, budget_s: float, min_reps: int = 5, max_reps: int = 500) -> dict:
    """Wall time of fn() in ms (median, min, repetitions): two warm-up calls, then at least min_reps
    calls and until the budget is spent (or max_reps).

    Three thread pools share the cores here (Colibri's OpenMP, torch's own OpenMP, numpy's OpenBLAS) and
    each keeps its workers spinning for a while after a call; on a small machine those spinners steal
    the cores from whichever runs next. A pause first lets them go to sleep."""
    time.sleep(0.5)
    fn()
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median": 1e3 * statistics.median(times), "min": 1e3 * min(times), "reps": len(times)}


def copy_bandwidth_gbps(torch, threads: int) -> tuple:
    """Copy bandwidth of a 512 MiB buffer, counting bytes read + written: numpy's copy (one thread) and,
    if torch is there, torch's (threads): the better of the two, and how it was measured."""
    src = np.ones(128 << 20, np.float32)
    dst = np.empty_like(src)
    best = (2 * src.nbytes / (_time_ms(lambda: np.copyto(dst, src), 0.5)["median"] / 1e3) / 1e9, "numpy copyto, 1 thread")
    if torch is not None:
        ts, td = torch.from_numpy(src), torch.from_numpy(dst)
        gbps = 2 * src.nbytes / (_time_ms(lambda: td.copy_(ts), 0.5)["median"] / 1e3) / 1e9
        if gbps > best[0]:
            best = (gbps, f"torch copy_, {threads} threads")
    return best


def _random_routing(rng, T: int, E: int, k: int):
    """k distinct experts per token, weights a softmax of random logits (as a router would give)."""
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
    logits = rng.standard_normal((T, k)).astype(np.float32)
    weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return ids, weights.astype(np.float32)


def numpy_moe(x, ids, weights, w1, w3, w2):
    """The Hugging Face loop in numpy, fp32. Each token meets an expert at most once, so out[t] += is safe."""
    out = np.zeros_like(x)
    for e in range(w1.shape[0]):
        tokens, slots = np.nonzero(ids == e)
        if tokens.size == 0:
            continue
        xe = x[tokens]
        gate = xe @ w1[e].T
        h = gate / (1.0 + np.exp(-gate)) * (xe @ w3[e].T)
        out[tokens] += (h @ w2[e].T) * weights[tokens, slots, None]
    return out


def torch_moe(torch, x, ids, weights, w1, w3, w2):
    """The Hugging Face (Mixtral) eager loop: per expert, select its tokens, FFN, index_add_ weighted."""
    F = torch.nn.functional
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tokens, slots = torch.where(ids == e)
        if tokens.numel() == 0:
            continue
        xe = x[tokens]
        y = F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])
        out.index_add_(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
    return out


def bench_shape(name, E, k, H, F, tokens, args, torch, rng):
    expert_numel = 3 * H * F
    bits = float32_to_bf16((rng.standard_normal((E, expert_numel), np.float32) * (1.0 / np.sqrt(H))))
    layer = MoELayer(LayerConfig(num_experts=E, top_k=k, hidden_size=H, intermediate_size=F, weight_dtype="bf16"),
                     bits, num_threads=args.threads)
    w32 = bf16_to_float32(bits)  # numpy's weights: the same values, widened exactly
    w1 = w32[:, :H * F].reshape(E, F, H)
    w3 = w32[:, H * F:2 * H * F].reshape(E, F, H)
    w2 = w32[:, 2 * H * F:].reshape(E, H, F)
    if torch is not None:
        tb = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)  # shares Colibri's buffer
        tw1 = tb[:, :H * F].reshape(E, F, H)
        tw3 = tb[:, H * F:2 * H * F].reshape(E, F, H)
        tw2 = tb[:, 2 * H * F:].reshape(E, H, F)

    rows = []
    for T in tokens:
        x_bits = float32_to_bf16(rng.standard_normal((T, H)).astype(np.float32))
        x = bf16_to_float32(x_bits)
        x_colibri = Tensor.from_numpy(x_bits, "bf16") if args.act == "bf16" else x
        routings = [_random_routing(rng, T, E, k) for _ in range(ROUTINGS_PER_SIZE)]
        ids, weights = routings[0]
        ours = layer.forward(x_colibri, ids, weights)
        ours = ours.numpy() if args.act == "bf16" else ours  # Tensor.numpy() widens bf16 to fp32
        theirs = numpy_moe(x, ids, weights, w1, w3, w2)
        agreement = float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))
        # bf16 output rounding alone is up to 2^-8 of the largest value
        if not agreement < (2e-2 if args.act == "bf16" else 1e-4):
            print(f"warning: {name} T={T}: Colibri and numpy differ by {agreement:.2e} (normalised)", file=sys.stderr)

        row = {"shape": name, "E": E, "k": k, "H": H, "F": F, "T": T, "agreement_vs_numpy": agreement}
        pool = itertools.cycle(routings)
        timings = {"colibri": _time_ms(lambda: layer.forward(x_colibri, *next(pool)), args.budget),
                   "numpy": _time_ms(lambda: numpy_moe(x, *next(pool), w1, w3, w2), args.budget)}
        if torch is not None:
            tx = torch.from_numpy(x_bits.view(np.int16)).view(torch.bfloat16)
            torch_pool = itertools.cycle([(torch.from_numpy(i).long(), torch.from_numpy(w)) for i, w in routings])
            with torch.inference_mode():
                timings["torch"] = _time_ms(lambda: torch_moe(torch, tx, *next(torch_pool), tw1, tw3, tw2), args.budget)
        for impl in ("colibri", "torch", "numpy"):
            row[f"{impl}_ms"] = timings[impl]["median"] if impl in timings else None
        row["timings_ms"] = timings
        best_other = min(v for v in (row["numpy_ms"], row["torch_ms"]) if v is not None)
        row["speedup_vs_best"] = best_other / row["colibri_ms"]
        touched = np.mean([len(np.unique(i)) for i, _ in routings])
        row["touched_weight_bytes"] = int(touched * expert_numel * 2)
        row["colibri_weight_gbps"] = row["touched_weight_bytes"] / (row["colibri_ms"] / 1e3) / 1e9
        rows.append(row)
        _print_row(row, args.copy_gbps)
    return rows


def _fmt(ms):
    return f"{ms:9.3f}" if ms is not None else f"{'-':>9}"


def _print_header():
    print(f"{'shape':18} {'T':>4} {'colibri ms':>10} {'torch ms':>9} {'numpy ms':>9} {'speed-up':>8}  weights GB/s (T=1)")


def _print_row(row, copy_gbps):
    bw = ""
    if row["T"] == 1:
        bw = f"{row['colibri_weight_gbps']:.1f} ({100 * row['colibri_weight_gbps'] / copy_gbps:.0f}% of copy)"
    print(f"{row['shape']:18} {row['T']:4d} {row['colibri_ms']:10.3f} {_fmt(row['torch_ms'])} "
          f"{_fmt(row['numpy_ms'])} {row['speedup_vs_best']:7.2f}x  {bw}", flush=True)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        import torch
        torch.set_num_threads(args.threads)
        torch_note = f"torch {torch.__version__}, {args.threads} threads"
    except ImportError:
        torch = None
        torch_note = "torch not importable: its column is skipped (make bench installs torch)"
    rng = np.random.default_rng(args.seed)
    args.copy_gbps, copy_how = copy_bandwidth_gbps(torch, args.threads)
    print(f"colibri CPU benchmark: {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
          f"Colibri {args.threads} threads; {torch_note}; numpy {np.__version__}")
    print(f"weights: Colibri and torch bf16, numpy fp32 (numpy has no bf16); activations: Colibri {args.act}, "
          "torch bf16, numpy fp32; same values and routing for all (k distinct experts per token); median ms")
    print(f"copy bandwidth (read + write): {args.copy_gbps:.1f} GB/s ({copy_how})")
    print("speed-up: the better of torch and numpy / Colibri; weights GB/s: bytes of the touched experts / Colibri's time;\n"
          f"each call takes the next of {ROUTINGS_PER_SIZE} random routings (weights mostly come from memory, not cache)")
    _print_header()
    rows = []
    for shape in SHAPES:
        rows += bench_shape(*shape, args.tokens, args, torch, rng)
    result = {
        "machine": {"cores": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "copy_gbps": args.copy_gbps, "copy_measured_with": copy_how},
        "settings": {"threads": args.threads, "budget_s": args.budget, "seed": args.seed, "torch": torch_note,
                     "numpy": np.__version__, "weights": {"colibri": "bf16", "torch": "bf16", "numpy": "fp32"},
                     "activations": {"colibri": args.act, "torch": "bf16", "numpy": "fp32"}},
        "results": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
