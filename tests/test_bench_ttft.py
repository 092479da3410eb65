"""bench/bench_ttft.py end to end on the CPU, as a smoke test: a 2-layer Qwen3-MoE of a small shape, its
experts packed to fp8, the eager baseline, the attention tier alone and the in-process expert tier each
driven open-loop through the continuous batcher, and the JSON and table written. The figures mean
nothing here; that every request of every run is served and accounted for does. Needs torch and
transformers (skipped without)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512)
NEW_TOKENS = 4


def run_bench(tmp_path, *options):
    """bench_ttft.py on the CPU with a tiny shape and `options` added; returns (ttft.json, out folder)."""
    package_parent = str(pathlib.Path(colibri.__file__).resolve().parents[1])
    # One OpenMP thread: on a small shared CI machine torch's threads and the library's oversubscribe
    # the cores, and a tiny model's forwards then take tens of times longer.
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "bench_ttft.py"), "--device", "cpu", "--layers", "2",
               "--shape", json.dumps(SHAPE), "--prompt-tokens", "32", "--new-tokens", str(NEW_TOKENS),
               "--duration", "1", "--sweep", "0.5", "--max-batch", "4", "--out", str(out),
               "--packed", str(tmp_path / "layers"), *options]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "ttft.json").read_text()), out


def test_the_ttft_bench_runs_on_the_cpu(tmp_path):
    written, out = run_bench(tmp_path, "--protocols", "eager,null,inprocess")
    assert written["device"] == "cpu" and written["args"]["max_batch"] == "4"
    assert sorted(written["runs"]) == ["attention only", "eager", "inprocess"]
    eager = written["runs"]["eager"]
    assert written["fixed_rate"] == pytest.approx(0.5 * eager["capacity_per_s"], abs=1e-3)
    assert eager["capacity_per_s"] == pytest.approx(1e3 / eager["warm_prefill_ms"])
    assert [len(written["runs"][name]["points"]) for name in ("eager", "attention only")] == [1, 1]
    assert len(written["runs"]["inprocess"]["points"]) >= 2  # the fixed load, then the sweep
    for name, runs in written["runs"].items():
        for point in runs["points"]:
            assert point["complete"] and point["n"] == point["offered"] == len(point["samples"]) > 0, name
            assert 1.0 <= point["mean_batch"] <= 4.0, name
            for sample in point["samples"]:
                assert sample["tokens"] == NEW_TOKENS
                assert 0 <= sample["wait_s"] < sample["ttft_s"] and sample["prefill_s"] > 0
                assert sample["ttft_s"] == pytest.approx(sample["wait_s"] + sample["prefill_s"], abs=1e-3)
    table = (out / "ttft.md").read_text()
    assert "| tier | offered req/s | n/offered | P50 TTFT ms | P99 TTFT ms | P50 TPOT ms | P99 TPOT ms | mean batch |" \
        in table
    assert "at most 4 sequences per decode forward" in table


def test_a_fixed_rate_in_requests_per_second_is_every_tiers_first_load(tmp_path):
    written, _ = run_bench(tmp_path, "--protocols", "eager,inprocess", "--fixed-rate", "3")
    assert written["fixed_rate"] == 3
    assert [written["runs"][name]["points"][0]["rate"] for name in ("eager", "inprocess")] == [3, 3]
