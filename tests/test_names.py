"""Every global name that a Python file of the repository reads is defined in it (assigned, imported, a
builtin or a module dunder). A script such as bench/bench_gpu.py runs only on a GPU, so a name left behind
by a copied line (the family rows' `Q`, issue 50) would otherwise show first as a NameError on the GPU
machine. The check is the standard library's symbol table, so it needs no linter installed."""
import builtins
import subprocess
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__",
                "__path__", "__annotations__", "__dict__"}


def undefined_globals(source, filename):
    """The names read as globals somewhere in source that nothing in the module defines, sorted."""
    module = symtable.symtable(source, filename, "exec")
    defined = set(dir(builtins)) | MODULE_NAMES
    read = set()
    stack = [module]
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        for sym in table.get_symbols():
            name = sym.get_name()
            if table is module or sym.is_declared_global():  # `global x; x = ...` defines x too
                if sym.is_assigned() or sym.is_imported() or (table is module and sym.is_namespace()):
                    defined.add(name)
            if sym.is_referenced() and (table is module or sym.is_global()):
                read.add(name)
    return sorted(read - defined)


def python_files():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    return [ROOT / line for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def test_no_undefined_global_names():
    files = python_files()
    assert any(f.name == "bench_gpu.py" for f in files)
    bad = {str(f.relative_to(ROOT)): names for f in files
           if (names := undefined_globals(f.read_text(), str(f)))}
    assert not bad, f"names read but never defined: {bad}"


@pytest.mark.parametrize("source, expected", [
    ("def f(lib):\n    return g(lib, Q)\n\ndef g(lib, Q):\n    return Q\n", ["Q"]),  # the bench_family bug
    ("def f():\n    return [q for q in Q]\n", ["Q"]),  # read inside a comprehension's own scope
    ("class C:\n    x = y\n", ["y"]),
    ("def f():\n    return lambda: z + 1\n", ["z"]),
])
def test_the_check_catches_an_undefined_name(source, expected):
    assert undefined_globals(source, "probe.py") == expected


@pytest.mark.parametrize("source", [
    "import os\ndef f():\n    return os.sep, len, __file__\n",
    "def f():\n    global g\n    g = 1\n\ndef h():\n    return g\n",
    "def f():\n    a = 1\n    b = lambda: a\n    del a\n    return b\n",  # a local read by a closure, then deleted
    "try:\n    import numpy as np\nexcept ImportError:\n    np = None\ndef f():\n    return np\n",
    "class C:\n    pass\ndef f():\n    return C\n",
])
def test_the_check_accepts_defined_names(source):
    assert undefined_globals(source, "probe.py") == []
