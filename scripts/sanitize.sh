#!/usr/bin/env bash
# The hardening half of the test suite, in build-san/: the whole project built with clang under
# AddressSanitizer + UndefinedBehaviorSanitizer (and libFuzzer's coverage instrumentation), then
#   1. the unit, module and command-line tests (labels core kernels io data moe model parallel apps; not the
#      multi-rank "mpi" programs, not "long") run under the sanitizers: any report fails its test;
#   2. every libFuzzer harness of fuzz/ for MOECORE_FUZZ_SMOKE_S seconds (label "fuzz").
# Usage: bash scripts/sanitize.sh [extra ctest arguments, e.g. -L fuzz or -R Checkpoint]
# The long fuzz runs (10 minutes per reader): cd build-san && ctest -L fuzz -L long  (see fuzz/CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build-san
# ccache: objects are shared between checkouts and build folders (debug info keeps the compile dir out of the hash).
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
if ! CC=clang CXX=clang++ cmake -S . -B build-san -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOECORE_CUDA=OFF \
    -DMOECORE_SANITIZE=address,undefined -DMOECORE_FUZZ=ON >build-san/configure.log 2>&1; then
  cat build-san/configure.log
  exit 1
fi
cmake --build build-san -j "$(nproc)"
cd build-san
# detect_leaks: the tests must not leak either; halt_on_error: the first report fails the test.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$PWD/../tests/sanitizer/lsan.supp:print_suppressions=0"
[ ! -x /usr/bin/llvm-symbolizer-14 ] || export ASAN_SYMBOLIZER_PATH=/usr/bin/llvm-symbolizer-14
if (($#)); then
  exec ctest --output-on-failure -j "$(nproc)" --timeout 900 "$@"
fi
status=0
ctest --output-on-failure -j "$(nproc)" --timeout 900 -LE "long|mpi|fuzz|gpu|format" || status=$?
ctest --output-on-failure -j "$(nproc)" -L fuzz -LE long || status=$?
exit $status
