"""Whether a set of layers fits where it is to run, checked before anything is loaded, so a model that
cannot fit is refused in one line rather than failing halfway (or swapping) after minutes of loading.

What must fit, per device:
- a GPU holds, per model instance, each layer's copy: experts (each expert padded to 256 bytes), shared
  expert, fp8 scales, router, biases, plus the workspace the CUDA backend sizes at load for its default
  8192 tokens (an estimate from the largest buffers it carves: activations, intermediates, routing).
  The host only streams the files through while they are copied: nothing of them must stay there.
- the CPU computes on the memory-mapped files in place: every file's bytes must stay in memory, or
  each forward reads from disk. Page cache is shared, so the files count once however many instances
  map them; each instance adds its workspace (256 tokens by default, small). Compared with the
  kernel's MemAvailable, which counts reclaimable page cache (the files' own, when cached) as free.

COLIBRI_MEMORY_AVAILABLE_BYTES, when set, replaces the measured free memory of every device: for
tests, which must see a refusal without a full machine.
"""
import os
from typing import Iterable

from colibri._native import ColibriError, STATUS_OUT_OF_MEMORY
from colibri.config import LayerConfig
from colibri.dtypes import DTYPES, ITEMSIZE

AVAILABLE_OVERRIDE = "COLIBRI_MEMORY_AVAILABLE_BYTES"
CUDA_WORKSPACE_TOKENS = 8192  # the CUDA backend's default (csrc/src/cuda/context.cu)
CPU_WORKSPACE_TOKENS = 256    # the CPU backend's default (csrc/src/cpu/moe_cpu.c)


def _shared_slices(config: LayerConfig) -> int:
    """The shared expert runs as slices of width F: how many (colibri.h)."""
    F, Fs = config.intermediate_size, config.shared_intermediate_size
    return -(-Fs // F) if Fs else 0


def gpu_bytes(config: LayerConfig, tokens: int = CUDA_WORKSPACE_TOKENS) -> int:
    """What one instance of the layer holds on its GPU: weights as copied, and the workspace."""
    E, H, F, k = config.num_experts, config.hidden_size, config.intermediate_size, config.top_k
    slices = _shared_slices(config)
    experts = E + slices
    expert_bytes = config.expert_numel * ITEMSIZE[config.weight_dtype]
    weights = experts * ((expert_bytes + 255) // 256 * 256)
    floats = (E * H if config.has_router else 0) + 2 * E + H  # router, its biases, the shared gate
    floats += experts * (config.expert_bias_width if config.expert_bias else 0)
    floats += experts * config.scales_numel if config.fp8 else 0
    compute = ITEMSIZE[DTYPES[config.weight_dtype].compute]  # inter and outputs, in the compute dtype
    positions = tokens * (k + slices)
    workspace = (tokens * H * compute + positions * (F + config.out_features) * compute  # inputs, inter, outputs
                 + tokens * E * 4 + positions * 24)                                   # logits, routing, permutes
    if config.fp8:
        workspace += tokens * H + positions * F  # the fp8 copies of the activations
    return weights + 4 * floats + workspace


def cpu_instance_bytes(config: LayerConfig, tokens: int = CPU_WORKSPACE_TOKENS) -> int:
    """What one CPU instance adds beside the mapped file: its workspace (fp32 inputs and intermediates)."""
    positions = tokens * (config.top_k + _shared_slices(config))
    return 4 * (tokens * (config.hidden_size + config.num_experts) + positions * (config.intermediate_size
                                                                                   + config.out_features + 4))


def needed(configs: Iterable[LayerConfig], file_sizes: Iterable[int], device: str, instances: int = 1) -> int:
    """Bytes `instances` instances of every layer need on one device ('cpu' or 'cuda')."""
    configs = list(configs)
    if device == "cpu":
        return sum(file_sizes) + instances * sum(map(cpu_instance_bytes, configs))
    return instances * sum(map(gpu_bytes, configs))


def host_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes (or the override)."""
    override = os.environ.get(AVAILABLE_OVERRIDE)
    if override:
        return int(override)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def gpu_available(free_bytes) -> int:
    """Free memory of a GPU in bytes: `free_bytes()` (from the caller's CUDA runtime), or the override."""
    override = os.environ.get(AVAILABLE_OVERRIDE)
    if override:
        return int(override)
    return int(free_bytes())


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check(need: int, available: int, where: str, what: str) -> None:
    """Raises ColibriError (COLIBRI_ERR_OUT_OF_MEMORY), in one line, when `need` bytes exceed `available`."""
    if need > available:
        raise ColibriError(f"{what} does not fit on {where}: needs {gib(need)} ({need} bytes), {gib(available)} "
                           f"({available} bytes) available", STATUS_OUT_OF_MEMORY)
