#!/usr/bin/env bash
# A re-run of the categories of issue 27's outside probe against a built moecore: outputs onto special files and
# inputs, retention into another model's directory, resumes that drop parameters or change the math, exports after
# changed flags, memory limits, strict environment variables, non-finite models and the user inputs that used to end
# in internal checks. Each trial prints one line: its verdict and what it saw. The verdicts counted at the end are
# the issue's targets: silent data loss or overwrite, runs killed without a message, internal-check or raw-library
# messages for user input. Not part of the test suite (tests/apps/test_nothing_lost.cpp and test_memory_limits.cpp
# hold the regression tests); run it by hand, as root (it makes a device node and another user's file):
#   bash tools/probe_nothing_lost.sh [build/apps/moecore]
set -uo pipefail
M=$(realpath "${1:-build/apps/moecore}")
SRC=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d /tmp/moecore_probe.XXXXXX)
trap 'rm -rf "$W"' EXIT
cd "$W"
lost=0 killed=0 internal=0 ok=0 n=0
INTERNAL='internal error|check failed|std::bad_alloc|json.exception|tensor\.slice|terminate called|what\(\)'

# trial NAME EXPECT(fail|ok) SAFE_CHECK CMD...: runs CMD (2 min limit); SAFE_CHECK is a shell test that must hold after.
trial() {
  local name=$1 expect=$2 safe=$3
  shift 3
  n=$((n + 1))
  local out rc
  out=$(timeout 120 "$@" 2>&1)
  rc=$?
  local verdict=ok
  if [ $rc -ge 124 ]; then
    verdict="KILLED/HUNG (rc $rc)"
    killed=$((killed + 1))
  elif echo "$out" | grep -Eq "$INTERNAL"; then
    verdict="INTERNAL MESSAGE"
    internal=$((internal + 1))
  elif ! eval "$safe"; then
    verdict="DATA LOST"
    lost=$((lost + 1))
  elif [ "$expect" = fail ] && [ $rc -eq 0 ]; then
    verdict="ACCEPTED (expected a refusal)"
    lost=$((lost + 1))
  elif [ "$expect" = ok ] && [ $rc -ne 0 ]; then
    verdict="FAILED (expected to run)"
  else
    ok=$((ok + 1))
  fi
  printf '%-4s %-58s %s | %s\n' "$n" "$name" "$verdict" "$(echo "$out" | grep -E 'error|refus|note' | head -1 | cut -c1-150)"
}

python3 - <<'EOF'
import json
with open("c.jsonl", "w") as f:
    for i in range(300):
        f.write(json.dumps({"text": "the quick brown fox jumps over the lazy dog %d" % i}) + "\n")
EOF
"$M" preprocess --input c.jsonl --output-prefix c --tokenizer-type ByteLevel > /dev/null 2>&1
T="train --data-path c_text_document --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 --train-iters 2 --log-interval 1 --eval-iters 1 --generate-tokens 0"
cp -r "$SRC/tests/golden/hf_models/deepseek_v2lite" hf
MS="model-step --hf hf --tokens hf/tokens.safetensors"
sum() { sha256sum "$@" | awk '{print $1}' | tr -d '\n'; }
H0=$(sum hf/model.safetensors hf/tokens.safetensors)
mkfifo fifo
mknod null c 1 3 2> /dev/null || true
mkdir adir
echo theirs > theirs && chown 4242 theirs

echo "== 1. outputs"
trial "model-step --out its input weights" fail '[ "$(sum hf/model.safetensors hf/tokens.safetensors)" = "$H0" ]' "$M" $MS --out hf/model.safetensors
trial "model-step --out its input tokens" fail '[ "$(sum hf/model.safetensors hf/tokens.safetensors)" = "$H0" ]' "$M" $MS --out hf/tokens.safetensors
trial "model-step --out a FIFO nobody reads" fail '[ -p fifo ]' "$M" $MS --out fifo
trial "model-step --out a character device" ok '[ ! -e null ] || [ -c null ]' "$M" $MS --out null
trial "model-step --out a directory" fail '[ -d adir ]' "$M" $MS --out adir
trial "model-step --out another user's file" fail '[ "$(cat theirs)" = theirs ]' "$M" $MS --out theirs
trial "moe-layer --out its --inputs" fail '[ "$(sum hf/model.safetensors hf/tokens.safetensors)" = "$H0" ]' "$M" moe-layer --config hf/config.json --inputs hf/tokens.safetensors --out hf/tokens.safetensors
echo "some text" > p_text_document.bin
trial "preprocess over its own input" fail '[ "$(cat p_text_document.bin)" = "some text" ]' "$M" preprocess --input p_text_document.bin --input-format text --output-prefix p --tokenizer-type ByteLevel
cp c_text_document.idx idx.bak
trial "train --metrics-jsonl onto its dataset's .idx" fail 'cmp -s c_text_document.idx idx.bak' "$M" $T --metrics-jsonl c_text_document.idx
trial "train --metrics-jsonl onto a FIFO" fail '[ -p fifo ]' "$M" $T --metrics-jsonl fifo
trial "train --save onto a file" fail '[ "$(cat theirs)" = theirs ]' "$M" $T --save theirs
trial "convert --to-hf onto a link to an empty directory" fail '[ -L elink ]' sh -c "mkdir -p e && ln -sfn e elink && $M convert --from-hf hf --save hck > /dev/null && $M convert --load hck --to-hf elink"

echo "== 2. retention"
"$M" $T --save ck > /dev/null 2>&1
trial "another model into the directory, keep-last 1" fail '[ -f ck/iter_0000002/COMMIT ]' "$M" $T --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --train-iters 4 --save-interval 1 --save ck --keep-last-checkpoints 1

echo "== 3. resumes that drop parameters"
"$M" $T --position-embedding-type learned_absolute --save ck3 > /dev/null 2>&1
trial "resume with --disable-bias-linear" fail '[ ! -e ck3/iter_0000003 ]' "$M" $T --position-embedding-type learned_absolute --disable-bias-linear --load ck3 --save ck3 --train-iters 3 --override-opt_param-scheduler
trial "resume with rope (drops the position table)" fail '[ ! -e ck3/iter_0000003 ]' "$M" $T --position-embedding-type rope --load ck3 --save ck3 --train-iters 3 --override-opt_param-scheduler
trial "finetune with rope (drops the position table)" fail '[ ! -e ck3/iter_0000003 ]' "$M" $T --position-embedding-type rope --load ck3 --save ck3 --train-iters 3 --finetune

echo "== 5. flags that change the math"
"$M" $T --num-experts 4 --save ck5 > /dev/null 2>&1
trial "resume with another top-k" fail 'true' "$M" $T --num-experts 4 --moe-router-topk 3 --load ck5 --train-iters 3 --override-opt_param-scheduler
trial "generate with another top-k" fail 'true' "$M" generate --load ck5 --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --num-experts 4 --moe-router-topk 3 --max-new-tokens 3

echo "== 6. memory"
trial "--micro-batch-size 100000" fail 'true' "$M" train --data-path c_text_document --tokenizer-type ByteLevel --micro-batch-size 100000 --train-iters 1 --eval-iters 1 --generate-tokens 0
trial "a model larger than the machine" fail 'true' "$M" $T --num-layers 2000 --hidden-size 8192 --num-attention-heads 64

echo "== 7. environment variables"
trial "MOECORE_COMM_TIMEOUT_S=-5" fail 'true' env MOECORE_COMM_TIMEOUT_S=-5 "$M" $T
trial "MOECORE_COMM_TIMEOUT_S=abc" fail 'true' env MOECORE_COMM_TIMEOUT_S=abc "$M" $T

echo "== 8. non-finite models"
trial "--nan-action skip on a diverging run" fail 'true' "$M" $T --train-iters 40 --lr 1e38 --clip-grad 0 --nan-action skip
"$M" $T --train-iters 3 --lr 1e38 --clip-grad 0 --no-check-for-nan-in-loss-and-grad --save nan > /dev/null 2>&1
trial "generate from a NaN checkpoint" fail 'true' "$M" generate --load nan --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-new-tokens 3

echo "== 9. user input that used to reach internal checks"
trial "generate --prompt ''" ok 'true' "$M" generate --load ck --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-new-tokens 3 --prompt ''
trial "convert --max-shard-size 0.5B" fail 'true' "$M" convert --load hck --to-hf o1 --max-shard-size 0.5B
trial "convert --max-shard-size 1e30GB" fail 'true' "$M" convert --load hck --to-hf o2 --max-shard-size 1e30GB
trial "convert --max-shard-size 1.2.3MB" fail 'true' "$M" convert --load hck --to-hf o3 --max-shard-size 1.2.3MB
trial "train --global-batch-size 1000000000" fail 'true' "$M" $T --global-batch-size 1000000000
trial "train --eval-iters 1000000000" fail 'true' "$M" $T --eval-iters 1000000000
trial "train --train-iters 1e12" fail 'true' "$M" $T --train-iters 1000000000000
trial "preprocess --json-keys text text" fail '[ ! -e d_text_document.bin ] || [ -e d_text_document.idx ]' "$M" preprocess --input c.jsonl --output-prefix d --tokenizer-type ByteLevel --json-keys text text
mkfifo idxfifo.idx
cp c_text_document.bin idxfifo.bin
trial "a FIFO as a dataset's .idx" fail 'true' "$M" $T --data-path idxfifo
python3 -c "import json; c=json.load(open('hf/config.json')); c['dtype']=None; c.pop('torch_dtype', None); json.dump(c, open('cfg_null.json','w'))"
mkdir -p hfnull && cp hf/model.safetensors hfnull/ && cp cfg_null.json hfnull/config.json
trial '"dtype": null imported, then exported' ok '[ -f hfnull_out/config.json ]' sh -c "$M convert --from-hf hfnull --save cknull && $M convert --load cknull --to-hf hfnull_out"

echo "== $n trials: $ok as expected; data lost or overwritten: $lost; killed or hung without a message: $killed; internal or raw-library messages: $internal"
