"""Targets, a summary and a plot of a bench_gpu.py run (its --json file); needs no GPU.

    python3 bench/gpu_report.py bench/results/gpu_h200.json [--plot gpu_h200.png]

Prints each row's fraction of the floor beside the target DESIGN.md sets for it ("Targets for
Colibri") and how many rows meet theirs. A fraction meets its target when its value rounded to two
decimals, as the tables print it, is at least the target. --plot draws, per shape, the fraction of the
floor against T with the targets (and every --compare build of the run), and below it the speed-up
over PyTorch eager, torch._grouped_mm and cuBLAS per expert (torch.matmul on the same GEMMs, the
vendor library's ceiling). bench_gpu.py prints the same summary at the end of a run.

A run with fp8 rows (bench_gpu.py --fp8-shapes) also gets its fp8 table against DESIGN.md's "Targets for
fp8 experts" (fp8/bf16 time, fraction of the fp8 floor, faster than torch._scaled_grouped_mm), and
--plot-fp8 draws the times of fp8, bf16 and the baselines per T above the ratio and the fraction.
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
    """Lines of a per-row table (shape, T, ms, the cuBLAS per-expert ceiling's ms and its time over Colibri's,
    fraction, target, met) and the met / total counts. Runs from before the ceiling show nan there."""
    width = max([17] + [len(r["shape"]) for r in run["rows"]])
    lines = [f"{'shape':{width}s} {'T':>5s} {'colibri ms':>10s} {'cuBLAS ms':>9s} {'x cuBLAS':>8s} {'frac':>5s} "
             f"{'target':>6s}  met"]
    met = 0
    reasons = {}
    for r in run["rows"]:
        goal, frac = target(r["E"], r["T"]), r["fraction_of_floor"]
        ok = meets(frac, goal)
        met += ok
        verdict = "yes" if ok else "no" if math.isnan(frac) else f"no (short by {goal - round(frac, 2):.2f})"
        mm_ms, mm_x = r.get("matmul_ceiling_ms", math.nan), r.get("fraction_of_matmul_ceiling", math.nan)
        lines.append(f"{r['shape']:{width}s} {r['T']:5d} {r['colibri_ms']:10.4f} {mm_ms:9.4f} {mm_x:8.2f} "
                     f"{frac:5.2f} {goal:6.2f}  {verdict}")
        if r.get("matmul_ceiling_status", "ok") != "ok":
            reasons.setdefault(r["matmul_ceiling_status"], []).append(f"{r['shape']} T={r['T']}")
    for why, where in reasons.items():
        lines.append(f"  {why} ({len(where)} rows: {', '.join(where[:3])}{', ...' if len(where) > 3 else ''})")
    lines.append(f"DESIGN.md's targets met on {met} of {len(run['rows'])} rows "
                 f"(copy {run['copy_bw'] / 1e12:.2f} TB/s, bf16 matmul {run['bf16_matmul_rate'] / 1e12:.0f} TFLOP/s); "
                 f"cuBLAS: torch.matmul per expert on the same GEMMs, x cuBLAS its time over Colibri's")
    return lines, met, len(run["rows"])


def layer_title(r: dict) -> str:
    """A row's layer in a few words: experts x (H, F), k, and its shared expert (gated or not)."""
    shared = f", shared {r['shared_F']}{' gated' if r.get('shared_gate') else ''}" if r.get("shared_F") else ""
    return f"{r['E']} x ({r['H']}, {r['F']}), k={r['k']}{shared}"


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
        frac.set_title(f"{shape} ({layer_title(rows[0])})", fontsize=9)
        frac.set_ylim(0, max(1.1, max(r["fraction_of_floor"] for r in rows) * 1.05))
        frac.grid(alpha=0.3)
        speed.plot(ts, [r["speedup_vs_eager"] for r in rows], "s-", color="tab:red", label="over PyTorch eager")
        speed.plot(ts, [r["speedup_vs_grouped"] for r in rows], "^-", color="tab:green",
                   label="over torch._grouped_mm")
        ceiling = [(r["T"], r["fraction_of_matmul_ceiling"]) for r in rows
                   if math.isfinite(r.get("fraction_of_matmul_ceiling", math.nan))]
        if ceiling:  # runs from before the ceiling have none
            speed.plot(*zip(*ceiling), "D-", color="tab:purple", markersize=4,
                       label="over cuBLAS per expert (torch.matmul)")
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


# DESIGN.md, "Targets for fp8 experts": fp8 time over Colibri's bf16 time of the same layer and tokens, at most
# 0.55 for T <= 64 and 0.6 at T = 4096; the fraction of the fp8 floor, at least 0.85 for T = 16-256 and 0.7 at
# T = 4096, on these shapes only; and faster than torch._scaled_grouped_mm on every row.
FP8_FLOOR_SHAPES = ("Mixtral-8x7B", "DeepSeek-V3")


def fp8_ratio_target(tokens: int):
    """The largest fp8/bf16 time DESIGN.md allows at T = tokens, or None where it sets none."""
    return 0.55 if tokens <= 64 else 0.6 if tokens == 4096 else None


def fp8_floor_target(shape: str, tokens: int):
    """The smallest fraction of the fp8 floor DESIGN.md asks of this shape at T = tokens, or None."""
    if shape not in FP8_FLOOR_SHAPES:
        return None
    return 0.85 if 16 <= tokens <= 256 else 0.7 if tokens == 4096 else None


def fp8_checks(row: dict) -> dict:
    """Each of the row's targets: {name: "yes" | "no" | "-" (no target at this T) | "n/a" (its baseline did not
    run)}. An fp8 output that is not finite meets nothing (NaN never passes); printed values round to two
    decimals as the tables print them; "faster" is a strict comparison of the unrounded times."""
    finite = math.isfinite(row["rel_err_vs_ref64"])
    ratio, frac, speedup = row["fp8_vs_bf16"], row["fraction_of_fp8_floor"], row["speedup_vs_scaled_grouped"]
    goal_ratio, goal_frac = fp8_ratio_target(row["T"]), fp8_floor_target(row["shape"], row["T"])
    verdict = {}
    verdict["ratio"] = "-" if goal_ratio is None else \
        "yes" if finite and not math.isnan(ratio) and round(ratio, 2) <= goal_ratio else "no"
    verdict["floor"] = "-" if goal_frac is None else "yes" if finite and meets(frac, goal_frac) else "no"
    verdict["scaled_grouped"] = "n/a" if math.isnan(row["scaled_grouped_ms"]) else \
        "yes" if finite and not math.isnan(speedup) and speedup > 1.0 else "no"
    return verdict


def fp8_summary(run: dict) -> tuple[list[str], int, int]:
    """Lines of the fp8 table (each row's three targets marked) and the met / judged counts ("-" and "n/a"
    are not judged), with the reasons a row's fp8 forward or baseline did not run."""
    lines = [f"{'shape':17s} {'T':>5s} {'fp8 ms':>8s} {'bf16 ms':>8s} {'fp8/bf16':>8s} {'goal':>5s} {'met':>3s} "
             f"{'floor':>5s} {'goal':>5s} {'met':>3s} {'x sg':>6s} {'met':>3s} {'x eager':>7s} {'err64':>8s} "
             f"{'err16':>8s} {'read':>5s} {'mm':>5s}"]
    met = judged = not_run = 0
    reasons = {}
    for r in run["fp8_rows"]:
        v = fp8_checks(r)
        met += sum(x == "yes" for x in v.values())
        judged += sum(x in ("yes", "no") for x in v.values())
        not_run += v["scaled_grouped"] == "n/a"
        goal_ratio, goal_frac = fp8_ratio_target(r["T"]), fp8_floor_target(r["shape"], r["T"])
        lines.append(f"{r['shape']:17s} {r['T']:5d} {r['fp8_ms']:8.4f} {r['bf16_ms']:8.4f} {r['fp8_vs_bf16']:8.2f} "
                     f"{'-' if goal_ratio is None else goal_ratio:>5} {v['ratio']:>3s} "
                     f"{r['fraction_of_fp8_floor']:5.2f} {'-' if goal_frac is None else goal_frac:>5} "
                     f"{v['floor']:>3s} {r['speedup_vs_scaled_grouped']:6.2f} {v['scaled_grouped']:>3s} "
                     f"{r['speedup_vs_eager']:7.2f} {r['rel_err_vs_ref64']:8.1e} {r['rel_err_vs_bf16']:8.1e} "
                     f"{r.get('fraction_of_read_ceiling', float('nan')):5.2f} "
                     f"{r.get('fraction_of_scaled_mm_ceiling', float('nan')):5.2f}")
        for key in ("fp8_status", "scaled_grouped_status", "read_ceiling_status", "scaled_mm_ceiling_status"):
            if r.get(key, "ok") != "ok":
                reasons.setdefault(r[key], []).append(f"{r['shape']} T={r['T']}")
    for why, where in reasons.items():
        lines.append(f"  {why} ({len(where)} rows: {', '.join(where[:3])}{', ...' if len(where) > 3 else ''})")
    lines.append("read, mm: the row's practical ceilings over its fp8 time (a plain read of the same fp8 bytes; "
                 "torch._scaled_mm on the same GEMMs)")
    lines.append(f"fp8 targets (DESIGN.md) met: {met} of {judged} judged"
                 + (f"; faster than torch._scaled_grouped_mm not judged on {not_run} rows (it did not run)"
                    if not_run else "")
                 + f" (copy {run['copy_bw'] / 1e12:.2f} TB/s, fp8 matmul {run['fp8_matmul_rate'] / 1e12:.0f} TFLOP/s)")
    return lines, met, judged


def plot_fp8(run: dict, path: str) -> None:
    """Per fp8 shape: the times of Colibri fp8 and bf16, torch._scaled_grouped_mm, the eager loop and the fp8
    floor against T; below, fp8/bf16 and the fraction of the fp8 floor with their targets (hollow: short)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in run["fp8_rows"]))
    fig, axes = plt.subplots(2, len(shapes), figsize=(max(4.8 * len(shapes), 9.0), 7.6), squeeze=False,
                             sharex="col")
    for col, shape in enumerate(shapes):
        rows = sorted((r for r in run["fp8_rows"] if r["shape"] == shape), key=lambda r: r["T"])
        ts = [r["T"] for r in rows]
        times, ratio = axes[0][col], axes[1][col]
        for key, style, color, label in (("fp8_ms", "o-", "tab:blue", "Colibri fp8"),
                                         ("bf16_ms", "s-", "0.45", "Colibri bf16"),
                                         ("scaled_grouped_ms", "^-", "tab:green", "torch._scaled_grouped_mm"),
                                         ("eager_ms", "v-", "tab:red", "eager dequantise + matmul"),
                                         ("fp8_floor_ms", "--", "black", "fp8 floor")):
            times.plot(ts, [r[key] for r in rows], style, color=color, label=label, markersize=4)
        missing = sorted({r["fp8_status"] for r in rows if r["fp8_status"] != "ok"})
        if missing:  # say on the panel why there is no fp8 line
            times.text(0.02, 0.02, "no fp8 forward: " + "; ".join(missing)[:90], transform=times.transAxes,
                       fontsize=6, color="tab:blue", wrap=True)
        times.set_xscale("log", base=2)
        times.set_yscale("log")
        times.set_title(f"{shape} ({layer_title(rows[0])})", fontsize=9)
        times.grid(alpha=0.3, which="both")
        for key, goal_of, color, label in (
                ("fp8_vs_bf16", lambda r: fp8_ratio_target(r["T"]), "tab:blue", "fp8 / bf16 time (target: at most)"),
                ("fraction_of_fp8_floor", lambda r: fp8_floor_target(r["shape"], r["T"]), "tab:purple",
                 "fraction of the fp8 floor (target: at least)")):
            ratio.plot(ts, [r[key] for r in rows], "o-", color=color, label=label, markersize=4)
            goals = [(r["T"], goal_of(r)) for r in rows if goal_of(r) is not None]
            if goals:
                ratio.plot(*zip(*goals), "_", color=color, markersize=18, markeredgewidth=2.5, alpha=0.6)
        for r in rows:  # hollow where a target is missed
            v = fp8_checks(r)
            for key, check, color in (("fp8_vs_bf16", "ratio", "tab:blue"),
                                      ("fraction_of_fp8_floor", "floor", "tab:purple")):
                if v[check] == "no" and math.isfinite(r[key]):
                    ratio.plot([r["T"]], [r[key]], "o", color="white", markeredgecolor=color)
        finite = [r[key] for r in rows for key in ("fp8_vs_bf16", "fraction_of_fp8_floor") if math.isfinite(r[key])]
        ratio.set_ylim(0, max([1.1] + [v * 1.05 for v in finite]))
        ratio.set_xticks(ts, tick_labels(ts))
        ratio.set_xlabel("tokens T")
        ratio.grid(alpha=0.3)
        if col == 0:
            times.set_ylabel("ms (median)")
            ratio.set_ylabel("ratio")
            times.legend(fontsize=7, loc="best")
            ratio.legend(fontsize=7, loc="upper left")
    _, met, judged = fp8_summary(run)
    fig.suptitle(f"{run.get('device', 'GPU')}: one MoE layer, fp8 e4m3 experts (block scales) beside bf16, "
                 f"medians of {run.get('reps', '?')} - fp8 targets met: {met} of {judged} judged", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="a bench_gpu.py --json file")
    ap.add_argument("--plot", default="", help="write a PNG of the run's bf16 rows here")
    ap.add_argument("--plot-fp8", default="", help="write a PNG of the run's fp8 rows here")
    args = ap.parse_args()
    with open(args.json) as f:
        run = json.load(f)
    if run["rows"] or not run.get("fp8_rows"):
        print("\n".join(summary(run)[0]))
    if run.get("fp8_rows"):
        print("\n".join(fp8_summary(run)[0]))
    if args.plot and run["rows"]:
        plot(run, args.plot)
        print(f"plot: {args.plot}")
    if args.plot_fp8 and run.get("fp8_rows"):
        plot_fp8(run, args.plot_fp8)
        print(f"fp8 plot: {args.plot_fp8}")


if __name__ == "__main__":
    main()
