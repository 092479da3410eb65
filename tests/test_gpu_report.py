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


def test_summary_shows_the_cublas_ceiling():
    # bench_gpu's per-expert torch.matmul ceiling beside each row, the reason where it did not run, and nan for
    # a run saved before it was measured
    rows = [dict(fake_row("Mixtral-8x7B", 8, 4096, 0.8, ms=2.0), matmul_ceiling_ms=3.0,
                 fraction_of_matmul_ceiling=1.5, matmul_ceiling_status="ok"),
            dict(fake_row("Qwen3-Next-80B-A3B", 512, 1, 0.6), matmul_ceiling_ms=math.nan,
                 fraction_of_matmul_ceiling=math.nan, matmul_ceiling_status="torch.matmul ceiling failed: oom"),
            fake_row("Qwen1.5-MoE", 60, 1, 0.6)]
    lines, met, total = gpu_report.summary(fake_run(rows))
    assert lines[1].split()[3:5] == ["3.0000", "1.50"] and lines[2].split()[3:5] == ["nan", "nan"]
    assert lines[3].split()[3:5] == ["nan", "nan"] and lines[3].startswith("Qwen1.5-MoE ")
    assert "torch.matmul ceiling failed: oom (1 rows: Qwen3-Next-80B-A3B T=1)" in lines[4]
    assert (met, total) == (3, 3)


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


def test_fp8_targets_are_design_md_table():
    # DESIGN.md, "Targets for fp8 experts": fp8/bf16 at most 0.55 at T <= 64 and 0.6 at T = 4096; the fp8
    # floor at least 0.85 at T = 16-256 and 0.7 at T = 4096, on the Mixtral and DeepSeek-V3 shapes only
    assert [gpu_report.fp8_ratio_target(t) for t in TOKENS] == [0.55, 0.55, 0.55, 0.55, None, None, 0.6]
    for shape in ("Mixtral-8x7B", "DeepSeek-V3"):
        assert [gpu_report.fp8_floor_target(shape, t) for t in TOKENS] == [None, None, 0.85, 0.85, 0.85, None, 0.7]
    assert {gpu_report.fp8_floor_target("Qwen3-30B-A3B", t) for t in TOKENS} == {None}


def fake_fp8_row(shape, T, ratio, frac, speedup, err=0.03, status="ok", sg_status="ok", bf16_ms=1.0):
    fp8_ms = ratio * bf16_ms
    sg_ms = speedup * fp8_ms if sg_status == "ok" else math.nan
    return dict(shape=shape, E=8, k=2, H=64, F=128, T=T, shared_F=0, block=[128, 128], fp8_ms=fp8_ms,
                bf16_ms=bf16_ms, fp8_vs_bf16=ratio, fp8_floor_ms=frac * fp8_ms, fraction_of_fp8_floor=frac,
                scaled_grouped_ms=sg_ms, eager_ms=5 * fp8_ms, speedup_vs_scaled_grouped=sg_ms / fp8_ms,
                speedup_vs_eager=5.0, rel_err_vs_ref64=err, rel_err_vs_bf16=err, fp8_status=status,
                scaled_grouped_status=sg_status)


def fake_fp8_run(rows):
    return dict(fake_run([]), fp8_matmul_rate=1.4e15, fp8_rows=rows)


def test_fp8_summary_marks_each_target():
    refused = "refused by the library: CUDA: fp8 weights are not supported"
    nan = math.nan
    rows = [fake_fp8_row("Mixtral-8x7B", 16, 0.554, 0.846, 1.01),  # prints 0.55 and 0.85: all three met
            fake_fp8_row("DeepSeek-V3", 4096, 0.61, 0.70, nan, sg_status="torch._scaled_grouped_mm failed: x"),
            fake_fp8_row("Qwen3-30B-A3B", 1, nan, nan, nan, err=nan, status=refused),  # no fp8 forward
            fake_fp8_row("Mixtral-8x7B", 64, 0.30, 0.95, 2.0, err=nan),  # fast, but its output is not finite
            fake_fp8_row("Mixtral-8x7B", 1024, 0.70, 0.80, 0.9)]  # no ratio or floor target at T = 1024
    rows[2]["scaled_grouped_ms"] = 0.5  # the baseline ran; the missing fp8 time misses it
    checks = [gpu_report.fp8_checks(r) for r in rows]
    assert checks[0] == dict(ratio="yes", floor="yes", scaled_grouped="yes")
    assert checks[1] == dict(ratio="no", floor="yes", scaled_grouped="n/a")
    assert checks[2] == dict(ratio="no", floor="-", scaled_grouped="no")
    assert checks[3] == dict(ratio="no", floor="no", scaled_grouped="no")
    assert checks[4] == dict(ratio="-", floor="-", scaled_grouped="no")
    lines, met, judged = gpu_report.fp8_summary(fake_fp8_run(rows))
    assert (met, judged) == (4, 11)
    assert any(refused in line and "Qwen3-30B-A3B T=1" in line for line in lines)
    assert any("torch._scaled_grouped_mm failed: x" in line for line in lines)
    assert "met: 4 of 11 judged" in lines[-1] and "not judged on 1 rows" in lines[-1] and "1400 TFLOP/s" in lines[-1]


def test_plot_fp8_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    refused = "refused by the library: CUDA: fp8 weights are not supported"
    rows = [fake_fp8_row(shape, T, 0.5 + 0.01 * i, 0.8, 1.5) for shape in ("Mixtral-8x7B", "DeepSeek-V3")
            for i, T in enumerate(TOKENS)]
    rows += [fake_fp8_row("Qwen3-30B-A3B", T, math.nan, math.nan, math.nan, err=math.nan, status=refused)
             for T in TOKENS]  # a shape with no fp8 line at all (the library refused it) still draws
    path = tmp_path / "fp8.png"
    gpu_report.plot_fp8(fake_fp8_run(rows), str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
