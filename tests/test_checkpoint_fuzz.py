"""A fuzz target for the checkpoint reader, MoELayer.from_file and `info`, beside the C library's
(csrc/fuzz). Valid files of every format version are mutated (bytes flipped, cut or inserted, header
values replaced by any JSON or by deep nesting, metadata set to odd text, a weight set to NaN or an
infinity, the header length changed), then loaded. Every outcome must be one of two: refused with a
one-line ColibriError naming the file (and `info` exits 1 with that one line), or a layer whose every
weight is finite that computes an output of the right shape (and `info` exits 0). Anything else --
another exception, a NaN weight accepted, a message of several lines -- is a finding.

Examples per run: COLIBRI_FUZZ_EXAMPLES (CI runs the default); new inputs each run, and hypothesis
prints the one that failed."""
import contextlib
import dataclasses
import io
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as s

import colibri
from colibri import checkpoint
from colibri import safetensors_io as st
from colibri.__main__ import main as colibri_main
from colibri.dtypes import from_float
from colibri.testing import random_fp8_layer, random_layer

EXAMPLES = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "400"))
WORK = Path(tempfile.mkdtemp(prefix="colibri-fuzz-"))


def _seed_files():
    """One valid file of each format version and of each kind of content: v1, v2 with every feature,
    v3 fp8 with a shared expert, the demo writer's, a linear fp16 layer."""
    rng = np.random.default_rng(7)
    files = {}
    config, experts, router, _ = random_layer(rng, num_experts=4, hidden_size=16, intermediate_size=8)
    meta = {k: v for k, v in checkpoint.config_metadata(config).items()
            if k in checkpoint.REQUIRED_METADATA + ("routed_scaling_factor",)}
    files["v1"] = WORK / "v1.colibri.safetensors"
    st.write(files["v1"], {"experts": experts, "router": router, "router_bias": np.ones(4, np.float32)},
             {**meta, "format": "colibri-moe/1"})

    config, experts, router, bias = random_layer(rng, num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                                                weight_dtype="bf16", routing="sigmoid_bias")
    config = dataclasses.replace(config, n_group=2, topk_group=1, group_score="top2_sum", activation="swiglu_oai",
                                 expert_bias=True, shared_intermediate_size=12, shared_gate=True)
    files["v2"] = WORK / "v2.colibri.safetensors"
    checkpoint.save(files["v2"], config, experts, router, bias,
                    router_logit_bias=rng.standard_normal(4).astype(np.float32),
                    expert_bias=rng.standard_normal((4, config.expert_bias_width)).astype(np.float32),
                    shared_expert=from_float(rng.standard_normal(config.shared_numel) / 4, "bf16"),
                    shared_expert_gate=rng.standard_normal(16).astype(np.float32))

    config, tensors = random_fp8_layer(rng, scale_block=(16, 16), num_experts=4, hidden_size=32, intermediate_size=16,
                                       shared_intermediate_size=16)
    files["v3"] = WORK / "v3.colibri.safetensors"
    checkpoint.save(files["v3"], config, tensors["experts"], tensors["router"], expert_scales=tensors["expert_scales"],
                    shared_expert=tensors["shared_expert"], shared_expert_scales=tensors["shared_expert_scales"])

    files["demo"] = WORK / "demo.colibri.safetensors"
    checkpoint.write_demo(files["demo"], experts=4, hidden=16, intermediate=8)
    config, experts, router, _ = random_layer(rng, expert_kind="linear", num_experts=4, hidden_size=16,
                                              intermediate_size=8, weight_dtype="fp16")
    files["linear"] = WORK / "linear.colibri.safetensors"
    checkpoint.save(files["linear"], config, experts, router)
    return {name: path.read_bytes() for name, path in files.items()}


SEEDS = _seed_files()

# Odd text for metadata values and keys: non-ASCII digits, lone surrogates (JSON escapes), control
# characters, numbers Python parses loosely, huge digit strings, and the valid words.
ODD_TEXT = s.one_of(
    s.sampled_from(["\u0663", "\uff12", "\udc80", "\ud800x", "1_0", " 8", "+4", "nan", "inf", "-0", "1e400",
                    "9" * 5000, "\x1b[2J", "a\nb", "", "true", "swiglu", "linear", "fp8", "colibri-moe/\u0663",
                    "colibri-moe/0", "colibri-moe/3", "-1", "65537", "2147483648", "0.0", "1e-45"]),
    s.text(max_size=12),
    s.integers(-2**40, 2**40).map(str))
KEYS = sorted({*checkpoint.REQUIRED_METADATA, "format", "routed_scaling_factor", "n_group", "topk_group",
               "group_score", "activation", "activation_alpha", "activation_limit", "expert_bias",
               "shared_intermediate_size", "shared_gate", "scale_block_n", "scale_block_k", "source"})
JSON_VALUES = s.recursive(
    s.none() | s.booleans() | s.integers(-2**70, 2**70) | s.floats(allow_nan=False) | ODD_TEXT,
    lambda inner: s.lists(inner, max_size=3) | s.dictionaries(ODD_TEXT, inner, max_size=3), max_leaves=6)
# bits of a NaN or an infinity for each storage width
NONFINITE_BITS = {1: [0x7F, 0xFF], 2: [0x7E00, 0x7C00, 0xFC00, 0x7FC0, 0x7F80, 0xFF80],
                  4: [0x7FC00000, 0x7F800000, 0xFF800000]}


def split(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header, body: bytes, raw: str = None) -> bytes:
    text = json.dumps(header).encode() if raw is None else raw.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(text)) + text + body


@s.composite
def mutation(draw, data: bytes):
    """One mutation of a file's bytes."""
    kind = draw(s.sampled_from(["flip", "cut", "insert", "value", "nest", "metadata", "nonfinite", "length"]))
    if not data:
        return draw(s.binary(max_size=16))
    if kind == "flip":
        at = draw(s.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ draw(s.integers(1, 255))]) + data[at + 1:]
    if kind == "cut":
        return data[:draw(s.integers(0, len(data) - 1))]
    if kind == "insert":
        at = draw(s.integers(0, len(data)))
        return data[:at] + draw(s.binary(min_size=1, max_size=8)) + data[at:]
    if kind == "length":
        return struct.pack("<Q", draw(s.integers(0, 2**64 - 1))) + data[8:]
    try:
        header, body = split(data)
    except (ValueError, UnicodeDecodeError, struct.error, RecursionError):
        return data  # an earlier mutation broke the header: nothing to edit in place
    if not isinstance(header, dict) or not header:
        return data
    name = draw(s.sampled_from(sorted(header)))
    if kind == "value":  # any JSON in place of an entry, one of its fields, or a metadata value
        entry = header[name]
        if isinstance(entry, dict) and entry and draw(s.booleans()):
            entry[draw(s.sampled_from(sorted(entry)))] = draw(JSON_VALUES)
        else:
            header[name] = draw(JSON_VALUES)
        return join(header, body)
    if kind == "nest":  # deep nesting where a list or an object may stand
        depth = draw(s.integers(2, 3000))
        header[name] = "@@NEST@@"
        text = json.dumps(header).replace('"@@NEST@@"', "[" * depth + "]" * depth)
        return join(header, body, raw=text)
    if kind == "metadata":
        metadata = header.setdefault("__metadata__", {})
        if isinstance(metadata, dict):
            key = draw(s.sampled_from(KEYS) | ODD_TEXT)
            metadata[key] = draw(ODD_TEXT)
        return join(header, body)
    entry = header.get(draw(s.sampled_from(sorted(k for k in header if k != "__metadata__") or ["experts"])))
    try:  # nonfinite: a weight of a float tensor set to a NaN or an infinity
        begin, end = entry["data_offsets"]
        width = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}[entry["dtype"]]
    except (TypeError, KeyError, ValueError):
        return data
    if not (type(begin) is int and type(end) is int):
        return data
    if end - begin < width or end > len(body):
        return data
    at = begin + width * draw(s.integers(0, (end - begin) // width - 1))
    bits = draw(s.sampled_from(NONFINITE_BITS[width]))
    body = body[:at] + bits.to_bytes(width, "little") + body[at + width:]
    return data[:len(data) - len(body)] + body if len(data) >= len(body) else data


@s.composite
def mutated_file(draw):
    data = SEEDS[draw(s.sampled_from(sorted(SEEDS)))]
    for _ in range(draw(s.integers(1, 3))):
        data = draw(mutation(data))
    return data


def decoded_finite(ckpt) -> bool:
    """Whether every weight the loaded checkpoint holds is finite, decoded here independently."""
    for value in (ckpt.experts, ckpt.router, ckpt.router_bias, ckpt.router_logit_bias, ckpt.expert_bias,
                  ckpt.shared_expert, ckpt.shared_expert_gate, ckpt.expert_scales, ckpt.shared_expert_scales):
        if value is None:
            continue
        value = np.asarray(value)
        if value.dtype == np.uint8:  # fp8 e4m3fn codes: 0x7f and 0xff are NaN
            finite = (value & 0x7F) != 0x7F
        elif value.dtype == np.uint16:  # bf16 bits
            finite = np.isfinite((value.astype(np.uint32) << 16).view(np.float32))
        else:
            finite = np.isfinite(value)
        if not finite.all():
            return False
    return True


def one_line_naming(message: str, path: Path) -> bool:
    return "\n" not in message and str(path) in message


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=mutated_file())
def test_reader_and_info_refuse_or_load_a_finite_layer(data):
    path = WORK / "fuzzed.colibri.safetensors"
    path.write_bytes(data)
    try:
        ckpt = checkpoint.load(path)
        layer = colibri.MoELayer.from_checkpoint(ckpt, path, device="cpu", workspace_tokens=4, num_threads=1)
    except colibri.ColibriError as exc:
        assert one_line_naming(exc.args[0], path), exc.args[0]
        loaded = False
    else:
        loaded = True
        assert decoded_finite(ckpt), "a layer holding a non-finite weight was loaded"
        x = np.ones((3, layer.config.hidden_size), np.float32)
        k = layer.config.top_k
        routing = () if layer.config.has_router else (np.zeros((3, k), np.int32), np.full((3, k), 1 / k, np.float32))
        assert layer.forward(x, *routing).shape == (3, layer.config.out_features)
        del layer, ckpt

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = colibri_main(["info", str(path)])
    assert status == (0 if loaded else 1), (status, err.getvalue())
    if not loaded:
        lines = err.getvalue().splitlines()
        assert out.getvalue() == "" and len(lines) == 1 and lines[0].startswith("colibri info: "), err.getvalue()
        assert str(path) in lines[0], lines[0]


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_files_load(name):
    """The fuzzer starts from valid files: each loads and `info` passes it."""
    path = WORK / f"seed-{name}.colibri.safetensors"
    path.write_bytes(SEEDS[name])
    colibri.MoELayer.from_file(path)
    with contextlib.redirect_stdout(io.StringIO()):
        assert colibri_main(["info", str(path)]) == 0
