"""fp8 e4m3 weights and their fp32 scale grids, as colibri.h defines them: every matrix [N, K] of an
expert (and of the shared expert) comes with a grid [ceil(N / bn), ceil(K / bk)], row-major, where a
block of 0 spans the whole dimension ((128, 128): DeepSeek-V3's blocks, (1, 0): one scale per output
channel, (0, 0): one per tensor), and stands for the weights fp8(w)[n, k] * grid[n // bn, k // bk]. An
expert's grids lie back to back in the order of its matrices: gate, up, down (swiglu) or w (linear).

Also the block quantisation `pack --dtype fp8` and the fp8 demo use: scale = amax / 448 per block (an
all-zero block gets scale 1), weights rounded to the nearest e4m3, ties to even."""
import numpy as np

from colibri._native import invalid
from colibri.dtypes import FP8_E4M3_MAX, float_to_fp8_e4m3, fp8_e4m3_to_float32

BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size: what pack --dtype fp8 and the demo write


def blocks(n: int, block: int) -> int:
    """Blocks of `block` (0: one block of all) along a dimension of n elements."""
    return -(-n // block) if block > 0 else 1


def grid_shape(shape, block_n: int, block_k: int):
    """The scale grid's shape for a matrix of `shape` [N, K]."""
    return blocks(shape[0], block_n), blocks(shape[1], block_k)


def matrix_shapes(expert_kind: str, hidden_size: int, intermediate_size: int):
    """The [N, K] shapes of an expert's matrices, in packing order: swiglu gate, up, down; linear w."""
    H, F = hidden_size, intermediate_size
    return [(F, H), (F, H), (H, F)] if expert_kind == "swiglu" else [(F, H)]


def scales_numel(expert_kind: str, hidden_size: int, intermediate_size: int, block_n: int, block_k: int) -> int:
    """Scales of one expert, all its grids (colibri_scales_numel)."""
    return sum(int(np.prod(grid_shape(s, block_n, block_k)))
               for s in matrix_shapes(expert_kind, hidden_size, intermediate_size))


def expand(grid, shape, block_n: int, block_k: int) -> np.ndarray:
    """The grid [ceil(N / bn), ceil(K / bk)] spread to one scale per weight, [N, K]."""
    N, K = shape
    grid = np.asarray(grid).reshape(grid_shape(shape, block_n, block_k))
    return np.repeat(np.repeat(grid, block_n or N, axis=0)[:N], block_k or K, axis=1)[:, :K]


def dequantize(codes, grid, block_n: int, block_k: int) -> np.ndarray:
    """fp8 codes [N, K] (uint8) times their scales, in float64: exact (an e4m3 value has 4 significant
    bits, an fp32 scale 24)."""
    codes = np.asarray(codes)
    return fp8_e4m3_to_float32(codes).astype(np.float64) * expand(np.asarray(grid, np.float64), codes.shape,
                                                                  block_n, block_k)


def quantize(values, block_n: int = BLOCK[0], block_k: int = BLOCK[1], name: str = "weights"):
    """Float values [N, K] -> (codes uint8 [N, K], grid float32): each block's scale is its largest
    magnitude over 448 (rounded to fp32; an all-zero block gets 1) and its values are divided by it and
    rounded to the nearest e4m3 (ties to even, saturating). Raises ColibriError on a NaN or an Inf."""
    values = np.asarray(values, np.float64)
    if values.ndim != 2:
        raise invalid(f"{name}: expected a matrix [N, K], got shape {list(values.shape)}")
    if not np.isfinite(values).all():
        raise invalid(f"{name}: not finite at index {tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])}")
    N, K = values.shape
    rows, cols = grid_shape(values.shape, block_n, block_k)
    bn, bk = block_n or N, block_k or K
    padded = np.zeros((rows * bn, cols * bk))
    padded[:N, :K] = np.abs(values)
    amax = padded.reshape(rows, bn, cols, bk).max(axis=(1, 3))
    grid = (amax / FP8_E4M3_MAX).astype(np.float32)
    grid[amax == 0] = 1.0
    codes = float_to_fp8_e4m3(values / expand(grid.astype(np.float64), values.shape, block_n, block_k))
    return codes, grid


def quantize_matrices(matrices, block_n: int = BLOCK[0], block_k: int = BLOCK[1], name: str = "weights"):
    """quantize() of each matrix of an expert: (its codes flat and back to back, its grids likewise)."""
    pairs = [quantize(m, block_n, block_k, name) for m in matrices]
    return (np.concatenate([codes.reshape(-1) for codes, _ in pairs]),
            np.concatenate([grid.reshape(-1) for _, grid in pairs]))


def dequantize_matrices(codes, scales, shapes, block_n: int, block_k: int):
    """An expert's matrices in float64 from its codes and grids (flat, back to back) and their shapes."""
    codes, scales = np.asarray(codes).reshape(-1), np.asarray(scales, np.float64).reshape(-1)
    matrices, at, grid_at = [], 0, 0
    for shape in shapes:
        size, grid_size = shape[0] * shape[1], int(np.prod(grid_shape(shape, block_n, block_k)))
        matrices.append(dequantize(codes[at:at + size].reshape(shape), scales[grid_at:grid_at + grid_size],
                                   block_n, block_k))
        at, grid_at = at + size, grid_at + grid_size
    if at != codes.size or grid_at != scales.size:
        raise invalid(f"fp8 expert: {codes.size} weights and {scales.size} scales, expected {at} and {grid_at} "
                      f"for matrices {[list(s) for s in shapes]} with scale block ({block_n}, {block_k})")
    return matrices
