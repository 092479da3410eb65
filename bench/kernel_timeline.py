"""Per-kernel timeline of CUDA-graph replays of one forward, as bench/bench_gpu.py runs them (an L2 flush
before each replay), from the CUPTI kernel records of torch.profiler: no patched build, no counters.

  python3 bench/kernel_timeline.py --libs base=PATH,new=PATH [--shapes Mixtral-8x7B] [--tokens 256]
                                   [--reps 20] [--json trace.json] [--fp8]

For every build, shape and T: each kernel of the forward in launch order with the median over the replays
of its start and end (us from the first kernel's start in that replay; a kernel launched under programmatic
dependent launch starts when its first block does, which can be before the previous kernel ends) and of
its duration, then the replay's span (first start to last end). The builds' replays alternate, one of each
per round, as in the bench. The profiler's own cost is on the host; the times are the GPU's.
--sustain S: instead, each build replays (flush, replay, wait) for S seconds, the builds in turn and twice over,
while nvidia-smi samples the SM clock and the power draw every 50 ms; per build, the median replay time and the
median clock and power of its phases (the GPU's power limit slows long compute-bound forwards).
Shapes, weights and tokens are bench_gpu.py's (same seeds): its bf16 rows, family rows and fp8 rows' layers, by
name, in bf16; --fp8: their experts quantised as the fp8 rows quantise them.
"""
import argparse
import datetime
import json
import statistics
import subprocess
import tempfile
import time

import torch

import bench_gpu as bg  # bench/, beside this script
from ncu_forward import layer_contexts


def timed_ms(graph, flush):
    """One replay of graph after an L2 flush, timed by CUDA events (ms)."""
    flush.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def short_name(name):
    """`void wgmma_ws_kernel<__nv_bfloat16, true>(CUtensorMap_st, ProjArgs)` -> `wgmma_ws_kernel<bf16, true>`"""
    name = name.removeprefix("void ").split("(")[0]
    return name.replace("__nv_bfloat16", "bf16").replace("__half", "f16")


def is_flush(name):
    """Whether a kernel record is the L2 flush before a replay (a fill kernel or a memset), not the forward's."""
    return "FillFunctor" in name or "emset" in name


def kernel_records(prof):
    """The profile's GPU kernels and memsets as (name, start us, end us), in start order."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    ks = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset")]
    return sorted(ks, key=lambda k: k[1])


def trace_one(labelled, T, x, out, reps, flush):
    """Replays every build's graph `reps` times in turn under the profiler; per build, a list of replays,
    each a list of (name, start, end) with times from that replay's first kernel."""
    graphs = {label: bg.capture(lib, ctx, T, x, out) for label, lib, ctx in labelled}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for label in graphs:
                flush.zero_()
                graphs[label].replay()
        torch.cuda.synchronize()
    # The records: per round and build, the flush (a fill kernel or a memset) and the forward's kernels.
    replays, current = [], None
    for name, start, end in kernel_records(prof):
        if is_flush(name):
            if current:
                replays.append(current)
            current = []
            continue
        if current is not None:
            current.append((short_name(name), start, end))
    if current:
        replays.append(current)
    per_build = {label: [] for label in graphs}
    labels = list(graphs)
    for i, r in enumerate(replays):
        t0 = r[0][1]
        per_build[labels[i % len(labels)]].append([(n, s - t0, e - t0) for n, s, e in r])
    return per_build


def sustain_one(labelled, T, x, out, seconds, flush):
    """Per build: median replay time (ms), SM clock (MHz) and power (W) over its phases of `seconds` each."""
    graphs = {label: bg.capture(lib, ctx, T, x, out) for label, lib, ctx in labelled}
    with tempfile.NamedTemporaryFile(mode="r", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=open(log.name, "w"))
        phases, times = [], {label: [] for label in graphs}
        try:
            time.sleep(0.5)
            for _ in range(2):
                for label, g in graphs.items():
                    t0 = time.time()
                    while time.time() - t0 < seconds:
                        times[label].append(timed_ms(g, flush))
                    phases.append((label, t0, time.time()))
        finally:
            smi.terminate()
            smi.wait()
        samples = []  # (epoch seconds, MHz, W)
        for line in open(log.name):
            f = [v.strip() for v in line.split(",")]
            if len(f) == 3:
                try:
                    stamp = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    samples.append((stamp, float(f[1]), float(f[2])))
                except ValueError:
                    pass
    result = {}
    for label in graphs:
        # a phase's samples, but for its first 200 ms
        inside = [s for lb, t0, t1 in phases if lb == label for s in samples if t0 + 0.2 <= s[0] <= t1]
        result[label] = dict(replay_ms=statistics.median(times[label]), replays=len(times[label]), samples=len(inside),
                             sm_mhz=statistics.median([s[1] for s in inside]) if inside else float("nan"),
                             power_w=statistics.median([s[2] for s in inside]) if inside else float("nan"))
    return result


def summarise(replays):
    """Median start, end and duration of each kernel position, and of the span; replays whose kernel
    sequence differs from the first's are counted and left out."""
    names = [k[0] for k in replays[0]]
    same = [r for r in replays if [k[0] for k in r] == names]
    rows = []
    for i, name in enumerate(names):
        starts = [r[i][1] for r in same]
        ends = [r[i][2] for r in same]
        rows.append(dict(kernel=name, start_us=statistics.median(starts), end_us=statistics.median(ends),
                         dur_us=statistics.median([e - s for s, e in zip(starts, ends)])))
    span = statistics.median([max(k[2] for k in r) - r[0][1] for r in same])
    return dict(kernels=rows, span_us=span, replays=len(same), dropped=len(replays) - len(same))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libs", required=True, help="NAME=PATH,...")
    ap.add_argument("--shapes", default="Mixtral-8x7B,DeepSeek-V2-Lite,Qwen1.5-MoE")
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--fp8", action="store_true", help="the shapes' fp8 layers (block scales, as bench_gpu's fp8 rows)")
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds per build and phase (clock/power mode)")
    args = ap.parse_args()
    libs = [(c.split("=", 1)[0], bg.load_lib(c.split("=", 1)[1])) for c in args.libs.split(",") if c]
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    results = []
    for name in args.shapes.split(","):
        labelled, H, hosts = layer_contexts(libs, name, args.fp8)
        try:
            for T in [int(t) for t in args.tokens.split(",") if t]:
                x = bg.row_tokens(T, H)
                out = torch.empty_like(x)
                if args.sustain > 0:
                    for label, r in sustain_one(labelled, T, x, out, args.sustain, flush).items():
                        results.append(dict(shape=name, T=T, fp8=args.fp8, build=label, **r))
                        print(f"{name} T={T} {label}: replay {r['replay_ms']:.3f} ms (median of {r['replays']}), "
                              f"SM clock {r['sm_mhz']:.0f} MHz, power {r['power_w']:.0f} W")
                    continue
                for label, reps in trace_one(labelled, T, x, out, args.reps, flush).items():
                    s = summarise(reps)
                    results.append(dict(shape=name, T=T, fp8=args.fp8, build=label, **s))
                    print(f"\n{name}{' fp8' if args.fp8 else ''} T={T} {label}: span {s['span_us']:.1f} us "
                          f"(median of {s['replays']} replays{', ' + str(s['dropped']) + ' dropped' if s['dropped'] else ''})")
                    print(f"  {'kernel':58s} {'start':>8s} {'end':>8s} {'dur':>8s}  (us)")
                    for r in s["kernels"]:
                        print(f"  {r['kernel'][:58]:58s} {r['start_us']:8.1f} {r['end_us']:8.1f} {r['dur_us']:8.1f}")
        finally:
            for label, lib, ctx in labelled:
                lib.colibri_moe_context_destroy(ctx)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
