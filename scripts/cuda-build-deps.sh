#!/usr/bin/env bash
# The CUDA build's header-only dependencies from PyPI, into a build venv (build/cuda-venv; Debian's python3-venv):
# CUTLASS (the nvidia-cutlass wheel ships its C++ headers) for the experts' tensor-core grouped GEMM. Prints the CMake
# flags that point the build at them, e.g.
#   cmake -S . -B build-gpu ... $(bash scripts/cuda-build-deps.sh)
# Idempotent: a venv that already holds the pinned version is reused. Only CUDA builds need it (scripts/gpu-bundle.sh);
# the README's commands build without CUDA and never call it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/cuda-venv
cutlass_req="nvidia-cutlass==4.2.0.0"
include() { "$venv/bin/python3" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null; }
have() {  # (pip's output read whole: grep -q closing the pipe early would fail the pipeline under pipefail)
  local shown
  [ -x "$venv/bin/python3" ] && shown=$("$venv/bin/python3" -m pip show nvidia-cutlass 2>/dev/null) &&
    grep -qx "Version: ${cutlass_req#*==}" <<<"$shown"
}
if ! have; then
  echo "cuda-build-deps: installing $cutlass_req from PyPI into $venv" >&2
  rm -rf "$venv"
  mkdir -p build
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check --retries 2 --timeout 60 --no-deps \
    "$cutlass_req" >&2 || { echo "cuda-build-deps: ERROR: could not install $cutlass_req from PyPI" >&2; exit 1; }
fi
inc=$(include)
[ -f "$inc/cutlass/cutlass.h" ] && [ -f "$inc/cute/tensor.hpp" ] ||
  { echo "cuda-build-deps: ERROR: $cutlass_req in $venv has no C++ headers at $inc" >&2; exit 1; }
echo "-DMOECORE_CUTLASS_INCLUDE=$inc"
