"""Smoke test of the Locust load test (loadtest/): a short headless run through loadtest/run.py (what
`make loadtest` runs) against the session's real tritonserver, both protocols, both profiles, and a
stepped user ramp, then its files: Locust's CSVs, summary.json and latency.png. Also the summary's
sample counts and few-samples flags on made-up samples, and BF16 through tritonclient's public API
(what CudaShmUser says on a host without a GPU or cupy is in test_cuda_shm.py)."""
import csv
import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from colibri.testing import load_script
from colibri.testing.server import REPO_ROOT, missing_reason

needs_server = pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")

RUN = REPO_ROOT / "loadtest" / "run.py"
# Loaded by path (not locustfile: importing Locust patches the standard library).
load_summary = load_script(REPO_ROOT / "loadtest" / "summary.py")
load_run = load_script(REPO_ROOT / "loadtest" / "run.py")
STEPS = (2, 6)  # users; the first step holds one user of each protocol
STEP_SECONDS = 6


@needs_server
def test_headless_run_writes_summary_and_plot(colibri_server, tmp_path):
    out = tmp_path / "loadtest"
    result = subprocess.run(
        [sys.executable, str(RUN), "--host", f"http://{colibri_server.http_url}", "--grpc-url", colibri_server.grpc_url,
         "--mix", "decode:1,prefill:1", "--prefill-tokens", "2-24", "--steps", ",".join(map(str, STEPS)),
         "--step-time", str(STEP_SECONDS), "--out", str(out)],
        capture_output=True, text=True, timeout=55)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # The table comes last: its header, 4 groups, the total, the layer-latency line (and the footnote on
    # percentiles from few requests), a heading and P99 by users (2 steps x 4 groups), the sample count.
    lines = result.stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("protocol profile"))
    table = lines[header:]
    assert table[-2].startswith("  users") and len(table) in (17, 18), result.stdout[-2000:]
    assert table[6].startswith("P99 layer latency, prefill (one layer's share of TTFT, not TTFT"), table
    assert table[-1] == f"samples: {json.loads((out / 'summary.json').read_text())['total']['requests']}, as Locust counted"

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
        assert group["metric"] == "layer"
        assert_counted(group)
    # P99 layer latency of prefill: every successful prefill request, both protocols, named as one
    # layer's; a single-layer run has no TTFT
    prefill = [g for g in summary["groups"] if g["profile"] == "prefill"]
    assert summary["layer_prefill_samples"] == summary["layer_prefill"]["samples"] == sum(g["samples"] for g in prefill)
    assert min(g["p99_ms"] for g in prefill) <= summary["layer_prefill_p99_ms"] <= max(g["p99_ms"] for g in prefill)
    assert summary["layer_prefill"]["protocols"] == ["grpc", "http"]
    assert summary["ttft_p99_ms"] is None and summary["ttft_samples"] == 0 and "ttft_note" in summary
    assert summary["workload"] == "layer" and summary["arrivals"] == "closed" and summary["counts_agree"] is True
    layer_line = f"{summary['layer_prefill_p99_ms']:.2f} ms from {summary['layer_prefill_samples']} requests"
    assert layer_line in table[6], table[6]
    assert summary["total"]["locust_failures"] == 0
    assert_counted(summary["total"])
    assert summary["grpc_url"] == colibri_server.grpc_url and summary["host"] == f"http://{colibri_server.http_url}"
    assert sorted({r["users"] for r in summary["by_users"]}) == list(STEPS)
    for level in summary["by_users"]:  # each step's own throughput, over that step's time
        assert 0 < level["seconds"] <= STEP_SECONDS + 1 and level["failures"] == 0, level
        assert level["throughput_rps"] == pytest.approx(level["requests"] / level["seconds"]), level
        assert_counted(level)
    # the table marks each P99 resting on fewer than 100 requests, and says what the mark means
    for row in table[1:5]:
        group = groups[(row.split()[0], row.split()[1])]
        assert row.split()[5] == str(group["samples"]), row  # protocol, profile (METRIC), requests, fails, samples
        assert ("*" in row) == bool(group["few_samples"]), (row, group)
    if any(g["few_samples"] for g in summary["groups"]):
        assert any(line.startswith("* from fewer requests") for line in table), table

    with open(out / "locust_stats_history.csv", newline="") as f:
        history = list(csv.DictReader(f))
    assert {int(r["User Count"]) for r in history} >= set(STEPS)
    assert (out / "locust_stats.csv").stat().st_size > 0

    png = (out / "latency.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    import matplotlib.image
    height, width, _ = matplotlib.image.imread(str(out / "latency.png")).shape
    assert width > 800 and height > 300


def assert_counted(row):
    """Every percentile row carries the count behind it and flags the percentiles it is too small for."""
    # a group's or the total's requests include its failures; a user level's are its successful ones
    assert row["samples"] == (row["requests"] if "users" in row else row["requests"] - row["failures"]), row
    assert row["few_samples"] == [f"p{p}_ms" for p in load_summary.PERCENTILES
                                  if row["samples"] < load_summary.MIN_SAMPLES[f"p{p}_ms"]], row


def test_no_server_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = subprocess.run([sys.executable, str(RUN), "--host", f"http://127.0.0.1:{port}", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "not ready" in result.stderr and "make serve" in result.stderr, result.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written when there is no server"


@needs_server
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
    compare = load_script(REPO_ROOT / "bench" / "serving" / "compare.py")

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


def test_grpc_address_follows_the_host():
    """Without --grpc-url, gRPC goes to --host's host on port 8001 (in run.py, which passes it on, and in
    the locustfile's own rule, for locust run by hand)."""
    assert load_run.grpc_address("http://10.1.2.3:18000") == "10.1.2.3:8001"
    assert load_run.grpc_address("gpu-node:8000") == "gpu-node:8001"
    assert load_run.grpc_address("http://[::1]:8000") == "[::1]:8001"
    assert load_run.grpc_address("http://10.1.2.3:18000", "10.1.2.3:18001") == "10.1.2.3:18001"
    check = ("import locustfile as l; assert l.grpc_address('http://10.1.2.3:18000') == '10.1.2.3:8001'; "
             "assert l.grpc_address('http://h:1', 'g:2') == 'g:2'; print('ok')")
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT / "loadtest", capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


def test_grpc_not_answering_names_the_setting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(load_run.NotReady, match="LOADTEST_GRPC_URL") as error:
        load_run.check_grpc_ready(f"127.0.0.1:{port}", "colibri_moe", given=False)
    assert "the --host host, port 8001" in str(error.value)


def write_samples(folder, rows):
    with open(folder / "samples-1.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["end_time", "protocol", "profile", "tokens", "latency_ms", "failed"])
        writer.writerows(rows)


def test_summary_counts_and_flags_thin_percentiles(tmp_path):
    """6 prefill requests (one P99 came from 6 once) are flagged for P50, P95 and P99 alike; 150 decode
    requests for none; 40 for P99 only. The counts and flags reach the JSON, the table and the plot's
    windows, and the layer's prefill figure is the prefill requests' own (not called TTFT). Samples
    files of the old six columns are read as before."""
    rng = np.random.default_rng(3)
    rows = [[f"{1000 + i * 0.1:.6f}", "grpc", "decode", 1, f"{rng.uniform(1, 2):.4f}", 0] for i in range(150)]
    rows += [[f"{1000 + i * 2.5:.6f}", "grpc", "prefill", 512, f"{20 + i:.4f}", 0] for i in range(6)]
    rows += [[f"{1000 + i * 0.3:.6f}", "http", "decode", 1, f"{rng.uniform(1, 2):.4f}", int(i == 0)] for i in range(41)]
    write_samples(tmp_path, rows)
    summary = load_summary.write(tmp_path)
    groups = {(g["protocol"], g["profile"]): g for g in summary["groups"]}
    assert groups[("grpc", "prefill")]["samples"] == 6
    assert groups[("grpc", "prefill")]["few_samples"] == ["p50_ms", "p95_ms", "p99_ms"]
    assert groups[("grpc", "decode")]["samples"] == 150 and groups[("grpc", "decode")]["few_samples"] == []
    assert groups[("http", "decode")]["samples"] == 40 and groups[("http", "decode")]["few_samples"] == ["p99_ms"]
    assert groups[("http", "decode")]["requests"] == 41 and groups[("http", "decode")]["failures"] == 1
    assert summary["layer_prefill_p99_ms"] == 25.0 and summary["layer_prefill_samples"] == 6  # nearest rank of 20..25
    assert summary["layer_prefill"]["few_samples"] == ["p50_ms", "p95_ms", "p99_ms"]
    assert summary["ttft_p99_ms"] is None and summary["generate"] == {}
    assert summary["total"]["samples"] == 196
    assert json.loads((tmp_path / "summary.json").read_text())["layer_prefill_p99_ms"] == 25.0
    text = load_summary.table(summary)
    lines = text.splitlines()
    prefill_row = next(line for line in lines if line.startswith("grpc     prefill (layer)"))
    assert prefill_row.count("*") == 3 and " 6 " in prefill_row, prefill_row
    decode_row = next(line for line in lines if line.startswith("grpc     decode (layer)"))
    assert "*" not in decode_row, decode_row
    assert "P99 layer latency, prefill" in text and "25.00 ms from 6 requests (fewer than 100: rough)" in text, text
    assert "time-to-first-token" not in text, text
    assert any(line.startswith("* from fewer requests than that percentile needs") for line in lines), text
    assert (tmp_path / "latency.png").stat().st_size > 10_000


def test_plot_windows_hold_enough_requests():
    """Each window of the latency-over-time plot is at least the minimum length and holds at least the
    requests a P99 needs; the remainder joins the last window; every sample is in exactly one."""
    rng = np.random.default_rng(4)
    seconds = np.sort(rng.uniform(0, 60, 1037))
    spans = load_summary.windows(seconds, 2.0, 100)
    assert len(spans) == 10
    assert all(len(indices) >= 100 and high - low >= 2.0 for low, high, indices in spans)
    assert sorted(np.concatenate([indices for _, _, indices in spans]).tolist()) == list(range(1037))
    assert [low for low, _, _ in spans[1:]] == [high for _, high, _ in spans[:-1]]  # consecutive
    thin = load_summary.windows(seconds[:30], 2.0, 100)  # too few for any P99: one window, all of them
    assert len(thin) == 1 and len(thin[0][2]) == 30
    slow = load_summary.windows(np.arange(300) * 0.001, 2.0, 100)  # 300 in 0.3 s: the minimum length rules
    assert len(slow) == 1


BF16_CHECK = r"""
import struct
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import triton_to_np_dtype
import locustfile
from colibri.dtypes import float32_to_bf16

def tritonclient_253_bytes(array):
    # tritonclient 2.5x's serialize_bf16_tensor, as it was: each float32's upper two bytes, C order,
    # one element at a time (the loop the load generator could not afford)
    return b"".join(struct.pack("<H", struct.unpack("<I", struct.pack("<f", v))[0] >> 16)
                    for v in np.ascontiguousarray(array, np.float32).ravel())

rng = np.random.default_rng(int(__import__("sys").argv[1]))
bf16 = triton_to_np_dtype("BF16")
special = np.array([np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-40, 3.3e38, 65504.0], np.float32)
for shape in [(1, 7), (5, 64), (33, 130)]:
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(np.float32)
    x.flat[rng.choice(x.size, min(x.size, len(special)), replace=False)] = special[:min(x.size, len(special))]
    exact = (float32_to_bf16(x).astype(np.uint32) << 16).view(np.float32)  # bf16 values, held as float32
    for array in (exact, np.asfortranarray(exact), exact[:, ::-1]):  # any memory order packs as C order
        expected = tritonclient_253_bytes(array)
        sent = locustfile.wire_array(array, "BF16")
        assert sent.dtype == bf16 and sent.tobytes() == expected, shape
        # through each protocol's public API: the gRPC input's bytes, the HTTP request body's binary part
        assert grpcclient.InferInput("h", list(array.shape), "BF16").set_data_from_numpy(sent)._get_content() == expected
        tensor = httpclient.InferInput("h", list(array.shape), "BF16")
        tensor.set_data_from_numpy(sent, binary_data=True)
        body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor])
        assert body[json_size:] == expected, shape
        # and back: an answer's bytes read by each protocol's InferResult, as the users read them
        response = service_pb2.ModelInferResponse(outputs=[service_pb2.ModelInferResponse.InferOutputTensor(
            name="output", datatype="BF16", shape=list(array.shape))], raw_output_contents=[expected])
        got = grpcclient.InferResult(response).as_numpy("output")
        assert got.shape == array.shape and got.astype(np.float32).tobytes() == np.ascontiguousarray(array).tobytes()
        header = ('{"outputs":[{"name":"output","datatype":"BF16","shape":%s,"parameters":{"binary_data_size":%d}}]}'
                  % (list(array.shape), len(expected))).encode()
        got = httpclient.InferResult.from_response_body(header + expected, header_length=len(header)).as_numpy("output")
        assert got.shape == array.shape and got.astype(np.float32).tobytes() == np.ascontiguousarray(array).tobytes()
    # values between bf16 neighbours: rounded to nearest even, as the server's colibri.dtypes rounds
    assert locustfile.wire_array(x, "BF16").view(np.uint16).tobytes() == float32_to_bf16(x).tobytes(), shape
    assert np.array_equal(locustfile.storage_bits(locustfile.wire_array(x, "BF16")), float32_to_bf16(x))
assert np.isnan(locustfile.wire_array(np.array([np.nan], np.float32), "BF16").astype(np.float32)).all()
source = open(locustfile.__file__).read()
assert "_infer_input" not in source and "_infer_result" not in source and "setattr(" not in source
print("ok")
"""


def test_bf16_goes_through_tritonclients_public_api(rng):
    """The load generator sends BF16 as tritonclient's own BF16 dtype (ml_dtypes.bfloat16), which
    InferInput packs with one tobytes() and InferResult reads with one frombuffer: the bytes equal those
    of tritonclient 2.5x's element-by-element serializer for every bf16 value (any memory order, Inf,
    signed zeros, subnormals), through both protocols' public InferInput and InferResult, and values
    between bf16 neighbours round as the server's own converter does. No tritonclient module is rebound.
    In a subprocess: importing Locust patches the standard library for gevent."""
    result = subprocess.run([sys.executable, "-c", BF16_CHECK, str(int(rng.integers(2**31)))],
                            cwd=REPO_ROOT / "loadtest", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout[-2000:] + result.stderr[-4000:]


def test_clients_import_no_torch_and_no_cuda_python():
    """The clients' and the locustfile's GPU paths are cupy's (colibri.serving.cuda_shm): neither torch nor
    cuda-python (tritonclient's CUDA shared-memory utilities import it) appears in any of them."""
    for path in [*sorted((REPO_ROOT / "client").glob("*.py")), REPO_ROOT / "loadtest" / "locustfile.py",
                 REPO_ROOT / "backend_src" / "colibri" / "serving" / "cuda_shm.py"]:
        text = path.read_text()
        for needle in ("import torch", "utils.cuda_shared_memory", "utils import cuda_shared_memory",
                       "cuda.bindings", "from cuda import", "import cuda\n"):
            assert needle not in text, (path, needle)


# --- the generate workload (whole-model requests through an attention tier) -------------------------

load_generate = load_script(REPO_ROOT / "loadtest" / "generate.py")


def test_poisson_arrivals_have_the_rate_asked_for():
    """Open-loop arrivals on a fixed seed: 50 per second over 400 s come to 20,000 within 3% (the count's
    own spread is 0.7%), with exponential gaps (mean 1/rate, standard deviation equal to the mean), in
    order, from the start time; the same seed gives the same schedule; a rate that is no rate is refused."""
    import itertools
    import random
    arrivals = load_generate.poisson_arrivals(50.0, random.Random(7), start=1000.0)
    times = np.array(list(itertools.takewhile(lambda t: t < 1400.0, arrivals)))
    assert times[0] > 1000.0 and np.all(np.diff(times) > 0)
    assert abs(len(times) - 20000) < 600, len(times)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.02, rel=0.03) and gaps.std() == pytest.approx(0.02, rel=0.05)
    # a Poisson count per second: variance equal to the mean (50) within a few percent of it
    per_second = np.bincount((times - 1000.0).astype(int), minlength=400)
    assert per_second.var() == pytest.approx(50.0, rel=0.15)
    again = load_generate.poisson_arrivals(50.0, random.Random(7), start=1000.0)
    assert [next(again) for _ in range(5)] == times[:5].tolist()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="arrival rate"):
            next(load_generate.poisson_arrivals(bad, random.Random(0)))


class FakeClock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_ttft_counts_from_the_scheduled_arrival():
    """A tier taking 30 ms to the first token (100 tokens at 0.3 ms) and 5 ms per later token, requests
    scheduled 10 ms apart and served one at a time: each waits for the one before, and its TTFT is that
    wait plus its own prefill (the single-server queue's waits: W[k+1] = max(0, W[k] + S[k] - gap)); TPOT
    is the tier's own. Nothing of the wait is lost because the load generator was busy."""
    clock = FakeClock(100.0)
    tier = load_generate.FakeTier(prefill_s_per_token=0.0003, tpot_s=0.005, sleep=clock.sleep, clock=clock)
    service = 0.03 + 3 * 0.005  # to the first token, then 3 more
    arrivals = [100.0 + 0.01 * k for k in range(6)]
    wait, samples = 0.0, []
    for k, arrival in enumerate(arrivals):
        clock.now = max(clock.now, arrival)  # the tier is free at clock.now; the request cannot start before it comes
        samples.append(load_generate.serve(tier, arrival, list(range(1, 101)), 4, clock=clock))
        assert samples[-1].ttft_ms == pytest.approx((wait + 0.03) * 1000.0, abs=1e-6), k
        assert samples[-1].tpot_ms == pytest.approx(5.0) and samples[-1].new_tokens == 4
        wait = max(0.0, wait + service - 0.01)
    assert samples[-1].ttft_ms > 150.0  # five requests queued ahead of the last one
    assert [s.error for s in samples] == [""] * 6 and tier.calls == 6


def test_fake_tier_and_factories():
    clock = FakeClock()
    tier = load_generate.FakeTier(prefill_s_per_token=0.001, tpot_s=0.002, sleep=clock.sleep, clock=clock)
    one = tier.generate([5, 6, 7], 1)
    assert one.tokens == [18] and one.tpot_s == 0.0 and one.ttft_s == pytest.approx(0.003) and one.prompt_tokens == 3
    assert tier.generate([5, 6, 7], 3).tokens == [18, 19, 20]
    failed = load_generate.serve(tier, 0.0, [], 4, clock=clock)  # an empty prompt: the request's error
    assert failed.error.startswith("ValueError") and failed.new_tokens == 0 and np.isnan(failed.ttft_ms)

    class Short(load_generate.FakeTier):
        def generate(self, prompt_ids, max_new_tokens):
            return load_generate.FakeResult([], 0.0, 0.0, len(prompt_ids))
    assert load_generate.serve(Short(), 0.0, [1], 4).error.startswith("WrongAnswer: 0 new tokens")
    assert load_generate.vocab_size(tier) == 1000 and load_generate.vocab_size(tier, 77) == 77
    with pytest.raises(ValueError, match="--vocab-size"):
        load_generate.vocab_size(object())
    assert load_generate.load_factory("") is load_generate.default_tier
    assert load_generate.load_factory("fake") is load_generate.fake_tier
    assert load_generate.load_factory("generate:fake_tier").__name__ == "fake_tier"  # module:function
    for bad, message in (("nocolon", "module:function"), ("generate:nothing", "no function nothing")):
        with pytest.raises(ValueError, match=message):
            load_generate.load_factory(bad)
    with pytest.raises(ValueError, match="--tier-model"):  # the default needs a model folder, and says so
        load_generate.default_tier("inprocess", type("Options", (), {"tier_model": ""})())
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="--tier-dtype 'bf16': not a torch dtype"):
        load_generate.default_tier("inprocess", type("Options", (), {"tier_model": "m", "tier_device": "cpu",
                                                                     "tier_dtype": "bf16"})())


GENERATE_ENV = {"LOADTEST_FAKE_PREFILL_S_PER_TOKEN": "0.0002", "LOADTEST_FAKE_TPOT_S": "0.04"}


def test_generate_with_two_processes_gathers_every_sample(tmp_path):
    """An open-loop generate run of the fake tier in 2 Locust processes: every request's sample is
    gathered (one file per worker, none from the master) and their total is Locust's own count. Each
    request takes about 0.7 s and each tier is offered more than it can serve, so requests are in flight
    when the run ends and their workers report after Locust's own 0.5 s wait for final reports (without
    the locustfile's flush, Locust's total falls short here). The summary names the arrival mode and the
    offered rate, and gives TTFT and TPOT percentiles with their counts. A sample removed afterwards is
    reported as a mismatch, loudly, with exit status 1."""
    out = tmp_path / "generate"
    env = {**__import__("os").environ, **GENERATE_ENV, "LOADTEST_FAKE_TPOT_S": "0.15",
           "PYTHONPATH": str(REPO_ROOT / "backend_src")}
    result = subprocess.run(
        [sys.executable, str(RUN), "--workload", "generate", "--tier-protocol", "fake", "--arrival-rate", "4",
         "--time", "8s", "--processes", "2", "--prefill-tokens", "100-400", "--new-tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = sorted(out.glob("samples-*.csv"))
    assert len(files) == 2, files  # the two workers'; the master ran no users and wrote none
    rows = [r for f in files for r in csv.DictReader(open(f, newline=""))]
    locust_total = sum(e["num_requests"] for e in json.loads((out / "locust_final.json").read_text()))
    assert len(rows) == locust_total >= 10, (len(rows), locust_total)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {"samples": len(rows), "locust": locust_total, "agree": True}
    assert summary["workload"] == "generate" and summary["arrivals"] == "open" and summary["offered_rate_rps"] == 4.0
    assert summary["settings"]["processes"] == 2 and summary["settings"]["users"] == 2
    fake = summary["generate"]["fake"]
    assert fake["requests"] == len(rows) and fake["failures"] == 0
    assert fake["ttft"]["samples"] == fake["tpot"]["samples"] == len(rows)
    assert 0 < fake["ttft"]["p50_ms"] <= fake["ttft"]["p90_ms"] <= fake["ttft"]["p99_ms"]
    assert fake["ttft"]["p50_ms"] >= 100 * 0.2  # at least the shortest prompt's prefill (100 tokens x 0.2 ms)
    assert fake["tpot"]["p50_ms"] == pytest.approx(150.0, rel=0.3)
    assert 100 <= fake["mean_prompt_tokens"] <= 400 and fake["mean_new_tokens"] == 5  # the first and 4 more
    assert summary["ttft_p99_ms"] == fake["ttft"]["p99_ms"] and summary["tpot_p99_ms"] == fake["tpot"]["p99_ms"]
    assert summary["layer_prefill_p99_ms"] is None
    for row in rows:  # TTFT runs from the scheduled arrival, which comes before the answer
        assert float(row["arrival_time"]) < float(row["end_time"]) and row["profile"] == "generate"
        assert float(row["latency_ms"]) == float(row["ttft_ms"])
    assert "open-loop Poisson arrivals, 4 req/s offered" in result.stdout
    assert f"samples: {len(rows)}, as Locust counted" in result.stdout

    lines = files[0].read_text().splitlines()
    files[0].write_text("\n".join(lines[:-1]) + "\n")  # one sample lost
    check = subprocess.run([sys.executable, str(REPO_ROOT / "loadtest" / "summary.py"), str(out)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1, check.stdout + check.stderr
    assert (f"SAMPLE COUNT MISMATCH: {len(rows) - 1} samples gathered, Locust counted {locust_total}"
            in check.stdout.splitlines()[-1]), check.stdout
    assert json.loads((out / "summary.json").read_text())["counts_agree"] is False
    assert load_run.verdict(json.loads((out / "summary.json").read_text())) == 1


def test_generate_closed_loop_and_the_summary_of_made_up_samples(tmp_path):
    """Closed-loop generate users in one process say so in the summary; made-up generate samples of two
    protocols give per-protocol TTFT/TPOT percentiles (failures left out, TPOT only where there was a
    later token) with their counts, and the offered rate of an open-loop run's settings."""
    out = tmp_path / "closed"
    env = {**__import__("os").environ, **GENERATE_ENV, "PYTHONPATH": str(REPO_ROOT / "backend_src")}
    result = subprocess.run(
        [sys.executable, str(RUN), "--workload", "generate", "--tier-protocol", "fake", "--arrivals", "closed",
         "--users", "2", "--time", "3s", "--prefill-tokens", "50", "--new-tokens", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=90, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arrivals"] == "closed" and summary["offered_rate_rps"] is None and summary["counts_agree"]
    fake = summary["generate"]["fake"]
    # two users, one tier: each request waits for the other's (about 10 + 80 ms), so TTFT exceeds the prefill
    assert fake["ttft"]["p50_ms"] > 10.0 + 40.0, fake
    assert "closed-loop users (2)" in result.stdout

    made = tmp_path / "made"
    made.mkdir()
    header = ["end_time", "protocol", "profile", "tokens", "latency_ms", "failed", "arrival_time", "ttft_ms",
              "tpot_ms", "new_tokens", "error"]
    rows = [[f"{10 + i:.6f}", "grpc", "generate", 512, f"{100 + i:.4f}", 0, f"{9 + i:.6f}", f"{100 + i:.4f}",
             f"{5 + i * 0.01:.4f}", 17, ""] for i in range(200)]
    rows += [[f"{10 + i:.6f}", "inprocess", "generate", 512, f"{50 + i:.4f}", 0, f"{9 + i:.6f}", f"{50 + i:.4f}",
              "0.0000", 1, ""] for i in range(30)]
    rows += [["300.0", "grpc", "generate", 512, "9000.0", 1, "299.0", "nan", "nan", 0, "RuntimeError: gone"]]
    with open(made / "samples-1.csv", "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    (made / "settings.json").write_text(json.dumps({"arrivals": "open", "arrival_rate": 3.5, "users": 1}))
    # two processes of grpc left 3 and 2 arrivals unserved at the end, the oldest waiting 0.8 s
    (made / "unserved-1.json").write_text(json.dumps({"protocol": "grpc", "count": 3, "oldest_wait_s": 0.8}))
    (made / "unserved-2.json").write_text(json.dumps({"protocol": "grpc", "count": 2, "oldest_wait_s": 0.5}))
    summary = load_summary.write(made)
    grpc, inprocess = summary["generate"]["grpc"], summary["generate"]["inprocess"]
    assert grpc["requests"] == 201 and grpc["failures"] == 1 and grpc["ttft"]["samples"] == 200
    assert grpc["ttft"]["p50_ms"] == 199.0 and grpc["ttft"]["p90_ms"] == 279.0 and grpc["ttft"]["p99_ms"] == 297.0
    assert grpc["tpot"]["p99_ms"] == pytest.approx(6.97) and grpc["offered_rate_rps"] == 3.5
    assert (grpc["ttft_p50_ms"], grpc["ttft_p90_ms"], grpc["ttft_p99_ms"], grpc["ttft_samples"]) == (199.0, 279.0, 297.0, 200)
    assert grpc["tpot_p99_ms"] == grpc["tpot"]["p99_ms"] and grpc["tpot_samples"] == 200
    assert inprocess["tpot"]["samples"] == 0 and inprocess["tpot"]["p99_ms"] is None  # one token each: no TPOT
    assert inprocess["ttft"]["few_samples"] == ["p99_ms"] and inprocess["ttft"]["samples"] == 30
    assert summary["ttft_samples"] == 230 and summary["tpot_samples"] == 200
    assert summary["counts"] == {"samples": 231, "locust": None, "agree": None}
    assert (grpc["unserved_at_end"], grpc["oldest_unserved_wait_ms"]) == (5, 800.0)
    assert (inprocess["unserved_at_end"], inprocess["oldest_unserved_wait_ms"]) == (0, 0.0)
    text = load_summary.table(summary)
    assert "grpc: 5 arrivals still waiting when the run ended, the oldest for 800 ms" in text, text
    assert "open-loop Poisson arrivals, 3.5 req/s offered" in text
    assert text.splitlines()[-1] == "samples: 231 (no Locust final counts to check them against)"
    grpc_row = next(line for line in text.splitlines() if line.startswith("grpc ") and "generate" not in line)
    assert grpc_row.split()[:4] == ["grpc", "201", "1", "200"], grpc_row


def test_sweep_finds_the_highest_rate_within_the_ttft_budget(tmp_path):
    """loadtest/sweep.py: per protocol, P99 TTFT and TPOT at each offered rate, and the highest rate
    with it and every lower rate within the budget, failures and count mismatches not eligible; a rate
    back under budget after one over it is not capacity. Then a real sweep of the fake tier at two
    rates: its folders, sweep.json, the table and the plot."""
    sweep = load_script(REPO_ROOT / "loadtest" / "sweep.py")

    def lv(rate, p99, failures=0, agree=True):
        return {"offered_rps": rate, "answered_rps": rate, "requests": 200, "failures": failures, "ttft_p50_ms": p99 / 2,
                "ttft_p99_ms": p99, "ttft_samples": 200 - failures, "tpot_p50_ms": 4.0, "tpot_p99_ms": 5.0,
                "tpot_samples": 200, "few_samples": False, "counts_agree": agree}

    assert sweep.best_rate([lv(1, 50), lv(2, 150), lv(4, 250), lv(8, 120)], 200)["best"]["offered_rps"] == 2
    assert sweep.best_rate([lv(1, 50), lv(2, 150, failures=1)], 200)["best"]["offered_rps"] == 1
    assert sweep.best_rate([lv(1, 50), lv(2, 150, agree=False)], 200)["best"]["offered_rps"] == 1
    assert sweep.best_rate([lv(1, 250)], 200) == {"best": None, "lower_bound": False}
    assert sweep.best_rate([lv(1, 50), lv(2, 60)], 200)["lower_bound"] is True
    # arrivals left waiting longer than the budget: over it, whatever the served requests' P99
    assert sweep.best_rate([lv(1, 50), {**lv(2, 60), "unserved": 4, "oldest_unserved_wait_ms": 900.0}], 200)["best"][
        "offered_rps"] == 1
    summary = {"counts_agree": True, "generate": {"grpc": {
        "requests": 10, "failures": 0, "answered_rate_rps": 0.9,
        "ttft": {"p50_ms": 5.0, "p99_ms": 9.0, "samples": 10, "few_samples": ["p99_ms"]},
        "tpot": {"p50_ms": 1.0, "p99_ms": 2.0, "samples": 10, "few_samples": ["p99_ms"]}}}}
    level = sweep.level(1.0, summary, "grpc")
    assert (level["ttft_p99_ms"], level["tpot_p99_ms"], level["ttft_samples"], level["few_samples"]) == (9.0, 2.0, 10, True)

    out = tmp_path / "sweep"
    env = {**__import__("os").environ, **GENERATE_ENV, "PYTHONPATH": str(REPO_ROOT / "backend_src")}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "loadtest" / "sweep.py"), "--protocols", "fake", "--rates", "4,8",
         "--time", "3s", "--prefill-tokens", "64", "--new-tokens", "1", "--budget-ms", "60000", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "sweep.json").read_text())
    levels = data["protocols"]["fake"]["levels"]
    assert [x["offered_rps"] for x in levels] == [4.0, 8.0] and all(x["ttft_samples"] > 0 for x in levels)
    for x in levels:
        run_summary = json.loads((out / "fake" / f"rate-{x['offered_rps']:g}" / "summary.json").read_text())
        assert run_summary["offered_rate_rps"] == x["offered_rps"] and run_summary["counts_agree"] is True
        assert x["ttft_p99_ms"] == run_summary["generate"]["fake"]["ttft"]["p99_ms"]
    assert data["protocols"]["fake"]["best"]["offered_rps"] == 8.0 and data["protocols"]["fake"]["lower_bound"]
    assert "fake       8 req/s (P99 TTFT" in result.stdout and "a lower bound" in result.stdout, result.stdout
    assert (out / "sweep.png").read_bytes().startswith(b"\x89PNG")
    bad = subprocess.run([sys.executable, str(REPO_ROOT / "loadtest" / "sweep.py"), "--rates", "0,1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rates" in bad.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    nobody = subprocess.run([sys.executable, str(REPO_ROOT / "loadtest" / "sweep.py"), "--protocols", "inprocess,grpc",
                             "--model", "m", "--rates", "1", "--grpc-url", f"127.0.0.1:{port}", "--out", str(tmp_path / "x")],
                            capture_output=True, text=True, timeout=60)
    assert nobody.returncode == 2 and f"gRPC at 127.0.0.1:{port}" in nobody.stderr, nobody.stderr
    assert not (tmp_path / "x").exists(), "nothing is run when a protocol's server does not answer"


def test_default_tier_builds_colibri_attention_as_api53_says(monkeypatch):
    """The default factory against a stand-in colibri.attention (the real one is built and tested with
    the attention tier itself): expert_tier(protocol, url, weights, device, model), then
    AttentionTier.from_pretrained(model folder, experts, device, dtype); eager: transformers' model,
    in the dtype asked for, wrapped by AttentionTier.eager."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import types
    calls = []

    class AttentionTier:
        @classmethod
        def from_pretrained(cls, model_dir, experts, device="cpu", dtype=None):
            calls.append(("from_pretrained", model_dir, experts, device, dtype))
            return "tier"

        @classmethod
        def eager(cls, model):
            calls.append(("eager", model))
            return "eager tier"

    def expert_tier(protocol, *, url=None, weights=None, device="cpu", model="colibri_moe"):
        calls.append(("expert_tier", protocol, url, weights, device, model))
        return "experts"

    class Model:
        def to(self, device):
            calls.append(("to", device))
            return self

        def eval(self):
            return self

    fake = types.ModuleType("colibri.attention")
    fake.AttentionTier, fake.expert_tier = AttentionTier, expert_tier
    monkeypatch.setitem(sys.modules, "colibri.attention", fake)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kw: calls.append(("hf", path, kw)) or Model())
    options = type("Options", (), {"tier_model": "/models/qwen", "tier_device": "cuda", "tier_dtype": "bfloat16",
                                   "grpc_url": "10.0.0.2:8001", "weights": "", "model": "colibri_moe"})()
    assert load_generate.default_tier("grpc", options) == "tier"
    assert calls == [("expert_tier", "grpc", "10.0.0.2:8001", None, "cuda", "colibri_moe"),
                     ("from_pretrained", "/models/qwen", "experts", "cuda", torch.bfloat16)]
    calls.clear()
    assert load_generate.default_tier("eager", options) == "eager tier"
    assert calls[0] == ("hf", "/models/qwen", {"dtype": torch.bfloat16}) and calls[1] == ("to", "cuda")
    assert calls[2][0] == "eager" and len(calls) == 3


def test_a_tier_holding_the_process_keeps_the_run_time_and_the_schedule(tmp_path):
    """A tier that computes on the CPU holds the load generator's only thread (a fake one spinning, built
    in 3 s of spinning): the run still lasts its --time (gevent's timers were starved: Locust's run-time
    limit fired at once after a slow build, or minutes late between requests), and no request is served
    before its arrival (each TTFT at least the tier's own prefill)."""
    out = tmp_path / "busy"
    env = {**__import__("os").environ, "LOADTEST_FAKE_BUSY": "1", "LOADTEST_FAKE_BUILD_S": "3",
           "LOADTEST_FAKE_PREFILL_S_PER_TOKEN": "0.0002", "LOADTEST_FAKE_TPOT_S": "0.01",
           "PYTHONPATH": str(REPO_ROOT / "backend_src")}
    result = subprocess.run(
        [sys.executable, str(RUN), "--workload", "generate", "--tier-protocol", "fake", "--arrival-rate", "8",
         "--time", "4s", "--prefill-tokens", "200", "--new-tokens", "2", "--warmup", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [r for f in out.glob("samples-*.csv") for r in csv.DictReader(open(f, newline=""))]
    arrivals = sorted(float(r["arrival_time"]) for r in rows)
    ends = [float(r["end_time"]) for r in rows]
    assert 12 <= len(rows) <= 60, len(rows)  # 8 per second for 4 s, give or take Poisson and the stop
    assert 2.5 <= arrivals[-1] - arrivals[0] <= 4.5 and max(ends) - arrivals[0] <= 5.0, (arrivals[0], arrivals[-1], max(ends))
    for row in rows:
        assert float(row["ttft_ms"]) >= 200 * 0.2 - 0.5, row  # the wait from arrival is never negative
