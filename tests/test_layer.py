"""MoELayer on the CPU against the float64 reference: every routing x expert kind x weight dtype x
activation dtype at T = 1, 7, 64, 513, plus caller-given routing, chunking, counters, Python routing
functions and every input error (each named, the layer still working after)."""
import pathlib

import numpy as np
import pytest

import colibri
from colibri import reference
from colibri.dtypes import FLOAT_DTYPES, bf16_to_float32
from colibri.testing import (assert_close, error_limit, random_hidden, random_layer, random_routing,
                             routed_reference)

TOKENS = (1, 7, 64, 513)
ROUTINGS = {
    "softmax_topk": dict(routing="softmax_topk", renormalize=False),
    "softmax_topk_renorm": dict(routing="softmax_topk", renormalize=True),
    "topk_softmax": dict(routing="topk_softmax", renormalize=False),
    "sigmoid_bias_renorm_scaled": dict(routing="sigmoid_bias", renormalize=True, routed_scaling_factor=2.5),
}
POISON = {"fp32": np.float32(np.nan), "fp16": np.float16(np.nan), "bf16": np.uint16(0x7FC0)}


def as_input(stored, dtype):
    """numpy for fp32/fp16; bf16 (which numpy lacks) as a colibri.Tensor over the uint16 bits."""
    return colibri.Tensor.from_numpy(stored, "bf16") if dtype == "bf16" else stored


def poisoned(shape, dtype):
    return as_input(np.full(shape, POISON[dtype]), dtype)


def to_numpy(out):
    return out.numpy() if isinstance(out, colibri.Tensor) else np.asarray(out)


@pytest.mark.parametrize("act_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("weight_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["swiglu", "linear"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_builtin_routing_matches_reference(rng, routing, kind, weight_dtype, act_dtype):
    config, experts, router, bias = random_layer(rng, expert_kind=kind, weight_dtype=weight_dtype,
                                                 **ROUTINGS[routing])
    layer = colibri.MoELayer(config, experts, router, bias)
    for T in TOKENS:
        stored, x64 = random_hidden(rng, T, config.hidden_size, act_dtype)
        ids, weights = layer.route(as_input(stored, act_dtype))
        ids, weights = to_numpy(ids), to_numpy(weights)
        ref, ref_ids, ref_weights, near = routed_reference(config, experts, x64, router, bias, ids)
        assert_close(weights, ref_weights, 1e-5, f"T={T} routing weights")

        out = poisoned((T, config.out_features), act_dtype)
        result = layer.forward(as_input(stored, act_dtype), out=out)
        assert result is out
        assert_close(to_numpy(out), ref, error_limit(act_dtype, weight_dtype), f"T={T} output ({near.sum()} near-ties)")


@pytest.mark.parametrize("act_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("weight_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["swiglu", "linear"])
def test_given_routing_matches_reference(rng, kind, weight_dtype, act_dtype):
    config, experts, _, _ = random_layer(rng, expert_kind=kind, weight_dtype=weight_dtype, top_k=3,
                                         with_router=False)
    layer = colibri.MoELayer(config, experts)
    for T in TOKENS:
        stored, x64 = random_hidden(rng, T, config.hidden_size, act_dtype)
        ids, weights = random_routing(rng, T, config.num_experts, config.top_k)
        ref = reference.moe_forward(config, experts, x64, ids, weights)
        out = layer.forward(as_input(stored, act_dtype), ids, weights)
        assert type(out) is (colibri.Tensor if act_dtype == "bf16" else np.ndarray)
        assert_close(to_numpy(out), ref, error_limit(act_dtype, weight_dtype), f"T={T}")
        # int64 ids are range-checked and converted.
        assert_close(to_numpy(layer.forward(as_input(stored, act_dtype), ids.astype(np.int64), weights)), ref,
                     error_limit(act_dtype, weight_dtype), f"T={T} int64 ids")


def test_odd_sizes_and_chunking(rng):
    """Sizes no kernel tile divides, and more tokens than the workspace, so forward runs in chunks."""
    config, experts, router, _ = random_layer(rng, num_experts=5, top_k=5, hidden_size=35, intermediate_size=19)
    layer = colibri.MoELayer(config, experts, router, workspace_tokens=4)
    stored, x64 = random_hidden(rng, 23, 35, "fp32")
    ids, _ = layer.route(stored)
    ref, *_ = routed_reference(config, experts, x64, router, None, ids)
    assert_close(layer.forward(stored), ref, error_limit("fp32"))


def test_zero_tokens(rng):
    config, experts, router, _ = random_layer(rng)
    layer = colibri.MoELayer(config, experts, router)
    out = layer.forward(np.zeros((0, config.hidden_size), np.float32))
    assert out.shape == (0, config.hidden_size) and out.dtype == np.float32


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    config, experts, router, _ = random_layer(rng, weight_dtype="bf16")
    layer = colibri.MoELayer(config, experts, router)
    for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        stored, x64 = random_hidden(rng, 64, config.hidden_size, dtype)
        x = torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16) if dtype == "bf16" else torch.from_numpy(stored)
        ids, weights = layer.route(x)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        ref, *_ = routed_reference(config, experts, x64, router, None, ids.numpy())
        out = layer.forward(x)
        assert isinstance(out, torch.Tensor) and out.dtype == torch_dtype and out.device.type == "cpu"
        assert_close(out.float().numpy(), ref, error_limit(dtype, "bf16"), f"torch {dtype}")
        given = layer.forward(x, ids.long(), weights)
        assert_close(given.float().numpy(), ref, error_limit(dtype, "bf16"), f"torch {dtype} given routing")


def test_raw_capsules(rng):
    """Raw DLPack capsules (what Triton's pb_utils.Tensor.to_dlpack() gives) in, colibri.Tensor out."""
    config, experts, router, _ = random_layer(rng)
    layer = colibri.MoELayer(config, experts, router)
    stored, x64 = random_hidden(rng, 7, config.hidden_size, "fp32")
    ids, weights = random_routing(rng, 7, config.num_experts, config.top_k)
    out = layer.forward(stored.__dlpack__(), ids.__dlpack__(), weights.__dlpack__())
    assert isinstance(out, colibri.Tensor) and out.shape == (7, config.hidden_size) and out.dtype == "fp32"
    assert_close(out.numpy(), reference.moe_forward(config, experts, x64, ids, weights), error_limit("fp32"))
    capsule = stored.__dlpack__()
    layer.forward(capsule)
    with pytest.raises(colibri.ColibriError, match="hidden_states: a PyCapsule named b'used_dltensor'"):
        layer.forward(capsule)


def test_expert_counts(rng):
    config, experts, router, _ = random_layer(rng)
    layer = colibri.MoELayer(config, experts, router)
    expected = np.zeros(config.num_experts, np.uint64)
    for T in (5, 9):
        stored, _ = random_hidden(rng, T, config.hidden_size, "fp32")
        ids, weights = random_routing(rng, T, config.num_experts, config.top_k)
        layer.forward(stored, ids, weights)
        expected += np.bincount(ids.ravel(), minlength=config.num_experts).astype(np.uint64)
    counts = layer.expert_counts(reset=True)
    assert counts.dtype == np.uint64 and (counts == expected).all()
    assert (layer.expert_counts() == 0).all()


def test_python_routing_fn(rng):
    config, experts, router, _ = random_layer(rng)
    chosen = {}

    def routing_fn(hidden_states, router_logits):
        assert hidden_states.shape == (len(router_logits), config.hidden_size)
        ids = np.argsort(router_logits, axis=1)[:, :config.top_k]  # the LOWEST logits: unlike the built-in
        chosen["ids"] = ids
        return ids, np.full(ids.shape, 0.5, np.float32)

    layer = colibri.MoELayer(config, experts, router, routing_fn=routing_fn)
    stored, x64 = random_hidden(rng, 9, config.hidden_size, "fp32")
    out = layer.forward(stored)
    ref = reference.moe_forward(config, experts, x64, chosen["ids"], np.full(chosen["ids"].shape, 0.5))
    assert_close(out, ref, error_limit("fp32"))

    def failing(hidden_states, router_logits):
        raise RuntimeError("no route today")
    failing_layer = colibri.MoELayer(config, experts, router, routing_fn=failing)
    with pytest.raises(colibri.ColibriError, match="routing_fn raised RuntimeError: no route today") as info:
        failing_layer.forward(stored)
    assert info.value.status == colibri.STATUS_ROUTING


# ---------------------------------------------------------------------------------------------------
# Errors: every bad input is named, and the layer still works afterwards.

T_ERR, H_ERR = 3, 64


def _bad_forward_cases():
    x = np.ones((T_ERR, H_ERR), np.float32)
    ids = np.zeros((T_ERR, 2), np.int32)
    weights = np.ones((T_ERR, 2), np.float32)
    ids_oob = ids.copy()
    ids_oob[2, 1] = 9
    ids_neg = ids.copy()
    ids_neg[1, 0] = -1
    w_nan = weights.copy()
    w_nan[0, 1] = np.nan
    w_inf = weights.copy()
    w_inf[2, 0] = np.inf
    return {
        "wrong_hidden": ((np.ones((T_ERR, 512), np.float32),), r"hidden_states: expected shape \[T, 64\], got \[3, 512\]"),
        "one_dim": ((np.ones(H_ERR, np.float32),), r"hidden_states: expected shape \[T, 64\], got \[64\]"),
        "float64": ((x.astype(np.float64),), "hidden_states: expected dtype fp32 | fp16 | bf16, got fp64"),
        "int_hidden": ((x.astype(np.int32),), "hidden_states: expected dtype fp32 | fp16 | bf16, got int32"),
        "bf16_bits_as_uint16": ((x.view(np.uint16)[:, :H_ERR],), "hidden_states: expected dtype .* got uint16"),
        "list": (([[1.0] * H_ERR],), "hidden_states: expected an array exporting DLPack"),
        "id_out_of_range": ((x, ids_oob, weights), r"topk_ids: expert id 9 out of range \[0, 8\) at row 2"),
        "id_negative": ((x, ids_neg, weights), r"topk_ids: expert id -1 out of range \[0, 8\) at row 1"),
        "weight_nan": ((x, ids, w_nan), "topk_weights: not finite at row 0"),
        "weight_inf": ((x, ids, w_inf), "topk_weights: not finite at row 2"),
        "ids_shape": ((x, ids[:, :1], weights), r"topk_ids: expected shape \[3, 2\]"),
        "weights_rows": ((x, ids, weights[:2]), r"topk_weights: expected shape \[3, 2\]"),
        "ids_alone": ((x, ids, None), "topk_weights: topk_ids and topk_weights must be given together"),
        "weights_alone": ((x, None, weights), "topk_ids: topk_ids and topk_weights must be given together"),
        "ids_float": ((x, weights, weights), "topk_ids: expected dtype int32"),
        "weights_float64": ((x, ids, weights.astype(np.float64)), "topk_weights: expected dtype fp32, got fp64"),
        "out_shape": ((x, ids, weights, np.empty((T_ERR, 5), np.float32)), r"out: expected shape \[3, 64\]"),
    }


BAD_FORWARD = _bad_forward_cases()


@pytest.fixture
def small_layer(rng):
    config, experts, router, _ = random_layer(rng, hidden_size=H_ERR)
    return config, experts, router, colibri.MoELayer(config, experts, router)


def _still_works(rng, config, experts, router, layer):
    stored, x64 = random_hidden(rng, 4, config.hidden_size, "fp32")
    ids, _ = layer.route(stored)
    ref, *_ = routed_reference(config, experts, x64, router, None, ids)
    assert_close(layer.forward(stored), ref, error_limit("fp32"), "after an error")


@pytest.mark.parametrize("case", list(BAD_FORWARD))
def test_bad_forward_input(rng, small_layer, case):
    config, experts, router, layer = small_layer
    args, message = BAD_FORWARD[case]
    with pytest.raises(colibri.ColibriError, match=message) as info:
        if len(args) == 4:
            layer.forward(args[0], args[1], args[2], out=args[3])
        else:
            layer.forward(*args)
    assert info.value.status == colibri.STATUS_INVALID_ARGUMENT and info.value.status_name == "invalid argument"
    _still_works(rng, config, experts, router, layer)


def test_bad_torch_inputs(rng, small_layer):
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    config, experts, router, layer = small_layer
    strided = torch.ones((H_ERR, 3)).T
    with pytest.raises(colibri.ColibriError, match="hidden_states: not C-contiguous"):
        layer.forward(strided)
    ids = torch.zeros((3, 2), dtype=torch.int64)
    ids[1, 1] = 8
    with pytest.raises(colibri.ColibriError, match=r"topk_ids: expert id 8 out of range \[0, 8\) at row 1"):
        layer.forward(torch.ones((3, H_ERR)), ids, torch.ones((3, 2)))
    _still_works(rng, config, experts, router, layer)


def test_no_router_needs_routing(rng):
    config, experts, _, _ = random_layer(rng, with_router=False)
    layer = colibri.MoELayer(config, experts)
    assert not layer.config.has_router
    with pytest.raises(colibri.ColibriError, match="topk_ids: this layer has no router"):
        layer.forward(np.ones((2, config.hidden_size), np.float32))
    with pytest.raises(colibri.ColibriError, match="hidden_states: this layer has no router"):
        layer.route(np.ones((2, config.hidden_size), np.float32))


def _bad_construction_cases(config, experts, router):
    E, H = config.num_experts, config.hidden_size
    bad_router = router.copy()
    bad_router[1, 2] = np.inf
    sigmoid = dict(config=colibri.LayerConfig(**{**vars(config), "routing": "sigmoid_bias"}))
    return {
        "experts_shape": (dict(experts=experts[:, :-1]), r"experts: expected shape \[E=8, 18432\]"),
        "experts_rows": (dict(experts=experts[:5]), r"experts: expected shape \[E=8"),
        "experts_dtype": (dict(experts=experts.astype(np.float16)), "experts: weight_dtype fp32 is stored as float32, got float16"),
        "router_shape": (dict(router=router[:, :5]), rf"router: expected shape \[{E}, {H}\], got \[{E}, 5\]"),
        "router_inf": (dict(router=bad_router), r"router: not finite at index \(1, 2\)"),
        "router_bits": (dict(router=router.view(np.uint16)), "router: expected a float array, got dtype uint16"),
        "bias_shape": (dict(router_bias=np.zeros(3, np.float32)), r"router_bias: expected shape \[8\]"),
        "sigmoid_without_bias": (sigmoid, r"router_bias: sigmoid_bias routing needs router_bias \[8\]"),
        "top_k": (dict(config=colibri.LayerConfig(**{**vars(config), "top_k": 9})), r"config.top_k must be in \[1, num_experts=8\], got 9"),
        "kind": (dict(config=colibri.LayerConfig(**{**vars(config), "expert_kind": "gelu"})), "config.expert_kind: expected swiglu | linear, got 'gelu'"),
        "routing": (dict(config=colibri.LayerConfig(**{**vars(config), "routing": "random"})), "config.routing: expected"),
        "scaling": (dict(config=colibri.LayerConfig(**{**vars(config), "routed_scaling_factor": float("nan")})), "config.routed_scaling_factor"),
        "device": (dict(device="tpu"), "device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        "threads": (dict(num_threads=-1), "num_threads: expected an integer >= 0"),
    }


def test_bad_construction(rng):
    config, experts, router, _ = random_layer(rng)
    for case, (override, message) in _bad_construction_cases(config, experts, router).items():
        kwargs = {"config": config, "experts": experts, "router": router, **override}
        with pytest.raises(colibri.ColibriError, match=message) as info:
            colibri.MoELayer(**kwargs)
        assert info.value.status == colibri.STATUS_INVALID_ARGUMENT, case


@pytest.mark.skipif(colibri.cuda_device_count() > 0, reason="a GPU is present: CUDA layers are tested elsewhere")
def test_cuda_layer_without_gpu_is_refused(rng):
    config, experts, router, _ = random_layer(rng)
    with pytest.raises(colibri.ColibriError) as info:
        colibri.MoELayer(config, experts, router, device="cuda")
    assert info.value.status in (colibri.STATUS_UNSUPPORTED, colibri.STATUS_CUDA)
    assert "colibri_moe_context_create" in str(info.value) or "colibri_moe_context_init" in str(info.value)


def test_bf16_output_round_trip(rng):
    """A bf16 forward's colibri.Tensor output: .numpy() widens exactly, and it feeds a second forward."""
    config, experts, router, _ = random_layer(rng, weight_dtype="bf16")
    layer = colibri.MoELayer(config, experts, router)
    stored, x64 = random_hidden(rng, 7, config.hidden_size, "bf16")
    out = layer.forward(colibri.Tensor.from_numpy(stored, "bf16"))
    assert out.dtype == "bf16" and out.shape == (7, config.hidden_size) and out.device == "cpu"
    widened = out.numpy()
    assert widened.dtype == np.float32
    again = layer.forward(out)
    bits = np.asarray(np.from_dlpack(colibri.Tensor(out, out.data_ptr, out.shape, "uint16")))
    assert (bf16_to_float32(bits) == widened).all()
    ids, _ = layer.route(widened)
    ref, *_ = routed_reference(config, experts, bf16_to_float32(bits).astype(np.float64), router, None, ids)
    assert_close(again.numpy(), ref, error_limit("bf16"))


def test_package_is_self_contained(tmp_path):
    """The package folder (extension + libcolibri.so, linked with rpath $ORIGIN) works when copied
    elsewhere, as into a Docker image or next to a Triton model."""
    import shutil
    import subprocess
    import sys
    copy = tmp_path / "site" / "colibri"
    shutil.copytree(pathlib.Path(colibri.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    script = ("import colibri, numpy as np, sys; from colibri.testing import random_layer; "
              "c, e, r, _ = random_layer(np.random.default_rng(0)); "
              "out = colibri.MoELayer(c, e, r).forward(np.ones((2, 64), np.float32)); "
              "print(colibri.__file__, out.shape, bool(np.isfinite(out).all()))")
    # Only cffi's runtime (a dependency, wherever this interpreter finds it: a site folder given by
    # PYTHONPATH on the GPU machine) comes along; nothing of the repository does.
    import _cffi_backend
    runtime = pathlib.Path(_cffi_backend.__file__).parent
    assert not (runtime / "colibri").exists()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": f"{copy.parent}:{runtime}", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(copy / "__init__.py"), "(2,", "64)", "True"]


# ---------------------------------------------------------------------------------------------------
# CUDA layers (run only where a GPU and the CUDA backend are present): the same reference, with torch,
# cupy and raw CUDA capsules as inputs.

needs_gpu = pytest.mark.skipif(not colibri.cuda_built() or colibri.cuda_device_count() == 0,
                               reason="no GPU or libcolibri built without the CUDA backend")


def _gpu_library(name):
    return pytest.importorskip(name, reason=f"{name} is not installed in this environment")


@needs_gpu
@pytest.mark.parametrize("weight_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_cuda_torch_matches_reference(rng, routing, weight_dtype):
    torch = _gpu_library("torch")
    config, experts, router, bias = random_layer(rng, weight_dtype=weight_dtype, **ROUTINGS[routing])
    layer = colibri.MoELayer(config, experts, router, bias, device="cuda")
    for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for T in TOKENS:
            stored, x64 = random_hidden(rng, T, config.hidden_size, dtype)
            host = torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16) if dtype == "bf16" else torch.from_numpy(stored)
            x = host.cuda()
            ids, weights = layer.route(x)
            assert ids.is_cuda and ids.dtype == torch.int32
            ref, *_ = routed_reference(config, experts, x64, router, bias, ids.cpu().numpy())
            out = layer.forward(x)
            assert out.is_cuda and out.dtype == torch_dtype
            assert_close(out.float().cpu().numpy(), ref, error_limit(dtype, weight_dtype), f"cuda torch {dtype} T={T}")
            given = layer.forward(x, ids.long(), weights)
            assert_close(given.float().cpu().numpy(), ref, error_limit(dtype, weight_dtype), f"cuda given {dtype} T={T}")
    layer.expert_counts(reset=True)


@needs_gpu
def test_cuda_cupy_and_raw_capsules(rng):
    cupy = _gpu_library("cupy")
    torch = _gpu_library("torch")
    config, experts, router, _ = random_layer(rng, weight_dtype="bf16")
    layer = colibri.MoELayer(config, experts, router, device="cuda:0")
    stored, x64 = random_hidden(rng, 64, config.hidden_size, "fp16")
    ids, weights = random_routing(rng, 64, config.num_experts, config.top_k)
    ref = reference.moe_forward(config, experts, x64, ids, weights)
    out = layer.forward(cupy.asarray(stored), cupy.asarray(ids), cupy.asarray(weights))
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float16
    assert_close(cupy.asnumpy(out), ref, error_limit("fp16", "bf16"), "cupy")
    capsules = [torch.from_numpy(a).cuda().__dlpack__() for a in (stored, ids, weights)]
    out = layer.forward(*capsules)
    assert isinstance(out, colibri.Tensor) and out.device == "cuda:0" and out.dtype == "fp16"
    assert_close(out.numpy(), ref, error_limit("fp16", "bf16"), "raw CUDA capsules")
    assert_close(torch.from_dlpack(out).float().cpu().numpy(), ref, error_limit("fp16", "bf16"), "exported to torch")


@needs_gpu
def test_cuda_input_errors(rng):
    torch = _gpu_library("torch")
    config, experts, router, _ = random_layer(rng, hidden_size=H_ERR)
    layer = colibri.MoELayer(config, experts, router, device="cuda")
    x = torch.ones((3, H_ERR), device="cuda")
    ids = torch.zeros((3, 2), dtype=torch.int32, device="cuda")
    ids[2, 1] = 8
    with pytest.raises(colibri.ColibriError, match=r"topk_ids: expert id 8 out of range \[0, 8\) at row 2"):
        layer.forward(x, ids, torch.ones((3, 2), device="cuda"))
    weights = torch.ones((3, 2), device="cuda")
    weights[1, 0] = float("nan")
    with pytest.raises(colibri.ColibriError, match="topk_weights: not finite at row 1"):
        layer.forward(x, torch.zeros((3, 2), dtype=torch.int32, device="cuda"), weights)
    with pytest.raises(colibri.ColibriError, match="hidden_states: on cpu but the layer runs on cuda:0"):
        layer.forward(np.ones((3, H_ERR), np.float32))
    stored, x64 = random_hidden(rng, 4, H_ERR, "fp32")
    out = layer.forward(torch.from_numpy(stored).cuda())
    ids, _ = layer.route(torch.from_numpy(stored).cuda())
    ref, *_ = routed_reference(config, experts, x64, router, None, ids.cpu().numpy())
    assert_close(out.cpu().numpy(), ref, error_limit("fp32"), "after an error")


# --------------------------------------------------------------------------------- non-finite inputs

# Bit patterns per activation dtype (as stored: fp32 uint32, fp16 and bf16 uint16): Inf, -Inf, quiet,
# negative and payload NaNs; and finite values at the edges (largest, smallest subnormal, -0), which
# must not be taken for them.
NONFINITE_BITS = {"fp32": [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001],
                  "fp16": [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01],
                  "bf16": [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81]}
FINITE_EDGE_BITS = {"fp32": [0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000000],
                    "fp16": [0x7BFF, 0xFBFF, 0x0001, 0x8000],
                    "bf16": [0x7F7F, 0xFF7F, 0x0001, 0x8000]}
BITS_VIEW = {"fp32": np.uint32, "fp16": np.uint16, "bf16": np.uint16}


def hidden_with_nonfinite_rows(rng, T, H, dtype):
    """(stored hidden states [T, H] with finite edge values everywhere and non-finite ones in a few
    random rows, those rows sorted)."""
    stored, _ = random_hidden(rng, T, H, dtype)
    bits = stored.view(BITS_VIEW[dtype])
    for _ in range(3):
        bits[rng.integers(T), rng.integers(H)] = rng.choice(FINITE_EDGE_BITS[dtype])
    bad = sorted(int(r) for r in rng.choice(T, size=int(rng.integers(0, min(T, 3) + 1)), replace=False))
    for row in bad:
        bits[row, rng.integers(H)] = rng.choice(NONFINITE_BITS[dtype])
    return stored, bad


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nonfinite_rows_names_each_arrays_first_bad_row(rng, dtype):
    arrays, expected = [], []
    for T in (1, 2, 5, 64, 513):
        stored, bad = hidden_with_nonfinite_rows(rng, T, 48, dtype)
        arrays.append(as_input(stored, dtype))
        expected.append(bad[0] if bad else None)
    capsule, capsule_bad = hidden_with_nonfinite_rows(rng, 9, 48, dtype)
    arrays.append(as_input(capsule, dtype).__dlpack__())
    expected.append(capsule_bad[0] if capsule_bad else None)
    # Left to the layer's own checks: no array, no rows, no tokens, integers.
    arrays += [None, as_input(np.zeros((0, 48), BITS_VIEW[dtype]).view(capsule.dtype), dtype), np.arange(4)]
    expected += [None, None, None]
    assert colibri.nonfinite_rows(arrays) == expected


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nonfinite_rows_by_part_names_each_parts_first_bad_row(rng, dtype):
    """One array made of consecutive parts (a server's joined batch): each part's first bad row,
    counted within the part, as nonfinite_rows gives it for the parts apart."""
    parts, expected = [], []
    for T in (1, 2, 5, 64, 513, 3, 9):
        stored, bad = hidden_with_nonfinite_rows(rng, T, 48, dtype)
        parts.append(stored)
        expected.append(bad[0] if bad else None)
    clean, _ = random_hidden(rng, 4, 48, dtype)
    dirty, _ = random_hidden(rng, 6, 48, dtype)
    dirty.view(BITS_VIEW[dtype])[2, rng.integers(48)] = rng.choice(NONFINITE_BITS[dtype])
    dirty.view(BITS_VIEW[dtype])[5, rng.integers(48)] = rng.choice(NONFINITE_BITS[dtype])
    parts[3:3] = [clean, dirty]
    expected[3:3] = [None, 2]
    lengths = [part.shape[0] for part in parts]
    joined = np.concatenate(parts)
    assert colibri.nonfinite_rows_by_part(as_input(joined, dtype), lengths) == expected
    assert colibri.nonfinite_rows_by_part(as_input(joined, dtype).__dlpack__(), lengths) == expected
    assert colibri.nonfinite_rows_by_part(None, [3, 4]) == [None, None]
    with pytest.raises(colibri.ColibriError, match=r"hidden_states: parts of \[1, 2\] rows do not make up its 4 rows"):
        colibri.nonfinite_rows_by_part(as_input(joined[:4], dtype), [1, 2])


def test_forward_check_finite_refuses_naming_the_row(rng, small_layer):
    config, experts, router, layer = small_layer
    x = rng.standard_normal((6, config.hidden_size)).astype(np.float32)
    x[4, 3], x[5, 0] = np.inf, np.nan
    with pytest.raises(colibri.ColibriError, match="hidden_states: not finite at row 4") as info:
        layer.forward(x, check_finite=True)
    assert info.value.status == colibri.STATUS_INVALID_ARGUMENT
    # Without the check (the default) the NaN and Inf are computed and stay in their own tokens.
    out = layer.forward(x)
    assert (~np.isfinite(out[4:])).any(1).all()
    np.testing.assert_array_equal(out[:4], layer.forward(x[:4], check_finite=True))
    _still_works(rng, config, experts, router, layer)


@needs_gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_nonfinite_rows_one_synchronisation(rng, dtype, monkeypatch):
    """GPU arrays are checked on the GPU, with their own library, and all their answers come back in
    one copy to the host; host arrays in the same list are checked on the host."""
    torch = _gpu_library("torch")
    from colibri import nonfinite
    copies = []
    to_host = nonfinite.device_to_host
    monkeypatch.setattr(nonfinite, "device_to_host", lambda array: copies.append(array) or to_host(array))
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]

    def on_gpu(stored):
        return torch.from_numpy(stored.view(np.int32 if dtype == "fp32" else np.int16)).cuda().view(torch_dtype)

    arrays, expected = [], []
    for T in (1, 3, 64, 513, 7):
        stored, bad = hidden_with_nonfinite_rows(rng, T, 40, dtype)
        arrays.append(on_gpu(stored))
        expected.append(bad[0] if bad else None)
    host, host_bad = hidden_with_nonfinite_rows(rng, 6, 40, dtype)
    arrays.append(as_input(host, dtype))
    expected.append(host_bad[0] if host_bad else None)
    capsule, capsule_bad = hidden_with_nonfinite_rows(rng, 9, 40, dtype)
    arrays.append(on_gpu(capsule).__dlpack__())  # a raw capsule: checked with cupy if present, else torch
    expected.append(capsule_bad[0] if capsule_bad else None)
    assert colibri.nonfinite_rows(arrays) == expected
    libraries = {type(c).__module__.split(".")[0] for c in copies}
    assert len(copies) == len(libraries) <= 2, copies


@needs_gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_nonfinite_rows_by_part_one_synchronisation(rng, dtype, monkeypatch):
    torch = _gpu_library("torch")
    from colibri import nonfinite
    copies = []
    to_host = nonfinite.device_to_host
    monkeypatch.setattr(nonfinite, "device_to_host", lambda array: copies.append(array) or to_host(array))
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    parts, expected = [], []
    for T in (1, 3, 64, 513, 7, 2):
        stored, bad = hidden_with_nonfinite_rows(rng, T, 40, dtype)
        parts.append(stored)
        expected.append(bad[0] if bad else None)
    joined = np.concatenate(parts)
    on_gpu = torch.from_numpy(joined.view(np.int32 if dtype == "fp32" else np.int16)).cuda().view(torch_dtype)
    assert colibri.nonfinite_rows_by_part(on_gpu, [part.shape[0] for part in parts]) == expected
    assert len(copies) == 1, copies

    if dtype != "bf16":  # cupy has no bfloat16; a cupy array alone: one copy, with cupy
        cupy = _gpu_library("cupy")
        copies.clear()
        stored, bad = hidden_with_nonfinite_rows(rng, 33, 40, dtype)
        assert colibri.nonfinite_rows([cupy.asarray(stored), cupy.asarray(stored[:1])]) == \
            [bad[0] if bad else None, 0 if bad and bad[0] == 0 else None]
        assert len(copies) == 1 and isinstance(copies[0], cupy.ndarray)


@needs_gpu
def test_cuda_forward_check_finite(rng):
    torch = _gpu_library("torch")
    config, experts, router, _ = random_layer(rng, hidden_size=H_ERR)
    layer = colibri.MoELayer(config, experts, router, device="cuda")
    x = torch.from_numpy(rng.standard_normal((5, H_ERR)).astype(np.float32)).cuda()
    x[3, 7] = float("-inf")
    with pytest.raises(colibri.ColibriError, match="hidden_states: not finite at row 3") as info:
        layer.forward(x, check_finite=True, stream=torch.cuda.Stream())
    assert info.value.status == colibri.STATUS_INVALID_ARGUMENT
    assert torch.equal(layer.forward(x[:3], check_finite=True), layer.forward(x[:3]))
