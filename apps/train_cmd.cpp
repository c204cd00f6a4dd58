// `moecore train`: Megatron-style training of a GPT (dense or MoE) on .bin/.idx data made by
// `moecore preprocess` or Megatron's own tools, with checkpoints, metrics and a generated sample at the end.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/data_flags.h"
#include "apps/device_flag.h"
#include "apps/hf_config.h"
#include "apps/megatron_flags.h"
#include "apps/model_flags.h"
#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"
#include "moecore/core/memory.h"
#include "moecore/core/memory_limit.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/kernels/attention_scratch.h"
#include "moecore/model/hf_weights.h"
#include "moecore/model/param_specs.h"
#include "moecore/model/upcycling.h"
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/train/async_save.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/gemm_peak.h"
#include "moecore/train/schedule.h"
#include "moecore/train/trainer.h"

namespace moecore::apps {
namespace {

// ---- Training flags as one typed table -------------------------------------------------------------------------
// Each row declares a flag once: its kind, Megatron's default, help, domain and the rule that reads it into the
// TrainConfig (run after the flags of add_training_flags below are read, so a rule may use them). The flags declared in
// add_training_flags move here with the typed-table redesign of the training front end.
enum class TrainFlagKind : uint8_t { value, flag };
struct TrainFlag {
  const char* name;
  TrainFlagKind kind;
  const char* def;  // Megatron's default ("" = Megatron's None)
  const char* help;
  std::optional<FlagDomain> domain;
  void (*apply)(const Args& a, const char* flag, train::TrainConfig& t);
};

// Megatron's rule (training.py get_optimizer_param_scheduler): warm-up = fraction x the decay's length (samples there,
// iterations here, fractional too), and it excludes --lr-warmup-iters.
void lr_warmup_fraction(const Args& a, const char* f, train::TrainConfig& t) {
  if (!a.given(f)) return;
  if (a.i64("--lr-warmup-iters") != 0)
    MOECORE_FAIL("--lr-warmup-fraction and --lr-warmup-iters exclude each other (as in Megatron: give one)");
  const int64_t decay = t.lr_decay_iters > 0 ? t.lr_decay_iters : t.train_iters;
  t.lr_warmup_iters = a.f64(f) * static_cast<double>(decay);  // (fractional as in Megatron)
}

void persistent_save_interval(const Args& a, const char* f, train::TrainConfig& t) {
  if (!a.given(f)) return;
  if (a.given("--save-interval") && a.i64("--save-interval") != a.i64(f))
    MOECORE_FAIL("--save-interval (", a.str("--save-interval"), ") and ", f, " (", a.str(f),
                 ") name one setting (Megatron's alias); give one");
  t.save_interval = a.i64(f);
}

// torch and torch_dist are Megatron's resharding formats; moecore writes its own, which reshards too (any TP, PP, EP,
// DP on load) and commits atomically. Megatron ties torch_dcp to torch FSDP2 and fsdp_dtensor to Megatron-FSDP.
void ckpt_format(const Args& a, const char* f, train::TrainConfig&) {
  const std::string v = a.str(f);
  if (v == "fsdp_dtensor")
    MOECORE_FAIL(f,
                 " fsdp_dtensor is Megatron-FSDP's format (\"--ckpt-format fsdp_dtensor is only tested with Megatron ",
                 "FSDP\"), and Megatron-FSDP is not supported yet; use --ckpt-format torch_dist");
  if (v == "torch_dcp")
    MOECORE_FAIL(f, " torch_dcp needs torch FSDP2 in Megatron (\"--ckpt-format torch_dcp is only tested with FSDP\"), ",
                 "which is not supported yet; use --ckpt-format torch_dist");
}

// Megatron's validate_args: an asynchronous save needs the persistent worker, or it is switched off with a warning.
void async_save(const Args& a, const char* f, train::TrainConfig& t) {
  t.async_save = a.on(f);
  if (t.async_save && !a.on("--use-persistent-ckpt-worker")) {
    std::fprintf(stderr,
                 "warning: --async-save is not supported without --use-persistent-ckpt-worker. Disabling "
                 "--async-save. (Megatron's check)\n");
    t.async_save = false;
  }
}

// Megatron's training/determinism.py: the options that are not deterministic are refused (never switched off).
// moecore's kernels use no atomics and its collectives reduce in rank order, so the rest holds already.
void deterministic_mode(const Args& a, const char* f, train::TrainConfig&) {
  if (!a.on(f)) return;
  if (a.given("--cross-entropy-loss-fusion"))
    MOECORE_FAIL("--deterministic-mode requires: cross_entropy_loss_fusion=False (got True). Adjust these options to ",
                 "continue (Megatron's check; drop --cross-entropy-loss-fusion)");
}

// Megatron's get_megatron_optimizer: --loss-scale is the constant scaler (with --fp16 or --bf16), --fp16 without it the
// dynamic one, whose validate_args also switches the NaN check off (overflows are the dynamic scaler's signal). The
// dynamic scaler's settings apply only to it: given another value without it they are refused (Megatron ignores them).
void loss_scaling(const Args& a, const char* f, train::TrainConfig& t) {
  using Kind = train::GradScalerConfig::Kind;
  const bool fp16 = a.on("--fp16"), bf16 = a.on("--bf16");
  train::GradScalerConfig& g = t.grad_scaler;
  if (a.given(f)) {
    if (!fp16 && !bf16)
      MOECORE_FAIL(f, " scales the loss of --fp16 or --bf16 training (Megatron's mixed-precision optimizer); fp32 ",
                   "training has no loss scale: drop it, or add --fp16");
    g.kind = Kind::constant;
    g.scale = static_cast<float>(a.f64(f));
  } else if (fp16) {
    g.kind = Kind::dynamic;
    g.scale = static_cast<float>(a.f64("--initial-loss-scale"));
    if (t.check_for_nan) {
      std::fprintf(stderr,
                   "warning: Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss scaling "
                   "is being used (Megatron's validation: a non-finite gradient lowers the loss scale and "
                   "skips the step)\n");
      t.check_for_nan = false;
    }
  }
  const double window = a.f64("--loss-scale-window");
  if (window != std::floor(window))
    MOECORE_FAIL("--loss-scale-window (", a.str("--loss-scale-window"),
                 ") must be a whole number of steps (the scale doubles when the steps since an overflow reach it)");
  g.min_scale = static_cast<float>(a.f64("--min-loss-scale"));
  g.window = static_cast<int64_t>(window);
  g.hysteresis = a.i64("--hysteresis");
  if (g.kind == Kind::dynamic) return;
  for (const char* d : {"--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"})
    if (a.given(d) && a.f64(d) != std::stod(megatron_flag(d)->def))
      MOECORE_FAIL(d, " sets the dynamic loss scaler, which only --fp16 without --loss-scale has",
                   fp16 ? " (this run has --loss-scale: a constant scale)" : " (this run is not --fp16)",
                   "; drop it or use --fp16");
}

// clang-format off
const TrainFlag kTrainFlags[] = {
  {"--loss-scale", TrainFlagKind::value, "",
   "a constant loss scale for --fp16 or --bf16 (without it --fp16 scales dynamically); steps whose gradients overflow "
   "are skipped", FlagDomain::positive_number(), loss_scaling},
  {"--initial-loss-scale", TrainFlagKind::value, "4294967296", "the dynamic loss scale's start (--fp16)",
   FlagDomain::positive_number(), nullptr},  // (read by --loss-scale's rule)
  {"--min-loss-scale", TrainFlagKind::value, "1.0", "the dynamic loss scale's floor (--fp16)",
   FlagDomain::positive_number(), nullptr},
  {"--loss-scale-window", TrainFlagKind::value, "1000",
   "steps without an overflow after which the dynamic loss scale doubles (--fp16)", FlagDomain::number(1), nullptr},
  {"--hysteresis", TrainFlagKind::value, "2",
   "overflowing steps (since the last doubling) after which the dynamic loss scale halves (--fp16)",
   FlagDomain::integer(1), nullptr},
  {"--no-log-loss-scale-to-tensorboard", TrainFlagKind::flag, "", "no loss-scale metric", {},
   [](const Args& a, const char* f, train::TrainConfig& t) {
     t.log_loss_scale_to_tensorboard = !a.on(f) && !a.on("--disable-log-loss-scale-to-tensorboard");
   }},
  {"--disable-log-loss-scale-to-tensorboard", TrainFlagKind::flag, "",
   "Megatron's other name of --no-log-loss-scale-to-tensorboard", {}, nullptr},
  {"--calculate-per-token-loss", TrainFlagKind::flag, "",
   "the loss and its gradient over the global batch's counted tokens (each token weighs alike; without it each "
   "micro-batch's mean does); the MoE auxiliary losses keep their weight, as Megatron",
   {}, [](const Args& a, const char* f, train::TrainConfig& t) { t.calculate_per_token_loss = a.on(f); }},
  {"--lr-warmup-fraction", TrainFlagKind::value, "",
   "warm-up as a fraction of the decay (--lr-decay-iters, else --train-iters); excludes --lr-warmup-iters",
   FlagDomain::number(0.0, 1.0), lr_warmup_fraction},
  {"--persistent-save-interval", TrainFlagKind::value, "", "Megatron's other name of --save-interval",
   FlagDomain::integer(1, 1e12), persistent_save_interval},
  {"--ckpt-format", TrainFlagKind::value, "torch_dist",
   "torch_dist | torch: moecore's checkpoint format (safetensors + COMMIT manifest; resharded on load to any TP, PP, "
   "EP, DP, as torch_dist); torch_dcp and fsdp_dtensor need FSDP (not supported yet)",
   FlagDomain::one_of({"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"}), ckpt_format},
  {"--dist-ckpt-strictness", TrainFlagKind::value, "assume_ok_unexpected",
   "on load, checkpoint tensors the model does not take: raise_all refuses them, the other modes load the rest and name "
   "them in a warning; tensors the model needs that the checkpoint lacks: assume_ok_unexpected and the raise modes "
   "refuse the load, the others leave them at their initial values and name them in a warning",
   FlagDomain::one_of({"assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                       "return_unexpected", "return_all", "ignore_all"}),
   [](const Args& a, const char* f, train::TrainConfig& t) { t.ckpt_strictness = train::parse_ckpt_strictness(a.str(f)); }},
  {"--log-validation-ppl-to-tensorboard", TrainFlagKind::flag, "",
   "validation perplexity as 'lm loss validation ppl' in TensorBoard (valid_lm_loss_ppl in --metrics-jsonl)", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.log_validation_ppl = a.on(f); }},
  {"--exit-duration-in-mins", TrainFlagKind::value, "",
   "save (with --save) and stop once the run has trained this many minutes (the slowest rank decides)",
   FlagDomain::integer(1, 1e9),
   [](const Args& a, const char* f, train::TrainConfig& t) { t.exit_duration_mins = static_cast<double>(a.i64_or(f, 0)); }},
  {"--check-weight-hash-across-dp-replicas-interval", TrainFlagKind::value, "",
   "every N steps, compare a hash of each parameter across its data-parallel replicas; a divergence stops the run "
   "naming the tensor and the ranks (unset: never)",
   FlagDomain::integer(1, 1e12),
   [](const Args& a, const char* f, train::TrainConfig& t) { t.check_weight_hash_interval = a.i64_or(f, 0); }},
  {"--num-distributed-optimizer-instances", TrainFlagKind::value, "1",
   "with --use-distributed-optimizer: the optimizer state is sharded within each of N groups of data-parallel ranks "
   "and gradients are all-reduced across the groups (Megatron's partial distributed optimizer)",
   FlagDomain::integer(1, 1e6),
   [](const Args& a, const char* f, train::TrainConfig& t) { t.num_distributed_optimizer_instances = a.i64(f); }},
  {"--use-tp-pp-dp-mapping", TrainFlagKind::flag, "",
   "rank order tp-cp-ep-pp-dp (pipeline stages before data-parallel replicas) instead of tp-cp-ep-dp-pp, as Megatron",
   {}, nullptr},  // (read into the ParallelConfig)
  {"--log-params-norm", TrainFlagKind::flag, "",
   "the L2 norm of all parameters (each counted once over TP, PP, EP) on the log line and as params-norm", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.log_params_norm = a.on(f); }},
  {"--log-num-zeros-in-grad", TrainFlagKind::flag, "",
   "the number of zero gradient elements after clipping on the log line and as num-zeros", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.log_num_zeros_in_grad = a.on(f); }},
  {"--log-throughput", TrainFlagKind::flag, "",
   "Megatron's 'throughput per GPU (TFLOP/s/GPU)' on the log line (with --log-timers-to-tensorboard also the "
   "throughput metric); moecore's tokens/s, TFLOP/s and MFU are always there", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.log_throughput = a.on(f); }},
  {"--log-timers-to-tensorboard", TrainFlagKind::flag, "",
   "the timers of --timing-log-level as <name>-time metrics (the slowest rank's seconds per step)", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.log_timers_to_tensorboard = a.on(f); }},
  {"--timing-log-level", TrainFlagKind::value, "0",
   "0: the iteration time; 1: and the step's phases (forward-backward, gradient reduction, parameter gather, "
   "optimizer parts), with Megatron's '(min, max) time across ranks (ms)' block after each log line; 2: and the "
   "per-micro-batch ones (batch-generator, forward/backward compute, pipeline sends and receives)",
   FlagDomain::one_of({"0", "1", "2"}),
   [](const Args& a, const char* f, train::TrainConfig& t) { t.timing_log_level = static_cast<int>(a.i64(f)); }},
  {"--timing-log-option", TrainFlagKind::value, "minmax",
   "the timers block: max (the slowest rank) | minmax | all (every rank)", FlagDomain::one_of({"max", "minmax", "all"}),
   [](const Args& a, const char* f, train::TrainConfig& t) { t.timing_log_option = a.str(f); }},
  {"--log-memory-to-tensorboard", TrainFlagKind::flag, "",
   "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count and mem-reserved-bytes (the CUDA pool's; on "
   "the host the resident set) in the metrics", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.log_memory_to_tensorboard = a.on(f); }},
  {"--logging-level", TrainFlagKind::value, "",
   "Python's logging levels: above 20 (INFO) hides the notes (timers block, MoE per-layer lines, load notes), above 30 "
   "(WARNING) the warnings too; the step, validation and checkpoint lines and errors always show, as in Megatron",
   FlagDomain::integer(0, 100),
   [](const Args& a, const char* f, train::TrainConfig& t) {
     if (a.given(f)) t.logging_level = static_cast<int>(a.i64(f));
   }},
  {"--async-save", TrainFlagKind::flag, "",
   "checkpoints written by a background worker while training goes on (a snapshot in host memory at the save point; "
   "committed at a later step boundary once every rank's files are durable; the save in flight is finished before the "
   "run ends); needs --use-persistent-ckpt-worker, as in Megatron",
   {}, async_save},
  {"--use-persistent-ckpt-worker", TrainFlagKind::flag, "",
   "one long-lived writer thread for --async-save (its snapshot buffers are kept from save to save)", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.use_persistent_ckpt_worker = a.on(f); }},
  {"--async-strategy", TrainFlagKind::value, "nvrx",
   "nvrx | mcore: Megatron's two writer implementations; both are moecore's writer here (mcore without --async-save, "
   "as Megatron)",
   FlagDomain::one_of({"nvrx", "mcore"}),
   [](const Args& a, const char* f, train::TrainConfig& t) { t.async_strategy = t.async_save ? a.str(f) : "mcore"; }},
  {"--async-ckpt-use-cpu-shm", TrainFlagKind::flag, "",
   "stage device tensors in shared host memory: the snapshot is always in this process's host memory here", {},
   [](const Args& a, const char* f, train::TrainConfig& t) { t.async_ckpt_use_cpu_shm = a.on(f); }},
  {"--async-ckpt-cpu-priority", TrainFlagKind::value, "10",
   "the writer thread's nice value (above 19: 19; below 0: left as it is, as Megatron)", FlagDomain::integer(-20, 1e6),
   [](const Args& a, const char* f, train::TrainConfig& t) {
     t.async_ckpt_cpu_priority = static_cast<int>(std::min<int64_t>(a.i64(f), 19));
   }},
  {"--deterministic-mode", TrainFlagKind::flag, "",
   "bitwise reproducible runs: refuses --cross-entropy-loss-fusion as Megatron; moecore's kernels and reductions are "
   "deterministic already", {}, deterministic_mode},
};
// clang-format on

// Defaults are Megatron's (megatron/training/arguments.py); "" is Megatron's None (unset).
void add_training_flags(Args& a) {
  for (const TrainFlag& f : kTrainFlags) {
    if (f.kind == TrainFlagKind::flag)
      a.flag(f.name, f.help);
    else
      a.option(f.name, f.def, f.help);
    if (f.domain) a.domain(f.name, *f.domain);
  }
  const std::string req = " (Megatron: required)";
  a.list_option("--data-path", "dataset prefixes (.bin/.idx), optionally weighted: \"w1 p1 w2 p2 ...\"")
      .option("--split", "969,30,1", "train,valid,test proportions (Megatron: unset = 969,30,1)")
      .flag("--eod-mask-loss", "no loss on end-of-document tokens")
      .option("--micro-batch-size", "8", "sequences per forward/backward" + req)
      .option("--global-batch-size", "", "sequences per optimizer step (unset: micro-batch x data-parallel size)")
      .option("--train-iters", "200", "optimizer steps" + req)
      .option("--lr", "3e-3", "peak learning rate" + req)
      .option("--min-lr", "0.0", "final learning rate of the decay")
      .option("--lr-warmup-iters", "0", "linear warmup steps")
      .option("--lr-decay-style", "linear", "constant | linear | cosine | WSD")
      .option("--lr-decay-iters", "", "end of the decay (unset: --train-iters)")
      .option("--lr-wsd-decay-iters", "", "WSD: length of the final decay")
      .option("--lr-wsd-decay-style", "exponential", "WSD: exponential | linear | cosine | minus_sqrt")
      .option("--weight-decay", "0.01", "decoupled weight decay on weight matrices (not norms or biases)")
      .option("--adam-beta1", "0.9", "AdamW beta1")
      .option("--adam-beta2", "0.999", "AdamW beta2")
      .option("--adam-eps", "1e-08", "AdamW epsilon")
      .option("--clip-grad", "1.0", "global gradient-norm clip (0: off)")
      .option("--optimizer", "adam",
              "adam (AdamW, Megatron's adam); Megatron's others (sgd, muon, ...) are not supported yet")
      .flag("--use-precision-aware-optimizer", "allow reduced-precision optimizer states (--exp-avg-dtype)")
      .option("--exp-avg-dtype", "fp32", "fp32 | bf16 (with --use-precision-aware-optimizer)")
      .option("--exp-avg-sq-dtype", "fp32", "fp32 | bf16 (with --use-precision-aware-optimizer)")
      .option("--seed", "1234", "random seed (weights, data order, dropout, router noise)")
      .option("--device", "cpu",
              "cpu | cuda | sim: where parameters, activations and every op live (moecore; sim is the simulated "
              "device of the test suite: host memory that only ops touch)")
      .option("--log-interval", "100", "steps between log lines")
      .option("--eval-interval", "",
              "steps between validations (Megatron: required for validation; unset here: only at the end)")
      .option("--eval-iters", "100", "validation batches per evaluation")
      .option("--metrics-jsonl", "", "write one JSON object per logged iteration to this file (moecore)")
      .option("--tensorboard-dir", "", "write TensorBoard event files here")
      .flag("--moe-per-layer-logging", "log tokens per expert, load, drops and losses of every MoE layer")
      .option("--save", "", "checkpoint directory")
      .option("--load", "", "resume from the newest committed checkpoint under this directory")
      .option("--ckpt-step", "", "with --load: load this iteration instead of the newest (Megatron)")
      .option("--load-hf", "",
              "start from a Hugging Face model directory's weights (its config.json fills the model flags as "
              "--hf-config); a committed checkpoint under --load takes precedence, so restarts resume (moecore only)")
      .option("--save-interval", "", "steps between checkpoints (unset: only at the end)")
      .option("--exit-interval", "", "stop (after saving) at multiples of this iteration")
      .option("--keep-last-checkpoints", "0", "keep only the newest N checkpoints (0: all; moecore)")
      .flag("--allow-other-models-in-save",
            "save into a --save directory that holds checkpoints of another model (refused otherwise); "
            "--keep-last-checkpoints still removes only this model's (moecore)")
      .flag("--no-load-optim", "load weights and progress, not the optimizer state")
      .flag("--no-load-rng", "do not restore the random state (router noise positions)")
      .flag("--no-save-optim", "checkpoints without the optimizer state")
      .flag("--no-save-rng", "checkpoints without the random state")
      .flag("--finetune", "load only the weights: iteration 0, fresh optimizer and random state")
      .flag("--override-opt_param-scheduler", "the command line's LR schedule wins over the checkpoint's")
      .flag("--override-opt-param-scheduler", "the same as --override-opt_param-scheduler")
      .flag("--use-checkpoint-opt_param-scheduler", "the checkpoint's LR schedule wins over the command line's")
      .flag("--use-checkpoint-opt-param-scheduler", "the same as --use-checkpoint-opt_param-scheduler")
      .flag("--exit-signal-handler", "on SIGTERM/SIGINT save a checkpoint and stop (without it the signal kills)")
      .flag("--no-check-for-nan-in-loss-and-grad", "do not check loss and gradients for NaN/Inf")
      .option("--nan-action", "stop",
              "on NaN/Inf: stop (error naming the tensor) | skip (drop the step; 10 skipped in a row stop the run "
              "with an error; moecore)")
      .option("--tensor-model-parallel-size", "1",
              "TP: ranks each attention and dense layer is split over (Megatron's column/row-parallel linears)")
      .flag("--sequence-parallel", "with TP > 1: norms, dropout and the residual stream split along the sequence")
      .option("--pipeline-model-parallel-size", "1",
              "PP: pipeline stages the decoder layers are split over (1F1B schedule; embeddings on the first, loss on "
              "the last)")
      .option("--context-parallel-size", "1",
              "CP: ranks each sequence is split over (two load-balanced chunks per rank; attention all-gathers K/V)")
      .option("--cp-comm-type", "p2p",
              "CP attention's communication: p2p (Megatron's ring) | allgather; moecore all-gathers for both (the "
              "same attention, without the ring's overlap)")
      .option(
          "--expert-tensor-parallel-size", "",
          "ETP: ranks each routed expert's fc1 and fc2 are split over (Parallel Folding: independent of TP); unset: "
          "the TP size, as Megatron")
      .option("--num-layers-per-virtual-pipeline-stage", "",
              "with PP: decoder layers per virtual pipeline stage (model chunk): the interleaved 1F1B schedule with "
              "num-layers / PP / this chunks per rank")
      .option("--decoder-first-pipeline-num-layers", "",
              "with PP: decoder layers of the first stage (the others split the rest evenly)")
      .option("--decoder-last-pipeline-num-layers", "",
              "with PP: decoder layers of the last stage (the others split the rest evenly)")
      .option(
          "--pipeline-model-parallel-layout", "",
          "with PP: Megatron's layout string, e.g. 'Et*3|(tt|)*2,tmL' (E embedding, t decoder layer, m MTP, L loss; "
          "'|' between stages)")
      .option("--num-virtual-stages-per-pipeline-rank", "",
              "with PP: model chunks per pipeline rank (the interleaved 1F1B schedule; each stage's layers split "
              "evenly over its chunks)")
      .flag("--account-for-embedding-in-pipeline-split",
            "with PP: the embedding counts as a decoder layer when the layers are split (the first stage holds one "
            "fewer)")
      .flag("--account-for-loss-in-pipeline-split",
            "with PP: the output layer and loss count as a decoder layer when the layers are split (the last stage "
            "holds one fewer)")
      .option("--microbatch-group-size-per-virtual-pipeline-stage", "",
              "interleaved schedule: micro-batches run through one chunk in a row (unset: the pipeline size)")
      .flag("--overlap-grad-reduce",
            "start each gradient bucket's all-reduce (distributed optimizer: reduce-scatter) during backward, as soon "
            "as it is final")
      .flag("--overlap-param-gather",
            "with --use-distributed-optimizer and --overlap-grad-reduce: leave the updated parameters' all-gathers in "
            "flight until forward reads each bucket")
      .option("--expert-model-parallel-size", "1",
              "EP: ranks the routed experts are spread over (mpirun -np a multiple)")
      .flag("--use-distributed-optimizer",
            "ZeRO-1: optimizer state sharded over data-parallel ranks (experts: expert-DP)")
      .option("--ddp-bucket-size", "",
              "gradient elements per all-reduce / reduce-scatter bucket (unset: max(40000000, 1000000 x DP))")
      .option("--moe-token-dispatcher-type", "allgather",
              "token dispatcher under EP: allgather | alltoall (flex, DeepEP/HybridEP, is not supported yet)")
      .option("--distributed-timeout-minutes", "10",
              "how long a collective waits for its peers before the job is aborted naming the operation "
              "(MOECORE_COMM_TIMEOUT_S, in seconds, overrides it)")
      .flag("--moe-use-upcycling", "start the MoE model from the dense checkpoint given by --load")
      .option("--moe-upcycling-granularity", "1", "experts per dense MLP copy: dense ffn = g * moe ffn")
      .option("--generate-tokens", "200", "tokens sampled after training (0: none; moecore)")
      .option("--prompt", "The ", "text the sample starts from (empty: a new document; moecore)");
  // What each numeric or enumerated training flag accepts, checked at start-up (Args::domain).
  using D = FlagDomain;
  const std::pair<const char*, FlagDomain> domains[] = {
      {"--split", D::numbers(0.0)},
      {"--micro-batch-size", D::integer(1)},
      {"--global-batch-size", D::integer(1)},
      {"--train-iters", D::integer(0, 1e12)},
      {"--lr", D::number(0.0)},
      {"--min-lr", D::number(0.0)},
      {"--lr-warmup-iters", D::integer(0, 1e12)},
      {"--lr-decay-style", D::one_of({"constant", "linear", "cosine", "WSD"})},
      {"--lr-decay-iters", D::integer(1, 1e12)},
      {"--lr-wsd-decay-iters", D::integer(0, 1e12)},
      {"--lr-wsd-decay-style", D::one_of({"exponential", "linear", "cosine", "minus_sqrt"})},
      {"--weight-decay", D::number(0.0)},
      {"--adam-beta1", D::fraction()},
      {"--adam-beta2", D::fraction()},
      {"--adam-eps", D::positive_number()},
      {"--clip-grad", D::number(0.0)},
      {"--optimizer", D::one_of({"adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"})},  // Megatron's
      {"--exp-avg-dtype", D::one_of({"fp32", "bf16"})},
      {"--exp-avg-sq-dtype", D::one_of({"fp32", "bf16"})},
      {"--seed", D::integer(0, 4294967295.0)},
      {"--log-interval", D::integer(1, 1e12)},
      {"--eval-interval", D::integer(1, 1e12)},
      {"--eval-iters", D::integer(0, 1e12)},
      {"--save-interval", D::integer(1, 1e12)},
      {"--exit-interval", D::integer(1, 1e12)},
      {"--keep-last-checkpoints", D::integer(0)},
      {"--ckpt-step", D::integer(0, 1e12)},
      {"--nan-action", D::one_of({"stop", "skip"})},
      {"--device", D::one_of({"cpu", "cuda", "sim"})},
      {"--expert-model-parallel-size", D::integer(1, 1e6)},
      {"--tensor-model-parallel-size", D::integer(1, 1e6)},
      {"--context-parallel-size", D::integer(1, 1e6)},
      {"--pipeline-model-parallel-size", D::integer(1, 1e6)},
      {"--decoder-first-pipeline-num-layers", D::integer(1, 1e6)},
      {"--decoder-last-pipeline-num-layers", D::integer(1, 1e6)},
      {"--num-layers-per-virtual-pipeline-stage", D::integer(1, 1e6)},
      {"--num-virtual-stages-per-pipeline-rank", D::integer(1, 1e6)},
      {"--microbatch-group-size-per-virtual-pipeline-stage", D::integer(1, 1e6)},
      {"--expert-tensor-parallel-size", D::integer(1, 1e6)},
      {"--cp-comm-type", D::one_of({"p2p", "allgather"})},
      {"--ddp-bucket-size", D::integer(1, 1e15)},
      {"--moe-token-dispatcher-type", D::one_of({"allgather", "alltoall", "flex"})},  // Megatron's
      {"--distributed-timeout-minutes", D::integer(1, 1e6)},
      {"--moe-upcycling-granularity", D::integer(1, 1e6)},
      {"--generate-tokens", D::integer(0, 1e6)},
  };
  for (const auto& [name, domain] : domains) a.domain(name, domain);
}

// --overlap-moe-expert-parallel-comm is accepted without effect (a schedule choice); Megatron's preconditions
// (TransformerConfig.__post_init__) still hold, so a configuration Megatron refuses is refused here too.
void check_overlap_moe_expert_parallel_comm(const Args& a) {
  const char* f = "--overlap-moe-expert-parallel-comm";
  if (!a.given(f)) return;
  const auto need = [&](bool ok, const char* megatron) {
    if (!ok) MOECORE_FAIL(f, ": ", megatron, " (Megatron's check)");
  };
  need(a.i64("--expert-model-parallel-size") > 1,
       "overlap_moe_expert_parallel_comm is only supported with expert model parallelism");
  need(a.str("--moe-token-dispatcher-type") == "alltoall",
       "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher");
  need(a.str("--recompute-granularity") != "full",
       "disable full recomputation when enabling overlap_moe_expert_parallel_comm");
  need(a.str("--recompute-method").empty(),
       "disable recomputation method when enabling overlap_moe_expert_parallel_comm");
  need(a.str("--recompute-num-layers").empty(),
       "recompute_num_layers must be None when enabling overlap_moe_expert_parallel_comm");
  need(a.i64("--pipeline-model-parallel-size") == 1 || !a.str("--num-virtual-stages-per-pipeline-rank").empty() ||
           !a.str("--num-layers-per-virtual-pipeline-stage").empty() ||
           !a.str("--pipeline-model-parallel-layout").empty(),
       "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
       "pipeline_model_parallel_size > 1");
}

DType state_dtype(const Args& a, const char* flag) {
  const std::string v = a.str(flag);
  if (v != "fp32" && v != "bf16") MOECORE_FAIL(flag, " '", v, "' is not one of fp32, bf16");
  if (v == "bf16" && !a.on("--use-precision-aware-optimizer"))
    MOECORE_FAIL(flag, " bf16 requires --use-precision-aware-optimizer");
  return v == "bf16" ? DType::bf16 : DType::f32;
}

// The flag the user typed for the model's config.json: --load-hf when it set --hf-config (errors must name it).
std::string hf_config_flag(const Args& a) {
  const std::string load_hf = a.str("--load-hf");
  return !load_hf.empty() && a.str("--hf-config") == load_hf ? "--load-hf" : "--hf-config";
}

train::TrainConfig train_config_from(const Args& a, int64_t dp_size) {
  train::TrainConfig t;
  t.micro_batch_size = a.i64("--micro-batch-size");
  t.global_batch_size = a.i64_or("--global-batch-size", t.micro_batch_size * dp_size);
  t.train_iters = a.i64("--train-iters");
  t.lr = static_cast<float>(a.f64("--lr"));
  t.min_lr = static_cast<float>(a.f64("--min-lr"));
  t.lr_warmup_iters = a.i64("--lr-warmup-iters");
  t.lr_decay_style = a.str("--lr-decay-style");
  t.lr_decay_iters = a.i64_or("--lr-decay-iters", 0);
  t.lr_wsd_decay_iters = a.i64_or("--lr-wsd-decay-iters", 0);
  t.lr_wsd_decay_style = a.str("--lr-wsd-decay-style");
  t.log_interval = a.i64("--log-interval");
  t.eval_interval = a.i64_or("--eval-interval", 0);
  t.eval_iters = a.i64("--eval-iters");
  t.seed = static_cast<uint64_t>(a.i64("--seed"));
  t.moe_per_layer_logging = a.on("--moe-per-layer-logging");
  t.save = a.str("--save");
  t.load = a.str("--load");
  t.ckpt_step = a.i64_or("--ckpt-step", -1);
  if (!a.str("--hf-config").empty())
    t.hf_config_json = io::read_file(hf_config_path(a.str("--hf-config"), hf_config_flag(a)));
  t.save_interval = a.i64_or("--save-interval", 0);
  t.exit_interval = a.i64_or("--exit-interval", 0);
  t.keep_last = static_cast<int>(a.i64("--keep-last-checkpoints"));
  t.allow_other_models_in_save = a.on("--allow-other-models-in-save");
  t.exit_signal_handler = a.on("--exit-signal-handler");
  t.load_optim = !a.on("--no-load-optim");
  t.load_rng = !a.on("--no-load-rng");
  t.save_optim = !a.on("--no-save-optim");
  t.save_rng = !a.on("--no-save-rng");
  t.finetune = a.on("--finetune");
  t.override_opt_param_scheduler = a.on("--override-opt_param-scheduler") || a.on("--override-opt-param-scheduler");
  t.use_checkpoint_opt_param_scheduler =
      a.on("--use-checkpoint-opt_param-scheduler") || a.on("--use-checkpoint-opt-param-scheduler");
  t.check_for_nan = !a.on("--no-check-for-nan-in-loss-and-grad");
  t.nan_action = a.str("--nan-action");
  t.use_distributed_optimizer = a.on("--use-distributed-optimizer");
  t.overlap_grad_reduce = a.on("--overlap-grad-reduce");
  t.overlap_param_gather = a.on("--overlap-param-gather");
  t.ddp_bucket_size = a.i64_or("--ddp-bucket-size", std::max<int64_t>(40'000'000, 1'000'000 * dp_size));
  if (t.ddp_bucket_size <= 0) MOECORE_FAIL("--ddp-bucket-size (", t.ddp_bucket_size, ") must be positive");
  t.microbatch_group_size_per_vp_stage = a.i64_or("--microbatch-group-size-per-virtual-pipeline-stage", 0);
  t.metrics_jsonl = a.str("--metrics-jsonl");
  t.tensorboard_dir = a.str("--tensorboard-dir");
  for (const TrainFlag& f : kTrainFlags)
    if (f.apply) f.apply(a, f.name, t);
  t.validate();
  return t;
}

optim::AdamWConfig optimizer_config_from(const Args& a) {
  optim::AdamWConfig o;
  o.beta1 = static_cast<float>(a.f64("--adam-beta1"));
  o.beta2 = static_cast<float>(a.f64("--adam-beta2"));
  o.eps = static_cast<float>(a.f64("--adam-eps"));
  o.weight_decay = static_cast<float>(a.f64("--weight-decay"));
  o.clip_grad = static_cast<float>(a.f64("--clip-grad"));
  const std::string name = a.str("--optimizer");
  if (name.find("muon") != std::string::npos)
    MOECORE_FAIL("--optimizer ", name, " is not supported yet: the Muon optimizer; use --optimizer adam");
  if (name != "adam") MOECORE_FAIL("--optimizer ", name, " is not supported yet: use --optimizer adam (AdamW)");
  const DType m = state_dtype(a, "--exp-avg-dtype"), v = state_dtype(a, "--exp-avg-sq-dtype");
  if (m != v) MOECORE_FAIL("--exp-avg-dtype and --exp-avg-sq-dtype must be equal");
  o.state_dtype = m;
  o.validate();
  return o;
}

// --moe-use-upcycling: the dense model of the same flags (without experts) is loaded from --load and
// converted (spec §10); the MoE model then trains from iteration 0 with a fresh optimizer.
void upcycle_from_dense(model::GptModel& gpt, const Args& a, const train::TrainConfig& tcfg) {
  const model::ModelConfig& mc = gpt.config();
  if (!mc.moe.enabled()) MOECORE_FAIL("--moe-use-upcycling needs --num-experts");
  if (tcfg.load.empty()) MOECORE_FAIL("--moe-use-upcycling needs --load with the dense checkpoint");
  const int64_t g = a.i64("--moe-upcycling-granularity");
  if (g <= 0 || mc.ffn() != g * mc.moe_ffn())
    MOECORE_FAIL("--moe-upcycling-granularity (", g, ") must equal --ffn-hidden-size (", mc.ffn(),
                 ") / --moe-ffn-hidden-size (", mc.moe_ffn(), ")");
  model::ModelConfig dc = mc;
  dc.moe = moe::MoeConfig{};
  dc.moe.swiglu = mc.swiglu;
  model::GptModel dense(dc, 1, tcfg.seed);
  optim::AdamW dense_opt(dense.params(), optim::AdamWConfig{});
  const auto dir = io::checkpoint_find_latest(
      tcfg.load, tcfg.ckpt_step >= 0 ? std::optional<int64_t>(tcfg.ckpt_step) : std::nullopt);
  if (!dir) MOECORE_FAIL("--load ", tcfg.load, ": no committed checkpoint to upcycle");
  train::load_training_checkpoint(*dir, dense, dense_opt, tcfg.seed);
  model::upcycle_dense_to_moe(dense, gpt);
  std::printf(" upcycled the dense checkpoint %s into %lld experts (granularity %lld)\n", dir->c_str(),
              static_cast<long long>(mc.moe.num_experts), static_cast<long long>(g));
}

// A model whose parameters and gradients alone (fp32, 8 bytes per parameter, before optimizer state and
// activations) exceed this machine's memory is refused before anything is allocated, instead of swapping or
// being killed minutes later.
// Model chunks per pipeline rank from Megatron's two flags (1 when neither is set):
// --num-virtual-stages-per-pipeline-rank directly, --num-layers-per-virtual-pipeline-stage as num_layers / pp / it
// (even splits only, as in Megatron).
int64_t virtual_pipeline_stages(const Args& a, int64_t num_layers, int64_t pp, bool uneven) {
  const bool per_rank = !a.str("--num-virtual-stages-per-pipeline-rank").empty(),
             per_stage = !a.str("--num-layers-per-virtual-pipeline-stage").empty();
  if (per_rank && per_stage)
    MOECORE_FAIL(
        "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank exclude each other (as "
        "in Megatron)");
  if (per_rank) return a.i64("--num-virtual-stages-per-pipeline-rank");
  if (!per_stage) return 1;
  const int64_t n = a.i64("--num-layers-per-virtual-pipeline-stage");
  if (uneven)
    MOECORE_FAIL(
        "--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers: use "
        "--num-virtual-stages-per-pipeline-rank for an uneven virtual pipeline (as Megatron asks)");
  if (pp <= 1) MOECORE_FAIL("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1");
  if (num_layers % pp != 0 || (num_layers / pp) % n != 0)
    MOECORE_FAIL("--num-layers-per-virtual-pipeline-stage ", n, ": --num-layers (", num_layers,
                 ") / --pipeline-model-parallel-size (", pp, ") must be a multiple of it");
  return num_layers / pp / n;
}

// The start-up memory check (host devices: cpu and sim; a cuda run's tensors fail by the device's own message).
// `limit` is the tightest limit of core/memory_limit.h, read before the model is built. The margin is left for
// what the plan does not count: 64 MiB for the heap's overhead, OpenMP's threads, the batches and the data's pages,
// and an eighth of the plan for the kernels' smaller scratch (measured on 1 layer, H 16, S 16, --micro-batch-size
// 100000: a peak resident set of 5.19 GB against a plan, attention scratch included, of 5.36 GB).
int64_t memory_margin(int64_t planned) {
  return (int64_t{64} << 20) + planned / 8;
}

// The tightest limit (core/memory_limit.h; the machine's RAM when none can be read), shared by the ranks that mpirun
// started on this node (OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS): each reads it before any has allocated.
MemoryLimit node_memory_limit() {
  MemoryLimit l = memory_limit();
  if (!l.known()) l = {memory_physical_bytes(), memory_physical_bytes(), "of the machine's RAM (sysconf)"};
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (!local) local = std::getenv("MPI_LOCALNRANKS");
  const int64_t ranks = local ? std::max<int64_t>(1, std::atoll(local)) : 1;
  if (ranks > 1) {
    l.room /= ranks;
    l.name += "; this rank's share: 1/" + std::to_string(ranks) + " of the free memory, for the " +
              std::to_string(ranks) + " ranks on this node";
  }
  return l;
}

std::string memory_hint(bool activations) {
  return std::string("hint: ") +
         (activations ? "a smaller --micro-batch-size or --seq-length, activation recompute (--recompute-granularity "
                        "full), "
                      : "a smaller model, ") +
         "--use-distributed-optimizer, or more tensor-, expert- or pipeline-parallel ranks lowers the need";
}

// Before the model is built (its constructor writes every parameter, gradient and optimizer moment): the parts
// sized by the parameters alone, from the configuration.
void check_model_fits(const model::ModelConfig& mc, const model::ModelParallel& par, DType state_dtype,
                      int64_t state_shards, const MemoryLimit& limit) {
  const int64_t params = model::parameters_per_rank(
      mc, std::max(1, par.ep.size()), std::max(1, par.tp.size()), std::max(1, par.etp.size()),
      [&](const std::string& name) { return model::pipeline_stage_holds(name, mc, par); });
  // f32 value and gradient, the compute-dtype copy of the weights (bf16), the two AdamW moments (sharded over the
  // data-parallel ranks by the distributed optimizer)
  const int64_t compute = mc.compute_dtype == DType::f32 ? 0 : static_cast<int64_t>(dtype_size(mc.compute_dtype));
  const int64_t per_param = 8 + compute, state = 2 * static_cast<int64_t>(dtype_size(state_dtype));
  int64_t need = 0, state_need = 0;
  const bool overflow = __builtin_mul_overflow(params, per_param, &need) ||
                        __builtin_mul_overflow(params / state_shards + 1, state, &state_need) ||
                        __builtin_add_overflow(need, state_need, &need);
  if (overflow || (limit.known() && need > limit.room - memory_margin(need)))
    MOECORE_FAIL("train: the model has ", params, " parameters per rank (", mc.summary(), "); their fp32 values and ",
                 "gradients", compute ? ", compute copy" : "", " and optimizer state alone need ",
                 overflow ? "more than 2^63 bytes" : memory_format_bytes(need), " (plus a margin of ",
                 memory_format_bytes(overflow ? 0 : memory_margin(need)), "), more than the ", limit.describe(), "\n",
                 memory_hint(false));
}

// The CPU attention kernels' f32 copies of q, k, v and dq (kernels/attention_scratch.h): host memory the model's
// plan does not hold (its tensors only), as large as the activations themselves for small head dims. MLA's attention
// is not counted.
int64_t attention_scratch_bytes(const model::ModelConfig& mc, int64_t micro_batch, const model::ModelParallel& par) {
  const auto layers = model::layer_specs(mc);
  if (std::none_of(layers.begin(), layers.end(),
                   [](const model::LayerSpec& l) { return l.attention == model::AttentionKind::standard; }))
    return 0;
  const int64_t cp = std::max(1, par.cp.size()), tp = std::max(1, par.tp.size()), g = mc.query_groups();
  const ops::QkvDims q{micro_batch,   mc.seq_length / cp,        g / tp, mc.num_attention_heads / g,
                       mc.head_dim(), cp > 1 ? mc.seq_length : 0};
  return ops::attention_host_scratch_bytes(q);
}

// After the model is built, before the first step: the whole plan (activations and workspaces included). The
// constructor only reserves the activation buffers (the first step writes them), so the limit read before it
// still holds; the plan is printed with the refusal.
void check_plan_fits(const model::MemoryPlan& plan, const MemoryLimit& limit) {
  if (!limit.known() || plan.total() <= limit.room - memory_margin(plan.total())) return;
  MOECORE_FAIL("train: the run's memory plan needs ", memory_format_bytes(plan.total()), " (plus a margin of ",
               memory_format_bytes(memory_margin(plan.total())), "), more than the ", limit.describe(),
               "; nothing was trained.\n", plan.format(), memory_hint(true));
}

// --save, --tensorboard-dir and the folder of --metrics-jsonl must be writable before the first step, not at
// the first save after hours of training: each is created if missing (as Megatron does) and a probe file is
// written and removed.
void check_writable_dir(const char* flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) MOECORE_FAIL(flag, " ", dir, ": cannot create the directory: ", ec.message());
  const std::string probe =
      (std::filesystem::path(dir) / (".moecore-write-test-" + std::to_string(::getpid()))).string();
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  const bool ok = f && std::fputc('x', f) != EOF && std::fflush(f) == 0;
  const int err = errno;
  if (f) std::fclose(f);
  std::filesystem::remove(probe, ec);
  if (!ok) MOECORE_FAIL(flag, " ", dir, ": cannot write there: ", std::strerror(err));
}

// The outputs before the first step: the directories writable, --metrics-jsonl (appended to) none of the files the
// run reads (datasets, tokenizer files, the HF config). --save and --tensorboard-dir add new files only.
void check_output_paths(const Args& a, const train::TrainConfig& t) {
  if (!t.save.empty()) check_writable_dir("--save", t.save);
  if (!t.tensorboard_dir.empty()) check_writable_dir("--tensorboard-dir", t.tensorboard_dir);
  if (t.metrics_jsonl.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(t.metrics_jsonl).parent_path();
  check_writable_dir("--metrics-jsonl", parent.empty() ? "." : parent.string());
  std::vector<io::FlagPath> inputs;
  for (const std::string& prefix : a.list("--data-path"))  // (weights too: no file has a number's name)
    for (const char* ext : {".bin", ".idx"}) inputs.push_back({"--data-path", prefix + ext});
  for (const char* flag : {"--vocab-file", "--merge-file", "--tokenizer-model"}) inputs.push_back({flag, a.str(flag)});
  if (!a.str("--hf-config").empty())
    inputs.push_back({hf_config_flag(a), hf_config_path(a.str("--hf-config"), hf_config_flag(a))});
  io::check_output_file({"--metrics-jsonl", t.metrics_jsonl}, inputs);
}

// The data's sample indices hold every sample of the run, built up front as Megatron's: at least 24 bytes a sample
// (sample_index and shuffle_index). Counts no memory holds are refused here, naming the flags that give them, instead
// of a std::bad_alloc (or a count of epochs) from the dataset. The dataset checks again with its real sizes.
void check_sample_counts(const train::TrainConfig& t) {
  const int64_t evaluations = t.eval_interval > 0 ? t.train_iters / t.eval_interval + 1 : 1;
  const double ram = static_cast<double>(memory_physical_bytes()), limit = ram > 0 ? ram : 0x1p62;
  const auto check = [&](double samples, const std::string& product, const char* which, const char* lower) {
    const double bytes = 24.0 * samples;
    if (bytes <= limit) return;
    char count[32];
    std::snprintf(count, sizeof count, "%.4g", samples);
    MOECORE_FAIL(
        "train: ", product, " = ", count, " ", which, " samples, whose sample index (24 bytes a sample, built ",
        "before training as Megatron's) needs ",
        bytes < 0x1p62 ? memory_format_bytes(static_cast<int64_t>(bytes)) : std::string("more than 2^62 bytes"),
        ram > 0 ? ", more than this machine's " + memory_format_bytes(static_cast<int64_t>(ram)) : "", ": lower ",
        lower);
  };
  const std::string gbs = " x --global-batch-size " + std::to_string(t.global_batch_size);
  check(static_cast<double>(t.train_iters) * static_cast<double>(t.global_batch_size),
        "--train-iters " + std::to_string(t.train_iters) + gbs, "training", "--train-iters or --global-batch-size");
  check(static_cast<double>(evaluations) * static_cast<double>(t.eval_iters) * static_cast<double>(t.global_batch_size),
        "--eval-iters " + std::to_string(t.eval_iters) + gbs + " x " + std::to_string(evaluations) + " evaluation" +
            (evaluations == 1 ? "" : "s"),
        "validation", "--eval-iters or --global-batch-size, or evaluate less often (--eval-interval)");
}

// The closing lines of a run: what was trained, how long it took, where the validation loss went, and where
// the checkpoint and the metrics are.
void print_summary(std::FILE* out, const train::TrainLog& log, const train::TrainConfig& t, int64_t seq_length,
                   double seconds) {
  const auto steps = static_cast<int64_t>(log.train_loss.size());
  const double tokens = static_cast<double>(steps * t.global_batch_size * seq_length);
  std::fprintf(out,
               "\n---- summary ----\ntrained %lld steps (iterations %lld -> %lld%s%s): %.0f tokens in %.0f s "
               "(%.0f tokens/s)\n",
               static_cast<long long>(steps - log.skipped_steps), static_cast<long long>(log.first_iteration),
               static_cast<long long>(log.first_iteration + steps),
               log.skipped_steps > 0 ? (", " + std::to_string(log.skipped_steps) + " skipped: non-finite").c_str() : "",
               log.stopped_by_signal ? ", stopped by a signal" : "", tokens, seconds,
               seconds > 0 ? tokens / seconds : 0.0);
  if (!log.train_loss.empty())
    std::fprintf(out, "training loss %.4f (first step) -> %.4f (last step)\n", log.train_loss.front(),
                 log.train_loss.back());
  if (!log.valid_loss.empty())
    std::fprintf(out, "validation loss %.4f (iteration %lld) -> %.4f (iteration %lld)\n", log.valid_loss.front().second,
                 static_cast<long long>(log.valid_loss.front().first), log.valid_loss.back().second,
                 static_cast<long long>(log.valid_loss.back().first));
  if (!t.save.empty()) {
    const auto dir = io::checkpoint_find_latest(t.save);
    std::fprintf(out, "checkpoint: %s\n", dir ? dir->c_str() : "(none committed)");
  }
  if (!t.metrics_jsonl.empty()) std::fprintf(out, "metrics: %s\n", t.metrics_jsonl.c_str());
  if (!t.tensorboard_dir.empty()) std::fprintf(out, "TensorBoard: %s\n", t.tensorboard_dir.c_str());
  std::fflush(out);
}

}  // namespace

int train_main(int argc, char** argv) {
  Args a("train");
  model::ModelConfig defaults;
  defaults.num_layers = 4;
  defaults.hidden_size = 128;
  defaults.num_attention_heads = 4;
  defaults.vocab_size = 0;
  defaults.seq_length = 128;
  add_model_flags(a, defaults);
  add_tokenizer_flags(a);
  add_hf_config_flag(a);
  add_training_flags(a);
  if (!a.parse(argc, argv)) return 0;
  if (a.on("--overlap-param-gather") && !(a.on("--use-distributed-optimizer") && a.on("--overlap-grad-reduce")))
    MOECORE_FAIL("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron)");
  check_overlap_moe_expert_parallel_comm(a);
  if (!a.str("--load-hf").empty()) a.fill_unset("--hf-config", a.str("--load-hf"), " by --load-hf");
  hf_config_apply(a, hf_config_flag(a));
  if (!a.str("--hf-config").empty()) a.check_same_on_every_rank();  // the file's values too
  if (comm_initialized() && !comm_timeout_from_env()) {             // the variable, when set, overrides the flag
    CommOptions o = comm_options();
    o.timeout_s = 60.0 * static_cast<double>(a.i64("--distributed-timeout-minutes"));
    comm_set_options(o);
  }
  // Flags whose values name a feature moecore lacks fail before any data is read.
  const optim::AdamWConfig ocfg = optimizer_config_from(a);
  const moe::DispatcherKind dispatcher = moe::parse_dispatcher_kind(a.str("--moe-token-dispatcher-type"));
  const int world_size = comm_initialized() ? comm_world().size() : 1;
  const Device device = device_from_flag(a, world_size);
  const std::vector<std::string> data_path = a.list("--data-path");
  if (data_path.empty()) MOECORE_FAIL("train: --data-path is required (prefixes made by moecore preprocess)");
  const auto tok = tokenizer_from(a);
  const int64_t tp_size = a.i64("--tensor-model-parallel-size");
  // An explicit --vocab-size (an HF config's) needs to cover the tokenizer's ids, not its padding to 128 x TP.
  const model::ModelConfig mcfg = model_config_from(a, padded_vocab_size(*tok, a, tp_size), tok->vocab_size());
  // The layout over every process of the run (mpirun -np P): tensor parallel, context parallel, data parallel,
  // expert parallel (folded into data parallel for the attention layers) and expert data parallel. Validated before
  // any collective, so a bad layout fails the same way on every rank.
  // The experts are split over ETP, by default the TP size (Megatron's default), within the same ranks (Parallel
  // Folding). Pipeline stages hold their share of the decoder layers (Megatron's split, checked here on every rank).
  ParallelConfig pcfg;
  pcfg.tensor_model_parallel_size = static_cast<int>(tp_size);
  pcfg.pipeline_model_parallel_size = static_cast<int>(a.i64("--pipeline-model-parallel-size"));
  auto layers_flag = [&](const char* name) { return a.str(name).empty() ? int64_t{-1} : a.i64(name); };
  const std::string layout = a.str("--pipeline-model-parallel-layout");
  const int64_t first_layers = layers_flag("--decoder-first-pipeline-num-layers"),
                last_layers = layers_flag("--decoder-last-pipeline-num-layers");
  if (!layout.empty() && (first_layers >= 0 || last_layers >= 0))
    MOECORE_FAIL(
        "--pipeline-model-parallel-layout and --decoder-first/last-pipeline-num-layers exclude each other (as "
        "in Megatron)");
  const int64_t pp_size = pcfg.pipeline_model_parallel_size,
                vpp = virtual_pipeline_stages(a, mcfg.num_layers, pp_size, first_layers >= 0 || last_layers >= 0);
  const bool account_embedding = a.on("--account-for-embedding-in-pipeline-split"),
             account_loss = a.on("--account-for-loss-in-pipeline-split");
  if (!layout.empty() && (account_embedding || account_loss))
    MOECORE_FAIL(
        "--pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split exclude each other (the "
        "layout places E and L itself)");
  const std::vector<int64_t> stage_layers =
      layout.empty() ? model::pipeline_stage_layers(mcfg.num_layers, pp_size, first_layers, last_layers, vpp,
                                                    account_embedding, account_loss)
                     : model::pipeline_layout_stage_layers(layout, mcfg.num_layers, mcfg.mtp_num_layers, pp_size);
  if (!layout.empty() && vpp > 1 && static_cast<int64_t>(stage_layers.size()) != pp_size * vpp)
    MOECORE_FAIL("--pipeline-model-parallel-layout '", layout, "' has ", stage_layers.size() / pp_size,
                 " virtual stages per rank, the virtual pipeline flags ask for ", vpp);
  if (!a.str("--microbatch-group-size-per-virtual-pipeline-stage").empty() &&
      static_cast<int64_t>(stage_layers.size()) <= pp_size)
    MOECORE_FAIL(
        "--microbatch-group-size-per-virtual-pipeline-stage needs a virtual pipeline "
        "(--num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage or a layout with "
        "more stages than --pipeline-model-parallel-size)");
  pcfg.context_parallel_size = static_cast<int>(a.i64("--context-parallel-size"));
  pcfg.expert_model_parallel_size = static_cast<int>(a.i64("--expert-model-parallel-size"));
  pcfg.expert_tensor_parallel_size =
      a.str("--expert-tensor-parallel-size").empty() ? 0 : static_cast<int>(a.i64("--expert-tensor-parallel-size"));
  pcfg.num_distributed_optimizer_instances = static_cast<int>(a.i64("--num-distributed-optimizer-instances"));
  if (a.on("--use-tp-pp-dp-mapping")) pcfg.order = "tp-cp-ep-pp-dp";
  const ParallelSizes sizes = pcfg.validate(world_size, static_cast<int>(mcfg.moe.num_experts));
  moe::echo_check_layout(mcfg.moe, sizes.ep, sizes.etp, dispatcher);
  train::TrainConfig tcfg = train_config_from(a, sizes.dp);
  check_sample_counts(tcfg);  // before anything is sized by them (the data's indices, a pipeline's schedule)
  if (static_cast<int64_t>(stage_layers.size()) > pp_size && tcfg.micro_batches() % sizes.dp == 0)  // (validated)
    train::interleaved_one_f_one_b(
        tcfg.micro_batches() / sizes.dp, pp_size, 0,  // Megatron's conditions, checked now
        static_cast<int64_t>(stage_layers.size()) / pp_size,
        tcfg.microbatch_group_size_per_vp_stage > 0 ? tcfg.microbatch_group_size_per_vp_stage : pp_size);
  check_output_paths(a, tcfg);

  data::GptDataSourceConfig dcfg;
  dcfg.data_path = data_path;
  dcfg.split = a.str("--split");
  const auto n =
      data::gpt_split_num_samples(tcfg.train_iters, tcfg.global_batch_size, tcfg.eval_interval, tcfg.eval_iters);
  dcfg.num_samples[0] = n[0];
  dcfg.num_samples[1] = n[1];
  dcfg.num_samples[2] = 0;  // the test split is not used by training
  dcfg.dataset.seq_length = mcfg.seq_length;
  dcfg.dataset.seed = static_cast<uint32_t>(tcfg.seed);
  dcfg.dataset.pad_id = tok->pad();
  dcfg.dataset.eod_id = tok->eod();
  dcfg.dataset.eod_mask_loss = a.on("--eod-mask-loss");
  dcfg.dataset.vocab_size = mcfg.vocab_size;  // a token id outside the model's vocabulary is an Error naming it
  const data::GptDataSource source(dcfg);
  if (!source.train()) MOECORE_FAIL("train: --split ", dcfg.split, " leaves no training data");
  tcfg.has_validation = source.valid() != nullptr;

  train::TrainGroups groups;
  model::ModelParallel ep;
  ep.dispatcher = dispatcher;
  if (comm_initialized()) {
    const ProcessGroups pg = make_process_groups(pcfg, static_cast<int>(mcfg.moe.num_experts), comm_world());
    groups = train::train_groups(pg);
    ep = model::model_parallel(pg, false, ep.dispatcher,
                               pcfg.pipeline_model_parallel_size > 1 ? stage_layers : std::vector<int64_t>{});
  }
  ep.sequence_parallel = a.on("--sequence-parallel");
  const ProcessGroup& dp = groups.dp;
  if (ep.ep.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --expert-model-parallel-size ", ep.ep.size(),
                 " is not supported yet: upcycle at EP 1, save, and load the checkpoint at any EP");
  if (ep.tp.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --tensor-model-parallel-size ", ep.tp.size(),
                 " is not supported yet: upcycle at TP 1, save, and load the checkpoint at any TP");
  if (ep.pp.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --pipeline-model-parallel-size ", ep.pp.size(),
                 " is not supported yet: start at PP 1, save, and load the checkpoint at any PP");
  if (ep.etp.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --expert-tensor-parallel-size ", ep.etp.size(),
                 " is not supported yet: upcycle at ETP 1, save, and load the checkpoint at any ETP");
  std::FILE* out = comm_initialized() && comm_world().rank() != 0 ? nullptr : stdout;
  // The distributed optimizer shards the dense state over DP x CP and the experts' over EDP, within each of the
  // --num-distributed-optimizer-instances groups (each holds a whole copy).
  const int64_t state_shards =
      tcfg.use_distributed_optimizer
          ? std::max<int64_t>(1, std::min(sizes.dp * sizes.cp, sizes.edp) / tcfg.num_distributed_optimizer_instances)
          : 1;
  const MemoryLimit limit = device == Device::cuda ? MemoryLimit{} : node_memory_limit();  // (before the model exists)
  check_model_fits(mcfg, ep, ocfg.state_dtype, state_shards, limit);
  model::GptModel gpt(mcfg, tcfg.micro_batch_size, tcfg.seed, ep, device);
  optim::AdamW opt(gpt.params(), ocfg, /*allocate_state=*/!tcfg.use_distributed_optimizer);
  model::MemoryPlan plan = gpt.memory_plan(opt.state_bytes_per_param());
  int64_t& state_bytes = plan.bytes[static_cast<int>(MemCategory::optimizer_state)];
  state_bytes = (state_bytes + state_shards - 1) / state_shards;  // the distributed optimizer's shard
  if (device != Device::cuda)
    plan.bytes[static_cast<int>(MemCategory::workspace)] += attention_scratch_bytes(mcfg, tcfg.micro_batch_size, ep);
  if (tcfg.async_save && !tcfg.save.empty())  // the snapshot of --async-save (an upper bound: rank 0's share at most)
    plan.bytes[static_cast<int>(MemCategory::other)] +=
        train::async_save_snapshot_bytes(mcfg, ocfg.state_dtype, tcfg.save_optim);
  memory_set_plan(plan.format());  // quoted by an out-of-memory error
  check_plan_fits(plan, limit);    // before weights are loaded or a step is taken
  if (!a.str("--load-hf").empty()) {
    if (a.on("--moe-use-upcycling")) MOECORE_FAIL("--load-hf and --moe-use-upcycling exclude each other");
    const auto step = tcfg.ckpt_step >= 0 ? std::optional<int64_t>(tcfg.ckpt_step) : std::nullopt;
    if (tcfg.load.empty() || !io::checkpoint_find_latest(tcfg.load, step)) {
      const std::string dir = a.str("--load-hf");
      const model::HfWeightMap map =
          hf_config_weight_map(hf_config_load(a.str("--hf-config"), hf_config_flag(a)), mcfg);
      const io::HfCheckpointReader hf(dir);
      model::hf_check_tensors(map, hf);
      model::hf_import(map, hf, gpt);
      if (out)
        std::printf("moecore train: weights of %s (%s) loaded (--load-hf)\n", dir.c_str(),
                    model::hf_family_name(map.family));
    }
  }
  if (a.on("--moe-use-upcycling")) {
    upcycle_from_dense(gpt, a, tcfg);
    tcfg.load.clear();  // the run starts at iteration 0 from the upcycled weights, as in Megatron
  }
  tcfg.peak_gflops = train::gemm_peak_gflops(mcfg.compute_dtype, device);
  if (out)
    std::printf(
        "moecore train: %s\n  %lld parameters, tokenizer %s (vocab %lld, padded to %lld), GEMM peak %.1f "
        "GFLOP/s (%s)\n%s%s",
        mcfg.summary().c_str(), static_cast<long long>(gpt.num_parameters()), tok->name().c_str(),
        static_cast<long long>(tok->vocab_size()), static_cast<long long>(mcfg.vocab_size), tcfg.peak_gflops,
        device_name(device), source.summary().c_str(), plan.format().c_str());
  if (out && device == Device::cuda) {  // the model and its optimizer state are allocated by now: against the total
    int64_t free_bytes = 0, total_bytes = 0;
    const std::string dev = device_description(&free_bytes, &total_bytes);
    std::printf("  device memory: %s; the plan's %s is %.0f%% of the device's %s\n", dev.c_str(),
                memory_format_bytes(plan.total()).c_str(),
                total_bytes ? 100.0 * static_cast<double>(plan.total()) / static_cast<double>(total_bytes) : 0.0,
                memory_format_bytes(total_bytes).c_str());
  }
  const int64_t B = tcfg.micro_batch_size, S = mcfg.seq_length;
  std::vector<float> mask(static_cast<size_t>(S));
  const train::BatchFn batches = [&](Tensor& t, Tensor& l, bool valid, int64_t index) {
    const data::GptSampleSource* src = valid ? source.valid() : source.train();
    int32_t* tp = t.data<int32_t>();
    int32_t* lp = l.data<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = (index * B + b) % static_cast<int64_t>(src->size());
      src->get(i, tp + b * S, lp + b * S, mask.data());
      for (int64_t s = 0; s < S; ++s)
        if (mask[static_cast<size_t>(s)] == 0.0f) lp[b * S + s] = -1;
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  const train::TrainLog log = train::train(gpt, opt, tcfg, batches, out, {}, &groups);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (log.stopped_by_signal) {
    if (out) print_summary(out, log, tcfg, mcfg.seq_length, seconds);
    return 0;
  }
  const int64_t count = a.i64("--generate-tokens");
  // When experts are spread over ranks (EP, or ETP: the group of ETP x EP ranks holds one copy of every expert),
  // every rank takes part in the forward passes; otherwise the ranks of data-parallel rank 0 (every stage of a
  // pipeline, every TP and CP rank) do. Rank 0 prints.
  if (count > 0 && (dp.rank() == 0 || ep.etp_ep.size() > 1)) {
    const std::string prompt = a.str("--prompt");
    const auto ids =
        train::generate(gpt, prompt_tokens(*tok, prompt), count, 0.8f, tcfg.seed, tok->eod(), tok->vocab_size());
    if (out) std::printf("\n---- sample ----\n%s%s\n----------------\n", prompt.c_str(), tok->decode(ids).c_str());
  }
  if (out) print_summary(out, log, tcfg, mcfg.seq_length, seconds);
  return 0;
}

}  // namespace moecore::apps
