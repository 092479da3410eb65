#!/bin/bash
# Fills .whl/ (git-ignored; WHL=DIR elsewhere) with what tools/gpu/serving_check.sh needs on a GPU machine that
# reaches no package registry (Python 3.12 with numpy 2, cupy and safetensors already there): colibri's
# binding (cffi, pycparser) and tritonclient's gRPC client with their dependencies, as cp312 manylinux
# wheels at constraints.txt's versions (CUDA shared memory is cupy's, colibri.serving.cuda_shm: no cuda-python),
# and the tritonserver of the nvidia-pytriton wheel packed for Python 3.12 by
# ../shared/tools/tritonserver-bundle.sh; .whl/pytest for tools/gpu/pytest.sh.
#   usage (from anywhere, with PyPI reachable): tools/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
whl=${WHL:-.whl}
mkdir -p "$whl"
# Every version from constraints.txt (markers evaluated for Python 3.12): nothing is pinned here.
target=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -c constraints.txt)
# Wheels of an earlier run at other versions would be installed beside these: start afresh.
rm -f "$whl"/*.whl
python3 -m pip download -q "${target[@]}" -d "$whl" cffi pycparser 'tritonclient[grpc]'
# The host's numpy stays: its cupy needs numpy 2, constraints.txt pins 1.x for tritonserver's stub, and
# tritonclient 2.73 takes either.
rm -f "$whl"/numpy-*.whl
# tools/gpu/pytest.sh: the test runner, pinned as constraints.txt pins it for the CI, with its
# dependencies (the image's pytest has plugins that do not load into this one: the script turns
# plugin autoloading off), and cffi for the binding, which the H200's image lacks.
mkdir -p "$whl/pytest"
python3 -m pip download -q "${target[@]}" -d "$whl/pytest" pytest hypothesis safetensors
python3 -m pip download -q --no-deps "${target[@]}" -d "$whl/pytest" cffi pycparser
bundler=$(readlink -f ../shared/tools/tritonserver-bundle.sh 2>/dev/null || true)
[ -x "$bundler" ] || bundler=/work/shared/tools/tritonserver-bundle.sh
[ -f "$whl/tritonserver-py3.12.tar.xz" ] || PATH="$PWD/.venv/bin:$PATH" bash "$bundler" "$whl/tritonserver-py3.12.tar.xz" 3.12
du -sh "$whl"
