#!/usr/bin/env bash
# Installs every Debian package moecore needs to build, test and run its main job (Debian 12, as root).
# ocl-icd-opencl-dev: Debian's oneDNN CMake config calls find_package(OpenCL REQUIRED).
# clang, libclang-rt-14-dev (AddressSanitizer, UBSan, libFuzzer runtimes) and llvm-14 (llvm-symbolizer for readable
# sanitizer reports): the sanitizer and fuzz build of scripts/sanitize.sh.
# The CUDA toolkit is optional: when nvcc is present the CUDA backend is built too.
# Regenerating golden files additionally needs python3-torch (see tools/).
set -euo pipefail
packages=(
  build-essential cmake ninja-build ccache pkg-config
  libdnnl-dev libomp-dev ocl-icd-opencl-dev opencl-headers
  libgtest-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin
  nlohmann-json3-dev libyaml-cpp-dev libsentencepiece-dev sentencepiece libpcre2-dev
  python3 python3-numpy python3-venv python3-matplotlib
  clang-format
  clang libclang-rt-14-dev llvm-14
  fortunes
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all ${#packages[@]} packages present"
fi
