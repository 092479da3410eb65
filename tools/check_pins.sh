#!/bin/bash
# Resolves each pip profile against constraints.txt from PyPI alone, as a clean machine would: uv with
# no configuration (neither pip's nor uv's, so no local wheel folder or mirror), wheels only, for Linux
# x86_64 with glibc 2.35 (nvidia-pytriton's wheels need it), once per Python named.
#   tools/check_pins.sh 3.12 3.11 3.10 -- "serve: numpy cffi ..." "legacy@3.8: numpy cffi" ...
# A profile written NAME@VERSION resolves on that Python only. Exits 1 when any profile does not resolve,
# after printing uv's reason. uv itself comes from constraints.txt into build/check-pins/.
set -euo pipefail
cd "$(dirname "$0")/.."
pythons=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do pythons+=("$1"); shift; done
[ $# -gt 1 ] || { echo "usage: $0 PYTHON... -- 'NAME[@PYTHON]: PACKAGE...' ..." >&2; exit 2; }
shift

tool=build/check-pins
if [ ! -x "$tool/bin/uv" ]; then
  python3 -m venv "$tool"
  "$tool/bin/pip" install -q -c constraints.txt uv
fi
# uv reads UV_* variables (an index, a cache, a Python preference): a clean machine has none.
mapfile -t uv_vars < <(env | sed -n 's/^\(UV_[A-Za-z0-9_]*\)=.*/-u\n\1/p')
uv=(env "${uv_vars[@]}" "$tool/bin/uv" pip compile --no-config --no-build --quiet
    --index-url https://pypi.org/simple --python-platform x86_64-manylinux_2_35 --no-header --no-annotate)

set -f  # 'tritonclient[grpc,http]' is a package, not a glob
failed=0
for spec in "$@"; do
  name=${spec%%:*}
  read -ra packages <<<"$(echo "${spec#*:}" | tr -d "'\"")"
  versions=("${pythons[@]}")
  if [[ $name == *@* ]]; then versions=("${name#*@}"); name=${name%@*}; fi
  printf '%s\n' "${packages[@]}" >"$tool/$name.in"
  for py in "${versions[@]}"; do
    out="$tool/$name-py$py.txt"
    if "${uv[@]}" --python-version "$py" -c constraints.txt "$tool/$name.in" -o "$out" 2>"$out.err"; then
      n=$(grep -c '==' "$out")
      picked=$(grep -oE '^(torch|numpy|cupy-cuda1[12]x|cuda-bindings)==[^ ;]+' "$out" | tr '\n' ' ')
      echo "check-pins: ok    $name on Python $py: $n packages ${picked:+($picked)}"
    else
      echo "check-pins: FAIL  $name on Python $py:"
      sed 's/^/    /' "$out.err" | grep -v "python-build-standalone\|not available; .* will be used" || true
      failed=1
    fi
  done
done
exit "$failed"
