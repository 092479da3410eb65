"""Targets, a summary and a plot of a bench_gpu.py run (its --json file); needs no GPU.

    python3 bench/gpu_report.py bench/results/gpu_h200.json [--plot gpu_h200.png]

Prints each row's fraction of the floor beside the target DESIGN.md sets for it ("Targets for
Colibri") and how many rows meet theirs. A fraction meets its target when its value rounded to two
decimals, as the tables print it, is at least the target. --plot draws, per shape, the fraction of the
floor against T with the targets (and every --compare build of the run), and below it the speed-up
over PyTorch eager and torch._grouped_mm. bench_gpu.py prints the same summary at the end of a run.
"""
import argparse
import json
import math

# DESIGN.md, "Targets for Colibri": (largest T of the band, Mixtral-size target, fine-grained target)
BANDS = [(4, 0.85, 0.7), (256, 0.95, 0.85), (1024, 0.75, 0.7), (math.inf, 0.8, 0.6)]
FINE_T1 = 0.5  # fine-grained experts at T = 1
FINE_MIN_EXPERTS = 32  # the fine-grained shapes have 60-64 small experts, Mixtral 8 large ones


def target(num_experts: int, tokens: int) -> float:
    """DESIGN.md's target fraction of the floor for a layer of num_experts experts at T = tokens."""
    fine = num_experts >= FINE_MIN_EXPERTS
    if fine and tokens == 1:
        return FINE_T1
    for top, mixtral, fine_grained in BANDS:
        if tokens <= top:
            return fine_grained if fine else mixtral
    raise AssertionError("unreachable: the last band is unbounded")


def meets(fraction: float, goal: float) -> bool:
    return not math.isnan(fraction) and round(fraction, 2) >= goal


def summary(run: dict) -> tuple[list[str], int, int]:
    """Lines of a per-row table (shape, T, ms, fraction, target, met) and the met / total counts."""
    lines = [f"{'shape':17s} {'T':>5s} {'colibri ms':>10s} {'frac':>5s} {'target':>6s}  met"]
    met = 0
    for r in run["rows"]:
        goal, frac = target(r["E"], r["T"]), r["fraction_of_floor"]
        ok = meets(frac, goal)
        met += ok
        verdict = "yes" if ok else "no" if math.isnan(frac) else f"no (short by {goal - round(frac, 2):.2f})"
        lines.append(f"{r['shape']:17s} {r['T']:5d} {r['colibri_ms']:10.4f} {frac:5.2f} {goal:6.2f}  {verdict}")
    lines.append(f"DESIGN.md's targets met on {met} of {len(run['rows'])} rows "
                 f"(copy {run['copy_bw'] / 1e12:.2f} TB/s, bf16 matmul {run['bf16_matmul_rate'] / 1e12:.0f} TFLOP/s)")
    return lines, met, len(run["rows"])


def tick_labels(ts: list[int], most: int = 10) -> list[str]:
    """Labels of the T axis: every T where there are at most `most`, else every n-th (n = ceil(len / most))
    and the last, so that a sweep of many T stays readable."""
    every = -(-len(ts) // most)
    return [str(t) if i % every == 0 or i == len(ts) - 1 else "" for i, t in enumerate(ts)]


def plot(run: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shapes = list(dict.fromkeys(r["shape"] for r in run["rows"]))
    # at least 9 inches wide: one shape's sweep of many T (bench_gpu.py --shapes X --tokens ...) gets room for its title
    fig, axes = plt.subplots(2, len(shapes), figsize=(max(4.6 * len(shapes), 9.0), 7.2), squeeze=False, sharex="col")
    for col, shape in enumerate(shapes):
        rows = sorted((r for r in run["rows"] if r["shape"] == shape), key=lambda r: r["T"])
        ts = [r["T"] for r in rows]
        frac, speed = axes[0][col], axes[1][col]
        goals = [target(r["E"], r["T"]) for r in rows]
        frac.plot(ts, goals, "_", color="0.35", markersize=22, markeredgewidth=2.5, label="target (DESIGN.md)")
        frac.plot(ts, [r["fraction_of_floor"] for r in rows], "o-", color="tab:blue", label="Colibri")
        for r, goal in zip(rows, goals):  # filled where the row meets its target, hollow where not
            if not meets(r["fraction_of_floor"], goal):
                frac.plot([r["T"]], [r["fraction_of_floor"]], "o", color="white", markeredgecolor="tab:blue")
        for name in dict.fromkeys(n for r in rows for n in r.get("compare", {})):
            pts = [(r["T"], r["compare"][name]["fraction_of_floor"]) for r in rows if name in r.get("compare", {})]
            frac.plot(*zip(*pts), ".:", alpha=0.7, label=name)
        frac.set_title(f"{shape} ({rows[0]['E']} x ({rows[0]['H']}, {rows[0]['F']}), k={rows[0]['k']})", fontsize=9)
        frac.set_ylim(0, max(1.1, max(r["fraction_of_floor"] for r in rows) * 1.05))
        frac.grid(alpha=0.3)
        speed.plot(ts, [r["speedup_vs_eager"] for r in rows], "s-", color="tab:red", label="over PyTorch eager")
        speed.plot(ts, [r["speedup_vs_grouped"] for r in rows], "^-", color="tab:green",
                   label="over torch._grouped_mm")
        speed.axhline(1.0, color="0.5", linewidth=0.8)
        speed.set_yscale("log")
        speed.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        speed.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        speed.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        speed.set_xscale("log", base=2)
        speed.set_xticks(ts, tick_labels(ts))
        speed.set_xlabel("tokens T")
        speed.grid(alpha=0.3, which="both")
        if col == 0:
            frac.set_ylabel("fraction of the floor (1 = copy BW / matmul rate)")
            speed.set_ylabel("speed-up (x)")
            frac.legend(fontsize=7, loc="lower right")
            speed.legend(fontsize=7)
    _, met, total = summary(run)
    fig.suptitle(f"{run.get('device', 'GPU')}: one MoE layer, bf16, CUDA-graph replay, medians of {run.get('reps', '?')}"
                 f" - targets met on {met} of {total} rows (hollow: short)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="a bench_gpu.py --json file")
    ap.add_argument("--plot", default="", help="write a PNG of the run here")
    args = ap.parse_args()
    with open(args.json) as f:
        run = json.load(f)
    print("\n".join(summary(run)[0]))
    if args.plot:
        plot(run, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
