"""Sends random hidden states to colibri_moe through CUDA shared memory and checks the answers (see
common.py). Inputs are put on the GPU with torch (or cupy), copied into CUDA IPC regions with
tritonclient's set_shared_memory_region_from_dlpack, registered over gRPC, and the output is read
back through DLPack, so on a GPU instance the model takes and gives GPU memory. Needs a GPU, torch
or cupy, and cuda-python (tritonclient's CUDA shared-memory utilities import it)."""
import os

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.cuda_shared_memory as cudashm

from common import SharedMemoryInfer, main


def device_library():
    """(to_device(numpy) -> GPU array, to_host(DLPack GPU array, storage) -> numpy of its bytes) from
    torch, else cupy (which has no bfloat16)."""
    try:
        import torch
        return (lambda a: torch.from_numpy(a).cuda(),
                lambda t, storage: torch.from_dlpack(t).cpu().view(torch.uint8).numpy().view(storage))
    except ImportError:
        import cupy
        return cupy.asarray, lambda t, storage: cupy.asnumpy(cupy.from_dlpack(t)).view(storage)


class CudaSharedMemoryInfer(SharedMemoryInfer):
    def __init__(self, client, out_features, dtype, prefix, device_id):
        super().__init__(client, out_features, dtype, prefix)
        self.device_id = device_id
        self.to_device, self.to_host = device_library()

    def create(self, name, nbytes):
        return cudashm.create_shared_memory_region(name, nbytes, self.device_id)

    def write(self, handle, array):
        cudashm.set_shared_memory_region_from_dlpack(handle, [self.to_device(np.ascontiguousarray(array))])

    def register(self, name, handle, nbytes):
        self.client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), self.device_id, nbytes)

    def read(self, handle, datatype, storage, shape):
        return self.to_host(cudashm.as_shared_memory_tensor(handle, datatype, list(shape)), storage)

    def unregister(self, name):
        self.client.unregister_cuda_shared_memory(name)

    def destroy(self, handle):
        cudashm.destroy_shared_memory_region(handle)


def make_infer(args, layer):
    client = grpcclient.InferenceServerClient(args.url)
    return CudaSharedMemoryInfer(client, layer.config.out_features, args.dtype, f"colibri_cuda_{os.getpid()}",
                                 args.device_id)


def add_arguments(parser):
    parser.add_argument("--device-id", type=int, default=0, help="GPU holding the shared-memory regions")


if __name__ == "__main__":
    main(__doc__, "127.0.0.1:8001", make_infer, add_arguments)
