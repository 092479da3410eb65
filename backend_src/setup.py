"""Builds the colibri-moe wheel with its native parts, libcolibri and the cffi extension, side by side in
the colibri package (the extension loads the library through rpath $ORIGIN). They come from:
- nowhere for an editable install (`make venv`): `make` builds them in backend_src/colibri, which is
  what an editable install imports, so the venv is ready in seconds before any library exists;
- backend_src/colibri when `make python` put them there (the Docker build: `make lib python`, then
  `pip wheel`), packaged as they are, so the CUDA library that build made is the one shipped;
- else the repository's Makefile (`make lib` in build_temp) and _ffi_build.py. The Makefile holds the
  one recipe for C flags, CUDA code generation and the static CUDA runtime; setuptools' compiler knows
  no nvcc and would be a second copy of it.
COLIBRI_CUDA=auto|0|1: auto builds the CUDA backend (10+ minutes) only when nvcc is found and an NVIDIA
driver is loaded. make reads CC, CFLAGS_ARCH (default -march=native), CUDA_ARCH, NVCC from the environment.
Runs on the CUDA 11.8 build stage's Python 3.8 too (tests/test_py38.py).
"""
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import setuptools
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = HERE / "colibri"
REPO = HERE.parent
HEADER = REPO / "csrc" / "include" / "colibri.h"
EXTENSION = "colibri._colibri_cffi"
DRIVER = pathlib.Path("/proc/driver/nvidia/version")


def fail(message: str):
    """Stops the build with one line; pip prints it below the build's output."""
    raise SystemExit(f"colibri-moe: {message}")


def cuda_wanted() -> bool:
    choice = os.environ.get("COLIBRI_CUDA", "auto").strip().lower() or "auto"
    if choice not in ("auto", "0", "1"):
        fail(f"COLIBRI_CUDA={choice!r}: expected auto, 0 or 1")
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if choice == "1" and not nvcc:
        fail("COLIBRI_CUDA=1 but nvcc is not on PATH (or name it with NVCC=/path/to/nvcc)")
    if choice == "auto":
        if nvcc and not DRIVER.exists():
            print("colibri-moe: nvcc found but no NVIDIA driver: building the CPU backend only "
                  "(COLIBRI_CUDA=1 builds CUDA too, 10+ minutes)")
        return bool(nvcc) and DRIVER.exists()
    return choice == "1"


def load_ffi_build():
    # By path: importing the colibri package would load the extension this build is making.
    spec = importlib.util.spec_from_file_location("colibri_ffi_build", str(PACKAGE / "_ffi_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildNative(build_ext):
    """Produces colibri/libcolibri.so and the extension in build_lib instead of compiling sources."""

    def editable(self) -> bool:
        return bool(getattr(self, "editable_mode", False) or self.inplace)

    def native_outputs(self):
        extension = pathlib.Path(self.get_ext_fullpath(EXTENSION))
        return extension, extension.with_name("libcolibri.so")

    def get_outputs(self):
        return [] if self.editable() else [str(path) for path in self.native_outputs()]

    def get_output_mapping(self):
        return {}

    def run(self):
        if self.editable():
            print("colibri-moe: editable install: the native library is not built here; "
                  "`make` builds it in backend_src/colibri")
            return
        extension, library = self.native_outputs()
        # A build folder reused across Pythons may hold another interpreter's extension; the wheel
        # takes the folder whole, so only this one may be there.
        for stale in extension.parent.glob("_colibri_cffi*"):
            stale.unlink()
        prebuilt_lib, prebuilt_ext = PACKAGE / "libcolibri.so", PACKAGE / extension.name
        if prebuilt_lib.is_file() and prebuilt_ext.is_file():
            print(f"colibri-moe: packaging {prebuilt_lib.name} and {prebuilt_ext.name} as `make python` built "
                  f"them in {PACKAGE} (`make clean` first to have them built here)")
            extension.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(str(prebuilt_lib), str(library))
            shutil.copy2(str(prebuilt_ext), str(extension))
            return
        if not HEADER.is_file() or not (REPO / "Makefile").is_file():
            fail(f"no C sources at {REPO / 'csrc'}: build from a Colibri checkout with pip >= 21.3 (pip "
                 "install ./backend_src; older pips build a copy of backend_src alone), not from an sdist, which "
                 "cannot carry them")
        if not (pathlib.Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
            fail(f"the extension needs Python {sys.version_info[0]}.{sys.version_info[1]}'s headers, which are "
                 "missing (Debian/Ubuntu: apt install python3-dev)")
        if prebuilt_lib.is_file():  # made by `make`, whose extension is for another Python
            print(f"colibri-moe: building {extension.name} against {prebuilt_lib} (`make clean` first to rebuild it)")
        source_lib = prebuilt_lib if prebuilt_lib.is_file() else self.make_library()
        load_ffi_build().build(source_lib, HEADER, extension.parent)

    def make_library(self) -> pathlib.Path:
        cuda = cuda_wanted()
        compiler = (os.environ.get("CC") or "cc").split()[0]
        missing = [tool for tool in ("make", compiler) if not shutil.which(tool)]
        if missing:
            fail(f"building libcolibri needs make and a C compiler with OpenMP; {' and '.join(missing)} not "
                 "found (Debian/Ubuntu: apt install make gcc)")
        # One folder per choice: make would take the other choice's newer library as up to date.
        build_dir = pathlib.Path(self.build_temp).resolve() / ("native-cuda" if cuda else "native-cpu")
        if cuda:
            print("colibri-moe: building the CUDA backend: the kernels take 10+ minutes to compile "
                  "(COLIBRI_CUDA=0 skips them)")
        command = ["make", "-C", str(REPO), f"-j{self.parallel or os.cpu_count() or 1}", "lib",
                   f"BUILD={build_dir}", f"CUDA={int(cuda)}"]
        print("colibri-moe: " + " ".join(command))
        sys.stdout.flush()
        result = subprocess.run(command)
        if result.returncode != 0:
            fail(f"`make lib` failed (exit {result.returncode}): it needs make and a C compiler with OpenMP "
                 "(Debian/Ubuntu: apt install make gcc); the compiler's messages are above")
        return build_dir / "libcolibri.so"


def license_metadata():
    # PEP 639 (License-Expression) exists from setuptools 77; Python 3.8's last setuptools is 75.3,
    # which takes only the classic License field, and refuses the PEP 639 keys in pyproject.toml.
    major = int(setuptools.__version__.split(".")[0])
    return {"license_expression" if major >= 77 else "license": "Apache-2.0", "license_files": ["LICENSE"]}


setuptools.setup(
    # No sources: BuildNative makes it. Declared so the wheel is tagged for this Python and platform.
    ext_modules=[setuptools.Extension(EXTENSION, sources=[])],
    cmdclass={"build_ext": BuildNative},
    **license_metadata(),
)
