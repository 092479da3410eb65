"""Summary of one Locust run of loadtest/locustfile.py: a JSON file, a PNG plot and a table.

Reads, from the run's folder, the per-request samples the locustfile writes (samples-*.csv, one per
Locust process), Locust's history (PREFIX_stats_history.csv from --csv and --csv-full-history) and
its final counts (PREFIX_final.json from --json-file). Percentiles are computed from every request's latency (nearest rank), not from
Locust's rounded histogram; Locust's request and failure counts are kept beside them as a check.
The user count of each request is the one Locust's history shows at the time its answer came, so a
stepped ramp (LOADTEST_STEPS) gives P99 against concurrency from one run.

    python loadtest/summary.py FOLDER [--prefix locust]
"""
import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

PERCENTILES = (50, 95, 99)


def read_samples(folder: Path) -> dict:
    """Columns of every samples-*.csv in folder, as numpy arrays."""
    rows = []
    for path in sorted(folder.glob("samples-*.csv")):
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"loadtest summary: no samples-*.csv with requests in {folder}")
    return {
        "end": np.array([float(r["end_time"]) for r in rows]),
        "protocol": np.array([r["protocol"] for r in rows]),
        "profile": np.array([r["profile"] for r in rows]),
        "tokens": np.array([int(r["tokens"] or 0) for r in rows]),
        "latency_ms": np.array([float(r["latency_ms"]) for r in rows]),
        "failed": np.array([r["failed"] == "1" for r in rows]),
    }


def read_history(folder: Path, prefix: str):
    """(timestamps, user counts) of Locust's aggregated history rows, or None without the file."""
    path = folder / f"{prefix}_stats_history.csv"
    if not path.exists():
        return None
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    if not rows:
        return None
    return np.array([float(r["Timestamp"]) for r in rows]), np.array([int(r["User Count"]) for r in rows])


def read_locust_totals(folder: Path, prefix: str) -> dict:
    """{(protocol, profile): (requests, failures)} and 'total' from PREFIX_final.json (Locust's
    --json-file, written at shutdown; PREFIX_stats.csv is rewritten each second and misses the last)."""
    path = folder / f"{prefix}_final.json"
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())
    totals = {(e["method"], e["name"]): (e["num_requests"], e["num_failures"]) for e in entries}
    totals["total"] = tuple(sum(e[key] for e in entries) for key in ("num_requests", "num_failures"))
    return totals


def percentiles(latency_ms) -> dict:
    if len(latency_ms) == 0:
        return {f"p{p}_ms": None for p in PERCENTILES}
    return {f"p{p}_ms": float(np.percentile(latency_ms, p, method="inverted_cdf")) for p in PERCENTILES}


def users_at(history, times) -> tuple:
    """User count at each time, and whether that second held a change of user count (a ramp)."""
    stamps, counts = history
    index = np.clip(np.searchsorted(stamps, times, side="right") - 1, 0, len(stamps) - 1)
    following = np.clip(index + 1, 0, len(stamps) - 1)
    return counts[index], counts[index] != counts[following]


def summarize(folder: Path, prefix: str = "locust") -> dict:
    samples = read_samples(folder)
    start = float(np.min(samples["end"] - samples["latency_ms"] / 1000.0))
    duration = float(np.max(samples["end"]) - start)
    locust_totals = read_locust_totals(folder, prefix)
    groups = []
    for protocol in sorted(set(samples["protocol"])):
        for profile in sorted(set(samples["profile"])):
            mask = (samples["protocol"] == protocol) & (samples["profile"] == profile)
            if not mask.any():
                continue
            ok = mask & ~samples["failed"]
            groups.append({
                "protocol": protocol, "profile": profile, "requests": int(mask.sum()),
                "failures": int((mask & samples["failed"]).sum()),
                **percentiles(samples["latency_ms"][ok]),
                "mean_ms": float(np.mean(samples["latency_ms"][ok])) if ok.any() else None,
                "throughput_rps": float(ok.sum() / duration) if duration > 0 else None,
                "tokens_per_s": float(samples["tokens"][ok].sum() / duration) if duration > 0 else None,
                "mean_tokens": float(np.mean(samples["tokens"][mask])),
                "locust_requests": locust_totals.get((protocol, profile), (None, None))[0],
            })
    ok = ~samples["failed"]
    summary = {
        "folder": str(folder), "duration_s": duration, "groups": groups,
        "total": {"requests": int(len(ok)), "failures": int((~ok).sum()), **percentiles(samples["latency_ms"][ok]),
                  "throughput_rps": float(ok.sum() / duration) if duration > 0 else None,
                  "locust_requests": locust_totals.get("total", (None, None))[0],
                  "locust_failures": locust_totals.get("total", (None, None))[1]},
        "by_users": [],
    }
    history = read_history(folder, prefix)
    if history is not None:
        users, ramping = users_at(history, samples["end"])
        summary["max_users"] = int(history[1].max())
        for count in sorted(set(users[~ramping].tolist())):
            level = (users == count) & ~ramping
            # the level's length: from its first to its last answer, whatever the profile
            span = float(np.ptp(samples["end"][level])) if level.sum() > 1 else 0.0
            for group in groups:
                in_group = level & (samples["protocol"] == group["protocol"]) & (samples["profile"] == group["profile"])
                mask = in_group & ok
                if mask.any():
                    summary["by_users"].append({
                        "users": int(count), "protocol": group["protocol"], "profile": group["profile"],
                        "requests": int(mask.sum()), "failures": int((in_group & ~ok).sum()),
                        "seconds": span, "throughput_rps": float(mask.sum() / span) if span > 0 else None,
                        "tokens_per_s": float(samples["tokens"][mask].sum() / span) if span > 0 else None,
                        **percentiles(samples["latency_ms"][mask])})
    return summary, samples, history


def plot(summary: dict, samples: dict, history, path: Path, title: str = "") -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, (over_time, by_users) = plt.subplots(1, 2, figsize=(13, 4.8))
    start = float(np.min(samples["end"] - samples["latency_ms"] / 1000.0))
    seconds = samples["end"] - start
    window = max(1.0, summary["duration_s"] / 40)
    edges = np.arange(0.0, summary["duration_s"] + window, window)
    styles = {50: ":", 95: "--", 99: "-"}
    ok = ~samples["failed"]
    for color, profile in zip(("tab:blue", "tab:orange", "tab:green"), sorted(set(samples["profile"]))):
        mask = ok & (samples["profile"] == profile)
        bins = np.digitize(seconds[mask], edges)
        centers = [(edges[b - 1] + window / 2) for b in sorted(set(bins))]
        for p in PERCENTILES:
            values = [np.percentile(samples["latency_ms"][mask][bins == b], p, method="inverted_cdf")
                      for b in sorted(set(bins))]
            over_time.plot(centers, values, styles[p], color=color, label=f"{profile} P{p}")
    over_time.set(xlabel=f"time (s), {window:.0f}-s windows", ylabel="latency (ms)",
                  title="Latency percentiles over time (both protocols)", yscale="log")
    over_time.legend(fontsize=7, ncol=2)
    if history is not None:
        users_axis = over_time.twinx()
        users_axis.step(history[0] - start, history[1], where="post", color="grey", alpha=0.5)
        users_axis.set_ylabel("users", color="grey")

    for group in summary["groups"]:
        points = [(r["users"], r["p99_ms"]) for r in summary["by_users"]
                  if (r["protocol"], r["profile"]) == (group["protocol"], group["profile"])]
        if points:
            x, y = zip(*points)
            by_users.plot(x, y, "o-", label=f"{group['protocol']} {group['profile']}")
    by_users.set(xlabel="concurrent users", ylabel="P99 latency (ms)", title="P99 against concurrency")
    if summary["by_users"]:
        by_users.set_xscale("log", base=2)
        by_users.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        by_users.legend(fontsize=8)
    fig.suptitle(title or summary["folder"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(summary: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value:9.2f}"
    lines = [f"{'protocol':8} {'profile':8} {'requests':>8} {'fails':>6} {'P50 ms':>9} {'P95 ms':>9} {'P99 ms':>9} "
             f"{'req/s':>8} {'tokens/s':>9}"]
    for g in summary["groups"]:
        lines.append(f"{g['protocol']:8} {g['profile']:8} {g['requests']:8d} {g['failures']:6d} {ms(g['p50_ms'])} "
                     f"{ms(g['p95_ms'])} {ms(g['p99_ms'])} {g['throughput_rps']:8.1f} {g['tokens_per_s']:9.0f}")
    t = summary["total"]
    lines.append(f"{'all':8} {'':8} {t['requests']:8d} {t['failures']:6d} {ms(t['p50_ms'])} {ms(t['p95_ms'])} "
                 f"{ms(t['p99_ms'])} {t['throughput_rps']:8.1f}")
    if len({r["users"] for r in summary["by_users"]}) > 1:
        lines.append("P99 ms by concurrent users:")
        for r in summary["by_users"]:
            lines.append(f"  users {r['users']:4d} {r['protocol']:5} {r['profile']:8} P99 {ms(r['p99_ms'])} "
                         f"({r['requests']} requests)")
    return "\n".join(lines)


def write(folder: Path, prefix: str = "locust", title: str = "") -> dict:
    """summary.json and latency.png in folder; returns the summary."""
    summary, samples, history = summarize(folder, prefix)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, samples, history, folder / "latency.png", title)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prefix", default="locust", help="the --csv prefix Locust was given (file name part)")
    args = parser.parse_args(argv)
    summary = write(args.folder, args.prefix)
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
