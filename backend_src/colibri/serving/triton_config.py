"""What a Triton Python model serving a Colibri checkpoint needs from it before loading it: the path
to serve, and the feature dims of colibri_moe's tensors for the backend's `auto_complete_config`.

config.pbtxt declares the tensors' names, data types and optional flags but no dims, because the
checkpoint, chosen at start, fixes H and k: the Python backend's ModelConfig.add_input/add_output
fill in dims a config leaves empty, and refuse to change declared ones (even -1). With the dims
known, Triton's model metadata and config tell clients H and k, and Triton refuses a request of the
wrong width itself, naming the input. Only the checkpoint's header is read here.

The served checkpoint's identity (colibri.serving.identity) goes into the config as parameters
COLIBRI_CHECKPOINT_*, so `GET /v2/models/colibri_moe/config` tells what is served. Auto-complete
cannot add them: tritonserver keeps only the max_batch_size, tensors, scheduling and transaction
policy that `auto_complete_config` returns and drops its parameters. So the launchers (`colibri
serve`, the image's entrypoint through `python -m colibri stage`) serve a copy of the model
repository made of links whose config.pbtxt names the checkpoint (stage_repository).
"""
import datetime
import json
import os
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from colibri import model_folder
from colibri.dtypes import DTYPES
from colibri.serving import identity


def weights_path(model_config: dict, version_dir: str) -> str:
    """The checkpoint (a packed file, or a folder of layer files: colibri.model_folder):
    $COLIBRI_WEIGHTS (the launcher sets it) or the config parameter of that name, relative to the
    version folder (an absolute path replaces it)."""
    weights = os.environ.get("COLIBRI_WEIGHTS") or model_config["parameters"]["COLIBRI_WEIGHTS"]["string_value"]
    return os.path.join(version_dir, weights)


class InstanceSettings(NamedTuple):
    """What a model instance takes from Triton's `initialize(args)`, its model config read once."""
    weights: str                  # the checkpoint's path (weights_path)
    on_gpu: bool                  # a KIND_GPU instance
    device_id: int
    metric_labels: dict           # model and version, for the instance's metrics
    metrics_interval: float       # seconds (metrics_interval)
    warmup_tokens: list           # token counts of the warm-up forwards (warmup_tokens)
    activation_dtype: str         # of hidden_states on the wire (activation_dtype)
    known_identity: Optional[identity.Identity]  # the checkpoint's, as the launcher wrote it, or None

    def checkpoint_identity(self) -> identity.Identity:
        """The identity of the checkpoint loaded: the launcher's, if the file is unchanged since."""
        return identity.of(self.weights, known=self.known_identity)


def instance_settings(args: dict) -> InstanceSettings:
    """The settings of the model instance that `initialize(args)` describes; raises ValueError naming
    a config parameter that is not valid."""
    config = json.loads(args["model_config"])
    on_gpu = args["model_instance_kind"] == "GPU"
    return InstanceSettings(
        weights=weights_path(config, os.path.join(args["model_repository"], args["model_version"])),
        on_gpu=on_gpu, device_id=int(args["model_instance_device_id"]),
        metric_labels={"model": args["model_name"], "version": args["model_version"]},
        metrics_interval=metrics_interval(config), warmup_tokens=warmup_tokens(config, on_gpu),
        activation_dtype=activation_dtype(config), known_identity=identity_in_config(config))


def metrics_interval(model_config: dict) -> float:
    """Seconds between flushes of the per-expert token counters to Triton: config parameter
    COLIBRI_METRICS_INTERVAL_S, default 1 (0: after every batch)."""
    parameters = model_config.get("parameters", {})
    text = parameters.get("COLIBRI_METRICS_INTERVAL_S", {}).get("string_value", "1")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0.0:  # NaN too
        raise ValueError(f"config parameter COLIBRI_METRICS_INTERVAL_S: {text!r} is not a number of seconds >= 0")
    return value


def warmup_tokens(model_config: dict, on_gpu: bool) -> list:
    """Token counts of the warm-up forwards an instance runs before it reports ready (config parameter
    COLIBRI_WARMUP, 'yes' (default) or 'no': none). On a GPU the kernels differ with the tokens per
    expert, so decode to a full batch (capped at max_batch_size); on the CPU one token is enough."""
    text = model_config.get("parameters", {}).get("COLIBRI_WARMUP", {}).get("string_value", "yes").strip().lower()
    if text not in ("yes", "no"):
        raise ValueError(f"config parameter COLIBRI_WARMUP: {text!r} is not 'yes' or 'no'")
    if text == "no":
        return []
    most = int(model_config.get("max_batch_size", 0)) or 4096
    return sorted({min(t, most) for t in (1, 64, 512, 4096)}) if on_gpu else [1]


# Activation dtypes as Triton's config names them (`colibri serve --dtype` writes these too).
TRITON_DTYPES = {name: d.triton for name, d in DTYPES.items() if d.triton}


def activation_dtype(model_config: dict) -> str:
    """The dtype of hidden_states on the wire ('fp32' | 'fp16' | 'bf16'), from the loaded config."""
    for tensor in model_config.get("input", []):
        if tensor.get("name") == "hidden_states":
            return next((d for d, t in TRITON_DTYPES.items() if t == tensor.get("data_type")), "fp32")
    return "fp32"


def complete(auto_complete_model_config, version_dir: str):
    """auto_complete_config for a model with colibri_moe's tensors: dims [H] for hidden_states,
    [k] for topk_ids and topk_weights, [out_features] for output (every layer's, for a folder: they
    share them), [1] for layer (one value per token row: tokens are the batch dimension); the
    declared data types (the launcher's --dtype rewrite) are kept."""
    declared = auto_complete_model_config.as_dict()
    layer = model_folder.read(weights_path(declared, version_dir)).config
    dims = {"hidden_states": layer.hidden_size, "topk_ids": layer.top_k, "topk_weights": layer.top_k,
            "output": layer.out_features, "layer": 1}
    for tensor in declared["input"]:
        auto_complete_model_config.add_input(
            {"name": tensor["name"], "data_type": tensor["data_type"], "dims": [dims[tensor["name"]]]})
    for tensor in declared["output"]:
        auto_complete_model_config.add_output(
            {"name": tensor["name"], "data_type": tensor["data_type"], "dims": [dims[tensor["name"]]]})
    return auto_complete_model_config


IDENTITY_PREFIX = "COLIBRI_CHECKPOINT_"
IDENTITY_FIELDS = ("FILE", "BYTES", "MODIFIED", "SHA256", "DEMO", "SOURCE")
# A folder's layer numbers, "0,2,5" (absent for a single file): what the probe and clients may send as `layer`.
LAYERS_PARAMETER = "COLIBRI_LAYERS"


def identity_parameters(ident: identity.Identity) -> dict:
    """The config parameters (name -> string) that name a checkpoint."""
    values = (ident.path, str(ident.size), ident.modified, ident.sha256, "yes" if ident.demo else "no", ident.source)
    parameters = {IDENTITY_PREFIX + field: value for field, value in zip(IDENTITY_FIELDS, values)}
    if ident.files:
        numbers = [model_folder.LAYER_FILE.match(os.path.basename(f.path)).group(1) for f in ident.files]
        parameters[LAYERS_PARAMETER] = ",".join(sorted(numbers, key=int))
    return parameters


def identity_in_config(model_config: dict) -> Optional[identity.Identity]:
    """The identity a launcher wrote into the config, or None if it wrote none."""
    parameters = model_config.get("parameters", {})
    values = {field: parameters.get(IDENTITY_PREFIX + field, {}).get("string_value") for field in IDENTITY_FIELDS}
    if None in values.values():
        return None
    try:
        modified = datetime.datetime.strptime(values["MODIFIED"], "%Y-%m-%dT%H:%M:%SZ")
        seconds = int(modified.replace(tzinfo=datetime.timezone.utc).timestamp())
        return identity.Identity(values["FILE"], int(values["BYTES"]), seconds * 1_000_000_000, values["SHA256"],
                                 values["DEMO"] == "yes", values["SOURCE"])
    except ValueError:
        return None


def pbtxt_string(text: str) -> str:
    """A protobuf text-format string literal: quotes, backslashes and anything outside printable ASCII
    escaped (the latter as octal bytes of its UTF-8)."""
    out = []
    for byte in text.encode("utf-8"):
        char = chr(byte)
        if char in "\\\"":
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def with_identity(config_text: str, ident: identity.Identity) -> str:
    """config.pbtxt with the checkpoint's identity added as parameters (a second `parameters` list: the
    text format merges repeated fields)."""
    entries = ",\n".join(f"  {{ key: {pbtxt_string(k)} value: {{ string_value: {pbtxt_string(v)} }} }}"
                         for k, v in identity_parameters(ident).items())
    return (config_text.rstrip("\n") + "\n\n# The checkpoint served (added by the launcher; "
            "colibri.serving.triton_config.stage_repository)\nparameters [\n" + entries + "\n]\n")


def stage_repository(repository, out, model: str, weights, rewrite: Optional[Callable[[str], str]] = None):
    """Makes `out` a copy of the model repository made of links, with `model`'s config.pbtxt rewritten
    (by `rewrite`, if given) and naming the checkpoint `weights`. Returns the checkpoint's identity."""
    repository, out = Path(repository), Path(out)
    config = repository / model / "config.pbtxt"
    if not config.is_file():
        raise FileNotFoundError(f"{repository} has no {model}/config.pbtxt")
    ident = identity.of(weights)
    for folder in sorted(p for p in repository.iterdir() if p.is_dir()):
        target = out / folder.name
        target.mkdir(parents=True)
        for entry in folder.iterdir():
            if entry == config:
                text = rewrite(entry.read_text()) if rewrite else entry.read_text()
                (target / entry.name).write_text(with_identity(text, ident))
            else:
                (target / entry.name).symlink_to(entry.resolve())
    return ident
