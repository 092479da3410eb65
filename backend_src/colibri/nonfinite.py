"""NaN and Inf rows of activations, found by reading exponent bits: for servers that join requests
(colibri.serving's batching) and for MoELayer.forward(check_finite=True). Arrays on a GPU are
checked there with their own library, and their answers come to the host in one copy."""
import contextlib
import sys

import numpy as np

from colibri import dlpack
from colibri._native import invalid

# Float dtypes as the signed integers of their width, and their exponent bits: all set is Inf or NaN.
# Reading the bits serves every library alike, bf16 included (which numpy and cupy cannot hold).
_EXPONENT_BITS = {"fp32": ("int32", 0x7F800000), "fp16": ("int16", 0x7C00), "bf16": ("int16", 0x7F80),
                  "fp64": ("int64", 0x7FF0000000000000)}


def nonfinite_rows(arrays, name="hidden_states"):
    """For each float array [T, ...] of `arrays` (numpy, torch, cupy, colibri.Tensor, any DLPack
    producer or capsule; capsules are consumed), the index of its first row holding a NaN or an Inf,
    or None when it has none (and for None, non-float and row-less arrays, left to the layer's own
    checks). Arrays on a GPU are checked there with their own library and their answers come to the
    host in one copy per library and device: for a batch of requests, one synchronisation in all."""
    views = []
    try:
        for array in arrays:
            views.append(None if array is None else dlpack.take(name, array))
        return first_nonfinite_rows(views)
    finally:
        for view in views:
            if view is not None:
                view.release()


def nonfinite_rows_by_part(array, lengths, name="hidden_states"):
    """nonfinite_rows() for the consecutive parts of one array [T, ...], of `lengths` rows each (they
    sum to T): for each part, the index within it of its first row holding a NaN or an Inf, or None.
    The array is read once and, on a GPU, its answer comes to the host in one copy however many parts
    it has: a server checks the joined batch of its requests so, not each request on its own."""
    return nonfinite_rows_by_part_later(array, lengths, name)()


def nonfinite_rows_by_part_later(array, lengths, name="hidden_states"):
    """nonfinite_rows_by_part() in two steps: this call starts the check (on a GPU it is enqueued on
    the array's library's current stream) and returns a function that gives the answer, waiting for
    the GPU only then. A server enqueues its forward in between, so the GPU need not idle while the
    host waits for the check: NaN and Inf rows reach only their own tokens' output."""
    lengths = [int(n) for n in lengths]
    if array is None:
        return lambda: [None] * len(lengths)
    view = dlpack.take(name, array)
    try:
        mask = _row_mask(view, 0)  # None: left to the layer's own checks, as nonfinite_rows leaves it
        if mask is not None and (sum(lengths) != view.shape[0] or min(lengths, default=0) < 0):
            raise invalid(f"{name}: parts of {lengths} rows do not make up its {view.shape[0]} rows")
        library = None if mask is None or isinstance(mask, np.ndarray) else dlpack.device_library(view)
        device_id = view.device_id
    finally:
        view.release()

    def rows():
        host = mask
        if library is not None:
            with _on_stream(library, 0, device_id):
                host = device_to_host(mask)  # the one synchronisation
        answer, start = [], 0
        for n in lengths:
            answer.append(None if host is None else _first_true(host[start:start + n]))
            start += n
        return answer
    return rows


def _row_mask(view, stream_ptr):
    """[T] bool, True at the rows of a dlpack View holding an Inf or a NaN: a numpy array for a host
    view, an array of the view's library (not yet waited for) for a GPU one; None where not checked."""
    if view is None or view.dtype not in _EXPONENT_BITS or not view.shape or view.size == 0:
        return None
    bits_dtype, exponent = _EXPONENT_BITS[view.dtype]
    if view.on_host:
        return _nonfinite_per_row(view.host_array().view(np.dtype(bits_dtype)), exponent)
    with _on_stream(dlpack.device_library(view), stream_ptr, view.device_id):
        return _nonfinite_per_row(dlpack.device_array(view, bits_dtype), exponent)


def first_nonfinite_rows(views, stream_ptr=0):
    """nonfinite_rows() of dlpack Views (None allowed); on a GPU on stream_ptr (0: the library's current)."""
    rows = [None] * len(views)
    on_device = {}  # (library name, device id) -> [(index, per-row mask on the device)]
    for index, view in enumerate(views):
        mask = _row_mask(view, stream_ptr)
        if mask is None:
            continue
        if view.on_host:
            rows[index] = _first_true(mask)
        else:
            on_device.setdefault((dlpack.device_library(view).__name__, view.device_id), []).append((index, mask))
    for (library_name, device_id), masks in on_device.items():
        library = sys.modules[library_name]
        parts = [mask for _, mask in masks]
        with _on_stream(library, stream_ptr, device_id):
            if len(parts) > 1:
                parts = [library.cat(parts) if library_name == "torch" else library.concatenate(parts)]
            host = device_to_host(parts[0])  # the one synchronisation
        start = 0
        for index, mask in masks:
            rows[index] = _first_true(host[start:start + len(mask)])
            start += len(mask)
    return rows


def _nonfinite_per_row(bits, exponent):
    """[T] bool: rows of `bits` (a float array read as integers) holding an Inf or a NaN."""
    return ((bits & exponent) == exponent).reshape(bits.shape[0], -1).any(1)


def _first_true(mask: np.ndarray):
    return int(mask.argmax()) if mask.any() else None


def _on_stream(library, stream_ptr, device_id):
    """Work of `library` enqueued on stream_ptr (0: its current stream), on device_id."""
    if library.__name__ == "torch":
        if not stream_ptr:
            return contextlib.nullcontext()
        return library.cuda.stream(library.cuda.ExternalStream(stream_ptr, device=library.device("cuda", device_id)))
    stack = contextlib.ExitStack()
    stack.enter_context(library.cuda.Device(device_id))
    if stream_ptr:
        stack.enter_context(library.cuda.ExternalStream(stream_ptr))
    return stack


def device_to_host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else array.cpu().numpy()
