#!/usr/bin/env bash
# Quality report (issue: MoE vs dense at equal active parameters and token budget). Tokenizes
# tinyshakespeare with the GPT-2 BPE tokenizer, trains an 8-expert top-2 MoE and the dense model with the same
# active parameters (dense ffn = 2 x expert ffn) on the same tokens, and plots both validation curves into
# docs/moe_vs_dense.png. Needs ../shared/data and python3-matplotlib.
# Usage: bash tools/quality_report.sh [ITERS (300)] [SEED (1234)]
set -euo pipefail
cd "$(dirname "$0")/.."
iters=${1:-300}
seed=${2:-1234}
data=../shared/data
out=build/quality
mkdir -p "$out"
[ -s "$out/shakespeare_text_document.idx" ] || ./build/apps/moecore preprocess \
  --input "$data/tinyshakespeare/input.txt" --input-format text --documents-by-blank-line \
  --output-prefix "$out/shakespeare" --tokenizer-type GPT2BPETokenizer \
  --vocab-file "$data/gpt2/gpt2-vocab.json" --merge-file "$data/gpt2/gpt2-merges.txt" --append-eod --workers 2
rm -f "$out/dense.jsonl" "$out/moe.jsonl"  # --metrics-jsonl appends (so resumed runs continue a file)
common=(--data-path "$out/shakespeare_text_document" --split 90,10,0 --tokenizer-type GPT2BPETokenizer
  --vocab-file "$data/gpt2/gpt2-vocab.json" --merge-file "$data/gpt2/gpt2-merges.txt"
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --swiglu
  --micro-batch-size 8 --global-batch-size 16 --train-iters "$iters" --lr 3e-3 --min-lr 3e-4
  --lr-warmup-iters 50 --log-interval 50 --eval-interval 50 --eval-iters 16 --generate-tokens 0 --seed "$seed"
  # The recipe the report was measured with (Megatron's defaults differ: LayerNorm, learned positions, biases,
  # dropout 0.1, linear decay, weight decay 0.01, beta2 0.999).
  --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --attention-dropout 0.0
  --hidden-dropout 0.0 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95)
./build/apps/moecore train "${common[@]}" --ffn-hidden-size 512 \
  --metrics-jsonl "$out/dense.jsonl" | tee "$out/dense.log"
./build/apps/moecore train "${common[@]}" --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 \
  --moe-aux-loss-coeff 1e-3 --moe-router-topk-scaling-factor 2 --metrics-jsonl "$out/moe.jsonl" | tee "$out/moe.log"
/usr/bin/python3 tools/plot_curves.py --title "tinyshakespeare, GPT-2 tokenizer: MoE vs dense at equal active parameters" \
  --xlabel "iteration (16 x 128 tokens each)" docs/moe_vs_dense.png "dense (ffn 512)=$out/dense.jsonl" \
  "MoE 8 experts top-2 (expert ffn 256, scaling 2)=$out/moe.jsonl"
