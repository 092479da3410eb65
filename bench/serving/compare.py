"""Serving benchmark: colibri_moe against the same layer in PyTorch eager (torch_moe), in ONE
tritonserver, under the same Locust load, plus an empty Python model (identity) whose latency is the
round trip every Python model pays.

One temporary model repository holds colibri_moe (model_repository/), torch_moe and identity
(bench/serving/model_repository/); the two others get colibri_moe's config.pbtxt with only the name
changed, so inputs, outputs, max_batch_size, dynamic batching and instance group are the same, and
`python -m colibri serve` starts the server (it rewrites every config for --device/--dtype the way
it rewrites colibri_moe's). Then, for each mix and protocol, the same Locust run (loadtest/run.py:
users, duration, token range) against each model in turn. Printed and written to OUT: compare.json,
compare.png (P50/P95/P99 per model), each run's Locust files, and per profile and protocol the P99
ratio colibri/torch and the identity model's P99 (the part of P99 that is not the layer's).

    python bench/serving/compare.py [--shape 8,2,256,512 | --weights FILE] [--users 16 --time 30s
        --mixes decode-heavy,prefill-heavy --protocols grpc,http,cudashm --device auto --out runs/serving
        --load closed|auto:0.7|RPS --sweep 4,8,16,32,64 --budget-ms 200]

--load: `closed` (each user sends its next request when the answer is in: the faster model is also
offered more), `auto:F` (per mix and protocol, torch_moe first runs closed-loop, and then every model
gets the same fixed offered load, F times the throughput torch_moe reached: a load it sustains), or a
number of requests per second in all. --sweep: per model, one closed-loop run stepping through those
user counts (--step-time s each) with --sweep-mix over --sweep-protocol, and the highest throughput
(requests/s and tokens/s) at which the --budget-profile P99 stays within --budget-ms; identity's
levels show what the transport alone sustains.

Needs torch in the server's Python (pip install -c constraints.txt torch) and the venv's locust.
On a GPU node with no registry access: see bench/serving/README.md for what to carry.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

from colibri import checkpoint
from colibri.serving import launcher

REPO_ROOT = Path(__file__).resolve().parents[2]
LOADTEST = REPO_ROOT / "loadtest" / "run.py"

BASELINES = REPO_ROOT / "bench" / "serving" / "model_repository"
MODELS = ("identity", "torch_moe", "colibri_moe")


def write_demo(path: Path, E: int, k: int, H: int, F: int, dtype: str) -> None:
    """A demo checkpoint; bf16 ones drawn with torch on the GPU when there is one (a Mixtral-size layer
    is 1.4 G weights: seconds there, minutes with numpy on the host), else checkpoint.write_demo."""
    try:
        import torch
        on_gpu = dtype == "bf16" and torch.cuda.is_available()
    except ImportError:
        on_gpu = False
    if not on_gpu:
        checkpoint.write_demo(path, experts=E, top_k=k, hidden=H, intermediate=F, dtype=dtype)
        return
    import numpy as np
    config = checkpoint.demo_config(experts=E, top_k=k, hidden=H, intermediate=F, dtype="bf16")
    generator = torch.Generator(device="cuda").manual_seed(0)
    packed = np.empty((E, 3 * F * H), np.uint16)
    for e in range(E):  # weights ~ N(0, 1/fan_in), as checkpoint.write_demo draws them
        gate_up = torch.randn(2 * F * H, generator=generator, device="cuda") / H ** 0.5
        down = torch.randn(H * F, generator=generator, device="cuda") / F ** 0.5
        packed[e] = torch.cat([gate_up, down]).to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    router = (torch.randn(E, H, generator=generator, device="cuda") / H ** 0.5).cpu().numpy()
    checkpoint.save(path, config, packed, router, None, {"source": "bench/serving/compare.py demo (torch, seed 0)"})


def build_repository(root: Path, device: str, dtype: str, instances: int = 1) -> Path:
    """root/models: colibri_moe linked from the repository, torch_moe and identity with its config."""
    models = root / "models"
    models.mkdir()
    colibri = REPO_ROOT / "model_repository" / launcher.MODEL_NAME
    (models / launcher.MODEL_NAME).symlink_to(colibri)
    config = (colibri / "config.pbtxt").read_text()
    for name in ("torch_moe", "identity"):
        (models / name).mkdir()
        renamed = config.replace(f'name: "{launcher.MODEL_NAME}"', f'name: "{name}"', 1)
        if renamed == config:
            raise RuntimeError(f"{colibri}/config.pbtxt has no name: \"{launcher.MODEL_NAME}\" line to rename")
        (models / name / "config.pbtxt").write_text(launcher.configure_model(renamed, device, dtype, instances))
        (models / name / "1").symlink_to(BASELINES / name / "1")
    return models


class Server:
    """`python -m colibri serve` on the repository, on free ports, stopped on exit."""

    def __init__(self, repository, weights, device, dtype, log_path, cuda_pool_mb=launcher.DEFAULT_CUDA_POOL_MB,
                 instances=1):
        self.http_port, self.grpc_port, self.metrics_port = launcher.free_ports(3)
        self.log = open(log_path, "w")
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "colibri", "serve", "--model-repository", str(repository), "--weights", str(weights),
             "--device", device, "--dtype", dtype, "--http-port", str(self.http_port),
             "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
             "--cuda-memory-pool-mb", str(cuda_pool_mb), "--instances", str(instances)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        self.host = f"http://127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"

    def __enter__(self):
        try:
            for model in MODELS:
                launcher.wait_until_ready(self.launcher, f"{self.host}/v2/models/{model}/ready", 600)
        except launcher.ServeError as exc:
            self.__exit__()
            raise RuntimeError(f"{exc}; server log: {self.log.name}") from None
        return self

    def __exit__(self, *_exc):
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)  # the launcher forwards it and waits for the server
            try:
                self.launcher.wait(90)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait()
        self.log.close()


def run_load(out: Path, **options) -> dict:
    """One run of loadtest/run.py, through its command line (the load test's interface; Locust patches
    the standard library of whatever imports it), into `out`; its summary.json."""
    command = [sys.executable, str(LOADTEST), "--out", str(out), "--quiet"]
    for name, value in options.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    result = subprocess.run(command, capture_output=True, text=True)
    summary_path = out / "summary.json"
    if result.returncode not in (0, 1) or not summary_path.exists():  # 1: the run had failed requests
        raise RuntimeError(f"loadtest/run.py exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return json.loads(summary_path.read_text())


def compare(runs):
    """Rows of P99 ratios colibri/torch and the identity floor, per mix, protocol and profile."""
    index = {(r["mix"], r["protocol"], r["profile"], r["model"]): r for r in runs}
    rows = []
    for (mix, protocol, profile, model) in index:
        if model != "colibri_moe" or (mix, protocol, profile, "torch_moe") not in index:
            continue
        ours, torch_ = index[(mix, protocol, profile, "colibri_moe")], index[(mix, protocol, profile, "torch_moe")]
        empty = index.get((mix, protocol, profile, "identity"))
        rows.append({
            "mix": mix, "protocol": protocol, "profile": profile,
            "p99_colibri_ms": ours["p99_ms"], "p99_torch_ms": torch_["p99_ms"],
            "p99_ratio_colibri_over_torch": ours["p99_ms"] / torch_["p99_ms"],
            "p99_identity_ms": empty and empty["p99_ms"],
            "identity_share_of_colibri_p99": empty and empty["p99_ms"] / ours["p99_ms"],
        })
    return rows


COLORS = {"identity": "tab:gray", "torch_moe": "tab:red", "colibri_moe": "tab:blue"}
STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


def model_stats(host: str, model: str, metrics_url: str = None) -> dict:
    """tritonserver's cumulative statistics of one model (the statistics extension), and from
    metrics_url (/metrics) the sum and count of its colibri_forward_seconds where it has them."""
    with urllib.request.urlopen(f"{host}/v2/models/{model}/stats", timeout=10) as reply:
        stats = json.load(reply)["model_stats"][0]
    stages = stats["inference_stats"]
    # inference_count counts batch rows (tokens here); a request is one success
    counts = {"requests": int(stages["success"]["count"]), "executions": int(stats["execution_count"])}
    if metrics_url:
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            counts.update(forward_seconds(reply.read().decode(), model))
    return {**counts, **{stage: int(stages[stage]["ns"]) for stage in STAGES}}


def forward_seconds(metrics_text: str, model: str) -> dict:
    """{"forward_s": sum, "forward_n": count} of model's colibri_forward_seconds histogram in a
    Prometheus text page; {} if the model reports none (torch_moe, identity)."""
    found = {}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        if name in ("colibri_forward_seconds_sum", "colibri_forward_seconds_count") and f'model="{model}"' in rest:
            found["forward_s" if name.endswith("sum") else "forward_n"] = float(line.rsplit(" ", 1)[1])
    return found if len(found) == 2 else {}


def server_side(before: dict, after: dict) -> dict:
    """What the server did between two snapshots: requests per execution (the dynamic batches' size)
    and, per request, the mean time in each stage. An execution's compute time counts once for each
    request it holds, so compute_infer is the time of the batch a request ran in."""
    n = after["requests"] - before["requests"]
    runs = after["executions"] - before["executions"]
    out = {"requests": n, "executions": runs, "requests_per_execution": n / runs if runs else None}
    for stage in STAGES:
        out[f"{stage}_ms"] = (after[stage] - before[stage]) / n / 1e6 if n else None
    # colibri_moe's own span per batch (joining, the layer, the answers, the wait for the GPU): the
    # rest of an execution's compute_infer is the Python backend's work and model.py's input checks.
    forwards = after.get("forward_n", 0) - before.get("forward_n", 0)
    out["forward_ms_per_execution"] = ((after["forward_s"] - before["forward_s"]) / forwards * 1e3
                                       if forwards > 0 else None)
    return out


def server_table(server_runs) -> str:
    lines = ["inside tritonserver, per request (mean ms; compute_infer is its whole batch's time); "
             "forward: colibri_moe's span per batch (colibri_forward_seconds):",
             f"{'run':44} {'req/exec':>8} {'queue':>8} {'input':>8} {'infer':>8} {'output':>8} {'forward':>8}"]
    for r in server_runs:
        cells = [f"{r[f'{stage}_ms']:8.2f}" if r[f"{stage}_ms"] is not None else f"{'-':>8}" for stage in STAGES]
        forward = r.get("forward_ms_per_execution")
        cells.append(f"{'-':>8}" if forward is None else f"{forward:8.2f}")
        per = "-" if r["requests_per_execution"] is None else f"{r['requests_per_execution']:.2f}"
        lines.append(f"{r['run']:44} {per:>8} " + " ".join(cells))
    return "\n".join(lines)


def sweep_result(model, summary, profile, budget_ms) -> dict:
    """Per user count: the budget profile's P99 and the throughput of all profiles together; and the
    highest throughput at a level whose P99 is within the budget."""
    levels = {}
    for r in summary["by_users"]:
        level = levels.setdefault(r["users"], {"users": r["users"], "rps": 0.0, "tokens_per_s": 0.0, "failures": 0,
                                               "p99_ms": None, "p50_ms": None})
        level["rps"] += r["throughput_rps"] or 0.0
        level["tokens_per_s"] += r["tokens_per_s"] or 0.0
        level["failures"] += r["failures"]
        if r["profile"] == profile:
            level["p99_ms"], level["p50_ms"] = r["p99_ms"], r["p50_ms"]
    levels = [levels[u] for u in sorted(levels)]
    within = [lv for lv in levels if lv["p99_ms"] is not None and lv["p99_ms"] <= budget_ms and not lv["failures"]]
    best = max(within, key=lambda lv: lv["tokens_per_s"], default=None)
    # When even the top level kept within the budget, the sweep ended before the model's limit: its
    # best is a lower bound of what it sustains.
    capped = bool(levels) and best is levels[-1]
    return {"model": model, "levels": levels, "best": best, "lower_bound": capped}


def sweep_table(sweeps, profile, budget_ms) -> str:
    lines = [f"throughput sweep ({profile} P99 budget {budget_ms:g} ms):",
             f"{'model':12} {'users':>5} {'req/s':>8} {'tokens/s':>10} {profile + ' P50':>12} {profile + ' P99':>12} "
             f"{'fails':>5}"]
    for sw in sweeps:
        for lv in sw["levels"]:
            p50 = "-" if lv["p50_ms"] is None else f"{lv['p50_ms']:.1f}"
            p99 = "-" if lv["p99_ms"] is None else f"{lv['p99_ms']:.1f}"
            mark = " <- best within budget" if lv is sw["best"] else ""
            lines.append(f"{sw['model']:12} {lv['users']:5d} {lv['rps']:8.1f} {lv['tokens_per_s']:10.0f} {p50:>12} "
                         f"{p99:>12} {lv['failures']:5d}{mark}")
    best = {sw["model"]: sw["best"] for sw in sweeps}
    bound = {sw["model"]: sw["lower_bound"] for sw in sweeps}
    for model in [m for m in bound if bound[m]]:
        lines.append(f"{model}: P99 stayed within budget up to the sweep's last level: its best is a lower bound")
    if best.get("colibri_moe") and best.get("torch_moe"):
        ours, theirs = best["colibri_moe"], best["torch_moe"]
        kind = ("at least " if bound["colibri_moe"] and not bound["torch_moe"] else
                "(inconclusive: torch's is a lower bound) " if bound["torch_moe"] else "")
        lines.append(f"highest throughput within budget, colibri/torch: {kind}"
                     f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x tokens/s ({ours['rps'] / theirs['rps']:.2f}x requests/s)")
    else:
        for model, level in best.items():
            found = "no level within budget" if level is None else f"{level['tokens_per_s']:.0f} tokens/s"
            lines.append(f"highest throughput within budget, {model}: {found}")
    return "\n".join(lines)


def plot_sweeps(sweeps, path: Path, title: str, budget_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6))
    for sw in sweeps:
        points = [(lv["tokens_per_s"], lv["p99_ms"], lv["users"]) for lv in sw["levels"] if lv["p99_ms"] is not None]
        if not points:
            continue
        x, y, users = zip(*points)
        ax.plot(x, y, "o-", color=COLORS.get(sw["model"]), label=sw["model"])
        for xi, yi, u in points:
            ax.annotate(str(u), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(budget_ms, color="k", linestyle="--", linewidth=1, label=f"budget {budget_ms:g} ms")
    ax.set(xlabel="throughput (tokens/s, all profiles)", ylabel="P99 latency ms (labels: users)", yscale="log")
    ax.legend(fontsize=8)
    ax.set_title(textwrap.fill(title, 95), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(runs, ratios) -> str:
    lines = [f"{'mix':14} {'proto':5} {'profile':8} {'model':12} {'requests':>8} {'fails':>5} {'P50 ms':>8} "
             f"{'P95 ms':>8} {'P99 ms':>8} {'req/s':>7}"]
    for r in runs:
        lines.append(f"{r['mix']:14} {r['protocol']:5} {r['profile']:8} {r['model']:12} {r['requests']:8d} "
                     f"{r['failures']:5d} {r['p50_ms']:8.2f} {r['p95_ms']:8.2f} {r['p99_ms']:8.2f} {r['throughput_rps']:7.1f}")
    lines.append("")
    lines.append(f"{'mix':14} {'proto':5} {'profile':8} {'P99 colibri/torch':>18} {'P99 identity ms':>16} "
                 f"{'identity/colibri P99':>21}")
    for r in ratios:
        share = "-" if r["identity_share_of_colibri_p99"] is None else f"{r['identity_share_of_colibri_p99']:.2f}"
        empty = "-" if r["p99_identity_ms"] is None else f"{r['p99_identity_ms']:.2f}"
        lines.append(f"{r['mix']:14} {r['protocol']:5} {r['profile']:8} {r['p99_ratio_colibri_over_torch']:18.3f} "
                     f"{empty:>16} {share:>21}")
    return "\n".join(lines)


def plot(runs, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["mix"], r["protocol"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (mix, protocol) in zip(axes[0], panels):
        profiles = sorted({r["profile"] for r in runs if (r["mix"], r["protocol"]) == (mix, protocol)})
        width = 0.8 / len(MODELS)
        for m, model in enumerate(MODELS):
            for p, profile in enumerate(profiles):
                r = next((r for r in runs if (r["mix"], r["protocol"], r["profile"], r["model"])
                          == (mix, protocol, profile, model)), None)
                if r is None:
                    continue
                x = p + (m - (len(MODELS) - 1) / 2) * width
                ax.bar(x, r["p99_ms"], width, color=COLORS[model], label=model if p == 0 else None)
                ax.plot([x, x], [r["p50_ms"], r["p95_ms"]], "k_", markersize=8)
        ax.set_xticks(range(len(profiles)), profiles)
        ax.set(title=f"{mix}, {protocol}", ylabel="latency ms (bar P99; ticks P50, P95)", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--weights", type=Path, help="a packed checkpoint (*.colibri.safetensors)")
    source.add_argument("--shape", default="8,2,256,512",
                        help="E,k,H,F of a demo checkpoint written for the run (default: the demo's)")
    p.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="of a demo checkpoint")
    p.add_argument("--device", default="auto", choices=sorted(launcher.INSTANCE_KINDS))
    p.add_argument("--dtype", default="fp32", choices=sorted(launcher.TRITON_DTYPES), help="activations on the wire")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--time", default="30s", help="Locust run time of each model's run")
    p.add_argument("--mixes", default="decode-heavy,prefill-heavy")
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument("--prefill-tokens", default="128-2048")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--processes", type=int, default=0, help="Locust worker processes (0: one)")
    p.add_argument("--load", default="closed", help="closed, auto[:F] or requests per second in all (see above)")
    p.add_argument("--sweep", default="", help="user counts of the throughput sweep, e.g. 4,8,16,32,64")
    p.add_argument("--sweep-mix", default="prefill-heavy")
    p.add_argument("--sweep-protocol", default="grpc")
    p.add_argument("--step-time", type=float, default=10.0, help="seconds per user count of the sweep")
    p.add_argument("--budget-ms", type=float, default=200.0, help="P99 budget of the sweep")
    p.add_argument("--budget-profile", default="prefill", choices=("prefill", "decode"))
    p.add_argument("--cuda-memory-pool-mb", type=int, default=launcher.DEFAULT_CUDA_POOL_MB,
                   help="passed to colibri serve (0: Triton's default of 64 MB)")
    p.add_argument("--instances", type=launcher.positive_int, default=1, help="instances per GPU of every model")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "serving")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="colibri-compare-") as tmp:
        tmp = Path(tmp)
        if args.weights is None:
            E, k, H, F = (int(v) for v in args.shape.split(","))
            args.weights = tmp / "compare.colibri.safetensors"
            started = time.monotonic()
            write_demo(args.weights, E, k, H, F, args.weight_dtype)
            print(f"compare: wrote a demo checkpoint {args.shape} ({args.weights.stat().st_size / 2**30:.2f} GiB) "
                  f"in {time.monotonic() - started:.1f} s", flush=True)
        config = checkpoint.load(args.weights).config
        shape = (f"E={config.num_experts} k={config.top_k} H={config.hidden_size} F={config.intermediate_size} "
                 f"{config.weight_dtype} weights, {args.dtype} activations, device {args.device}")
        print(f"compare: {shape}; {args.users} users, {args.time} per run", flush=True)
        runs, calibrations, sweeps, server_runs = [], [], [], []
        with Server(build_repository(tmp, args.device, args.dtype, args.instances), args.weights, args.device,
                    args.dtype, args.out / "tritonserver.log", args.cuda_memory_pool_mb, args.instances) as server:
            def load(folder, model, mix, protocol, rate=0.0, steps=""):
                started = time.monotonic()
                before = model_stats(server.host, model, server.metrics_url)
                summary = run_load(
                    args.out / folder, host=server.host, grpc_url=server.grpc_url, model=model, users=args.users,
                    time=args.time, mix=mix, protocols=protocol, prefill_tokens=args.prefill_tokens,
                    hidden=config.hidden_size, processes=args.processes, rate=rate, steps=steps,
                    step_time=args.step_time)
                server_runs.append({"run": folder, "model": model,
                                    **server_side(before, model_stats(server.host, model, server.metrics_url))})
                t = summary["total"]
                print(f"  {folder}: {t['requests']} requests, {t['failures']} failed, P99 {t['p99_ms']:.2f} ms, "
                      f"{t['throughput_rps']:.1f} req/s ({time.monotonic() - started:.0f} s)", flush=True)
                return summary

            for mix in filter(None, args.mixes.split(",")):
                for protocol in filter(None, args.protocols.split(",")):
                    total_rps = 0.0
                    if args.load.startswith("auto"):
                        fraction = float(args.load.partition(":")[2] or 0.7)
                        reached = load(f"{mix}-{protocol}-torch_moe-closed", "torch_moe", mix, protocol)
                        total_rps = fraction * reached["total"]["throughput_rps"]
                        calibrations.append({"mix": mix, "protocol": protocol, "fraction": fraction,
                                             "torch_closed_loop_rps": reached["total"]["throughput_rps"],
                                             "torch_closed_loop_p99_ms": reached["total"]["p99_ms"],
                                             "offered_rps": total_rps})
                    elif args.load != "closed":
                        total_rps = float(args.load)
                    for model in models:
                        summary = load(f"{mix}-{protocol}-{model}", model, mix, protocol, rate=total_rps / args.users)
                        for group in summary["groups"]:
                            runs.append({"mix": mix, "model": model, "offered_rps": total_rps or None, **group})
            if args.sweep:
                # identity too: its ceiling is what the transport alone sustains
                for model in models:
                    summary = load(f"sweep-{args.sweep_mix}-{args.sweep_protocol}-{model}", model, args.sweep_mix,
                                   args.sweep_protocol, steps=args.sweep)
                    sweeps.append(sweep_result(model, summary, args.budget_profile, args.budget_ms))
            # colibri_forward_seconds and the expert counters, for the record
            with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
                (args.out / "metrics.txt").write_bytes(reply.read())
    ratios = compare(runs)
    result = {"shape": shape, "weights": str(args.weights), "users": args.users, "time": args.time,
              "load": args.load, "prefill_tokens": args.prefill_tokens, "host_cpus": os.cpu_count(),
              "calibrations": calibrations, "runs": runs, "ratios": ratios, "sweeps": sweeps,
              "server": server_runs}
    (args.out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    load_text = {"closed": "closed loop"}.get(args.load, f"offered load {args.load}")
    if runs:
        plot(runs, args.out / "compare.png", f"{shape}; {args.users} users, {args.time} each, {load_text}")
        print(table(runs, ratios))
    if sweeps:
        plot_sweeps(sweeps, args.out / "sweep.png", f"{shape}; {args.sweep_mix} over {args.sweep_protocol}, "
                    f"users {args.sweep}, {args.step_time:g} s each; budget {args.budget_profile} P99 "
                    f"<= {args.budget_ms:g} ms", args.budget_ms)
        print(sweep_table(sweeps, args.budget_profile, args.budget_ms))
    if server_runs:
        print(server_table(server_runs))
    print(f"compare: {args.out}/compare.json" + (", compare.png" if runs else "") + (", sweep.png" if sweeps else ""))
    failed = sum(r["failures"] for r in runs) + sum(level["failures"] for sw in sweeps for level in sw["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
