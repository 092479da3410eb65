"""Triton Python-backend model serving one Colibri MoE layer (inputs and outputs: config.pbtxt).

Requests whose inputs have the same feature shapes are joined along the token axis and computed in
one forward; the layer checks every input (shape, expert ids in range, finite weights, ids and
weights together) before it computes anything. If a joined forward is refused as invalid, each of
its requests is run alone, so only the bad ones get an INVALID_ARG error naming the input. Hidden
states holding a NaN or an Inf are refused, naming the row within the request. They are checked
once joined, so a batch costs one pass and no synchronisation of its own however many requests it
holds: on a GPU the check is enqueued before the forward and read after it (a NaN or an Inf reaches
only its own token's output), so the other requests' answers come from the same forward. Their
tokens were computed, so the expert counters count them.
Tensors move through DLPack only: the 24.10 stub's as_numpy() is wrong under numpy 2.
"""
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

import colibri
from colibri import triton_config
from colibri.dlpack import take
from colibri.dtypes import ITEMSIZE, STORAGE, float32_to_bf16

INPUTS = ("hidden_states", "topk_ids", "topk_weights")
FORWARD_SECONDS_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0]


class FinitenessCheckFailed(RuntimeError):
    pass


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
    too, which cupy cannot hold); outputs are row ranges of the forward's output, nothing copied."""

    def __init__(self, device_id):
        self.cupy = colibri.dlpack.import_cupy()
        self.device_id = device_id
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
            pb_utils.Logger.log_info(f"colibri_moe: first request whose inputs arrived in {where}")
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


class _WarmupInput:
    """The part of pb_utils.Tensor that execute reads, over a colibri.Tensor (for the warm-up)."""

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


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        # The tensors' dims from the checkpoint's header (config.pbtxt leaves them out).
        return triton_config.complete(auto_complete_model_config, os.path.dirname(os.path.abspath(__file__)))

    def initialize(self, args):
        path = triton_config.instance_weights_path(args)
        on_gpu = args["model_instance_kind"] == "GPU"
        device_id = int(args["model_instance_device_id"])
        self.layer = colibri.MoELayer.from_file(path, device="cuda" if on_gpu else "cpu", device_id=device_id)
        self.batch = DeviceBatch(device_id) if on_gpu else HostBatch()

        labels = {"model": args["model_name"], "version": args["model_version"]}
        # Custom metrics came to the Python backend in 23.05, histograms later still: tritonserver
        # 22.12 (the CUDA 11.8 image) serves without the ones it lacks.
        self.expert_tokens, self.forward_seconds = [], None
        # Each metric update is a round trip to tritonserver (about 20 us on the CI machine): one per
        # touched expert after every batch cost a 64-expert layer about 1 ms per batch. The counts
        # gather here and go out at most once per interval, with the next batch after it.
        self.metrics_interval = triton_config.metrics_interval(args)
        self.unflushed = np.zeros(self.layer.config.num_experts, np.uint64)
        self.last_flush = time.monotonic()
        families = getattr(pb_utils, "MetricFamily", None)
        # The families must outlive their metrics: the backend refuses to update orphaned ones.
        if families is not None:
            self.tokens_family = families(
                name="colibri_expert_tokens_total",
                description="Tokens routed to each expert (one count per token and chosen expert)",
                kind=families.COUNTER)
            self.expert_tokens = [self.tokens_family.Metric(labels={**labels, "expert": str(e)})
                                  for e in range(self.layer.config.num_experts)]
        if hasattr(families, "HISTOGRAM"):
            self.seconds_family = families(
                name="colibri_forward_seconds",
                description="Time to compute one batch of requests: its MoE forwards until the device is done",
                kind=families.HISTOGRAM)
            self.forward_seconds = self.seconds_family.Metric(labels=labels, buckets=FORWARD_SECONDS_BUCKETS)
        # What is served, in one line (the config's COLIBRI_CHECKPOINT_* parameters say the same).
        checkpoint = triton_config.instance_identity(args, path)
        pb_utils.Logger.log_info(f"colibri_moe: {self.layer} from {checkpoint.describe()}")
        if checkpoint.note:
            pb_utils.Logger.log_info(f"colibri_moe: {checkpoint.note}")
        counts = triton_config.warmup_tokens(args, on_gpu)
        if counts:
            seconds = self._warm_up(triton_config.activation_dtype(args), counts)
            pb_utils.Logger.log_info(f"colibri_moe: warm-up forwards ({counts} tokens) took {seconds * 1e3:.1f} ms")

    def _warm_up(self, dtype, token_counts):
        """Runs the paths requests take once (router and given routing; one request alone and two
        joined; on a GPU each regime of tokens per expert, whose kernels load lazily), so no request
        pays their one-time costs: module loading, cupy's kernel compilation, allocator pools. Its
        tokens are not counted in the metrics. Returns the seconds it took."""
        start = time.perf_counter()
        config = self.layer.config
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
                    keep = []
                    try:
                        self._compute([(i, inputs) for i in range(count)], keep)
                    finally:
                        for view in keep:
                            view.release()
        self.layer.expert_counts(reset=True)  # waits for the GPU; the warm-up is not traffic
        if hasattr(self.batch, "arrivals"):
            self.batch.arrivals.clear()  # the log's "first request" lines are about real ones
        return time.perf_counter() - start

    def execute(self, requests):
        responses = [None] * len(requests)
        members = [(index, [pb_utils.get_input_tensor_by_name(request, name) for name in INPUTS])
                   for index, request in enumerate(requests)]
        groups = {}
        for index, inputs in members:
            key = tuple(None if t is None else tuple(t.shape()[1:]) for t in inputs)
            groups.setdefault(key, []).append((index, inputs))
        start = time.perf_counter()
        for group in groups.values():
            self._run(group, responses)
        try:
            self.unflushed += self.layer.expert_counts(reset=True)  # on a GPU this waits for the forwards
            if self.forward_seconds is not None:
                self.forward_seconds.observe(time.perf_counter() - start)
            if time.monotonic() - self.last_flush >= self.metrics_interval:
                self._flush_expert_tokens()
        except Exception as exc:  # the answers are ready: a metrics failure must not fail them
            pb_utils.Logger.log_error(f"colibri_moe: metrics not updated: {type(exc).__name__}: {exc}")
        return responses

    def finalize(self):
        try:
            self._flush_expert_tokens()
        except Exception as exc:
            pb_utils.Logger.log_error(f"colibri_moe: metrics not updated: {type(exc).__name__}: {exc}")

    def _flush_expert_tokens(self):
        counts, self.unflushed = self.unflushed, np.zeros_like(self.unflushed)
        self.last_flush = time.monotonic()
        for metric, count in zip(self.expert_tokens, counts.tolist()):
            if count:
                metric.increment(count)

    def _run(self, members, responses):
        """One forward for the members' tokens; an answer for each member in responses."""
        if members[0][1][0] is None:  # Triton checks how many inputs came, not which: say what is missing
            self._fail(members, responses, "hidden_states: required (the tokens [T, H]); topk_ids and "
                       "topk_weights only give their routing", "INVALID_ARG")
            return
        keep = []  # the inputs' views on a GPU: released once the forward is done
        try:
            out, bad_rows = self._compute(members, keep)
            start = 0
            for (index, inputs), bad_row in zip(members, bad_rows):
                stop = start + inputs[0].shape()[0]
                if bad_row is not None:
                    self._fail([(index, inputs)], responses, f"hidden_states: not finite at row {bad_row}",
                               "INVALID_ARG")
                else:
                    rows = out if len(members) == 1 else self.batch.rows(out, start, stop)
                    responses[index] = pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("output", rows)])
                start = stop
        except colibri.ColibriError as exc:
            if exc.status == colibri.STATUS_INVALID_ARGUMENT and len(members) > 1:
                for member in members:
                    self._run([member], responses)
            else:
                invalid = exc.status == colibri.STATUS_INVALID_ARGUMENT
                self._fail(members, responses, str(exc), "INVALID_ARG" if invalid else "INTERNAL")
        except FinitenessCheckFailed as exc:
            self._fail(members, responses, f"hidden_states: finiteness check failed: {exc}", "INTERNAL")
        except Exception as exc:  # execute must not raise: that would fail every request of the batch
            self._fail(members, responses, f"{type(exc).__name__}: {exc}", "INTERNAL")
        finally:
            for view in keep:
                view.release()

    def _compute(self, members, keep):
        """The members' joined forward and, for each member, its first row holding a NaN or an Inf."""
        joined = [None if members[0][1][j] is None else self.batch.join([inputs[j] for _, inputs in members], keep)
                  for j in range(len(INPUTS))]
        finish_check = self._nonfinite_rows_later(members, joined[0])
        out = self.layer.forward(*joined)
        return out, finish_check()  # on a GPU the check's answer waits for the forward

    def _nonfinite_rows_later(self, members, hidden_states):
        """The batch's finiteness check, started: a function giving each member's first bad row."""
        try:
            finish = self.batch.nonfinite_rows_later([inputs[0] for _, inputs in members], hidden_states)
        except Exception as exc:
            raise FinitenessCheckFailed(f"{type(exc).__name__}: {exc}") from exc

        def rows():
            try:
                return finish()
            except Exception as exc:
                raise FinitenessCheckFailed(f"{type(exc).__name__}: {exc}") from exc
        return rows

    @staticmethod
    def _fail(members, responses, message, code_name):
        # Error codes came in 23.09; before (tritonserver 22.12, the CUDA 11.8 image), every error a
        # model returns is INTERNAL, so a bad request answers HTTP 500 there instead of 400.
        code = getattr(pb_utils.TritonError, code_name, None)
        for index, _ in members:
            error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
            responses[index] = pb_utils.InferenceResponse(error=error)
