"""CUDA backend on a GPU: the C harness (csrc/dev/cuda/check_cuda.cu: every routing x kind x dtype pair
against float64, determinism, graph replay, bad ids) built and run in its quick mode, and forward
captured in a torch CUDA graph through the Python package, replayed on fresh inputs and compared
bitwise with eager forwards. Skipped, with the reason, where there is no GPU."""
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import colibri
from colibri.testing import random_layer

ROOT = pathlib.Path(__file__).resolve().parent.parent
gpu = colibri.cuda_built() and colibri.cuda_device_count() > 0
needs_gpu = pytest.mark.skipif(not gpu, reason="needs the CUDA backend built and a CUDA device")


@needs_gpu
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build the harness")
def test_c_harness_quick(tmp_path):
    subprocess.run(["make", "--no-print-directory", "lib"], cwd=ROOT, check=True, capture_output=True)
    exe = tmp_path / "check_cuda"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-Icsrc/include", "-Xcompiler", "-fopenmp", "-o", str(exe),
                    "csrc/dev/cuda/check_cuda.cu", "build/libcolibri.a", "-lgomp"], cwd=ROOT, check=True)
    result = subprocess.run([str(exe), "--quick"], capture_output=True, text=True, timeout=900)
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
