// The training run around the steps: the LR schedule (Megatron's formulas), resume from and crash-safe saves of
// checkpoints with Megatron's partial loads/saves (--finetune, --no-load-optim, ...), periodic validation, graceful
// stop on SIGTERM/SIGINT, Megatron-style log lines with MFU and ETA, and JSONL / TensorBoard metrics. Each step
// (step.h) runs a schedule's micro-batches (schedule.h) and reduces and applies the gradients through the optimizer's
// interface (optimizer.h). Not here: data sources (data/), the command line (apps/).
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "moecore/optim/muon.h"
#include "moecore/parallel/comm.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/grad_scaler.h"
#include "moecore/train/step_metrics.h"
#include "moecore/train/timers.h"
#include "moecore/train/train_groups.h"

namespace moecore::train {

// --nan-action skip drops a step with a non-finite loss or gradient; this many in a row stop the run with an Error
// (a model that only produces NaN does not recover by skipping, and must not report "trained" steps it never took).
inline constexpr int64_t kMaxConsecutiveSkippedSteps = 10;

// The training flags' enumerations, with their flag spellings (core/enum_names.h: enum_parse, enum_name). The
// spellings are also what checkpoints (state.json's opt_param_scheduler) and log lines hold.
enum class LrDecayStyle : uint8_t { constant, linear, cosine, wsd };             // --lr-decay-style
enum class WsdDecayStyle : uint8_t { exponential, linear, cosine, minus_sqrt };  // --lr-wsd-decay-style
enum class NanAction : uint8_t { stop, skip };                                   // --nan-action
enum class AsyncStrategy : uint8_t { nvrx, mcore };                              // --async-strategy
// --data-parallel-sharding-strategy under --use-megatron-fsdp (off: no --use-megatron-fsdp)
enum class FsdpStrategy : uint8_t { off, no_shard, optim, optim_grads, optim_grads_params };
inline constexpr EnumName<LrDecayStyle> kLrDecayStyleNames[] = {{LrDecayStyle::constant, "constant"},
                                                                {LrDecayStyle::linear, "linear"},
                                                                {LrDecayStyle::cosine, "cosine"},
                                                                {LrDecayStyle::wsd, "WSD"}};
inline constexpr EnumName<WsdDecayStyle> kWsdDecayStyleNames[] = {{WsdDecayStyle::exponential, "exponential"},
                                                                  {WsdDecayStyle::linear, "linear"},
                                                                  {WsdDecayStyle::cosine, "cosine"},
                                                                  {WsdDecayStyle::minus_sqrt, "minus_sqrt"}};
inline constexpr EnumName<NanAction> kNanActionNames[] = {{NanAction::stop, "stop"}, {NanAction::skip, "skip"}};
inline constexpr EnumName<AsyncStrategy> kAsyncStrategyNames[] = {{AsyncStrategy::nvrx, "nvrx"},
                                                                  {AsyncStrategy::mcore, "mcore"}};
constexpr std::span<const EnumName<LrDecayStyle>> enum_names(LrDecayStyle) {
  return kLrDecayStyleNames;
}
constexpr std::span<const EnumName<WsdDecayStyle>> enum_names(WsdDecayStyle) {
  return kWsdDecayStyleNames;
}
constexpr std::span<const EnumName<NanAction>> enum_names(NanAction) {
  return kNanActionNames;
}
constexpr std::span<const EnumName<AsyncStrategy>> enum_names(AsyncStrategy) {
  return kAsyncStrategyNames;
}
inline constexpr EnumName<FsdpStrategy> kFsdpStrategyNames[] = {
    {FsdpStrategy::off, "off"},
    {FsdpStrategy::no_shard, "no_shard"},
    {FsdpStrategy::optim, "optim"},
    {FsdpStrategy::optim_grads, "optim_grads"},
    {FsdpStrategy::optim_grads_params, "optim_grads_params"}};
constexpr std::span<const EnumName<FsdpStrategy>> enum_names(FsdpStrategy) {
  return kFsdpStrategyNames;
}

// The defaults are Megatron's (megatron/training/arguments.py); where Megatron has none (a required flag), they are
// `moecore train`'s, whose command line reads them from here (apps/train_flags.cpp), so the two never disagree. A
// field whose flag Megatron leaves None holds the value that stands for "unset" (said in its comment).
struct TrainConfig {
  int64_t micro_batch_size = 8;   // --micro-batch-size: sequences per forward/backward (Megatron: required)
  int64_t global_batch_size = 8;  // --global-batch-size: sequences per optimizer step (unset: micro_batch_size x dp)
  int64_t train_iters = 200;      // --train-iters: optimizer steps (Megatron: required)
  float lr = 3e-3f;               // --lr: peak learning rate (Megatron: required)
  float min_lr = 0.0f;            // --min-lr: floor of the decay
  double lr_warmup_iters =
      0;  // --lr-warmup-iters: linear warmup from 0 (fractional from --lr-warmup-fraction, as Megatron)
  LrDecayStyle lr_decay_style = LrDecayStyle::linear;  // --lr-decay-style: constant | linear | cosine | WSD
  int64_t lr_decay_iters = 0;                          // --lr-decay-iters: end of the decay (0: train_iters)
  int64_t lr_wsd_decay_iters = 0;                      // --lr-wsd-decay-iters: length of WSD's final decay phase
  WsdDecayStyle lr_wsd_decay_style = WsdDecayStyle::exponential;  // --lr-wsd-decay-style
  int64_t log_interval = 100;                                     // --log-interval: steps between log lines
  int64_t eval_interval = 0;                // --eval-interval: steps between validations (0: only at the end)
  int64_t eval_iters = 100;                 // --eval-iters: validation batches per evaluation
  bool has_validation = true;               // false when the data has no validation split (no evaluation)
  uint64_t seed = 1234;                     // --seed
  bool moe_per_layer_logging = false;       // --moe-per-layer-logging: a line per MoE layer at each log
  std::string save;                         // --save: checkpoint root ("" = no checkpoints)
  std::string load;                         // --load: checkpoint root or iteration directory to resume from
  int64_t ckpt_step = -1;                   // --ckpt-step: with --load, this iteration instead of the newest
                                            // (-1: the newest; a damaged newest is an Error, never skipped)
  int64_t save_interval = 0;                // --save-interval: steps between checkpoints (0: only at the end)
  int64_t exit_interval = 0;                // --exit-interval: stop (after saving) when the iteration is a multiple
  int keep_last = 0;                        // --keep-last-checkpoints: newest N kept (0: all)
  bool allow_other_models_in_save = false;  // --allow-other-models-in-save (checkpointing.h check_save_directory)
  // Megatron's asynchronous saves (async_save.h): the same files, written by a background worker while training goes
  // on from a snapshot in host memory, committed at a later step boundary; a save in flight is finished before train
  // returns. The snapshot doubles the checkpointed state's host memory (async_save_snapshot_bytes), while a save is in
  // flight, or with the persistent worker (which reuses its buffers) from the first save on.
  bool async_save = false;                  // --async-save
  bool use_persistent_ckpt_worker = false;  // --use-persistent-ckpt-worker: one writer thread for the run (else one
                                            // per save; Megatron disables --async-save without it, with a warning)
  AsyncStrategy async_strategy = AsyncStrategy::nvrx;  // --async-strategy: nvrx | mcore (Megatron's two writer
                                                       // implementations; both are moecore's one writer, the files
                                                       // are the same; mcore without async_save, as Megatron)
  bool async_ckpt_use_cpu_shm = false;  // --async-ckpt-use-cpu-shm: device tensors staged in host memory by the
                                        // training process before the hand-off; moecore's snapshot always is
  int async_ckpt_cpu_priority = 10;     // --async-ckpt-cpu-priority: the writer thread's nice value (only raised;
                                        // as Megatron, above 19 is 19 and below 0 leaves it), so that its CRC32C
                                        // and writes yield the cores to training
  std::string hf_config_json;  // --hf-config's config.json text, saved in checkpoints for `moecore convert --to-hf`
  // Megatron's partial saves and loads (checkpointing.h says what each part holds).
  bool save_optim = true;  // false: --no-save-optim (checkpoints without moments, step count, LR scheduler)
  bool save_rng = true;    // false: --no-save-rng (checkpoints without the router noise-stream positions)
  bool load_optim = true;  // false: --no-load-optim (fresh moments and step count; as in Megatron, whose
                           // scheduler is saved with the optimizer, the LR schedule restarts at the
                           // loaded iteration: warmup again)
  bool load_rng = true;    // false: --no-load-rng (router noise streams restart at 0, as in a fresh run)
  bool finetune = false;   // --finetune: load only the weights; iteration and consumed samples start at 0,
                           // no optimizer state, no rng state (whatever load_optim / load_rng say)
  bool override_opt_param_scheduler = false;        // --override-opt_param-scheduler: on load, this config's LR
                                                    // schedule wins over the checkpoint's, unchecked
  bool use_checkpoint_opt_param_scheduler = false;  // --use-checkpoint-opt_param-scheduler: on load, the
                                                    // checkpoint's LR schedule (lr, min_lr, warmup, decay end and
                                                    // style, WSD) replaces this config's; with neither flag they
                                                    // must match (Error naming the field otherwise)
  bool exit_signal_handler = false;                 // --exit-signal-handler: SIGTERM/SIGINT save a checkpoint and stop
  bool check_for_nan = true;                        // --check-for-nan-in-loss-and-grad
  NanAction nan_action = NanAction::stop;  // --nan-action: stop (raise an error) | skip (drop the step; the run stops
                                           // with an Error after kMaxConsecutiveSkippedSteps skipped in a row)
  std::string metrics_jsonl;               // --metrics-jsonl: one JSON object per logged iteration
  std::string tensorboard_dir;             // --tensorboard-dir: TensorBoard event files
  // Megatron's logging flags (what each adds to the log line and the metrics: RunLog in run_log.h; the timers:
  // timers.h). The metrics go to --metrics-jsonl and --tensorboard-dir alike, under Megatron's TensorBoard names.
  // --log-params-norm: " params norm: %.3f |" and params-norm, the L2 norm of the f32 parameters after the logged
  // step, each parameter counted once over the groups.
  bool log_params_norm = false;
  // --log-num-zeros-in-grad: " num zeros: %.1f |" and num-zeros, the zero elements of the logged step's gradients
  // after clipping, each counted once over the groups.
  bool log_num_zeros_in_grad = false;
  // --log-throughput: " throughput per GPU (TFLOP/s/GPU): %.1f |" (the run's model TFLOP/s over its ranks); with
  // log_timers_to_tensorboard also the metric throughput. The line's run TFLOP/s and tokens/s stay regardless.
  bool log_throughput = false;
  // --log-timers-to-tensorboard: the metrics iteration-time (s per step) and, at timing_log_level >= 1,
  // "<timer>-time" (the maximum over the ranks, s per step).
  bool log_timers_to_tensorboard = false;
  int timing_log_level = 0;  // --timing-log-level: 0 (the iteration time only) | 1 (and the timers that run once per
                             // step) | 2 (and those per micro-batch); at 1 and 2 a timers block follows each log line
  TimingLogOption timing_log_option = TimingLogOption::minmax;  // --timing-log-option: max | minmax | all (the
                                                                // block's statistic over the ranks)
  // --log-memory-to-tensorboard: the metrics mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes and
  // mem-allocated-count of the model's device (RunLog in run_log.h says what each counts).
  bool log_memory_to_tensorboard = false;
  // --logging-level (Python's levels: 10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR; nullopt: Megatron's None, INFO).
  // The trainer's output by level: as in Megatron, whose log line, validation and checkpoint notices are print()s,
  // those lines are never hidden (the iteration line, validation, checkpoints saved / loaded / absent, stops by signal
  // or --exit-interval); INFO (20): the timers block (Megatron's logger.info), the MoE per-layer lines, the
  // distributed optimizer's state size, the LR schedule's restart or replacement on a resume, the --finetune note
  // on a checkpoint of another model; WARNING (30): a skipped step (--nan-action skip), a resume with another
  // --seed. A level above 20 hides the INFO lines, above 30 the warnings too; Errors are never hidden. moecore has no
  // DEBUG output: 10 shows what 20 shows.
  std::optional<int> logging_level;
  double peak_gflops = 0;  // GEMM peak measured at start (0: no MFU on the log line)
  optim::OptimizerKind optimizer = optim::OptimizerKind::adam;  // --optimizer: adam (AdamW) or muon (Muon for the
                                                                // weight matrices, AdamW for the rest: optim/muon.h)
  optim::MuonConfig muon;                                       // --muon-*: with optimizer muon
  bool use_distributed_optimizer = false;  // --use-distributed-optimizer: ZeRO-1 over dp (experts: over edp)
  bool overlap_grad_reduce = false;   // --overlap-grad-reduce: each gradient bucket's all-reduce (with the distributed
                                      // optimizer: reduce-scatter) starts during backward
  bool overlap_param_gather = false;  // --overlap-param-gather (needs the two above): the distributed optimizer's
                                      // all-gathers stay in flight until forward reads each bucket
  int num_distributed_optimizer_instances = 1;  // --num-distributed-optimizer-instances: copies of the distributed
                                                // optimizer's state, each sharded over 1/N of dp x cp (experts: edp),
                                                // gradients all-reduced across them; N > 1 needs
                                                // use_distributed_optimizer and groups built with the same N
  // --use-megatron-fsdp with --data-parallel-sharding-strategy (Megatron-FSDP v1, which needs
  // use_distributed_optimizer; the flag sets it, as Megatron does): what is sharded over dp x cp (experts: edp) --
  // nothing (no_shard: plain data parallelism), the optimizer state (optim: the distributed optimizer), and the
  // gradients (optim_grads: reduce-scattered after each decoder layer's backward, every micro-batch), and the
  // parameters (optim_grads_params: each decoder layer's gathered before its forward and its backward, the next one's
  // prefetched). The embeddings, the final norm and the output layer stay whole (Megatron's non-unit parameters). off:
  // no FSDP.
  FsdpStrategy fsdp = FsdpStrategy::off;
  // --megatron-fsdp-main-grads-dtype and --megatron-fsdp-grad-comm-dtype (auto: the parameters' dtype, so bf16 under
  // --bf16, as Megatron): with optim_grads and optim_grads_params the gradients are reduce-scattered in the comm dtype
  // and accumulated in the main one over the micro-batches, then cast to f32 for the update. f32 or bf16; the other
  // strategies reduce f32.
  DType fsdp_main_grads_dtype = DType::f32;
  DType fsdp_grad_comm_dtype = DType::f32;
  // --megatron-fsdp-main-params-dtype (auto: the parameters' dtype, so bf16 under --bf16): with optim_grads and
  // optim_grads_params the main parameters AdamW updates live in each rank's shard in this dtype (f32, bf16 or f16;
  // each update computed in f32 and rounded) and are gathered in it; the model's values are them widened.
  DType fsdp_main_params_dtype = DType::f32;
  // --outer-dp-sharding-strategy, for hybrid sharding (num_distributed_optimizer_instances > 1): no_shard (HSDP: the
  // instances hold the same shards, their gradients all-reduced across them once per step) or optim (HFSDP, with
  // optim_grads_params only: the optimizer state and the update sharded over the instances too, the gradients
  // reduce-scattered across them and the updated masters gathered back).
  FsdpStrategy fsdp_outer = FsdpStrategy::no_shard;
  // The optimizer state sharded over the data-parallel ranks: the distributed optimizer, but for FSDP's no_shard.
  bool shards_optimizer_state() const { return use_distributed_optimizer && fsdp != FsdpStrategy::no_shard; }
  int64_t ddp_bucket_size = 40'000'000;  // --ddp-bucket-size: gradient elements per all-reduce / reduce-scatter
                                         // bucket
  int64_t microbatch_group_size_per_vp_stage = 0;  // --microbatch-group-size-per-virtual-pipeline-stage: the
                                                   // interleaved schedule's micro-batches in a row per model chunk
                                                   // (0: the pipeline size, Megatron's default)
  CkptStrictness ckpt_strictness = CkptStrictness::assume_ok_unexpected;  // --dist-ckpt-strictness (checkpointing.h)
  bool log_validation_ppl = false;  // --log-validation-ppl-to-tensorboard: "lm loss validation ppl" in TB and JSONL
  double exit_duration_mins = 0;    // --exit-duration-in-mins: save and stop once the run has trained this long (the
                                    // slowest rank's clock decides; 0: never)
  int64_t check_weight_hash_interval = 0;  // --check-weight-hash-across-dp-replicas-interval: compare the replicas'
                                           // parameter hashes every N steps (replica_check.h; 0: never)
  // Loss scaling (grad_scaler.h): Megatron's --fp16 without --loss-scale is the dynamic scaler, --loss-scale (with
  // --fp16 or --bf16) the constant one; none by default. A step whose gradients overflow is skipped whatever
  // --nan-action says (with the dynamic scaler Megatron's validation also switches check_for_nan off: overflows are
  // its signal). Its state is saved with the optimizer's (state.json "grad_scaler").
  GradScalerConfig grad_scaler;
  bool log_loss_scale_to_tensorboard = true;  // --no-log-loss-scale-to-tensorboard: no loss-scale metric
  // --calculate-per-token-loss: the loss heads' gradients are of their sums over the counted tokens, and after the
  // reduction every gradient is divided by the global batch's counted tokens (Megatron's finalize_model_grads); the
  // logged lm loss is the global batch's sum over its count. The MoE auxiliary losses keep their weight (Megatron's
  // router rule; gpt.h forward). Without it each micro-batch's mean loss is weighted alike.
  bool calculate_per_token_loss = false;
  void validate() const;
  int64_t micro_batches() const { return global_batch_size / micro_batch_size; }
  // Whether step `it` (0-based) ends a log interval: its line, its metrics and the logging flags' values.
  bool logs_step(int64_t it) const { return (it + 1) % log_interval == 0; }
  // Whether the trainer prints its lines of Python logging level `level` (see logging_level).
  bool logs_at(int level) const { return level >= logging_level.value_or(kLogInfo); }
  static constexpr int kLogInfo = 20, kLogWarning = 30;
};

// Learning rate at (0-based) schedule step `it`, Megatron's OptimizerParamScheduler formulas for these styles
// (warmup reaches lr at step lr_warmup_iters - 1; decay runs from the end of warmup to lr_decay_iters).
// The schedule step is the iteration, unless the schedule restarted (a load without the optimizer state).
float lr_at(const TrainConfig& cfg, int64_t it);

// Supplies micro-batch `index` of the training (valid=false) or validation split into tokens/labels [B, S].
using BatchFn = std::function<void(Tensor& tokens, Tensor& labels, bool valid, int64_t index)>;

struct TrainLog {
  int64_t first_iteration = 0;       // steps already done when this run started (resume)
  bool stopped_by_signal = false;    // SIGTERM/SIGINT arrived; a checkpoint was saved when --save is set
  bool stopped_by_time = false;      // --exit-duration-in-mins passed; a checkpoint was saved when --save is set
  int64_t skipped_steps = 0;         // steps dropped for non-finite loss or gradients (overflows included)
  std::vector<float> loss_scale;     // per step, the loss scale its gradients were taken with (1: none)
  std::vector<double> train_loss;    // per step, mean over its micro-batches
  std::vector<double> grad_norm;     // per step, before clipping
  std::vector<float> lr;             // per step, the learning rate (a skipped step's was not applied)
  std::vector<StepMetrics> metrics;  // per step: its MTP and MoE losses (step_metrics.h; value(key) is 0 for
                                     // a loss the model has none of)
  std::vector<double> params_norm;   // per step: with log_params_norm on the logged steps, NaN elsewhere
  std::vector<double> num_zeros;     // per step: with log_num_zeros_in_grad on the logged steps that were not
                                     // skipped, NaN elsewhere
  int64_t moe_retries = 0;           // steps run again on the synced dropless path (received-token capacity)
  std::vector<std::pair<int64_t, double>> valid_loss;  // (step, loss)
};

// Called after every step with its 0-based iteration (tests, tools).
using StepObserver = std::function<void(int64_t iteration, double loss, bool skipped)>;

// Runs (or resumes, with cfg.load) training until cfg.train_iters steps are done or a stop signal arrives.
// cfg.load: an absent or empty directory (no tracker, no iter_N) starts from scratch; otherwise the newest
// checkpoint (or cfg.ckpt_step's) must load, else Error naming the file and the reason and listing the
// committed alternatives (io/checkpoint.h). A failed save (ENOSPC, EIO) stops the run, as in Megatron: Error
// naming the file, the byte offset and the errno, and the iteration that stays the newest valid checkpoint;
// nothing is committed, and the in-memory state is untouched (a save only reads it).
// A resume reads the parts of the checkpoint that cfg's load switches select; with the optimizer state it
// resolves the saved LR schedule against cfg's (opt_param_scheduler_resolve in checkpointing.h) and continues
// with the result for the rest of the run (and writes it into the next checkpoints).
// With groups whose dp has P ranks, each rank runs its 1/P share of every global batch's micro-batches
// (rank r takes the r-th consecutive block), gradients are summed over dp / edp and router counts and
// losses over dp with deterministic collectives, the gradient norm counts every parameter once (expert
// shards summed over ep), the non-finite and stop decisions are agreed on, and checkpoints are written by
// the ranks that hold each part (see checkpointing.h). With a pipeline (groups->pp, the stages gpt was built for) each
// step runs the 1F1B schedule of this rank's stage (step.h), and the losses, the grad norm and every decision are
// reduced over the stages too.
TrainLog train(model::GptModel& gpt, optim::AdamW& opt, const TrainConfig& cfg, const BatchFn& batches, std::FILE* log,
               const StepObserver& observer = {}, const TrainGroups* groups = nullptr);

// The static received-token capacity's agreement: whether an MoE forward overflowed it on any rank since the last
// call (gpt.take_moe_overflow, reduced over the model's dp, tp, cp and pp groups: the world). Collective when the
// capacity is set; false without it.
bool moe_overflow_anywhere(model::GptModel& gpt);

// Mean validation loss over cfg.eval_iters batches; with a data-parallel group the batches are split over
// its ranks and the sums reduced (collective); on a pipeline stage (gpt built for PP > 1) each batch passes every
// stage, and every rank returns the loss. Over the static received-token capacity anywhere, the evaluation runs again
// on the synced dropless path.
double evaluate(model::GptModel& gpt, const TrainConfig& cfg, const BatchFn& batches, const ProcessGroup* dp = nullptr);

// Samples up to `count` tokens after `prompt` (temperature sampling, top-k 40) with the model's fixed
// sequence window, stopping at stop_token (e.g. the tokenizer's end-of-document; -1: never) once a quarter of
// `count` tokens exist; returns the new tokens without the stop token. Only ids below vocab_limit (the
// tokenizer's vocabulary; 0: the model's) are sampled: the rows Megatron pads the vocabulary with are no tokens.
// On a pipeline every stage calls it (collective over pp): the last samples, every stage returns the tokens.
// Non-finite logits are an Error on every stage (a model with NaN weights samples nothing).
std::vector<int32_t> generate(model::GptModel& gpt, const std::vector<int32_t>& prompt, int64_t count,
                              float temperature, uint64_t seed, int32_t stop_token = -1, int64_t vocab_limit = 0);

}  // namespace moecore::train
