"""Headless Locust run against a Triton server that is already up (`make serve`), then the summary:
Locust's CSVs (--csv, --csv-full-history), summary.json, latency.png and a table printed last.

    python loadtest/run.py [--users 16 --time 60s --mix decode-heavy --protocols grpc,http ...]
    make loadtest LOADTEST_USERS=16 LOADTEST_TIME=60s LOADTEST_PROFILE=decode-heavy

It starts no server: when none is ready at --host it says so and exits 2. Exit status 1 when any
request failed. bench/serving/compare.py runs its loads through run_load().
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
    for stale in list(out.glob("samples-*.csv")) + list(out.glob("locust*")):
        stale.unlink()
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *[USER_CLASSES[p] for p in protocols],
               "--headless", "--host", host, "--users", str(users), "--spawn-rate", str(users),
               "--run-time", run_time, "--stop-timeout", "30",
               "--csv", str(out / "locust"), "--csv-full-history", "--json-file", str(out / "locust_final"),
               "--model", model, "--mix", mix, "--prefill-tokens", prefill_tokens, "--samples-dir", str(out),
               "--loglevel", "WARNING" if quiet else "INFO"]
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
    if not list(out.glob("samples-*.csv")):
        raise RuntimeError(f"locust wrote no samples (exit status {result.returncode})"
                           + (f":\n{result.stdout[-3000:]}{result.stderr[-3000:]}" if quiet else ""))
    summary = load_summary.write(out, "locust", title or (
        f"{model}, users stepped {steps} ({step_time:g} s each)" if steps else f"{model}, {users} users, {run_time}")
        + f", mix {mix}")
    summary.update(model=model, users=users, mix=mix, protocols=list(protocols), rate_per_user=rate,
                   host=host, grpc_url=grpc_url if set(protocols) & {"grpc", "cudashm"} else None,
                   locust_exit_status=result.returncode)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def parse_args(argv):
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default=env("LOADTEST_HOST", "http://127.0.0.1:8000"), help="Triton HTTP endpoint")
    p.add_argument("--grpc-url", default=env("LOADTEST_GRPC_URL", ""),
                   help="gRPC host:port (default: the --host host, port 8001)")
    p.add_argument("--model", default=env("LOADTEST_MODEL", "colibri_moe"))
    p.add_argument("--users", type=int, default=int(env("LOADTEST_USERS", "16")))
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
    return 1 if summary["total"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
