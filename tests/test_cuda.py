"""CUDA backend on a GPU: the C harness (csrc/tests/check_cuda.cu: every routing x kind x dtype pair
against float64, determinism, graph replay, bad ids) built and run in its quick mode by
`make test-cuda`, and forward captured in a torch CUDA graph through the Python package, replayed on
fresh inputs and compared bitwise with eager forwards. Skipped, with the reason, where there is no GPU."""
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import colibri
from colibri.testing import error_limit, random_layer

ROOT = pathlib.Path(__file__).resolve().parent.parent
gpu = colibri.cuda_built() and colibri.cuda_device_count() > 0
needs_gpu = pytest.mark.skipif(not gpu, reason="needs the CUDA backend built and a CUDA device")


@needs_gpu
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build the harness")
def test_c_harness_quick():
    result = subprocess.run(["make", "--no-print-directory", "test-cuda", "CUDA_HARNESS_ARGS=--quick"], cwd=ROOT,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0 and "PASS:" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


@needs_gpu
@pytest.mark.parametrize("T", [1, 64, 513])
def test_torch_graph_replay_is_bitwise_eager(rng, T):
    torch = pytest.importorskip("torch")
    config, experts, router, _ = random_layer(rng, weight_dtype="bf16", hidden_size=128, intermediate_size=96)
    layer = colibri.MoELayer(config, experts, router, device="cuda")
    static_x = torch.zeros((T, config.hidden_size), dtype=torch.bfloat16, device="cuda")
    layer.forward(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer.forward(static_x)
    for _ in range(3):
        fresh = torch.from_numpy(rng.standard_normal((T, config.hidden_size)).astype(np.float32))
        static_x.copy_(fresh.to(torch.bfloat16).cuda())
        static_out.fill_(float("nan"))
        graph.replay()
        eager = layer.forward(static_x)
        torch.cuda.synchronize()
        assert torch.isfinite(static_out.float()).all()
        assert torch.equal(static_out.view(torch.int16), eager.view(torch.int16))


@needs_gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_instance_refuses_nonfinite_requests_with_one_synchronisation(rng, monkeypatch, tmp_path, dtype):
    """model.py on a GPU instance, hidden states on the GPU (as CUDA shared memory gives them) and on
    the host (plain gRPC/HTTP) in one batch, joined with cupy (torch is never imported: a finder
    refuses it here): the requests holding a NaN or an Inf are refused naming their row, the others
    answered as alone, and each joined forward's check (one per routing kind in the batch) copies
    to the host once, however many requests it joins."""
    cupy = pytest.importorskip("cupy")
    import sys
    from colibri import checkpoint
    from colibri import nonfinite
    from colibri.dtypes import float32_to_bf16
    from colibri.testing.fake_backend import load_model, request
    from test_model_py import check_answers, mixed_batch

    blocked = []

    class NoTorch:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "torch":
                blocked.append(name)
                raise ImportError("torch is blocked: the serving path must not import it")

    monkeypatch.setattr(sys, "meta_path", [NoTorch()] + sys.meta_path)
    for name in [n for n in sys.modules if n.split(".")[0] == "torch"]:
        monkeypatch.delitem(sys.modules, name)
    weights = tmp_path / "gpu.colibri.safetensors"
    checkpoint.write_demo(weights, experts=8, top_k=2, hidden=64, intermediate=96, dtype="bf16", seed=3)
    model = load_model(monkeypatch, weights, kind="GPU")
    layer = colibri.MoELayer.from_file(weights, device="cuda")
    copies = []
    to_host = nonfinite.device_to_host
    monkeypatch.setattr(nonfinite, "device_to_host", lambda array: copies.append(array) or to_host(array))

    def wire(name, array):  # bf16 hidden states travel as their bits, read as bf16 through DLPack
        if dtype == "bf16" and name == "hidden_states":
            return colibri.Tensor.from_numpy(float32_to_bf16(array), "bf16")
        return array

    def on_gpu(name, array):
        if dtype == "bf16" and name == "hidden_states":
            bits = cupy.asarray(float32_to_bf16(array))
            return colibri.Tensor(bits, bits.data.ptr, bits.shape, "bf16", colibri.dlpack.KDL_CUDA, 0)
        return cupy.asarray(array)

    for _ in range(3):
        batch = mixed_batch(rng, layer)
        arrivals = [{name: on_gpu(name, a) if n % 4 else wire(name, a) for name, a in arrays.items()}
                    for n, (arrays, _) in enumerate(batch)]
        copies.clear()
        responses = model.execute([request(**arrays) for arrays in arrivals])
        kinds = {"topk_ids" in arrays for arrays, _ in batch}
        assert len(copies) == len(kinds), f"{len(copies)} copies to the host for {len(kinds)} joined forwards"
        gpu_batch = [({name: on_gpu(name, a) for name, a in arrays.items()}, bad) for arrays, bad in batch]
        check_answers(responses, gpu_batch, layer, limit=error_limit(dtype, "bf16"))
    assert blocked == []
