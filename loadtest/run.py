"""Headless Locust run against a Triton server that is already up (`make serve`), then the summary:
Locust's CSVs (--csv, --csv-full-history), summary.json, latency.png and a table printed last.

    python loadtest/run.py [--users 16 --time 60s --mix decode-heavy --protocols grpc,http ...]
    make loadtest LOADTEST_USERS=16 LOADTEST_TIME=60s LOADTEST_PROFILE=decode-heavy

The default workload times one layer per request (its latency is the layer's). `--workload generate`
times a whole model: an attention tier in each load-generating process (loadtest/generate.py) runs
each prompt through every layer to its first token (TTFT) and --new-tokens more (TPOT), its experts
in-process, over gRPC or CUDA shared memory, or transformers' own (eager):

    python loadtest/run.py --workload generate --model HF_DIR --tier-protocol grpc --arrival-rate 2 --time 60s
    python loadtest/run.py --workload generate --model HF_DIR --tier-protocol inprocess --weights PACKED_DIR ...

Arrivals are open-loop by default (Poisson at --arrival-rate requests per second in all, TTFT from
each scheduled arrival), or --arrivals closed with --users. `--tier module:function` builds the tier
instead (then no model folder is needed). One protocol per run; loadtest/sweep.py runs several rates.

It starts no server: when the run needs one (single-layer runs; generate over grpc or cudashm) and
none is ready at --host, it says so and exits 2. Exit status 1 when any request failed or the
gathered samples do not add up to Locust's own count. bench/serving/compare.py runs its loads
through run_load().
"""
import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import summary as load_summary  # noqa: E402  (beside this file)

LOCUSTFILE = HERE / "locustfile.py"
USER_CLASSES = {"grpc": "GrpcUser", "http": "HttpUser", "cudashm": "CudaShmUser"}  # cudashm: a GPU and cupy
GRPC_PORT = 8001  # as loadtest/locustfile.py's grpc_address


def grpc_address(host: str, grpc_url: str = "") -> str:
    """The gRPC endpoint a run uses: grpc_url, else host's host on port 8001 (the locustfile's rule,
    which this file cannot import: importing Locust patches the standard library for gevent)."""
    if grpc_url:
        return grpc_url
    hostname = urlsplit(host if "://" in host else f"http://{host}").hostname or "127.0.0.1"
    return f"[{hostname}]:{GRPC_PORT}" if ":" in hostname else f"{hostname}:{GRPC_PORT}"


class NotReady(RuntimeError):
    pass


def check_ready(host: str, model: str) -> None:
    """Raises NotReady unless Triton at host (http://HOST:PORT) is up and serves model."""
    for path, what in (("/v2/health/ready", "Triton"), (f"/v2/models/{model}/ready", f"model {model}")):
        try:
            with urllib.request.urlopen(host.rstrip("/") + path, timeout=5) as reply:
                if reply.status == 200:
                    continue
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        raise NotReady(f"{what} is not ready at {host}: start a server first (`make serve` in another "
                       f"terminal) or point LOADTEST_HOST at one")


def check_grpc_ready(url: str, model: str, given: bool) -> None:
    """Raises NotReady unless model is ready over gRPC at url (host:port), naming how to set it."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(url)
    try:
        if client.is_model_ready(model, client_timeout=5):
            return
        problem = f"model {model} is not ready"
    except InferenceServerException as exc:
        problem = f"no answer ({str(exc).splitlines()[0][:120]})"
    finally:
        client.close()
    how = "" if given else " (the --host host, port 8001)"
    raise NotReady(f"gRPC at {url}{how}: {problem}; set LOADTEST_GRPC_URL=HOST:PORT (--grpc-url) to the "
                   f"server's gRPC endpoint, or leave grpc out of LOADTEST_PROTOCOLS")


def run_load(out: Path, *, host: str, grpc_url: str = "", model: str = "colibri_moe", users: int = 8,
             run_time: str = "30s", mix: str = "decode-heavy", protocols=("grpc", "http"),
             prefill_tokens: str = "128-2048", hidden: int = 0, steps: str = "", step_time: float = 10.0,
             processes: int = 0, rate: float = 0.0, quiet: bool = False, title: str = "") -> dict:
    """One Locust run into `out` (emptied of earlier samples first); returns the summary.

    steps ("1,4,16") replaces users/run_time by a stepped ramp of step_time seconds each.
    processes > 1 runs that many Locust worker processes (--processes), for when one load-generator
    core is the bottleneck. rate > 0: each user sends that many requests per second at most (a fixed
    offered load of users * rate while the server keeps up), instead of a closed loop."""
    out = out.resolve()  # locust runs in this folder
    out.mkdir(parents=True, exist_ok=True)
    command = locust_command(out, [USER_CLASSES[p] for p in protocols], host=host, users=users, run_time=run_time,
                             quiet=quiet)
    command += ["--model", model, "--mix", mix, "--prefill-tokens", prefill_tokens]
    grpc_url = grpc_address(host, grpc_url)
    if set(protocols) & {"grpc", "cudashm"}:
        command += ["--grpc-url", grpc_url]
    if hidden:
        command += ["--hidden", str(hidden)]
    if rate > 0:
        command += ["--rate", repr(float(rate))]
    if processes > 1:
        command += ["--processes", str(processes)]
    env = dict(os.environ)
    env.pop("LOADTEST_STEPS", None)
    if steps:
        env.update(LOADTEST_STEPS=steps, LOADTEST_STEP_TIME=str(step_time))
    result = subprocess.run(command, env=env, cwd=HERE, capture_output=quiet, text=True)
    check_samples(out, result, quiet)
    summary = load_summary.write(out, "locust", title or (
        f"{model}, users stepped {steps} ({step_time:g} s each)" if steps else f"{model}, {users} users, {run_time}")
        + f", mix {mix}")
    summary.update(model=model, users=users, mix=mix, protocols=list(protocols), rate_per_user=rate,
                   host=host, grpc_url=grpc_url if set(protocols) & {"grpc", "cudashm"} else None,
                   locust_exit_status=result.returncode)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def locust_command(out: Path, user_classes, *, host: str, users: int, run_time: str, quiet: bool) -> list:
    """Locust's command line of a headless run into `out`, emptied of an earlier run's files first."""
    for stale in [*out.glob("samples-*.csv"), *out.glob("locust*"), *out.glob("settings.json"), *out.glob("unserved-*.json")]:
        stale.unlink()
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *user_classes,
            "--headless", "--host", host, "--users", str(users), "--spawn-rate", str(users),
            "--run-time", run_time, "--stop-timeout", "30",
            "--csv", str(out / "locust"), "--csv-full-history", "--json-file", str(out / "locust_final"),
            "--samples-dir", str(out), "--loglevel", "WARNING" if quiet else "INFO"]


def check_samples(out: Path, result, quiet: bool) -> None:
    if not list(out.glob("samples-*.csv")):
        raise RuntimeError(f"locust wrote no samples (exit status {result.returncode})"
                           + (f":\n{result.stdout[-3000:]}{result.stderr[-3000:]}" if quiet else ""))


def run_generate(out: Path, *, tier_protocol: str = "inprocess", tier: str = "", hf_model: str = "",
                 weights: str = "", device: str = "cpu", dtype: str = "", warmup: int = 1,
                 host: str = "http://127.0.0.1:8000", grpc_url: str = "",
                 triton_model: str = "colibri_moe", arrivals: str = "open", arrival_rate: float = 1.0, users: int = 0,
                 run_time: str = "60s", prefill_tokens: str = "128-2048", new_tokens: int = 16, processes: int = 0,
                 seed: int = 0, vocab_size: int = 0, quiet: bool = False, title: str = "", env: dict = None) -> dict:
    """One generate run (GenerateUser) into `out`; returns the summary. users: closed-loop users, or
    open-loop arrival streams (default: one per process, the arrival rate split evenly over them).
    tier: "module:function", importable by Locust's processes (loadtest/ is on their path; put the
    module's folder on PYTHONPATH through `env` otherwise)."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    users = users or max(1, processes)
    command = locust_command(out, ["GenerateUser"], host=host, users=users, run_time=run_time, quiet=quiet)
    command += ["--tier-protocol", tier_protocol, "--tier-device", device, "--tier-warmup", str(warmup),
                "--arrivals", arrivals,
                "--arrival-rate", repr(float(arrival_rate)), "--prefill-tokens", prefill_tokens,
                "--new-tokens", str(new_tokens), "--seed", str(seed), "--model", triton_model]
    for flag, value in (("--tier", tier), ("--tier-model", hf_model), ("--weights", weights), ("--tier-dtype", dtype),
                        ("--grpc-url", grpc_url), ("--vocab-size", vocab_size)):
        if value:
            command += [flag, str(value)]
    if processes > 1:
        command += ["--processes", str(processes)]
    run_env = {**os.environ, **(env or {})}
    run_env.pop("LOADTEST_STEPS", None)
    result = subprocess.run(command, env=run_env, cwd=HERE, capture_output=quiet, text=True)
    check_samples(out, result, quiet)
    rate = f"open loop, {arrival_rate:g} req/s offered" if arrivals == "open" else f"closed loop, {users} users"
    summary = load_summary.write(out, "locust", title or f"generate, {tier_protocol}, {rate}, {run_time}")
    summary.update(tier_protocol=tier_protocol, users=users, processes=processes, host=host,
                   locust_exit_status=result.returncode)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def parse_args(argv):
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default=env("LOADTEST_HOST", "http://127.0.0.1:8000"), help="Triton HTTP endpoint")
    p.add_argument("--grpc-url", default=env("LOADTEST_GRPC_URL", ""),
                   help="gRPC host:port (default: the --host host, port 8001)")
    p.add_argument("--workload", default=env("LOADTEST_WORKLOAD", "layer"), choices=("layer", "generate"),
                   help="layer: each request one layer (Triton); generate: whole-model requests through an "
                        "attention tier")
    p.add_argument("--model", default="",
                   help="layer: the Triton model [colibri_moe, LOADTEST_MODEL]; generate: the Hugging Face model "
                        "folder [LOADTEST_TIER_MODEL]")
    g = p.add_argument_group("generate workload")
    g.add_argument("--tier-protocol", default=env("LOADTEST_TIER_PROTOCOL", "inprocess"),
                   help="inprocess, grpc, cudashm, eager (transformers' own MoE blocks) or fake")
    g.add_argument("--tier", default=env("LOADTEST_TIER", ""), help="module:function building the tier instead")
    g.add_argument("--weights", default=env("LOADTEST_WEIGHTS", ""), help="the packed folder (inprocess)")
    g.add_argument("--device", default=env("LOADTEST_TIER_DEVICE", "cpu"), help="the attention tier's device")
    g.add_argument("--dtype", default=env("LOADTEST_TIER_DTYPE", ""),
                   help="the attention tier's torch dtype, e.g. bfloat16 (default: the model's)")
    g.add_argument("--warmup", type=int, default=int(env("LOADTEST_TIER_WARMUP", "1")),
                   help="untimed requests per process before the run")
    g.add_argument("--triton-model", default=env("LOADTEST_MODEL", "colibri_moe"),
                   help="the expert tier's Triton model (grpc, cudashm)")
    g.add_argument("--arrivals", default=env("LOADTEST_ARRIVALS", "open"), choices=("open", "closed"))
    g.add_argument("--arrival-rate", type=float, default=float(env("LOADTEST_ARRIVAL_RATE", "1")),
                   help="open loop: requests per second offered in all")
    g.add_argument("--new-tokens", type=int, default=int(env("LOADTEST_NEW_TOKENS", "16")),
                   help="tokens after the first (TPOT)")
    g.add_argument("--seed", type=int, default=int(env("LOADTEST_SEED", "0")))
    g.add_argument("--vocab-size", type=int, default=int(env("LOADTEST_VOCAB_SIZE", "0")),
                   help="prompt ids below this (default: the tier's vocabulary)")
    p.add_argument("--users", type=int, default=int(env("LOADTEST_USERS", "0")),
                   help="users [16]; generate: closed-loop users, or open-loop streams [one per process]")
    p.add_argument("--time", default=env("LOADTEST_TIME", "60s"), help="Locust run time (30s, 2m)")
    p.add_argument("--mix", default=env("LOADTEST_PROFILE", "decode-heavy"),
                   help="decode-heavy, prefill-heavy, decode, prefill, or weights like decode:9,prefill:1")
    p.add_argument("--protocols", default=env("LOADTEST_PROTOCOLS", "grpc,http"))
    p.add_argument("--prefill-tokens", default=env("LOADTEST_PREFILL_TOKENS", "128-2048"))
    p.add_argument("--steps", default=env("LOADTEST_STEPS", ""),
                   help="stepped ramp, e.g. 1,4,16,64 users (replaces --users/--time)")
    p.add_argument("--step-time", type=float, default=float(env("LOADTEST_STEP_TIME", "15")))
    p.add_argument("--processes", type=int, default=int(env("LOADTEST_PROCESSES", "0")),
                   help="Locust worker processes (gevent in each); 0: one process")
    p.add_argument("--hidden", type=int, default=0, help="H, when the model's config does not give it")
    p.add_argument("--quiet", action="store_true", help="Locust's own output only on failure")
    p.add_argument("--rate", type=float, default=float(env("LOADTEST_RATE", "0")),
                   help="requests per second per user: a fixed offered load (0: closed loop)")
    p.add_argument("--out", type=Path, default=Path(env("LOADTEST_OUT", "runs/loadtest")))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.workload == "generate":
        return main_generate(args)
    args.model = args.model or os.environ.get("LOADTEST_MODEL", "colibri_moe")
    args.users = args.users or 16
    protocols = [p for p in args.protocols.split(",") if p]
    unknown = set(protocols) - set(USER_CLASSES)
    if unknown or not protocols:
        print(f"loadtest: --protocols takes {','.join(USER_CLASSES)}, got {args.protocols!r}", file=sys.stderr)
        return 2
    if not args.rate >= 0:
        print(f"loadtest: --rate {args.rate}: expected requests per second per user, >= 0", file=sys.stderr)
        return 2
    try:
        check_ready(args.host, args.model)
        if set(protocols) & {"grpc", "cudashm"}:
            check_grpc_ready(grpc_address(args.host, args.grpc_url), args.model, bool(args.grpc_url))
    except NotReady as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    summary = run_load(args.out.resolve(), host=args.host, grpc_url=args.grpc_url, model=args.model,
                       users=args.users, run_time=args.time, mix=args.mix, protocols=protocols,
                       prefill_tokens=args.prefill_tokens, steps=args.steps, step_time=args.step_time,
                       processes=args.processes, rate=args.rate, hidden=args.hidden, quiet=args.quiet)
    grpc = f" (gRPC {summary['grpc_url']})" if summary.get("grpc_url") else ""
    print(f"\nloadtest: {args.model} at {args.host}{grpc}, mix {args.mix}, "
          + (f"users stepped {args.steps} ({args.step_time:.0f} s each)" if args.steps else
             f"{args.users} users for {args.time}")
          + f"; files in {args.out}/ (summary.json, latency.png, locust_*.csv)")
    print(load_summary.table(summary))
    return verdict(summary)


def verdict(summary: dict) -> int:
    """1 when a request failed or the samples do not add up to Locust's count (said on stderr too)."""
    if summary.get("counts_agree") is False:
        print(f"loadtest: {load_summary.counts_line(summary)}", file=sys.stderr)
        return 1
    return 1 if summary["total"]["failures"] else 0


def main_generate(args) -> int:
    hf_model = args.model or os.environ.get("LOADTEST_TIER_MODEL", "")
    if not hf_model and not args.tier and args.tier_protocol != "fake":
        print("loadtest: --workload generate needs --model HF_DIR (or --tier module:function)", file=sys.stderr)
        return 2
    if args.arrivals == "open" and not 0 < args.arrival_rate < float("inf"):
        print(f"loadtest: --arrival-rate {args.arrival_rate}: expected requests per second, > 0", file=sys.stderr)
        return 2
    if args.tier_protocol in ("grpc", "cudashm"):
        try:
            check_grpc_ready(grpc_address(args.host, args.grpc_url), args.triton_model, bool(args.grpc_url))
        except NotReady as exc:
            print(f"loadtest: {exc}", file=sys.stderr)
            return 2
    try:
        summary = run_generate(args.out.resolve(), tier_protocol=args.tier_protocol, tier=args.tier, hf_model=hf_model,
                               weights=args.weights, device=args.device, dtype=args.dtype, warmup=args.warmup,
                               host=args.host, grpc_url=args.grpc_url,
                               triton_model=args.triton_model, arrivals=args.arrivals, arrival_rate=args.arrival_rate,
                               users=args.users, run_time=args.time, prefill_tokens=args.prefill_tokens,
                               new_tokens=args.new_tokens, processes=args.processes, seed=args.seed,
                               vocab_size=args.vocab_size, quiet=args.quiet)
    except RuntimeError as exc:  # no samples: the tier could not be built, or Locust could not start
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    print(f"\nloadtest: generate, {args.tier_protocol}, files in {args.out}/ (summary.json, samples-*.csv)")
    print(load_summary.table(summary))
    return verdict(summary)


if __name__ == "__main__":
    sys.exit(main())
