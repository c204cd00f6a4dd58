#!/usr/bin/env bash
# Builds moecore and runs the default test suite (everything except the "long" label).
# GPU tests carry the "gpu" label and skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
ctest --output-on-failure -j "$(nproc)" -LE long --timeout 900
