"""Broken checkpoint files refused in one line, by the reader, `info`, MoELayer.from_file and `serve`:
non-finite weights (a NaN layer is never served), headers that crash a JSON parser or a printer, sizes
that would make the loader allocate without bound, and files that are not regular files (a FIFO would
block the reader forever). Each case failed before the checks it tests existed."""
import dataclasses
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import colibri
from colibri import checkpoint
from colibri import safetensors_io as st
from colibri.serving import launcher
from colibri.__main__ import main as colibri_main
from colibri.testing import random_fp8_layer, random_layer

# The bits of a NaN or an infinity in each weight dtype's storage (fp8 e4m3fn has NaN codes only).
NONFINITE = {"fp32": (np.uint32, [0x7FC00000, 0x7F800000, 0xFF800000]), "fp16": (np.uint16, [0x7E00, 0x7C00, 0xFC00]),
             "bf16": (np.uint16, [0x7FC0, 0x7F80, 0xFF80]), "fp8_e4m3": (np.uint8, [0x7F, 0xFF])}
MATRICES = ("gate", "up", "down")


def tensors_of(path):
    file = st.SafetensorsFile(path)
    return {name: (info.dtype, np.array(file.get(name))) for name, info in file.tensors.items()}, dict(file.metadata)


def info_lines(path, capsys):
    """`python -m colibri info PATH` in this process: (status, stdout lines, stderr lines)."""
    status = colibri_main(["info", str(path)])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.splitlines()


def layer_file(rng, tmp_path, dtype, shared=False):
    """A small packed layer in `dtype`, with a shared expert when asked; its path and config."""
    path = tmp_path / f"{dtype}.colibri.safetensors"
    if dtype == "fp8_e4m3":
        config, tensors = random_fp8_layer(rng, scale_block=(16, 16), num_experts=4, hidden_size=32,
                                           intermediate_size=16)
        checkpoint.save(path, config, tensors["experts"], tensors["router"], expert_scales=tensors["expert_scales"])
        return path, config
    config, experts, router, bias = random_layer(rng, num_experts=4, hidden_size=32, intermediate_size=16,
                                                weight_dtype=dtype)
    extra = {}
    if shared:
        config = dataclasses.replace(config, shared_intermediate_size=24)
        extra["shared_expert"] = np.zeros(config.shared_numel, experts.dtype)
    checkpoint.save(path, config, experts, router, bias, **extra)
    return path, config


# Non-finite weights


@pytest.mark.parametrize("dtype", sorted(NONFINITE))
def test_nonfinite_expert_weight_refused_at_load_and_by_info(rng, tmp_path, capsys, dtype):
    """A NaN or an infinity anywhere in an expert (an fp8 NaN code too) is refused when the layer is
    built, naming the expert, matrix, row and column; `info` exits 1 with that one line."""
    path, config = layer_file(rng, tmp_path, dtype)
    assert info_lines(path, capsys)[0] == 0
    tensors, metadata = tensors_of(path)
    H, F = config.hidden_size, config.intermediate_size
    storage, patterns = NONFINITE[dtype]
    e, m = int(rng.integers(config.num_experts)), int(rng.integers(3))
    rows, cols = (H, F) if m == 2 else (F, H)
    r, c = int(rng.integers(rows)), int(rng.integers(cols))
    experts = tensors["experts"][1].view(np.uint8).reshape(config.num_experts, -1).view(storage)
    experts[e, m * F * H + r * cols + c] = patterns[int(rng.integers(len(patterns)))]
    bad = tmp_path / "bad.colibri.safetensors"
    st.write(bad, tensors, metadata)

    where = f"expert {e}'s {MATRICES[m]} [{r}, {c}] is "
    with pytest.raises(colibri.ColibriError, match=r"^invalid argument: ") as raised:
        colibri.MoELayer.from_file(bad)
    assert str(bad) in str(raised.value) and where in str(raised.value), str(raised.value)
    status, out, err = info_lines(bad, capsys)
    assert status == 1 and out == [] and len(err) == 1 and where in err[0] and str(bad) in err[0], (out, err)


@pytest.mark.skipif(colibri.cuda_device_count() == 0, reason="needs a GPU and a library built with CUDA")
def test_nonfinite_expert_weight_refused_on_cuda(rng, tmp_path):
    """The check runs before the weights are copied to the GPU, whichever device the layer is for."""
    path, config = layer_file(rng, tmp_path, "bf16")
    colibri.MoELayer.from_file(path, device="cuda")
    tensors, metadata = tensors_of(path)
    tensors["experts"][1][2, config.expert_numel - 1] = 0xFF80  # expert 2's down [H-1, F-1] = -Inf
    bad = tmp_path / "bad.colibri.safetensors"
    st.write(bad, tensors, metadata)
    H, F = config.hidden_size, config.intermediate_size
    with pytest.raises(colibri.ColibriError, match=rf"expert 2's down \[{H - 1}, {F - 1}\] is -Inf"):
        colibri.MoELayer.from_file(bad, device="cuda")


def test_nonfinite_shared_expert_refused(rng, tmp_path):
    path, config = layer_file(rng, tmp_path, "bf16", shared=True)
    colibri.MoELayer.from_file(path)
    tensors, metadata = tensors_of(path)
    Fs, H = config.shared_intermediate_size, config.hidden_size
    tensors["shared_expert"][1][2 * Fs * H + 5 * Fs + 7] = 0x7F80  # down [5, 7] = +Inf
    bad = tmp_path / "bad.colibri.safetensors"
    st.write(bad, tensors, metadata)
    with pytest.raises(colibri.ColibriError, match=r"the shared expert's down \[5, 7\] is \+Inf"):
        colibri.MoELayer.from_file(bad)


@pytest.mark.parametrize("tensor", ["router", "expert_scales"])
def test_info_checks_what_loading_checks(rng, tmp_path, capsys, tensor):
    """`info` used to read the header alone and pass files whose router or scales held a NaN."""
    path, _ = layer_file(rng, tmp_path, "fp8_e4m3")
    tensors, metadata = tensors_of(path)
    tensors[tensor][1][1, 2] = np.inf
    bad = tmp_path / "bad.colibri.safetensors"
    st.write(bad, tensors, metadata)
    status, out, err = info_lines(bad, capsys)
    assert status == 1 and out == [] and len(err) == 1, (out, err)
    assert f"{tensor}: not finite at index (1, 2)" in err[0] and str(bad) in err[0], err


def test_info_prints_a_checked_layer_and_escapes_what_it_prints(rng, tmp_path, capsys):
    path, _ = layer_file(rng, tmp_path, "bf16")
    tensors, metadata = tensors_of(path)
    st.write(path, tensors, {**metadata, "source": "a\x1b[2Jb\nc", "note": "Kraków ✓"})
    status, out, err = info_lines(path, capsys)
    assert status == 0 and err == []
    assert "metadata source               a\\x1b[2Jb\\nc" in out and "metadata note                 Kraków ✓" in out
    assert out[-1].startswith("checked: the layer loads and every weight is finite"), out[-1]


# Headers that crashed the reader or the printer


def raw_file(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_deeply_nested_header_refused(tmp_path):
    path = raw_file(tmp_path / "deep.colibri.safetensors", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(colibri.ColibriError, match="header nests 100000 levels deep; a safetensors header nests at most 3"):
        checkpoint.load(path)
    brackets_in_strings = {"__metadata__": {"note": "[[[[{{{{" * 1000}}
    fine = raw_file(tmp_path / "fine.colibri.safetensors", json.dumps(brackets_in_strings).encode())
    with pytest.raises(colibri.ColibriError, match="has no 'experts' tensor"):  # parsed: strings are not nesting
        checkpoint.load(fine)


@pytest.mark.parametrize("version", ["\u0663", "\uff12", "2 ", "+2", "9" * 5000])
def test_version_must_be_ascii_digits(rng, tmp_path, version):
    path, _ = layer_file(rng, tmp_path, "bf16")
    tensors, metadata = tensors_of(path)
    st.write(path, tensors, {**metadata, "format": "colibri-moe/" + version})
    with pytest.raises(colibri.ColibriError, match="metadata format is 'colibri-moe/") as raised:
        checkpoint.load(path)
    assert str(path) in str(raised.value) and len(str(raised.value)) < 400


@pytest.mark.parametrize("key, value", [("top_k", "\u0662"), ("num_experts", " 4"), ("hidden_size", "3_2"),
                                        ("routed_scaling_factor", "nan"), ("routed_scaling_factor", "\u0661.5")])
def test_metadata_numbers_must_be_ascii(rng, tmp_path, key, value):
    path, _ = layer_file(rng, tmp_path, "bf16")
    tensors, metadata = tensors_of(path)
    st.write(path, tensors, {**metadata, key: value})
    with pytest.raises(colibri.ColibriError, match=f"metadata {key}="):
        checkpoint.load(path)


def test_lone_surrogate_in_metadata_refused(rng, tmp_path, capsys):
    path, _ = layer_file(rng, tmp_path, "bf16")
    file = st.SafetensorsFile(path)
    header = json.loads(path.read_bytes()[8:8 + file.data_start - 8])
    header["__metadata__"]["source"] = "\udc80"
    text = json.dumps(header).encode()  # ensure_ascii writes the surrogate as the escape \udc80
    bad = raw_file(tmp_path / "bad.colibri.safetensors", text, path.read_bytes()[file.data_start:])
    with pytest.raises(colibri.ColibriError, match=r"header string '\\udc80' holds a lone surrogate"):
        checkpoint.load(bad)
    status, out, err = info_lines(bad, capsys)
    assert status == 1 and out == [] and len(err) == 1, (out, err)


def test_header_too_large_for_a_checkpoint_refused(tmp_path):
    path = raw_file(tmp_path / "big.colibri.safetensors", b" " * (checkpoint.MAX_HEADER_BYTES + 1))
    with pytest.raises(colibri.ColibriError, match="header of 1048577 bytes is larger than the 1048576"):
        checkpoint.load(path)


# Sizes the loader would allocate without bound


def test_hundreds_of_millions_of_experts_refused_before_allocating(tmp_path):
    """A sparse file declaring 5e8 experts of 3 weights each: its sizes agree with the file, and the
    loader used to build a Python list of 5e8 offsets (about 20 GB) before failing with MemoryError."""
    E = 500_000_000
    header = {"experts": {"dtype": "BF16", "shape": [E, 3], "data_offsets": [0, E * 3 * 2]},
              "__metadata__": {"format": "colibri-moe/2", "expert_kind": "swiglu", "num_experts": str(E),
                               "top_k": "1", "hidden_size": "1", "intermediate_size": "1",
                               "routing": "softmax_topk", "renormalize": "false"}}
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    path = raw_file(tmp_path / "sparse.colibri.safetensors", text)
    with open(path, "r+b") as f:
        f.truncate(8 + len(text) + E * 3 * 2)  # a hole: no disk is used
    started = time.perf_counter()
    with pytest.raises(colibri.ColibriError, match=r"config.num_experts must be in \[1, 65536\], got 500000000"):
        colibri.MoELayer.from_file(path)
    assert time.perf_counter() - started < 5


# Files that are not regular files


def in_subprocess(code: str, timeout=30):
    """Runs code in a fresh interpreter; a hang fails the test instead of stalling the suite."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / "weights.colibri.safetensors"
    os.mkfifo(fifo)
    loaded = in_subprocess(f"import colibri\ncolibri.MoELayer.from_file({str(fifo)!r})")
    assert loaded.returncode != 0 and "is a FIFO (named pipe), not a regular file" in loaded.stderr, loaded.stderr
    info = in_subprocess(f"import sys; from colibri.__main__ import main; sys.exit(main(['info', {str(fifo)!r}]))")
    assert info.returncode == 1 and info.stdout == "" and info.stderr.count("\n") == 1, info
    assert f"{fifo}: is a FIFO (named pipe), not a regular file" in info.stderr
    from colibri.serving import identity
    with pytest.raises(colibri.ColibriError, match="is a FIFO"):
        identity.of(fifo)


def test_folder_refused(tmp_path):
    folder = tmp_path / "layer.colibri.safetensors"
    folder.mkdir()
    with pytest.raises(colibri.ColibriError, match="is a folder, not a regular file"):
        checkpoint.load(folder)


# serve: one line, exit 2, before any server starts


@pytest.mark.parametrize("kind", ["fifo", "truncated", "deep"])
def test_serve_refuses_in_one_line(rng, tmp_path, capsys, kind):
    path = tmp_path / "weights.colibri.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "truncated":
        good, _ = layer_file(rng, tmp_path, "bf16")
        path.write_bytes(good.read_bytes()[:-100])
    else:
        raw_file(path, b"{" * 50 + b"}" * 50)
    status = launcher.main(["--weights", str(path), "--model-repository", str(tmp_path / "unused")])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith(f"colibri serve: --weights {path}: "), err
