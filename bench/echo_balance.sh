#!/usr/bin/env bash
# MoE ECHO against skewed routing (issue 14's targets). Trains one MoE model under expert parallelism (NP ranks x 1
# thread, EP = NP, alltoall) on the same global batches four ways:
#   balanced  --moe-router-force-load-balancing (random logits: every EP rank near the average load)
#   skewed    --moe-router-force-biased SKEW (random logits plus a fixed per-layer expert bias: hot experts)
#   echo      skewed, with --moe-enable-echo --moe-num-echo-experts SLOTS x NP
#   capacity  echo, with --moe-received-token-capacity 1.25 (dropless: overflowing steps run again, synced)
#   capacity_alone  skewed, with the capacity but without ECHO
# and prints, from the metrics JSONL (the log intervals after the first, which holds start-up; best of REPEATS
# alternating rounds): tokens/s, the max/mean received load per EP rank before and after ECHO's plan, the share of the
# imbalance's cost that ECHO wins back ((t_skewed - t_echo) / (t_skewed - t_balanced), t = seconds per token), and the
# share of steps the capacity run retried. Needs an MPI build and mpirun.
# Usage: bash bench/echo_balance.sh [BINARY] [ITERS] [NP]     (default build/apps/moecore, 30, 2)
# Environment: SKEW (default -1.5), SLOTS per rank (default 2), REPEATS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/apps/moecore}
iters=${2:-30}
np=${3:-2}
skew=${SKEW:--1.5}
slots=${SLOTS:-2}
out=build/bench-echo
mkdir -p "$out"
text=../shared/data/tinyshakespeare/input.txt
[ -f "$text" ] || text=/usr/share/games/fortunes/fortunes
[ -s "$out/corpus_text_document.idx" ] || "$bin" preprocess --input "$text" --input-format text \
  --documents-by-blank-line --output-prefix "$out/corpus" --tokenizer-type ByteLevel --append-eod >/dev/null
rm -f "$out"/*.jsonl  # the metrics writer appends
args=(train --data-path "$out/corpus_text_document" --tokenizer-type ByteLevel --split 100,0,0
  --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --swiglu
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024
  --micro-batch-size 4 --global-batch-size $((4 * np)) --train-iters "$iters" --lr 1e-3 --log-interval 5
  --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --attention-dropout 0.0
  --hidden-dropout 0.0 --generate-tokens 0
  --expert-model-parallel-size "$np" --moe-token-dispatcher-type alltoall)
echo_args=(--moe-router-force-biased "$skew" --moe-enable-echo --moe-num-echo-experts $((slots * np)))
run() {  # name, extra flags...
  local name=$1
  shift
  OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np "$np" "$bin" "${args[@]}" "$@" \
    --metrics-jsonl "$out/${name}_$r.jsonl" >"$out/${name}_$r.log"
}
for r in $(seq 1 "${REPEATS:-2}"); do
  run balanced --moe-router-force-load-balancing
  run skewed --moe-router-force-biased "$skew"
  run echo "${echo_args[@]}"
  run capacity "${echo_args[@]}" --moe-received-token-capacity 1.25
  run capacity_alone --moe-router-force-biased "$skew" --moe-received-token-capacity 1.25
done
/usr/bin/python3 - "$out" "$np" "$skew" "$slots" <<'PY'
import glob, json, sys
out, np, skew, slots = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def best(name):
    res = []
    for path in sorted(glob.glob(f"{out}/{name}_*.jsonl")):
        rows = [json.loads(l) for l in open(path) if '"tokens_per_s"' in l]
        tail = rows[1:]  # first interval: start-up
        res.append((sum(r["tokens_per_s"] for r in tail) / len(tail), rows))
    return max(res, key=lambda x: x[0])
def mean(rows, key):
    v = [r[key] for r in rows[1:] if key in r]
    return sum(v) / len(v) if v else float("nan")
(tb, _), (ts, _), (te, re), (tc, rc) = best("balanced"), best("skewed"), best("echo"), best("capacity")
print(f"echo_balance: {np} ranks x 1 thread, EP {np}, --moe-router-force-biased {skew}, {slots} slots per rank")
print(f"echo_balance: tokens/s balanced {tb:.0f} | skewed {ts:.0f} | skewed + ECHO {te:.0f} | "
      f"+ capacity 1.25 {tc:.0f}")
print(f"echo_balance: max/mean received per EP rank (worst layer, last micro-batch, mean over intervals): "
      f"{mean(re, 'moe/echo_max_over_mean_before'):.3f} -> {mean(re, 'moe/echo_max_over_mean_after'):.3f} "
      f"(target <= 1.15)")
cost = 1 / ts - 1 / tb
gain = 1 / ts - 1 / te
print(f"echo_balance: imbalance costs {100 * cost * tb:.1f}% of the balanced step time; ECHO wins back "
      f"{100 * gain / cost if cost > 0 else float('nan'):.0f}% of it (target >= 50%)")
steps = int(rc[-1]["iteration"])
retries = sum(r.get("moe/capacity_retries", 0) for r in rc)
print(f"echo_balance: capacity 1.25 with ECHO: {int(retries)} retried steps of {steps} "
      f"({100 * retries / steps:.1f}%, target < 5%)")
ta, ra = best("capacity_alone")
alone = sum(r.get("moe/capacity_retries", 0) for r in ra)
print(f"echo_balance: capacity 1.25 without ECHO: {int(alone)} retried steps of {int(ra[-1]['iteration'])} "
      f"({ta:.0f} tokens/s)")
PY
