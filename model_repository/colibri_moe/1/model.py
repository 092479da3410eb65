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
Weights that are a folder of layer{N}.colibri.safetensors files are all loaded, after a check that
they fit (colibri.memory); each request names its layer with the input `layer`, and the requests of
a batch are grouped by layer, each group computed as above by its layer.
The batching, its checks and the metrics live in colibri.serving (batching.py, metrics.py);
this file adapts them to Triton's Python backend.
"""
import os
import time

import triton_python_backend_utils as pb_utils

import colibri
from colibri import memory, model_folder
from colibri.serving import batching, metrics, triton_config
from colibri.serving.batching import INPUTS, LAYER_INPUT, FinitenessCheckFailed


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        # The tensors' dims from the checkpoint's header (config.pbtxt leaves them out).
        return triton_config.complete(auto_complete_model_config, os.path.dirname(os.path.abspath(__file__)))

    def initialize(self, args):
        settings = triton_config.instance_settings(args)  # the model config, read once
        served = model_folder.read(settings.weights)
        self.batch = (batching.DeviceBatch(settings.device_id, pb_utils.Logger.log_info) if settings.on_gpu
                      else batching.HostBatch())
        self._check_memory(served, settings)
        self.layers = {n: colibri.MoELayer.from_file(path, device="cuda" if settings.on_gpu else "cpu",
                                                     device_id=settings.device_id)
                       for n, path in served.files.items()}
        self.numbers = served.numbers  # [] for a single file: requests name no layer
        self.metrics = metrics.ModelMetrics(pb_utils, settings.metric_labels,
                                            {n: layer.config.num_experts for n, layer in self.layers.items()},
                                            settings.metrics_interval)
        # What is served, in one line (the config's COLIBRI_CHECKPOINT_* parameters say the same).
        checkpoint = settings.checkpoint_identity()
        if served.is_folder:  # the folder, then each layer and its file
            pb_utils.Logger.log_info(f"colibri_moe: {served.describe_numbers()} from {checkpoint.describe()}")
        for (n, layer), part in zip(self.layers.items(), checkpoint.files or [checkpoint]):
            pb_utils.Logger.log_info(f"colibri_moe: {'' if n is None else f'layer {n}: '}{layer} from "
                                     f"{part.describe()}")
        if checkpoint.note:
            pb_utils.Logger.log_info(f"colibri_moe: {checkpoint.note}")
        if settings.warmup_tokens:
            seconds = self._warm_up(settings.activation_dtype, settings.warmup_tokens)
            pb_utils.Logger.log_info(f"colibri_moe: warm-up forwards ({settings.warmup_tokens} tokens) took "
                                     f"{seconds * 1e3:.1f} ms")

    def _check_memory(self, served, settings):
        """Refuses, before loading, layers that do not fit this instance's device (colibri.memory)."""
        sizes = [path.stat().st_size for path in served.files.values()]
        if settings.on_gpu:
            cupy = self.batch.cupy
            with cupy.cuda.Device(settings.device_id):
                available = memory.gpu_available(lambda: cupy.cuda.runtime.memGetInfo()[0])
            where = f"GPU {settings.device_id}"
        else:
            available, where = memory.host_available(), "the host (memory-mapped, used in place)"
        need = memory.needed(served.configs.values(), sizes, "cuda" if settings.on_gpu else "cpu")
        memory.check(need, available, where, f"{served.path} ({served.describe_numbers()})")

    def _warm_up(self, dtype, token_counts):
        """Runs the paths requests take once (router and given routing; one request alone and two
        joined; on a GPU each regime of tokens per expert, whose kernels load lazily), so no request
        pays their one-time costs: module loading, cupy's kernel compilation, allocator pools. Its
        tokens are not counted in the metrics. Returns the seconds it took."""
        start = time.perf_counter()
        for layer in self.layers.values():
            for members in batching.warmup_batches(layer.config, dtype, token_counts):
                keep = []
                try:
                    self._compute(layer, members, keep)
                finally:
                    for view in keep:
                        view.release()
            layer.expert_counts(reset=True)  # waits for the GPU; the warm-up is not traffic
        if hasattr(self.batch, "arrivals"):
            self.batch.arrivals.clear()  # the log's "first request" lines are about real ones
        return time.perf_counter() - start

    def execute(self, requests):
        responses = [None] * len(requests)
        members = [(index, [pb_utils.get_input_tensor_by_name(request, name) for name in INPUTS])
                   for index, request in enumerate(requests)]
        try:
            by_layer, refused = batching.split_by_layer(
                members, [pb_utils.get_input_tensor_by_name(r, LAYER_INPUT) for r in requests], self.numbers)
        except Exception as exc:  # reading `layer` itself failed (not a bad value): no request can run
            self._fail(members, responses, f"layer: not read: {type(exc).__name__}: {exc}", "INTERNAL")
            return responses
        for index, message in refused:
            self._fail([(index, None)], responses, message, "INVALID_ARG")
        for number, layer_members in by_layer.items():
            layer, start = self.layers[number], time.perf_counter()
            for group in batching.groups_by_shape(layer_members):
                self._run(layer, group, responses)
            try:
                counts = layer.expert_counts(reset=True)  # on a GPU this waits for the layer's forwards
                self.metrics.batch_done(number, counts, time.perf_counter() - start)
            except Exception as exc:  # the answers are ready: a metrics failure must not fail them
                pb_utils.Logger.log_error(f"colibri_moe: metrics not updated: {type(exc).__name__}: {exc}")
        return responses

    def finalize(self):
        try:
            self.metrics.flush()
        except Exception as exc:
            pb_utils.Logger.log_error(f"colibri_moe: metrics not updated: {type(exc).__name__}: {exc}")

    def _run(self, layer, members, responses):
        """One forward of `layer` for the members' tokens; an answer for each member in responses."""
        if members[0][1][0] is None:
            self._fail(members, responses, batching.MISSING_HIDDEN_STATES, "INVALID_ARG")
            return
        keep = []  # the inputs' views on a GPU: released once the forward is done
        try:
            out, bad_rows = self._compute(layer, members, keep)
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
                    self._run(layer, [member], responses)
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

    def _compute(self, layer, members, keep):
        """The members' joined forward and, for each member, its first row holding a NaN or an Inf."""
        joined = [None if members[0][1][j] is None else self.batch.join([inputs[j] for _, inputs in members], keep)
                  for j in range(len(INPUTS))]
        finish_check = self._nonfinite_rows_later(members, joined[0])
        out = layer.forward(*joined)
        return out, finish_check()  # on a GPU the check's answer waits for the forward

    def _nonfinite_rows_later(self, members, hidden_states):
        """The batch's finiteness check, started: a function giving each member's first bad row."""
        return batching.checked_nonfinite_rows_later(self.batch, members, hidden_states)

    @staticmethod
    def _fail(members, responses, message, code_name):
        # Error codes came in 23.09; before (tritonserver 22.12, the CUDA 11.8 image), every error a
        # model returns is INTERNAL, so a bad request answers HTTP 500 there instead of 400.
        code = getattr(pb_utils.TritonError, code_name, None)
        for index, _ in members:
            error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
            responses[index] = pb_utils.InferenceResponse(error=error)
