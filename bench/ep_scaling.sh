#!/usr/bin/env bash
# Expert-parallel scaling on one machine (issue: 2 ranks x 1 thread vs 1 rank x 2 threads). Trains the same
# MoE model on the same global batches twice -- one process with 2 OpenMP threads, then `mpirun -np 2` with
# one thread per rank and --expert-model-parallel-size 2 (alltoall dispatcher) -- and prints the tokens/s
# ratio (averaged over the log intervals after the first, which holds start-up) and the share of step time
# each EP run spent in the dispatcher's all-to-all. Needs an MPI build (MOECORE_MPI=ON) and mpirun.
# Usage: bash bench/ep_scaling.sh [BINARY] [ITERS]     (default build-mpi/apps/moecore, 40)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build-mpi/apps/moecore}
iters=${2:-40}
out=build/bench-ep
mkdir -p "$out"
text=../shared/data/tinyshakespeare/input.txt
[ -f "$text" ] || text=/usr/share/games/fortunes/fortunes
[ -s "$out/corpus_text_document.idx" ] || "$bin" preprocess --input "$text" --input-format text \
  --documents-by-blank-line --output-prefix "$out/corpus" --tokenizer-type ByteLevel --append-eod >/dev/null
args=(train --data-path "$out/corpus_text_document" --tokenizer-type ByteLevel --split 100,0,0
  --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --swiglu
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 --moe-aux-loss-coeff 1e-2
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$iters" --lr 1e-3 --log-interval 10
  --generate-tokens 0)
OMP_NUM_THREADS=2 "$bin" "${args[@]}" --metrics-jsonl "$out/one_rank.jsonl" >"$out/one_rank.log"
OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np 2 "$bin" "${args[@]}" \
  --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall \
  --metrics-jsonl "$out/two_ranks.jsonl" >"$out/two_ranks.log"
/usr/bin/python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def rows(name):
    return [json.loads(l) for l in open(f"{out}/{name}.jsonl") if '"tokens_per_s"' in l][1:]
one, two = rows("one_rank"), rows("two_ranks")
t1 = sum(r["tokens_per_s"] for r in one) / len(one)
t2 = sum(r["tokens_per_s"] for r in two) / len(two)
share = [r["moe/dispatcher_comm_share"] for r in two]
print(f"ep_scaling: 1 rank x 2 threads {t1:.0f} tokens/s | 2 ranks x 1 thread (EP 2, alltoall) {t2:.0f} tokens/s"
      f" | ratio {t2 / t1:.3f} (target >= 0.85)")
print("ep_scaling: all-to-all share of step time per logged interval (rank 0): "
      + ", ".join(f"{100 * s:.1f}%" for s in share))
PY
