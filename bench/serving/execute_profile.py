"""Where a batch's time goes inside model.py, without Triton: colibri_moe's and torch_moe's execute()
run in this process (colibri.testing.fake_backend stands in for triton_python_backend_utils) on the same
batches of requests whose inputs are already on the GPU, as CUDA shared memory hands them over.

For each model it prints the median wall time of one execute() (until its outputs are ready on the
GPU), the GPU time of the layer's forward alone on the joined batch (CUDA events), and the
difference, the host's share; then the functions colibri_moe's execute spends its time in
(cProfile, cumulative). Needs a GPU, torch and a library built with nvcc.
  python3 bench/serving/execute_profile.py --shape 8,2,4096,14336 --requests 3 --tokens 128-2048
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from colibri.testing import fake_backend
from compare import write_demo  # beside this file (a script's folder is on its path)

ROOT = Path(__file__).resolve().parents[2]

MODELS = {"colibri_moe": ROOT / "model_repository" / "colibri_moe" / "1" / "model.py",
          "torch_moe": ROOT / "bench" / "serving" / "model_repository" / "torch_moe" / "1" / "model.py"}


def load(name, weights):
    sys.modules["triton_python_backend_utils"] = fake_backend
    os.environ["COLIBRI_WEIGHTS"] = str(weights)
    return fake_backend.initialize(MODELS[name], name, weights, kind="GPU")


def batches(count, requests, tokens, H, dtype, seed=0):
    rng = np.random.default_rng(seed)
    lo, hi = tokens
    out = []
    for _ in range(count):
        sizes = rng.integers(lo, hi + 1, size=requests)
        out.append([fake_backend.request(hidden_states=torch.randn(int(T), H, device="cuda", dtype=dtype))
                    for T in sizes])
    return out


def time_execute(model, batch_list):
    times = []
    for batch in batch_list:
        torch.cuda.synchronize()
        start = time.perf_counter()
        responses = model.execute(batch)
        torch.cuda.synchronize()  # the outputs are ready: what the stub then hands to Triton
        times.append(time.perf_counter() - start)
        for r in responses:
            assert r.error is None, r.error.message
    return times


def time_forward(layer_forward, batch_list):
    """GPU time of the layer alone on each batch's joined hidden states."""
    times = []
    for batch in batch_list:
        x = torch.cat([r["hidden_states"].array for r in batch])
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        layer_forward(x)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8,2,4096,14336", help="E,k,H,F of the demo checkpoint")
    p.add_argument("--requests", type=int, default=3, help="requests per batch (execute call)")
    p.add_argument("--tokens", default="128-2048", help="tokens per request, drawn from this range")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="of hidden_states")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--weights", type=Path, help="a packed checkpoint (default: a demo one of --shape)")
    args = p.parse_args(argv)
    if args.weights is not None:  # its own shape, not --shape's
        from colibri import checkpoint
        c = checkpoint.load(args.weights).config
        args.shape = f"{c.num_experts},{c.top_k},{c.hidden_size},{c.intermediate_size}"
    E, k, H, F = (int(v) for v in args.shape.split(","))
    tokens = tuple(int(v) for v in args.tokens.split("-"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights
        if weights is None:
            weights = Path(tmp) / "demo.colibri"
            write_demo(weights, E, k, H, F, "bf16")
        warm = batches(3, args.requests, tokens, H, dtype, seed=1)
        work = batches(args.batches, args.requests, tokens, H, dtype)
        mean_tokens = statistics.mean(sum(r["hidden_states"].array.shape[0] for r in b) for b in work)
        print(f"execute_profile: E={E} k={k} H={H} F={F}, {args.requests} requests of {args.tokens} tokens per batch "
              f"(mean {mean_tokens:.0f} tokens), {args.dtype} hidden states on the GPU, {args.batches} batches")
        print(f"{'model':12s} {'execute ms':>11s} {'forward GPU ms':>15s} {'host ms':>8s}")
        for name in MODELS:
            model = load(name, weights)
            forward = model.layer.forward
            time_execute(model, warm)
            time_forward(forward, warm)
            ex = statistics.median(time_execute(model, work)) * 1e3
            fw = statistics.median(time_forward(forward, work)) * 1e3
            print(f"{name:12s} {ex:11.3f} {fw:15.3f} {ex - fw:8.3f}")
            if name == "colibri_moe":
                # What the finiteness check of the hidden states (one synchronisation) costs.
                checked = model._nonfinite_rows_later
                model._nonfinite_rows_later = lambda members, hidden_states: lambda: [None] * len(members)
                unchecked = statistics.median(time_execute(model, work)) * 1e3
                model._nonfinite_rows_later = checked
                print(f"{'  unchecked':12s} {unchecked:11.3f} {'':15s} {unchecked - fw:8.3f}   "
                      "(the same without the finiteness check)")
                profile = cProfile.Profile()
                profile.enable()
                time_execute(model, work)
                profile.disable()
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(28)
                profiled = text.getvalue()
            del model
            torch.cuda.empty_cache()
        print(f"\ncolibri_moe's execute, cProfile over {args.batches} batches (cumulative s):")
        print(profiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
