"""How colibri_moe's model.py joins the requests of one Triton batch into one forward, and the checks
of its requests. A request's inputs are pb_utils.Tensor-like (name(), shape(), to_dlpack(), is_cpu());
requests whose inputs have the same feature shapes are joined along the token axis. With weights
that are a folder of layers, a batch's requests are first grouped by the layer they name (input
`layer`), each group computed by its own layer. Tensors move through DLPack only: the 24.10 stub's
as_numpy() is wrong under numpy 2.
"""
import numpy as np

import colibri
from colibri.dlpack import device_array, take
from colibri.dtypes import ITEMSIZE, STORAGE, float32_to_bf16

INPUTS = ("hidden_states", "topk_ids", "topk_weights")
LAYER_INPUT = "layer"
# Triton checks how many inputs came, not which: say what is missing.
MISSING_HIDDEN_STATES = ("hidden_states: required (the tokens [T, H]); topk_ids and topk_weights only give "
                         "their routing")


class FinitenessCheckFailed(RuntimeError):
    """The NaN/Inf check itself failed (not an input found bad)."""


def split_by_layer(members, layer_tensors, numbers):
    """members [(index, inputs)] by the layer their request names: ({N: members}, [(index, message)]
    for the requests refused). layer_tensors: each request's `layer` input or None; numbers: the layers
    served, [] for a single file, whose members all go under None."""
    groups, refused = {}, []
    for (index, inputs), tensor in zip(members, layer_tensors):
        try:
            number = requested_layer(tensor, numbers)
        except ValueError as exc:
            refused.append((index, str(exc)))
            continue
        groups.setdefault(number, []).append((index, inputs))
    return groups, refused


def requested_layer(tensor, numbers):
    """The layer number a request's `layer` input names (None for a single file); ValueError saying
    what is wrong with it, the layers served named."""
    if not numbers:
        if tensor is not None:
            raise ValueError("layer: this server serves one layer (its weights are one checkpoint file); "
                             "send no layer")
        return None
    served = "this server serves layers " + ", ".join(map(str, numbers))
    if tensor is None:
        raise ValueError(f"layer: required: {served} (INT32 [T, 1], the layer's number on each of the T rows)")
    values = np.unique(_host_values(tensor))
    if values.size == 0:
        raise ValueError(f"layer: no value (a request of no tokens); {served}")
    if values.size > 1:
        shown = ", ".join(map(str, values[:8].tolist())) + (", ..." if values.size > 8 else "")
        raise ValueError(f"layer: one layer per request, got {shown}; {served}")
    number = int(values[0])
    if number not in numbers:
        raise ValueError(f"layer: {number} is not served; {served}")
    return number


def _host_values(tensor) -> np.ndarray:
    """A small input's values in a numpy copy, wherever it arrived (CUDA shared memory: on a GPU)."""
    view = take(tensor.name(), tensor.to_dlpack())
    try:
        if view.on_host:
            return view.host_array().copy()
        array = device_array(view)
        return array.get() if hasattr(array, "get") else array.cpu().numpy()  # cupy, or torch
    finally:
        view.release()


def groups_by_shape(members):
    """members [(index, inputs)] in groups that can be joined: the same feature shapes of each input."""
    groups = {}
    for index, inputs in members:
        key = tuple(None if t is None else tuple(t.shape()[1:]) for t in inputs)
        groups.setdefault(key, []).append((index, inputs))
    return list(groups.values())


class HostBatch:
    """Joins requests on the host with numpy; results stay colibri.Tensor (bf16 included)."""

    @staticmethod
    def nonfinite_rows_later(tensors, joined):
        """A function giving, for each request's hidden states, its first row holding a NaN or an Inf,
        or None. On the host each is read where it is, at once: nothing to wait for."""
        rows = colibri.nonfinite_rows([None if t is None else t.to_dlpack() for t in tensors])
        return lambda: rows

    def join(self, tensors, keep):
        if len(tensors) == 1:
            return tensors[0].to_dlpack()
        views = [take(t.name(), t.to_dlpack()) for t in tensors]
        try:
            return colibri.Tensor.from_numpy(np.concatenate([v.host_array() for v in views]), views[0].dtype)
        finally:
            for view in views:
                view.release()

    @staticmethod
    def rows(out, start, stop):
        """Rows [start, stop) of a colibri.Tensor output, as a colibri.Tensor over the same memory."""
        row_bytes = out.shape[1] * ITEMSIZE[out.dtype]
        return colibri.Tensor(out, out.data_ptr + start * row_bytes, (stop - start, out.shape[1]), out.dtype,
                              *out.__dlpack_device__(), stream=out.stream)


class DeviceBatch:
    """Joins requests on the instance's GPU with cupy: one buffer, one asynchronous copy per request
    (device to device for CUDA shared memory, host to device for plain gRPC/HTTP), any dtype (bf16
    too, which cupy cannot hold); outputs are row ranges of the forward's output, nothing copied.
    log: a function taking a line for the server's log (pb_utils.Logger.log_info)."""

    def __init__(self, device_id, log):
        self.cupy = colibri.dlpack.import_cupy()
        self.device_id = device_id
        self.log = log
        self.arrivals = set()  # where inputs came from, logged the first time each is seen

    @staticmethod
    def nonfinite_rows_later(tensors, joined):
        """The same, read from the joined batch on the GPU in one pass (checking each request on its
        own cost about 0.2 ms per request in launches); the answer waits for the GPU."""
        if joined is None:  # no hidden_states: the layer names what is missing
            return lambda: [None] * len(tensors)
        return colibri.nonfinite_rows_by_part_later(joined, [t.shape()[0] for t in tensors])

    def join(self, tensors, keep):
        """One colibri.Tensor on this GPU holding the tensors' rows in order. What must outlive the
        forward (the inputs' views) is appended to keep."""
        where = "GPU memory (zero-copy)" if not tensors[0].is_cpu() else "host memory (copied to the GPU)"
        if where not in self.arrivals:
            self.arrivals.add(where)
            self.log(f"colibri_moe: first request whose inputs arrived in {where}")
        views = [take(t.name(), t.to_dlpack()) for t in tensors]
        keep.extend(views)
        first = views[0]
        here = (colibri.dlpack.KDL_CUDA, self.device_id)
        if len(views) == 1 and (first.device_type, first.device_id) == here:
            return colibri.Tensor(first, first.ptr, first.shape, first.dtype, *here)
        rows = sum(v.shape[0] for v in views)
        joined = colibri.Tensor.empty((rows,) + tuple(first.shape[1:]), first.dtype, *here, library=self.cupy)
        with self.cupy.cuda.Device(self.device_id):
            stream = self.cupy.cuda.get_current_stream().ptr
            offset = 0
            for view in views:
                if tuple(view.shape[1:]) != tuple(first.shape[1:]) or view.dtype != first.dtype:
                    raise colibri.ColibriError(f"{view.name}: requests of one batch disagree in shape or dtype",
                                               colibri.STATUS_INVALID_ARGUMENT)
                nbytes = view.nbytes
                if nbytes:  # cudaMemcpyDefault: the pointers say which way (host, this GPU, another GPU)
                    self.cupy.cuda.runtime.memcpyAsync(joined.data_ptr + offset, view.ptr, nbytes, 4, stream)
                offset += nbytes
        return joined

    rows = staticmethod(HostBatch.rows)


def checked_nonfinite_rows_later(batch, members, hidden_states):
    """The batch's finiteness check, started: a function giving each member's first bad row. A failure
    of the check itself (not of an input) is raised as FinitenessCheckFailed, both now and later."""
    try:
        finish = batch.nonfinite_rows_later([inputs[0] for _, inputs in members], hidden_states)
    except Exception as exc:
        raise FinitenessCheckFailed(f"{type(exc).__name__}: {exc}") from exc

    def rows():
        try:
            return finish()
        except Exception as exc:
            raise FinitenessCheckFailed(f"{type(exc).__name__}: {exc}") from exc
    return rows


class _WarmupInput:
    """The part of pb_utils.Tensor that a batch reads, over a colibri.Tensor (for the warm-up)."""

    def __init__(self, name, tensor):
        self._name, self._tensor = name, tensor

    def name(self):
        return self._name

    def shape(self):
        return list(self._tensor.shape)

    def to_dlpack(self):
        return self._tensor.__dlpack__()

    def is_cpu(self):
        return True


def warmup_batches(config, dtype, token_counts):
    """The batches of a warm-up, as lists of members [(index, inputs)]: for each token count, routed by
    the router (if the layer has one) and with given routing; one request alone and, at one token,
    two joined. Random hidden states of `dtype`, every expert used."""
    rng = np.random.default_rng(0)
    for tokens in token_counts:
        values = rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)
        x = colibri.Tensor.from_numpy(float32_to_bf16(values) if dtype == "bf16" else values.astype(STORAGE[dtype]),
                                      dtype)
        ids = (np.arange(tokens * config.top_k) % config.num_experts).astype(np.int32).reshape(tokens, config.top_k)
        weights = np.full((tokens, config.top_k), 1.0 / config.top_k, np.float32)
        routed = [_WarmupInput("hidden_states", x), None, None]
        given = [routed[0], _WarmupInput("topk_ids", colibri.Tensor.from_numpy(ids)),
                 _WarmupInput("topk_weights", colibri.Tensor.from_numpy(weights))]
        for inputs in ([routed] if config.has_router else []) + [given]:
            for count in ((1, 2) if tokens == 1 else (1,)):  # one request alone, then two joined
                yield [(i, inputs) for i in range(count)]
