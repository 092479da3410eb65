"""What the Colibri clients share: arguments, the requests they send, the float64 reference their
answers are checked against, and the request flow through shared memory.

A client supplies `infer(inputs) -> output`: inputs is a list of (name, numpy array, Triton
datatype) — hidden_states, plus topk_ids and topk_weights when the routing is explicit — and output
the model's `output` as a numpy array. `main` sends random hidden states with the layer's own routing
(when the checkpoint has a router) and with explicit routing, compares each answer with
colibri.reference computed from the same packed checkpoint, prints PASS or FAIL per case and exits
non-zero on any FAIL.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

# colibri comes from the environment (make venv installs the checkout's package; elsewhere PYTHONPATH).
from colibri import checkpoint, reference
from colibri.dtypes import bf16_to_float32, float32_to_bf16
from colibri.testing import error_limit

REPO_ROOT = Path(__file__).resolve().parents[1]

MODEL = "colibri_moe"
DEFAULT_WEIGHTS = REPO_ROOT / "model_repository" / MODEL / "1" / "weights.colibri.safetensors"
# Activation dtype -> (Triton datatype, numpy dtype the values are held in). BF16 values are held as
# float32 (exactly representable); gRPC sends them as tritonclient's BF16 dtype (wire_array), shared
# memory as bf16 bits (raw_bytes / from_raw).
WIRE_DTYPES = {"fp32": ("FP32", np.float32), "fp16": ("FP16", np.float16), "bf16": ("BF16", np.float32)}
# The largest accepted max |output - reference| / max |reference| is colibri.testing's limit for the
# least precise of the wire dtype and the weight dtype: the reference is computed from exactly the
# values sent, with the stored weights, and with 16-bit weights a backend may round intermediates to
# that dtype (colibri.h; the CUDA backend does, to feed its tensor cores). fp8 weights have their own,
# colibri.testing.FP8_ERROR_LIMIT (0.1): the reference is the layer of the dequantised weights, which
# the CPU computes within 1e-5, while a GPU's fp8 tensor cores also quantise the activations (4-5% off).
# Rows whose k-th and (k+1)-th routing scores are closer than this are redrawn: either expert would
# be a right answer there, and the check could not tell which one the server picked.
MIN_TOPK_MARGIN = 1e-4


def parser(description: str, default_url: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", default=default_url, help=f"server address (default {default_url})")
    p.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS,
                   help="the packed checkpoint the server serves, which the answers are checked against "
                        "(default: the demo one `make serve` serves, model_repository/colibri_moe/1/"
                        "weights.colibri.safetensors)")
    p.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="fp32",
                   help="activation dtype the server was started with (serve --dtype)")
    p.add_argument("--layer", type=int, default=None, metavar="N",
                   help="the layer to ask for, for a server whose --weights is a folder of layer{N} files: sent "
                        "as input `layer`, and checked against --weights' layerN.colibri.safetensors")
    p.add_argument("--tokens", type=int, default=7, help="tokens per request")
    p.add_argument("--seed", type=int, default=0)
    return p


class Layer:
    """The served layer as the reference sees it, loaded from the packed checkpoint."""

    def __init__(self, path: Path):
        ckpt = checkpoint.load(path)
        self.ckpt = ckpt  # every tensor of the layer (biases, shared expert) for the reference
        self.config, self.experts = ckpt.config, np.asarray(ckpt.experts)
        self.router = None if ckpt.router is None else np.asarray(ckpt.router)
        self.router_bias = None if ckpt.router_bias is None else np.asarray(ckpt.router_bias)

    def hidden_states(self, tokens: int, rng, dtype: str) -> np.ndarray:
        """Random hidden states, exactly representable in dtype, whose routing (if the layer routes)
        is unambiguous."""
        def draw(rows):
            x = rng.standard_normal((rows, self.config.hidden_size)).astype(WIRE_DTYPES[dtype][1])
            return bf16_to_float32(float32_to_bf16(x)) if dtype == "bf16" else x

        x = draw(tokens)
        if self.router is None:
            return x
        while True:
            logits = reference.router_logits(x, self.router, self.ckpt.router_logit_bias)
            scores = reference.selection_scores(self.config, logits, self.router_bias)
            close = ((reference.topk_margin(scores, self.config.top_k) < MIN_TOPK_MARGIN)
                     | (reference.group_margin(self.config, logits, self.router_bias) < MIN_TOPK_MARGIN))
            if not close.any():
                return x
            x[close] = draw(int(close.sum()))

    def routing(self, tokens: int, rng):
        """Explicit routing: k distinct experts per token and positive weights."""
        E, k = self.config.num_experts, self.config.top_k
        ids = np.argsort(rng.random((tokens, E)), axis=1)[:, :k].astype(np.int32)
        weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
        return ids, weights

    def expected(self, x, ids=None, weights=None) -> np.ndarray:
        return reference.checkpoint_forward(self.ckpt, x.astype(np.float64), ids, weights)


def requests(layer: Layer, tokens: int, dtype: str, seed: int, number=None):
    """(case name, inputs, expected output) for each case the clients check; with a layer number, each
    request names it (input `layer`, the number on each of its rows)."""
    datatype = WIRE_DTYPES[dtype][0]
    rng = np.random.default_rng(seed)
    named = [] if number is None else [("layer", np.full((tokens, 1), number, np.int32), "INT32")]
    cases = []
    if layer.router is not None:
        x = layer.hidden_states(tokens, rng, dtype)
        cases.append(("router routing", [("hidden_states", x, datatype)] + named, layer.expected(x)))
    x = layer.hidden_states(tokens, rng, dtype)
    ids, weights = layer.routing(tokens, rng)
    cases.append(("explicit routing",
                  [("hidden_states", x, datatype), ("topk_ids", ids, "INT32"), ("topk_weights", weights, "FP32")]
                  + named, layer.expected(x, ids, weights)))
    return cases


def checked_file(args, prog: str) -> Path:
    """The packed file the answers are checked against: --weights, or its layer --layer for a folder."""
    if args.weights.is_dir():
        if args.layer is None:
            sys.exit(f"{prog}: --weights {args.weights} is a folder of layers: pass --layer N, the layer to ask for")
        return args.weights / f"layer{args.layer}.colibri.safetensors"
    return args.weights


def wire_array(array, datatype) -> np.ndarray:
    """The array as tritonclient's InferInput takes it for datatype (BF16: ml_dtypes.bfloat16, exact for
    the values Layer.hidden_states draws)."""
    from tritonclient.utils import triton_to_np_dtype
    return np.ascontiguousarray(array).astype(triton_to_np_dtype(datatype), copy=False)


def raw_bytes(array, datatype) -> np.ndarray:
    """The array as the server holds it in memory (BF16: bits)."""
    return float32_to_bf16(array) if datatype == "BF16" else array


def from_raw(array, datatype) -> np.ndarray:
    return bf16_to_float32(array) if datatype == "BF16" else array


def relative_error(output, expected) -> float:
    output = np.asarray(output, np.float64)
    if output.shape != expected.shape:
        return float("inf")
    return float(np.max(np.abs(output - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


def check(infer, layer: Layer, args) -> bool:
    """Sends every case through infer; prints one line per case and the verdict; True if all pass."""
    ok = True
    for name, inputs, expected in requests(layer, args.tokens, args.dtype, args.seed, args.layer):
        try:
            output = infer(inputs)
        except Exception as exc:  # a transport or server error is this case's FAIL, with its reason
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            ok = False
            continue
        error = relative_error(output, expected)
        limit = error_limit(args.dtype, layer.config.weight_dtype)
        passed = error <= limit
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'} {name}: T={args.tokens} output {list(np.shape(output))}, "
              f"max relative error {error:.2e} (limit {limit:.0e})")
    print("PASS" if ok else "FAIL")
    return ok


def main(description: str, default_url: str, make_infer, add_arguments=None, preflight=None) -> None:
    """Parses arguments (the client's own through add_arguments(parser)), runs preflight(args) (a
    client's check of this host, which exits with its own message), builds the client's infer with
    make_infer(args, layer) and checks every case."""
    p = parser(description, default_url)
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args()
    if preflight is not None:
        preflight(args)
    weights = checked_file(args, p.prog)
    if not weights.is_file():
        sys.exit(f"{p.prog}: no checkpoint at {weights}: pass --weights FILE, the file the server "
                 f"serves (`colibri serve --weights FILE`), or run `make serve` once for the demo one")
    layer = Layer(weights)
    c = layer.config
    default = " (the default: the demo checkpoint `make serve` serves)" if weights == DEFAULT_WEIGHTS else ""
    print(f"checking against {weights}{default}: {c.num_experts} experts, top-{c.top_k}, "
          f"hidden {c.hidden_size}, {c.weight_dtype} weights; a server started with another checkpoint "
          f"needs --weights FILE, the file it serves", flush=True)
    sys.exit(0 if check(make_infer(args, layer), layer, args) else 1)


class SharedMemoryInfer:
    """infer() through shared-memory regions registered with the server over gRPC: each input is
    written into a region of its own, the output lands in another, and all are unregistered and
    freed after the request. Subclasses say how a region is handled: create(name, nbytes) -> handle,
    write(handle, array), register(name, handle, nbytes), read(handle, datatype, storage numpy dtype,
    shape) -> numpy of the bytes (bf16 bits as uint16, which from_raw widens),
    unregister(name), destroy(handle)."""

    def __init__(self, client, layer_out_features: int, dtype: str, prefix: str):
        self.client, self.out_features, self.prefix = client, layer_out_features, prefix
        self.datatype, self.wire = WIRE_DTYPES[dtype]

    def __call__(self, inputs):
        import tritonclient.grpc as grpcclient
        regions = []  # (name, handle)
        try:
            tensors = []
            for name, values, datatype in inputs:
                array = raw_bytes(values, datatype)
                handle = self.create(f"{self.prefix}_{name}", array.nbytes)
                regions.append((f"{self.prefix}_{name}", handle))
                self.write(handle, array)
                self.register(f"{self.prefix}_{name}", handle, array.nbytes)
                tensor = grpcclient.InferInput(name, list(array.shape), datatype)
                tensor.set_shared_memory(f"{self.prefix}_{name}", array.nbytes)
                tensors.append(tensor)
            shape = (inputs[0][1].shape[0], self.out_features)
            storage = raw_bytes(np.zeros(0, self.wire), self.datatype).dtype
            nbytes = int(np.prod(shape)) * storage.itemsize
            handle = self.create(f"{self.prefix}_output", nbytes)
            regions.append((f"{self.prefix}_output", handle))
            self.register(f"{self.prefix}_output", handle, nbytes)
            requested = grpcclient.InferRequestedOutput("output")
            requested.set_shared_memory(f"{self.prefix}_output", nbytes)
            self.client.infer(MODEL, tensors, outputs=[requested])
            return from_raw(self.read(handle, self.datatype, storage, shape), self.datatype)
        finally:
            for name, handle in reversed(regions):
                self._unregister_when_released(name)
                self.destroy(handle)

    def _unregister_when_released(self, name, seconds=5.0):
        """Triton drops its hold on an output region just after the response reaches the client, so
        an unregister right after infer() can be refused as "currently in use": retry until released."""
        from tritonclient.utils import InferenceServerException
        deadline = time.monotonic() + seconds
        while True:
            try:
                return self.unregister(name)
            except InferenceServerException as exc:
                if "currently in use" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
