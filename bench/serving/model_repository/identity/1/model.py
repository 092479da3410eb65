"""An empty Triton Python model with colibri_moe's inputs and outputs: `output` is `hidden_states`,
handed back through DLPack. Its latency under load is the round trip every Python model pays
(transport, dynamic batcher, stub IPC), the floor under colibri_moe's and torch_moe's.
bench/serving/compare.py gives it colibri_moe's config with the name changed, whose dims come from
the checkpoint's header as colibri_moe's do."""
import os

import triton_python_backend_utils as pb_utils

from colibri.serving import triton_config


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return triton_config.complete(auto_complete_model_config, os.path.dirname(os.path.abspath(__file__)))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
                    "output", pb_utils.get_input_tensor_by_name(request, "hidden_states").to_dlpack())])
                for request in requests]
