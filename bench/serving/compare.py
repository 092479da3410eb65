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
        --mixes decode-heavy,prefill-heavy --protocols grpc,http --device auto --out runs/serving]

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
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "loadtest"))
import run as loadtest  # noqa: E402  (loadtest/run.py)

from colibri import checkpoint, serve  # noqa: E402

BASELINES = REPO_ROOT / "bench" / "serving" / "model_repository"
MODELS = ("identity", "torch_moe", "colibri_moe")


def build_repository(root: Path, device: str, dtype: str) -> Path:
    """root/models: colibri_moe linked from the repository, torch_moe and identity with its config."""
    models = root / "models"
    models.mkdir()
    colibri = REPO_ROOT / "model_repository" / serve.MODEL_NAME
    (models / serve.MODEL_NAME).symlink_to(colibri)
    config = (colibri / "config.pbtxt").read_text()
    for name in ("torch_moe", "identity"):
        (models / name).mkdir()
        renamed = config.replace(f'name: "{serve.MODEL_NAME}"', f'name: "{name}"', 1)
        if renamed == config:
            raise RuntimeError(f"{colibri}/config.pbtxt has no name: \"{serve.MODEL_NAME}\" line to rename")
        (models / name / "config.pbtxt").write_text(serve.configure_model(renamed, device, dtype))
        (models / name / "1").symlink_to(BASELINES / name / "1")
    return models


class Server:
    """`python -m colibri serve` on the repository, on free ports, stopped on exit."""

    def __init__(self, repository, weights, device, dtype, log_path):
        self.http_port, self.grpc_port, metrics_port = serve.free_ports(3)
        self.log = open(log_path, "w")
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "colibri", "serve", "--model-repository", str(repository), "--weights", str(weights),
             "--device", device, "--dtype", dtype, "--http-port", str(self.http_port),
             "--grpc-port", str(self.grpc_port), "--metrics-port", str(metrics_port)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        self.host = f"http://127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"

    def __enter__(self):
        try:
            for model in MODELS:
                serve.wait_until_ready(self.launcher, f"{self.host}/v2/models/{model}/ready", 600)
        except serve.ServeError as exc:
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
    colors = {"identity": "tab:gray", "torch_moe": "tab:red", "colibri_moe": "tab:blue"}
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
                ax.bar(x, r["p99_ms"], width, color=colors[model], label=model if p == 0 else None)
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
    p.add_argument("--device", default="auto", choices=sorted(serve.INSTANCE_KINDS))
    p.add_argument("--dtype", default="fp32", choices=sorted(serve.TRITON_DTYPES), help="activations on the wire")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--time", default="30s", help="Locust run time of each model's run")
    p.add_argument("--mixes", default="decode-heavy,prefill-heavy")
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument("--prefill-tokens", default="128-2048")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--processes", type=int, default=0, help="Locust worker processes (0: one)")
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
            checkpoint.write_demo(args.weights, experts=E, top_k=k, hidden=H, intermediate=F, dtype=args.weight_dtype)
        config = checkpoint.load(args.weights).config
        shape = (f"E={config.num_experts} k={config.top_k} H={config.hidden_size} F={config.intermediate_size} "
                 f"{config.weight_dtype} weights, {args.dtype} activations, device {args.device}")
        print(f"compare: {shape}; {args.users} users, {args.time} per run", flush=True)
        runs = []
        with Server(build_repository(tmp, args.device, args.dtype), args.weights, args.device, args.dtype,
                    args.out / "tritonserver.log") as server:
            for mix in args.mixes.split(","):
                for protocol in args.protocols.split(","):
                    for model in models:
                        started = time.monotonic()
                        summary = loadtest.run_load(
                            args.out / f"{mix}-{protocol}-{model}", host=server.host, grpc_url=server.grpc_url,
                            model=model, users=args.users, run_time=args.time, mix=mix, protocols=[protocol],
                            prefill_tokens=args.prefill_tokens, hidden=config.hidden_size,
                            processes=args.processes, quiet=True)
                        for group in summary["groups"]:
                            runs.append({"mix": mix, "model": model, **group})
                        print(f"  {mix} {protocol} {model}: {summary['total']['requests']} requests, "
                              f"{summary['total']['failures']} failed, P99 {summary['total']['p99_ms']:.2f} ms "
                              f"({time.monotonic() - started:.0f} s)", flush=True)
    ratios = compare(runs)
    result = {"shape": shape, "weights": str(args.weights), "users": args.users, "time": args.time,
              "prefill_tokens": args.prefill_tokens, "host_cpus": os.cpu_count(), "runs": runs, "ratios": ratios}
    (args.out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, args.out / "compare.png", f"{shape}; {args.users} users, {args.time} each")
    print(table(runs, ratios))
    print(f"compare: {args.out}/compare.json, compare.png")
    return 1 if any(r["failures"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
