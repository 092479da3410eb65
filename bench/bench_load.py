"""What loading a checkpoint costs, and how much of it is the check that every weight is finite.

Writes a packed layer of the given shape (Mixtral's by default: 8 experts of H=4096, F=14336 in bf16,
2.8 GB), reads it once so it sits in the page cache, then times, median of --repeat runs each:
  check      colibri_first_nonfinite over the experts (the pass colibri_moe_context_create makes)
  read       a plain read of the same bytes by numpy (max over them, one thread): a floor to compare
  load cpu   MoELayer.from_file on the CPU (the weights are used in place: the check is most of it)
  load cuda  MoELayer.from_file on the GPU, when there is one (the copy to the GPU included)

  python bench/bench_load.py [--experts 8 --hidden 4096 --intermediate 14336 --dtype bf16] [--json OUT]
"""
import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

import colibri
from colibri import checkpoint
from colibri import safetensors_io as st
from colibri._native import DTYPE_CODES, ffi, lib
from colibri.config import LayerConfig
from colibri.dtypes import ITEMSIZE


def write_layer(path, experts, hidden, intermediate, dtype):
    """A layer of finite random weights, streamed to disk one expert at a time."""
    config = LayerConfig(num_experts=experts, top_k=2, hidden_size=hidden, intermediate_size=intermediate,
                         weight_dtype=dtype, has_router=True)
    rng = np.random.default_rng(0)
    storage = np.dtype(f"uint{8 * ITEMSIZE[dtype]}")  # the weights' bits, drawn as unsigned integers
    finite = {"bf16": 0x3F80, "fp16": 0x3C00, "fp32": 0x3F800000}[dtype]  # bits below 1.0: finite, any sign

    def chunks():
        for _ in range(experts):
            bits = rng.integers(0, finite, config.expert_numel, dtype=storage)
            yield bits | (rng.integers(0, 2, config.expert_numel, dtype=storage) << (8 * bits.itemsize - 1))
    lazy = st.LazyTensor(st.COLIBRI_TO_SAFETENSORS[dtype], (experts, config.expert_numel), chunks)
    router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    checkpoint.save(path, config, lazy, router)
    return config


def median_seconds(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="Where to write the layer (default: a temporary folder).")
    parser.add_argument("--json", default=None, help="Write the figures here as JSON.")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="colibri-load-") as folder:
        path = pathlib.Path(folder) / "layer.colibri.safetensors"
        start = time.perf_counter()
        config = write_layer(path, args.experts, args.hidden, args.intermediate, args.dtype)
        size = path.stat().st_size
        print(f"wrote {path.name}: {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s", flush=True)
        ckpt = checkpoint.load(path)
        experts = ckpt.experts
        experts.max()  # into the page cache
        pointer = ffi.cast("void *", experts.__array_interface__["data"][0])
        code = DTYPE_CODES[args.dtype]
        assert lib.colibri_first_nonfinite(code, pointer, experts.size) == experts.size

        results = {
            "check_s": median_seconds(lambda: lib.colibri_first_nonfinite(code, pointer, experts.size), args.repeat),
            "numpy_read_s": median_seconds(experts.max, args.repeat),
            "load_cpu_s": median_seconds(lambda: colibri.MoELayer.from_file(path, "cpu"), args.repeat),
        }
        if colibri.cuda_device_count() > 0:
            colibri.MoELayer.from_file(path, "cuda")  # the CUDA context and first allocations, untimed
            results["load_cuda_s"] = median_seconds(lambda: colibri.MoELayer.from_file(path, "cuda"), args.repeat)
        del ckpt, experts

    experts_bytes = config.num_experts * config.expert_numel * ITEMSIZE[args.dtype]
    summary = {"shape": f"{args.experts}x(H={args.hidden}, F={args.intermediate}) {args.dtype}",
               "experts_bytes": experts_bytes, "cpu_count": os.cpu_count(), "machine": platform.node(),
               "check_GB_per_s": experts_bytes / results["check_s"] / 1e9, **results}
    for key, value in summary.items():
        print(f"{key:16} {value:.4f}" if isinstance(value, float) else f"{key:16} {value}")
    for load in ("load_cpu_s", "load_cuda_s"):
        if load in results:
            print(f"the check is {results['check_s'] / results[load]:.0%} of {load[:-2].replace('_', ' ')}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
