"""A Hugging Face MoE model without its experts: which decoder layers hold an MoE block (read from the
model transformers builds, so DeepSeek's first dense layers or Qwen's decoder_sparse_step come from the
model's own code), those blocks replaced, and only the remaining weights read from the safetensors shards.

The model is built on the meta device (no memory), the MoE blocks swapped for parameter-free ones, the
rest materialised on the target device, the non-persistent buffers (rotary inv_freq) computed again by
transformers' own _init_weights, and every other tensor of the state dict read from the checkpoint:
a missing one is refused rather than left random."""
import json
import pathlib

import numpy as np
import torch

from colibri._native import invalid
from colibri.pack.families import BLOCK_CLASSES

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# Safetensors dtypes of the non-expert weights the tier reads (quantised attention is refused).
STORED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def torch_dtype(dtype):
    """A torch dtype from a torch dtype, a name (bf16, float32, ...) or None (None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) not in DTYPES:
        raise invalid(f"dtype: expected one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    return DTYPES[str(dtype)]


def block_class(model_type):
    """transformers' MoE block class of the family, or a one-line refusal."""
    import importlib
    if model_type not in BLOCK_CLASSES:
        raise invalid(f"model_type {model_type!r} is not an MoE family the attention tier knows (known: "
                      f"{', '.join(BLOCK_CLASSES)})")
    module, name = BLOCK_CLASSES[model_type]
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def decoder_layers(model):
    """The decoder layers of a transformers causal LM (model.model.layers)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise invalid(f"{type(model).__name__}: no model.layers, not a decoder-only causal LM")
    return layers


def moe_blocks(model):
    """{decoder layer index: (the layer, the attribute holding its MoE block)}, from the model's structure."""
    cls = block_class(model.config.model_type)
    found = {}
    for index, layer in enumerate(decoder_layers(model)):
        for name, child in layer.named_children():
            if isinstance(child, (cls, _replaced())):
                found[index] = (layer, name)
    return found


def _replaced():
    from colibri.attention.blocks import _Block
    return _Block


def moe_layers(model):
    """The sorted indices of the model's MoE layers; a model with none is refused in one line."""
    found = sorted(moe_blocks(model))
    if not found:
        raise invalid(f"{model.config.model_type} model of {len(decoder_layers(model))} layers has no MoE block "
                      f"({block_class(model.config.model_type).__name__}): nothing for the expert tier to serve")
    return found


def replace_moe_blocks(model, make_block):
    """Replaces each MoE block by make_block(layer index)."""
    for index, (layer, name) in moe_blocks(model).items():
        setattr(layer, name, make_block(index))


def read_config(model_dir):
    from transformers import AutoConfig
    folder = pathlib.Path(model_dir)
    if not (folder / "config.json").is_file():
        raise invalid(f"model {folder}: no config.json (a Hugging Face model folder is needed)")
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except ValueError as exc:
        raise invalid(f"model {folder}: config.json is not valid JSON ({exc})") from None
    block_class(model_type)  # refuses a family without MoE blocks before transformers builds anything
    return AutoConfig.from_pretrained(folder)


def build_without_experts(config, make_block, device="cpu", dtype=None, check=None):
    """(the causal LM of `config` with its MoE blocks replaced by make_block(index), their indices) on
    `device` in `dtype` (None: the config's dtype, else float32), its non-persistent buffers computed and
    its parameters not yet set. Built on the meta device, so the experts never take memory; check(indices,
    config) runs before any memory is allocated."""
    from transformers import AutoModelForCausalLM
    dtype = torch_dtype(dtype) or _config_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    indices = moe_layers(model)
    if check is not None:
        check(indices, model.config)
    replace_moe_blocks(model, make_block)
    model.to_empty(device=device)
    _recompute_non_persistent_buffers(model)
    return model, indices


def load_without_experts(model_dir, make_block, device="cpu", dtype=None, check=None):
    """build_without_experts of model_dir's config.json, every remaining weight read from its safetensors
    shards (no expert weight is read)."""
    from colibri.pack.source import _Source
    model, indices = build_without_experts(read_config(model_dir), make_block, device, dtype, check)
    _load_tensors(model, _Source(model_dir), model_dir)
    return model, indices


def random_without_experts(config, make_block, device="cpu", dtype=None, check=None, seed=0):
    """build_without_experts with random parameters, drawn as transformers initialises the model
    (_init_weights of each module, seeded): a model of a released shape without its weights."""
    model, indices = build_without_experts(config, make_block, device, dtype, check)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))
        torch.manual_seed(seed)
        for module in model.modules():
            model._init_weights(module)
    for name, parameter in model.named_parameters():
        if torch.isnan(parameter).any():
            raise invalid(f"{name}: transformers' _init_weights of {type(model).__name__} does not set this "
                          "parameter; the attention tier cannot draw this model at random")
    return model, indices


def _config_dtype(config):
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return DTYPES.get(str(value).removeprefix("torch."), torch.float32)


def _recompute_non_persistent_buffers(model):
    """Non-persistent buffers are in no checkpoint: transformers computes them (e.g. rotary inv_freq
    from rope_theta) in _init_weights, run here on the modules that hold them. Each is poisoned first,
    so one that _init_weights does not compute is refused, not used as uninitialised memory."""
    owners = {}
    for name, buffer in model.named_non_persistent_buffers():
        if not buffer.is_floating_point():
            raise invalid(f"{name}: a non-persistent {buffer.dtype} buffer the attention tier cannot recompute")
        buffer.fill_(float("nan"))
        owner = name.rpartition(".")[0]
        owners[owner] = model.get_submodule(owner)
    with torch.no_grad():
        for module in owners.values():
            model._init_weights(module)
    for name, buffer in model.named_non_persistent_buffers():
        if torch.isnan(buffer).any():
            raise invalid(f"{name}: transformers' _init_weights of {type(model).__name__} does not compute this "
                          "non-persistent buffer; the attention tier cannot build this model without its experts")


def _load_tensors(model, source, model_dir):
    """Every tensor of the model's state dict from the checkpoint (tied ones once), cast to its dtype."""
    state = model.state_dict()
    loaded, missing = {}, []
    for name, target in state.items():
        if target.data_ptr() in loaded:  # tied to a tensor already read (lm_head and embed_tokens)
            continue
        if name not in source:
            missing.append(name)
            continue
        info = source.info(name)
        if info.dtype not in STORED:
            raise invalid(f"model {model_dir}: {name} is stored as {info.dtype}; the attention tier reads "
                          f"{', '.join(STORED)} weights (dequantise the non-expert weights first)")
        if tuple(info.shape) != tuple(target.shape):
            raise invalid(f"model {model_dir}: {name} has shape {list(info.shape)}, the model expects "
                          f"{list(target.shape)}")
        array = np.array(source.get(name))  # a writable copy of the memory map, as torch wants
        value = torch.from_numpy(array.view("int16")).view(torch.bfloat16) if info.dtype == "BF16" \
            else torch.from_numpy(array)
        with torch.no_grad():
            target.copy_(value)
        loaded[target.data_ptr()] = name
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise invalid(f"model {model_dir}: {len(missing)} non-expert weight(s) missing from its safetensors: {shown}")
