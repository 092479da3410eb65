"""Reading and writing safetensors files (our own code; the format is small):

    8 bytes   little-endian uint64 N, the header length
    N bytes   JSON: {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
                     "__metadata__": {"key": "string value", ...}}
    ...       raw little-endian data; offsets are relative to the end of the header

The reader validates the whole header before touching any data and returns numpy views into a
read-only memory map (BF16 as uint16 bits), so a large file is never loaded whole. Nothing is ever
unpickled."""
import json
import math
import mmap
import os
import pathlib
import struct

import numpy as np

# safetensors dtype -> numpy storage dtype (BF16 and FP8 as raw unsigned integers).
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
}
COLIBRI_TO_SAFETENSORS = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "fp8_e4m3": "F8_E4M3"}
SAFETENSORS_TO_COLIBRI = {v: k for k, v in COLIBRI_TO_SAFETENSORS.items()}

# torch.save writes a zip ("PK\x03\x04") or a bare pickle (protocol 2+ starts with 0x80).
PICKLE_MAGICS = (b"PK\x03\x04", b"\x80")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
PICKLE_REFUSAL = ("is a pickle / PyTorch file, which Colibri never loads (unpickling can run arbitrary code); "
                  "convert it to safetensors first")

MAX_HEADER_BYTES = 100 * 1024 * 1024
ALIGNMENT = 64  # the header is padded so the data (and the first tensor) start 64-byte aligned


class SafetensorsError(ValueError):
    """A malformed or truncated safetensors file; the message names the file."""


class TensorInfo:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _unique_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


class SafetensorsFile:
    """An open, validated safetensors file. `metadata` (dict of str), `tensors` (name -> TensorInfo),
    `get(name)` -> read-only numpy view. The mmap stays open while any view is alive."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        if self.path.suffix in PICKLE_SUFFIXES:
            raise self._error(PICKLE_REFUSAL)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise self._error(f"file of {size} bytes is too short for a safetensors header")
            head = f.read(8)
            (header_len,) = struct.unpack("<Q", head)
            header_fits = header_len <= MAX_HEADER_BYTES and 8 + header_len <= size
            if not header_fits and head.startswith(PICKLE_MAGICS):
                raise self._error(PICKLE_REFUSAL)
            if not header_fits:
                raise self._error(f"header length {header_len} does not fit a file of {size} bytes "
                                  "(truncated, or not a safetensors file)")
            header_bytes = f.read(header_len)
            self.data_start = 8 + header_len
            self.metadata, self.tensors = self._parse_header(header_bytes, size - self.data_start)
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def _error(self, message) -> SafetensorsError:
        return SafetensorsError(f"{self.path}: {message}")

    def _parse_header(self, header_bytes, data_size):
        try:
            header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._error(f"header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in metadata.items()):
            raise self._error("__metadata__ must map strings to strings")
        tensors = {}
        for name, entry in header.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise self._error(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if dtype not in DTYPES:
                raise self._error(f"tensor {name!r}: unknown dtype {dtype!r}")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise self._error(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
            if (not isinstance(offsets, list) or len(offsets) != 2
                    or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
                raise self._error(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
            info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
            expected = info.numel * np.dtype(DTYPES[dtype]).itemsize
            if info.end - info.begin != expected:
                raise self._error(f"tensor {name!r}: {info.end - info.begin} bytes for shape {shape} of {dtype} "
                                  f"(expected {expected})")
            if info.end > data_size:
                raise self._error(f"tensor {name!r}: data ends at byte {info.end} but the file holds only "
                                  f"{data_size} data bytes (truncated?)")
            tensors[name] = info
        end = 0
        for info in sorted(tensors.values(), key=lambda i: (i.begin, i.end)):
            if info.begin < end:
                raise self._error(f"tensor {info.name!r}: data overlaps the previous tensor")
            if info.begin > end:
                raise self._error(f"tensor {info.name!r}: a hole of {info.begin - end} bytes before its data")
            end = info.end
        if end != data_size:
            raise self._error(f"tensors cover {end} data bytes but the file holds {data_size} (holes or trailing bytes)")
        return metadata, tensors

    def keys(self):
        return self.tensors.keys()

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def get(self, name) -> np.ndarray:
        info = self.tensors[name]
        dtype = np.dtype(DTYPES[info.dtype])
        if info.numel == 0:
            return np.empty(info.shape, dtype)
        return np.frombuffer(self._mmap, dtype=dtype, count=info.numel,
                             offset=self.data_start + info.begin).reshape(info.shape)


class LazyTensor:
    """A tensor the writer streams in pieces, so it is never held whole in memory: `chunks` is a
    callable returning an iterable of arrays whose bytes, in order, are the tensor's."""

    def __init__(self, dtype: str, shape, chunks):
        self.dtype, self.shape, self.chunks = dtype, tuple(int(d) for d in shape), chunks

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(DTYPES[self.dtype]).itemsize


def _dtype_of(array: np.ndarray, name: str) -> str:
    for st_name, storage in DTYPES.items():
        if array.dtype == storage and st_name not in ("BF16", "F8_E4M3", "F8_E5M2"):
            return st_name
    raise ValueError(f"tensor {name!r}: numpy dtype {array.dtype} has no safetensors dtype")


def write(path, tensors, metadata=None) -> None:
    """Writes tensors (name -> numpy array, (safetensors dtype, array) for BF16 bits and fp8 codes, or LazyTensor)
    in the given order, with string metadata. Written to a temporary file, then renamed, so a failure
    never leaves a partial file under `path`."""
    entries, header, offset = [], {}, 0
    for name, value in tensors.items():
        if isinstance(value, LazyTensor):
            dtype, shape, nbytes, source = value.dtype, value.shape, value.nbytes, value.chunks
        else:
            dtype, array = value if isinstance(value, tuple) else (_dtype_of(np.asarray(value), name), value)
            array = np.ascontiguousarray(array)
            if array.dtype != np.dtype(DTYPES[dtype]):
                raise ValueError(f"tensor {name!r}: {dtype} is stored as {np.dtype(DTYPES[dtype])}, got {array.dtype}")
            dtype, shape, nbytes = dtype, array.shape, array.nbytes
            source = (lambda a=array: (a,))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        entries.append((name, nbytes, source))
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-(8 + len(header_bytes)) % ALIGNMENT)
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for name, nbytes, source in entries:
                written = 0
                for chunk in source():
                    data = memoryview(np.ascontiguousarray(chunk)).cast("B")
                    f.write(data)
                    written += data.nbytes
                if written != nbytes:
                    raise ValueError(f"tensor {name!r}: wrote {written} bytes, expected {nbytes}")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
