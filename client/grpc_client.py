"""Sends random hidden states to colibri_moe over gRPC and checks the answers (see common.py)."""
import tritonclient.grpc as grpcclient

from common import MODEL, main, wire_array


def make_infer(args, layer):
    client = grpcclient.InferenceServerClient(args.url)

    def infer(inputs):
        tensors = []
        for name, array, datatype in inputs:
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(wire_array(array, datatype))
            tensors.append(tensor)
        result = client.infer(MODEL, tensors, outputs=[grpcclient.InferRequestedOutput("output")])
        return result.as_numpy("output")

    return infer


if __name__ == "__main__":
    main(__doc__, "127.0.0.1:8001", make_infer)
