"""Smoke test of the Locust load test (loadtest/): a short headless run through loadtest/run.py (what
`make loadtest` runs) against the session's real tritonserver, both protocols, both profiles, and a
stepped user ramp, then its files: Locust's CSVs, summary.json and latency.png."""
import csv
import json
import socket
import subprocess
import sys

import pytest

from triton_server import REPO_ROOT, import_compare, missing_reason

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")

RUN = REPO_ROOT / "loadtest" / "run.py"
STEPS = (2, 6)  # users; the first step holds one user of each protocol
STEP_SECONDS = 6


def test_headless_run_writes_summary_and_plot(colibri_server, tmp_path):
    out = tmp_path / "loadtest"
    result = subprocess.run(
        [sys.executable, str(RUN), "--host", f"http://{colibri_server.http_url}", "--grpc-url", colibri_server.grpc_url,
         "--mix", "decode:1,prefill:1", "--prefill-tokens", "2-24", "--steps", ",".join(map(str, STEPS)),
         "--step-time", str(STEP_SECONDS), "--out", str(out)],
        capture_output=True, text=True, timeout=55)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # The table comes last: its header, 4 groups, the total, then P99 by users (2 steps x 4 groups).
    tail = result.stdout.splitlines()[-15:]
    assert tail[0].startswith("protocol profile") and tail[-1].startswith("  users"), result.stdout[-2000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"]["failures"] == 0
    groups = {(g["protocol"], g["profile"]): g for g in summary["groups"]}
    assert sorted(groups) == [("grpc", "decode"), ("grpc", "prefill"), ("http", "decode"), ("http", "prefill")]
    for key, group in groups.items():
        assert group["requests"] > 0 and group["failures"] == 0, key
        # The per-request samples and Locust's own final counts must agree.
        assert group["locust_requests"] == group["requests"], key
        assert 0 < group["p50_ms"] <= group["p95_ms"] <= group["p99_ms"], key
        assert (group["mean_tokens"] == 1) if key[1] == "decode" else (2 <= group["mean_tokens"] <= 24), key
    assert summary["total"]["locust_failures"] == 0
    assert sorted({r["users"] for r in summary["by_users"]}) == list(STEPS)
    for level in summary["by_users"]:  # each step's own throughput, over that step's time
        assert 0 < level["seconds"] <= STEP_SECONDS + 1 and level["failures"] == 0, level
        assert level["throughput_rps"] == pytest.approx(level["requests"] / level["seconds"]), level

    with open(out / "locust_stats_history.csv", newline="") as f:
        history = list(csv.DictReader(f))
    assert {int(r["User Count"]) for r in history} >= set(STEPS)
    assert (out / "locust_stats.csv").stat().st_size > 0

    png = (out / "latency.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    import matplotlib.image
    height, width, _ = matplotlib.image.imread(str(out / "latency.png")).shape
    assert width > 800 and height > 300


def test_no_server_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = subprocess.run([sys.executable, str(RUN), "--host", f"http://127.0.0.1:{port}", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "not ready" in result.stderr and "make serve" in result.stderr, result.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written when there is no server"


def test_rate_fixes_the_offered_load(colibri_server, tmp_path):
    """--rate paces each user (Locust's constant_throughput): 2 users at 3 requests/s each offer 6 per
    second, where the same small model answers hundreds per second in a closed loop."""
    out = tmp_path / "paced"
    result = subprocess.run(
        [sys.executable, str(RUN), "--host", f"http://{colibri_server.http_url}", "--grpc-url", colibri_server.grpc_url,
         "--protocols", "grpc", "--mix", "decode", "--users", "2", "--time", "6s", "--rate", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=55)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rate_per_user"] == 3.0 and summary["total"]["failures"] == 0
    # 6 s at 6 requests/s: about 36 requests (the first of each user goes out at once)
    assert 24 <= summary["total"]["requests"] <= 44, summary["total"]


def test_bad_rate_is_refused(tmp_path):
    result = subprocess.run([sys.executable, str(RUN), "--rate", "-1", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "--rate" in result.stderr, result.stderr


def test_sweep_picks_the_highest_throughput_within_the_budget():
    """bench/serving/compare.py's sweep: per user count, the budget profile's P99 and the throughput of
    all profiles; a level over budget or with failures is not eligible even when it is faster."""
    compare = import_compare()

    def row(users, profile, rps, tokens, p99, failures=0):
        return {"users": users, "protocol": "grpc", "profile": profile, "throughput_rps": rps,
                "tokens_per_s": tokens, "p50_ms": p99 / 2, "p99_ms": p99, "failures": failures}

    summary = {"by_users": [
        row(4, "prefill", 10.0, 10000.0, 50.0), row(4, "decode", 5.0, 5.0, 9.0),
        row(8, "prefill", 18.0, 18000.0, 190.0), row(8, "decode", 6.0, 6.0, 300.0),  # decode P99 is not budgeted
        row(16, "prefill", 30.0, 30000.0, 250.0), row(16, "decode", 7.0, 7.0, 10.0),  # over budget
        row(32, "prefill", 40.0, 40000.0, 100.0, failures=1), row(32, "decode", 8.0, 8.0, 10.0),  # a failure
    ]}
    result = compare.sweep_result("colibri_moe", summary, "prefill", 200.0)
    assert [lv["users"] for lv in result["levels"]] == [4, 8, 16, 32]
    assert result["levels"][1]["rps"] == pytest.approx(24.0) and result["levels"][1]["tokens_per_s"] == pytest.approx(18006.0)
    assert result["best"]["users"] == 8 and result["best"]["p99_ms"] == 190.0 and not result["lower_bound"]
    assert compare.sweep_result("torch_moe", summary, "prefill", 40.0)["best"] is None
    text = compare.sweep_table([result, {**compare.sweep_result("torch_moe", summary, "prefill", 60.0)}], "prefill", 200.0)
    assert "colibri/torch: 1.80x tokens/s" in text, text
    # a sweep that never reached the budget says its best is only a lower bound
    generous = compare.sweep_result("colibri_moe", {"by_users": summary["by_users"][:4]}, "prefill", 1000.0)
    assert generous["best"]["users"] == 8 and generous["lower_bound"]
    text = compare.sweep_table([generous, compare.sweep_result("torch_moe", summary, "prefill", 60.0)], "prefill", 1000.0)
    assert "colibri/torch: at least 1.80x" in text and "lower bound" in text, text


BF16_CHECK = r"""
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils
import tritonclient.grpc._infer_input, tritonclient.grpc._infer_result
import tritonclient.http._infer_input, tritonclient.http._infer_result
import locustfile

rng = np.random.default_rng(int(__import__("sys").argv[1]))
special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-40, 3.4e38, 65504.0], np.float32)
for shape in [(1, 7), (5, 64), (33, 130)]:
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(np.float32)
    x.flat[rng.choice(x.size, min(x.size, len(special)), replace=False)] = special[:min(x.size, len(special))]
    for array in (x, np.asfortranarray(x), x[:, ::-1]):  # any memory order packs as C order
        expected = tritonclient.utils.serialize_bf16_tensor(array).item()
        assert locustfile.serialize_bf16_tensor(array).item() == expected, shape
        sent = grpcclient.InferInput("h", list(array.shape), "BF16").set_data_from_numpy(array)._get_content()
        assert sent == expected, shape
        sent = httpclient.InferInput("h", list(array.shape), "BF16").set_data_from_numpy(array)._get_binary_data()
        assert sent == expected, shape
        decoded = tritonclient.utils.deserialize_bf16_tensor(expected)
        ours = locustfile.deserialize_bf16_tensor(expected)
        assert ours.shape == decoded.shape and ours.dtype == decoded.dtype, (ours.shape, decoded.shape)
        assert ours.tobytes() == decoded.tobytes(), shape  # NaN payloads included
for module in (tritonclient.grpc._infer_input, tritonclient.http._infer_input):
    assert module.serialize_bf16_tensor is locustfile.serialize_bf16_tensor, module
for module in (tritonclient.grpc._infer_result, tritonclient.http._infer_result):
    assert module.deserialize_bf16_tensor is locustfile.deserialize_bf16_tensor, module
assert locustfile.serialize_bf16_tensor(np.zeros((0, 4), np.float32)).size == 0
assert locustfile.deserialize_bf16_tensor(b"").shape == (0, 1)
try:
    locustfile.serialize_bf16_tensor(np.zeros((2, 2), np.float64))
except tritonclient.utils.InferenceServerException:
    pass
else:
    raise AssertionError("a float64 array was packed")
print("ok")
"""


def test_bf16_inputs_are_packed_as_tritonclient_packs_them(rng):
    """The load generator packs BF16 inputs and unpacks BF16 answers with its own vectorised functions
    (tritonclient's loop over the elements in Python and saturated it): the same bytes and values as
    tritonclient's, through both protocols' InferInput, for any memory order, NaN, Inf, signed zeros
    and subnormals included. In a subprocess: importing Locust patches the standard library for gevent."""
    result = subprocess.run([sys.executable, "-c", BF16_CHECK, str(int(rng.integers(2**31)))],
                            cwd=REPO_ROOT / "loadtest", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout[-2000:] + result.stderr[-4000:]
