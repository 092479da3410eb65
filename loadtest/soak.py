"""Soak: a bounded run under steady load, watching the server's memory (not in CI).

    python loadtest/soak.py [--minutes 10 --users 8 --out runs/soak]

Starts its own `colibri serve` (demo checkpoint, free ports), puts the Locust load of run.py on it
(both protocols, decode and prefill requests of 1 to 256 tokens), and samples the resident memory
(VmRSS) of tritonserver and of the Python-backend stub every few seconds. Writes rss.csv and
soak.json into --out and prints: requests and failures, start and end RSS of each process, and the
slope of a least-squares line through the samples after the warm-up (MiB per hour). Exit status 1
when a request failed or a process grew by more than --max-growth-mib over the measured part.
"""
import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from colibri.testing.server import serving  # the serving tests' launcher: free ports, always stopped

import run as load_run  # beside this file (a script's folder is on its path)

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def server_pids(http_port: str) -> dict:
    """{"tritonserver": pid, "stub": pid} of the server listening on http_port."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if command[0].endswith(b"bin/tritonserver") and http_port.encode() in command:
            found["tritonserver"] = int(entry.name)
        elif command[0].endswith(b"triton_python_backend_stub"):
            found.setdefault("stubs", []).append(int(entry.name))
    stubs = [pid for pid in found.get("stubs", []) if _parent(pid) == found.get("tritonserver")]
    return {"tritonserver": found["tritonserver"], "stub": stubs[0]}


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def slope_mib_per_hour(times, values) -> float:
    return float(np.polyfit(np.asarray(times) / 3600.0, values, 1)[0]) if len(times) > 2 else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the slope and growth")
    p.add_argument("--max-growth-mib", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "soak")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from colibri import checkpoint

    with tempfile.TemporaryDirectory(prefix="colibri-soak-") as tmp:
        weights = Path(tmp) / "soak.colibri.safetensors"
        checkpoint.write_demo(weights)
        with serving(weights, args.out, probes=True) as server:  # as `colibri serve` runs: probes on
            pids = server_pids(server.http_url.rsplit(":", 1)[1])
            samples, done = [], threading.Event()

            def sample():
                start = time.monotonic()
                while not done.is_set():
                    samples.append((time.monotonic() - start, *(rss_mib(pids[name]) for name in ("tritonserver", "stub"))))
                    done.wait(args.interval)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            summary = load_run.run_load(args.out, host=f"http://{server.http_url}", grpc_url=server.grpc_url,
                                        users=args.users, run_time=f"{int(args.minutes * 60)}s", mix="decode:3,prefill:1",
                                        prefill_tokens="2-256", quiet=True, title="soak")
            done.set()
            sampler.join()

    with open(args.out / "rss.csv", "w") as f:
        f.write("seconds,tritonserver_mib,stub_mib\n" + "".join(f"{t:.1f},{a:.1f},{b:.1f}\n" for t, a, b in samples))
    measured = [s for s in samples if s[0] >= args.warmup]
    report = {"minutes": args.minutes, "users": args.users, "samples": len(samples),
              "requests": summary["total"]["requests"], "failures": summary["total"]["failures"],
              "p99_ms": summary["total"].get("p99_ms"), "processes": {}}
    for column, name in ((1, "tritonserver"), (2, "stub")):
        values = [s[column] for s in measured]
        report["processes"][name] = {
            "start_mib": samples[0][column], "after_warmup_mib": values[0], "end_mib": values[-1],
            "max_mib": max(values), "growth_after_warmup_mib": values[-1] - values[0],
            "slope_mib_per_hour": slope_mib_per_hour([s[0] for s in measured], values)}
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    grew = [n for n, r in report["processes"].items() if r["growth_after_warmup_mib"] > args.max_growth_mib]
    failed = not report["requests"] or report["failures"]
    if grew or failed:
        print(f"soak: FAIL ({'failures' if failed else ''} {'growth of ' + ', '.join(grew) if grew else ''})")
        return 1
    print("soak: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
