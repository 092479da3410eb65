"""CUDA shared memory for Triton clients, with cupy alone (client/cuda_shm_client.py and loadtest's
CudaShmUser): a region is GPU memory of its own that the server opens through a CUDA IPC handle, so
inputs and outputs move device to device and only the request header crosses the wire.

    problem = host_problem(device_id)         # None, or one line: no driver, no cupy, no such GPU
    region = CudaShmRegion("x", nbytes, device_id)
    region.write(cupy_array); region.register(client)      # a tritonclient gRPC or HTTP client
    ... client.infer(...) naming the region ...
    out = region.read(dtype, shape)           # a cupy array
    region.unregister(client); region.free()

bf16 travels as its uint16 bits (cupy has no bfloat16): a region only holds bytes. cupy is imported
when a region is made, so this module imports on hosts without it.
"""
import base64
import re
import subprocess
from pathlib import Path

NVIDIA_DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
# The oldest NVIDIA driver each cupy build runs on (CUDA 12: R525, CUDA 11: R450), newest first.
CUPY_BY_DRIVER = (("cupy-cuda12x", 525), ("cupy-cuda11x", 450))


def nvidia_driver(version_file: Path = NVIDIA_DRIVER_VERSION_FILE) -> int | None:
    """The NVIDIA driver's major version (535), 0 when a driver is there but its version unreadable,
    None when this host has none. The kernel module's version file first (no process to start), then
    nvidia-smi (WSL has no such file)."""
    try:
        text = version_file.read_text()
    except OSError:
        pass
    else:  # "NVRM version: NVIDIA UNIX [Open ]Kernel Module[ for x86_64]  535.104.05  ..."
        found = re.search(r"Kernel Module\b.*?\s(\d+)\.\d+", text)
        return int(found.group(1)) if found else 0
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    first = smi.stdout.strip().split(".")[0]
    return int(first) if smi.returncode == 0 and first.isdigit() else None


def cupy_advice(driver: int) -> str:
    """What to install for cupy, given the driver's major version (0: unknown)."""
    if not driver:
        return ("pip install -c constraints.txt cupy-cuda12x (NVIDIA driver R525+; cupy-cuda11x for "
                "R450+)")
    for package, oldest in CUPY_BY_DRIVER:
        if driver >= oldest:
            return f"pip install -c constraints.txt {package} (for this host's NVIDIA driver R{driver})"
    return f"this host's NVIDIA driver R{driver} is older than any cupy build takes (R450): update the driver"


def host_problem(device_id: int = 0) -> str | None:
    """None when this host can make regions on GPU device_id, else one line saying what is missing,
    starting "needs": the driver is asked first (without importing cupy), then cupy, then the GPU."""
    driver = nvidia_driver()
    if driver is None:
        return "needs a CUDA GPU, and this host has no NVIDIA driver"
    try:
        import cupy
    except ImportError:
        return f"needs cupy: {cupy_advice(driver)}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # a driver without devices, or too old for this cupy: CUDARuntimeError
        return f"needs a CUDA GPU, and none is usable on this host ({type(exc).__name__}: {exc})"
    if not 0 <= device_id < count:
        return f"needs GPU {device_id}, and this host has {count} GPU(s)"
    return None


class CudaShmRegion:
    """One CUDA shared-memory region: `nbytes` of GPU memory on device_id and the IPC handle that names
    it, under the name the server knows it by once registered.

    Parameters
    ----------
    name : str
        The region's name on the server (unique among the clients of one server).
    nbytes : int
        Its size in bytes.
    device_id : int
        The GPU holding it, as this process numbers them; the server is told the same number.
    """

    def __init__(self, name: str, nbytes: int, device_id: int = 0):
        import cupy
        self.name, self.nbytes, self.device_id = name, int(nbytes), device_id
        self._cupy = cupy
        with cupy.cuda.Device(device_id):
            # A cudaMalloc of its own, not cupy's memory pool: an IPC handle names a whole allocation,
            # and the server would open a pool chunk's base, not this region's bytes.
            self._memory = cupy.cuda.Memory(self.nbytes)
            handle = cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)  # the 64-byte cudaIpcMemHandle_t
        # What both tritonclient clients take as raw_handle: base64 of the handle's bytes (gRPC decodes
        # it into the request's bytes field, HTTP sends it as the JSON {"b64": ...} string).
        self.raw_handle = base64.b64encode(bytes(handle))

    def register(self, client) -> None:
        """Registers the region with the server of a tritonclient gRPC or HTTP client."""
        client.register_cuda_shared_memory(self.name, self.raw_handle, self.device_id, self.nbytes)

    def unregister(self, client) -> None:
        client.unregister_cuda_shared_memory(self.name)

    def write(self, array) -> None:
        """Copies a C-contiguous cupy array into the region's first bytes, device to device, and waits
        for the copy: the server reads the region from another process."""
        if not array.flags.c_contiguous:
            raise ValueError("CudaShmRegion.write takes a C-contiguous array (one copy into the region)")
        if array.nbytes > self.nbytes:
            raise ValueError(f"{array.nbytes} bytes do not fit region {self.name} of {self.nbytes}")
        self._copy(self._pointer(), array.data, array.nbytes)

    def read(self, dtype, shape):
        """A new cupy array of dtype and shape copied from the region's first bytes, device to device."""
        with self._cupy.cuda.Device(self.device_id):
            out = self._cupy.empty(shape, dtype)
        if out.nbytes > self.nbytes:
            raise ValueError(f"{out.nbytes} bytes are more than region {self.name} holds ({self.nbytes})")
        self._copy(out.data, self._pointer(), out.nbytes)
        return out

    def free(self) -> None:
        """Frees the GPU memory; unregister first, or the server keeps a handle to freed memory."""
        with self._cupy.cuda.Device(self.device_id):
            self._memory = None  # cupy's Memory is cudaFree'd as its last reference goes, on its device

    def _pointer(self):
        if self._memory is None:
            raise ValueError(f"region {self.name} has been freed")
        return self._cupy.cuda.MemoryPointer(self._memory, 0)

    def _copy(self, destination, source, nbytes: int) -> None:
        # On the current stream, after whatever wrote the source there; waited for, as the other side
        # (the server, or the caller's next use) is not ordered on this stream.
        with self._cupy.cuda.Device(self.device_id):
            stream = self._cupy.cuda.get_current_stream()
            destination.copy_from_device_async(source, nbytes, stream)
            stream.synchronize()
