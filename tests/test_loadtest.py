"""Smoke test of the Locust load test (loadtest/): a short headless run through loadtest/run.py (what
`make loadtest` runs) against the session's real tritonserver, both protocols, both profiles, and a
stepped user ramp, then its files: Locust's CSVs, summary.json and latency.png."""
import csv
import json
import socket
import subprocess
import sys

import pytest

from triton_server import REPO_ROOT, missing_reason

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
