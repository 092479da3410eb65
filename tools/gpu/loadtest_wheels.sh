#!/bin/bash
# Fills .whl/loadtest/ (git-ignored; WHL=DIR for another folder than .whl) with what
# bench/serving/compare.py needs on a GPU node that reaches no registry, beyond tools/gpu/wheels.sh's
# .whl/ (colibri's binding, tritonclient, the tritonserver bundle): Locust and its gevent
# stack and tritonclient's HTTP client, as cp312 manylinux x86_64 wheels at constraints.txt's versions
# (what it leaves unpinned resolves as the venv's does). Then one installed site-packages of both
# folders for the node: .whl/site-py312.tar.xz (carry limits are tight).
#   usage (from anywhere, with PyPI reachable): tools/gpu/wheels.sh, then tools/gpu/loadtest_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
whl=${WHL:-.whl}
target=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
mkdir -p "$whl/loadtest"
rm -f "$whl"/loadtest/*.whl  # an earlier run's versions would be installed beside these
python3 -m pip download -q "${target[@]}" -c constraints.txt -d "$whl/loadtest" locust 'tritonclient[grpc,http]'
rm -f "$whl"/loadtest/numpy-*.whl  # the node's numpy 2 stays (its cupy needs it; tritonclient takes it)
du -sh "$whl/loadtest"
# One installed site-packages for the GPU node: these wheels and wheels.sh's, each package once,
# unpacked for CPython 3.12, without tritonclient's perf_analyzer binaries.
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
mapfile -t wheels < <(ls "$whl"/*.whl "$whl"/loadtest/*.whl | awk -F/ '!seen[$NF]++')
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "${target[@]}" "${wheels[@]}"
rm -rf "$site/bin"
find "$site" -name tests -type d -prune -exec rm -rf {} +
tar cJf "$whl/site-py312.tar.xz" -C "$site" .
du -sh "$whl/site-py312.tar.xz"
