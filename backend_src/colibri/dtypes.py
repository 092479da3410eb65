"""Element types Colibri knows, by one name each ('fp32', 'fp16', 'bf16'; weights also 'fp8_e4m3'), and
numpy-only helpers for the ones numpy lacks: bfloat16 values travel in numpy as their raw uint16 bit
patterns, fp8 e4m3 values as their uint8 codes."""
from typing import NamedTuple, Optional

import numpy as np


class DType(NamedTuple):
    """One element type under each of its names; the one table every other mapping derives from."""
    name: str                # Colibri's (configs, messages, the CLI)
    safetensors: str         # in a checkpoint's header
    c_enum: str              # colibri_dtype_t member in colibri.h
    storage: np.dtype        # numpy's dtype for it (bf16: its bits; fp8: its codes)
    triton: Optional[str]    # Triton's config.pbtxt data_type, for activations; None: weights only
    compute: str             # what experts of these weights compute and store in (csrc/src/dtype.h)


DTYPES = {d.name: d for d in (
    DType("fp32", "F32", "COLIBRI_DTYPE_F32", np.dtype(np.float32), "TYPE_FP32", "fp32"),
    DType("fp16", "F16", "COLIBRI_DTYPE_F16", np.dtype(np.float16), "TYPE_FP16", "fp16"),
    DType("bf16", "BF16", "COLIBRI_DTYPE_BF16", np.dtype(np.uint16), "TYPE_BF16", "bf16"),
    # with scales: colibri.fp8; e4m3 values are exact in bf16
    DType("fp8_e4m3", "F8_E4M3", "COLIBRI_DTYPE_F8E4M3", np.dtype(np.uint8), None, "bf16"),
)}
FLOAT_DTYPES = tuple(name for name, d in DTYPES.items() if d.triton)   # activations, and weights
WEIGHT_DTYPES = tuple(DTYPES)
STORAGE = {name: d.storage for name, d in DTYPES.items()}
ITEMSIZE = {name: d.storage.itemsize for name, d in DTYPES.items()}

# fp8 e4m3 as OCP's "e4m3fn" (torch.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
# infinities, S.1111.111 is NaN, the largest finite value is 448.
FP8_E4M3_MAX = 448.0


def _fp8_e4m3_values() -> np.ndarray:
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 7
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9, (8 + mantissa) * np.exp2(exponent - 10.0))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


FP8_E4M3_VALUES = _fp8_e4m3_values()  # code -> its value, exact in float32


def fp8_e4m3_to_float32(codes) -> np.ndarray:
    """Widens fp8 e4m3 codes (uint8) to float32 exactly; 0x7f and 0xff are NaN."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"fp8 e4m3 values are stored as uint8 codes, got {codes.dtype}")
    return FP8_E4M3_VALUES[codes]


def float_to_fp8_e4m3(values) -> np.ndarray:
    """Rounds float values (float64 and narrower, each rounded once) to the nearest fp8 e4m3, ties to
    even, saturating at +-448 (Inf too), as torch's x.clamp(-448, 448).to(torch.float8_e4m3fn) does;
    NaN stays NaN (0x7f, 0xff when its sign is set). Returns the uint8 codes."""
    x = np.asarray(values, np.float64)
    magnitude = np.minimum(np.abs(x), FP8_E4M3_MAX)   # NaN stays NaN
    # The binade of each value, 2^-6 (the smallest normal) at least: below it the subnormals share its
    # spacing. In binade [2^e, 2^(e+1)) the values are n * 2^(e-3), n in [8, 16).
    _, exponent = np.frexp(np.maximum(magnitude, 2.0 ** -10))
    biased = np.maximum(exponent - 1, -6) + 7
    with np.errstate(invalid="ignore"):
        steps = np.rint(np.ldexp(magnitude, 10 - biased))  # n; rint rounds ties to even
        # code = biased exponent * 8 + mantissa = (biased - 1) * 8 + n; n = 16 carries into the next binade,
        # and below 2^-6 (biased 1) the code is n itself: the subnormals, then 2^-6.
        codes = np.where(np.isnan(magnitude), 0x7F, (biased - 1) * 8 + np.nan_to_num(steps)).astype(np.uint8)
    return codes | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))


def float32_to_bf16(values) -> np.ndarray:
    """Rounds to the nearest bfloat16 (ties to even), returning the bits as uint16. NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)
    # Rounding a NaN's payload could carry into the exponent and make it Inf; force a quiet NaN.
    nan = np.isnan(bits.view(np.float32))
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def bf16_to_float32(bits) -> np.ndarray:
    """Widens bfloat16 bits (uint16) to float32 exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 values are stored as uint16 bits, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values stored as `dtype` (bf16: uint16 bits; fp8: codes, without any scale) widened exactly to float32."""
    if dtype == "bf16":
        return bf16_to_float32(values)
    if dtype == "fp8_e4m3":
        return fp8_e4m3_to_float32(values)
    return np.asarray(values, dtype=STORAGE[dtype]).astype(np.float32)


def to_float64(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values stored as `dtype` widened exactly to float64."""
    return to_float32(values, dtype).astype(np.float64)


def from_float(values, dtype: str) -> np.ndarray:
    """Rounds float values to `dtype` storage (bf16: uint16 bits; fp8: codes, saturating, without any
    scale: colibri.fp8.quantize finds the scales)."""
    if dtype == "bf16":
        return float32_to_bf16(np.asarray(values, dtype=np.float32))
    if dtype == "fp8_e4m3":
        return float_to_fp8_e4m3(values)
    return np.asarray(values).astype(STORAGE[dtype])


def storage_dtype_name(array: np.ndarray):
    """The Colibri dtype a numpy float array holds, or None (uint16 is ambiguous: not guessed)."""
    for name in ("fp32", "fp16"):
        if array.dtype == STORAGE[name]:
            return name
    return None
