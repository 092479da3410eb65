"""Generate-workload sweep: the same model at a list of open-loop offered rates, per protocol; P99 TTFT
and P99 TPOT at each rate, and the highest rate whose P99 TTFT is within a budget.

    python loadtest/sweep.py --model HF_DIR --protocols inprocess,grpc,eager --rates 0.5,1,2,4 \\
        --prefill-tokens 2048 --new-tokens 16 --time 60s [--weights PACKED_DIR --device cuda] --out runs/sweep
    python loadtest/sweep.py --tier module:function ...   (a factory instead of a model folder)

Each (protocol, rate) is one loadtest/run.py generate run in OUT/PROTOCOL/rate-R/ (its samples,
summary.json, latency.png). A rate counts as within budget when its P99 TTFT is at most --budget-ms,
no request failed and the samples add up to Locust's count; the answer is the highest rate with every
rate up to it within budget, and when that is the highest rate swept it is only a lower bound and
says so. Once a protocol's P99 TTFT passes
--give-up-factor times the budget, its higher rates are skipped (they would only queue longer).
Writes OUT/sweep.json and, when matplotlib is there, OUT/sweep.png (P99 TTFT against offered rate).
"""
import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as load_run  # noqa: E402  (beside this file)


def level(rate: float, summary: dict, protocol: str) -> dict:
    """One rate's figures for `protocol` from its run's summary."""
    figures = (summary.get("generate") or {}).get(protocol) or {}
    ttft, tpot = figures.get("ttft") or {}, figures.get("tpot") or {}
    return {"offered_rps": rate, "answered_rps": figures.get("answered_rate_rps"),
            "requests": figures.get("requests", 0), "failures": figures.get("failures", 0),
            "ttft_p50_ms": ttft.get("p50_ms"), "ttft_p99_ms": ttft.get("p99_ms"), "ttft_samples": ttft.get("samples", 0),
            "tpot_p50_ms": tpot.get("p50_ms"), "tpot_p99_ms": tpot.get("p99_ms"), "tpot_samples": tpot.get("samples", 0),
            "few_samples": "p99_ms" in ttft.get("few_samples", ["p99_ms"]),
            "unserved": figures.get("unserved_at_end", 0), "oldest_unserved_wait_ms": figures.get("oldest_unserved_wait_ms"),
            "counts_agree": summary.get("counts_agree")}


def within(lv: dict, budget_ms: float) -> bool:
    """P99 TTFT within budget, no failure, the counts agreeing, and no arrival left waiting at the end
    longer than the budget (its TTFT, unmeasured, is over it already)."""
    return (lv["ttft_p99_ms"] is not None and lv["ttft_p99_ms"] <= budget_ms and not lv["failures"]
            and lv["counts_agree"] is not False and (lv.get("oldest_unserved_wait_ms") or 0.0) <= budget_ms)


def best_rate(levels: list, budget_ms: float) -> dict:
    """The highest offered rate within budget with every lower rate swept within it too (a rate that
    comes back under budget after one that did not is noise, not capacity), None if the lowest is not;
    lower_bound: the highest rate swept was still within budget."""
    top = None
    for lv in sorted(levels, key=lambda lv: lv["offered_rps"]):
        if not within(lv, budget_ms):
            break
        top = lv
    if top is None:
        return {"best": None, "lower_bound": False}
    return {"best": top, "lower_bound": top["offered_rps"] == max(lv["offered_rps"] for lv in levels)}


def table(result: dict) -> str:
    def ms(value):
        return f"{'-':>9}" if value is None else f"{value:9.2f}"
    lines = [f"{'protocol':10} {'offered':>8} {'answered':>8} {'requests':>8} {'fails':>5} {'P99 TTFT':>9} {'n':>5} "
             f"{'P99 TPOT':>9} {'n':>5}  (ms; * fewer than 100 samples behind a P99)"]
    for protocol, sweep in result["protocols"].items():
        for lv in sweep["levels"]:
            answered = "-" if lv["answered_rps"] is None else f"{lv['answered_rps']:.2f}"
            lines.append(f"{protocol:10} {lv['offered_rps']:8g} {answered:>8} {lv['requests']:8d} {lv['failures']:5d} "
                         f"{ms(lv['ttft_p99_ms'])}{'*' if lv['few_samples'] else ' '}{lv['ttft_samples']:5d} "
                         f"{ms(lv['tpot_p99_ms'])} {lv['tpot_samples']:5d}"
                         + ("  SAMPLE COUNT MISMATCH" if lv["counts_agree"] is False else "")
                         + (f"  {lv['unserved']} unserved at the end, waiting up to {lv['oldest_unserved_wait_ms']:.0f} ms"
                            if lv.get("unserved") else ""))
        for skipped in sweep.get("skipped", []):
            lines.append(f"{protocol:10} {skipped:8g} skipped: P99 TTFT already past {result['give_up_ms']:g} ms")
    lines.append(f"highest offered rate with P99 TTFT within {result['budget_ms']:g} ms:")
    for protocol, sweep in result["protocols"].items():
        best = sweep["best"]
        lines.append(f"  {protocol:10} " + ("none of the rates swept" if best is None else
                     f"{best['offered_rps']:g} req/s (P99 TTFT {best['ttft_p99_ms']:.2f} ms, P99 TPOT "
                     + ("-" if best["tpot_p99_ms"] is None else f"{best['tpot_p99_ms']:.2f} ms") + ")"
                     + (": a lower bound, the highest rate swept" if sweep["lower_bound"] else "")))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """P99 TTFT against offered rate, one line per protocol, the budget drawn; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("sweep: no matplotlib, no sweep.png", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for protocol, sweep in result["protocols"].items():
        points = [lv for lv in sweep["levels"] if lv["ttft_p99_ms"] is not None]
        if not points:
            continue
        line, = ax.plot([lv["offered_rps"] for lv in points], [lv["ttft_p99_ms"] for lv in points], "o-", label=protocol)
        thin = [lv for lv in points if lv["few_samples"]]  # too few samples for a P99: hollow
        ax.plot([lv["offered_rps"] for lv in thin], [lv["ttft_p99_ms"] for lv in thin], "o", mfc="white",
                color=line.get_color())
    ax.axhline(result["budget_ms"], color="grey", ls="--", lw=1, label=f"budget {result['budget_ms']:g} ms")
    ax.set(xlabel="offered load (requests/s, open-loop Poisson)", ylabel="P99 time to first token (ms)", yscale="log",
           title=f"{result['title']}\nhollow: fewer than 100 requests behind the P99")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def sweep(out: Path, protocols, rates, *, budget_ms: float = 200.0, give_up_factor: float = 5.0, title: str = "",
          **options) -> dict:
    """Runs every protocol at every rate (ascending) into out/PROTOCOL/rate-R; returns the result."""
    result = {"budget_ms": budget_ms, "give_up_ms": budget_ms * give_up_factor, "rates": sorted(rates),
              "options": {k: v for k, v in options.items() if k != "env"}, "protocols": {},
              "title": title or f"generate sweep, prompts {options.get('prefill_tokens', '128-2048')} tokens"}
    for protocol in protocols:
        levels, skipped = [], []
        for rate in sorted(rates):
            if levels and levels[-1]["ttft_p99_ms"] is not None and levels[-1]["ttft_p99_ms"] > result["give_up_ms"]:
                skipped.append(rate)
                continue
            folder = out / protocol / f"rate-{rate:g}"
            try:
                summary = load_run.run_generate(folder, tier_protocol=protocol, arrivals="open", arrival_rate=rate,
                                                **options)
            except RuntimeError as exc:  # no samples at all: the tier could not be built or run
                print(f"sweep: {protocol} at {rate:g} req/s: {exc}", file=sys.stderr)
                levels.append({**level(rate, {}, protocol), "error": str(exc)[:500]})
                break
            levels.append(level(rate, summary, protocol))
            print(f"sweep: {protocol} at {rate:g} req/s: P99 TTFT {levels[-1]['ttft_p99_ms']} ms "
                  f"({levels[-1]['ttft_samples']} requests)", flush=True)
        result["protocols"][protocol] = {"levels": levels, "skipped": skipped, **best_rate(levels, budget_ms)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    result["plot"] = str(out / "sweep.png") if plot(result, out / "sweep.png") else None
    return result


def main(argv=None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--protocols", default="inprocess", help="comma-separated: inprocess, grpc, cudashm, eager, fake")
    p.add_argument("--rates", required=True, help="offered rates, requests per second in all, e.g. 0.5,1,2,4")
    p.add_argument("--budget-ms", type=float, default=200.0, help="the P99 TTFT budget")
    p.add_argument("--give-up-factor", type=float, default=5.0,
                   help="skip a protocol's higher rates once its P99 TTFT passes this times the budget")
    p.add_argument("--model", default=env("LOADTEST_TIER_MODEL", ""), help="the Hugging Face model folder")
    p.add_argument("--tier", default=env("LOADTEST_TIER", ""), help="module:function building the tier instead")
    p.add_argument("--weights", default=env("LOADTEST_WEIGHTS", ""), help="the packed folder (inprocess)")
    p.add_argument("--device", default=env("LOADTEST_TIER_DEVICE", "cpu"))
    p.add_argument("--dtype", default=env("LOADTEST_TIER_DTYPE", ""), help="the attention tier's torch dtype")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per process before each run")
    p.add_argument("--host", default=env("LOADTEST_HOST", "http://127.0.0.1:8000"))
    p.add_argument("--grpc-url", default=env("LOADTEST_GRPC_URL", ""))
    p.add_argument("--triton-model", default=env("LOADTEST_MODEL", "colibri_moe"))
    p.add_argument("--time", default="60s", help="each run's length")
    p.add_argument("--prefill-tokens", default="128-2048", help="prompt lengths MIN-MAX (2048: all 2048)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens after the first (TPOT)")
    p.add_argument("--processes", type=int, default=0, help="load-generating processes, a tier in each (0: one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--title", default="")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"))
    args = p.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        print(f"sweep: --rates {args.rates!r}: expected positive requests per second, e.g. 0.5,1,2", file=sys.stderr)
        return 2
    protocols = [x for x in args.protocols.split(",") if x]
    if not args.model and not args.tier and set(protocols) - {"fake"}:
        print("sweep: give --model HF_DIR (or --tier module:function)", file=sys.stderr)
        return 2
    if set(protocols) & {"grpc", "cudashm"}:
        try:
            load_run.check_grpc_ready(load_run.grpc_address(args.host, args.grpc_url), args.triton_model,
                                      bool(args.grpc_url))
        except load_run.NotReady as exc:
            print(f"sweep: {exc}", file=sys.stderr)
            return 2
    result = sweep(args.out.resolve(), protocols, rates, budget_ms=args.budget_ms, give_up_factor=args.give_up_factor,
                   title=args.title, tier=args.tier, hf_model=args.model, weights=args.weights, device=args.device,
                   dtype=args.dtype, warmup=args.warmup,
                   host=args.host, grpc_url=args.grpc_url, triton_model=args.triton_model, run_time=args.time,
                   prefill_tokens=args.prefill_tokens, new_tokens=args.new_tokens, processes=args.processes,
                   seed=args.seed, quiet=True)
    print(table(result))
    print(f"sweep: {args.out}/sweep.json" + (f", {args.out}/sweep.png" if result["plot"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
