#!/bin/bash
# Fills .whl/ (git-ignored) with what client/gpu_check.sh needs on a GPU machine that reaches no
# package registry (Python 3.12, torch, numpy 2 and safetensors already there): the packages below
# as cp312 manylinux wheels, and the tritonserver of the nvidia-pytriton wheel packed for Python 3.12
# by ../shared/tools/tritonserver-bundle.sh; .whl/pytest for tests/gpu_pytest.sh. About 57 MB in all.
#   usage (from anywhere, with PyPI reachable): client/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# cffi/pycparser: build and load colibri's binding. tritonclient + python-rapidjson + protobuf<5: the
# gRPC client. cuda-python/cuda-bindings 12.9 (`from cuda import cudart`, gone in 13) and setuptools<81
# (pkg_resources): tritonclient's CUDA shared-memory utilities.
packages="cffi==2.0.0 pycparser==2.23 tritonclient==2.51.0 python-rapidjson==1.25 protobuf==4.25.8
          cuda-python==12.9.0 cuda-bindings==12.9.0 setuptools==80.9.0"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $packages
# tests/gpu_pytest.sh: the test runner, pinned as constraints.txt pins it for the CI, with its
# dependencies (the image's pytest has plugins that do not load into this one: the script turns
# plugin autoloading off), and cffi for the binding, which the H200's image lacks.
mkdir -p .whl/pytest
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/pytest -c constraints.txt \
  pytest hypothesis safetensors
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/pytest -c constraints.txt cffi pycparser
bundler=$(readlink -f ../shared/tools/tritonserver-bundle.sh 2>/dev/null || true)
[ -x "$bundler" ] || bundler=/work/shared/tools/tritonserver-bundle.sh
[ -f .whl/tritonserver-py3.12.tar.xz ] || PATH="$PWD/.venv/bin:$PATH" bash "$bundler" .whl/tritonserver-py3.12.tar.xz 3.12
du -sh .whl
