"""Zero-copy tensor exchange through DLPack.

Reading: `take(name, obj)` accepts a numpy array, anything with __dlpack__ / __dlpack_device__ (torch,
cupy, colibri.Tensor, ...) or a raw DLPack PyCapsule (what Triton's pb_utils.Tensor.to_dlpack()
returns), and describes its memory as a View without copying. A capsule taken this way is consumed
as the protocol says: renamed to "used_dltensor" and its deleter called when the View is released.

Writing: `Tensor` owns a buffer (numpy on the host; cupy or torch on a GPU) and exports it through
__dlpack__, bfloat16 included, which numpy cannot hold. Its deleter is a cffi extern "Python"
callback, which takes the GIL, so a consumer may free the tensor from any thread.
"""
import ctypes
import glob
import importlib
import os
import sys

import numpy as np

from colibri._native import ffi, invalid, lib
from colibri.dtypes import STORAGE, bf16_to_float32

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
_DEVICE_NAMES = {KDL_CPU: "cpu", KDL_CUDA: "cuda", KDL_CUDA_HOST: "cuda_host"}

# (DLDataTypeCode, bits) <-> dtype name. kDLInt=0, kDLUInt=1, kDLFloat=2, kDLBfloat=4.
_DL_TO_NAME = {
    (2, 32): "fp32", (2, 16): "fp16", (4, 16): "bf16", (2, 64): "fp64",
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64", (6, 8): "bool",
}
_NAME_TO_DL = {name: code for code, name in _DL_TO_NAME.items()}
_NUMPY_TO_NAME = {np.dtype(t): name for t, name in (
    (np.float32, "fp32"), (np.float16, "fp16"), (np.float64, "fp64"), (np.int8, "int8"), (np.int16, "int16"),
    (np.int32, "int32"), (np.int64, "int64"), (np.uint8, "uint8"), (np.uint16, "uint16"),
    (np.uint32, "uint32"), (np.uint64, "uint64"), (np.bool_, "bool"))}
_NUMPY_STORAGE = {name: dtype for dtype, name in _NUMPY_TO_NAME.items()}
_NUMPY_STORAGE["bf16"] = STORAGE["bf16"]

# Capsule names must outlive the capsules that point at them: module constants.
_DLTENSOR = b"dltensor"
_DLTENSOR_VERSIONED = b"dltensor_versioned"
_USED_DLTENSOR = b"used_dltensor"
_USED_DLTENSOR_VERSIONED = b"used_dltensor_versioned"

# Own prototypes rather than setting argtypes on the shared ctypes.pythonapi entries.
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_PyCapsule_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi))
_PyCapsule_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_CAPSULE_DESTRUCTOR = int(ffi.cast("uintptr_t", ffi.addressof(lib, "colibri_py_capsule_destructor")))

# The PyCapsule type has no public name; a throwaway capsule (no destructor) gives it.
_PyCapsuleType = type(_PyCapsule_New(1, _USED_DLTENSOR, None))


def is_capsule(obj) -> bool:
    return type(obj) is _PyCapsuleType


def device_name(device_type: int, device_id: int) -> str:
    name = _DEVICE_NAMES.get(device_type, f"device_type {device_type}")
    return f"{name}:{device_id}" if device_type == KDL_CUDA else name


class View:
    """Memory of one input array, described without copying. `kind` says which library it came
    from ('numpy', 'torch', 'cupy', or 'tensor' for a colibri.Tensor, a raw capsule or any other
    DLPack producer), so outputs can be made of the same kind."""

    __slots__ = ("name", "kind", "source", "ptr", "device_type", "device_id", "dtype", "shape",
                 "contiguous", "_release")

    def __init__(self, name, kind, source, ptr, device_type, device_id, dtype, shape, contiguous, release):
        self.name, self.kind, self.source = name, kind, source
        self.ptr, self.device_type, self.device_id = ptr, device_type, device_id
        self.dtype, self.shape, self.contiguous = dtype, shape, contiguous
        self._release = release

    @property
    def on_host(self) -> bool:
        return self.device_type in (KDL_CPU, KDL_CUDA_HOST)

    @property
    def device(self) -> str:
        return device_name(self.device_type, self.device_id)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * _NUMPY_STORAGE[self.dtype].itemsize

    def release(self) -> None:
        release, self._release = self._release, None
        self.source = None
        if release is not None:
            release()

    def host_array(self) -> np.ndarray:
        """A numpy array over this host memory (bf16 as uint16 bits); valid while the View is."""
        if self.kind == "numpy":
            return self.source
        storage = _NUMPY_STORAGE[self.dtype]
        if self.size == 0:
            return np.empty(self.shape, storage)
        buffer = ffi.buffer(ffi.cast("char *", self.ptr), self.size * storage.itemsize)
        return np.frombuffer(buffer, dtype=storage).reshape(self.shape)


def _is_instance_of(obj, module: str, cls: str) -> bool:
    # Only libraries the caller already imported can have made obj: never import them here.
    mod = sys.modules.get(module)
    return mod is not None and isinstance(obj, getattr(mod, cls))


def kind_of(obj) -> str:
    if isinstance(obj, np.ndarray):
        return "numpy"
    if _is_instance_of(obj, "torch", "Tensor"):
        return "torch"
    if _is_instance_of(obj, "cupy", "ndarray"):
        return "cupy"
    return "tensor"


def _c_contiguous(shape, strides) -> bool:
    expected = 1
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _consume_capsule(name, capsule, kind, source) -> View:
    if _PyCapsule_IsValid(capsule, _DLTENSOR):
        managed = ffi.cast("DLManagedTensor *", _PyCapsule_GetPointer(capsule, _DLTENSOR))
        _PyCapsule_SetName(capsule, _USED_DLTENSOR)
    elif _PyCapsule_IsValid(capsule, _DLTENSOR_VERSIONED):
        managed = ffi.cast("DLManagedTensorVersioned *", _PyCapsule_GetPointer(capsule, _DLTENSOR_VERSIONED))
        _PyCapsule_SetName(capsule, _USED_DLTENSOR_VERSIONED)
        if managed.version.major != 1:
            _call_deleter(managed)
            raise invalid(f"{name}: DLPack version {managed.version.major}.{managed.version.minor} is not supported (need 1.x)")
    else:
        label = _PyCapsule_GetName(capsule)
        raise invalid(f"{name}: a PyCapsule named {label!r} is not an unconsumed DLPack tensor "
                      "(expected 'dltensor'; a capsule can be consumed only once)")
    t = managed.dl_tensor
    dtype = _DL_TO_NAME.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    if dtype is None:
        _call_deleter(managed)
        raise invalid(f"{name}: unsupported DLPack dtype (code {t.dtype.code}, bits {t.dtype.bits}, "
                      f"lanes {t.dtype.lanes})")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    contiguous = t.strides == ffi.NULL or _c_contiguous(shape, [int(t.strides[i]) for i in range(t.ndim)])
    ptr = int(ffi.cast("uintptr_t", t.data)) + int(t.byte_offset)
    return View(name, kind, source, ptr, int(t.device.device_type), int(t.device.device_id), dtype, shape,
                contiguous, lambda: _call_deleter(managed))


def _call_deleter(managed) -> None:
    if managed.deleter != ffi.NULL:
        managed.deleter(managed)


def take(name: str, obj, stream=None) -> View:
    """Describes obj's memory (see the module docstring). `stream` is the CUDA stream (int) the
    caller will use it on, handed to the producer's __dlpack__ so it can order its work before it."""
    if isinstance(obj, np.ndarray):
        dtype = _NUMPY_TO_NAME.get(obj.dtype)
        if dtype is None:
            raise invalid(f"{name}: numpy dtype {obj.dtype} is not supported")
        return View(name, "numpy", obj, obj.__array_interface__["data"][0], KDL_CPU, 0, dtype, obj.shape,
                    obj.flags.c_contiguous, None)
    if is_capsule(obj):
        return _consume_capsule(name, obj, "tensor", None)
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        raise invalid(f"{name}: expected an array exporting DLPack (numpy, torch, cupy, colibri.Tensor) or a "
                      f"DLPack capsule, got {type(obj).__module__}.{type(obj).__qualname__}")
    device_type, _ = obj.__dlpack_device__()
    kind = kind_of(obj)
    try:
        capsule = obj.__dlpack__(stream=stream) if int(device_type) == KDL_CUDA else obj.__dlpack__()
    except (BufferError, TypeError, RuntimeError, ValueError) as exc:
        raise invalid(f"{name}: cannot export through DLPack: {exc}") from exc
    return _consume_capsule(name, capsule, kind, obj)


# ---------------------------------------------------------------------------------------------------
# Export


_live_exports = {}  # address of a DLManagedTensor we exported -> what must stay alive until its deleter


@ffi.def_extern()
def colibri_py_dlpack_deleter(managed):
    _live_exports.pop(int(ffi.cast("uintptr_t", managed)), None)


def import_cupy():
    """cupy, with NVRTC from the nvidia-cuda-nvrtc-cu12/cu11 wheel loaded first when it is installed.

    cupy 13 compiles its elementwise kernels at first use with NVRTC, which it dlopens by soname
    (libnvrtc.so.12) and does not look for in that wheel; a library already loaded under that soname
    is what dlopen returns, so a host with only the driver serves without a CUDA toolkit."""
    global _nvrtc_preloaded
    if not _nvrtc_preloaded:
        _nvrtc_preloaded = True
        try:
            folders = list(importlib.import_module("nvidia.cuda_nvrtc").__path__)
        except ImportError:
            folders = []
        for folder in folders:
            for path in sorted(glob.glob(os.path.join(folder, "lib", "libnvrtc.so.*"))):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    import cupy
    return cupy


_nvrtc_preloaded = False


def _cuda_library():
    """The library that allocates GPU memory for outputs that have no library of their own (raw
    capsules, colibri.Tensor): cupy; torch only when the caller already imported it and cupy is
    missing (the runtime never imports torch itself)."""
    try:
        return import_cupy()
    except ImportError:
        if "torch" in sys.modules:
            return sys.modules["torch"]
    raise invalid("CUDA tensors without a library of their own need cupy (pip install cupy-cuda12x) to allocate outputs")


class Tensor:
    """An array that owns its buffer and exports it through DLPack (bfloat16 included).

    `shape` (tuple), `dtype` ('fp32' | 'fp16' | 'bf16' | 'int32' | ...), `device` ('cpu' | 'cuda:N'),
    `numpy()` (a host copy; bf16 widened to float32). Accepted by np.from_dlpack (not bf16),
    torch.from_dlpack, cupy.from_dlpack and pb_utils.Tensor.from_dlpack."""

    __slots__ = ("_owner", "_ptr", "shape", "dtype", "_device_type", "_device_id", "stream")

    def __init__(self, owner, ptr: int, shape, dtype: str, device_type: int = KDL_CPU, device_id: int = 0,
                 stream=None):
        if dtype not in _NAME_TO_DL:
            raise invalid(f"Tensor: unknown dtype {dtype!r}")
        self._owner, self._ptr = owner, int(ptr)
        self.shape, self.dtype = tuple(int(d) for d in shape), dtype
        self._device_type, self._device_id = int(device_type), int(device_id)
        # On a GPU: the CUDA stream (int) the data is written on; consumers on other streams wait for it.
        self.stream = stream

    @classmethod
    def from_numpy(cls, array: np.ndarray, dtype: str = None) -> "Tensor":
        """Wraps a host array without copying; dtype='bf16' reads uint16 as bfloat16 bits."""
        array = np.ascontiguousarray(array)
        if dtype is None:
            dtype = _NUMPY_TO_NAME.get(array.dtype)
            if dtype is None:
                raise invalid(f"Tensor.from_numpy: numpy dtype {array.dtype} is not supported")
        elif array.dtype != _NUMPY_STORAGE.get(dtype):
            raise invalid(f"Tensor.from_numpy: dtype {dtype!r} needs a {_NUMPY_STORAGE.get(dtype)} array, "
                          f"got {array.dtype}")
        return cls(array, array.__array_interface__["data"][0], array.shape, dtype)

    @classmethod
    def empty(cls, shape, dtype: str, device_type: int = KDL_CPU, device_id: int = 0, library=None) -> "Tensor":
        """Allocates on the host (numpy) or a GPU (`library`: cupy or torch module; default: cupy
        if importable, else torch)."""
        storage = _NUMPY_STORAGE[dtype]
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * storage.itemsize)
        if device_type != KDL_CUDA:
            owner = np.empty(nbytes, np.uint8)
            return cls(owner, owner.__array_interface__["data"][0], shape, dtype, device_type, device_id)
        library = library or _cuda_library()
        if library.__name__ == "cupy":
            with library.cuda.Device(device_id):
                owner = library.empty(nbytes, library.uint8)
            return cls(owner, owner.data.ptr, shape, dtype, KDL_CUDA, device_id)
        owner = library.empty(nbytes, dtype=library.uint8, device=f"cuda:{device_id}")
        return cls(owner, owner.data_ptr(), shape, dtype, KDL_CUDA, device_id)

    @property
    def device(self) -> str:
        return device_name(self._device_type, self._device_id)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def data_ptr(self) -> int:
        return self._ptr

    def __repr__(self) -> str:
        return f"colibri.Tensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __dlpack_device__(self):
        return (self._device_type, self._device_id)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("colibri.Tensor exports its buffer without copying (copy=True refused)")
        if dl_device is not None and tuple(int(v) for v in dl_device) != self.__dlpack_device__():
            raise BufferError(f"colibri.Tensor lives on {self.device}, cannot export to {tuple(dl_device)}")
        if self.stream is not None and stream != -1 and stream != self.stream:
            _synchronize(self.stream, self._device_id)
        managed = ffi.new("DLManagedTensor *")
        ndim = len(self.shape)
        shape = ffi.new("int64_t[]", self.shape or [1])
        strides = ffi.new("int64_t[]", ndim or 1)
        step = 1
        for axis in range(ndim - 1, -1, -1):
            strides[axis] = step
            step *= self.shape[axis]
        t = managed.dl_tensor
        t.data = ffi.cast("void *", self._ptr)
        t.device.device_type, t.device.device_id = self._device_type, self._device_id
        t.ndim = ndim
        t.dtype.code, t.dtype.bits = _NAME_TO_DL[self.dtype]
        t.dtype.lanes = 1
        t.shape, t.strides, t.byte_offset = shape, strides, 0
        managed.deleter = lib.colibri_py_dlpack_deleter
        address = int(ffi.cast("uintptr_t", managed))
        _live_exports[address] = (managed, shape, strides, self)
        return _PyCapsule_New(address, _DLTENSOR, _CAPSULE_DESTRUCTOR)

    def numpy(self) -> np.ndarray:
        """A host copy (bf16 widened to float32 exactly)."""
        storage = _NUMPY_STORAGE[self.dtype]
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * storage.itemsize
        if self._device_type == KDL_CUDA:
            # From this tensor's own pointer (a row range of a larger buffer starts inside its owner).
            if self.stream is not None:
                _synchronize(self.stream, self._device_id)
            flat = np.empty(max(nbytes, 1), np.uint8)
            library = _cuda_library()
            if library.__name__ == "cupy":
                with library.cuda.Device(self._device_id):
                    library.cuda.runtime.memcpy(flat.ctypes.data, self._ptr, nbytes, 2)  # device to host
            else:
                source = library.from_dlpack(Tensor(self, self._ptr, (nbytes,), "uint8", KDL_CUDA, self._device_id))
                flat[:nbytes] = source.cpu().numpy()
            host = flat[:nbytes].view(storage).reshape(self.shape)
        else:
            buffer = ffi.buffer(ffi.cast("char *", self._ptr), nbytes)
            host = np.frombuffer(buffer, dtype=storage).reshape(self.shape).copy()
        return bf16_to_float32(host) if self.dtype == "bf16" else host


# ---------------------------------------------------------------------------------------------------
# Outputs of the input's kind


_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int32": "int32", "int64": "int64"}


def allocate(like: View, shape, dtype: str):
    """An uninitialised array of the same kind and device as `like`: (array, data pointer).
    numpy cannot hold bf16, so a numpy-kind bf16 output is a Tensor."""
    kind = like.kind
    if kind == "numpy" and dtype != "bf16":
        array = np.empty(shape, _NUMPY_STORAGE[dtype])
        return array, array.__array_interface__["data"][0]
    if kind == "torch":
        torch = sys.modules["torch"]  # the input is a torch tensor: torch is already imported
        device = torch.device("cuda", like.device_id) if like.device_type == KDL_CUDA else torch.device("cpu")
        array = torch.empty(shape, dtype=getattr(torch, _TORCH_DTYPES[dtype]), device=device)
        return array, array.data_ptr()
    if kind == "cupy" and dtype != "bf16":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(like.device_id):
            array = cupy.empty(shape, _NUMPY_STORAGE[dtype])
        return array, array.data.ptr
    library = None
    if like.device_type == KDL_CUDA and kind in ("torch", "cupy"):
        library = sys.modules[kind]
    tensor = Tensor.empty(shape, dtype, like.device_type, like.device_id, library)
    return tensor, tensor.data_ptr


def current_stream(kind: str, device_id: int) -> int:
    """The current CUDA stream (cudaStream_t as int) on device_id of the library an input of this
    kind came from; for inputs of no library (raw capsules), cupy's if importable, else torch's."""
    module = kind if kind in ("torch", "cupy") else _cuda_library().__name__
    if module == "torch":
        return int(sys.modules["torch"].cuda.current_stream(device_id).cuda_stream)
    cupy = import_cupy()
    with cupy.cuda.Device(device_id):
        return int(cupy.cuda.get_current_stream().ptr)


def _synchronize(stream: int, device_id: int) -> None:
    library = _cuda_library()
    if library.__name__ == "cupy":
        library.cuda.runtime.streamSynchronize(stream)
    else:
        library.cuda.ExternalStream(stream, device=library.device("cuda", device_id)).synchronize()


def stream_handle(stream) -> int:
    """A cudaStream_t as int from an int, a cupy Stream (.ptr) or a torch Stream (.cuda_stream)."""
    for attribute in ("ptr", "cuda_stream"):
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    return int(stream)


def device_library(view: View):
    """The array library a GPU View is worked on with: its own (torch, cupy), else cupy or torch."""
    return sys.modules[view.kind] if view.kind in ("torch", "cupy") else _cuda_library()


def device_array(view: View, dtype: str = None):
    """The View's GPU memory as an array of device_library(view), borrowed, for checks; with
    `dtype`, its bytes read as that dtype (of the same width)."""
    return device_library(view).from_dlpack(
        Tensor(view, view.ptr, view.shape, dtype or view.dtype, view.device_type, view.device_id))
