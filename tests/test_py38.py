"""What runs inside the CUDA 11.8 image must run on its Python 3.8.

tritonserver 22.12 (docker/Dockerfile, CUDA_STACK=11) runs model.py in the image's own Python 3.8, and
the entrypoint runs `python3 -m colibri demo` there; the build stage runs _ffi_build.py with the same
Python. No 3.8 interpreter is at hand here (CI and developers run 3.10+), so vermin checks statically
that those modules need nothing newer than 3.8: syntax, standard-library modules, functions and
keyword arguments (dataclass(kw_only=...), str.removeprefix, functools.cache, zip(strict=), ...).
vermin flags `X | None` even under `from __future__ import annotations`, so these modules spell
Optional[X]. It cannot see everything (a `|` between two dict variables, an API of numpy or cffi that
the 3.8 pins lack): those need review, or a run on the image.
The developer tools (pack, bench, the serve launcher, testing, reference) and the tests may use 3.10+.
"""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri.testing import fake_backend

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "backend_src" / "colibri"
MODEL_PY = REPO / "model_repository" / "colibri_moe" / "1" / "model.py"
TARGET = "3.8"

# What starts the walk: Triton imports model.py, the entrypoint runs __main__ (its demo command),
# the build stage runs _ffi_build.py and, for `pip wheel`, setup.py.
ROOTS = [MODEL_PY, PACKAGE / "__main__.py", PACKAGE / "_ffi_build.py", PACKAGE.parent / "setup.py"]
# Imported only for developer commands, which are documented as 3.10+ (backend_src/pyproject.toml):
# modules, or packages with everything in them, as paths under colibri/ without .py.
DEVELOPER_TOOLS = {"pack", "serving/launcher", "bench", "testing", "reference"}
# The modules the walk must find, so that a change to how it reads imports cannot shrink the check.
KNOWN_RUNTIME = {"__init__", "__main__", "_native", "_ffi_build", "config", "dlpack", "dtypes", "layer", "checkpoint",
                 "nonfinite", "safetensors_io", "serving/__init__", "serving/batching", "serving/identity",
                 "serving/metrics", "serving/triton_config", "serving/watchdog"}


def module_name(path) -> str:
    """A file of the package as DEVELOPER_TOOLS and KNOWN_RUNTIME name it: serving/watchdog."""
    return path.relative_to(PACKAGE).with_suffix("").as_posix()


def developer_tool(path) -> bool:
    name = module_name(path)
    return any(name == tool or name.startswith(tool + "/") for tool in DEVELOPER_TOOLS)


def colibri_imports(path):
    """Files of colibri's modules a file imports anywhere in it (function bodies included, since
    e.g. MoELayer.from_file imports checkpoint when called), with the packages holding them, whose
    __init__ runs first."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "colibri":
                continue
            for depth in range(1, len(parts) + 1):  # colibri, colibri.serving, colibri.serving.watchdog
                module = PACKAGE.joinpath(*parts[1:depth])
                if (module / "__init__.py").is_file():
                    found.add(module / "__init__.py")
                elif depth > 1 and module.with_suffix(".py").is_file():
                    found.add(module.with_suffix(".py"))
                else:
                    break  # a name inside a module (from colibri.pack import pack), not a module
    return found


def runtime_modules():
    """Paths of the files the walk from ROOTS reaches, developer tools left out."""
    seen, todo = set(), [p for p in ROOTS]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(p for p in colibri_imports(path) if not developer_tool(p))
    return sorted(seen)


def vermin():
    found = shutil.which("vermin") or shutil.which("vermin", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("vermin not installed (pip install -c constraints.txt vermin)")
    return found


def run_vermin(files):
    command = [vermin(), "--no-tips", "--violations", "--eval-annotations", "--feature", "union-types",
               "--no-make-paths-absolute",
               f"--target={TARGET}-", "--processes=1", *map(str, files)]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)


def test_the_walk_finds_the_runtime_modules():
    reached = [path for path in runtime_modules() if PACKAGE in path.parents]
    names = {module_name(path) for path in reached}
    assert KNOWN_RUNTIME <= names, f"not reached from model.py/__main__/_ffi_build: {KNOWN_RUNTIME - names}"
    assert not [module_name(path) for path in reached if developer_tool(path)], names


def test_runtime_modules_need_at_most_python_3_8():
    files = [path.relative_to(REPO) for path in runtime_modules()]
    result = run_vermin(files)
    assert result.returncode == 0, f"needs a Python newer than {TARGET}:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("source, feature", [
    ("import dataclasses\n@dataclasses.dataclass(kw_only=True)\nclass C:\n    x: int\n", "kw_only"),
    ("def f(x: int | None):\n    return x\n", "union types as `X | Y`"),
    ("print('ab'.removeprefix('a'))\n", "removeprefix"),
    ("import functools\n@functools.cache\ndef f():\n    return 1\n", "functools.cache"),
    ("print(list(zip([1], [2], strict=True)))\n", "strict"),
    ("print({1: 2} | {3: 4})\n", "dict union"),
    ("def f() -> list[int]:\n    return []\n", "builtin generic type annotation"),
])
def test_vermin_catches_what_3_8_lacks(tmp_path, source, feature):
    """The check above can fail: vermin flags each of these 3.9+/3.10+ features under the same options."""
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    result = run_vermin([probe])
    assert result.returncode != 0 and feature in result.stdout, result.stdout


# ------------------------------------------------- model.py against the Python backend of 22.12

class _Backend2212:
    """What model.py uses of triton_python_backend_utils as tritonserver 22.12 has it: DLPack
    tensors, Logger (22.09), TritonError(message) with no error codes (23.09) and no MetricFamily
    (23.05)."""

    class Tensor(fake_backend.Tensor):
        @staticmethod
        def from_dlpack(name, tensor):
            import numpy as np
            return _Backend2212.Tensor(name, np.from_dlpack(tensor).copy())

    class TritonError:
        def __init__(self, message):  # one argument only, as before 23.09
            self.message = message

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.output_tensors, self.error = output_tensors or [], error

    class Logger:
        messages = []

        @classmethod
        def log_info(cls, message):
            cls.messages.append(message)

        log_error = log_info

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.get(name)


def test_model_py_serves_on_the_python_backend_of_22_12(tmp_path, monkeypatch):
    import importlib.util
    import json

    import numpy as np
    try:
        import colibri
        from colibri import checkpoint
    except ImportError as exc:
        pytest.skip(f"colibri package not importable here ({exc}); `make python` builds it")
    weights = tmp_path / "w.colibri.safetensors"
    config = checkpoint.write_demo(weights, experts=4, top_k=2, hidden=16, intermediate=32, dtype="fp32")
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _Backend2212)
    monkeypatch.setenv("COLIBRI_WEIGHTS", str(weights))
    spec = importlib.util.spec_from_file_location("colibri_moe_model_2212", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model_config = {"parameters": {"COLIBRI_WEIGHTS": {"string_value": str(weights)}}}
    model.initialize({"model_config": json.dumps(model_config), "model_instance_kind": "CPU",
                      "model_instance_device_id": "0", "model_repository": str(tmp_path), "model_version": "1",
                      "model_name": "colibri_moe"})

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, config.hidden_size), np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 2]], np.int32)
    weights_in = np.full((3, 2), 0.5, np.float32)
    bad_ids = ids.copy()
    bad_ids[1, 0] = config.num_experts  # out of range: only this request may fail
    requests = [{name: _Backend2212.Tensor(name, value) for name, value in
                 (("hidden_states", x), ("topk_ids", i), ("topk_weights", weights_in))} for i in (ids, bad_ids)]
    good, bad = model.execute(requests)

    expected = colibri.MoELayer.from_file(weights).forward(x, ids, weights_in)
    assert good.error is None and [t.name() for t in good.output_tensors] == ["output"]
    np.testing.assert_array_equal(good.output_tensors[0].array, expected)
    assert bad.error is not None and "topk_ids" in bad.error.message and not bad.output_tensors


@pytest.mark.parametrize("command", ["pack", "serve", "bench", "generate"])
def test_developer_commands_say_they_need_3_10(command, monkeypatch, capsys):
    try:
        from colibri import __main__ as cli
    except ImportError as exc:
        pytest.skip(f"colibri package not importable here ({exc}); `make python` builds it")
    monkeypatch.setattr(sys, "version_info", (3, 8, 10, "final", 0))
    assert cli.main([command, "--help"]) == 2
    assert "needs Python 3.10 or newer" in capsys.readouterr().err
