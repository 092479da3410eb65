"""Packed checkpoints and the safetensors reader/writer: round trips (cross-checked with the
safetensors library when installed), memory-mapped weights used in place, the demo writer, and every
malformed file refused with a message naming the file and the problem."""
import dataclasses
import json
import struct

import numpy as np
import pytest

import colibri
from colibri import checkpoint
from colibri import safetensors_io as st
from colibri.testing import assert_close, error_limit, random_hidden, random_layer, routed_reference


def saved_layer(rng, tmp_path, **kwargs):
    config, experts, router, bias = random_layer(rng, **kwargs)
    path = tmp_path / "layer.colibri.safetensors"
    checkpoint.save(path, config, experts, router, bias)
    return path, config, experts, router, bias


@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16", "bf16"])
def test_round_trip_and_in_place_weights(rng, tmp_path, weight_dtype):
    path, config, experts, router, bias = saved_layer(rng, tmp_path, weight_dtype=weight_dtype,
                                                      routing="sigmoid_bias", routed_scaling_factor=1.5)
    ckpt = checkpoint.load(path)
    assert ckpt.config == config
    assert (ckpt.experts == experts).all() and (ckpt.router == router).all() and (ckpt.router_bias == bias).all()
    assert ckpt.experts.ctypes.data % 64 == 0  # the writer aligns the data section

    layer = colibri.MoELayer.from_file(path)
    whole_file = np.frombuffer(layer._keepalive._mmap, np.uint8)
    assert not layer._experts.flags.writeable and np.shares_memory(layer._experts, whole_file)
    del ckpt, whole_file  # the layer alone keeps the memory map alive
    stored, x64 = random_hidden(rng, 16, config.hidden_size, "fp32")
    ids, _ = layer.route(stored)
    ref, *_ = routed_reference(config, experts, x64, router, bias, ids)
    assert_close(layer.forward(stored), ref, error_limit("fp32", weight_dtype))


def test_cross_check_with_safetensors_library(rng, tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors library is not installed")
    path, config, experts, router, _ = saved_layer(rng, tmp_path, weight_dtype="fp16")
    theirs = safetensors_numpy.load_file(str(path))
    assert (theirs["experts"] == experts).all() and (theirs["router"] == router).all()
    other = tmp_path / "theirs.safetensors"
    safetensors_numpy.save_file({"a": np.arange(10, dtype=np.int64), "b": router}, str(other), metadata={"k": "v"})
    mine = st.SafetensorsFile(other)
    assert mine.metadata == {"k": "v"} and (mine.get("a") == np.arange(10)).all() and (mine.get("b") == router).all()


def test_demo_writer_and_cli(rng, tmp_path, colibri_cli):
    path = tmp_path / "demo.colibri.safetensors"
    config = checkpoint.write_demo(path)
    assert (config.num_experts, config.top_k, config.hidden_size, config.intermediate_size, config.weight_dtype) == \
        (8, 2, 256, 512, "bf16")
    ckpt = checkpoint.load(path)
    layer = colibri.MoELayer.from_file(path)
    stored, x64 = random_hidden(rng, 64, 256, "fp32")
    ids, _ = layer.route(stored)
    ref, *_ = routed_reference(ckpt.config, ckpt.experts, x64, ckpt.router, None, ids)
    out = layer.forward(stored)
    assert_close(out, ref, error_limit("bf16"))
    assert 0.1 < np.abs(ref).std() < 10  # activations stay O(1)

    other = tmp_path / "cli.colibri.safetensors"
    result = colibri_cli("demo", "--out", other, "--experts", 4, "--top-k", 1, "--hidden", 32, "--intermediate", 48,
                         "--dtype", "fp16", "--seed", 3, "--routing", "sigmoid_bias", "--kind", "linear")
    assert result.returncode == 0, result.stderr
    loaded = checkpoint.load(other)
    assert (loaded.config.expert_kind, loaded.config.weight_dtype, loaded.config.routing, loaded.router_bias.shape) == \
        ("linear", "fp16", "sigmoid_bias", (4,))
    info = colibri_cli("info", other)
    assert info.returncode == 0 and "sigmoid_bias" in info.stdout and "[4, 1536]" in info.stdout


# ---------------------------------------------------------------------------------------------------
# Malformed files


def raw_file(path, header, data=b"", header_len=None):
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body + data)
    return path


def rewrite_metadata(path, change):
    """The same file with its metadata changed by change(dict)."""
    file = st.SafetensorsFile(path)
    tensors = {name: (info.dtype, file.get(name)) for name, info in file.tensors.items()}
    metadata = dict(file.metadata)
    change(metadata)
    del file
    out = path.with_name("changed.colibri.safetensors")
    st.write(out, tensors, metadata)
    return out


BAD_METADATA = {
    "format": (lambda m: m.update(format="something/2"), "metadata format is 'something/2'"),
    "missing_top_k": (lambda m: m.pop("top_k"), "metadata lacks top_k"),
    "not_int": (lambda m: m.update(num_experts="eight"), "metadata num_experts='eight' is not an integer"),
    "routing": (lambda m: m.update(routing="random"), "metadata routing='random' is not one of"),
    "renormalize": (lambda m: m.update(renormalize="maybe"), "metadata renormalize='maybe'"),
    "scaling": (lambda m: m.update(routed_scaling_factor="big"), "routed_scaling_factor='big' is not a finite decimal number"),
    "invalid_layer": (lambda m: m.update(top_k="99"), "metadata describes an invalid layer"),
    "shape_mismatch": (lambda m: m.update(hidden_size="65"), r"tensor 'experts' has shape \[8, 18432\], expected \[8, 18720\]"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_wrong_metadata(rng, tmp_path, case):
    path, *_ = saved_layer(rng, tmp_path)
    change, message = BAD_METADATA[case]
    bad = rewrite_metadata(path, change)
    with pytest.raises(colibri.ColibriError, match=message) as info:
        colibri.MoELayer.from_file(bad)
    assert str(bad) in str(info.value) and info.value.status == colibri.STATUS_INVALID_ARGUMENT


def test_missing_tensors(rng, tmp_path):
    config, experts, router, _ = random_layer(rng, routing="sigmoid_bias")
    meta = checkpoint.config_metadata(config)
    no_experts = tmp_path / "a.colibri.safetensors"
    st.write(no_experts, {"router": router}, meta)
    with pytest.raises(colibri.ColibriError, match="has no 'experts' tensor"):
        checkpoint.load(no_experts)
    no_bias = tmp_path / "b.colibri.safetensors"
    st.write(no_bias, {"experts": experts, "router": router}, meta)
    with pytest.raises(colibri.ColibriError, match="sigmoid_bias routing needs a 'router_bias' tensor"):
        checkpoint.load(no_bias)
    bad_router = tmp_path / "c.colibri.safetensors"
    st.write(bad_router, {"experts": experts, "router": router[:, :3]}, meta)
    with pytest.raises(colibri.ColibriError, match=r"tensor 'router' has shape \[8, 3\], expected \[8, 64\]"):
        checkpoint.load(bad_router)


def test_truncated_file(rng, tmp_path):
    path, *_ = saved_layer(rng, tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 100, 5):
        truncated = tmp_path / f"cut{cut}.colibri.safetensors"
        truncated.write_bytes(data[:cut])
        with pytest.raises(colibri.ColibriError, match=f"{truncated}: .*(truncated|too short)"):
            colibri.MoELayer.from_file(truncated)


MALFORMED = {
    "huge_header_length": (dict(header={}, header_len=2**40), "header length 1099511627776 does not fit"),
    "not_json": (None, "header is not valid JSON"),
    "unknown_dtype": (dict(header={"x": {"dtype": "F17", "shape": [1], "data_offsets": [0, 4]}}, data=b"\0" * 4),
                      "unknown dtype 'F17'"),
    "size_mismatch": (dict(header={"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, data=b"\0" * 4),
                      r"4 bytes for shape \[2\] of F32 \(expected 8\)"),
    "overlap": (dict(header={"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, data=b"\0" * 8),
                "overlaps the previous tensor"),
    "hole": (dict(header={"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, data=b"\0" * 8),
             "a hole of 4 bytes before its data"),
    "trailing": (dict(header={"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, data=b"\0" * 8),
                 "holes or trailing bytes"),
    "beyond_end": (dict(header={"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, data=b"\0" * 8),
                   "data ends at byte 16 but the file holds only 8"),
    "metadata_not_strings": (dict(header={"__metadata__": {"a": 1}}), "__metadata__ must map strings to strings"),
    "negative_shape": (dict(header={"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}),
                       "is not a list of non-negative integers"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_safetensors(tmp_path, case):
    spec, message = MALFORMED[case]
    path = tmp_path / "bad.colibri.safetensors"
    if spec is None:
        path.write_bytes(struct.pack("<Q", 6) + b"{nope}")
    else:
        raw_file(path, **spec)
    with pytest.raises(colibri.ColibriError, match=message) as info:
        checkpoint.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name, content", [("weights.pt", b"PK\x03\x04rest"), ("weights.bin", b"\x80\x02}q\x00."),
                                           ("weights.colibri.safetensors", b"\x80\x04\x95" + b"\0" * 20)])
def test_pickles_refused(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(colibri.ColibriError, match="pickle / PyTorch file, which Colibri never loads"):
        checkpoint.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(colibri.ColibriError, match="no such file"):
        colibri.MoELayer.from_file(tmp_path / "absent.colibri.safetensors")


# ---------------------------------------------------------------------------------------------------
# Format versions


def test_version_1_file_loads(rng, tmp_path):
    """A colibri-moe/1 file (its eight keys, no v2 tensors) loads as a layer without the v2 features;
    its router_bias under softmax routing stays unused, as v1 readers left it."""
    config, experts, router, _ = random_layer(rng)
    meta = {k: v for k, v in checkpoint.config_metadata(config).items()
            if k in checkpoint.REQUIRED_METADATA + ("routed_scaling_factor",)}
    path = tmp_path / "v1.colibri.safetensors"
    st.write(path, {"experts": experts, "router": router, "router_bias": np.ones(8, np.float32)},
             {**meta, "format": "colibri-moe/1"})
    ckpt = checkpoint.load(path)
    assert ckpt.version == 1 and ckpt.config == config and ckpt.router_bias is None
    assert not ckpt.config.uses_v2_features and ckpt.shared_expert is None and ckpt.expert_bias is None
    layer = colibri.MoELayer.from_file(path)
    stored, x64 = random_hidden(rng, 8, config.hidden_size, "fp32")
    ref, *_ = routed_reference(config, experts, x64, router, None, layer.route(stored)[0])
    assert_close(layer.forward(stored), ref, error_limit("fp32"))


def test_unknown_version_refused(rng, tmp_path):
    path, *_ = saved_layer(rng, tmp_path)
    assert checkpoint.load(path).metadata["format"] == "colibri-moe/2"
    bad = rewrite_metadata(path, lambda m: m.update(format="colibri-moe/4"))
    with pytest.raises(colibri.ColibriError, match=r"format version 4 \('colibri-moe/4'\) is not known to this reader, "
                                                   r"which reads colibri-moe/1, colibri-moe/2, colibri-moe/3"):
        checkpoint.load(bad)


def v2_layer(rng):
    """A layer with every v2 feature: groups, clamped activation, expert biases, a gated shared expert
    and a router logit bias, as keyword arguments of checkpoint.save."""
    config, experts, router, bias = random_layer(rng, num_experts=8, top_k=3, routing="sigmoid_bias")
    config = dataclasses.replace(config, n_group=4, topk_group=2, group_score="top2_sum", activation="swiglu_oai",
                                 activation_alpha=1.5, activation_limit=0.8, expert_bias=True,
                                 shared_intermediate_size=24, shared_gate=True, routed_scaling_factor=2.0)
    H = config.hidden_size
    tensors = dict(router_logit_bias=rng.standard_normal(8).astype(np.float32),
                   expert_bias=rng.standard_normal((8, config.expert_bias_width)).astype(np.float32),
                   shared_expert=(rng.standard_normal(config.shared_numel) / np.sqrt(H)).astype(np.float32),
                   shared_expert_gate=rng.standard_normal(H).astype(np.float32))
    return config, experts, router, bias, tensors


def test_version_2_round_trip(rng, tmp_path):
    config, experts, router, bias, tensors = v2_layer(rng)
    path = tmp_path / "v2.colibri.safetensors"
    checkpoint.save(path, config, experts, router, bias, **tensors)
    ckpt = checkpoint.load(path)
    assert ckpt.version == 2 and ckpt.config == dataclasses.replace(config, has_router_logit_bias=True)
    for name, value in tensors.items():
        assert (np.asarray(getattr(ckpt, name)).reshape(value.shape) == value).all(), name
    # Nothing given goes unused: a tensor the metadata does not ask for, or an unknown one, is refused.
    extra = rewrite_metadata(path, lambda m: m.update(shared_gate="false"))
    with pytest.raises(colibri.ColibriError, match="tensor 'shared_expert_gate' is present but the metadata does not ask"):
        checkpoint.load(extra)
    file = st.SafetensorsFile(path)
    stray = tmp_path / "stray.colibri.safetensors"
    st.write(stray, {**{n: (i.dtype, file.get(n)) for n, i in file.tensors.items()}, "gate_bias": np.zeros(8, np.float32)},
             file.metadata)
    with pytest.raises(colibri.ColibriError, match="unknown tensor 'gate_bias'"):
        checkpoint.load(stray)
    with pytest.raises(colibri.ColibriError, match="shared_expert missing but the config asks for it"):
        checkpoint.save(tmp_path / "x.colibri.safetensors", config, experts, router, bias,
                        **{k: v for k, v in tensors.items() if k != "shared_expert"})


def test_version_2_layer(rng, tmp_path):
    """The v2 features through MoELayer: the library's layer against colibri.reference."""
    config, experts, router, bias, tensors = v2_layer(rng)
    path = tmp_path / "v2.colibri.safetensors"
    checkpoint.save(path, config, experts, router, bias, **tensors)
    layer = colibri.MoELayer.from_file(path)
    stored, x64 = random_hidden(rng, 32, config.hidden_size, "fp32")
    ref, *_ = routed_reference(layer.config, experts, x64, router, bias, layer.route(stored)[0], **tensors)
    assert_close(layer.forward(stored), ref, error_limit("fp32"))
