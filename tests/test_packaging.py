"""Packaging: `pip wheel ./backend_src` on a checkout without `make`'s outputs builds libcolibri and the
extension itself and ships both in a colibri-moe wheel, which installs into a fresh venv and computes
from any directory; what `make python` already built is packaged as it is (the Docker build); an
editable install builds nothing; an sdist, which cannot carry ../csrc, refuses in one line.

CPU only (COLIBRI_CUDA=0) and without build isolation (the venv's setuptools and cffi, no index):
about 30 s on an idle 2-core machine, most of it pip starting and compiling the library once.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
EXTENSION = "_colibri_cffi" + sysconfig.get_config_var("EXT_SUFFIX")
MAKE_OUTPUTS = ("_colibri_cffi*", "libcolibri.so")
# What the build leaves in a source folder, kept out of the copies so each starts as a fresh clone's.
BUILD_LEFTOVERS = shutil.ignore_patterns(*MAKE_OUTPUTS, "build", "*.egg-info", "__pycache__")


def run(command, cwd, **env):
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLIBRI_CUDA")}
    environment.update({"COLIBRI_CUDA": "0", **env})
    return subprocess.run([str(c) for c in command], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=600)


def pip_wheel(source, out, **env):
    return run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", out,
                source], cwd=source.parent, **env)


def copy_backend_src(root, with_make_outputs=False):
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__") if with_make_outputs else BUILD_LEFTOVERS
    shutil.copytree(REPO / "backend_src", root / "backend_src", ignore=ignore)
    return root / "backend_src"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """What a fresh clone has for the package: Makefile, csrc, backend_src, no library built."""
    root = tmp_path_factory.mktemp("checkout")
    shutil.copy2(REPO / "Makefile", root)
    shutil.copytree(REPO / "csrc", root / "csrc", ignore=shutil.ignore_patterns("__pycache__"))
    copy_backend_src(root)
    return root


@pytest.fixture(scope="module")
def wheel(checkout, tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    result = pip_wheel(checkout / "backend_src", out)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("*.whl")
    return built


def wheel_files(path):
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_the_license_is_apache_2_and_the_package_ships_the_same_text():
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text
    # pyproject paths cannot leave backend_src, so the package holds a copy; it must stay the same text.
    assert (REPO / "backend_src" / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes()


def test_the_wheel_carries_the_library_the_extension_and_the_license(wheel):
    files = wheel_files(wheel)
    python_tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert wheel.name.startswith("colibri_moe-") and f"-{python_tag}-{python_tag}-linux_" in wheel.name, wheel.name
    assert f"colibri/{EXTENSION}" in files and "colibri/libcolibri.so" in files, sorted(files)
    assert [n for n in files if "_colibri_cffi" in n] == [f"colibri/{EXTENSION}"]
    (metadata,) = [data.decode() for name, data in files.items() if name.endswith(".dist-info/METADATA")]
    assert "\nName: colibri-moe\n" in metadata
    # torch and transformers only with the attention extra, never for the engine
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert "Provides-Extra: attention" in metadata and all("extra ==" in r for r in requires
                                                           if "torch" in r or "transformers" in r), requires
    assert any(r.startswith("Requires-Dist: torch") for r in requires), requires
    assert "\nLicense-Expression: Apache-2.0\n" in metadata or "\nLicense: Apache-2.0\n" in metadata, metadata
    licenses = [data for name, data in files.items() if ".dist-info/" in name and name.endswith("LICENSE")]
    assert licenses == [(REPO / "LICENSE").read_bytes()]


def test_pip_builds_outside_the_source_folder(wheel, checkout):
    """The wheel's build leaves backend_src/colibri as it was: no library or extension written there."""
    assert not [p.name for pattern in MAKE_OUTPUTS for p in (checkout / "backend_src" / "colibri").glob(pattern)]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(python, its site-packages): the wheel installed with --no-deps into a fresh venv that sees only
    this venv's numpy and cffi."""
    import cffi
    import numpy
    venv = tmp_path_factory.mktemp("installed") / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent).returncode == 0
    python = venv / "bin" / "python"
    site = pathlib.Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                            cwd=venv.parent).stdout.strip())
    (site / "dependencies.pth").write_text(
        "\n".join({str(pathlib.Path(m.__file__).parents[1]) for m in (numpy, cffi)}) + "\n")
    installed = run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", wheel], cwd=venv.parent)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python, site


def test_the_installed_wheel_computes_from_any_directory(installed, tmp_path):
    """Run from an empty folder: the console script writes a checkpoint, and MoELayer matches the
    float64 reference."""
    python, site = installed
    venv = python.parents[1]
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    demo = run([venv / "bin" / "colibri", "demo", "--out", "demo.colibri.safetensors", "--dtype", "fp32",
                "--hidden", "64", "--intermediate", "96"], cwd=workdir)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    script = """
import numpy as np, colibri
from colibri import checkpoint, reference, testing
assert colibri.__file__.startswith(%r), colibri.__file__
assert not colibri.cuda_built()
layer = colibri.MoELayer.from_file("demo.colibri.safetensors", device="cpu")
x = np.random.default_rng(0).standard_normal((5, layer.config.hidden_size)).astype(np.float32)
expected = reference.checkpoint_forward(checkpoint.load("demo.colibri.safetensors"), x.astype(np.float64))
error = testing.relative_error(layer.forward(x), expected)
assert error < testing.ERROR_LIMITS["fp32"], error
print("forward ok", error)
""" % str(site)
    forward = run([python, "-c", script], cwd=workdir)
    assert forward.returncode == 0 and "forward ok" in forward.stdout, forward.stdout + forward.stderr


def test_the_installed_package_has_every_role_and_serves_without_a_checkout(installed, tmp_path):
    """The packer and serving come with the wheel and import from the installed copy, and `colibri
    serve` runs from it: it has no checkout's model repository to default to, so without
    --model-repository it asks for one in a line, before looking for a server."""
    python, site = installed
    script = ("import colibri, colibri.pack, colibri.serving.launcher, colibri.serving.batching, colibri.testing\n"
              "import colibri.attention.cli\n"
              "from colibri.pack import pack\n"
              "for module in (colibri, colibri.pack, colibri.serving.launcher, colibri.serving.batching,\n"
              "               colibri.attention.cli):\n"
              "    print(module.__file__)\n")
    imported = run([python, "-c", script], cwd=tmp_path)
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert all(line.startswith(str(site)) for line in imported.stdout.splitlines()), imported.stdout
    shown = run([python, "-m", "colibri", "serve", "--help"], cwd=tmp_path)
    assert shown.returncode == 0 and "--model-repository DIR" in shown.stdout, shown.stdout + shown.stderr
    refused = run([python, "-m", "colibri", "serve"], cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "colibri serve: no model repository: this colibri package is installed, not run from a checkout; pass "
        "--model-repository DIR (a Colibri checkout's model_repository)"], refused.stderr
    assert not list(tmp_path.iterdir()), "nothing written where it ran"


def test_what_make_python_built_is_packaged_as_it_is(tmp_path):
    """The Docker build's path: `make lib python`, then `pip wheel`. The copy has no csrc, so the wheel can
    only hold the files make left in backend_src/colibri, byte for byte (the CUDA library there stays)."""
    made = REPO / "backend_src" / "colibri"
    if not (made / "libcolibri.so").is_file() or not (made / EXTENSION).is_file():
        pytest.skip(f"`make python` has not built {EXTENSION} in backend_src/colibri")
    source = copy_backend_src(tmp_path, with_make_outputs=True)
    result = pip_wheel(source, tmp_path / "dist")
    assert result.returncode == 0, result.stdout + result.stderr
    files = wheel_files(next((tmp_path / "dist").glob("*.whl")))
    for name in ("libcolibri.so", EXTENSION):
        assert files[f"colibri/{name}"] == (made / name).read_bytes(), name


def test_an_sdist_without_the_c_sources_refuses_in_one_line(tmp_path):
    source = copy_backend_src(tmp_path)
    sdist = run([sys.executable, "-c", "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"],
                cwd=source)
    assert sdist.returncode == 0, sdist.stdout + sdist.stderr
    archive = source / "dist" / sdist.stdout.strip().splitlines()[-1]
    result = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                  tmp_path / "out", archive], cwd=tmp_path)
    assert result.returncode != 0
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if "colibri-moe: " in line]
    assert len(lines) == 1 and "no C sources at" in lines[0] and "from a Colibri checkout" in lines[0], lines


@pytest.mark.parametrize("value, message", [("2", "COLIBRI_CUDA='2': expected auto, 0 or 1"),
                                            ("1", "COLIBRI_CUDA=1 but nvcc is not on PATH")])
def test_a_bad_cuda_choice_refuses_in_one_line(checkout, tmp_path, value, message):
    no_nvcc = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                              if not (pathlib.Path(d) / "nvcc").exists())
    result = pip_wheel(checkout / "backend_src", tmp_path, COLIBRI_CUDA=value, PATH=no_nvcc, NVCC="")
    assert result.returncode != 0
    assert any(line.strip().startswith(f"colibri-moe: {message}")
               for line in (result.stdout + result.stderr).splitlines()), result.stdout + result.stderr


def test_an_editable_install_builds_nothing(tmp_path):
    """`make venv` installs editable before any library exists and must stay quick. The copy has no csrc,
    so an attempt to build would fail; the hook is the one pip calls for `pip install -e`."""
    source = copy_backend_src(tmp_path)
    hook = "from setuptools import build_meta; print(build_meta.build_editable('dist'))"
    result = run([sys.executable, "-c", hook], cwd=source)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the native library is not built here" in result.stdout
    assert not [p for pattern in MAKE_OUTPUTS for p in tmp_path.rglob(pattern)]
