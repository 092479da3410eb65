"""examples/hello_colibri.c, built as `make examples` builds it, against the Python API on the same
checkpoint and input: its output must be MoELayer's (the same library; fp32 tolerance) and the float64
reference's (within the weights' rounding), and a bad checkpoint must be refused with one clear line."""
import os
import pathlib
import re
import struct
import subprocess

import numpy as np
import pytest

import colibri
from colibri import checkpoint, reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "build" / "examples" / "hello_colibri"
MASK64 = 2**64 - 1


@pytest.fixture(scope="module")
def hello():
    """The example binary. CUDA= follows the library the Python package loaded, so a tree built with
    CUDA=0 on a host with nvcc is not rebuilt with CUDA (minutes) just for this."""
    cuda = "1" if colibri.cuda_built() else "0"
    build = subprocess.run(["make", "--no-print-directory", f"CUDA={cuda}", str(EXAMPLE.relative_to(ROOT))],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout + build.stderr
    return EXAMPLE


def run(hello, *args):
    return subprocess.run([str(hello), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))


def example_input(seed, tokens, hidden):
    """hello_colibri's input: splitmix64 from `seed`, the top 24 bits of each draw as fp32 in [-1, 1)."""
    state, values = seed, []
    for _ in range(tokens * hidden):
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        values.append((z ^ (z >> 31)) >> 40)
    return (np.array(values, np.float64) / 8388608.0 - 1.0).astype(np.float32).reshape(tokens, hidden)


def test_example_input_matches_its_definition():
    # splitmix64(0)'s first output is a published constant: the Python twin is the same generator.
    first = (0xE220A8397B1DCDAF >> 40) / 8388608.0 - 1.0
    assert example_input(0, 1, 1)[0, 0] == np.float32(first)


@pytest.mark.parametrize("kind,dtype,routing", [("swiglu", "bf16", "softmax_topk"), ("swiglu", "fp32", "sigmoid_bias"),
                                                ("linear", "fp16", "topk_softmax"),
                                                ("swiglu", "fp8_e4m3", "softmax_topk"),
                                                ("linear", "fp8_e4m3", "sigmoid_bias")])
def test_hello_matches_moelayer_and_reference(hello, tmp_path, kind, dtype, routing):
    path = tmp_path / "w.colibri.safetensors"
    config = checkpoint.write_demo(path, experts=6, top_k=2, hidden=48, intermediate=80, dtype=dtype, seed=3,
                                   routing=routing, kind=kind)
    tokens, seed = 5, 1234
    result = run(hello, path, "--tokens", tokens, "--seed", seed, "--output", tmp_path / "out.f32")
    assert result.returncode == 0, result.stdout + result.stderr
    got = np.fromfile(tmp_path / "out.f32", np.float32)
    assert got.size == tokens * config.out_features
    got = got.reshape(tokens, config.out_features)

    x = example_input(seed, tokens, config.hidden_size)
    layer = colibri.MoELayer.from_file(path)
    expected = layer.forward(x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The comparison can tell inputs apart: another seed's output is not within that tolerance.
    assert not np.allclose(got, layer.forward(example_input(seed + 1, tokens, config.hidden_size)), rtol=1e-5, atol=1e-6)

    # The float64 reference with the routing the library chose (near-ties may pick differently).
    ckpt = checkpoint.load(path)
    ids, _ = layer.route(x)
    logits = reference.router_logits(x, ckpt.router)
    weights = reference.routing_weights(ckpt.config, logits, ids)
    ref = reference.moe_forward(ckpt.config, ckpt.experts, x, ids, weights, expert_scales=ckpt.expert_scales)
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())

    checksum = re.search(r"^checksum: sum (\S+), sum of \|x\| (\S+)$", result.stdout, re.M)
    assert checksum, result.stdout
    assert float(checksum[1]) == pytest.approx(float(got.astype(np.float64).sum()), rel=1e-6, abs=1e-6)
    assert float(checksum[2]) == pytest.approx(float(np.abs(got.astype(np.float64)).sum()), rel=1e-6)


def _header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data, n


def _rewrite_header(path, text):
    data, n = _header(path)
    body = text.encode().ljust(n)
    assert len(body) == n, "the edit must keep the header's length"
    path.write_bytes(data[:8] + body + data[8 + n:])


@pytest.mark.parametrize("damage,message", [
    ("truncate", r"tensor '\w+': data ends at byte \d+ but the file holds only \d+ data bytes \(truncated\?\)"),
    ("missing", "cannot open it"),
    ("tiny", "too short for a safetensors file"),
    ("header_length", r"header length \d+ does not fit a file of \d+ bytes"),
    ("not_json", "header: expected '{'"),
    ("format", "metadata format is 'colibri-moe/9', expected 'colibri-moe/1', '/2' or '/3'"),
    ("no_router", "no 'router' tensor"),
    ("shape", r"tensor 'experts': dimension 1 is \d+, expected \d+"),
    ("unclosed", "header: "),
    ("fp8_no_scales", "fp8 experts without an 'expert_scales' tensor"),
    ("fp8_scale_shape", r"tensor 'expert_scales': dimension 1 is \d+, expected \d+"),
    ("fp8_no_block", "metadata: 'scale_block_k' is missing"),
])
def test_hello_refuses_bad_checkpoints(hello, tmp_path, damage, message):
    path = tmp_path / "w.colibri.safetensors"
    checkpoint.write_demo(path, experts=4, top_k=2, hidden=32, intermediate=64, seed=1,
                          dtype="fp8_e4m3" if damage.startswith("fp8") else "bf16")
    data, n = _header(path)
    text = data[8:8 + n].decode()
    if damage == "fp8_no_scales":
        _rewrite_header(path, text.replace('"expert_scales"', '"expert_scalez"'))
    elif damage == "fp8_scale_shape":
        _rewrite_header(path, re.sub(r'("expert_scales":\{"dtype":"F32","shape":\[4,)(\d+)',
                                     lambda m: m[1] + str(int(m[2]) + 1).rjust(len(m[2])), text))
    elif damage == "fp8_no_block":
        _rewrite_header(path, text.replace('"scale_block_k"', '"scale_block_q"'))
    elif damage == "truncate":
        path.write_bytes(data[:len(data) - 100])
    elif damage == "missing":
        path.unlink()
    elif damage == "tiny":
        path.write_bytes(b"\x01\x02")
    elif damage == "header_length":
        path.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    elif damage == "not_json":
        _rewrite_header(path, "x" + text[1:])
    elif damage == "format":
        _rewrite_header(path, text.replace("colibri-moe/2", "colibri-moe/9"))
    elif damage == "no_router":
        _rewrite_header(path, text.replace('"router"', '"rooter"'))
    elif damage == "shape":
        _rewrite_header(path, re.sub(r'("experts":\{"dtype":"BF16","shape":\[4,)(\d+)', lambda m: m[1] + str(int(m[2]) - 1).rjust(len(m[2])), text))
    elif damage == "unclosed":
        _rewrite_header(path, text.rstrip()[:-1])
    result = run(hello, path)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hello_colibri: {path}: "), last
    assert re.search(message, last), last


@pytest.mark.skipif(colibri.cuda_built() and colibri.cuda_device_count() > 0, reason="a GPU is here to run on")
def test_hello_says_why_it_cannot_use_cuda(hello, tmp_path):
    path = tmp_path / "w.colibri.safetensors"
    checkpoint.write_demo(path, experts=4, top_k=2, hidden=32, intermediate=64, seed=1)
    result = run(hello, path, "--device", "cuda")
    assert result.returncode == 1
    assert re.search(r"--device cuda: (libcolibri was built without the CUDA backend|no CUDA device is visible)",
                     result.stderr), result.stderr


@pytest.mark.skipif(not (colibri.cuda_built() and colibri.cuda_device_count() > 0), reason="needs a CUDA GPU")
def test_hello_on_cuda_matches_moelayer(hello, tmp_path):
    path = tmp_path / "w.colibri.safetensors"
    checkpoint.write_demo(path, experts=6, top_k=2, hidden=64, intermediate=96, dtype="bf16", seed=3)
    result = run(hello, path, "--device", "cuda", "--tokens", 7, "--seed", 9, "--output", tmp_path / "out.f32")
    assert result.returncode == 0, result.stdout + result.stderr
    got = np.fromfile(tmp_path / "out.f32", np.float32).reshape(7, 64)
    expected = colibri.MoELayer.from_file(path).forward(example_input(9, 7, 64))  # the CPU: another backend
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
