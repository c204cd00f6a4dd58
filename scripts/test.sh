#!/usr/bin/env bash
# Builds moecore and runs the default test suite (everything except the "long" label), then the sanitizer and
# fuzz half (scripts/sanitize.sh).
# GPU tests carry the "gpu" label and skip themselves when no GPU is present.
# Test-time Python tools come from PyPI into a virtual environment, build/test-venv (Debian's python3-venv),
# created once and reused while it works; its interpreter is exported as MOECORE_TEST_PYTHON, which
# TensorBoard.PythonTensorboardReadsOurFiles runs (unset, that test skips). A machine that cannot reach PyPI
# (offline, or behind a TLS proxy whose certificate it does not trust) cannot run that one test: the suite then
# runs without it and says so loudly at the start and the end.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=build/test-venv
tensorboard_req="tensorboard==2.21.0"
venv_ok() {
  [ -x "$venv/bin/python3" ] && "$venv/bin/python3" - "${tensorboard_req#tensorboard==}" <<'EOF' >/dev/null 2>&1
import sys
import tensorboard
from tensorboard.backend.event_processing import event_accumulator  # noqa: F401
sys.exit(tensorboard.__version__ != sys.argv[1])
EOF
}
no_pypi=""
if venv_ok; then
  echo "test.sh: reusing $venv ($tensorboard_req)"
else
  echo "test.sh: creating $venv and installing $tensorboard_req from PyPI"
  rm -rf "$venv"
  mkdir -p build
  /usr/bin/python3 -m venv "$venv"
  if ! "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check --retries 2 --timeout 60 \
      "$tensorboard_req" || ! venv_ok; then
    rm -rf "$venv"
    no_pypi="test.sh: WARNING: could not install $tensorboard_req from PyPI into $venv: this machine cannot run
test.sh: WARNING: TensorBoard.PythonTensorboardReadsOurFiles (it will be SKIPPED; the C++ reader tests still run)."
    echo "$no_pypi" >&2
  fi
fi
[ -n "$no_pypi" ] || export MOECORE_TEST_PYTHON="$PWD/$venv/bin/python3"

bash scripts/build.sh
status=0
suite=0
(cd build && ctest --output-on-failure -j "$(nproc)" -LE long --timeout 900) || suite=$?
status=$suite
# The hardening half: the unit, module and command-line tests again under AddressSanitizer + UBSan, and every
# reader's libFuzzer harness for a short fixed budget (scripts/sanitize.sh, its own build in build-san/).
bash scripts/sanitize.sh || status=$?
# A failure of the default suite is named again at the end (a CI log is read from its tail), with the failed tests'
# output from one more run of each; the exit status stays the first run's.
failed=build/Testing/Temporary/LastTestsFailed.log
if [ "$suite" -ne 0 ] && [ -s "$failed" ]; then
  echo "test.sh: the default suite FAILED (ctest exit $suite): these tests, run once more for their output:"
  sed 's/^/test.sh:   /' "$failed"
  (cd build && ctest --rerun-failed --output-on-failure --timeout 300) || true
  echo "test.sh: the default suite FAILED (above: its failed tests, run once more)"
fi
[ -z "$no_pypi" ] || echo "$no_pypi" >&2
exit $status
