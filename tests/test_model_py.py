"""model.py's execute in this process, on exact batches (colibri.testing.fake_backend stands in for Triton's
Python backend): requests whose hidden states hold a NaN or an Inf are refused one by one, naming the
row within the request, and the others of the same batch are computed together, exactly as alone.
The same on a GPU instance with GPU tensors (as CUDA shared memory gives them) is in test_cuda.py."""
import types

import numpy as np
import pytest

import colibri
from colibri import checkpoint
from colibri.serving import metrics
from colibri.testing import relative_error
from colibri.testing import fake_backend
from colibri.testing.fake_backend import load_model, request


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "model_py.colibri.safetensors"
    checkpoint.write_demo(path, experts=8, top_k=2, hidden=64, intermediate=96, dtype="bf16", seed=3)
    return path


def mixed_batch(rng, layer, T_max=9):
    """Requests (router-routed and explicitly routed), every third with a NaN or an Inf in one or two
    random rows: [(request arrays, first bad row or None)]."""
    E, k, H = layer.config.num_experts, layer.config.top_k, layer.config.hidden_size
    batch = []
    for n in range(12):
        T = int(rng.integers(1, T_max + 1))
        x = rng.standard_normal((T, H)).astype(np.float32)
        bad = sorted(int(r) for r in rng.choice(T, size=int(rng.integers(1, min(T, 2) + 1)), replace=False)) \
            if n % 3 == 0 else []
        for row in bad:
            x[row, rng.integers(H)] = rng.choice([np.nan, np.inf, -np.inf])
        arrays = {"hidden_states": x}
        if n % 2:
            arrays["topk_ids"] = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
            arrays["topk_weights"] = rng.uniform(0.1, 1, (T, k)).astype(np.float32)
        batch.append((arrays, bad[0] if bad else None))
    return batch


def to_numpy(array):
    """numpy, colibri.Tensor, cupy or torch (on a GPU too) -> numpy."""
    if hasattr(array, "get"):  # cupy
        return array.get()
    if hasattr(array, "cpu"):
        return array.cpu().numpy()
    return array.numpy() if isinstance(array, colibri.Tensor) else np.asarray(array)


def check_answers(responses, batch, layer, limit=0.0):
    """Each good request's answer as `layer` computes it alone (bitwise with limit 0, else within
    that relative error); each bad one refused naming its first bad row."""
    for response, (arrays, bad_row) in zip(responses, batch):
        if bad_row is None:
            assert response.error is None, response.error.message
            alone = layer.forward(*[arrays.get(name) for name in ("hidden_states", "topk_ids", "topk_weights")])
            out, alone = to_numpy(response.output_tensors[0].array), to_numpy(alone)
            if limit:
                assert relative_error(out, alone.astype(np.float64)) <= limit
            else:
                np.testing.assert_array_equal(out, alone)
        else:
            assert response.error is not None and not response.output_tensors
            assert response.error.code == "INVALID_ARG"
            assert response.error.message == f"hidden_states: not finite at row {bad_row}"


def test_nonfinite_requests_refused_alone_in_their_batch(weights, monkeypatch, rng):
    model = load_model(monkeypatch, weights)
    layer = colibri.MoELayer.from_file(weights)
    forwards = []
    forward = model.layers[None].forward
    monkeypatch.setattr(model.layers[None], "forward", lambda x, *rest: forwards.append(x.shape[0]) or forward(x, *rest))
    for _ in range(5):
        batch = mixed_batch(rng, layer)
        assert any(bad is not None for _, bad in batch) and any(bad is None for _, bad in batch)
        forwards.clear()
        responses = model.execute([request(**arrays) for arrays, _ in batch])
        check_answers(responses, batch, layer)
        # One forward per routing kind, of all its requests' tokens: the refused ones' rows are
        # computed and dropped (they reach only their own outputs), so nothing is computed twice.
        everyone = [arrays for arrays, _ in batch]
        assert sorted(forwards) == sorted(n for n in (
            sum(a["hidden_states"].shape[0] for a in everyone if "topk_ids" not in a),
            sum(a["hidden_states"].shape[0] for a in everyone if "topk_ids" in a)) if n)


def expert_increments(E):
    """{expert: [increments]} that the fake backend recorded for colibri_expert_tokens_total."""
    metrics = fake_backend.MetricFamily.families["colibri_expert_tokens_total"].metrics
    return {e: calls for labels, calls in metrics.items() for key, e in [(k, int(v)) for k, v in labels if k == "expert"]}


def test_expert_counters_go_out_once_per_interval(weights, monkeypatch, rng):
    """The per-expert token counters reach Triton at most once per COLIBRI_METRICS_INTERVAL_S, with
    the batch after it ends, exactly (what the batches in between routed is held, not lost); finalize
    sends the rest. The forward-time histogram still gets one observation per batch."""
    model = load_model(monkeypatch, weights, parameters={"COLIBRI_METRICS_INTERVAL_S": "1.5"})
    clock = [100.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    model.metrics.last_flush = clock[0]
    layer = colibri.MoELayer.from_file(weights)
    E = layer.config.num_experts
    expected = np.zeros(E, np.int64)

    def batch():
        x = rng.standard_normal((int(rng.integers(1, 9)), layer.config.hidden_size)).astype(np.float32)
        responses = model.execute([request(hidden_states=x)])
        assert responses[0].error is None
        ids, _ = layer.route(x)
        expected[:] += np.bincount(np.asarray(ids).ravel(), minlength=E)

    for t in (100.5, 101.0):  # within the interval: nothing sent yet
        clock[0] = t
        batch()
    assert all(not calls for calls in expert_increments(E).values())
    clock[0] = 101.6  # the interval is over: this batch sends all three
    batch()
    sent = expert_increments(E)
    assert [sum(sent[e]) for e in range(E)] == expected.tolist() and all(len(c) <= 1 for c in sent.values())
    clock[0] = 102.0
    batch()
    model.finalize()
    assert [sum(expert_increments(E)[e]) for e in range(E)] == expected.tolist()
    histogram = fake_backend.MetricFamily.families["colibri_forward_seconds"].metrics
    assert [len(calls) for calls in histogram.values()] == [4]


def test_metrics_interval_parameter_is_checked(weights, monkeypatch):
    model = load_model(monkeypatch, weights, parameters={"COLIBRI_METRICS_INTERVAL_S": "0"})
    assert model.metrics.interval == 0.0
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match="COLIBRI_METRICS_INTERVAL_S"):
            load_model(monkeypatch, weights, parameters={"COLIBRI_METRICS_INTERVAL_S": bad})


# Imports model.py serves without: torch is a benchmark and test dependency, never the server's.
_NO_TORCH = r'''
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    tried = []
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            NoTorch.tried.append(name)
            raise ImportError(f"{name} is blocked: the serving path must not import it")
sys.meta_path.insert(0, NoTorch())
sys.modules.pop("torch", None)
'''


def test_serving_path_never_imports_torch(weights, tmp_path):
    """model.py's initialize (warm-up included) and execute, in a fresh interpreter where importing
    torch raises: nothing on the serving path asks for it (on a GPU instance too: test_cuda.py)."""
    script = tmp_path / "no_torch.py"
    script.write_text(_NO_TORCH + f'''
import numpy as np
from colibri.testing import fake_backend
class Patch:
    def setitem(self, mapping, key, value): mapping[key] = value
    def setenv(self, name, value): __import__("os").environ[name] = value
model = fake_backend.load_model(Patch(), __import__("pathlib").Path({str(weights)!r}))
x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
ids, w = np.array([[0, 1]] * 3, np.int32), np.full((3, 2), 0.5, np.float32)
responses = model.execute([fake_backend.request(hidden_states=x), fake_backend.request(hidden_states=x[:1]),
                           fake_backend.request(hidden_states=x, topk_ids=ids, topk_weights=w)])
assert all(r.error is None for r in responses), [r.error.message for r in responses if r.error]
print("tried:", NoTorch.tried)
''')
    import subprocess
    import sys
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tried: []" in result.stdout, result.stdout


def test_warm_up_runs_before_ready_and_is_not_counted(weights, monkeypatch):
    """initialize runs the request paths once (router, given routing, one and two joined requests)
    and leaves the expert counters at zero; COLIBRI_WARMUP=no skips it, anything else is refused."""
    calls = []
    original = colibri.MoELayer.forward
    monkeypatch.setattr(colibri.MoELayer, "forward", lambda self, *a, **k: calls.append(a[0]) or original(self, *a, **k))
    model = load_model(monkeypatch, weights)
    assert len(calls) == 4  # router x {alone, joined}, given routing x {alone, joined}
    assert not model.layers[None].expert_counts().any()
    calls.clear()
    load_model(monkeypatch, weights, parameters={"COLIBRI_WARMUP": "no"})
    assert calls == []
    with pytest.raises(ValueError, match="COLIBRI_WARMUP"):
        load_model(monkeypatch, weights, parameters={"COLIBRI_WARMUP": "sometimes"})
