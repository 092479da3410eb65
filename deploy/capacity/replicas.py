"""How many replicas (one GPU each) a target request rate needs within a P99 budget, from a measured
serving curve: the throughput sweep that bench/serving/compare.py writes (compare.json, its `sweeps`),
and what the chart's autoscaler does when the load doubles.

A replica's capacity at a budget is the highest throughput of a sweep level whose P99 (the sweep's
budget profile: prefill by default) stayed within it, with no failure. Levels are not interpolated:
between two levels the lower one counts. Where no level is within the budget, or the sweep stopped
before P99 reached it (a lower bound), it says so. The curve is one Colibri layer on one GPU, so the
P99 is that layer's share of time-to-first-token, not a whole model's TTFT.

    python deploy/capacity/replicas.py bench/serving/results/h200-64x6x2048x1408.json \\
        --rate 3000 --budget-ms 50 [--headroom 0.8] [--startup-s 120] [--table 25,50,100,200]
"""
import argparse
import json
import math
import sys
from pathlib import Path


class CurveError(ValueError):
    pass


def load_sweep(path: Path, model: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise CurveError(f"cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise CurveError(f"{path} is not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("sweeps"), list):
        raise CurveError(f"{path} has no 'sweeps': give a compare.json written by bench/serving/compare.py --sweep")
    sweeps = {sweep.get("model"): sweep for sweep in data["sweeps"]}
    if model not in sweeps:
        found = ", ".join(sorted(map(str, sweeps))) or "none (run compare.py with --sweep)"
        raise CurveError(f"{path} has no sweep of model {model!r}; models swept: {found}")
    levels = sweeps[model].get("levels") or []
    for level in levels:
        if not all(isinstance(level.get(k), (int, float)) for k in ("users", "rps", "failures")):
            raise CurveError(f"{path}: a sweep level of {model} lacks users, rps or failures: {level}")
    if not levels:
        raise CurveError(f"{path}: the sweep of {model} has no levels")
    return {"shape": data.get("shape", "?"), "prefill_tokens": data.get("prefill_tokens", "?"), "levels": levels}


def capacity(levels: list, budget_ms: float) -> tuple:
    """(the best level within the budget or None, whether it is the sweep's last level)."""
    within = [lv for lv in levels if lv.get("p99_ms") is not None and lv["p99_ms"] <= budget_ms and not lv["failures"]]
    best = max(within, key=lambda lv: lv["rps"], default=None)
    return best, best is not None and best is levels[-1]


def replicas_for(rate: float, per_replica_rps: float, headroom: float) -> int:
    return max(1, math.ceil(rate / (per_replica_rps * headroom)))


def answer(sweep: dict, rate: float, budget_ms: float, headroom: float) -> str:
    best, lower_bound = capacity(sweep["levels"], budget_ms)
    if best is None:
        lowest = min((lv for lv in sweep["levels"] if lv.get("p99_ms") is not None), key=lambda lv: lv["p99_ms"])
        return (f"no measured level is within a P99 of {budget_ms:g} ms: the lowest measured is "
                f"{lowest['p99_ms']:.1f} ms at {lowest['users']} users ({lowest['rps']:.0f} req/s); "
                "a tighter budget needs a sweep with fewer users")
    n = replicas_for(rate, best["rps"], headroom)
    bound = " (at least: P99 stayed within the budget up to the sweep's last level)" if lower_bound else ""
    return (f"{n} replica(s) for {rate:g} req/s within P99 {budget_ms:g} ms: one replica sustains "
            f"{best['rps']:.0f} req/s{bound} (measured at {best['users']} users, P99 {best['p99_ms']:.1f} ms), "
            f"planned at {headroom:g} of it")


def table(sweep: dict, budgets: list, rates: list, headroom: float) -> str:
    lines = [f"{'P99 budget ms':>13} {'req/s per replica':>18} " + " ".join(f"{r:>8g}/s" for r in rates)]
    for budget in budgets:
        best, lower_bound = capacity(sweep["levels"], budget)
        if best is None:
            lines.append(f"{budget:>13g} {'none measured':>18} " + " ".join(f"{'-':>10}" for _ in rates))
            continue
        per = f"{'>=' if lower_bound else ''}{best['rps']:.0f}"
        lines.append(f"{budget:>13g} {per:>18} " + " ".join(f"{replicas_for(r, best['rps'], headroom):>10d}"
                                                           for r in rates))
    return "\n".join(lines)


def doubling(rate: float, per_replica_rps: float, headroom: float, startup_s: float, scrape_s: float,
             window_s: float, polling_s: float) -> str:
    """What the chart's autoscaler does when the offered load goes from `rate` to twice that at t = 0."""
    before = replicas_for(rate, per_replica_rps, headroom)
    after = replicas_for(2 * rate, per_replica_rps, headroom)
    capacity_before = before * per_replica_rps
    detect = scrape_s + window_s + polling_s
    short = max(0.0, 2 * rate - capacity_before)
    lines = [f"load doubles, {rate:g} -> {2 * rate:g} req/s: {before} -> {after} replicas",
             f"  detection: at most {detect:g} s (a scrape every {scrape_s:g} s, a {window_s:g} s rate window, "
             f"KEDA polling every {polling_s:g} s); the HPA's scale-up policy adds up to 100% of the pods per minute",
             f"  new pods ready after about {startup_s:g} s more (--startup-s: scheduling, image, weights, warm-up)"]
    if short:
        queued = short * (detect + startup_s)
        lines.append(f"  meanwhile {before} replica(s) serve {capacity_before:.0f} req/s of {2 * rate:g}: the other "
                     f"{short:.0f} req/s, about {queued:.0f} requests over {detect + startup_s:g} s, wait past "
                     "the budget or time out (plan with --headroom, or keep minReplicas up, to carry a jump)")
    else:
        lines.append(f"  the {before} replica(s) already carry {2 * rate:g} req/s within the budget: nothing queues")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("curve", type=Path, help="compare.json from bench/serving/compare.py --sweep")
    parser.add_argument("--model", default="colibri_moe", help="the swept model (default: %(default)s)")
    parser.add_argument("--rate", type=float, help="target requests per second, of the sweep's mix")
    parser.add_argument("--budget-ms", type=float, help="P99 budget of the sweep's profile, in ms")
    parser.add_argument("--headroom", type=float, default=1.0,
                        help="plan each replica at this fraction of its measured throughput (default: 1)")
    parser.add_argument("--table", default="", help="P99 budgets in ms for a table, e.g. 25,50,100,200")
    parser.add_argument("--rates", default="1000,5000,20000", help="request rates of the table's columns")
    parser.add_argument("--startup-s", type=float, help="seconds from a new pod's creation to ready, as measured")
    parser.add_argument("--scrape-s", type=float, default=15.0, help="Prometheus scrape interval (default: 15)")
    parser.add_argument("--window-s", type=float, default=60.0, help="the autoscaler's rate window (default: 60)")
    parser.add_argument("--polling-s", type=float, default=15.0, help="KEDA's polling interval (default: 15)")
    args = parser.parse_args(argv)

    def numbers(text, name):
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            parser.error(f"{name} must be numbers separated by commas, got {text!r}")
        if any(v <= 0 for v in values):
            parser.error(f"{name} must be positive, got {text!r}")
        return values

    for name in ("rate", "budget_ms", "startup_s"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    if not 0 < args.headroom <= 1:
        parser.error(f"--headroom must be in (0, 1], got {args.headroom:g}")
    if not args.table and (args.rate is None or args.budget_ms is None):
        parser.error("give --rate and --budget-ms, or --table")
    try:
        sweep = load_sweep(args.curve, args.model)
    except CurveError as error:
        print(f"replicas: {error}", file=sys.stderr)
        return 2
    print(f"replicas: {args.model}, {sweep['shape']}; requests as swept (prompts of {sweep['prefill_tokens']} "
          "tokens); one replica = one GPU")
    if args.table:
        print(table(sweep, numbers(args.table, "--table"), numbers(args.rates, "--rates"), args.headroom))
    if args.rate is not None and args.budget_ms is not None:
        print(answer(sweep, args.rate, args.budget_ms, args.headroom))
        best, _ = capacity(sweep["levels"], args.budget_ms)
        if best is not None and args.startup_s is not None:
            print(doubling(args.rate, best["rps"], args.headroom, args.startup_s, args.scrape_s, args.window_s,
                           args.polling_s))
        elif args.startup_s is None:
            print("(give --startup-s, a new pod's measured time to ready, for what happens when the load doubles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
