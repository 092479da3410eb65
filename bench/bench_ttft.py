"""Time to first token of a whole MoE model on one GPU: transformers' bf16 model with its own (eager) MoE
blocks against the same model whose MoE layers run in Colibri's expert tier with fp8 experts —
in-process, over gRPC with CUDA shared memory, and over plain gRPC to a tritonserver on the same GPU.

The model is Qwen3-30B-A3B's shape with random weights (bench/ttft_model.py): drawn on the GPU in bf16,
timed as it is (the eager baseline), then its experts are packed to fp8 into a folder of layers and
freed, and the rest of the model (embeddings, attention, norms, lm_head: the attention tier) is timed
against each expert tier. Every protocol sees the same prompts, the same arrivals and the same driver.

Load: open loop. Requests arrive as a Poisson process at the offered rate (fixed seed); each is a
prompt of --prompt-tokens random ids, prefilled through every layer to its first new token, then
--new-tokens - 1 more tokens greedily. Each tier serves them through a continuous batcher
(colibri.attention.batching): before every step the requests whose time has come are admitted; a step
prefills the oldest waiting prompt alone, or, when none waits, runs one decode forward of up to
--max-batch running sequences together (1: no batched decode, requests still interleave). A request's
TTFT is its wait for its prefill plus the prefill, measured from its scheduled arrival (a late request
is not excused: no coordinated omission); TPOT is the mean time of its later tokens, decode steps
shared with the other running requests and delayed by the prefills that come first. Reported per
protocol and offered rate: P50/P99 TTFT and TPOT with sample counts (n/offered) and the mean running
batch of the decode forwards. Batched, a tier's capacity is no longer 1 / its whole request but about
1 / its warm prefill: the fixed offered load is --fixed-load of 1 / eager's warm prefill (or
--fixed-rate requests/s), and the sweep offers fractions of each tier's own 1 / warm prefill, up to
the highest rate whose P99 TTFT stays within --budget-ms.

    python3 bench/bench_ttft.py --out DIR [--layers 48] [--prompt-tokens 2048] [--new-tokens 16]
        [--protocols eager,inprocess,cudashm,grpc] [--sweep 0.3,0.5,0.7,0.9] [--duration 30] [--budget-ms 200]
        [--max-batch 32]

Writes DIR/ttft.json (every sample), DIR/ttft.md (the table) and DIR/ttft.png (P99 TTFT against offered
load, when matplotlib is there). Needs a CUDA GPU with room for the bf16 model (61 GB for 48 layers),
torch, transformers, and for the gRPC protocols a tritonserver `python -m colibri serve` can find.
`--device cpu` with a small `--shape` and `--layers` is a smoke test of all of it
(tests/test_bench_ttft.py).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ttft_model  # noqa: E402


def percentile(values, q):
    return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else float("nan")


def poisson_arrivals(rate, duration, seed):
    """Arrival times (s from the start) over `duration` s: the load test's own Poisson schedule
    (loadtest/generate.py), so the bench and the generate workload offer load alike."""
    import itertools
    import random
    from colibri.testing import load_script
    schedule = load_script(Path(__file__).resolve().parents[1] / "loadtest" / "generate.py", "loadtest_generate")
    return list(itertools.takewhile(lambda t: t < duration, schedule.poisson_arrivals(rate, random.Random(seed))))


def open_loop(tier, rate, duration, prompts, new_tokens, seed, deadline, give_up_s, max_batch):
    """One run: the Poisson arrivals of `rate` over `duration` s served by a continuous batcher over `tier`
    (colibri.attention.run_open_loop); each sample's TTFT counts from its arrival. A run whose queue holds
    a request back over give_up_s is overloaded: it takes no more arrivals (incomplete)."""
    from colibri.attention import ContinuousBatcher, run_open_loop
    arrivals = poisson_arrivals(rate, duration, seed)
    requests = [(prompts[n % len(prompts)], new_tokens) for n in range(len(arrivals))]
    run = run_open_loop(ContinuousBatcher(tier, max_batch), arrivals, requests, deadline=deadline, give_up_s=give_up_s)
    return {"rate": rate, "duration_s": duration, **run}


def summarise(run):
    s = run["samples"]
    ttft = [x["ttft_s"] * 1e3 for x in s]
    tpot = [x["tpot_s"] * 1e3 for x in s]
    return {"rate": run["rate"], "n": len(s), "offered": run["offered"], "complete": run["complete"],
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
            "prefill_p50_ms": percentile([x["prefill_s"] * 1e3 for x in s], 50),
            "wait_p99_ms": percentile([x["wait_s"] * 1e3 for x in s], 99), "mean_batch": run["mean_batch"]}


def serve(folder, log, device, port_base=8700):
    """`python -m colibri serve` of the packed folder on the GPU; returns (process, grpc url)."""
    http, grpc, metrics = port_base, port_base + 1, port_base + 2
    proc = subprocess.Popen([sys.executable, "-m", "colibri", "serve", "--weights", str(folder),
                             *(["--device", "gpu", "--dtype", "bf16"] if device.startswith("cuda") else ["--device", "cpu"]),
                             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    import urllib.request
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"bench_ttft: the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/colibri_moe/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, f"127.0.0.1:{grpc}"
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"bench_ttft: the server was not ready in 600 s; see {log}")


class NullExperts:
    """An expert tier that computes nothing (zeros): what the attention tier costs by itself."""

    def __init__(self, model):
        from colibri.attention import loading
        self.layers = set(loading.moe_blocks(model))
        self.hidden_size = model.config.hidden_size

    def forward(self, layer, hidden):
        import torch
        return torch.zeros_like(hidden)

    def close(self):
        pass


def set_experts(model, implementation):
    """transformers' experts implementation of the model: "eager" (its loop over experts), or None for
    its default (grouped_mm where torch can)."""
    if implementation is None:
        implementation = model.get_correct_experts_implementation(None) \
            if hasattr(model, "get_correct_experts_implementation") else "grouped_mm"
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(implementation)
    else:
        model.config._experts_implementation = implementation


def gib(device):
    import torch
    return f"{torch.cuda.memory_allocated() / 2**30:.1f}" if device.startswith("cuda") else "-"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--protocols", default="eager,transformers,null,inprocess,cudashm,grpc",
                   help="eager: transformers' loop over experts; transformers: its default experts (grouped_mm); "
                        "null: the attention tier alone")
    p.add_argument("--sweep", default="0.3,0.5,0.7,0.9",
                   help="offered loads of the sweep, as fractions of each tier's capacity (1 / its warm prefill)")
    p.add_argument("--fixed-load", type=float, default=0.5,
                   help="the fixed load as a fraction of eager's capacity (1 / its warm prefill)")
    p.add_argument("--fixed-rate", type=float, default=0.0, help="the fixed load in requests/s (instead)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    p.add_argument("--max-batch", type=int, default=32,
                   help="most sequences in one decode forward (1: no batched decode)")
    p.add_argument("--budget-ms", type=float, default=200.0)
    p.add_argument("--give-up-s", type=float, default=30.0,
                   help="a run whose queue holds a request back this long is overloaded: no more arrivals")
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds for everything; later runs are cut")
    p.add_argument("--packed", type=Path, help="folder for the fp8 layers (default OUT/../layers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="where both tiers run (cpu: a smoke test of a small shape)")
    p.add_argument("--shape", default="{}", help="JSON of Qwen3MoeConfig settings over Qwen3-30B-A3B's")
    args = p.parse_args(argv)
    import torch
    from colibri.attention import AttentionTier, expert_tier
    t0 = time.perf_counter()
    deadline = t0 + args.time_limit
    args.out.mkdir(parents=True, exist_ok=True)
    packed = args.packed or Path(os.environ.get("TMPDIR", "/tmp")) / "ttft-layers"
    protocols = args.protocols.split(",")
    log = lambda *a: print(f"[{time.perf_counter() - t0:6.1f} s]", *a, flush=True)  # noqa: E731
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"device": name, "args": {k: str(v) for k, v in vars(args).items()},
              "runs": {}}

    config = ttft_model.qwen3_30b_a3b(layers=args.layers, **json.loads(args.shape))
    model = ttft_model.build(config, args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    log(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B parameters, "
        f"{gib(args.device)} GiB")
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, config.vocab_size, args.prompt_tokens).tolist() for _ in range(8)]

    def measure(name, tier, rates):
        """rates: offered loads, or a callable of the tier's capacity (1 / its warm prefill) giving them."""
        tier.generate(prompts[0], 2)  # warm-up: kernels, allocator, caches
        warm = min((tier.generate(prompts[1], args.new_tokens) for _ in range(3)), key=lambda r: r.ttft_s)
        log(f"{name}: warm request alone: prefill {warm.ttft_s * 1e3:.1f} ms, TPOT {warm.tpot_s * 1e3:.2f} ms")
        rates = rates(1.0 / warm.ttft_s) if callable(rates) else rates
        runs = result["runs"].setdefault(name, {"warm_prefill_ms": warm.ttft_s * 1e3, "warm_tpot_ms": warm.tpot_s * 1e3,
                                                "capacity_per_s": 1.0 / warm.ttft_s, "points": []})
        for rate in rates:
            if time.perf_counter() > deadline:
                log(f"{name}: time limit, rate {rate} not run")
                break
            run = open_loop(tier, rate, args.duration, prompts, args.new_tokens, args.seed, deadline, args.give_up_s,
                            args.max_batch)
            runs["points"].append({**summarise(run), "samples": run["samples"]})
            s = runs["points"][-1]
            log(f"{name} @ {rate:.2f}/s: n={s['n']}/{s['offered']} P99 TTFT {s['ttft_p99_ms']:.0f} ms, "
                f"P99 TPOT {s['tpot_p99_ms']:.1f} ms, mean batch {s['mean_batch']:.1f}")
            (args.out / "ttft.json").write_text(json.dumps(result, indent=1))
            if rate != result.get("fixed_rate") and not (s["complete"] and s["ttft_p99_ms"] <= args.budget_ms):
                break  # the sweep rises: past the budget, higher rates are past it too

    sweep = [float(r) for r in args.sweep.split(",") if r]
    fixed = args.fixed_rate or None
    if fixed:
        result["fixed_rate"] = fixed
    # The baselines: transformers' model with its own experts, as its "eager" loop over experts (the
    # issue's baseline, which sets the fixed load) and as its default (grouped_mm where torch has it).
    for name, implementation in (("eager", "eager"), ("transformers", None)):
        if name not in protocols:
            continue
        set_experts(model, implementation)
        result.setdefault("experts_implementation", {})[name] = model.config._experts_implementation

        def baseline_rates(capacity):
            result["fixed_rate"] = fixed or round(args.fixed_load * capacity, 3)
            return [result["fixed_rate"]]
        measure(name, AttentionTier.eager(model), [fixed] if fixed else baseline_rates)
        fixed = result["fixed_rate"]
    ttft_model.pack_fp8(model, packed, log=log)
    log(f"packed; model without experts: {gib(args.device)} GiB")
    fixed = fixed or 1.0
    result["fixed_rate"] = fixed
    if "null" in protocols:  # the attention tier alone: experts that answer zeros at once
        measure("attention only", AttentionTier(model, NullExperts(model)), [fixed])

    def rates(capacity):  # the fixed load, then the sweep's fractions of this tier's own 1 / warm prefill
        return [fixed] + sorted(round(f * capacity, 3) for f in sweep)
    if "inprocess" in protocols:
        experts = expert_tier("inprocess", weights=packed, device=args.device)
        measure("inprocess", AttentionTier(model, experts), rates)
        experts.close()
        del experts
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    remote = [p for p in ("cudashm", "grpc") if p in protocols]
    if remote:
        proc, url = serve(packed, args.out / "server.log", args.device)
        log(f"tritonserver ready at {url}")
        try:
            for name in remote:
                experts = expert_tier(name, url=url, device=args.device)
                measure(name, AttentionTier(model, experts), rates)
                experts.close()
        finally:
            proc.terminate()
            proc.wait(60)
    (args.out / "ttft.json").write_text(json.dumps(result, indent=1))
    report(result, args.out, args.budget_ms)


def report(result, out, budget_ms):
    lines = [f"# TTFT, whole model ({result['device']})", "",
             f"Continuous batching, at most {result['args'].get('max_batch', '?')} sequences per decode forward.", "",
             "| tier | offered req/s | n/offered | P50 TTFT ms | P99 TTFT ms | P50 TPOT ms | P99 TPOT ms | mean batch |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in result["runs"].items():
        for s in runs["points"]:
            cut = "" if s["complete"] else " (overloaded: cut)"
            lines.append(f"| {name} | {s['rate']:.2f} | {s['n']}/{s['offered']}{cut} | {s['ttft_p50_ms']:.0f} | "
                         f"{s['ttft_p99_ms']:.0f} | {s['tpot_p50_ms']:.1f} | {s['tpot_p99_ms']:.1f} | "
                         f"{s.get('mean_batch', float('nan')):.1f} |")
    lines += ["", "Warm, one request alone (min of 3): prefill = TTFT without queueing; the expert tier's share per "
              "MoE layer = (tier - attention only) / MoE layers.", "",
              "| tier | prefill ms | TPOT ms | prefill share / layer ms | TPOT share / layer ms |", "|---|---|---|---|---|"]
    alone = result["runs"].get("attention only")
    layers = int(result["args"].get("layers", "48"))
    for name, runs in result["runs"].items():
        share = (f"{(runs['warm_prefill_ms'] - alone['warm_prefill_ms']) / layers:.2f} | "
                 f"{(runs['warm_tpot_ms'] - alone['warm_tpot_ms']) / layers:.3f}") if alone else "- | -"
        lines.append(f"| {name} | {runs['warm_prefill_ms']:.1f} | {runs['warm_tpot_ms']:.2f} | {share} |")
    lines.append("")
    fixed = result.get("fixed_rate")
    base = next((s for s in result["runs"].get("eager", {}).get("points", []) if s["rate"] == fixed), None)
    for name, runs in result["runs"].items():
        ok = [s["rate"] for s in runs["points"] if s["ttft_p99_ms"] <= budget_ms and s["complete"]]
        at = next((s for s in runs["points"] if s["rate"] == fixed), None)
        ratio = f", P99 TTFT {at['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x eager's at {fixed:.2f}/s" \
            if base and at and at["complete"] and base["complete"] else ""
        lines.append(f"- {name}: highest offered load within P99 TTFT {budget_ms:.0f} ms: "
                     f"{max(ok) if ok else 'none measured'}{ratio}")
    (out / "ttft.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_ttft: no matplotlib, no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, runs in result["runs"].items():
        pts = sorted(runs["points"], key=lambda s: s["rate"])
        ax.plot([s["rate"] for s in pts], [s["ttft_p99_ms"] for s in pts], "o-", label=name)
    ax.axhline(budget_ms, color="gray", ls="--", lw=1, label=f"budget {budget_ms:.0f} ms")
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("P99 TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"Qwen3-30B-A3B shape, whole model, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=120)


if __name__ == "__main__":
    main()
