#!/usr/bin/env bash
# The main job: builds moecore, then trains a small GPT on a real English corpus from Debian's `fortunes`
# package (about 2.5 MB of quotations, byte-level tokens), showing the loss fall and a generated sample.
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
  --micro-batch-size 8 --global-batch-size 16 --train-iters 1500 --lr 2e-3 --min-lr 2e-4 \
  --lr-warmup-iters 100 --log-interval 50 --eval-interval 250 --prompt "A wise man " "$@"
