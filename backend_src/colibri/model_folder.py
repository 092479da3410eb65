"""What a weights path serves: one packed file (one layer, requests name none), or a folder of
`layer{N}.colibri.safetensors` files, as `pack --layer all` writes, served side by side and named by
N, the decoder layer's index (not a count: DeepSeek's first layer is dense, so its folder starts at
layer1). Only headers are read here; each file is checked by colibri.checkpoint, naming it.

A folder's layers share one request shape: the same hidden size H, output width and top-k (k fixes
the width of topk_ids, which Triton checks per model, not per layer). Experts, dtypes, routing and
intermediate sizes may differ from layer to layer. Anything else is refused in one line naming files.
"""
import re
from pathlib import Path
from typing import Dict, NamedTuple, Optional

from colibri import checkpoint
from colibri._native import invalid
from colibri.config import LayerConfig

LAYER_FILE = re.compile(r"^layer([0-9]{1,6})\.colibri\.safetensors$")
LAYER_PATTERN = "layer{N}.colibri.safetensors"


class Served(NamedTuple):
    """The layers a weights path serves: {N: file} for a folder, {None: file} for a single file."""
    path: Path
    files: Dict[Optional[int], Path]
    configs: Dict[Optional[int], LayerConfig]

    @property
    def is_folder(self) -> bool:
        return None not in self.files

    @property
    def numbers(self) -> list:
        """The layer numbers a request may name (none for a single file)."""
        return sorted(n for n in self.files if n is not None)

    @property
    def config(self) -> LayerConfig:
        """The first layer's config: H, k and the output width are every layer's."""
        return next(iter(self.configs.values()))

    def describe_numbers(self) -> str:
        return "layers " + ", ".join(map(str, self.numbers)) if self.is_folder else "one layer"


def layer_files(folder) -> Dict[int, Path]:
    """{N: path} of the folder's layer{N}.colibri.safetensors files, by N; refuses a folder without any."""
    folder = Path(folder)
    found = {}
    for path in folder.iterdir():
        match = LAYER_FILE.match(path.name)
        if match:
            number = int(match.group(1))
            if number in found:  # layer01 and layer1: which one is layer 1 is not for us to guess
                raise invalid(f"{folder}: {found[number].name} and {path.name} both name layer {number}")
            found[number] = path
    if not found:
        raise invalid(f"{folder}: no {LAYER_PATTERN} files (`python -m colibri pack SRC --layer all --out "
                      f"{folder}` writes them)")
    return dict(sorted(found.items()))


def read(path) -> Served:
    """The layers `path` serves (a packed file or a folder of layer files), their configs read from
    the headers and checked to share one request shape. Raises ColibriError in one line."""
    path = Path(path)
    files = layer_files(path) if path.is_dir() else {None: path}
    configs = {n: checkpoint.read_config(f) for n, f in files.items()}  # errors name the file
    first_n, first = next(iter(configs.items()))
    for n, config in configs.items():
        for what, field in (("hidden size", "hidden_size"), ("output width", "out_features"), ("top_k", "top_k")):
            if getattr(config, field) != getattr(first, field):
                raise invalid(f"{path}: the layers of a folder must share one {what} (one request shape): "
                              f"{files[first_n].name} has {getattr(first, field)}, {files[n].name} has "
                              f"{getattr(config, field)}")
    return Served(path, files, configs)
