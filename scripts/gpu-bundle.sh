#!/usr/bin/env bash
# Builds the GPU bundle here (no GPU needed): moecore and every GPU test binary for sm_90a (H100/H200) with a
# portable -march, the libraries they load that a bare Linux lacks, a small training corpus and the smoke-train
# flags, as one compressed file: .gpu-bundle/bundle.tar.xz (ignored by git: whatever copies the working tree to the
# GPU machine must carry it by name; scripts/gpu-check.sh unpacks and runs it there). cuBLAS, cuDNN, NCCL and the
# driver's libcuda are not carried: they come from the device (PyTorch's nvidia-* wheels, the driver).
# Usage: bash scripts/gpu-bundle.sh          (then: bash scripts/gpu-bundle-check.sh, as root, to prove it here)
# Bundle layout: run (helper: ./run PROGRAM ARGS... with the bundle's lib/), bin/moecore, tests/<GPU test binaries>,
# lib/, data/docs_text_document.{bin,idx} + data/train.flags, gpu-tests.tsv (each GPU test as ctest runs it), REV,
# SHA256SUMS.
set -euo pipefail
cd "$(dirname "$0")/.."
B=build-gpu
D=.gpu-bundle
cfg=(-DCMAKE_BUILD_TYPE=Release -DMOECORE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DMOECORE_MPI=OFF
  -DMOECORE_MARCH=x86-64-v3 -DMOECORE_TESTS=ON)
limit=40000000  # bytes: the bundle plus the tracked tree must stay under the 64 MiB that travels to the device
say() { echo "gpu-bundle: $*"; }
die() {
  echo "gpu-bundle: ERROR: $*" >&2
  exit 1
}

cutlass=$(bash scripts/cuda-build-deps.sh) || die "scripts/cuda-build-deps.sh failed (CUTLASS's headers from PyPI)"
cfg+=("$cutlass")
say "configuring $B (Release, CUDA sm_90a with CUTLASS, no MPI, -march=x86-64-v3)"
mkdir -p $B
cmake -S . -B $B -G Ninja "${cfg[@]}" >$B/gpu-bundle-configure.log 2>&1 ||
  {
    cat $B/gpu-bundle-configure.log
    die "cmake configure failed (log above)"
  }
grep -q "CUDA backend ON" $B/gpu-bundle-configure.log ||
  die "the CUDA backend is off in $B (see $B/gpu-bundle-configure.log): is nvcc at /usr/local/cuda/bin?"
grep -q "CUTLASS grouped GEMM (sm_90a) ON" $B/gpu-bundle-configure.log ||
  die "the CUTLASS grouped GEMM is off in $B (see $B/gpu-bundle-configure.log)"

# The GPU test binaries are the targets whose gtest discovery carries the ctest label "gpu". ctest itself knows a
# binary's tests and labels only once it is built, so the candidates are read from what CMake wrote at configure time:
# each discovery step in build.ninja names its target and test list (TEST_TARGET, TEST_LIST), and tests/CMakeLists.txt's
# moecore_discover writes that list's labels into tests/<list>_properties.cmake. They are built, then checked against
# ctest (the source of truth) below.
mapfile -t candidates < <(python3 - $B <<'PY'
import os, re, sys
b = sys.argv[1]
found = set()
for target, lst in re.findall(r'TEST_TARGET=(\S+) .*?TEST_LIST=(\S+)_tests\b', open(os.path.join(b, "build.ninja")).read()):
    props = os.path.join(b, "tests", lst + "_properties.cmake")
    if not os.path.exists(props):
        continue
    m = re.search(r"LABELS \[==\[([^\]]*)\]==\]", open(props).read())
    if m and "gpu" in m.group(1).split(";"):
        found.add(target)
sys.stdout.write("".join(t + "\n" for t in sorted(found)))
PY
)
[ ${#candidates[@]} -gt 0 ] || die "no test target in $B carries the ctest label gpu (tests/CMakeLists.txt)"
say "building moecore ${candidates[*]} (-j$(nproc))"
cmake --build $B --target moecore "${candidates[@]}" -j"$(nproc)"

S=$(mktemp -d /tmp/gpu-bundle.XXXXXX)
trap 'rm -rf "$S"' EXIT
(cd $B && ctest -L gpu --show-only=json-v1) >"$S/ctest.json" || die "ctest -L gpu --show-only=json-v1 failed in $B"
# One line per GPU test as ctest runs it: binary path, gtest filter, environment ("-" or "K=V K=V"), labels
# (comma-separated), ctest name.
python3 - "$S/ctest.json" >"$S/tests.tsv" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1]))["tests"]:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    cmd = t.get("command") or ["?"]
    flt = next((a.split("=", 1)[1] for a in cmd if a.startswith("--gtest_filter=")), t["name"])
    env = " ".join(props.get("ENVIRONMENT", [])) or "-"
    print(f"{cmd[0]}\t{flt}\t{env}\t{','.join(props.get('LABELS', []))}\t{t['name']}")
PY
# Two ctest entries that run the same test the same way mean a property was lost (CMake 3.25's gtest_discover_tests
# keeps only the first element of a list-valued property, e.g. LABELS "gpu;kernels" ENVIRONMENT ... loses the
# environment): say so, since gpu-check.sh can only run what ctest says.
awk -F'\t' 'seen[$1 FS $2 FS $3]++ { print "gpu-bundle: WARNING: ctest runs " $5 " exactly as another test (" $2 ", \
environment " $3 "): a lost ENVIRONMENT property in tests/CMakeLists.txt?" }' "$S/tests.tsv" >&2
mapfile -t binaries < <(cut -f1 "$S/tests.tsv" | sort -u)
[ ${#binaries[@]} -gt 0 ] || die "ctest -L gpu lists no test in $B"
for b in "${binaries[@]}"; do
  [ -x "$b" ] || die "ctest lists GPU tests of '$b', which is not a built program (a test registered without a binary?)"
  printf '%s\n' "${candidates[@]}" | grep -qx "$(basename "$b")" ||
    die "ctest's GPU test binary $b was not among the discovery targets read from build.ninja (${candidates[*]})"
done
say "GPU test binaries (from ctest -L gpu): ${binaries[*]##*/} ($(wc -l <"$S/tests.tsv") tests)"

mkdir -p "$S/b/bin" "$S/b/tests" "$S/b/lib" "$S/b/data"
cp $B/apps/moecore "$S/b/bin/"
cp "${binaries[@]}" "$S/b/tests/"
awk -F'\t' 'BEGIN { OFS = "\t" } { n = split($1, p, "/"); $1 = p[n]; print }' "$S/tests.tsv" >"$S/b/gpu-tests.tsv"
# Debug sections go; the symbol table stays (+0.9 MB compressed) so that compute-sanitizer's host backtraces and
# any crash on the device name moecore's functions.
strip --strip-debug "$S/b/bin/"* "$S/b/tests/"*

# Every library the programs load, except glibc's own (libc, libm, libdl, libpthread, librt, ..., the loader), libstdc++
# and libgcc_s, which every Linux has, and the device's CUDA libraries (driver, cuBLAS, cuDNN, NCCL), which must
# match the device's driver and are far too large to carry.
system='/(libc|libm|libmvec|libdl|libpthread|librt|libresolv|libutil|libanl|libstdc\+\+|libgcc_s|ld-linux-x86-64'
system+='|libcuda|libcublas[A-Za-z]*|libcudnn[A-Za-z_]*|libnccl)\.so'
for f in "$S/b/bin/"* "$S/b/tests/"*; do
  ldd "$f" | grep -q 'not found' && die "$f: ldd finds unresolved libraries here: $(ldd "$f" | grep 'not found')"
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'
done | sort -u | grep -Ev "$system" | while read -r lib; do cp -L "$lib" "$S/b/lib/"; done
for f in "$S/b/bin/"* "$S/b/tests/"*; do
  # With the bundle's lib/ first, every library must resolve to the bundle or to the kept system set.
  LD_LIBRARY_PATH="$S/b/lib" ldd "$f" | awk -v lib="$S/b/lib/" '$2 == "=>" && index($3, lib) != 1 { print $3 }' |
    grep -Ev "$system" && die "$f loads the libraries above from outside the bundle"
done
compgen -G "$S/b/lib/libcudart.so*" >/dev/null || die "libcudart was not collected (is the build linked against it?)"

# The training corpus: the repository's own documentation, one JSON document per paragraph, tokenized as bytes
# (ByteLevel needs no tokenizer files). About 150 KB, enough for a short training run.
python3 - docs/*.md README.md >"$S/docs.jsonl" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for p in open(path, encoding="utf-8").read().split("\n\n"):
        if len(p.strip()) > 200:
            print(json.dumps({"text": p.strip()}))
PY
"$S/b/bin/moecore" preprocess --input "$S/docs.jsonl" --output-prefix "$S/b/data/docs" --tokenizer-type ByteLevel \
  --append-eod --workers 2 >"$S/preprocess.log" 2>&1 || {
  cat "$S/preprocess.log"
  die "moecore preprocess failed"
}
# The smoke-training flags shared by gpu-bundle-check.sh and gpu-check.sh (relative to the bundle root; add
# --device and --train-iters): a 2-layer MoE GPT (8 experts, top-2), no dropout, so cpu and cuda runs compare.
cat >"$S/b/data/train.flags" <<'EOF'
--data-path data/docs_text_document --split 98,2,0 --tokenizer-type ByteLevel
--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
--attention-dropout 0.0 --hidden-dropout 0.0 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512
--moe-aux-loss-coeff 1e-2 --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --seed 1234 --log-interval 1
--eval-iters 1 --generate-tokens 0
EOF

cat >"$S/b/run" <<'EOF'
#!/bin/sh
# Runs a program of this bundle with the bundle's libraries first: ./run moecore --help; ./run test_gpu.
# cuBLAS (dlopen'ed by the CUDA backend) comes from LD_LIBRARY_PATH as set by the caller (scripts/gpu-check.sh
# adds the device's PyTorch nvidia/*/lib folders).
here=$(cd "$(dirname "$0")" && pwd)
if [ $# = 0 ]; then
  echo "usage: $0 PROGRAM [ARGS...]  (programs: $(ls "$here/bin" "$here/tests" | tr '\n' ' '))" >&2
  exit 2
fi
name=$1
shift
for d in bin tests; do
  if [ -x "$here/$d/$name" ]; then
    LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/$d/$name" "$@"
  fi
done
echo "$0: no program '$name' in $here/bin or $here/tests" >&2
exit 127
EOF
chmod +x "$S/b/run"

{
  echo "commit $(git rev-parse HEAD)"
  echo "describe $(git describe --always --dirty)"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n) with $(gcc --version | head -1)"
  echo "nvcc: $(/usr/local/cuda/bin/nvcc --version | tail -1)"
  echo "cmake ${cfg[*]}"
  echo "uncommitted changes in the build (git status --porcelain):"
  git status --porcelain --untracked-files=no | sed 's/^/  /'
} >"$S/b/REV"
(cd "$S/b" && find . -type f ! -name SHA256SUMS | sort | xargs sha256sum >SHA256SUMS)

rm -rf $D
mkdir -p $D
say "compressing $(du -sh "$S/b" | cut -f1) with xz -9"
tar -C "$S/b" --owner=0 --group=0 -cf - . | xz -9 -T0 >$D/bundle.tar.xz
size=$(stat -c %s $D/bundle.tar.xz)
[ "$size" -lt $limit ] || die "$D/bundle.tar.xz is $size bytes, over the $limit-byte limit"
(cd "$S/b" && du -b bin/* tests/* lib/* data/* | sort -k2) | awk '{ printf "  %10d  %s\n", $1, $2 }'
say "$D/bundle.tar.xz: $size bytes (limit $limit); $(sed -n 2p "$S/b/REV")"
