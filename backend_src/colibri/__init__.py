"""Colibri: a minimal, fast Mixture-of-Experts layer engine (C99/CUDA) with a Python binding.

One MoE layer (router, top-k routing, expert FFNs, weighted combine) computed by the C library on
the CPU or a CUDA GPU, called with numpy arrays, cupy or torch tensors (anything with DLPack)
without copies; the output comes back as the same kind of array.

    import numpy as np, colibri                  # python -m colibri demo --out demo.colibri.safetensors
    layer = colibri.MoELayer.from_file("demo.colibri.safetensors", device="cpu")   # or "cuda"
    x = np.ones((4, layer.config.hidden_size), np.float32)                          # [T, H] tokens
    y = layer.forward(x)                                           # [T, H], routed by the router
    ids, weights = layer.route(x)                                  # int32 [T, k], float32 [T, k]
    y = layer.forward(x, topk_ids=ids, topk_weights=weights)       # routing given explicitly

Exported:
    MoELayer        one layer: from_file(path, device), forward(), route(), expert_counts(), config
    LayerConfig     its shape and semantics: num_experts, top_k, hidden_size, intermediate_size,
                    expert_kind, weight_dtype, routing, renormalize, routed_scaling_factor, and for
                    fp8_e4m3 weights their scale blocks scale_block_n, scale_block_k (colibri.fp8)
    Tensor          the array forward returns where numpy cannot hold it (bf16, capsules)
    ColibriError    every failure, with .status (one of the STATUS_* codes) and a message naming
                    the input or file and what is wrong
    cuda_built(), cuda_device_count()       whether the loaded library has CUDA, and GPUs seen
    nonfinite_rows(), nonfinite_rows_by_part(), nonfinite_rows_by_part_later()
                    NaN/Inf row checks for servers that join requests (model.py uses them)
    __version__     the C library's version

Packed checkpoints (*.colibri.safetensors) are read and written by colibri.checkpoint; the float64
reference is colibri.reference; `python -m colibri --help` lists the command-line tools (pack,
demo, info, serve, probe, watch, bench, generate). Beside this engine: colibri.pack converts Hugging
Face checkpoints (docs/packing.md), colibri.serving serves with Triton, colibri.attention runs a whole
model's attention with transformers around them (torch: an extra); the engine imports none of them.
"""
from colibri._native import (STATUS_CUDA, STATUS_INTERNAL, STATUS_INVALID_ARGUMENT, STATUS_OK,
                             STATUS_OUT_OF_MEMORY, STATUS_ROUTING, STATUS_UNSUPPORTED, ColibriError, ffi, lib)
from colibri.config import LayerConfig
from colibri.dlpack import Tensor
from colibri.layer import MoELayer
from colibri.nonfinite import nonfinite_rows, nonfinite_rows_by_part, nonfinite_rows_by_part_later

__version__ = ffi.string(lib.colibri_version()).decode()


def cuda_built() -> bool:
    """Whether the loaded libcolibri has the CUDA backend."""
    return bool(lib.colibri_cuda_built())


def cuda_device_count() -> int:
    """CUDA devices the loaded libcolibri sees (0 without the CUDA backend or without a GPU)."""
    return int(lib.colibri_cuda_device_count())


__all__ = ["ColibriError", "LayerConfig", "MoELayer", "Tensor", "cuda_built", "cuda_device_count", "nonfinite_rows",
           "nonfinite_rows_by_part", "nonfinite_rows_by_part_later",
           "STATUS_OK", "STATUS_INVALID_ARGUMENT", "STATUS_OUT_OF_MEMORY", "STATUS_UNSUPPORTED", "STATUS_CUDA",
           "STATUS_ROUTING", "STATUS_INTERNAL"]
