"""A stand-in for triton_python_backend_utils, enough to run model.py's initialize and execute in
this process: a request is a dict of input name -> Tensor over any DLPack array (numpy; torch on a
GPU, as CUDA shared memory hands them to the model), so one call to execute is one exact batch."""
import importlib.util
import json
import sys

from colibri.testing.server import REPO_ROOT

MODEL_PY = REPO_ROOT / "model_repository" / "colibri_moe" / "1" / "model.py"


class Tensor:
    def __init__(self, name, array):
        self._name, self.array = name, array

    def name(self):
        return self._name

    def shape(self):
        return list(self.array.shape)

    def to_dlpack(self):
        return self.array.__dlpack__()

    def is_cpu(self):
        return self.array.__dlpack_device__()[0] == 1  # kDLCPU

    @staticmethod
    def from_dlpack(name, array):
        return Tensor(name, array)


class TritonError:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code=INTERNAL):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors or [], error


class Logger:
    @staticmethod
    def log_info(message):
        pass

    log_error = log_info


class MetricFamily:
    """Records what model.py reports: families[name].metrics[labels as a sorted tuple] holds the
    increments (counters) or observations (histograms) in the order they came."""
    COUNTER, HISTOGRAM = "counter", "histogram"
    families = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, {}
        MetricFamily.families[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (the backend's name)
        return _Metric(self.metrics.setdefault(tuple(sorted(labels.items())), []))


class _Metric:
    def __init__(self, calls):
        self.calls = calls

    def increment(self, value):
        self.calls.append(value)

    observe = increment


def get_input_tensor_by_name(request, name):
    return request.get(name)


def load_model(monkeypatch, weights, kind="CPU", device_id=0, parameters=None):
    """model.py's TritonPythonModel, initialized on weights for an instance of kind (CPU | GPU), with
    config parameters {key: string value}."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", sys.modules[__name__])
    monkeypatch.setenv("COLIBRI_WEIGHTS", str(weights))
    return initialize(MODEL_PY, "colibri_moe", weights, kind, device_id, parameters)


def initialize(model_py, name, weights, kind="CPU", device_id=0, parameters=None):
    """The TritonPythonModel of the model.py at model_py, initialized as Triton would for an instance
    of kind; triton_python_backend_utils must already be this module and COLIBRI_WEIGHTS set."""
    spec = importlib.util.spec_from_file_location(f"{name}_model_under_test", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    MetricFamily.families.clear()
    config = {"parameters": {key: {"string_value": value} for key, value in (parameters or {}).items()}}
    model.initialize({"model_config": json.dumps(config), "model_instance_kind": kind,
                      "model_instance_device_id": str(device_id), "model_repository": str(weights.parent),
                      "model_version": "1", "model_name": name})
    return model


def request(**arrays):
    return {name: Tensor(name, array) for name, array in arrays.items()}
