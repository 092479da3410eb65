"""What a Triton Python model serving a Colibri checkpoint needs from it before loading it: the path
to serve, and the feature dims of colibri_moe's tensors for the backend's `auto_complete_config`.

config.pbtxt declares the tensors' names, data types and optional flags but no dims, because the
checkpoint, chosen at start, fixes H and k: the Python backend's ModelConfig.add_input/add_output
fill in dims a config leaves empty, and refuse to change declared ones (even -1). With the dims
known, Triton's model metadata and config tell clients H and k, and Triton refuses a request of the
wrong width itself, naming the input. Only the checkpoint's header is read here.
"""
import json
import os

from colibri import checkpoint


def weights_path(model_config: dict, version_dir: str) -> str:
    """The checkpoint: $COLIBRI_WEIGHTS (the launcher sets it) or the config parameter of that name,
    relative to the version folder (an absolute path replaces it)."""
    weights = os.environ.get("COLIBRI_WEIGHTS") or model_config["parameters"]["COLIBRI_WEIGHTS"]["string_value"]
    return os.path.join(version_dir, weights)


def instance_weights_path(args: dict) -> str:
    """weights_path for the model instance that Triton's `initialize(args)` describes."""
    return weights_path(json.loads(args["model_config"]), os.path.join(args["model_repository"], args["model_version"]))


def metrics_interval(args: dict) -> float:
    """Seconds between flushes of the per-expert token counters to Triton: config parameter
    COLIBRI_METRICS_INTERVAL_S, default 1 (0: after every batch)."""
    parameters = json.loads(args["model_config"]).get("parameters", {})
    text = parameters.get("COLIBRI_METRICS_INTERVAL_S", {}).get("string_value", "1")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0.0:  # NaN too
        raise ValueError(f"config parameter COLIBRI_METRICS_INTERVAL_S: {text!r} is not a number of seconds >= 0")
    return value


def warmup_tokens(args: dict, on_gpu: bool) -> list:
    """Token counts of the warm-up forwards an instance runs before it reports ready (config parameter
    COLIBRI_WARMUP, 'yes' (default) or 'no': none). On a GPU the kernels differ with the tokens per
    expert, so decode to a full batch (capped at max_batch_size); on the CPU one token is enough."""
    config = json.loads(args["model_config"])
    text = config.get("parameters", {}).get("COLIBRI_WARMUP", {}).get("string_value", "yes").strip().lower()
    if text not in ("yes", "no"):
        raise ValueError(f"config parameter COLIBRI_WARMUP: {text!r} is not 'yes' or 'no'")
    if text == "no":
        return []
    most = int(config.get("max_batch_size", 0)) or 4096
    return sorted({min(t, most) for t in (1, 64, 512, 4096)}) if on_gpu else [1]


# Activation dtypes as Triton's config names them (`colibri serve --dtype` writes these too).
TRITON_DTYPES = {"fp32": "TYPE_FP32", "fp16": "TYPE_FP16", "bf16": "TYPE_BF16"}


def activation_dtype(args: dict) -> str:
    """The dtype of hidden_states on the wire ('fp32' | 'fp16' | 'bf16'), from the loaded config."""
    for tensor in json.loads(args["model_config"]).get("input", []):
        if tensor.get("name") == "hidden_states":
            return next((d for d, t in TRITON_DTYPES.items() if t == tensor.get("data_type")), "fp32")
    return "fp32"


def complete(auto_complete_model_config, version_dir: str):
    """auto_complete_config for a model with colibri_moe's tensors: dims [H] for hidden_states,
    [k] for topk_ids and topk_weights, [out_features] for output; the declared data types (the
    launcher's --dtype rewrite) are kept."""
    declared = auto_complete_model_config.as_dict()
    layer = checkpoint.read_config(weights_path(declared, version_dir))
    dims = {"hidden_states": layer.hidden_size, "topk_ids": layer.top_k, "topk_weights": layer.top_k,
            "output": layer.out_features}
    for tensor in declared["input"]:
        auto_complete_model_config.add_input(
            {"name": tensor["name"], "data_type": tensor["data_type"], "dims": [dims[tensor["name"]]]})
    for tensor in declared["output"]:
        auto_complete_model_config.add_output(
            {"name": tensor["name"], "data_type": tensor["data_type"], "dims": [dims[tensor["name"]]]})
    return auto_complete_model_config
