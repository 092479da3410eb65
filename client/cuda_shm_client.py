"""Sends random hidden states to colibri_moe through CUDA shared memory and checks the answers (see
common.py). Inputs are put on the GPU with cupy (bf16 as its uint16 bits: cupy has no bfloat16, and a
region only needs the bytes), copied device to device into CUDA IPC regions with tritonclient's
set_shared_memory_region_from_dlpack and registered over gRPC, so on a GPU instance the model takes
and gives GPU memory; the output region is read back to the host for the check. Needs a GPU, cupy
(cupy-cuda12x or cupy-cuda11x) and cuda-python (tritonclient's CUDA shared-memory utilities import it):
`pip install -c constraints.txt cupy-cuda12x cuda-python`. Without them it says which one is missing,
in one line, and exits 2."""
import os
import sys

import numpy as np

from common import SharedMemoryInfer, main

NO_GPU_EXIT = 2


def gpu_problem(device_id: int):
    """None when this host can run the client, else one line saying what is missing."""
    try:
        import cupy
    except ImportError:
        return ("needs cupy and a CUDA GPU: no cupy here (pip install -c constraints.txt cupy-cuda12x; "
                "cupy-cuda11x on CUDA 11 drivers)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a driver without devices: cupy's CUDARuntimeError
        return f"needs a CUDA GPU, and none is usable on this host ({type(exc).__name__}: {exc})"
    if not 0 <= device_id < count:
        return f"--device-id {device_id}, but this host has {count} GPU(s)"
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401
    except Exception as exc:  # RuntimeError when cuda-python is missing
        return f"tritonclient's CUDA shared-memory utilities do not load: {exc}"
    return None


class CudaSharedMemoryInfer(SharedMemoryInfer):
    def __init__(self, client, out_features, dtype, prefix, device_id):
        import cupy
        import tritonclient.utils.cuda_shared_memory as cudashm
        super().__init__(client, out_features, dtype, prefix)
        self.cupy, self.cudashm, self.device_id = cupy, cudashm, device_id

    def create(self, name, nbytes):
        return self.cudashm.create_shared_memory_region(name, nbytes, self.device_id)

    def write(self, handle, array):
        # array holds the bytes the server reads (bf16: uint16 bits); a contiguous cupy copy on the
        # region's GPU goes in through DLPack, device to device
        with self.cupy.cuda.Device(self.device_id):
            on_gpu = self.cupy.asarray(np.ascontiguousarray(array))
        self.cudashm.set_shared_memory_region_from_dlpack(handle, [on_gpu])

    def register(self, name, handle, nbytes):
        self.client.register_cuda_shared_memory(name, self.cudashm.get_raw_handle(handle), self.device_id, nbytes)

    def read(self, handle, datatype, storage, shape):
        return self.cudashm.get_contents_as_numpy(handle, storage, list(shape))

    def unregister(self, name):
        self.client.unregister_cuda_shared_memory(name)

    def destroy(self, handle):
        self.cudashm.destroy_shared_memory_region(handle)


def require_gpu(args):
    """Ends the run with one line, before any checkpoint is read, on a host that cannot run it."""
    problem = gpu_problem(args.device_id)
    if problem:
        print(f"cuda_shm_client: {problem}", file=sys.stderr)
        sys.exit(NO_GPU_EXIT)


def make_infer(args, layer):
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(args.url)
    return CudaSharedMemoryInfer(client, layer.config.out_features, args.dtype, f"colibri_cuda_{os.getpid()}",
                                 args.device_id)


def add_arguments(parser):
    parser.add_argument("--device-id", type=int, default=0, help="GPU holding the shared-memory regions")


if __name__ == "__main__":
    main(__doc__, "127.0.0.1:8001", make_infer, add_arguments, require_gpu)
