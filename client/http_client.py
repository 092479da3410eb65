"""Sends random hidden states to colibri_moe over HTTP with plain JSON bodies (no binary extension,
only the standard library) and checks the answers (see common.py)."""
import json
import sys
import urllib.error
import urllib.request

import numpy as np

from common import MODEL, main


def make_infer(args, layer):
    url = f"http://{args.url}/v2/models/{MODEL}/infer"

    def infer(inputs):
        body = {"inputs": [{"name": name, "shape": list(array.shape), "datatype": datatype,
                            "data": array.ravel().tolist()} for name, array, datatype in inputs],
                "outputs": [{"name": "output"}]}
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request) as reply:
                output = json.load(reply)["outputs"][0]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc
        return np.asarray(output["data"], np.float64).reshape(output["shape"])

    return infer


def json_carries_dtype(args):
    """Triton takes BF16 only as binary data: say so in one line rather than FAIL every case."""
    if args.dtype == "bf16":
        sys.exit("http_client: Triton accepts no BF16 in JSON bodies; for a server started with --dtype bf16 "
                 "use grpc_client.py or shm_client.py")


if __name__ == "__main__":
    main(__doc__, "127.0.0.1:8000", make_infer, preflight=json_carries_dtype)
