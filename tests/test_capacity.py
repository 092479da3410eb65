"""deploy/capacity/replicas.py on the measured H200 curves in bench/serving/results, and its one-line
refusals of bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "deploy" / "capacity" / "replicas.py"
FINE_GRAINED = REPO_ROOT / "bench" / "serving" / "results" / "h200-64x6x2048x1408.json"
MIXTRAL = REPO_ROOT / "bench" / "serving" / "results" / "h200-8x2x4096x14336.json"


def replicas(*args):
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def test_replicas_from_the_measured_fine_grained_curve():
    # One H200 kept P99 at 20.2 ms at 16 users and 981 req/s (2026-11-29): 3000 req/s needs 4.
    code, out, _ = replicas(FINE_GRAINED, "--rate", 3000, "--budget-ms", 50, "--startup-s", 120)
    assert code == 0, out
    assert "4 replica(s) for 3000 req/s within P99 50 ms: one replica sustains 981 req/s" in out
    assert "load doubles, 3000 -> 6000 req/s: 4 -> 7 replicas" in out
    assert "detection: at most 90 s" in out


def test_table_says_where_nothing_was_measured_and_where_capacity_is_a_lower_bound():
    code, out, _ = replicas(FINE_GRAINED, "--table", "10,50,200", "--rates", "1000,5000")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert code == 0 and rows["10"][:2] == ["none", "measured"]
    assert rows["50"] == ["981", "2", "6"] and rows["200"] == [">=991", "2", "6"]
    code, out, _ = replicas(MIXTRAL, "--rate", 1000, "--budget-ms", 25)
    assert code == 0 and "no measured level is within a P99 of 25 ms: the lowest measured is 41.6 ms" in out


def test_headroom_adds_replicas():
    _, out, _ = replicas(MIXTRAL, "--rate", 1000, "--budget-ms", 50, "--headroom", 0.7)
    assert "4 replica(s) for 1000 req/s" in out  # 1000 / (472 * 0.7) = 3.03


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    (json.dumps({"runs": []}), "has no 'sweeps'"),
    (json.dumps({"sweeps": [{"model": "torch_moe", "levels": []}]}), "no sweep of model 'colibri_moe'; models swept: torch_moe"),
    (json.dumps({"sweeps": [{"model": "colibri_moe", "levels": [{"users": 4}]}]}), "lacks users, rps or failures"),
])
def test_bad_curve_files_are_refused_in_one_line(tmp_path, content, message):
    curve = tmp_path / "curve.json"
    curve.write_text(content)
    code, out, err = replicas(curve, "--rate", 10, "--budget-ms", 50)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, message", [
    (["--rate", "0", "--budget-ms", "50"], "--rate must be positive"),
    (["--rate", "10"], "give --rate and --budget-ms, or --table"),
    (["--table", "50,x"], "--table must be numbers"),
    (["--rate", "10", "--budget-ms", "50", "--headroom", "1.5"], "--headroom must be in (0, 1]"),
])
def test_bad_arguments_are_refused_in_one_line(args, message):
    code, _, err = replicas(FINE_GRAINED, *args)
    assert code == 2 and message in err.strip().splitlines()[-1]
