#!/usr/bin/env bash
# Configures and builds moecore into build/ (Release, Ninja, ccache when present).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
if ! cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >build/configure.log 2>&1; then
  cat build/configure.log
  exit 1
fi
grep "^-- moecore:" build/configure.log || true
cmake --build build -j "$(nproc)"
