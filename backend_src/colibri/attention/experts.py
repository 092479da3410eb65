"""The expert tier as the attention tier calls it: forward(layer, hidden [T, H]) -> [T, H], over one of
three paths. inprocess: a colibri.MoELayer per packed layer file, called through DLPack on the caller's
tensors (no copy, no transport). grpc: Triton's colibri_moe over gRPC, the tokens and the result crossing
the wire. cudashm: the same requests with hidden_states and output in CUDA shared-memory regions on the
caller's GPU, so only the request header crosses the wire. torch is imported when a tier is used, not
when this module is."""
import itertools
import os
import re

import numpy as np

from colibri import model_folder
from colibri._native import STATUS_INTERNAL, ColibriError, invalid

PROTOCOLS = ("inprocess", "grpc", "cudashm")
MODEL = "colibri_moe"
# Seconds the first request to a server may take to answer, before its URL is called dead.
CONNECT_TIMEOUT_S = 10.0
# Triton datatype of hidden_states/output -> (numpy storage on the wire, torch dtype name).
WIRE = {"FP32": ("float32", "float32"), "FP16": ("float16", "float16"), "BF16": ("bfloat16", "bfloat16")}


def expert_tier(protocol, *, url=None, weights=None, device="cpu", model=MODEL):
    """The expert tier of `protocol`.

    Parameters
    ----------
    protocol : str
        "inprocess" (a colibri.MoELayer per layer file of the folder `weights`, on `device`), "grpc" (Triton
        at `url`, model `model`, input `layer`) or "cudashm" (gRPC, hidden_states and output in CUDA shared
        memory on the GPU the hidden states are on; needs an NVIDIA GPU and cupy).
    url : str
        HOST:PORT of Triton's gRPC endpoint (grpc, cudashm).
    weights : path
        A folder of layer{N}.colibri.safetensors files, what `pack --layer all` writes (inprocess).
    device : str
        "cpu", "cuda" or "cuda:N": where inprocess layers run, and the GPU cudashm regions live on.

    Returns
    -------
    An object with .forward(layer, hidden) -> output (a torch tensor [T, H] of hidden's dtype and
    device), .layers (the set of layer numbers served), .hidden_size and .close(). Errors are
    ColibriError, in one line naming the input."""
    if protocol == "inprocess":
        if weights is None:
            raise invalid("weights: the inprocess expert tier needs the packed folder (pack --layer all --out DIR)")
        return InProcessExperts(weights, device)
    if protocol in ("grpc", "cudashm"):
        if url is None:
            raise invalid(f"url: the {protocol} expert tier needs the server's gRPC address HOST:PORT")
        return GrpcExperts(url, model) if protocol == "grpc" else CudaShmExperts(url, model, device)
    raise invalid(f"protocol: expected one of {', '.join(PROTOCOLS)}, got {protocol!r}")


class InProcessExperts:
    """Every layer of a packed folder as a colibri.MoELayer on `device`, called on the caller's tensors."""

    def __init__(self, weights, device="cpu"):
        from colibri.layer import MoELayer
        served = model_folder.read(weights)
        if not served.is_folder:
            raise invalid(f"weights {weights}: one layer file; the expert tier needs a folder of "
                          f"{model_folder.LAYER_PATTERN} files (pack --layer all --out DIR)")
        self.device = str(device)
        self._layers = {n: MoELayer.from_file(path, device=self.device) for n, path in served.files.items()}
        self.configs = {n: layer.config for n, layer in self._layers.items()}
        self.layers = set(self._layers)
        self.hidden_size = served.config.hidden_size

    def layer(self, n):
        """The colibri.MoELayer serving layer n."""
        try:
            return self._layers[n]
        except KeyError:
            raise invalid(f"layer: {n} is not served; this tier serves layers "
                          f"{', '.join(map(str, sorted(self.layers)))}") from None

    def forward(self, layer, hidden):
        return self.layer(layer).forward(hidden)

    def close(self):
        self._layers = {}


class GrpcExperts:
    """colibri_moe of a Triton server over gRPC: one request per layer call (split where a call has more
    tokens than the model's max_batch_size), hidden states sent in the server's activation dtype."""

    def __init__(self, url, model=MODEL):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException
        if "://" in url or not re.fullmatch(r"[^\s:/]+:\d+|\[[0-9a-fA-F:]+\]:\d+", url):
            raise invalid(f"url {url!r}: expected HOST:PORT of Triton's gRPC endpoint, e.g. 127.0.0.1:8001")
        self.url, self.model = url, model
        self._grpc, self._error = grpcclient, InferenceServerException
        self._client = grpcclient.InferenceServerClient(url)
        try:
            self._client.is_server_live(client_timeout=CONNECT_TIMEOUT_S)
        except InferenceServerException as exc:
            self._client.close()
            raise invalid(f"url {url}: no Triton server answers there ({exc.message()})") from None
        try:
            metadata = self._client.get_model_metadata(model, as_json=True, client_timeout=CONNECT_TIMEOUT_S)
            config = self._client.get_model_config(model, as_json=True, client_timeout=CONNECT_TIMEOUT_S)["config"]
        except InferenceServerException as exc:
            self._client.close()
            raise invalid(f"url {url}: model {model!r} is not ready there ({exc.message()})") from None
        inputs = {t["name"]: t for t in metadata["inputs"]}
        self.datatype = inputs["hidden_states"]["datatype"]
        self.hidden_size = int(inputs["hidden_states"]["shape"][-1])
        self.top_k = int(inputs["topk_ids"]["shape"][-1]) if "topk_ids" in inputs else None
        if "layer" not in inputs:
            raise invalid(f"url {url}: model {model!r} takes no `layer` input: not a Colibri expert tier")
        layers = config.get("parameters", {}).get("COLIBRI_LAYERS", {}).get("string_value", "")
        if not layers:
            raise invalid(f"url {url}: model {model!r} serves one layer file; the expert tier is a server whose "
                          "--weights is a folder of layer files (pack --layer all)")
        self.layers = {int(n) for n in layers.split(",")}
        self.max_tokens = int(config.get("max_batch_size") or 0) or None

    def forward(self, layer, hidden):
        import torch
        if layer not in self.layers:
            raise invalid(f"layer: {layer} is not served by {self.url}; it serves layers "
                          f"{', '.join(map(str, sorted(self.layers)))}")
        x = hidden.detach().to(getattr(torch, WIRE[self.datatype][1]))
        step = self.max_tokens or max(1, x.shape[0])
        parts = [self._send(layer, x[i:i + step]) for i in range(0, max(1, x.shape[0]), step)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.to(device=hidden.device, dtype=hidden.dtype)

    def _send(self, layer, x):
        """One request of x [t, H] (torch, the wire dtype): its output as a torch tensor on x's device."""
        import torch
        host = x.cpu().contiguous()
        array = host.view(torch.int16).numpy().view(_bfloat16()) if self.datatype == "BF16" else host.numpy()
        inputs = [self._input("hidden_states", array, self.datatype), self._layer_input(layer, x.shape[0])]
        result = self._infer(layer, inputs)
        out = np.array(result.as_numpy("output"))  # a writable copy: the reply's buffer is read-only
        if self.datatype == "BF16":
            return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(out)

    def _input(self, name, array, datatype):
        tensor = self._grpc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def _layer_input(self, layer, tokens):
        return self._input("layer", np.full((tokens, 1), layer, np.int32), "INT32")

    def _infer(self, layer, inputs, outputs=None):
        try:
            return self._client.infer(self.model, inputs, outputs=outputs)
        except self._error as exc:
            raise ColibriError(f"{self.url} layer {layer}: {exc.message()}", STATUS_INTERNAL) from None

    def close(self):
        self._client.close()


class CudaShmExperts(GrpcExperts):
    """GrpcExperts with hidden_states and output in CUDA shared-memory regions on the hidden states' GPU
    (colibri.serving.cuda_shm): the tokens move device to device, each way once. Regions grow to the
    largest call seen and are unregistered and freed by close()."""

    _names = itertools.count()

    def __init__(self, url, model=MODEL, device="cuda"):
        from colibri.serving.cuda_shm import host_problem
        name, _, ordinal = str(device).partition(":")
        if name != "cuda":
            raise invalid(f"device: the cudashm expert tier puts its regions on a GPU: expected 'cuda' or "
                          f"'cuda:N', got {device!r}")
        self.device_id = int(ordinal or 0)
        problem = host_problem(self.device_id)
        if problem:
            raise invalid(f"cudashm {problem}")
        super().__init__(url, model)
        from colibri.dlpack import import_cupy
        self._cupy = import_cupy()
        self._regions = {}

    def _region(self, role, nbytes):
        from colibri.serving.cuda_shm import CudaShmRegion
        region = self._regions.get(role)
        if region is not None and region.nbytes >= nbytes:
            return region
        if region is not None:
            region.unregister(self._client)
            region.free()
        region = CudaShmRegion(f"colibri_attention_{os.getpid()}_{next(self._names)}_{role}", nbytes, self.device_id)
        region.register(self._client)
        self._regions[role] = region
        return region

    def _send(self, layer, x):
        import torch
        if x.device.type != "cuda" or (x.device.index or 0) != self.device_id:
            raise invalid(f"hidden_states: on {x.device}, but the cudashm regions are on cuda:{self.device_id}")
        x = x.contiguous()
        # cupy has no bfloat16: a region holds bytes, so bf16 travels as its int16 bits.
        bits = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        nbytes = x.numel() * x.element_size()
        source, target = self._region("in", nbytes), self._region("out", nbytes)
        source.write(self._cupy.from_dlpack(bits))
        hidden = self._grpc.InferInput("hidden_states", list(x.shape), self.datatype)
        hidden.set_shared_memory(source.name, nbytes)
        output = self._grpc.InferRequestedOutput("output")
        output.set_shared_memory(target.name, nbytes)
        self._infer(layer, [hidden, self._layer_input(layer, x.shape[0])], [output])
        out = torch.from_dlpack(target.read(str(bits.dtype).removeprefix("torch."), tuple(x.shape)))
        return out.view(torch.bfloat16) if x.dtype == torch.bfloat16 else out

    def close(self):
        for region in self._regions.values():
            try:
                region.unregister(self._client)
            finally:
                region.free()
        self._regions = {}
        super().close()


def _bfloat16():
    import ml_dtypes  # tritonclient's own BF16 array type
    return ml_dtypes.bfloat16
