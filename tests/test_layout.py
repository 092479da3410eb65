"""The Python package by role, read with ast (nothing is imported): the engine (colibri's own
modules), the packer (colibri.pack), serving (colibri.serving) and the attention tier
(colibri.attention, which uses the packer's family table and serving's CUDA shared memory). The import
graph has no circles, the engine imports none of the others, serving does not import the packer, the
packer not serving, none of them the attention tier, and no Python file in backend_src is over 700
lines.

An edge is an import written in a module, function bodies included: `from colibri.x import y` goes to
colibri.x.y when that is a module, else to colibri.x. The package __init__ that Python runs on the
way to a submodule is not an edge (every module would close a circle through colibri/__init__.py).
"""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BACKEND = REPO / "backend_src"
MODEL_PY = REPO / "model_repository" / "colibri_moe" / "1" / "model.py"
MAX_LINES = 700
# Above the roles: the CLI dispatches to all three, and the test helpers pack layers and start servers.
ABOVE_ROLES = ("colibri.__main__", "colibri.testing")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str, known) -> set:
    """The modules of `known` that the file of module `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # a module of the package, else a name inside the module imported from
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        # what is not a Python module of the package (numpy, the compiled colibri._colibri_cffi) is no edge
        found.update(target for target in targets if target in known and target != name)
    return found


def import_graph(root: Path, package: str = "colibri") -> dict:
    """module -> the modules of `package` (a folder under root) it imports."""
    files = {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}
    return {name: imported(path, name, files) for name, path in files.items()}


def circles(graph: dict) -> list:
    """Each circle found by a depth-first walk, as the modules along it, first one repeated at the end."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def walk(name, path):
        state[name] = 1
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target, path)
        path.pop()
        state[name] = 2
    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    return found


def role(name: str) -> str:
    for prefix, what in (("colibri.pack", "pack"), ("colibri.serving", "serving"),
                         ("colibri.attention", "attention")) + tuple(
            (above, "above") for above in ABOVE_ROLES):
        if name == prefix or name.startswith(prefix + "."):
            return what
    return "engine"


@pytest.fixture(scope="module")
def graph():
    return import_graph(BACKEND)


def test_the_graph_sees_every_role(graph):
    """So that a change to how imports are read cannot make the checks below pass by seeing nothing."""
    assert {"colibri", "colibri.layer", "colibri.pack", "colibri.pack.verify", "colibri.serving.launcher",
            "colibri.serving.batching", "colibri.attention.tier"} <= set(graph)
    assert "colibri.pack.families" in graph["colibri.attention.loading"]
    assert "colibri.serving.watchdog" in graph["colibri.serving.launcher"]
    assert "colibri.nonfinite" in graph["colibri"] and "colibri.layer" in graph["colibri.pack.verify"]


def test_the_import_graph_has_no_circles(graph):
    assert circles(graph) == []


@pytest.mark.parametrize("importer, forbidden", [("engine", ("pack", "serving", "attention")),
                                                 ("serving", ("pack", "attention")),
                                                 ("pack", ("serving", "attention"))])
def test_each_role_imports_only_what_it_may(graph, importer, forbidden):
    wrong = sorted(f"{name} imports {target}" for name, targets in graph.items() if role(name) == importer
                   for target in targets if role(target) in forbidden + ("above",))
    assert wrong == []


def test_model_py_is_an_adapter_over_the_engine_and_serving():
    known = set(import_graph(BACKEND))
    assert {role(name) for name in imported(MODEL_PY, "model", known)} <= {"engine", "serving"}


def test_no_python_file_in_backend_src_is_over_700_lines():
    long = {str(path.relative_to(REPO)): n for path in sorted(BACKEND.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_a_circle_is_found(tmp_path):
    """The check above can fail: a package whose modules import each other, one of them inside a
    function and one relatively, is reported with its circle."""
    package = tmp_path / "colibri"
    (package / "serving").mkdir(parents=True)
    (package / "__init__.py").write_text("from colibri.layer import MoELayer\n")
    (package / "layer.py").write_text("def forward():\n    from colibri.serving import batching\n")
    (package / "serving" / "__init__.py").write_text("")
    (package / "serving" / "batching.py").write_text("from .. import layer\n")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["colibri.layer", "colibri.serving.batching", "colibri.layer"]]
    assert role("colibri.layer") == "engine" and role("colibri.serving.batching") == "serving"
