"""Reading and writing safetensors files (our own code; the format is small):

    8 bytes   little-endian uint64 N, the header length
    N bytes   JSON: {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
                     "__metadata__": {"key": "string value", ...}}
    ...       raw little-endian data; offsets are relative to the end of the header

The reader validates the whole header before touching any data and returns numpy views into a
read-only memory map (BF16 as uint16 bits), so a large file is never loaded whole. Nothing is ever
unpickled. Only a regular file is opened (a FIFO would block the reader forever), and the header's size
and nesting are bounded before it is parsed."""
import json
import math
import mmap
import os
import pathlib
import re
import stat
import struct

import numpy as np

from colibri.dtypes import DTYPES as DTYPES_BY_NAME

# safetensors dtype -> numpy storage dtype (BF16 and FP8 as raw unsigned integers).
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
}
COLIBRI_TO_SAFETENSORS = {name: d.safetensors for name, d in DTYPES_BY_NAME.items()}
SAFETENSORS_TO_COLIBRI = {v: k for k, v in COLIBRI_TO_SAFETENSORS.items()}

# torch.save writes a zip ("PK\x03\x04") or a bare pickle (protocol 2+ starts with 0x80).
PICKLE_MAGICS = (b"PK\x03\x04", b"\x80")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
PICKLE_REFUSAL = ("is a pickle / PyTorch file, which Colibri never loads (unpickling can run arbitrary code); "
                  "convert it to safetensors first")

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
# {"name": {"shape": [..]}}: an object of objects of lists. A deeper header is not one, and Python's JSON
# parser would recurse on it until RecursionError.
MAX_HEADER_DEPTH = 3
# A JSON string (its contents may hold brackets), matched without backtracking.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
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

    def __init__(self, path, max_header_bytes: int = MAX_HEADER_BYTES):
        self.path = pathlib.Path(path)
        if self.path.suffix in PICKLE_SUFFIXES:
            raise self._error(PICKLE_REFUSAL)
        with self._open_regular() as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise self._error(f"file of {size} bytes is too short for a safetensors header")
            head = f.read(8)
            (header_len,) = struct.unpack("<Q", head)
            header_fits = 8 + header_len <= size
            if not header_fits and head.startswith(PICKLE_MAGICS):
                raise self._error(PICKLE_REFUSAL)
            if not header_fits:
                raise self._error(f"header length {header_len} does not fit a file of {size} bytes "
                                  "(truncated, or not a safetensors file)")
            if header_len > max_header_bytes:
                raise self._error(f"header of {header_len} bytes is larger than the {max_header_bytes} this "
                                  "reader accepts")
            header_bytes = f.read(header_len)
            if len(header_bytes) != header_len:  # the file shrank under us
                raise self._error(f"header of {header_len} bytes, but only {len(header_bytes)} could be read")
            self.data_start = 8 + header_len
            self.metadata, self.tensors = self._parse_header(header_bytes, size - self.data_start)
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def _error(self, message) -> SafetensorsError:
        return SafetensorsError(f"{self.path}: {message}")

    def _open_regular(self):
        """The file opened for reading, or SafetensorsError if it is not a regular file. Opened without
        blocking, so a FIFO is refused instead of waiting for a writer."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._error(f"cannot be opened ({exc.strerror or exc})") from None
        problem = not_regular(os.fstat(fd).st_mode)
        if problem:
            os.close(fd)
            raise self._error(problem)
        return os.fdopen(fd, "rb")

    def _parse_header(self, header_bytes, data_size):
        depth = _nesting_depth(header_bytes)
        if depth > MAX_HEADER_DEPTH:
            raise self._error(f"header nests {depth} levels deep; a safetensors header nests at most "
                              f"{MAX_HEADER_DEPTH} (an object of tensor entries holding lists)")
        try:
            header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise self._error(f"header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in metadata.items()):
            raise self._error("__metadata__ must map strings to strings")
        for text in (*header, *metadata, *metadata.values()):
            if not _is_text(text):
                shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
                raise self._error(f"header string {shown} holds a lone surrogate escape (\\ud800-\\udfff), "
                                  "which is not text")
        tensors = {}
        for name, entry in header.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise self._error(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise self._error(f"tensor {name!r}: unknown dtype {str(dtype)[:40]!r}")
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


def not_regular(mode: int):
    """Why a file of this st_mode cannot be a checkpoint ("is a FIFO (named pipe), not a regular file"),
    or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "a special file")
    return f"is {kind}, not a regular file"


def _nesting_depth(header_bytes: bytes) -> int:
    """How deep the JSON's objects and lists nest, counted outside its strings without parsing it."""
    codes = np.frombuffer(_JSON_STRING.sub(b'""', header_bytes), np.uint8)
    step = (np.isin(codes, (ord("{"), ord("["))).astype(np.int64)
            - np.isin(codes, (ord("}"), ord("]"))).astype(np.int64))
    return int(np.cumsum(step).max(initial=0))


def _is_text(value: str) -> bool:
    """False for a string holding a lone surrogate, which JSON's \\u escapes can make and UTF-8 cannot hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
