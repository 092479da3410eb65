"""Element types Colibri knows, by one name each ('fp32', 'fp16', 'bf16'), and numpy-only helpers for
bfloat16, which numpy lacks: bf16 values travel in numpy as their raw uint16 bit patterns."""
import numpy as np

FLOAT_DTYPES = ("fp32", "fp16", "bf16")

# Storage numpy dtype of each float dtype (bf16: its bits).
STORAGE = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(np.uint16)}

ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


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
    """Values stored as `dtype` (bf16: uint16 bits) widened exactly to float32."""
    if dtype == "bf16":
        return bf16_to_float32(values)
    return np.asarray(values, dtype=STORAGE[dtype]).astype(np.float32)


def to_float64(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values stored as `dtype` widened exactly to float64."""
    return to_float32(values, dtype).astype(np.float64)


def from_float(values, dtype: str) -> np.ndarray:
    """Rounds float values to `dtype` storage (bf16: uint16 bits)."""
    if dtype == "bf16":
        return float32_to_bf16(np.asarray(values, dtype=np.float32))
    return np.asarray(values).astype(STORAGE[dtype])


def storage_dtype_name(array: np.ndarray):
    """The Colibri dtype a numpy float array holds, or None (uint16 is ambiguous: not guessed)."""
    for name in ("fp32", "fp16"):
        if array.dtype == STORAGE[name]:
            return name
    return None
