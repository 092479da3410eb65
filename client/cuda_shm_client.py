"""Sends random hidden states to colibri_moe through CUDA shared memory and checks the answers (see
common.py). Inputs are put on the GPU with cupy (bf16 as its uint16 bits: cupy has no bfloat16, and a
region only needs the bytes) and copied device to device into CUDA IPC regions of their own
(colibri.serving.cuda_shm), registered over gRPC, so on a GPU instance the model takes and gives GPU memory;
the output region is copied out on the GPU and brought to the host for the check. Needs an NVIDIA GPU
and cupy (`pip install -c constraints.txt cupy-cuda12x`; cupy-cuda11x on CUDA 11 drivers). Without
them it says which one is missing, the driver first, in one line, and exits 2."""
import os
import sys

import numpy as np

from colibri.serving.cuda_shm import CudaShmRegion, host_problem
from common import SharedMemoryInfer, main

NO_GPU_EXIT = 2


class CudaSharedMemoryInfer(SharedMemoryInfer):
    def __init__(self, client, out_features, dtype, prefix, device_id):
        import cupy
        super().__init__(client, out_features, dtype, prefix)
        self.cupy, self.device_id = cupy, device_id

    def create(self, name, nbytes):
        return CudaShmRegion(name, nbytes, self.device_id)

    def write(self, region, array):
        # array holds the bytes the server reads (bf16: uint16 bits): on the region's GPU first, as a
        # producer on the GPU would hold it, then one copy into the region
        with self.cupy.cuda.Device(self.device_id):
            region.write(self.cupy.asarray(np.ascontiguousarray(array)))

    def register(self, name, region, nbytes):
        region.register(self.client)

    def read(self, region, datatype, storage, shape):
        return region.read(storage, shape).get()

    def unregister(self, name):
        self.client.unregister_cuda_shared_memory(name)

    def destroy(self, region):
        region.free()


def require_gpu(args):
    """Ends the run with one line, before any checkpoint is read, on a host that cannot run it."""
    problem = host_problem(args.device_id)
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
