#!/usr/bin/env bash
# Parallel-layout sweep on one machine (issue 12): the same model on the same global batches under each layout, one
# process with 2 OpenMP threads as the reference, then `mpirun -np 2` with one thread per rank. Prints, per layout,
# tokens/s relative to 1 rank x 2 threads (mean over the log intervals after the first, which holds start-up; best of
# REPEATS alternating rounds, default 2) and the share of step time rank 0 spent blocked in communication
# (comm/exposed_share: every collective, from the trainer's comm_blocked_seconds) and the part of it spent in the
# gradient reduction (comm/grad_reduce_share). Needs an MPI build and mpirun.
#   dense: GPT with hidden 1024 (16 heads, SwiGLU ffn 2816, 2 layers, seq 256): DP 2 (one 40M-element bucket, the
#          default), DP 2 with 2M-element buckets without and with --overlap-grad-reduce, the same with the
#          distributed optimizer (overlap: --overlap-grad-reduce --overlap-param-gather), TP 2, TP 2 + SP, CP 2
#   moe:   4 layers, hidden 256, 8 experts top-2: EP 2 (alltoall), TP 2 + SP (experts over ETP 2, the default), TP 2
#          + SP with ETP 1, alone and with EP 2, DP 2 with the experts over ETP 2, CP 2 with EP 2
#   fsdp:  the dense model with 4 layers at DP 2 (issue 31): the distributed optimizer with its overlap, then
#          Megatron-FSDP's optim_grads and optim_grads_params; the last lines give each FSDP layout's step time over the
#          distributed optimizer's (the target: within 1.15)
# Usage: bash bench/layout_sweep.sh [BINARY] [ITERS] [dense|moe|fsdp|both]   (default build/apps/moecore, 16, both)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/apps/moecore}
iters=${2:-16}
which=${3:-both}
out=build/bench-layouts
mkdir -p "$out"
text=../shared/data/tinyshakespeare/input.txt
[ -f "$text" ] || text=/usr/share/games/fortunes/fortunes
[ -s "$out/corpus_text_document.idx" ] || "$bin" preprocess --input "$text" --input-format text \
  --documents-by-blank-line --output-prefix "$out/corpus" --tokenizer-type ByteLevel --append-eod >/dev/null
common=(train --data-path "$out/corpus_text_document" --tokenizer-type ByteLevel --split 100,0,0
  --train-iters "$iters" --lr 1e-3 --log-interval 4 --normalization RMSNorm --position-embedding-type rope
  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --generate-tokens 0 --swiglu
  --make-vocab-size-divisible-by 256)
dense=(--num-layers 2 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2816 --seq-length 256
  --micro-batch-size 2 --global-batch-size 8)
fsdp=(--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2816 --seq-length 256
  --micro-batch-size 2 --global-batch-size 8)
moe=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --num-experts 8 --moe-router-topk 2
  --moe-ffn-hidden-size 512 --moe-aux-loss-coeff 1e-2 --micro-batch-size 4 --global-batch-size 16
  --moe-token-dispatcher-type alltoall)
run_model() {  # name, model flags array name, then "label|flags" per layout
  local name=$1 model=$2
  shift 2
  local -n flags=$model
  rm -f "$out/${name}"_*.jsonl  # the metrics writer appends
  for r in $(seq 1 "${REPEATS:-2}"); do
    OMP_NUM_THREADS=2 "$bin" "${common[@]}" "${flags[@]}" --metrics-jsonl "$out/${name}_ref_$r.jsonl" \
      >"$out/${name}_ref_$r.log"
    local i=0
    for layout in "$@"; do
      i=$((i + 1))
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np 2 "$bin" "${common[@]}" "${flags[@]}" \
        ${layout#*|} --metrics-jsonl "$out/${name}_l${i}_$r.jsonl" >"$out/${name}_l${i}_$r.log"
    done
  done
  /usr/bin/python3 - "$out" "$name" "$@" <<'PY'
import glob, json, sys
out, name, layouts = sys.argv[1], sys.argv[2], sys.argv[3:]
def best(tag):
    res = []
    for path in sorted(glob.glob(f"{out}/{name}_{tag}_*.jsonl")):
        rows = [json.loads(l) for l in open(path) if '"tokens_per_s"' in l][1:]  # first interval: start-up
        tps = sum(r["tokens_per_s"] for r in rows) / len(rows)
        share = [r["comm/exposed_share"] for r in rows if "comm/exposed_share" in r]
        grads = [r["comm/grad_reduce_share"] for r in rows if "comm/grad_reduce_share" in r]
        mean = lambda v: sum(v) / len(v) if v else float("nan")
        res.append((tps, mean(share), mean(grads)))
    return max(res)
ref = best("ref")[0]
print(f"layout_sweep {name}: 1 rank x 2 threads {ref:.0f} tokens/s (reference)")
got = []
for i, layout in enumerate(layouts, 1):
    tps, share, grads = best(f"l{i}")
    got.append(tps)
    print(f"layout_sweep {name}: {layout.split('|')[0]:<24} {tps:8.0f} tokens/s | ratio {tps / ref:.3f} | "
          f"exposed comm {100 * share:.1f}% of step time, of which the gradient reduction {100 * grads:.1f}%")
if name == "fsdp":  # the first layout is the distributed optimizer's
    for layout, tps in zip(layouts[1:], got[1:]):
        print(f"layout_sweep fsdp: {layout.split('|')[0]:<24} step time / distributed optimizer's {got[0] / tps:.3f}")
PY
}
if [ "$which" = dense ] || [ "$which" = both ]; then
  run_model dense dense "DP 2|" "DP 2, 2M buckets|--ddp-bucket-size 2000000" \
    "DP 2, 2M buckets, overlap|--ddp-bucket-size 2000000 --overlap-grad-reduce" \
    "DP 2, ZeRO, 2M buckets|--use-distributed-optimizer --ddp-bucket-size 2000000" \
    "DP 2, ZeRO, 2M, overlap|--use-distributed-optimizer --ddp-bucket-size 2000000 --overlap-grad-reduce --overlap-param-gather" \
    "TP 2|--tensor-model-parallel-size 2" "TP 2 + SP|--tensor-model-parallel-size 2 --sequence-parallel" \
    "CP 2|--context-parallel-size 2"
fi
if [ "$which" = fsdp ]; then
  megatron_fsdp="--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy"
  run_model fsdp fsdp \
    "DP 2, ZeRO, overlap|--use-distributed-optimizer --ddp-bucket-size 2000000 --overlap-grad-reduce --overlap-param-gather" \
    "DP 2, FSDP optim_grads|$megatron_fsdp optim_grads" "DP 2, FSDP optim_grads_params|$megatron_fsdp optim_grads_params"
  exit 0
fi
if [ "$which" != dense ]; then
  run_model moe moe "EP 2|--expert-model-parallel-size 2" \
    "TP 2 + SP (ETP 2)|--tensor-model-parallel-size 2 --sequence-parallel" \
    "TP 2 + SP, ETP 1|--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1" \
    "TP 2 + SP, EP 2, ETP 1|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1" \
    "DP 2, ETP 2|--expert-tensor-parallel-size 2" \
    "CP 2, EP 2|--context-parallel-size 2 --expert-model-parallel-size 2"
fi
