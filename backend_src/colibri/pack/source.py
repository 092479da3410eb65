"""Where a checkpoint's tensors are: the shards of a file, a folder or a model.safetensors.index.json,
read lazily through memory maps (nothing is unpickled), and the reads every part of pack shares."""
import json
import pathlib

import numpy as np

from colibri import safetensors_io as st
from colibri._native import STATUS_INVALID_ARGUMENT, ColibriError
from colibri.dtypes import to_float32


def _fail(message) -> ColibriError:
    return ColibriError(message, STATUS_INVALID_ARGUMENT)


class _Source:
    """Tensor name -> the shard holding it, for a file, a folder of shards or an index json."""

    def __init__(self, src):
        path = pathlib.Path(src)
        if path.suffix in st.PICKLE_SUFFIXES:
            raise _fail(f"{path}: {st.PICKLE_REFUSAL}")
        if not path.exists():
            raise _fail(f"{path}: no such file or folder")
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            self.folder = path
            if index.is_file():
                shards = self._read_index(index)
            else:
                files = sorted(p for p in path.glob("*.safetensors") if not p.name.endswith(".colibri.safetensors"))
                if not files:
                    pickles = sorted(p.name for p in path.iterdir() if p.suffix in st.PICKLE_SUFFIXES)
                    raise _fail(f"{path}: no .safetensors files" + (
                        f" (only {', '.join(pickles)}: {st.PICKLE_REFUSAL})" if pickles else ""))
                shards = {f: None for f in files}
        elif path.name.endswith(".json"):
            self.folder = path.parent
            shards = self._read_index(path)
        elif path.suffix == ".safetensors":
            self.folder = path.parent
            shards = {path: None}
        else:
            raise _fail(f"{path}: expected a .safetensors file, a folder of shards or a model.safetensors.index.json")
        self.files, self.where = {}, {}
        for shard, names in shards.items():
            try:
                file = st.SafetensorsFile(shard)
            except FileNotFoundError:
                raise _fail(f"{shard}: shard listed in the index does not exist") from None
            except st.SafetensorsError as exc:
                raise _fail(str(exc)) from None
            self.files[shard] = file
            for name in (file.keys() if names is None else names):
                if name not in file:
                    raise _fail(f"{shard}: the index lists tensor {name!r} but the shard lacks it")
                self.where[name] = file

    @staticmethod
    def _read_index(index: pathlib.Path) -> dict:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _fail(f"{index}: not a safetensors index with a weight_map ({exc})") from None
        shards = {}
        for name, shard in weight_map.items():
            shards.setdefault(index.parent / shard, []).append(name)
        return shards

    def __contains__(self, name) -> bool:
        return name in self.where

    def info(self, name) -> st.TensorInfo:
        return self.where[name].tensors[name]

    def get(self, name) -> np.ndarray:
        return self.where[name].get(name)


def _expect_shape(source, name, shape) -> None:
    if name not in source:
        raise _fail(f"missing tensor {name}")
    actual = source.info(name).shape
    if actual != tuple(shape):
        raise _fail(f"{name}: shape {list(actual)}, expected {list(shape)}")


def _as_float32(source, name) -> np.ndarray:
    info = source.info(name)
    if info.dtype == "F64":
        return source.get(name).astype(np.float32)
    if info.dtype not in st.SAFETENSORS_TO_COLIBRI:
        raise _fail(f"{name}: dtype {info.dtype} is not supported")
    return to_float32(source.get(name), st.SAFETENSORS_TO_COLIBRI[info.dtype])
