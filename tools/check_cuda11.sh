#!/bin/bash
# Compiles the CUDA backend with CUDA 11.8's nvcc for sm_80 and sm_90 (no sm_90a before CUDA 12), so
# that the promise to CUDA 11.8 stacks (cupy-cuda11x, tritonserver 22.12) is checked, not assumed.
# The toolkit is Debian bookworm's non-free nvidia-cuda-toolkit 11.8.89, fetched once into CACHE
# (about 870 MB of .debs, checked against their SHA-256), of which only the compiler and the headers
# are unpacked. The wheel nvidia-cuda-nvcc-cu11 cannot do this: it holds ptxas and libnvvm, no nvcc.
#   tools/check_cuda11.sh [CACHE]      (default: build-cuda11/)
set -euo pipefail
cd "$(dirname "$0")/.."
cache=$(realpath -m "${1:-build-cuda11}")
root=$cache/root
pool=http://deb.debian.org/debian/pool/non-free/n/nvidia-cuda-toolkit
version=11.8.89~11.8.0-5~deb12u1
declare -A sha=(
  [nvidia-cuda-toolkit]=d1156026e704fe0368b6295db06224ed00a727966fb13454f34e3f3102db0457
  [nvidia-cuda-dev]=dc63bf2fb94aaaf903e9bad0c35f631266077d016b34329ec7af456bd7fed5ec
  [libnvvm4]=32147ac62a9c113ba4336949d03be31db3dd84a6849398383d88b12cf69b2187
)
mkdir -p "$cache/debs"
if [ ! -x "$root/usr/lib/nvidia-cuda-toolkit/bin/nvcc" ] || [ ! -f "$root/usr/include/cuda_runtime.h" ]; then
  rm -rf "$root"
  for package in "${!sha[@]}"; do
    deb=$cache/debs/${package}_${version}_amd64.deb
    [ -f "$deb" ] || python3 - "$pool/${package}_${version//\~/%7e}_amd64.deb" "$deb" <<'PY'
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=120) as reply, open(sys.argv[2] + ".part", "wb") as out:
    shutil.copyfileobj(reply, out, 1 << 20)
shutil.move(sys.argv[2] + ".part", sys.argv[2])
PY
    echo "${sha[$package]}  $deb" | sha256sum -c --quiet - || { rm -f "$deb"; echo "check_cuda11: $deb: bad checksum" >&2; exit 1; }
  done
  mkdir -p "$root"
  dpkg-deb -x "$cache/debs/nvidia-cuda-toolkit_${version}_amd64.deb" "$root"
  dpkg-deb -x "$cache/debs/libnvvm4_${version}_amd64.deb" "$root"
  dpkg-deb --fsys-tarfile "$cache/debs/nvidia-cuda-dev_${version}_amd64.deb" | tar -x -C "$root" --wildcards './usr/include/*'
  # Debian's nvcc reads bin/nvcc.profile (a link to /etc/nvcc.profile) and finds gcc-11 as bin/gcc:
  # point the profile at this folder instead, and take the system's compiler below.
  bin=$root/usr/lib/nvidia-cuda-toolkit/bin
  rm -f "$bin/nvcc.profile" "$bin/gcc" "$bin/g++"
  cat > "$bin/nvcc.profile" <<PROFILE
NVVMIR_LIBRARY_DIR = $root/usr/lib/nvidia-cuda-toolkit/libdevice
PATH += $bin:$root/usr/bin:
INCLUDES += "-I$root/usr/include" \$(_SPACE_)
PROFILE
fi
nvcc=$root/usr/lib/nvidia-cuda-toolkit/bin/nvcc
export LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
"$nvcc" --version | tail -1
# gcc 12 is newer than 11.8 supports officially (it stops at gcc 11); the check is of our sources.
objects=()
for source in csrc/src/cuda/*.cu csrc/src/cuda/instances/*.cu; do
  relative=${source#csrc/}
  objects+=("$cache/build/obj/${relative%.cu}.o")
done
make -s -j"$(nproc)" CUDA=1 NVCC="$nvcc -ccbin ${CXX:-g++} -allow-unsupported-compiler" CUDA_ARCH="80 90" \
  BUILD="$cache/build" CUDA_LIBDIR=/nonexistent "${objects[@]}"
echo "check_cuda11: the CUDA sources compile with CUDA 11.8 for sm_80 and sm_90"
