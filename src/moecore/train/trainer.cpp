#include "moecore/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "moecore/core/rng.h"
#include "moecore/io/checkpoint.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/gemm_peak.h"
#include "moecore/train/replica_check.h"
#include "moecore/train/run_log.h"
#include "moecore/train/run_saves.h"
#include "moecore/train/signals.h"
#include "moecore/train/step.h"

namespace moecore::train {

void TrainConfig::validate() const {
  if (micro_batch_size <= 0 || global_batch_size <= 0 || global_batch_size % micro_batch_size != 0)
    MOECORE_FAIL("training: global_batch_size (", global_batch_size, ") must be a positive multiple of ",
                 "micro_batch_size (", micro_batch_size, ")");
  if (train_iters <= 0) MOECORE_FAIL("training: train_iters (", train_iters, ") must be positive");
  if (overlap_param_gather && (!use_distributed_optimizer || !overlap_grad_reduce))
    MOECORE_FAIL(
        "training: --overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in "
        "Megatron)");
  if (optimizer == optim::OptimizerKind::muon) {
    muon.validate();
    if (use_distributed_optimizer && num_distributed_optimizer_instances != 1)  // (Megatron's layer-wise assertion)
      MOECORE_FAIL("training: the layer-wise distributed optimizer of --optimizer muon needs ",
                   "--num-distributed-optimizer-instances 1, got ", num_distributed_optimizer_instances);
    if (overlap_param_gather)
      MOECORE_FAIL("training: --overlap-param-gather with --optimizer muon is not supported yet (the layer-wise ",
                   "distributed optimizer's parameter broadcasts run after the step); leave it out");
  }
  if (fsdp != FsdpStrategy::off) {  // (Megatron's validate_args for Megatron-FSDP v1)
    if (!use_distributed_optimizer)
      MOECORE_FAIL("training: Megatron-FSDP v1 is only compatible with --use-distributed-optimizer (set with ",
                   "--use-megatron-fsdp)");
    if (optimizer != optim::OptimizerKind::adam)
      MOECORE_FAIL("training: Megatron-FSDP does not support the ", enum_name(optimizer),
                   " optimizer yet (--use-megatron-fsdp needs --optimizer adam)");
    for (DType t : {fsdp_main_grads_dtype, fsdp_grad_comm_dtype})
      if ((t != DType::f32 && t != DType::bf16) ||
          (t == DType::bf16 && fsdp != FsdpStrategy::optim_grads && fsdp != FsdpStrategy::optim_grads_params))
        MOECORE_FAIL("training: Megatron-FSDP's gradients in ", dtype_name(t), " are not supported with ",
                     "--data-parallel-sharding-strategy ", enum_name(fsdp),
                     " (its no_shard and optim reduce f32 gradients, optim_grads and optim_grads_params f32 or bf16); ",
                     "pass --megatron-fsdp-main-grads-dtype fp32 --megatron-fsdp-grad-comm-dtype fp32");
    if (fsdp_main_params_dtype != DType::f32 &&
        ((fsdp != FsdpStrategy::optim_grads && fsdp != FsdpStrategy::optim_grads_params) ||
         !dtype_is_float(fsdp_main_params_dtype)))
      MOECORE_FAIL("training: Megatron-FSDP's main parameters in ", dtype_name(fsdp_main_params_dtype),
                   " are not supported with --data-parallel-sharding-strategy ", enum_name(fsdp),
                   " (moecore's no_shard and optim update the f32 parameters themselves; optim_grads and ",
                   "optim_grads_params keep fp32, bf16 or fp16 main parameters in the shards); pass ",
                   "--megatron-fsdp-main-params-dtype fp32");
    if (fsdp_outer != FsdpStrategy::no_shard &&
        (fsdp_outer != FsdpStrategy::optim || fsdp != FsdpStrategy::optim_grads_params))
      MOECORE_FAIL("training: --outer-dp-sharding-strategy ", enum_name(fsdp_outer), " with ",
                   "--data-parallel-sharding-strategy ", enum_name(fsdp),
                   ": the outer strategy is no_shard, or optim with optim_grads_params (Megatron's check)");
    if (fsdp == FsdpStrategy::optim_grads_params && check_weight_hash_interval > 0)
      MOECORE_FAIL("training: --check-weight-hash-across-dp-replicas-interval is not supported with ",
                   "--data-parallel-sharding-strategy optim_grads_params (the parameters are sharded, as in Megatron)");
  }
  if (num_distributed_optimizer_instances < 1)
    MOECORE_FAIL("training: --num-distributed-optimizer-instances (", num_distributed_optimizer_instances,
                 ") must be >= 1");
  if (num_distributed_optimizer_instances > 1 && !use_distributed_optimizer)  // Megatron's DDP assertion, quoted
    MOECORE_FAIL("training: Partial DistOpt cannot be used without DistOpt: --num-distributed-optimizer-instances (",
                 num_distributed_optimizer_instances, ") > 1 needs --use-distributed-optimizer");
  if (lr_decay_style == LrDecayStyle::wsd && lr_wsd_decay_iters <= 0)
    MOECORE_FAIL("--lr-decay-style WSD needs --lr-wsd-decay-iters > 0");
  if (lr_decay_iters < 0) MOECORE_FAIL("--lr-decay-iters (", lr_decay_iters, ") must not be negative");
  if (!(lr >= 0) || !(min_lr >= 0) || min_lr > lr)
    MOECORE_FAIL("training: need 0 <= min_lr (", min_lr, ") <= lr (", lr, ")");
  if (log_interval <= 0 || eval_iters <= 0 || eval_interval < 0 ||
      !(lr_warmup_iters >= 0 && std::isfinite(lr_warmup_iters)))
    MOECORE_FAIL("training: log_interval (", log_interval, ") and eval_iters (", eval_iters,
                 ") must be positive; eval_interval (", eval_interval, ") and lr_warmup_iters (", lr_warmup_iters,
                 ") must not be negative");
  if (save_interval < 0 || keep_last < 0)
    MOECORE_FAIL("--save-interval (", save_interval, ") and --keep-last-checkpoints (", keep_last,
                 ") must not be negative");
  // (--save-interval without --save is accepted as Megatron does: nothing is saved)
  if (check_weight_hash_interval < 0)
    MOECORE_FAIL("--check-weight-hash-across-dp-replicas-interval (", check_weight_hash_interval,
                 ") must not be negative");
  if (!(exit_duration_mins >= 0 && std::isfinite(exit_duration_mins)))
    MOECORE_FAIL("--exit-duration-in-mins (", exit_duration_mins, ") must be a non-negative number of minutes");
  if (exit_interval < 0) MOECORE_FAIL("--exit-interval (", exit_interval, ") must not be negative");
  if (ckpt_step < -1) MOECORE_FAIL("--ckpt-step (", ckpt_step, ") must not be negative");
  if (ckpt_step >= 0 && load.empty())
    MOECORE_FAIL("--ckpt-step (", ckpt_step, ") needs --load DIR: it picks which iteration of DIR to load");
  if (timing_log_level < 0 || timing_log_level > 2)
    MOECORE_FAIL("--timing-log-level ", timing_log_level, " is not one of 0, 1, 2");
  if (logging_level && *logging_level < 0)
    MOECORE_FAIL("--logging-level ", *logging_level, " must not be negative (Python's levels: 10 DEBUG, 20 INFO, ",
                 "30 WARNING, 40 ERROR)");
  if (override_opt_param_scheduler && use_checkpoint_opt_param_scheduler)
    MOECORE_FAIL("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other ",
                 "(both override and use-checkpoint are set): keep the command line's LR schedule or the checkpoint's");
  grad_scaler.validate();
}

float lr_at(const TrainConfig& c, int64_t it) {
  if (c.lr_warmup_iters > 0 && static_cast<double>(it + 1) <= c.lr_warmup_iters)
    return c.lr * static_cast<float>(it + 1) / static_cast<float>(c.lr_warmup_iters);
  if (c.lr_decay_style == LrDecayStyle::constant) return c.lr;
  const int64_t end = c.lr_decay_iters > 0 ? c.lr_decay_iters : c.train_iters;
  if (it >= end) return c.min_lr;
  double coeff;
  if (c.lr_decay_style == LrDecayStyle::wsd) {
    const int64_t anneal_start = end - c.lr_wsd_decay_iters;
    if (it < anneal_start) return c.lr;
    const double r =
        static_cast<double>(it - anneal_start) / static_cast<double>(std::max<int64_t>(c.lr_wsd_decay_iters, 1));
    switch (c.lr_wsd_decay_style) {
      case WsdDecayStyle::linear:
        coeff = 1.0 - r;
        break;
      case WsdDecayStyle::cosine:
        coeff = 0.5 * (std::cos(M_PI * r) + 1.0);
        break;
      case WsdDecayStyle::minus_sqrt:
        coeff = 1.0 - std::sqrt(r);
        break;
      case WsdDecayStyle::exponential:
      default:
        coeff = 2.0 * std::pow(0.5, r) - 1.0;
        break;
    }
  } else {
    // (a fractional warm-up from --lr-warmup-fraction: the decay starts at the first step past it)
    const double decay_steps = std::max(static_cast<double>(end) - c.lr_warmup_iters, 1.0);
    const double r = std::max(static_cast<double>(it) - c.lr_warmup_iters, 0.0) / decay_steps;
    coeff = c.lr_decay_style == LrDecayStyle::linear ? 1.0 - r : 0.5 * (std::cos(M_PI * r) + 1.0);
  }
  return static_cast<float>(c.min_lr + coeff * (c.lr - c.min_lr));
}

namespace {
double evaluate_once(model::GptModel& gpt, const TrainConfig& cfg, const BatchFn& batches, const ProcessGroup* dp) {
  const ProcessGroup& pp = gpt.parallel().pp;
  const auto& m = gpt.config();
  Tensor tokens = Tensor::empty({gpt.micro_batch_size(), m.seq_length}, DType::i32, MemCategory::workspace);
  Tensor labels = Tensor::empty({gpt.micro_batch_size(), m.seq_length}, DType::i32, MemCategory::workspace);
  const int64_t P = dp ? dp->size() : 1, r = dp ? dp->rank() : 0;
  // Rank r takes batches r, r + P, ...; every rank runs the same number of forwards (the EP dispatchers
  // communicate in each), the surplus ones uncounted.
  const int64_t rounds = (cfg.eval_iters + P - 1) / P;
  double sums[2] = {0, 0};  // loss sum, counted tokens
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t i = k * P + r;
    batches(tokens, labels, true, std::min(i, cfg.eval_iters - 1));
    const auto res = gpt.evaluate(tokens, labels);  // (through every pipeline stage)
    if (i >= cfg.eval_iters) continue;
    sums[0] += res.loss_sum;  // (the last stage's; zeros on the others)
    sums[1] += static_cast<double>(res.tokens);
  }
  if (P > 1) all_reduce_sum(std::span<double>(sums, 2), *dp);
  if (pp.size() > 1) all_reduce_sum(std::span<double>(sums, 2), pp);
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}
}  // namespace

bool moe_overflow_anywhere(model::GptModel& gpt) {
  if (!gpt.moe_static_capacity()) return false;
  int64_t flag = gpt.take_moe_overflow() ? 1 : 0;
  const model::ModelParallel& par = gpt.parallel();
  for (const ProcessGroup* g : {&par.dp, &par.tp, &par.cp, &par.pp})
    if (g->size() > 1) all_reduce_sum(std::span<int64_t>(&flag, 1), *g);
  return flag > 0;
}

double evaluate(model::GptModel& gpt, const TrainConfig& cfg, const BatchFn& batches, const ProcessGroup* dp) {
  (void)gpt.take_moe_overflow();
  for (;;) {
    const double loss = evaluate_once(gpt, cfg, batches, dp);
    if (!moe_overflow_anywhere(gpt)) return loss;
    MOECORE_CHECK(!gpt.moe_synced_dropless(), "evaluate: the synced dropless path overflowed");
    gpt.set_moe_synced_dropless(true);
  }
}

namespace {

OptParamSchedulerState opt_param_scheduler_of(const TrainConfig& c, int64_t num_steps) {
  return {c.lr,
          c.min_lr,
          c.lr_warmup_iters,
          c.lr_decay_iters > 0 ? c.lr_decay_iters : c.train_iters,
          enum_name(c.lr_decay_style),
          c.lr_wsd_decay_iters,
          enum_name(c.lr_wsd_decay_style),
          num_steps};
}

// After a load: settles the LR schedule the run continues with (written into cfg) and returns the iteration at
// which its step 0 falls (lr_at(cfg, it - start)).
int64_t lr_schedule_resume(TrainConfig& cfg, const LoadedTrainingState& loaded, const std::string& dir,
                           std::FILE* log) {
  const int64_t it = loaded.progress.iteration;
  if (!loaded.optimizer_loaded) {  // Megatron's scheduler is saved and loaded with the optimizer: it restarts
    if (it > 0 && log && cfg.logs_at(TrainConfig::kLogInfo))
      std::fprintf(log, " optimizer state not loaded: fresh moments; the LR schedule restarts at iteration %lld\n",
                   static_cast<long long>(it));
    return it;
  }
  if (!loaded.scheduler) return 0;  // saved before the scheduler state was: nothing to check, step = iteration
  const OptParamSchedulerState s =
      opt_param_scheduler_resolve(opt_param_scheduler_of(cfg, it), *loaded.scheduler, it,
                                  cfg.override_opt_param_scheduler, cfg.use_checkpoint_opt_param_scheduler, dir);
  cfg.lr = s.max_lr;
  cfg.min_lr = s.min_lr;
  cfg.lr_warmup_iters = s.lr_warmup_steps;
  cfg.lr_decay_iters = s.lr_decay_steps;
  // (the file's spellings: a name no moecore writes is an Error naming the key, the value and the accepted ones)
  cfg.lr_decay_style =
      enum_parse<LrDecayStyle>(s.lr_decay_style, "the checkpoint's opt_param_scheduler lr_decay_style");
  cfg.lr_wsd_decay_iters = s.wsd_decay_steps;
  cfg.lr_wsd_decay_style =
      enum_parse<WsdDecayStyle>(s.lr_wsd_decay_style, "the checkpoint's opt_param_scheduler lr_wsd_decay_style");
  cfg.validate();
  if (log && cfg.use_checkpoint_opt_param_scheduler && cfg.logs_at(TrainConfig::kLogInfo))
    std::fprintf(log, " using the checkpoint's LR schedule: lr %.3e, min lr %.3e, warmup %g, %s decay to %lld\n",
                 static_cast<double>(cfg.lr), static_cast<double>(cfg.min_lr), cfg.lr_warmup_iters,
                 enum_name(cfg.lr_decay_style), static_cast<long long>(cfg.lr_decay_iters));
  return it - s.num_steps;
}
}  // namespace

namespace {
// The partial distributed optimizer's groups must be built for the config's N (ParallelConfig's
// num_distributed_optimizer_instances); Megatron's divisibility assertions are quoted when the sizes allow no N.
void check_instances(const TrainGroups& g, int n) {
  if (n == 1) return;
  const int dense = g.dense_grads().size(), expert = g.edp.size();
  if (dense % n != 0)
    MOECORE_FAIL(
        "training: Data parallel size should be divisible by partial DistOpt shard factor: data-parallel size "
        "x context-parallel size (",
        dense, ") must be divisible by --num-distributed-optimizer-instances (", n, ")");
  if (expert % n != 0)
    MOECORE_FAIL(
        "training: Expert data parallel size should be divisible by partial DistOpt shard factor: expert "
        "data-parallel size (",
        expert, ") must be divisible by --num-distributed-optimizer-instances (", n, ")");
  if (g.inter_dist_opt.size() != n || g.intra_dp_cp.size() * n != dense || g.intra_edp.size() * n != expert)
    MOECORE_FAIL("training: --num-distributed-optimizer-instances is ", n, " but the process groups were built for ",
                 g.inter_dist_opt.size(), " instance(s) (inter_dist_opt ", g.inter_dist_opt.size(),
                 " ranks, intra_dp_cp ", g.intra_dp_cp.size(), " of ", dense, ", intra_edp ", g.intra_edp.size(),
                 " of ", expert, "); set ParallelConfig::num_distributed_optimizer_instances to the same value");
}

// The layout gpt was built for must be the groups': every size, and the expert groups folding into the others.
void check_groups(const model::GptModel& gpt, const TrainGroups& g, const TrainConfig& cfg) {
  auto same = [](int64_t model, const ProcessGroup& group, const char* what) {
    if (model != group.size())
      MOECORE_FAIL("training: the model was built for ", what, " size ", model, " but the ", group.name(),
                   " group has ", group.size(), " ranks");
  };
  same(gpt.ep_size(), g.ep, "expert-parallel");
  same(gpt.tp_size(), g.tp, "tensor-parallel");
  same(gpt.cp_size(), g.cp, "context-parallel");
  if (g.cp.size() > 1 && g.dp_cp.size() != g.dp.size() * g.cp.size())
    MOECORE_FAIL("training: the dp_cp group has ", g.dp_cp.size(), " ranks, not data-parallel (", g.dp.size(),
                 ") x context-parallel (", g.cp.size(), ")");
  same(gpt.etp_size(), g.etp, "expert-tensor-parallel");
  same(gpt.parallel().pp.size(), g.pp, "pipeline-parallel");
  if (g.etp.size() > 1 && g.etp_ep.size() != g.etp.size() * g.ep.size())
    MOECORE_FAIL("training: the etp_ep group has ", g.etp_ep.size(), " ranks, not expert-tensor-parallel (",
                 g.etp.size(), ") x expert-parallel (", g.ep.size(), ")");
  if (g.etp.size() * g.ep.size() * g.edp.size() != g.stage_size())
    MOECORE_FAIL("training: expert-tensor-parallel (", g.etp.size(), ") x expert-parallel (", g.ep.size(),
                 ") x expert-data-parallel (", g.edp.size(), ") must equal tensor-parallel (", g.tp.size(),
                 ") x context-parallel (", g.cp.size(), ") x data-parallel (", g.dp.size(),
                 ") within a pipeline stage");
  check_instances(g, cfg.num_distributed_optimizer_instances);
  if (gpt.micro_batch_size() != cfg.micro_batch_size)
    MOECORE_FAIL("training: the model was built for micro-batch ", gpt.micro_batch_size(), ", not ",
                 cfg.micro_batch_size);
}

// Where a run starts: from scratch, or from the checkpoint cfg.load names (cfg's LR schedule then settled against the
// saved one).
struct RunStart {
  TrainProgress progress;
  int64_t schedule_start = 0;  // the iteration at which the LR schedule's step 0 falls
};
// Every rank resumes from the same iteration. Megatron reduces the tracker's iteration over the ranks; here a
// disagreement (a stale tracker or a missing directory on one node's view of --load) is an Error on every rank,
// before any rank loads, naming each rank's host and what it found. Collective over every rank of the run (the stage,
// then the pipeline). `found`: this rank's iteration, -1 for none; `error` (when not empty): why it found nothing.
void agree_on_resume_iteration(const TrainConfig& cfg, int64_t found, const std::string& error, const TrainGroups& g) {
  const ProcessGroup& stage = g.tp.size() > 1 || g.cp.size() > 1 ? g.tp_dp : g.dp;
  if (stage.size() * g.pp.size() == 1) {
    if (!error.empty()) throw Error(error);
    return;
  }
  constexpr int kHostWords = 8, kFields = 2 + kHostWords;  // {world rank, iteration (-2: failed), host name}
  std::vector<int64_t> mine(kFields, 0);
  mine[0] = comm_initialized() ? comm_world().rank() : 0;
  mine[1] = error.empty() ? found : -2;
  char host[kHostWords * 8] = {};
  ::gethostname(host, sizeof host - 1);
  std::memcpy(mine.data() + 2, host, sizeof host);
  std::vector<int64_t> in_stage(static_cast<size_t>(kFields * stage.size()));
  all_gather(std::span<int64_t>(in_stage), std::span<const int64_t>(mine), stage);
  std::vector<int64_t> all(in_stage.size() * static_cast<size_t>(g.pp.size()));
  all_gather(std::span<int64_t>(all), std::span<const int64_t>(in_stage), g.pp);
  bool agree = true;
  for (size_t r = 0; r < all.size(); r += kFields) agree = agree && all[r + 1] == all[1] && all[r + 1] != -2;
  if (agree) return;
  std::string ranks;
  for (size_t r = 0; r < all.size(); r += kFields) {
    char name[kHostWords * 8 + 1] = {};
    std::memcpy(name, all.data() + r + 2, kHostWords * 8);
    const int64_t it = all[r + 1];
    ranks += "\n  rank " + std::to_string(all[r]) + " (host " + name + "): " +
             (it >= 0    ? "iteration " + std::to_string(it) + " (" + io::checkpoint_iteration_dir(cfg.load, it) + ")"
              : it == -1 ? std::string("no checkpoint")
                         : std::string("could not read its checkpoint") + (all[r] == mine[0] ? ": " + error : ""));
  }
  MOECORE_FAIL("the ranks do not agree on the checkpoint to resume from under --load ", cfg.load, ":", ranks,
               "\nhint: every rank must see the same --load directory (a stale copy of ", io::kCheckpointTrackerFile,
               " on one node?); fix it, or pick one iteration for all with --ckpt-step N");
}

// The dynamic loss scaler's state from a load (Megatron's Float16Optimizer.load_state_dict, its warnings).
void resume_grad_scaler(GradScaler& scaler, const TrainConfig& cfg, const LoadedTrainingState& loaded,
                        const std::string& dir, std::FILE* log) {
  if (!loaded.optimizer_loaded) return;
  const bool warn = log && cfg.logs_at(TrainConfig::kLogWarning);
  if (scaler.dynamic() && loaded.grad_scaler) {
    scaler.load(*loaded.grad_scaler, (dir + "/state.json").c_str());
  } else if (scaler.dynamic() && warn) {
    std::fprintf(log,
                 " warning: %s holds no loss scaler state (saved without --fp16's dynamic loss scaling): the "
                 "loss scale starts at --initial-loss-scale %g\n",
                 dir.c_str(), static_cast<double>(scaler.scale()));
  } else if (loaded.grad_scaler && warn) {
    std::fprintf(log,
                 " warning: %s holds a dynamic loss scaler's state (scale %g) but this run has none (no --fp16 "
                 "without --loss-scale): not loaded\n",
                 dir.c_str(), static_cast<double>(loaded.grad_scaler->scale));
  }
}

RunStart resume(TrainConfig& cfg, Optimizer& opt, GradScaler& scaler, const TrainGroups& groups, std::FILE* log) {
  RunStart start;
  if (cfg.load.empty()) return start;
  // As in Megatron, an empty --load directory starts from scratch, so one command serves the first launch
  // and every restart; a directory holding a damaged newest checkpoint is an Error (checkpoint_find_latest).
  std::optional<std::string> dir;
  int64_t iteration = -1;
  std::string error;
  try {
    dir =
        io::checkpoint_find_latest(cfg.load, cfg.ckpt_step >= 0 ? std::optional<int64_t>(cfg.ckpt_step) : std::nullopt);
    if (dir) iteration = io::checkpoint_iteration_of(*dir);
  } catch (const Error& e) {
    error = e.what();
  }
  agree_on_resume_iteration(cfg, iteration, error, groups);
  if (!dir) {
    if (log) std::fprintf(log, " no committed checkpoint under --load %s: training from scratch\n", cfg.load.c_str());
    return start;
  }
  const LoadedTrainingState loaded =
      opt.load(*dir, cfg.seed,
               {cfg.load_optim, cfg.load_rng, cfg.finetune, cfg.ckpt_strictness, cfg.logs_at(TrainConfig::kLogInfo),
                cfg.logs_at(TrainConfig::kLogWarning)});
  start.progress = loaded.progress;
  if (log)
    std::fprintf(log, " loaded checkpoint %s at iteration %lld%s%s%s\n", dir->c_str(),
                 static_cast<long long>(start.progress.iteration), cfg.finetune ? " (--finetune: weights only)" : "",
                 !cfg.finetune && !loaded.optimizer_loaded ? " without the optimizer state" : "",
                 !cfg.finetune && !loaded.rng_loaded ? " without the rng state" : "");
  start.schedule_start = lr_schedule_resume(cfg, loaded, *dir, log);
  resume_grad_scaler(scaler, cfg, loaded, *dir, log);
  return start;
}

// Why the run stops early, agreed by every rank (every rank stops at the same step, or the others would wait in a
// collective): a stop signal arrived on any rank, or --exit-duration-in-mins passed on any rank's clock (Megatron's
// checkpoint_and_decide_exit: the MAX over the ranks).
struct StopRequest {
  bool signal = false, time = false;
};
StopRequest stop_requested(const ExitSignalGuard* signals, bool past_duration, const TrainGroups& g) {
  int64_t flags[2] = {signals && ExitSignalGuard::requested() ? 1 : 0, past_duration ? 1 : 0};
  if (g.world_size() > 1)
    for (const ProcessGroup* grp : {&g.dp, &g.tp, &g.cp, &g.pp})
      if (grp->size() > 1) all_reduce_sum(std::span<int64_t>(flags, 2), *grp);
  return {flags[0] > 0, flags[1] > 0};
}
}  // namespace

TrainLog train(model::GptModel& gpt, optim::AdamW& adamw, const TrainConfig& config, const BatchFn& batches,
               std::FILE* log, const StepObserver& observer, const TrainGroups* groups_in) {
  config.validate();
  TrainConfig cfg = config;  // the LR schedule may come from the checkpoint (--use-checkpoint-opt_param-scheduler)
  const TrainGroups groups = groups_in ? *groups_in : TrainGroups{};
  check_groups(gpt, groups, cfg);
  Timers timers(cfg.timing_log_level, gpt.device());
  const std::unique_ptr<Optimizer> opt = make_optimizer(gpt, adamw, cfg, groups, &timers);
  if (cfg.optimizer == optim::OptimizerKind::muon && log && cfg.logs_at(TrainConfig::kLogInfo)) {
    int64_t matrices = 0;
    for (const Param& p : gpt.params())
      if (optim::muon_managed(p.name, p.value.dim(), p.expert_parallel)) matrices += p.value.numel();
    const optim::MuonConfig& m = cfg.muon;
    std::fprintf(
        log,
        " optimizer: Muon for %.1f%% of the parameters (momentum %g%s, %s x %d Newton-Schulz steps in %s, "
        "%s scale x %g, TP %s), %s for the rest\n",
        100.0 * static_cast<double>(matrices) / static_cast<double>(std::max<int64_t>(1, gpt.num_parameters())),
        m.momentum, m.nesterov ? " Nesterov" : "", enum_name(m.coefficient_type), m.num_ns_steps,
        m.fp32_matmul_prec == optim::MuonMatmulPrecision::medium ? "bf16" : "f32", enum_name(m.scale_mode),
        m.extra_scale_factor, enum_name(m.tp_mode),
        m.scalar_optimizer == optim::ScalarOptimizer::lion ? "Lion" : "AdamW");
  }
  if (cfg.shards_optimizer_state() && log && cfg.logs_at(TrainConfig::kLogInfo)) {
    const auto per_element = optimizer_state_bytes(cfg, adamw.config());
    int64_t unsharded = 0;
    for (const Param& p : gpt.params()) unsharded += per_element(p) * p.value.numel();
    std::fprintf(log, " distributed optimizer: %s of optimizer state on this rank (%s unsharded)\n",
                 memory_format_bytes(opt->state_bytes()).c_str(), memory_format_bytes(unsharded).c_str());
  }
  // --overlap-param-gather: forward waits for the parameters it reads; Megatron-FSDP: the passes gather and release
  // the units' parameters and gradients. The hooks are never left behind, and the model is left whole.
  struct HookGuard {
    model::GptModel& m;
    ~HookGuard() {
      m.set_params_needed({});
      m.set_params_released({});
      m.set_grads_needed({});
    }
  } hook_guard{gpt};
  if (opt->gathers_params_later() || opt->follows_units())
    gpt.set_params_needed([&](size_t a, size_t b) { opt->params_needed(a, b); });
  if (opt->follows_units()) {
    gpt.set_params_released([&](size_t a, size_t b) { opt->params_released(a, b); });
    gpt.set_grads_needed([&](size_t a, size_t b) { opt->grads_needed(a, b); });
  }
  GradScaler scaler(cfg.grad_scaler);
  TrainStep step(gpt, *opt, cfg, groups, batches, scaler, &timers);
  if (!cfg.save.empty() && !cfg.allow_other_models_in_save) check_save_directory(cfg.save, gpt.config());
  RunStart start = resume(cfg, *opt, scaler, groups, log);
  TrainProgress& progress = start.progress;
  std::unique_ptr<ExitSignalGuard> signals;
  if (cfg.exit_signal_handler) signals = std::make_unique<ExitSignalGuard>();
  RunLog run_log(gpt, cfg, groups, progress.iteration, log, &timers);
  TrainLog out;
  out.first_iteration = progress.iteration;
  int64_t consecutive_skips = 0;
  RunSaves saves(cfg, *opt, log);
  const auto save = [&] {  // the LR schedule's and the loss scaler's state go into the checkpoint with the optimizer's
    saves.save(progress, opt_param_scheduler_of(cfg, progress.iteration - start.schedule_start),
               scaler.dynamic() ? std::optional<GradScalerState>(scaler.state()) : std::nullopt);
  };
  const auto finish = [&] {  // the last save committed; the model left whole (Megatron-FSDP's parameters gathered)
    saves.finish(progress.iteration);
    opt->settle();
  };
  const auto t_start = std::chrono::steady_clock::now();  // (--exit-duration-in-mins)
  for (int64_t it = progress.iteration; it < cfg.train_iters; ++it) {
    comm_set_phase("iteration " + std::to_string(it + 1));  // named by timeouts, aborts and fatal signals
    saves.step_boundary(it);  // Megatron's maybe_finalize_async_save(blocking=False) before each step
    const float lr = lr_at(cfg, it - start.schedule_start);
    const StepResult r = step.run(it, lr);
    progress.iteration = it + 1;
    progress.consumed_samples += cfg.global_batch_size;
    if (r.skipped) ++start.schedule_start;  // no update, so the LR schedule stays (Megatron's update_successful)
    out.skipped_steps += r.skipped ? 1 : 0;
    out.moe_retries += r.retried ? 1 : 0;
    out.train_loss.push_back(r.loss);
    out.grad_norm.push_back(r.stats.grad_norm);
    out.lr.push_back(lr);
    out.loss_scale.push_back(r.loss_scale);
    out.metrics.push_back(r.metrics);
    out.params_norm.push_back(r.params_norm);
    out.num_zeros.push_back(r.num_zeros);
    if (observer) observer(it, r.loss, r.skipped);
    run_log.step(it, r, lr, progress.consumed_samples, step.take_grad_reduce_blocked(), step.take_pipeline_wait());
    // (an overflow the dynamic loss scaler can still answer by lowering the scale is its normal working)
    const bool stuck = r.skipped && !(r.overflow && scaler.dynamic() && r.loss_scale > scaler.min_scale());
    consecutive_skips = stuck ? consecutive_skips + 1 : 0;
    if (consecutive_skips == kMaxConsecutiveSkippedSteps) {  // every rank decided alike (TrainStep::check_and_update)
      char scale[32];
      std::snprintf(scale, sizeof scale, "%g", static_cast<double>(r.loss_scale));
      const std::string flag = scaler.dynamic() ? "minimum loss scale (--min-loss-scale " : "loss scale (--loss-scale ";
      const std::string why =
          r.overflow ? "for gradient overflow at the " + flag + scale + ")" : std::string("under --nan-action skip");
      MOECORE_FAIL("training: ", consecutive_skips, " consecutive steps skipped ", why, " (iterations ",
                   it + 2 - consecutive_skips, " to ", it + 1, "; the last: non-finite value in ", r.nonfinite,
                   "): the run does not recover by skipping, so it stops here (no checkpoint of these ",
                   "steps is written); hint: lower --lr or clip gradients (--clip-grad), check the data, or resume ",
                   "from the last checkpoint");
    }
    const bool last = it + 1 == cfg.train_iters;
    if (cfg.check_weight_hash_interval > 0 && (it + 1) % cfg.check_weight_hash_interval == 0) {
      opt->settle();  // (the distributed optimizer's parameter all-gathers complete first)
      check_replica_hashes(gpt, groups, it + 1, log);
    }
    if (cfg.has_validation && (last || (cfg.eval_interval > 0 && (it + 1) % cfg.eval_interval == 0))) {
      const auto t_eval = std::chrono::steady_clock::now();
      comm_set_phase("validation after iteration " + std::to_string(it + 1));
      const double v = evaluate(gpt, cfg, batches, &groups.dp);
      run_log.exclude(std::chrono::steady_clock::now() - t_eval);
      out.valid_loss.emplace_back(it + 1, v);
      run_log.validation(it, v);
    }
    const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count() / 60;
    const StopRequest stop =
        stop_requested(signals.get(), cfg.exit_duration_mins > 0 && minutes > cfg.exit_duration_mins, groups);
    if (stop.signal || stop.time) {
      if (log && stop.signal)
        std::fprintf(log, " received signal %d: saving and stopping at iteration %lld\n", ExitSignalGuard::signal(),
                     static_cast<long long>(it + 1));
      else if (log)
        std::fprintf(log, " exiting after %.2f minutes at iteration %lld (--exit-duration-in-mins %g)\n", minutes,
                     static_cast<long long>(it + 1), cfg.exit_duration_mins);
      save();
      finish();
      out.stopped_by_signal = stop.signal;
      out.stopped_by_time = !stop.signal;
      return out;
    }
    if (!last && cfg.exit_interval > 0 && (it + 1) % cfg.exit_interval == 0) {
      if (log) std::fprintf(log, " exiting at iteration %lld (--exit-interval)\n", static_cast<long long>(it + 1));
      save();
      finish();
      return out;
    }
    if (!last && cfg.save_interval > 0 && (it + 1) % cfg.save_interval == 0) save();
  }
  save();
  finish();  // (Megatron's maybe_finalize_async_save(blocking=True) at the end)
  return out;
}

std::vector<int32_t> generate(model::GptModel& gpt, const std::vector<int32_t>& prompt, int64_t count,
                              float temperature, uint64_t seed, int32_t stop_token, int64_t vocab_limit) {
  const auto& m = gpt.config();
  const int64_t B = gpt.micro_batch_size(), S = m.seq_length, Vm = m.vocab_size;
  if (vocab_limit < 0 || vocab_limit > Vm)
    MOECORE_FAIL("generate: vocab_limit ", vocab_limit, " is outside the model's vocabulary of ", Vm);
  if (prompt.empty())
    MOECORE_FAIL("generate: the prompt holds no token; start from at least one (e.g. the end-of-document token)");
  const int64_t V = vocab_limit > 0 ? vocab_limit : Vm;  // candidates: the first V logits of a row
  // A sample has no retry: its MoE layers hold every received row (a static received-token capacity would drop some).
  gpt.set_moe_synced_dropless(true);
  Tensor tokens = Tensor::zeros({B, S}, DType::i32, MemCategory::workspace);
  Tensor logits = Tensor::empty({B * S, Vm}, DType::f32, MemCategory::workspace, gpt.device());
  std::vector<float> row(static_cast<size_t>(Vm));  // the last position's logits, read back to sample from
  std::vector<int32_t> ctx = prompt, out;
  const PhiloxKey key = philox_key(seed, "generate");
  std::vector<std::pair<float, int32_t>> cand(static_cast<size_t>(V));
  // Token t from position n - 1's logits: top-40 at the temperature; -1 for the stop token, -2 when a logit is not
  // finite (a model with NaN or Inf weights gives no text, not random text).
  const auto sample = [&](int64_t t, int64_t n) -> int64_t {
    logits.slice(0, n - 1, n).copy_to_host(row.data(), Vm);
    for (int64_t v = 0; v < V; ++v) {
      if (!std::isfinite(row[v])) return -2;
      cand[v] = {row[v], static_cast<int32_t>(v)};
    }
    const int64_t k = std::min<int64_t>(40, V);
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), std::greater<>());
    double z = 0;
    std::vector<double> p(static_cast<size_t>(k));
    // The stop token may end the sample only after a quarter of the requested tokens (no empty samples).
    const bool may_stop = 4 * t >= count;
    for (int64_t i = 0; i < k; ++i) {
      p[i] = (!may_stop && cand[i].second == stop_token)
                 ? 0.0
                 : std::exp((cand[i].first - cand[0].first) / std::max(temperature, 1e-4f));
      z += p[i];
    }
    double u = philox_uniform(key, static_cast<uint64_t>(t)) * z;
    int64_t pick = 0;
    while (pick + 1 < k && (u -= p[pick]) > 0) ++pick;
    return cand[pick].second == stop_token ? -1 : cand[pick].second;
  };
  const ProcessGroup& pp = gpt.parallel().pp;  // on a pipeline the last stage samples and tells the others
  for (int64_t t = 0; t < count; ++t) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ctx.size()), S);
    int32_t* tp = tokens.data<int32_t>();
    std::copy(ctx.end() - n, ctx.end(), tp);
    gpt.forward_logits(logits, tokens);
    int64_t next = pp.rank() == pp.size() - 1 ? sample(t, n) : 0;
    if (pp.size() > 1) broadcast(std::span<int64_t>(&next, 1), pp.size() - 1, pp);
    if (next == -2)
      MOECORE_FAIL("generate: the model's logits are not finite (NaN or Inf) at generated token ", t + 1,
                   ": its weights hold non-finite values; nothing is sampled from such a model");
    if (next < 0) break;
    ctx.push_back(static_cast<int32_t>(next));
    out.push_back(static_cast<int32_t>(next));
  }
  return out;
}

}  // namespace moecore::train
