#!/usr/bin/env bash
# Proves here, without a GPU, that .gpu-bundle/bundle.tar.xz (scripts/gpu-bundle.sh) is self-contained: it is
# unpacked into a copy of a brand-new Debian 12 root with no packages installed (debootstrap minbase, the pristine
# root ../shared/tools/fresh-debian-check makes and reuses) and, in a chroot with an empty environment (env -i):
#   1. the checksums hold, every library resolves (libcudart from the bundle; the driver's libcuda.so.1 is absent);
#   2. `moecore --help` runs;
#   3. every GPU test binary runs and its GPU tests skip, and with MOECORE_REQUIRE_GPU=1 the same binary FAILS;
#   4. a 2-step CPU training on the bundle's own data (data/train.flags) runs.
# Usage (from the project root, as root): bash scripts/gpu-bundle-check.sh [BUNDLE]
#   BUNDLE defaults to .gpu-bundle/bundle.tar.xz.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=$(realpath "${1:-.gpu-bundle/bundle.tar.xz}")
[ -f "$bundle" ] || {
  echo "gpu-bundle-check: no bundle at $bundle: run bash scripts/gpu-bundle.sh first" >&2
  exit 2
}
[ "$(id -u)" -eq 0 ] || {
  echo "gpu-bundle-check: run as root (chroot)" >&2
  exit 2
}
base=/var/tmp/fresh-debian-base
if [ ! -f $base/.ok ]; then  # made exactly as ../shared/tools/fresh-debian-check makes it, once
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  rm -rf $base
  echo "gpu-bundle-check: making a pristine Debian 12 root in $base (once)"
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list)
  debootstrap --variant=minbase bookworm $base "$mirror" >/var/tmp/fresh-debian-base.log 2>&1 ||
    {
      echo "gpu-bundle-check: debootstrap failed: see /var/tmp/fresh-debian-base.log" >&2
      exit 1
    }
  touch $base/.ok
fi
root=$(mktemp -d /var/tmp/gpu-bundle-root.XXXXXX)
cleanup() {
  for m in dev/pts dev proc sys; do umount -l "$root/$m" 2>/dev/null || true; done
  rm -rf "$root"
}
trap cleanup EXIT
cp -a $base/. "$root/"
mkdir -p "$root/opt/moecore-bundle"
tar -C "$root/opt/moecore-bundle" -xJf "$bundle"
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
mount --bind /dev "$root/dev"
mount -t devpts devpts "$root/dev/pts" 2>/dev/null || true
echo "gpu-bundle-check: $bundle ($(stat -c %s "$bundle") bytes) unpacked into a fresh Debian 12 root ($root)"

cat >"$root/tmp/check.sh" <<'EOF'
# Runs inside the chroot, from the bundle's root, with env -i.
cd /opt/moecore-bundle
fails=0
ok() { echo "CHECK PASS  $*"; }
bad() { echo "CHECK FAIL  $*"; fails=$((fails + 1)); }
echo "--- $(sed -n 2p REV); $(. /etc/os-release && echo "$PRETTY_NAME"); $(ldd --version | head -1)"
echo "--- packages installed in this root: $(dpkg-query -W -f '${Package}\n' | wc -l) (debootstrap minbase only)"
if sha256sum -c --quiet SHA256SUMS; then ok "SHA256SUMS ($(wc -l <SHA256SUMS) files)"; else bad "SHA256SUMS"; fi
missing=$(for f in bin/* tests/*; do LD_LIBRARY_PATH=$PWD/lib ldd "$f" | grep 'not found'; done)
cudart=$(LD_LIBRARY_PATH=$PWD/lib ldd bin/moecore | awk '/libcudart/ {print $3}')
if [ -z "$missing" ] && [ "${cudart#/opt/moecore-bundle/lib/}" != "$cudart" ]; then
  ok "every library resolves; libcudart from the bundle ($cudart)"
else
  bad "libraries: missing [$missing], libcudart at [$cudart]"
fi
if ls /usr/lib/x86_64-linux-gnu/libcuda.so* /lib/x86_64-linux-gnu/libcuda.so* >/dev/null 2>&1; then
  bad "this root has a libcuda.so: it is not the driver-less root the check needs"
else
  echo "--- no libcuda.so.1 in this root: device_available() is false, as on a machine without a GPU driver"
fi

out=$(timeout 30 ./run moecore --help 2>&1)
rc=$?
echo "$out" | head -4 | sed 's/^/    /'
if [ $rc = 0 ]; then ok "moecore --help"; else bad "moecore --help (rc=$rc)"; fi

for t in tests/*; do
  t=${t#tests/}
  out=$(timeout 120 ./run "$t" 2>&1)
  rc=$?
  total=$(echo "$out" | sed -n 's/^\[==========\] \([0-9]*\) tests\? from .* ran.*/\1/p' | tail -1)
  passed=$(echo "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\..*/\1/p')
  skipped=$(echo "$out" | sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?, listed below.*/\1/p')
  why=$(echo "$out" | grep -m1 -o 'no CUDA device[^"]*')
  echo "    $t: rc=$rc, ${total:-?} tests: ${passed:-0} passed, ${skipped:-0} skipped (\"$why\")"
  if [ $rc = 0 ] && [ "${skipped:-0}" -gt 0 ] && [ -n "$why" ]; then
    ok "$t: its GPU tests skip without a GPU"
  else
    bad "$t: expected rc 0 with the GPU tests skipped"
    echo "$out" | tail -20 | sed 's/^/      /'
  fi
  out=$(MOECORE_REQUIRE_GPU=1 timeout 120 ./run "$t" 2>&1)
  rc=$?
  failed=$(echo "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\?, listed below.*/\1/p')
  if [ $rc != 0 ] && [ $rc -lt 124 ]; then
    ok "$t with MOECORE_REQUIRE_GPU=1 fails (rc=$rc, ${failed:-?} tests failed)"
    echo "$out" | grep -m1 -i 'MOECORE_REQUIRE_GPU' | sed 's/^/      /'
  else
    bad "$t with MOECORE_REQUIRE_GPU=1: rc=$rc; a missing GPU must fail it (tests/cuda_test_util.h)"
  fi
done

# shellcheck disable=SC2046  # the flags file is a word list by design
out=$(timeout 300 ./run moecore train $(cat data/train.flags) --device cpu --train-iters 2 2>&1)
rc=$?
echo "$out" | grep -E 'iteration +[0-9]+/' | sed 's/^/    /'
if [ $rc = 0 ] && echo "$out" | grep -qE 'iteration +2/ +2 '; then
  ok "2-step CPU training on data/docs_text_document"
else
  bad "2-step CPU training (rc=$rc)"
  echo "$out" | tail -20 | sed 's/^/      /'
fi
echo "--- $fails check(s) failed"
exit $((fails > 0))
EOF
if chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin bash /tmp/check.sh; then
  echo "gpu-bundle-check: PASSED: the bundle runs in a fresh Debian 12 root with no packages installed"
else
  echo "gpu-bundle-check: FAILED (see CHECK FAIL above)"
  exit 1
fi
