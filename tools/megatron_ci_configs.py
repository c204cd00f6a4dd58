#!/usr/bin/env python3
"""Runs Megatron-LM's own MoE CI training configurations against `moecore train` and reports which run.

Reads tests/functional_tests/test_cases/moe/*/model_config.yaml from a Megatron-LM checkout, builds each
command line the way Megatron's runner does (shell_test_utils/run_ci_test.sh + _run_training.sh), and launches
it with mpirun on the world size Megatron's CI recipes give the test (tests/test_utils/recipes/*/moe*.yaml).
It replaces only model sizes (shrunk so that 8 ranks train in seconds on a CPU) and data paths; every other
flag is Megatron's. It does not check losses against Megatron's golden values (other sizes, other data).
See docs/megatron-ci.md.

Usage: tools/megatron_ci_configs.py --megatron /path/to/Megatron-LM [--moecore build/apps/moecore]
                                    [--only REGEX] [--jobs 1] [--timeout 900] [--keep] [--dry-run]
"""
import argparse
import collections
import concurrent.futures
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import yaml

CASES_DIR = "tests/functional_tests/test_cases/moe"
RECIPES_GLOB = "tests/test_utils/recipes/*/*.yaml"
RUNNER_GPUS_PER_NODE = 8  # _run_training.sh: GPUS_PER_NODE=${GPUS_PER_NODE:-8}, NUM_NODES=1

# ---------------------------------------------------------------------------------------------------
# Replacements (a): model sizes. Every other flag is kept as Megatron wrote it.

TRAIN_ITERS = 4  # even, so the ckpt-resume run saves at TRAIN_ITERS/2 and resumes from there
# --fp16 configs: Megatron's dynamic loss scaler starts at 2^32 and skips the steps whose gradients overflow while it
# halves the scale (about 15 on these models), so they run long enough to train after that.
TRAIN_ITERS_FP16 = 40
HEAD_DIM = 16  # hidden = heads x HEAD_DIM
MIN_HEADS = 4
SEQ_LENGTH = 64
MICRO_BATCH_MAX = 2
MICROBATCHES_MAX = 4  # gradient-accumulation steps per iteration (kept when Megatron's is smaller)
EVAL_ITERS_MAX = 2
NULL_TOKENIZER_VOCAB = 512


def _int(args, key, default):
    v = args.get(key)
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


def shrink_sizes(args, world):
    """New text for the size flags present in `args` ({flag: scalar text}). Keeps the divisibility that
    Megatron's layouts need: heads by TP, hidden by heads, seq by 2*CP*TP, global batch by micro x DP."""
    tp = _int(args, "--tensor-model-parallel-size", 1)
    pp = _int(args, "--pipeline-model-parallel-size", 1)
    cp = _int(args, "--context-parallel-size", 1)
    new = {}
    heads = max(MIN_HEADS, tp)
    heads = math.ceil(heads / tp) * tp
    hidden = heads * HEAD_DIM
    sizes = {
        "--num-attention-heads": heads,
        "--hidden-size": hidden,
        "--kv-channels": HEAD_DIM,
        "--ffn-hidden-size": 2 * hidden,
        "--moe-ffn-hidden-size": hidden,
        "--moe-shared-expert-intermediate-size": hidden,
        "--q-lora-rank": 2 * HEAD_DIM,
        "--kv-lora-rank": 2 * HEAD_DIM,
        "--qk-head-dim": HEAD_DIM,
        "--qk-pos-emb-head-dim": HEAD_DIM // 2,
        "--v-head-dim": HEAD_DIM,
    }
    for k, v in sizes.items():
        if k in args:
            new[k] = v
    if "--num-query-groups" in args:
        old_heads = _int(args, "--num-attention-heads", heads)
        groups = max(tp, _int(args, "--num-query-groups", 1) * heads // max(old_heads, 1))
        new["--num-query-groups"] = groups if heads % groups == 0 else heads
    old_seq = _int(args, "--seq-length", SEQ_LENGTH)
    step = 2 * cp * tp
    seq = math.ceil(SEQ_LENGTH / step) * step
    for k in ("--seq-length", "--encoder-seq-length", "--decoder-seq-length"):
        if k in args:
            new[k] = seq
    if "--max-position-embeddings" in args:
        ratio = _int(args, "--max-position-embeddings", old_seq) / max(old_seq, 1)
        new["--max-position-embeddings"] = max(seq, int(seq * ratio))
    dp = max(1, world // (tp * pp * cp))
    old_mbs = _int(args, "--micro-batch-size", 1)
    mbs = min(old_mbs, MICRO_BATCH_MAX)
    if "--micro-batch-size" in args:
        new["--micro-batch-size"] = mbs
    if "--global-batch-size" in args:
        old_nmb = max(1, _int(args, "--global-batch-size", old_mbs * dp) // (old_mbs * dp))
        nmb = min(old_nmb, max(MICROBATCHES_MAX, pp))
        if old_nmb % pp == 0:
            nmb = max(pp, nmb // pp * pp)
        new["--global-batch-size"] = mbs * dp * nmb
    iters = TRAIN_ITERS_FP16 if str(args.get("--fp16", "")).lower() in ("true", "1") else TRAIN_ITERS
    old_iters = _int(args, "--train-iters", iters)
    if "--train-iters" in args:
        new["--train-iters"] = iters
    for k in ("--save-interval", "--persistent-save-interval", "--eval-interval"):
        v = _int(args, k, None)
        if v is not None and v < old_iters:  # an interval past the end stays past the end
            new[k] = max(1, round(v * iters / old_iters))
    if "--eval-iters" in args:
        new["--eval-iters"] = min(_int(args, "--eval-iters", EVAL_ITERS_MAX), EVAL_ITERS_MAX)
    if args.get("--tokenizer-type") == "NullTokenizer" and "--vocab-size" in args:
        new["--vocab-size"] = NULL_TOKENIZER_VOCAB
    return {k: str(v) for k, v in new.items()}


# ---------------------------------------------------------------------------------------------------
# What Megatron's runner does with a model_config.yaml


def envsubst(text, env):
    """GNU envsubst with SHELL-FORMAT = every exported name: $VAR and ${VAR} of set variables only."""
    def sub(m):
        name = m.group(1) or m.group(2)
        return env[name] if name in env else m.group(0)
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", sub, text)


MERGE_TAG = "tag:yaml.org,2002:merge"
BOOL_TRUE_12 = ("true", "True", "TRUE")  # yq follows YAML 1.2: yes/on are strings there


def explode(node):
    """yq's explode(.): aliases become copies (PyYAML's composer already shares the node) and `<<` merge
    keys are flattened, explicit keys winning."""
    if isinstance(node, yaml.MappingNode):
        merged, own = [], []
        for k, v in node.value:
            if k.tag == MERGE_TAG:
                for src in (v.value if isinstance(v, yaml.SequenceNode) else [v]):
                    merged.extend(explode(src).value)
            else:
                own.append((k, explode(v)))
        keys = {k.value for k, _ in own}
        out, seen = [], set()
        for k, v in merged:
            if k.value not in keys and k.value not in seen:
                seen.add(k.value)
                out.append((k, v))
        return yaml.MappingNode(node.tag, out + own)
    if isinstance(node, yaml.SequenceNode):
        return yaml.SequenceNode(node.tag, [explode(v) for v in node.value], flow_style=node.flow_style)
    return node


def yq_value_text(node):
    """`with(select(.value == true); .value = "true") | select(.value != "") | .value | tostring`:
    the scalar's own text (`.01` stays `.01`), None where the entry is dropped."""
    if isinstance(node, yaml.ScalarNode):
        if node.tag.endswith(":bool") and node.style is None and node.value in BOOL_TRUE_12:
            return "true"
        if node.tag.endswith(":str") and node.value == "":
            return None
        return node.value
    if isinstance(node, yaml.SequenceNode):
        return "[" + ", ".join(yq_value_text(v) or "" for v in node.value) + "]"
    raise ValueError("a mapping as a MODEL_ARGS value is not something Megatron's runner can pass")


def runner_words(key, text):
    """One `key: value` line of _run_training.sh turned into argv words (after `xargs` trim and `eval`)."""
    try:
        value = " ".join(shlex.split(text))  # echo "$value" | xargs
    except ValueError:
        value = ""
    if value == "true":
        return [key]
    if re.fullmatch(r"\([^)]+\)", value):
        return [key, value]
    if re.fullmatch(r"\[[^]]+\]", value):
        return [key] + shlex.split(value[1:-1])  # nargs lists: the words, unquoted
    if any(c in value for c in " |()"):
        return [key, value]
    return [key] + shlex.split(value)


@dataclasses.dataclass
class Case:
    name: str
    path: str
    test_type: str
    mode: str
    world: int
    world_note: str
    env_vars: dict
    has_args2: bool


def recipe_worlds(megatron):
    """{test_case: [(nodes*gpus, recipe)]} from the moe recipes (a product may override nodes/gpus)."""
    worlds = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(megatron, RECIPES_GLOB))):
        try:
            recipe = yaml.safe_load(open(path))
        except yaml.YAMLError:
            continue
        spec = (recipe or {}).get("spec") or {}
        if spec.get("model") != "moe":
            continue
        rel = os.path.relpath(path, os.path.join(megatron, "tests/test_utils/recipes"))
        spec_world = int(spec.get("nodes", 1)) * int(spec.get("gpus", RUNNER_GPUS_PER_NODE))
        for line in open(path):  # a test commented out of the schedule still says where it ran
            m = re.match(r"\s*#\s*-\s*test_case:\s*\[([^]]+)\]", line)
            if m:
                for tc in m.group(1).split(","):
                    worlds[tc.strip()].append((spec_world, rel + " (commented out)"))
        for product in recipe.get("products") or []:
            nodes = product.get("nodes", spec.get("nodes", 1))
            gpus = product.get("gpus", spec.get("gpus", RUNNER_GPUS_PER_NODE))
            nodes = nodes[0] if isinstance(nodes, list) else nodes
            gpus = gpus[0] if isinstance(gpus, list) else gpus
            for tc in product.get("test_case") or []:
                worlds[tc].append((int(nodes) * int(gpus), rel))
    return worlds


def load_cases(megatron):
    worlds = recipe_worlds(megatron)
    cases = []
    for path in sorted(glob.glob(os.path.join(megatron, CASES_DIR, "*", "model_config.yaml"))):
        name = os.path.basename(os.path.dirname(path))
        cfg = yaml.safe_load(open(path)) or {}
        found = worlds.get(name, [])
        active = [f for f in found if not f[1].endswith("(commented out)")]
        found = active or found
        sizes = collections.Counter(w for w, _ in found)
        if sizes:
            world = max(sizes, key=lambda w: (sizes[w], w))
            note = ", ".join(sorted({f"{r} {w}" for w, r in found}))
        else:
            world, note = RUNNER_GPUS_PER_NODE, "in no recipe: runner default 1x8"
        cases.append(Case(name, path, str(cfg.get("TEST_TYPE", "regular")), str(cfg.get("MODE", "pretraining")),
                          world, note, {str(k): str(v) for k, v in (cfg.get("ENV_VARS") or {}).items()},
                          "MODEL_ARGS_2" in cfg))
    return cases


# ---------------------------------------------------------------------------------------------------
# Command lines


@dataclasses.dataclass
class Site:
    moecore: str
    data_prefix: str
    vocab_file: str
    merge_file: str
    byte_prefix: str
    add_tokenizer_type: bool


def model_args(case, env, run_number, site):
    """argv of `pretrain_gpt.py` for one run, and the shrunk MODEL_ARGS as YAML text (for the record)."""
    text = envsubst(open(case.path).read(), env)
    root = explode(yaml.compose(text, Loader=yaml.SafeLoader))
    top = {k.value: v for k, v in root.value}
    key = f"MODEL_ARGS_{run_number}" if run_number > 1 and f"MODEL_ARGS_{run_number}" in top else "MODEL_ARGS"
    node = top[key]
    entries = [[k.value, v] for k, v in (node.value if isinstance(node, yaml.MappingNode) else [])]
    texts = {k: yq_value_text(v) for k, v in entries}

    def scalar(text):
        return yaml.ScalarNode("tag:yaml.org,2002:str", text, style=None)

    # (a) sizes, (b) data; the same for both runs of a resume test
    replaced = shrink_sizes(texts, case.world)
    tokenizer = texts.get("--tokenizer-type")
    prefix = site.byte_prefix if tokenizer == "NullTokenizer" else site.data_prefix
    if "--data-path" in texts and texts["--data-path"] is not None:
        words = texts["--data-path"].split()
        replaced["--data-path"] = " ".join(w if re.fullmatch(r"[0-9.eE+-]+", w) else prefix for w in words)
    if "--vocab-file" in texts:
        replaced["--vocab-file"] = site.vocab_file
    if "--merge-file" in texts:
        replaced["--merge-file"] = site.merge_file
    for e in entries:
        if e[0] in replaced:
            e[1] = scalar(replaced[e[0]])
    if site.add_tokenizer_type and tokenizer is None and "--merge-file" in texts:
        # The MoE configs give GPT-2 BPE files but no --tokenizer-type, whose default is None in Megatron
        # d98e8a64 (build_tokenizer raises for None there too); name the type the files are.
        at = [k for k, _ in entries].index("--merge-file") + 1
        entries.insert(at, ["--tokenizer-type", scalar("GPT2BPETokenizer")])
    # run_ci_test.sh: yq -i '.MODEL_ARGS."--exit-interval" = .MODEL_ARGS."--train-iters"'
    train_iters = next((v for k, v in entries if k == "--train-iters"), None)
    exit_node = train_iters if train_iters is not None else yaml.ScalarNode("tag:yaml.org,2002:null", "")
    for e in entries:
        if e[0] == "--exit-interval":
            e[1] = exit_node
            break
    else:
        entries.append(["--exit-interval", exit_node])
    argv = []
    for k, v in entries:
        t = yq_value_text(v)
        if t is not None:
            argv += runner_words(k, t)
    shrunk = yaml.serialize(yaml.MappingNode("tag:yaml.org,2002:map", [(scalar(k), v) for k, v in entries]))
    return argv, shrunk, (train_iters.value if train_iters is not None else None)


def runner_env(tmp, tb_run=None, load=None):
    """The variables run_ci_test.sh exports before _run_training.sh's envsubst."""
    tb = os.path.join(tmp, "tensorboard", "1", "tensorboard")  # $DIR/$REPEAT/$FILE
    if tb_run:
        tb = os.path.join(tb, f"run_{tb_run}")
    env = dict(os.environ)
    env.update({
        "DATA_PATH": os.path.join(tmp, "artifacts"),
        "DATA_CACHE_PATH": os.path.join(tmp, "data-cache"),
        "OUTPUT_PATH": os.path.join(tmp, "output"),
        "TENSORBOARD_PATH": tb,
        "CHECKPOINT_SAVE_PATH": os.path.join(tmp, "checkpoints"),
        "CHECKPOINT_LOAD_PATH": load or os.path.join(tmp, "empty-load"),  # /tmp/checkpoints/ in CI
    })
    return env


def launch_words(case, site, argv, jsonl):
    return (["nice", "-n", "10", "mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(case.world),
             site.moecore, "train"] + argv + ["--metrics-jsonl", jsonl])


def plan_runs(case, site, tmp):
    """[(argv for mpirun, env, jsonl, tb dir, shrunk yaml)] for run 1 and, for ckpt-resume, run 2."""
    resume = case.test_type == "ckpt-resume"
    runs = []
    for n in ((1, 2) if resume else (1,)):
        env = runner_env(tmp, tb_run=n if case.test_type in ("ckpt-resume", "frozen-resume") else None,
                         load=os.path.join(tmp, "checkpoints") if n == 2 else None)
        argv, shrunk, iters = model_args(case, env, n, site)
        jsonl = os.path.join(tmp, f"metrics_run{n}.jsonl")
        run_env = {**env, **case.env_vars, "OMP_NUM_THREADS": "1"}
        runs.append((launch_words(case, site, argv, jsonl), run_env, jsonl, env["TENSORBOARD_PATH"], shrunk, iters))
    return runs


# ---------------------------------------------------------------------------------------------------
# Running and judging

ERROR_RE = re.compile(r"(moecore(?: \w+)?: error)(?: \(rank \d+ of \d+\))?(: .*)")  # rank dropped: one line for all
FSDP_RE = re.compile(r"fsdp", re.I)


@dataclasses.dataclass
class Result:
    case: Case
    status: str = "failed"  # runs | refused | failed | skipped
    category: str = ""  # for refused: unknown flag | Muon | FP8 | Megatron-FSDP | other
    detail: str = ""
    error: str = ""
    tail: list = dataclasses.field(default_factory=list)
    by_name: list = dataclasses.field(default_factory=list)  # its flags --list-flags refuses or lacks
    tb: str = "-"
    jsonl: str = "-"
    seconds: float = 0.0


def refusal_category(line):
    low = line.lower()
    if "unknown flag" in low:
        return "unknown flag"
    if "muon" in low:
        return "Muon"
    if "fp8" in low or "fp4" in low:
        return "FP8"
    if FSDP_RE.search(low):
        return "Megatron-FSDP"
    return "other"


def read_metrics(path):
    rows = {}
    if not os.path.exists(path):
        return rows
    for line in open(path, errors="replace"):
        try:
            obj = json.loads(line, parse_float=lambda s: (float(s), s))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "iteration" in obj:  # train and validation rows share an iteration
            rows.setdefault(obj["iteration"], {}).update(obj)
    return rows


def has_events(path):
    return any(f.startswith("events.out.tfevents") for _, _, fs in os.walk(path) for f in fs)


def run_one(words, env, log_path, timeout):
    start = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(words, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=os.path.dirname(log_path), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the session mpirun leads: it and its ranks
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    lines = open(log_path, errors="replace").read().splitlines()
    return rc, lines, time.time() - start


NOISE_RE = re.compile(r"^-+$|SIGTERM before any collective|^Primary job|^a non-zero exit code|^mpirun detected|"
                      r"^the job to be terminated|^The first process|^\s*Process name:|^\s*Exit code:")


def last_lines(lines, n=6):
    """The last lines that say something: without mpirun's boilerplate and without repeats from every rank."""
    keep, seen = [], set()
    for line in lines:
        text = re.sub(r" \(rank \d+ of \d+\)|rank \d+ of \d+", "rank N", line.rstrip())
        if text.strip() and not NOISE_RE.search(text.strip()) and text not in seen:
            seen.add(text)
            keep.append(text)
    return keep[-n:]


def judge(case, site, tmp, timeout):
    res = Result(case)
    runs = plan_runs(case, site, tmp)
    for n, (words, env, _, tb, shrunk, _) in enumerate(runs, 1):
        with open(os.path.join(tmp, f"model_config.run{n}.yaml"), "w") as f:
            f.write(shrunk)
    iters = int(runs[0][5]) if runs[0][5] and runs[0][5].isdigit() else None
    metrics = []
    for n, (words, env, jsonl, tb, _, _) in enumerate(runs, 1):
        for d in (env["CHECKPOINT_SAVE_PATH"], env["CHECKPOINT_LOAD_PATH"], env["DATA_CACHE_PATH"], tb):
            os.makedirs(d, exist_ok=True)  # run_ci_test.sh: mkdir -p the save, load and TB dirs
        if n == 2:  # run_ci_test.sh between the two runs of ckpt-resume
            save = env["CHECKPOINT_SAVE_PATH"]
            shutil.rmtree(os.path.join(save, "iter_%07d" % iters), ignore_errors=True)
            with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(f"{iters // 2}\n")
        rc, lines, secs = run_one(words, env, os.path.join(tmp, f"run{n}.log"), timeout)
        res.seconds += secs
        errors = [(m.group(1) + m.group(2)).strip() for l in lines for m in [ERROR_RE.search(l)] if m]
        rows = read_metrics(jsonl)
        metrics.append(rows)
        res.jsonl = "yes" if os.path.exists(jsonl) else "no"
        if "--tensorboard-dir" in words:
            res.tb = "yes" if has_events(tb) else "no"
        tag = f"run {n}: " if len(runs) > 1 else ""
        if rc is None:
            res.status, res.detail, res.tail = "failed", f"{tag}timeout after {timeout}s", last_lines(lines)
            return res
        if rc != 0:
            res.error = errors[0] if errors else ""
            if errors and n == 1 and not rows:
                res.status, res.category, res.detail = "refused", refusal_category(errors[0]), errors[0]
                # moecore names every refused flag of a command line, one per line: a config that also needs Muon,
                # FP8 or Megatron-FSDP counts as refused by that.
                for l in lines:
                    if res.category == "other" and "is not supported" in l and refusal_category(l) != "other":
                        res.category = refusal_category(l)
                        res.detail += " (and: " + l.strip() + ")"
            else:
                res.status = "failed"
                res.detail = f"{tag}exit {rc}" + (f": {errors[0]}" if errors else "")
                res.tail = last_lines(lines)
            return res
        log_interval = 1
        if "--log-interval" in words:
            log_interval = int(words[words.index("--log-interval") + 1])
        first = iters // 2 + 1 if n == 2 else 1
        want = [i for i in range(first, (iters or 0) + 1) if i % log_interval == 0]
        missing = [i for i in want if "lm_loss" not in rows.get(i, {})]
        if not iters or missing:
            res.status = "failed"
            res.detail = f"{tag}exit 0 but no lm_loss for iterations {missing or '?'} in --metrics-jsonl"
            res.tail = last_lines(lines)
            return res
        extra = sorted(i for i in rows if i < first)
        if extra:
            res.status, res.detail = "failed", f"{tag}did not resume: logged iterations {extra} again"
            res.tail = last_lines(lines)
            return res
    # (a step skipped by the fp16 loss scaler logs lm_loss null, as Megatron logs no loss for it)
    losses = [metrics[0][i]["lm_loss"] for i in sorted(metrics[0]) if metrics[0][i].get("lm_loss") is not None]
    skipped = sum(1 for i in metrics[0] if "lm_loss" in metrics[0][i] and metrics[0][i]["lm_loss"] is None)
    res.status = "runs"
    res.detail = (f"{iters} iters, lm_loss {losses[0][0]:.4f} -> {losses[-1][0]:.4f}" if losses
                  else f"{iters} iters, every one skipped")
    scales = [metrics[0][i]["loss-scale"] for i in sorted(metrics[0]) if "loss-scale" in metrics[0][i]]
    if skipped:
        res.detail += (f" ({skipped} skipped for fp16 loss-scale overflow; loss scale {scales[0][1]} -> {scales[-1][1]})"
                       if scales else f" ({skipped} skipped)")
    if case.test_type == "frozen-resume":  # run_ci_test.sh skips run 2 when no frozen checkpoint is stored
        res.detail += "; run 2 skipped (no frozen Megatron checkpoint)"
    if len(runs) == 2:
        def loss_bits(row):
            v = row.get("lm_loss")
            return None if v is None else v[1]
        diff = [(i, loss_bits(metrics[0][i]), loss_bits(metrics[1][i])) for i in sorted(metrics[1])
                if i in metrics[0] and "lm_loss" in metrics[1][i]
                and loss_bits(metrics[0][i]) != loss_bits(metrics[1][i])]
        if diff:
            i, a, b = diff[0]
            res.status = "failed"
            res.detail = f"resumed losses differ: iteration {i}: run 1 {a}, run 2 {b}"
        else:
            res.detail += f"; resume {iters // 2 + 1}-{iters} bitwise equal"
    return res


# ---------------------------------------------------------------------------------------------------
# Data, binary, report


def file_sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare_site(opts, dry):
    work = opts.workdir
    os.makedirs(work, exist_ok=True)
    binary = opts.moecore
    if not dry:  # others rebuild the binary while a run goes on: use one copy throughout
        sha = file_sha(opts.moecore)[:12]
        binary = os.path.join(work, f"moecore-{sha}")
        if not os.path.exists(binary):
            shutil.copy2(opts.moecore, binary + ".tmp")
            os.replace(binary + ".tmp", binary)
    data = os.path.join(work, "data")
    vocab = os.path.join(opts.gpt2_dir, "gpt2-vocab.json")
    merges = os.path.join(opts.gpt2_dir, "gpt2-merges.txt")
    site = Site(binary, os.path.join(data, "shakespeare_text_document"), vocab, merges,
                os.path.join(data, "shakespeare-bytes_text_document"), not opts.no_tokenizer_type)
    if dry:
        return site
    os.makedirs(data, exist_ok=True)
    jsonl = os.path.join(data, "shakespeare.jsonl")
    if not os.path.exists(jsonl):  # one JSON document per blank-line-separated paragraph
        text = open(opts.corpus, encoding="utf-8").read()
        with open(jsonl + ".tmp", "w") as f:
            for doc in (d.strip() for d in text.split("\n\n")):
                if doc:
                    f.write(json.dumps({"text": doc}) + "\n")
        os.replace(jsonl + ".tmp", jsonl)
    for prefix, tok in ((site.data_prefix, ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                            "--merge-file", merges]),
                        (site.byte_prefix, ["--tokenizer-type", "ByteLevel"])):
        if os.path.exists(prefix + ".idx"):
            continue
        out = prefix[: -len("_text_document")]
        subprocess.run(["nice", binary, "preprocess", "--input", jsonl, "--output-prefix", out,
                        "--append-eod"] + tok, check=True, stdout=subprocess.DEVNULL)
    return site


def moecore_flag_table(binary):
    """{flag: (kind, help)} from `moecore train --list-flags` (kind: value, switch, accepted-*, refused-*)."""
    try:
        out = subprocess.run([binary, "train", "--list-flags"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = (line.split("\t") for line in out.splitlines())
    return {r[0]: (r[1], r[3] if len(r) > 3 else "") for r in rows if len(r) > 1 and r[0].startswith("--")}


def audit_by_name(case, site, flags):
    """The config's flags that moecore refuses by name or does not know: every blocker a run would hit
    one at a time (refusals of a value, such as --optimizer muon, show only in the run)."""
    if not flags:
        return []
    words = plan_runs(case, site, os.path.join(tempfile.gettempdir(), "audit"))[0][0]
    names = [w for w in words[words.index("train") + 1:] if w.startswith("--")]
    return [n for n in dict.fromkeys(names) if n not in flags or flags[n][0].startswith("refused")]


def table(results):
    rows = ["| config | world | test type | result | detail | refused by name | TB | JSONL | s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.case
        result = r.status + (f" ({r.category})" if r.category else "")
        detail = r.detail.replace("|", "\\|")
        rows.append(f"| {c.name} | {c.world} | {c.test_type} | {result} | {detail} | {len(r.by_name)} | {r.tb} "
                    f"| {r.jsonl} | {r.seconds:.0f} |")
    return rows


def report(results, skipped, header, flags):
    out = list(header) + [""] + table(results) + [""]
    n = collections.Counter(r.status for r in results)
    mff = sum(1 for r in results if r.status == "refused" and r.category in ("Muon", "FP8", "Megatron-FSDP"))
    other = len(results) - n["runs"] - mff
    out.append(f"**{len(results)} training configs: {n['runs']} run, {mff} refused by Muon/FP8/FSDP, "
               f"{other} other** ({n['refused'] - mff} refused for another reason, {n['failed']} failed). "
               f"Skipped (not MODE training): {len(skipped)}.")
    cats = collections.Counter(r.category for r in results if r.status == "refused")
    if cats:
        out.append("Refusals by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(cats.items())) + ".")
    errs = collections.defaultdict(list)
    for r in results:
        if r.error:
            errs[r.error].append(r.case.name)
    out += ["", f"Distinct error lines ({len(errs)}):", ""]
    for line, names in sorted(errs.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        out.append(f"* `{line}` ({len(names)}: {', '.join(names)})")
    names = collections.defaultdict(list)
    for r in results:
        for n in r.by_name:
            names[n].append(r.case.name)
    if flags:
        out += ["", f"Flags refused by name or unknown, from `moecore train --list-flags` ({len(names)}; a run stops "
                "at the first, this lists them all):", ""]
        for n, cs in sorted(names.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            kind, why = flags.get(n, ("unknown flag", ""))
            out.append(f"* `{n}` ({kind}, {len(cs)} configs){': ' + why if why else ''}")
    failed = [r for r in results if r.status == "failed"]
    if failed:
        out += ["", "Last lines of failed runs:", ""]
        for r in failed:
            out.append(f"* {r.case.name}: {r.detail}")
            out += [f"  > {l}" for l in r.tail]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="Megatron-LM checkout (reads tests/ only)")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--moecore", default=os.path.join(here, "build/apps/moecore"), help="moecore binary (copied first)")
    shared = os.path.join(os.path.dirname(here), "shared/data")
    ap.add_argument("--gpt2-dir", default=os.path.join(shared, "gpt2"), help="gpt2-vocab.json + gpt2-merges.txt")
    ap.add_argument("--corpus", default=os.path.join(shared, "tinyshakespeare/input.txt"), help="training text")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "moecore-megatron-ci"),
                    help="binary copy, preprocessed corpus and one temp dir per config")
    ap.add_argument("--only", help="run configs whose name matches this regex (re.search)")
    ap.add_argument("--jobs", type=int, default=1, help="configs run at once (default 1)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mpirun (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep each config's temp dir (logs, checkpoints, TB)")
    ap.add_argument("--dry-run", action="store_true", help="print each command line, run nothing")
    ap.add_argument("--no-tokenizer-type", action="store_true",
                    help="do not add --tokenizer-type GPT2BPETokenizer where a config gives BPE files but no type")
    ap.add_argument("--report", help="also write the report (markdown) to this file")
    opts = ap.parse_args()

    cases = [c for c in load_cases(opts.megatron) if not opts.only or re.search(opts.only, c.name)]
    training = [c for c in cases if c.mode == "pretraining"]
    skipped = [c for c in cases if c.mode != "pretraining"]
    site = prepare_site(opts, opts.dry_run)
    if opts.dry_run:
        tmp = os.path.join(opts.workdir, "runs", "<config>")
        for c in training:
            print(f"# {c.name}  [{c.test_type}; world {c.world}: {c.world_note}]")
            for n, (words, env, *_rest) in enumerate(plan_runs(c, site, tmp.replace("<config>", c.name)), 1):
                envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**c.env_vars, "OMP_NUM_THREADS": "1"}.items())
                print(f"run {n}: {envs} {shlex.join(words)}")
        for c in skipped:
            print(f"# {c.name}: skipped (MODE {c.mode})")
        return 0
    runs_root = os.path.join(opts.workdir, "runs")
    os.makedirs(runs_root, exist_ok=True)
    lock = threading.Lock()
    done = [0]

    def one(c):
        tmp = tempfile.mkdtemp(prefix=c.name[:60] + ".", dir=runs_root)
        try:
            r = judge(c, site, tmp, opts.timeout)
        except Exception as e:  # a broken config must not stop the others
            r = Result(c, "failed", detail=f"tool error: {type(e).__name__}: {e}")
        finally:
            if not opts.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        r.by_name = audit_by_name(c, site, flags)
        with lock:
            done[0] += 1
            print(f"[{done[0]}/{len(training)}] {c.name}: {r.status} {r.category} {r.seconds:.0f}s"
                  + (f" ({tmp})" if opts.keep else ""), file=sys.stderr, flush=True)
        return r

    flags = moecore_flag_table(site.moecore)
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        results = list(pool.map(one, training))
    head = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(opts.moecore)), "log", "-1", "--format=%h"],
                          capture_output=True, text=True).stdout.strip() or "?"
    mlm = subprocess.run(["git", "-C", opts.megatron, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "?"
    header = [f"moecore: {opts.moecore} (sha256 {file_sha(site.moecore)[:12]}; its checkout's HEAD {head}), "
              f"Megatron-LM: {opts.megatron} ({mlm}), {len(training)} training configs in {time.time() - t0:.0f}s, "
              f"--jobs {opts.jobs}"]
    lines = report(results, skipped, header, flags)
    print("\n".join(lines))
    if opts.report:
        with open(opts.report, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
