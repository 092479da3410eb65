"""Sends random hidden states to colibri_moe through system shared memory (inputs and output in
POSIX shm regions registered over gRPC) and checks the answers (see common.py). The regions are made
with the standard library: tritonclient's shared_memory utilities need pkg_resources, which
setuptools no longer ships."""
import os
from multiprocessing import shared_memory

import numpy as np
import tritonclient.grpc as grpcclient

from common import SharedMemoryInfer, main


class SystemSharedMemoryInfer(SharedMemoryInfer):
    def create(self, name, nbytes):
        return shared_memory.SharedMemory(name=name, create=True, size=nbytes)

    def write(self, handle, array):
        np.ndarray(array.shape, array.dtype, buffer=handle.buf)[...] = array

    def register(self, name, handle, nbytes):
        self.client.register_system_shared_memory(name, f"/{handle.name}", nbytes)

    def read(self, handle, datatype, storage, shape):
        return np.ndarray(shape, storage, buffer=handle.buf).copy()  # the region is freed next

    def unregister(self, name):
        self.client.unregister_system_shared_memory(name)

    def destroy(self, handle):
        handle.close()
        handle.unlink()


def make_infer(args, layer):
    client = grpcclient.InferenceServerClient(args.url)
    return SystemSharedMemoryInfer(client, layer.config.out_features, args.dtype, f"colibri_{os.getpid()}")


if __name__ == "__main__":
    main(__doc__, "127.0.0.1:8001", make_infer)
