"""Colibri: a minimal, fast Mixture-of-Experts layer engine (C99/CUDA) with a Python binding.

    layer = colibri.MoELayer.from_file("weights.colibri.safetensors", device="cpu")
    out = layer.forward(hidden_states)                  # numpy, torch, cupy, DLPack capsules
"""
from colibri._native import (STATUS_CUDA, STATUS_INTERNAL, STATUS_INVALID_ARGUMENT, STATUS_OK,
                             STATUS_OUT_OF_MEMORY, STATUS_ROUTING, STATUS_UNSUPPORTED, ColibriError, ffi, lib)
from colibri.dlpack import Tensor
from colibri.layer import (LayerConfig, MoELayer, nonfinite_rows, nonfinite_rows_by_part,
                           nonfinite_rows_by_part_later)

__version__ = ffi.string(lib.colibri_version()).decode()


def cuda_built() -> bool:
    """Whether the loaded libcolibri has the CUDA backend."""
    return bool(lib.colibri_cuda_built())


def cuda_device_count() -> int:
    return int(lib.colibri_cuda_device_count())


__all__ = ["ColibriError", "LayerConfig", "MoELayer", "Tensor", "cuda_built", "cuda_device_count", "nonfinite_rows",
           "nonfinite_rows_by_part", "nonfinite_rows_by_part_later",
           "STATUS_OK", "STATUS_INVALID_ARGUMENT", "STATUS_OUT_OF_MEMORY", "STATUS_UNSUPPORTED", "STATUS_CUDA",
           "STATUS_ROUTING", "STATUS_INTERNAL"]
