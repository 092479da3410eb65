"""Summary of one Locust run of loadtest/locustfile.py: a JSON file, a PNG plot and a table.

Reads, from the run's folder, the per-request samples the locustfile writes (samples-*.csv, one per
Locust process), Locust's history (PREFIX_stats_history.csv from --csv and --csv-full-history) and
its final counts (PREFIX_final.json from --json-file). Percentiles are computed from every request's latency (nearest rank), not from
Locust's rounded histogram; Locust's request and failure counts are kept beside them as a check.
The user count of each request is the one Locust's history shows at the time its answer came, so a
stepped ramp (LOADTEST_STEPS) gives P99 against concurrency from one run.

What the profiles measure. Single-layer runs (GrpcUser, HttpUser, CudaShmUser): a `prefill` request is
a prompt through one layer, a `decode` request one token; their latencies are that layer's, named as
such (`layer_prefill_p99_ms`), never TTFT: a model's time to first token has every layer in it.
`generate` runs (GenerateUser): a request is a prompt through every layer of a model to its first
new token, and summary.json's `ttft_p99_ms` (with p50 and p90, and `tpot_p99_ms`, time per later
output token) is the whole model's, per protocol in `generate` with the sample count behind each. The
arrival mode (open: Poisson at an offered rate, TTFT from each scheduled arrival; closed: users) and
the offered rate come from the run's settings.json, which the locustfile writes.
Older summaries named the layer's prefill P99 `ttft_p99_ms`; it is `layer_prefill_p99_ms` now, and
`ttft_p99_ms` is None in a single-layer run (old samples files read as before).

Sample counts against Locust's: the samples of every process (samples-*.csv) must add up to Locust's
own final count (PREFIX_final.json); `counts_agree` says whether they do, and when they do not the
table's last line says so in capitals (run.py's exit status is then 1).

Every percentile comes with the number of requests behind it (`samples`), and a percentile resting on
fewer than MIN_SAMPLES requests is listed in `few_samples` and marked `*` in the table and hollow in the
plot: P_p needs at least 100/(100-p) samples for one of them to lie above it (P99: 100, P95: 20; P50:
10, by choice). The plot's time windows are at least WINDOW_MIN_S long and are merged until each holds
MIN_SAMPLES["p99_ms"] requests of its profile, so each plotted P99 can be read.

    python loadtest/summary.py FOLDER [--prefix locust]
"""
import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

PERCENTILES = (50, 95, 99)
GENERATE_PERCENTILES = (50, 90, 99)
# Fewest samples behind a trustworthy percentile: at least one sample above it (100/(100-p)), and 10.
MIN_SAMPLES = {f"p{p}_ms": max(10, int(np.ceil(100.0 / (100 - p)))) for p in sorted({*PERCENTILES, *GENERATE_PERCENTILES})}
WINDOW_MIN_S = 1.0
# What each profile's latency is: one layer's (single-layer runs), or a whole model's TTFT (generate).
METRICS = {"prefill": "layer", "decode": "layer", "generate": "TTFT"}


def read_samples(folder: Path) -> dict:
    """Columns of every samples-*.csv in folder, as numpy arrays (files without the generate columns,
    as single-layer runs and older versions wrote them, read with those columns empty)."""
    rows = []
    for path in sorted(folder.glob("samples-*.csv")):
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"loadtest summary: no samples-*.csv with requests in {folder}")

    def number(row, key):
        value = row.get(key) or ""
        return float(value) if value else np.nan
    return {
        "arrival": np.array([number(r, "arrival_time") for r in rows]),
        "ttft_ms": np.array([number(r, "ttft_ms") for r in rows]),
        "tpot_ms": np.array([number(r, "tpot_ms") for r in rows]),
        "new_tokens": np.array([int(r.get("new_tokens") or 0) for r in rows]),
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


def percentiles(latency_ms, which=PERCENTILES) -> dict:
    """p50_ms/p95_ms/p99_ms (or `which`) of the latencies, the count behind them (samples) and the
    percentiles that count is too small for (few_samples, keys of MIN_SAMPLES)."""
    n = int(len(latency_ms))
    few = [f"p{p}_ms" for p in which if n < MIN_SAMPLES[f"p{p}_ms"]]
    if n == 0:
        return {**{f"p{p}_ms": None for p in which}, "samples": 0, "few_samples": few}
    return {**{f"p{p}_ms": float(np.percentile(latency_ms, p, method="inverted_cdf")) for p in which},
            "samples": n, "few_samples": few}


def read_settings(folder: Path) -> dict:
    """The run's settings.json (arrival mode, offered rate, ...) as the locustfile wrote it, or {}."""
    path = folder / "settings.json"
    return json.loads(path.read_text()) if path.exists() else {}


def read_unserved(folder: Path) -> dict:
    """{protocol: (arrivals due and never served when the run ended, the longest wait among them, s)}
    from the unserved-*.json files of open-loop generate runs."""
    found = {}
    for path in sorted(folder.glob("unserved-*.json")):
        data = json.loads(path.read_text())
        count, wait = found.get(data["protocol"], (0, 0.0))
        found[data["protocol"]] = (count + int(data["count"]), max(wait, float(data["oldest_wait_s"])))
    return found


def generate_summary(samples: dict, settings: dict, duration: float, unserved: dict = None) -> dict:
    """Per protocol of the generate requests: TTFT and TPOT percentiles of the successful ones, with
    the counts behind them, the offered and the answered rate, and the arrivals still waiting when
    the run ended (no samples: a tier that cannot keep up leaves them, and their TTFT is at least
    that wait)."""
    result, unserved = {}, unserved or {}
    is_generate = samples["profile"] == "generate"
    for protocol in sorted(set(samples["protocol"][is_generate].tolist())):
        mask = is_generate & (samples["protocol"] == protocol)
        ok = mask & ~samples["failed"]
        arrivals = samples["arrival"][mask]
        span = float(np.nanmax(samples["end"][mask]) - np.nanmin(arrivals)) if mask.any() else 0.0
        result[protocol] = {
            "requests": int(mask.sum()), "failures": int((mask & samples["failed"]).sum()),
            "ttft": percentiles(samples["ttft_ms"][ok], GENERATE_PERCENTILES),
            "tpot": percentiles(samples["tpot_ms"][ok & (samples["new_tokens"] > 1)], GENERATE_PERCENTILES),
            "mean_prompt_tokens": float(np.mean(samples["tokens"][mask])),
            "mean_new_tokens": float(np.mean(samples["new_tokens"][ok])) if ok.any() else None,
            "offered_rate_rps": settings.get("arrival_rate") if settings.get("arrivals") == "open" else None,
            "answered_rate_rps": float(ok.sum() / span) if span > 0 else None,
            "unserved_at_end": unserved.get(protocol, (0, 0.0))[0],
            "oldest_unserved_wait_ms": unserved.get(protocol, (0, 0.0))[1] * 1000.0,
        }
        figures = result[protocol]  # the headline figures flat as well: ttft_p99_ms, tpot_p99_ms, ...
        for metric in ("ttft", "tpot"):
            figures.update({f"{metric}_{key}": value for key, value in figures[metric].items() if key.endswith("_ms")},
                           **{f"{metric}_samples": figures[metric]["samples"]})
    return result


def count_check(samples: dict, locust_totals: dict) -> dict:
    """The samples' total against Locust's own (None where Locust's final counts are missing)."""
    locust = locust_totals.get("total", (None, None))[0]
    return {"samples": int(len(samples["failed"])), "locust": locust,
            "agree": None if locust is None else int(len(samples["failed"])) == locust}


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
                "protocol": protocol, "profile": profile, "metric": METRICS.get(profile), "requests": int(mask.sum()),
                "failures": int((mask & samples["failed"]).sum()),
                **percentiles(samples["latency_ms"][ok]),
                "mean_ms": float(np.mean(samples["latency_ms"][ok])) if ok.any() else None,
                "throughput_rps": float(ok.sum() / duration) if duration > 0 else None,
                "tokens_per_s": float(samples["tokens"][ok].sum() / duration) if duration > 0 else None,
                "mean_tokens": float(np.mean(samples["tokens"][mask])),
                "locust_requests": locust_totals.get((protocol, profile), (None, None))[0],
            })
    ok = ~samples["failed"]
    prefill = ok & (samples["profile"] == "prefill")
    layer = percentiles(samples["latency_ms"][prefill])
    generated = ok & (samples["profile"] == "generate")
    ttft = percentiles(samples["ttft_ms"][generated], GENERATE_PERCENTILES)
    tpot = percentiles(samples["tpot_ms"][generated & (samples["new_tokens"] > 1)], GENERATE_PERCENTILES)
    settings = read_settings(folder)
    counts = count_check(samples, locust_totals)
    summary = {
        "folder": str(folder), "duration_s": duration,
        "workload": "generate" if generated.any() or (samples["profile"] == "generate").any() else "layer",
        "arrivals": settings.get("arrivals"), "offered_rate_rps": settings.get("arrival_rate")
        if settings.get("arrivals") == "open" else None, "settings": settings,
        # Whole-model time to first token (generate requests, every protocol together; per protocol in
        # `generate`). None in a single-layer run, whose prefill latency is one layer's: layer_prefill.
        "ttft_p99_ms": ttft["p99_ms"], "ttft_samples": ttft["samples"],
        "ttft": {"what": "whole-model time to first token of generate requests, from arrival, all protocols",
                 **ttft, "protocols": sorted(set(samples["protocol"][generated].tolist()))},
        "tpot_p99_ms": tpot["p99_ms"], "tpot_samples": tpot["samples"],
        "generate": generate_summary(samples, settings, duration, read_unserved(folder)),
        "layer_prefill_p99_ms": layer["p99_ms"], "layer_prefill_samples": layer["samples"],
        "layer_prefill": {"what": "one layer's latency of prefill requests (a share of TTFT, not TTFT), all protocols",
                          **layer, "protocols": sorted(set(samples["protocol"][prefill].tolist()))},
        "counts": counts, "counts_agree": counts["agree"],
        **({} if generated.any() else {"ttft_note": "no generate requests: a single-layer run has no time to first "
                                                     "token; its prefill latency is layer_prefill_p99_ms"}),
        "min_samples": MIN_SAMPLES,
        "groups": groups,
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
                        "metric": group["metric"],
                        "requests": int(mask.sum()), "failures": int((in_group & ~ok).sum()),
                        "seconds": span, "throughput_rps": float(mask.sum() / span) if span > 0 else None,
                        "tokens_per_s": float(samples["tokens"][mask].sum() / span) if span > 0 else None,
                        **percentiles(samples["latency_ms"][mask])})
    return summary, samples, history


def windows(seconds, min_seconds: float, min_samples: int) -> list:
    """Consecutive windows over the sample times `seconds`: [start, end, indices], each at least
    min_seconds long and holding at least min_samples samples; what is left at the end (too short or
    too few) joins the last window. With fewer than min_samples in all, one window holds them all."""
    order = np.argsort(seconds, kind="stable")
    result, low, first = [], 0.0, 0
    for i, index in enumerate(order):
        if i + 1 - first >= min_samples and seconds[index] - low >= min_seconds:
            result.append([low, float(seconds[index]), order[first:i + 1]])
            low, first = float(seconds[index]), i + 1
    if first < len(order):
        if result:
            result[-1][1] = float(seconds[order[-1]])
            result[-1][2] = np.concatenate([result[-1][2], order[first:]])
        else:
            result.append([low, float(seconds[order[-1]]), order[first:]])
    return result


def profile_label(profile: str) -> str:
    metric = METRICS.get(profile)
    return f"{profile} ({metric})" if metric else profile


def plot(summary: dict, samples: dict, history, path: Path, title: str = "") -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, (over_time, by_users) = plt.subplots(1, 2, figsize=(13, 6.2))
    start = float(np.min(samples["end"] - samples["latency_ms"] / 1000.0))
    seconds = samples["end"] - start
    min_seconds = max(WINDOW_MIN_S, summary["duration_s"] / 40)
    needed = MIN_SAMPLES["p99_ms"]
    styles = {50: ".:", 95: ".--", 99: ".-"}
    ok = ~samples["failed"]
    for color, profile in zip(("tab:blue", "tab:orange", "tab:green"), sorted(set(samples["profile"]))):
        mask = ok & (samples["profile"] == profile)
        if not mask.any():
            continue
        latency = samples["latency_ms"][mask]
        spans = windows(seconds[mask], min_seconds, needed)
        centers = [(low + high) / 2 for low, high, _ in spans]
        counts = [len(indices) for _, _, indices in spans]
        sizes = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        for p in PERCENTILES:
            values = [np.percentile(latency[indices], p, method="inverted_cdf") for _, _, indices in spans]
            label = f"{profile_label(profile)} P{p}"
            if p == 99:
                label += f" ({len(spans)} window{'s' if len(spans) > 1 else ''} of {sizes} requests)"
            over_time.plot(centers, values, styles[p], color=color, label=label)
            if p == 99:  # what each window spans
                over_time.hlines(values, [s[0] for s in spans], [s[1] for s in spans], color=color, alpha=0.3)
            if p == 99:  # a window too thin for its P99 (a profile with fewer requests in all): hollow
                thin = [i for i, n in enumerate(counts) if n < needed]
                over_time.plot([centers[i] for i in thin], [values[i] for i in thin], "o", mfc="none",
                               color=color)
                for i in thin:
                    over_time.annotate(f"n={counts[i]}", (centers[i], values[i]), fontsize=7, color=color,
                                       textcoords="offset points", xytext=(3, 3))
    over_time.set(xlabel=f"time (s); windows of at least {min_seconds:.0f} s and {needed} requests of their profile",
                  ylabel="latency (ms)", yscale="log",
                  title="Latency percentiles over time (all protocols)\nprefill, decode: one layer's latency; "
                        "generate: a whole model's TTFT")
    over_time.title.set_fontsize(9)
    over_time.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    over_time.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    over_time.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    over_time.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    if history is not None:
        users_axis = over_time.twinx()
        users_axis.step(history[0] - start, history[1], where="post", color="grey", alpha=0.5)
        users_axis.set_ylabel("users", color="grey")

    stepped = len({r["users"] for r in summary["by_users"]}) > 1
    for index, group in enumerate(summary["groups"] if stepped else []):
        rows = [r for r in summary["by_users"] if (r["protocol"], r["profile"]) == (group["protocol"], group["profile"])]
        if not rows:
            continue
        x, y = [r["users"] for r in rows], [r["p99_ms"] for r in rows]
        line, = by_users.plot(x, y, "o-", label=f"{group['protocol']} {profile_label(group['profile'])}")
        for r in rows:  # every point with its sample count; hollow where too few for a P99
            few = "p99_ms" in r["few_samples"]
            if few:
                by_users.plot([r["users"]], [r["p99_ms"]], "o", color=line.get_color(), mfc="white")
            by_users.annotate(f"n={r['samples']}" + ("*" if few else ""), (r["users"], r["p99_ms"]), fontsize=7,
                              color=line.get_color(), textcoords="offset points", xytext=(5, 8 * index - 10))
    by_users.set(xlabel="concurrent users", ylabel="P99 latency (ms)",
                 title=f"P99 against concurrency (n = requests behind each P99; hollow, *: fewer than {needed})")
    by_users.title.set_fontsize(9)
    if stepped:
        by_users.set_xscale("log", base=2)
        by_users.set_xticks(sorted({r["users"] for r in summary["by_users"]}))
        by_users.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        by_users.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        by_users.legend(fontsize=8)
    else:  # one user count: the tail of each group instead (the share of requests slower than x)
        for group in summary["groups"]:
            mask = ok & (samples["protocol"] == group["protocol"]) & (samples["profile"] == group["profile"])
            latency = np.sort(samples["latency_ms"][mask])
            if not len(latency):
                continue
            slower = 1.0 - np.arange(len(latency)) / len(latency)
            line, = by_users.step(latency, slower, where="post",
                                  label=f"{group['protocol']} {profile_label(group['profile'])}, n={len(latency)}")
            few = "p99_ms" in group["few_samples"]
            by_users.plot([group["p99_ms"]], [0.01], "o", color=line.get_color(), mfc="none" if few else None)
        by_users.axhline(0.01, color="grey", lw=0.5)
        by_users.set(xscale="log", yscale="log", xlabel="latency (ms)", ylabel="share of requests slower",
                     title=f"Latency tails (one user count; dots: P99, hollow where n < {needed})")
        by_users.title.set_fontsize(9)
        by_users.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        by_users.legend(fontsize=8)
    fig.suptitle(f"{title or summary['folder']}\n{ttft_line(summary)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_line(summary: dict) -> str:
    """The headline: a generate run's P99 time-to-first-token, or a single-layer run's P99 layer
    latency of prefill requests, and the requests behind it."""
    ttft = summary.get("ttft") or {}
    if ttft.get("samples"):
        few = " (fewer than %d: rough)" % MIN_SAMPLES["p99_ms"] if "p99_ms" in ttft["few_samples"] else ""
        tpot = summary.get("tpot_p99_ms")
        return (f"P99 time-to-first-token (whole model, from arrival; {'+'.join(ttft['protocols'])}): "
                f"{ttft['p99_ms']:.2f} ms from {ttft['samples']} requests{few}"
                + (f"; P99 TPOT {tpot:.2f} ms" if tpot is not None else "") + arrivals_text(summary))
    layer = summary.get("layer_prefill") or {}
    if not layer.get("samples"):
        return "P99 layer latency, prefill: no prefill requests in this run"
    few = " (fewer than %d: rough)" % MIN_SAMPLES["p99_ms"] if "p99_ms" in layer["few_samples"] else ""
    return (f"P99 layer latency, prefill (one layer's share of TTFT, not TTFT; {'+'.join(layer['protocols'])}): "
            f"{layer['p99_ms']:.2f} ms from {layer['samples']} requests{few}")


def arrivals_text(summary: dict) -> str:
    if summary.get("arrivals") == "open":
        return f"; open-loop Poisson arrivals, {summary['offered_rate_rps']:g} req/s offered"
    if summary.get("arrivals") == "closed":
        return f"; closed-loop users ({summary['settings'].get('users')})"
    return ""


def counts_line(summary: dict) -> str:
    """Whether every request's sample was gathered: loud when the totals disagree."""
    counts = summary.get("counts") or {}
    if counts.get("agree") is None:
        return f"samples: {counts.get('samples')} (no Locust final counts to check them against)"
    if counts["agree"]:
        return f"samples: {counts['samples']}, as Locust counted"
    return (f"SAMPLE COUNT MISMATCH: {counts['samples']} samples gathered, Locust counted {counts['locust']}: "
            "the percentiles above may miss or double requests")


def generate_table(summary: dict) -> list:
    """Per protocol: requests, TTFT and TPOT percentiles with their counts, the rates."""
    def ms(row, key):
        value = row.get(key)
        return f"{'-':>9} " if value is None else f"{value:9.2f}" + ("*" if key in row.get("few_samples", ()) else " ")
    lines = [f"{'protocol':10} {'requests':>8} {'fails':>6} {'TTFT n':>7} {'P50 ms':>9}  {'P90 ms':>9}  {'P99 ms':>9}  "
             f"{'TPOT n':>7} {'P50 ms':>9}  {'P99 ms':>9}  {'offered':>8} {'answered':>8}"]
    for protocol, g in summary["generate"].items():
        rate = lambda v: f"{'-':>8}" if v is None else f"{v:8.2f}"  # noqa: E731
        lines.append(f"{protocol:10} {g['requests']:8d} {g['failures']:6d} {g['ttft']['samples']:7d} "
                     f"{ms(g['ttft'], 'p50_ms')} {ms(g['ttft'], 'p90_ms')} {ms(g['ttft'], 'p99_ms')} "
                     f"{g['tpot']['samples']:7d} {ms(g['tpot'], 'p50_ms')} {ms(g['tpot'], 'p99_ms')} "
                     f"{rate(g['offered_rate_rps'])} {rate(g['answered_rate_rps'])}")
    return lines


def table(summary: dict) -> str:
    def ms(row, key):
        value = row.get(key)
        if value is None:
            return f"{'-':>9} "
        return f"{value:9.2f}" + ("*" if key in row.get("few_samples", ()) else " ")

    def rate(value, width, digits):
        return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"

    lines = [f"{'protocol':8} {'profile':15} {'requests':>8} {'fails':>6} {'samples':>7} {'P50 ms':>9}  {'P95 ms':>9}  "
             f"{'P99 ms':>9}  {'req/s':>8} {'tokens/s':>9}"]
    for g in summary["groups"]:
        lines.append(f"{g['protocol']:8} {profile_label(g['profile']):15} {g['requests']:8d} {g['failures']:6d} "
                     f"{g['samples']:7d} {ms(g, 'p50_ms')} {ms(g, 'p95_ms')} {ms(g, 'p99_ms')} "
                     f"{rate(g['throughput_rps'], 8, 1)} {rate(g['tokens_per_s'], 9, 0)}")
    t = summary["total"]
    lines.append(f"{'all':8} {'':15} {t['requests']:8d} {t['failures']:6d} {t['samples']:7d} {ms(t, 'p50_ms')} "
                 f"{ms(t, 'p95_ms')} {ms(t, 'p99_ms')} {rate(t['throughput_rps'], 8, 1)}")
    if summary.get("generate"):
        lines.append("generate: time to first token (TTFT, from arrival) and per later token (TPOT), rates in req/s")
        lines += generate_table(summary)
        for protocol, g in summary["generate"].items():
            if g["unserved_at_end"]:
                lines.append(f"{protocol}: {g['unserved_at_end']} arrivals still waiting when the run ended, the oldest "
                             f"for {g['oldest_unserved_wait_ms']:.0f} ms (no samples: the tier did not keep up)")
    lines.append(ttft_line(summary))
    rows = summary["groups"] + [t] + summary["by_users"] + [summary.get("ttft") or {}, summary.get("layer_prefill") or {}]
    rows += [g[k] for g in (summary.get("generate") or {}).values() for k in ("ttft", "tpot")]
    if any(r.get("few_samples") and r.get("samples") for r in rows):
        lines.append("* from fewer requests than that percentile needs ("
                     + ", ".join(f"P{k[1:-3]} {n}" for k, n in MIN_SAMPLES.items()) + "): read it as rough")
    if len({r["users"] for r in summary["by_users"]}) > 1:
        lines.append("P99 ms by concurrent users:")
        for r in summary["by_users"]:
            lines.append(f"  users {r['users']:4d} {r['protocol']:7} {profile_label(r['profile']):15} "
                         f"P99 {ms(r, 'p99_ms')} ({r['samples']} requests)")
    lines.append(counts_line(summary))
    return "\n".join(lines)


def write(folder: Path, prefix: str = "locust", title: str = "") -> dict:
    """summary.json and latency.png in folder; returns the summary."""
    summary, samples, history = summarize(folder, prefix)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        import matplotlib  # noqa: F401  (not a dependency of the load test: the plot is a bonus)
    except ImportError:
        print("loadtest summary: no matplotlib, no latency.png", file=sys.stderr)
    else:
        plot(summary, samples, history, folder / "latency.png", title)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prefix", default="locust", help="the --csv prefix Locust was given (file name part)")
    args = parser.parse_args(argv)
    summary = write(args.folder, args.prefix)
    print(table(summary))
    return 1 if summary["counts_agree"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
