#!/usr/bin/env bash
# The main job: builds moecore, then trains a small MoE GPT (8 experts, top-2, aux loss) on a real English
# corpus from Debian's `fortunes` package (about 15,000 quotations, 2.7 MB), end to end the Megatron way:
#   1. the fortunes become JSONL documents;
#   2. a 4,000-piece SentencePiece BPE model is trained on them (spm_train, Debian's `sentencepiece`);
#   3. `moecore preprocess` tokenizes them into Megatron .bin/.idx;
#   4. `moecore train` trains with Megatron's flags, logging loss, balancing loss, MFU and ETA, saving
#      a checkpoint, and printing a generated sample at the end (about 6 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
work=build/main-job
mkdir -p "$work"
if [ ! -s "$work/fortunes_text_document.idx" ]; then
  mapfile -t files < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort)
  python3 scripts/fortunes_to_jsonl.py "$work/fortunes.jsonl" "${files[@]}"
  spm_train --input="$work/fortunes.jsonl" --model_prefix="$work/fortunes_sp" --vocab_size=4000 \
    --model_type=bpe --character_coverage=1.0 --num_threads=2 --minloglevel=2 >/dev/null
  ./build/apps/moecore preprocess --input "$work/fortunes.jsonl" --output-prefix "$work/fortunes" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/fortunes_sp.model" --append-eod --workers 2
fi
./build/apps/moecore train --data-path "$work/fortunes_text_document" --split 95,5,0 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/fortunes_sp.model" \
  --num-layers 4 --hidden-size 192 --num-attention-heads 6 --group-query-attention --num-query-groups 2 \
  --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope --normalization RMSNorm \
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 384 --moe-aux-loss-coeff 1e-2 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters 1200 --lr 2e-3 --min-lr 2e-4 \
  --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1 --adam-beta2 0.95 --exit-signal-handler \
  --log-interval 50 --eval-interval 200 --eval-iters 8 \
  --save "$work/checkpoints" --save-interval 400 --keep-last-checkpoints 2 \
  --metrics-jsonl "$work/metrics.jsonl" --tensorboard-dir "$work/tensorboard" \
  --prompt "A wise man " "$@"
# 5. The loss curves from the metrics JSONL (training loss per logged iteration, validation loss) as a PNG.
if [ -s "$work/metrics.jsonl" ]; then
  /usr/bin/python3 tools/plot_curves.py --title "main job: MoE GPT on Debian's fortunes" \
    "$work/loss.png" "$work/metrics.jsonl" >/dev/null
  echo "Loss curve: $work/loss.png (training and validation loss from $work/metrics.jsonl)"
fi
