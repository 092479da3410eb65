"""DLPack exchange: colibri.Tensor exports (bf16 included) to numpy and torch, the capsule ownership
protocol both ways (consumed capsules, unconsumed ones, deleters called from threads without the
GIL), versioned capsules, and zero-copy reads."""
import ctypes
import gc
import threading

import numpy as np
import pytest

import colibri
from colibri import dlpack
from colibri.dtypes import bf16_to_float32, float32_to_bf16


def test_bf16_conversion_rounds_to_nearest_even():
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 65504.0, np.inf, -np.inf], np.float32)
    widened = bf16_to_float32(float32_to_bf16(values))
    # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa.
    assert widened.tolist() == [1.0, 1.0, 1.0 + 2**-6, -2.5, 65536.0, np.inf, -np.inf]
    assert np.isnan(bf16_to_float32(float32_to_bf16(np.array([np.nan, -np.nan], np.float32)))).all()
    x = np.random.default_rng().standard_normal(10000).astype(np.float32)
    widened = bf16_to_float32(float32_to_bf16(x))
    assert (np.abs(widened - x) <= np.abs(x) * 2**-8).all()  # bf16 unit roundoff
    torch = pytest.importorskip("torch", reason="torch is not installed: no second opinion on rounding")
    assert (torch.from_numpy(x).bfloat16().float().numpy() == widened).all()


def test_tensor_to_numpy_zero_copy():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = colibri.Tensor.from_numpy(base)
    assert t.shape == (3, 4) and t.dtype == "fp32" and t.device == "cpu"
    view = np.from_dlpack(t)
    assert view.shape == (3, 4) and (view == base).all()
    base[1, 2] = -7.0
    assert view[1, 2] == -7.0  # shares memory


def test_bf16_tensor_round_trip_through_torch():
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    values = np.random.default_rng().standard_normal((5, 3)).astype(np.float32)
    t = colibri.Tensor.from_numpy(float32_to_bf16(values), "bf16")
    as_torch = torch.from_dlpack(t)
    assert as_torch.dtype == torch.bfloat16 and tuple(as_torch.shape) == (5, 3)
    assert (as_torch.float().numpy() == t.numpy()).all()
    # torch -> colibri: a bf16 torch tensor read back exactly.
    back = dlpack.take("x", as_torch)
    try:
        assert back.dtype == "bf16" and back.kind == "torch"
        assert (bf16_to_float32(back.host_array()) == t.numpy()).all()
    finally:
        back.release()


def test_exported_capsule_lifetimes():
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    gc.collect()
    before = len(dlpack._live_exports)
    t = colibri.Tensor.from_numpy(np.ones((2, 2), np.float32))
    consumed = torch.from_dlpack(t)
    assert len(dlpack._live_exports) == before + 1
    del consumed
    gc.collect()
    assert len(dlpack._live_exports) == before  # the consumer called our deleter
    capsule = t.__dlpack__()
    assert len(dlpack._live_exports) == before + 1
    del capsule  # never consumed: the capsule's destructor calls the deleter
    gc.collect()
    assert len(dlpack._live_exports) == before


def test_deleter_called_without_the_gil():
    """Triton may drop a tensor on a thread of its own: the deleter must take the GIL itself."""
    t = colibri.Tensor.from_numpy(np.ones(4, np.float32))
    capsule = t.__dlpack__()
    managed = dlpack._PyCapsule_GetPointer(capsule, b"dltensor")
    dlpack._PyCapsule_SetName(capsule, dlpack._USED_DLTENSOR)
    deleter = colibri.ffi.cast("DLManagedTensor *", managed).deleter
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(int(colibri.ffi.cast("uintptr_t", deleter)))
    errors = []

    def consumer():  # a ctypes call releases the GIL, as a C thread would run without it
        try:
            call(managed)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
    before = len(dlpack._live_exports)
    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join()
    assert not errors
    assert len(dlpack._live_exports) == before - 1


def test_consumed_input_capsule_is_released():
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    capsule = x.__dlpack__()
    view = dlpack.take("x", capsule)
    assert view.shape == (2, 3) and view.dtype == "fp32" and view.ptr == x.data_ptr()
    assert (view.host_array() == x.numpy()).all()
    view.release()
    with pytest.raises(colibri.ColibriError, match="a PyCapsule named b'used_dltensor'"):
        dlpack.take("x", capsule)


def test_versioned_capsule():
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    x = torch.arange(6, dtype=torch.float16).reshape(3, 2)
    try:
        capsule = x.__dlpack__(max_version=(1, 0))
    except TypeError:
        pytest.skip("this torch does not export versioned DLPack capsules")
    view = dlpack.take("x", capsule)
    try:
        assert view.dtype == "fp16" and view.shape == (3, 2) and view.ptr == x.data_ptr()
    finally:
        view.release()


def test_strided_and_offset_views():
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    rows = base[1:3]  # contiguous, with a byte offset
    view = dlpack.take("x", rows)
    try:
        assert view.contiguous and (view.host_array() == rows.numpy()).all()
    finally:
        view.release()
    view = dlpack.take("x", base[:, 1:3])
    try:
        assert not view.contiguous
    finally:
        view.release()


def test_readonly_numpy_input():
    """numpy refuses to export read-only arrays through DLPack; Colibri reads them directly."""
    x = np.frombuffer(np.ones(8, np.float32).tobytes(), np.float32).reshape(2, 4)
    assert not x.flags.writeable
    view = dlpack.take("x", x)
    assert view.kind == "numpy" and view.ptr == x.__array_interface__["data"][0]


def test_tensor_refuses_copy_and_other_devices():
    t = colibri.Tensor.from_numpy(np.ones(3, np.float32))
    with pytest.raises(BufferError):
        t.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(dlpack.KDL_CUDA, 0))
    with pytest.raises(colibri.ColibriError, match="dtype 'bf16' needs a uint16 array"):
        colibri.Tensor.from_numpy(np.ones(3, np.float32), "bf16")
