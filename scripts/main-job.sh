#!/usr/bin/env bash
# The main job: builds moecore, then trains a small MoE GPT (8 experts, top-2, aux loss) on a real English
# corpus from Debian's `fortunes` package (about 2.5 MB of quotations, byte-level tokens), showing the loss
# fall, the balancing loss, and a generated sample at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
corpus=build/fortunes.txt
if [ ! -s "$corpus" ]; then
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort | xargs cat >"$corpus"
fi
exec ./build/apps/moecore train --data-path "$corpus" \
  --num-layers 4 --hidden-size 192 --num-attention-heads 6 --num-query-groups 2 --seq-length 128 \
  --swiglu --untie-embeddings-and-output-weights \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 384 --moe-aux-loss-coeff 1e-2 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters 1500 --lr 2e-3 --min-lr 2e-4 \
  --lr-warmup-iters 100 --log-interval 50 --eval-interval 250 --prompt "A wise man " "$@"
