"""bench/gpu_report.py (no GPU): DESIGN.md's target per row, the met count and the plot, on small runs made
here, and the kept runs of bench/results/ read."""
import json
import math
from pathlib import Path

import pytest

from colibri.testing import load_script

ROOT = Path(__file__).resolve().parents[1]
gpu_report = load_script(ROOT / "bench" / "gpu_report.py")

TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def test_targets_are_design_md_table():
    # DESIGN.md, "Targets for Colibri": Mixtral-size experts, then the fine-grained shapes
    assert [gpu_report.target(8, t) for t in TOKENS] == [0.85, 0.85, 0.95, 0.95, 0.95, 0.75, 0.8]
    assert [gpu_report.target(64, t) for t in TOKENS] == [0.5, 0.7, 0.85, 0.85, 0.85, 0.7, 0.6]
    assert [gpu_report.target(60, t) for t in TOKENS] == [0.5, 0.7, 0.85, 0.85, 0.85, 0.7, 0.6]
    # a T between the table's rows takes the band it falls in
    assert (gpu_report.target(60, 2), gpu_report.target(8, 512), gpu_report.target(8, 8192)) == (0.7, 0.75, 0.8)


def fake_row(shape, E, T, frac, ms=0.1):
    return dict(shape=shape, E=E, k=2, H=64, F=128, T=T, colibri_ms=ms, eager_ms=ms * 3, grouped_ms=ms * 2,
                floor_ms=frac * ms, fraction_of_floor=frac, speedup_vs_eager=3.0, speedup_vs_grouped=2.0,
                experts_touched=2, rel_err_vs_eager=0.006)


def fake_run(rows):
    return dict(device="test GPU", copy_bw=4.0e12, bf16_matmul_rate=7.0e14, reps=5, rows=rows)


def test_summary_counts_the_printed_fraction():
    rows = [fake_row("Mixtral-8x7B", 8, 1, 0.846),  # prints 0.85: meets 0.85
            fake_row("Mixtral-8x7B", 8, 4, 0.844),  # prints 0.84: short by 0.01
            fake_row("Qwen1.5-MoE", 60, 1, math.nan),  # no time: never meets
            fake_row("Qwen1.5-MoE", 60, 4096, 0.61)]
    lines, met, total = gpu_report.summary(fake_run(rows))
    assert (met, total) == (2, 4)
    assert lines[1].endswith("yes") and lines[2].endswith("no (short by 0.01)") and lines[3].endswith("no")
    assert "targets met on 2 of 4 rows" in lines[-1] and "4.00 TB/s" in lines[-1]


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "results").glob("gpu_*.json")), ids=lambda p: p.name)
def test_kept_result_reads(path):
    # bench/results/ keeps the latest run per GPU kind: gpu_report reads it, every row against its target
    run = json.loads(path.read_text())
    lines, met, total = gpu_report.summary(run)
    assert total == len(run["rows"]) and 0 <= met <= total


def test_tick_labels_thin_out_a_long_sweep():
    assert gpu_report.tick_labels([1, 4, 16, 64, 256, 1024, 4096]) == ["1", "4", "16", "64", "256", "1024", "4096"]
    ts = list(range(960, 2113, 64))  # 19 T: every other one, the first and the last labelled
    labels = gpu_report.tick_labels(ts)
    assert labels[0] == "960" and labels[1] == "" and labels[2] == "1088" and labels[-1] == "2112"
    assert sum(1 for x in labels if x) == 10
    labels = gpu_report.tick_labels(list(range(22)))  # 22: every third, and the last
    assert [i for i, x in enumerate(labels) if x] == [0, 3, 6, 9, 12, 15, 18, 21]


def sweep_run():
    """One shape over 19 T, one --compare build: the plot's thinned ticks and its dotted compare lines."""
    rows = []
    for n, T in enumerate(range(960, 2113, 64)):
        row = fake_row("Mixtral-8x7B", 8, T, 0.7 + 0.01 * n)
        row["compare"] = {"old": dict(colibri_ms=0.11, fraction_of_floor=0.65 + 0.01 * n, rel_err_vs_eager=0.006,
                                      same_bits=False)}
        rows.append(row)
    return fake_run(rows)


@pytest.mark.parametrize("run", [fake_run([fake_row(shape, E, T, 0.8) for shape, E in
                                           (("Mixtral-8x7B", 8), ("Qwen1.5-MoE", 60)) for T in TOKENS]),
                                 sweep_run()], ids=["two shapes", "sweep with a compare build"])
def test_plot_writes_a_png(tmp_path, run):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    gpu_report.plot(run, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
