#!/bin/bash
# Fills .whl/loadtest/ (git-ignored) with what bench/serving/compare.py needs on a GPU node that
# reaches no registry, beyond client/gpu_wheels.sh's .whl/ (colibri's binding, the tritonserver
# bundle): Locust 2.47 and its gevent stack, tritonclient 2.53 with its protobuf 5 (they replace
# gpu_wheels.sh's tritonclient 2.51 / protobuf 4, see bench/serving/README.md), as cp312 manylinux
# x86_64 wheels; about 23 MB. Versions are constraints.txt's and those the venv resolved with them.
#   usage (from anywhere, with PyPI reachable): bench/serving/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl/loadtest
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl/loadtest \
  locust==2.47.0 gevent==26.9.0 greenlet==3.5.6 zope.event==6.2 zope.interface==8.7 geventhttpclient==2.6.1 \
  brotli==1.2.1 pyzmq==27.3.0 configargparse==1.9.0 flask==3.1.3 flask-cors==6.0.5 flask-login==0.6.3 \
  werkzeug==3.1.9 blinker==1.9.0 itsdangerous==2.2.0 python-socketio==5.18.1 python-engineio==4.15.1 \
  bidict==0.24.1 simple-websocket==1.1.0 wsproto==1.3.2 websocket-client==1.9.2 \
  tritonclient==2.53.0 protobuf==5.29.6 python-rapidjson==1.25
du -sh .whl/loadtest
# One installed site-packages for the GPU node (carry limits are tight): these wheels with
# client/gpu_wheels.sh's cffi, pycparser, setuptools and cuda-python (the CUDA shared-memory users
# need it), unpacked for CPython 3.12, without tritonclient's perf_analyzer binaries and the
# bindings' C++ sources: about 10 MB as .whl/site-py312.tar.xz, against 65 MB of wheels.
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# shellcheck disable=SC2046
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  $(ls .whl/*.whl | grep -v -E '/(tritonclient|protobuf|python_rapidjson)-') .whl/loadtest/*.whl
rm -rf "$site/bin"
find "$site/cuda" \( -name '*.cpp' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.h' \) -delete
find "$site" -name tests -type d -prune -exec rm -rf {} +
tar cJf .whl/site-py312.tar.xz -C "$site" .
du -sh .whl/site-py312.tar.xz
