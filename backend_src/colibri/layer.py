"""MoELayer: one MoE layer held by the C library, called with any DLPack-capable arrays.

Every input is checked here once, before the call, with messages naming the input and what is wrong;
then one colibri_moe_forward runs on the caller's memory (no copies on the way in or out) and the
output comes back as the same kind of array as the input (see colibri.dlpack)."""
import dataclasses
import math
import sys
import threading

import numpy as np

from colibri import dlpack
from colibri._native import (DEVICE_CODES, DTYPE_CODES, STATUS_OK, STATUS_ROUTING, ColibriError, check, ffi,
                             invalid, lib)
from colibri.config import LayerConfig
from colibri.dtypes import FLOAT_DTYPES, STORAGE
from colibri.nonfinite import device_to_host, first_nonfinite_rows

def _parse_device(device: str, device_id: int):
    name, _, ordinal = str(device).partition(":")
    if name not in DEVICE_CODES or (ordinal and not ordinal.isdigit()):
        raise invalid(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return name, int(ordinal) if ordinal else int(device_id)


def _float_array(name: str, value, shape) -> np.ndarray:
    """A finite float32, C-contiguous, aligned copy-if-needed of a host float array of `shape`."""
    array = np.asarray(value)
    if array.dtype.kind != "f":
        raise invalid(f"{name}: expected a float array, got dtype {array.dtype}"
                      + (" (bf16 bits? widen with colibri.dtypes.bf16_to_float32)" if array.dtype == np.uint16 else ""))
    if array.shape != tuple(shape):
        raise invalid(f"{name}: expected shape {list(shape)}, got {list(array.shape)}")
    array = np.require(array, dtype=np.float32, requirements=["C", "A"])
    if not np.isfinite(array).all():
        raise invalid(f"{name}: not finite at index {tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])}")
    return array


def _pointer(ctype: str, array):
    """A cffi pointer to a host array's data, NULL for None."""
    return ffi.NULL if array is None else ffi.cast(ctype, array.__array_interface__["data"][0])


class MoELayer:
    """One MoE layer on 'cpu' or 'cuda' (device_id). See forward() for how inputs are taken.

    experts: host array [E, expert_numel] in config.weight_dtype (bf16 as uint16 bits, fp8_e4m3 as
    uint8 codes); on the CPU it is used in place (kept referenced by the layer), on CUDA copied to the
    GPU once. fp8 weights come with expert_scales [E, config.scales_numel] (each expert's scale grids,
    colibri.fp8) and, with a shared expert, shared_expert_scales [config.shared_scales_numel]: host
    float arrays, copied.
    router [E, H], router_bias [E] (selection only), router_logit_bias [E] (added to the logits),
    expert_bias [E, 2F+H] (linear [E, F]) and shared_expert_gate [H]: host float arrays, copied.
    shared_expert [3*Fs*H] (gate, up, down): host array in weight_dtype storage, used in place on the
    CPU like the experts. Each of expert_bias, shared_expert and shared_expert_gate is given exactly
    when config asks for it (config.expert_bias, shared_intermediate_size, shared_gate); see colibri.h.
    routing_fn (CPU only): a Python function (hidden_states [T, H] numpy (bf16 as uint16),
    router_logits [T, E] float32 or None) -> (topk_ids [T, k], topk_weights [T, k]) replacing the
    built-in routing."""

    def __init__(self, config: LayerConfig, experts, router=None, router_bias=None, device="cpu", device_id=0,
                 workspace_tokens=0, num_threads=0, routing_fn=None, _keepalive=None, router_logit_bias=None,
                 expert_bias=None, shared_expert=None, shared_expert_gate=None, expert_scales=None,
                 shared_expert_scales=None):
        config.validate()
        device, device_id = _parse_device(device, device_id)
        E, H = config.num_experts, config.hidden_size
        experts = np.asarray(experts)
        storage = STORAGE[config.weight_dtype]
        if experts.dtype != storage:
            raise invalid(f"experts: weight_dtype {config.weight_dtype} is stored as {storage}, got {experts.dtype}")
        if experts.ndim < 2 or experts.shape[0] != E or math.prod(experts.shape[1:]) != config.expert_numel:
            raise invalid(f"experts: expected shape [E={E}, {config.expert_numel}] ({config.expert_kind}, H={H}, "
                          f"F={config.intermediate_size}), got {list(experts.shape)}")
        experts = np.require(experts, requirements=["C", "A"])
        router = None if router is None else _float_array("router", router, (E, H))
        if router_bias is not None:
            router_bias = _float_array("router_bias", router_bias, (E,))
        if router_logit_bias is not None:
            if router is None:
                raise invalid("router_logit_bias: given without a router")
            router_logit_bias = _float_array("router_logit_bias", router_logit_bias, (E,))
        for name, value, field in (("expert_bias", expert_bias, "expert_bias"),
                                   ("shared_expert", shared_expert, "shared_intermediate_size"),
                                   ("shared_expert_gate", shared_expert_gate, "shared_gate"),
                                   ("expert_scales", expert_scales, "scales_numel"),
                                   ("shared_expert_scales", shared_expert_scales, "shared_scales_numel")):
            asked = bool(getattr(config, field))
            if (value is not None) != asked:  # nothing given goes unused, nothing asked for is missing
                why = f"weight_dtype is {config.weight_dtype!r}" if field.endswith("scales_numel") and not config.fp8 \
                    else f"config.{field} is {getattr(config, field)!r}"
                raise invalid(f"{name}: {'missing' if asked else 'given'}, but {why}")
        if expert_scales is not None:
            expert_scales = _float_array("expert_scales", expert_scales, (E, config.scales_numel))
        if shared_expert_scales is not None:
            shared_expert_scales = _float_array("shared_expert_scales", np.asarray(shared_expert_scales).reshape(-1),
                                                (config.shared_scales_numel,))
        if expert_bias is not None:
            expert_bias = _float_array("expert_bias", np.asarray(expert_bias), (E, config.expert_bias_width))
        if shared_expert_gate is not None:
            shared_expert_gate = _float_array("shared_expert_gate", np.asarray(shared_expert_gate).reshape(-1), (H,))
        if shared_expert is not None:
            shared_expert = np.asarray(shared_expert)
            if shared_expert.dtype != storage:
                raise invalid(f"shared_expert: weight_dtype {config.weight_dtype} is stored as {storage}, "
                              f"got {shared_expert.dtype}")
            if shared_expert.size != config.shared_numel:
                raise invalid(f"shared_expert: expected {config.shared_numel} elements (3 * Fs={config.shared_intermediate_size}"
                              f" * H={H}), got {shared_expert.size}")
            shared_expert = np.require(shared_expert.reshape(-1), requirements=["C", "A"])
        if config.routing == "sigmoid_bias" and router is not None and router_bias is None and routing_fn is None:
            raise invalid(f"router_bias: sigmoid_bias routing needs router_bias [{E}]")
        if routing_fn is not None and device != "cpu":
            raise invalid("routing_fn: a Python routing function runs on the CPU only")
        for name, value in (("workspace_tokens", workspace_tokens), ("num_threads", num_threads)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise invalid(f"{name}: expected an integer >= 0, got {value!r}")

        self.config = dataclasses.replace(config, has_router=router is not None,
                                          has_router_logit_bias=router_logit_bias is not None)
        self.device = device if device == "cpu" else f"cuda:{device_id}"
        self.device_id = device_id
        self._device_type = dlpack.KDL_CPU if device == "cpu" else dlpack.KDL_CUDA
        self._routing_fn = routing_fn
        self._routing_error = None
        self._handle = ffi.new_handle(self) if routing_fn is not None else None
        self._lock = threading.Lock()

        cfg = self.config.to_c()
        cfg.workspace_tokens, cfg.num_threads = int(workspace_tokens), int(num_threads)
        cfg.device, cfg.device_id = DEVICE_CODES[device], device_id
        if routing_fn is not None:
            cfg.routing_fn, cfg.routing_user_data = lib.colibri_py_routing_fn, self._handle
        offsets_array = np.arange(E, dtype=np.uint64) * np.uint64(config.expert_numel)
        weights = ffi.new("colibri_moe_weights_t *")
        weights.expert_weights = _pointer("void *", experts)
        weights.expert_offsets = _pointer("uint64_t *", offsets_array)
        weights.expert_weights_numel = experts.size
        weights.expert_bias = _pointer("float *", expert_bias)
        weights.router_weight = _pointer("float *", router)
        weights.router_logit_bias = _pointer("float *", router_logit_bias)
        weights.router_bias = _pointer("float *", router_bias)
        weights.shared_weights = _pointer("void *", shared_expert)
        weights.shared_gate_weight = _pointer("float *", shared_expert_gate)
        weights.expert_scales = _pointer("float *", expert_scales)
        weights.shared_scales = _pointer("float *", shared_expert_scales)
        out = ffi.new("colibri_moe_context_t **")
        check(lib.colibri_moe_context_create(out, cfg, weights), "colibri_moe_context_create")
        self._ctx = ffi.gc(out[0], lib.colibri_moe_context_destroy)
        # On the CPU the context borrows the weights: they (and the mmap under them) live as long as it.
        self._experts = experts
        self._shared_expert = shared_expert
        self._keepalive = _keepalive

    @classmethod
    def from_file(cls, path, device="cpu", device_id=0, workspace_tokens=0, num_threads=0) -> "MoELayer":
        """Loads a packed *.colibri.safetensors checkpoint, memory-mapped (used in place on the CPU)."""
        from colibri.checkpoint import load
        return cls.from_checkpoint(load(path), path, device, device_id, workspace_tokens, num_threads)

    @classmethod
    def from_checkpoint(cls, ckpt, path, device="cpu", device_id=0, workspace_tokens=0, num_threads=0) -> "MoELayer":
        """The layer of a loaded colibri.checkpoint.Checkpoint (read from `path`, which errors name). Every
        weight is checked finite here, by the library."""
        try:
            return cls(ckpt.config, ckpt.experts, ckpt.router, ckpt.router_bias, device=device, device_id=device_id,
                       workspace_tokens=workspace_tokens, num_threads=num_threads, _keepalive=ckpt.file,
                       router_logit_bias=ckpt.router_logit_bias, expert_bias=ckpt.expert_bias,
                       shared_expert=ckpt.shared_expert, shared_expert_gate=ckpt.shared_expert_gate,
                       expert_scales=ckpt.expert_scales, shared_expert_scales=ckpt.shared_expert_scales)
        except ColibriError as error:  # e.g. a NaN in the router: say which file holds it
            raise ColibriError(f"{path}: {error.args[0]}", error.status) from error

    def __repr__(self) -> str:
        return f"MoELayer({self.config}, device={self.device!r})"

    # -----------------------------------------------------------------------------------------------

    def forward(self, hidden_states, topk_ids=None, topk_weights=None, stream=None, out=None, check_finite=False):
        """output [T, out_features] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]).

        hidden_states [T, H] fp32 | fp16 | bf16 and the optional routing topk_ids [T, k] int32 (int64 is
        range-checked, then converted) + topk_weights [T, k] float32 may be numpy arrays, torch or
        cupy tensors, colibri.Tensor, any DLPack producer or raw DLPack capsules (consumed), on the
        layer's device. Without routing the layer's router decides. The output has the input's dtype
        and kind (numpy -> numpy, torch -> torch, cupy -> cupy; capsules, other producers and bf16
        numpy-kind -> colibri.Tensor), or is written into `out` if given. On CUDA the work is
        enqueued on `stream` (int, cupy or torch stream; default: the input library's current
        stream) and not waited for. The layer's GPU workspace serves one call at a time: calls on
        different streams must be ordered by the caller (events, or a synchronisation), else they
        race on it (colibri.h, colibri_moe_forward).

        NaN or Inf in hidden_states is computed (it reaches only its own token's output) unless
        check_finite: then it is refused, naming the first row that holds one. On CUDA that check
        waits for the GPU (one synchronisation), so a forward with it cannot be captured in a CUDA
        graph; a server checking a batch of requests at once uses nonfinite_rows() instead."""
        views = []
        try:
            x, stream_ptr = self._take_hidden(hidden_states, stream, views)
            T = x.shape[0]
            if check_finite:
                row = first_nonfinite_rows([x], stream_ptr)[0]
                if row is not None:
                    raise invalid(f"hidden_states: not finite at row {row}")
            ids_ptr = weights_ptr = ffi.NULL
            if (topk_ids is None) != (topk_weights is None):
                missing = "topk_weights" if topk_weights is None else "topk_ids"
                raise invalid(f"{missing}: topk_ids and topk_weights must be given together")
            if topk_ids is None:
                if not self.config.has_router and self._routing_fn is None:
                    raise invalid("topk_ids: this layer has no router, so topk_ids and topk_weights are required")
            else:
                ids_ptr, weights_ptr = self._take_routing(topk_ids, topk_weights, T, stream_ptr, views)
            output, out_ptr = self._output(out, x, (T, self.config.out_features), x.dtype, "out", views)
            if isinstance(output, dlpack.Tensor) and self._device_type == dlpack.KDL_CUDA:
                output.stream = stream_ptr
            self._call("colibri_moe_forward", lib.colibri_moe_forward, T, DTYPE_CODES[x.dtype],
                       ffi.cast("void *", x.ptr), ids_ptr, weights_ptr, ffi.cast("void *", out_ptr),
                       ffi.cast("void *", stream_ptr))
            return output
        finally:
            for view in views:
                view.release()

    def route(self, hidden_states, stream=None):
        """The routing forward would use: (topk_ids [T, k] int32, topk_weights [T, k] float32), of the
        input's kind."""
        views = []
        try:
            x, stream_ptr = self._take_hidden(hidden_states, stream, views)
            if not self.config.has_router and self._routing_fn is None:
                raise invalid("hidden_states: this layer has no router and no routing_fn to route with")
            T, k = x.shape[0], self.config.top_k
            ids, ids_ptr = dlpack.allocate(x, (T, k), "int32")
            weights, weights_ptr = dlpack.allocate(x, (T, k), "fp32")
            self._call("colibri_moe_route", lib.colibri_moe_route, T, DTYPE_CODES[x.dtype],
                       ffi.cast("void *", x.ptr), ffi.cast("int32_t *", ids_ptr),
                       ffi.cast("float *", weights_ptr), ffi.cast("void *", stream_ptr))
            return ids, weights
        finally:
            for view in views:
                view.release()

    def expert_counts(self, reset=False) -> np.ndarray:
        """(token, expert) assignments per expert since init or the last reset: uint64 [E]."""
        counts = np.zeros(self.config.num_experts, np.uint64)
        with self._lock:
            check(lib.colibri_moe_context_expert_counts(
                self._ctx, ffi.cast("uint64_t *", counts.__array_interface__["data"][0]), int(bool(reset))),
                "colibri_moe_context_expert_counts")
        return counts

    # -----------------------------------------------------------------------------------------------

    def _call(self, what, function, *args) -> None:
        # One call at a time per context: the C context's workspace is not shareable between threads.
        with self._lock:
            self._routing_error = None
            status = function(self._ctx, *args)
            error, self._routing_error = self._routing_error, None
        if status != STATUS_OK and status == STATUS_ROUTING and error is not None:
            raise ColibriError(f"{what}: routing_fn raised {type(error).__name__}: {error}", status) from error
        check(status, what)

    def _take(self, name, value, stream_ptr, views):
        if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
            value = np.ascontiguousarray(value)  # numpy inputs are copied into row-major order
        view = dlpack.take(name, value, stream_ptr or None)
        views.append(view)
        on_device = view.device_type == dlpack.KDL_CUDA and view.device_id == self.device_id
        if (self._device_type == dlpack.KDL_CPU) != view.on_host or (not view.on_host and not on_device):
            raise invalid(f"{name}: on {view.device} but the layer runs on {self.device}")
        if not view.contiguous:
            raise invalid(f"{name}: not C-contiguous (make it contiguous first, e.g. .contiguous())")
        return view

    def _take_hidden(self, hidden_states, stream, views):
        stream_ptr = 0
        if self._device_type == dlpack.KDL_CUDA:
            stream_ptr = (dlpack.stream_handle(stream) if stream is not None
                          else dlpack.current_stream(dlpack.kind_of(hidden_states), self.device_id))
        x = self._take("hidden_states", hidden_states, stream_ptr, views)
        H = self.config.hidden_size
        if len(x.shape) != 2 or x.shape[1] != H:
            raise invalid(f"hidden_states: expected shape [T, {H}], got {list(x.shape)}")
        if x.dtype not in FLOAT_DTYPES:
            raise invalid(f"hidden_states: expected dtype fp32 | fp16 | bf16, got {x.dtype}")
        return x, stream_ptr

    def _take_routing(self, topk_ids, topk_weights, T, stream_ptr, views):
        E, k = self.config.num_experts, self.config.top_k
        ids = self._take("topk_ids", topk_ids, stream_ptr, views)
        weights = self._take("topk_weights", topk_weights, stream_ptr, views)
        for view in (ids, weights):
            if view.shape != (T, k):
                raise invalid(f"{view.name}: expected shape [{T}, {k}] (T from hidden_states), got {list(view.shape)}")
        if ids.dtype not in ("int32", "int64"):
            raise invalid(f"topk_ids: expected dtype int32 (or int64, converted), got {ids.dtype}")
        if weights.dtype != "fp32":
            raise invalid(f"topk_weights: expected dtype fp32, got {weights.dtype}")
        if T == 0:
            return ffi.cast("int32_t *", ids.ptr), ffi.cast("float *", weights.ptr)
        if ids.on_host:
            id_values, weight_values, to_host, library = ids.host_array(), weights.host_array(), np.asarray, np
        else:
            id_values, weight_values = dlpack.device_array(ids), dlpack.device_array(weights)
            library = sys.modules[type(id_values).__module__.split(".")[0]]
            to_host = device_to_host
        bad = (id_values < 0) | (id_values >= E)
        if bool(bad.any()):
            row = int((bad.any(1) * 1).argmax())
            value = int(to_host(id_values[row])[int((to_host(bad[row]) * 1).argmax())])
            raise invalid(f"topk_ids: expert id {value} out of range [0, {E}) at row {row}")
        bad = ~library.isfinite(weight_values)
        if bool(bad.any()):
            raise invalid(f"topk_weights: not finite at row {int((bad.any(1) * 1).argmax())}")
        ids_ptr = ids.ptr
        if ids.dtype == "int64":
            if ids.on_host:
                converted = id_values.astype(np.int32)
                ids_ptr = converted.__array_interface__["data"][0]
            else:
                converted, ids_ptr = _device_int32(id_values)
            views.append(_Holder(converted))
        return ffi.cast("int32_t *", ids_ptr), ffi.cast("float *", weights.ptr)

    def _output(self, out, x, shape, dtype, name, views):
        if out is None:
            return dlpack.allocate(x, shape, dtype)
        view = self._take(name, out, 0, views)
        if view.shape != shape or view.dtype != dtype:
            raise invalid(f"{name}: expected shape {list(shape)} and dtype {dtype}, got {list(view.shape)} {view.dtype}")
        return out, view.ptr


class _Holder:
    """Keeps a converted array alive until the call's views are released."""
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def release(self):
        self.array = None


def _device_int32(array):
    """An int32 copy of a torch or cupy array, and its data pointer."""
    if hasattr(array, "data_ptr"):
        converted = array.to(sys.modules["torch"].int32)  # a torch array: torch is imported
        return converted, converted.data_ptr()
    converted = array.astype("int32")
    return converted, converted.data.ptr


@ffi.def_extern(error=STATUS_ROUTING)
def colibri_py_routing_fn(user_data, num_tokens, num_experts, top_k, act_dtype, hidden_states, router_logits,
                          topk_ids, topk_weights, stream):
    layer = ffi.from_handle(user_data)
    try:
        H = layer.config.hidden_size
        dtype = next(name for name, code in DTYPE_CODES.items() if code == act_dtype)
        storage = STORAGE[dtype]
        x = np.frombuffer(ffi.buffer(ffi.cast("char *", hidden_states), num_tokens * H * storage.itemsize),
                          storage).reshape(num_tokens, H)
        logits = None
        if router_logits != ffi.NULL:
            logits = np.frombuffer(ffi.buffer(router_logits, num_tokens * num_experts * 4),
                                   np.float32).reshape(num_tokens, num_experts)
        ids, weights = layer._routing_fn(x, logits)
        ids, weights = np.asarray(ids), np.asarray(weights)
        if ids.shape != (num_tokens, top_k) or weights.shape != (num_tokens, top_k):
            raise ValueError(f"routing_fn returned shapes {list(ids.shape)} and {list(weights.shape)}, "
                             f"expected [{num_tokens}, {top_k}]")
        np.frombuffer(ffi.buffer(topk_ids, num_tokens * top_k * 4), np.int32)[:] = ids.reshape(-1)
        np.frombuffer(ffi.buffer(topk_weights, num_tokens * top_k * 4), np.float32)[:] = weights.reshape(-1)
        return STATUS_OK
    except Exception as exc:  # reported by MoELayer._call with the cause attached
        layer._routing_error = exc
        return STATUS_ROUTING
