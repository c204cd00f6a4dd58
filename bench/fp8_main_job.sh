#!/usr/bin/env bash
# FP8 against bf16 on the main job's model (issue 32): the main job's flags (scripts/main-job.sh: 4 layers, hidden 192,
# 8 experts top-2, Debian's fortunes with its SentencePiece model) for 200 iterations with --bf16, then with --bf16
# and each FP8 recipe given (--fp8-format hybrid), one process each. Prints, per recipe, the largest difference of the
# logged training loss (every 10 iterations) and the difference of the final validation loss from the bf16 run, and
# fails (exit 1) when either exceeds BAND (default 0.1, on a loss that falls from 8.2 to 5.5); also prints the step time
# ratio to bf16 (mean tokens/s over the logged intervals after the first; meaningful on an otherwise idle machine).
# Needs the main job's dataset: run `bash scripts/main-job.sh` first (it writes build/main-job/).
#   usage: bash bench/fp8_main_job.sh [MOECORE_BINARY] [RECIPES...]   (default: build/apps/moecore tensorwise
#          blockwise mxfp8); BAND=0.1 ITERS=200 in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/apps/moecore}
shift || true
recipes=("$@")
((${#recipes[@]})) || recipes=(tensorwise blockwise mxfp8)
band=${BAND:-0.1}
iters=${ITERS:-200}
work=build/main-job
if [ ! -s "$work/fortunes_text_document.idx" ] || [ ! -s "$work/fortunes_sp.model" ]; then
  echo "fp8_main_job: $work has no fortunes dataset; run bash scripts/main-job.sh first" >&2
  exit 2
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {  # name, extra flags...
  local name=$1
  shift
  "$bin" train --data-path "$work/fortunes_text_document" --split 95,5,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/fortunes_sp.model" \
    --num-layers 4 --hidden-size 192 --num-attention-heads 6 --group-query-attention --num-query-groups 2 \
    --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope --normalization RMSNorm \
    --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 384 --moe-aux-loss-coeff 1e-2 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$iters" --lr 2e-3 --min-lr 2e-4 \
    --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1 --adam-beta2 0.95 \
    --log-interval 10 --eval-interval "$iters" --eval-iters 8 --generate-tokens 0 --bf16 "$@" \
    --metrics-jsonl "$out/$name.jsonl" >"$out/$name.log" 2>&1 || {
    cat "$out/$name.log" >&2
    exit 1
  }
}
run bf16
status=0
for r in "${recipes[@]}"; do
  run "$r" --fp8-format hybrid --fp8-recipe "$r"
  python3 - "$out/bf16.jsonl" "$out/$r.jsonl" "$r" "$band" <<'EOF' || status=1
import json, sys
def read(path):
    train, valid, speed = {}, None, []
    for line in open(path):
        d = json.loads(line)
        if "lm_loss" in d:
            train[d["iteration"]] = d["lm_loss"]
            speed.append(d["tokens_per_s"])
        if "valid_lm_loss" in d:
            valid = d["valid_lm_loss"]
    return train, valid, sum(speed[1:]) / max(len(speed) - 1, 1)
(bt, bv, bs), (ft, fv, fs) = read(sys.argv[1]), read(sys.argv[2])
name, band = sys.argv[3], float(sys.argv[4])
worst = max(abs(ft[i] - bt[i]) for i in bt)
dv = abs(fv - bv) if fv is not None and bv is not None else float("nan")
ok = worst <= band and not dv > band
print(f"{name}: train loss {bt[max(bt)]:.4f} (bf16) {ft[max(ft)]:.4f} (fp8), largest difference {worst:.4f}; "
      f"validation {bv:.4f} (bf16) {fv:.4f} (fp8), difference {dv:.4f}; step time / bf16 {bs / fs:.3f}; band {band}: "
      f"{'ok' if ok else 'OUTSIDE'}")
sys.exit(0 if ok else 1)
EOF
done
exit $status
