"""bench/gpu_report.py on saved runs (no GPU): DESIGN.md's target per row, the met count, the plot."""
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


@pytest.mark.parametrize("name, met", [("gpu_h200_v12.json", 12), ("gpu_h200_v14.json", 13),
                                       ("gpu_h200_v15.json", 13), ("gpu_h200_v15c.json", 12),
                                       ("gpu_h200_v16.json", 16), ("gpu_h200_v17.json", 13),
                                       ("gpu_h200_v18.json", 15), ("gpu_h200_v20.json", 16),
                                       ("gpu_h200_v20_read.json", 16), ("gpu_h200_v23.json", 16),
                                       ("gpu_h200_v24.json", 15), ("gpu_h200_v25.json", 15),
                                       ("gpu_h200_v26.json", 16), ("gpu_h200_v27.json", 17),
                                       ("gpu_h200_v27_chain_all.json", 17), ("gpu_h200_v28.json", 18),
                                       ("gpu_h200_v28_run2.json", 17)])
def test_committed_run_matches_bench_readme(name, met):
    # bench/README.md: "Met: 12 of 21" (v12, v15 C), "Met: 13 of 21" (v14, v15, v17), "Met: 15 of 21" (v18,
    # v24, v25), "Met: 16 of 21" (v16, v20 with either flush, v23, v26), "Met: 17 of 21" (v27, both runs),
    # "Met: 18 of 21" (v28; its second run 17)
    run = json.loads((ROOT / "bench" / name).read_text())
    assert gpu_report.summary(run)[1:] == (met, 21)
    assert f"Met: {met} of 21" in (ROOT / "bench" / "README.md").read_text()


def test_tick_labels_thin_out_a_long_sweep():
    assert gpu_report.tick_labels([1, 4, 16, 64, 256, 1024, 4096]) == ["1", "4", "16", "64", "256", "1024", "4096"]
    ts = list(range(960, 2113, 64))  # 19 T: every other one, the first and the last labelled
    labels = gpu_report.tick_labels(ts)
    assert labels[0] == "960" and labels[1] == "" and labels[2] == "1088" and labels[-1] == "2112"
    assert sum(1 for x in labels if x) == 10
    labels = gpu_report.tick_labels(list(range(22)))  # 22: every third, and the last
    assert [i for i, x in enumerate(labels) if x] == [0, 3, 6, 9, 12, 15, 18, 21]


@pytest.mark.parametrize("name", ["gpu_h200_v13_decode.json",  # has --compare builds
                                  "gpu_h200_v25_mixtral.json"])  # one shape, 19 T
def test_plot_writes_a_png(tmp_path, name):
    pytest.importorskip("matplotlib")
    run = json.loads((ROOT / "bench" / name).read_text())
    path = tmp_path / "run.png"
    gpu_report.plot(run, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
