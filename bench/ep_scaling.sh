#!/usr/bin/env bash
# Expert-parallel scaling on one machine (issue: 2 ranks x 1 thread vs 1 rank x 2 threads). Trains the same
# MoE model on the same global batches twice -- one process with 2 OpenMP threads, then `mpirun -np 2` with
# one thread per rank and --expert-model-parallel-size 2 (alltoall dispatcher) -- and prints the tokens/s
# ratio (averaged over the log intervals after the first, which holds start-up; best of REPEATS alternating
# runs per layout, default 2) and the share of step time the EP run spent in the dispatcher's all-to-all. Needs an MPI build (MOECORE_MPI=ON) and mpirun.
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
rm -f "$out"/one_rank_*.jsonl "$out"/two_ranks_*.jsonl  # the metrics writer appends
args=(train --data-path "$out/corpus_text_document" --tokenizer-type ByteLevel --split 100,0,0
  --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --swiglu
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 --moe-aux-loss-coeff 1e-2
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$iters" --lr 1e-3 --log-interval 10
  --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --attention-dropout 0.0
  --hidden-dropout 0.0 --generate-tokens 0)
# The machine is noisy: the two layouts alternate, REPEATS times each, and each layout's best run counts.
for r in $(seq 1 "${REPEATS:-2}"); do
  OMP_NUM_THREADS=2 "$bin" "${args[@]}" --metrics-jsonl "$out/one_rank_$r.jsonl" >"$out/one_rank_$r.log"
  OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np 2 "$bin" "${args[@]}" \
    --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall \
    --metrics-jsonl "$out/two_ranks_$r.jsonl" >"$out/two_ranks_$r.log"
done
/usr/bin/python3 - "$out" <<'PY'
import glob, json, sys
out = sys.argv[1]
def runs(name):
    res = []
    for path in sorted(glob.glob(f"{out}/{name}_*.jsonl")):
        rows = [json.loads(l) for l in open(path) if '"tokens_per_s"' in l][1:]  # first interval: start-up
        res.append((sum(r["tokens_per_s"] for r in rows) / len(rows), rows))
    return res
one, two = runs("one_rank"), runs("two_ranks")
t1, t2 = max(t for t, _ in one), max(t for t, _ in two)
best_two = max(two, key=lambda x: x[0])[1]
print("ep_scaling: runs (tokens/s): 1x2 " + ", ".join(f"{t:.0f}" for t, _ in one) +
      " | 2x1 " + ", ".join(f"{t:.0f}" for t, _ in two))
print(f"ep_scaling: 1 rank x 2 threads {t1:.0f} tokens/s | 2 ranks x 1 thread (EP 2, alltoall) {t2:.0f} tokens/s"
      f" | ratio {t2 / t1:.3f} (target >= 0.85)")
print("ep_scaling: all-to-all share of step time per logged interval (rank 0, best 2x1 run): "
      + ", ".join(f"{100 * r['moe/dispatcher_comm_share']:.1f}%" for r in best_two))
PY
