// One optimizer step of a training run: this rank's micro-batches through the model in a schedule's order
// (schedule.h), the gradient reduction and update through the optimizer's interface (optimizer.h), the non-finite
// check, the MoE router updates, and the step's losses reduced over the data-parallel group. Not here: the run
// around it -- LR schedule, logging, evaluation, checkpoints, signals (trainer.h).
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moecore/model/gpt.h"
#include "moecore/train/grad_scaler.h"
#include "moecore/train/optimizer.h"
#include "moecore/train/schedule.h"
#include "moecore/train/step_metrics.h"
#include "moecore/train/timers.h"
#include "moecore/train/trainer.h"

namespace moecore::train {

struct StepResult {
  double loss = 0;         // lm loss: mean over the step's micro-batches (all data-parallel ranks')
  StepMetrics metrics;     // the MTP losses (likewise) and the MoE losses as Megatron logs them (step_metrics.h)
  optim::StepStats stats;  // grad norm before clipping and the clip scale (zeros when skipped)
  bool skipped = false;    // a non-finite loss or gradient under --nan-action skip, or an overflow: no update
  bool overflow = false;   // skipped because the gradients overflowed under loss scaling (grad_scaler.h)
  float loss_scale = 1;    // the loss scale the step's gradients were taken with (1 without loss scaling)
  int64_t tokens = 0;      // --calculate-per-token-loss: the global batch's counted tokens
  std::string nonfinite;   // what was not finite ("" when all was)
  bool retried = false;    // over the static received-token capacity somewhere: run again synced, dropless
  // On the steps that end a log interval (cfg.log_interval), with the logging flags; NaN otherwise.
  double num_zeros = NAN;    // log_num_zeros_in_grad, steps not skipped: Optimizer::count_zeros_in_grad
  double params_norm = NAN;  // log_params_norm: Optimizer::params_norm after the step
};

// A step's schedule on pipeline rank pp_rank of pp: 1F1B over this data-parallel rank's cfg.micro_batches() / dp
// micro-batches (Error naming the sizes when dp does not divide them), interleaved over `chunks` model chunks
// (cfg.microbatch_group_size_per_vp_stage, default pp). Its in_flight counts are the model's micro-batch slots: the
// memory plan reads them before the model exists.
Schedule step_schedule(const TrainConfig& cfg, int64_t dp, int64_t pp, int64_t pp_rank, int64_t chunks);

class TrainStep {
 public:
  // This rank's share of every global batch: the dp group's rank r runs micro-batches [r * m, (r + 1) * m) of the
  // step, m = cfg.micro_batches() / dp (Error naming the sizes when it does not divide), in the 1F1B order of its
  // pipeline stage (one stage: forward and backward per micro-batch), interleaved when gpt has several model chunks
  // (cfg.microbatch_group_size_per_vp_stage); gpt gets the schedule's activation slots. Between stages (groups.pp)
  // the activations go forward and their gradients back point-to-point as pipeline_transfers plans them (schedule.h),
  // the gradients on a communicator of their own. Collective over groups.pp (that communicator).
  // The phases run under `timers` (timers.h; null: untimed).
  // The losses' gradients are taken times scaler's scale, and the reduced gradients multiplied by its inverse (with
  // cfg.calculate_per_token_loss also divided by the global batch's counted tokens) before the check; the scaler is
  // updated after each step.
  TrainStep(model::GptModel& gpt, Optimizer& opt, const TrainConfig& cfg, const TrainGroups& groups,
            const BatchFn& batches, GradScaler& scaler, Timers* timers = nullptr);
  // Step `iteration` (0-based) with learning rate lr: zeroes the gradients, runs the schedule (dropout keyed by the
  // iteration and each micro-batch's index in the global batch), reduces, checks (cfg.check_for_nan: a non-finite
  // loss or gradient stops with an Error naming it, or with --nan-action skip drops the update; under loss scaling a
  // non-finite gradient is an overflow, which drops the update whatever --nan-action says; every rank decides alike),
  // updates and finishes the routers' step. With a static received-token capacity (gpt.moe_static_capacity)
  // an overflow on any rank (agreed over the groups) discards the pass -- gradients, losses, router counters -- and
  // runs the step once more on the synced dropless path (retried), whose buffers stay until the next step starts.
  // On a step that ends a log interval, the zeros of the gradients and the norm of the parameters as the logging flags
  // ask (StepResult). Collective over the groups.
  StepResult run(int64_t iteration, float lr);
  int64_t micro_batches_per_rank() const { return micro_local_; }
  // Seconds this rank was blocked in the gradient reduction since the last call (the reduction posted during backward
  // with --overlap-grad-reduce, and the final wait or the whole reduction).
  double take_grad_reduce_blocked();
  // Seconds this rank waited in the transfers between pipeline stages since the last call (its share of the bubble
  // and of any imbalance between the stages).
  double take_pipeline_wait();

 private:
  model::GptModel& gpt_;
  Optimizer& opt_;
  const TrainConfig& cfg_;
  const TrainGroups& g_;
  const BatchFn& batches_;
  GradScaler& scaler_;
  Timers* timers_;
  int64_t micro_ = 0, micro_local_ = 0;
  int64_t moe_layers_ = 0;  // the MoE layers this stage holds (MTP depths included)
  StepMetrics metrics_;     // the step's loss list, zeros (the model's MTP depths and MoE losses)
  Schedule schedule_;
  std::vector<P2PAction> transfers_;  // empty without a pipeline
  ProcessGroup pp_grads_;             // groups.pp's ranks: the gradients' stream between stages
  // Per stream (activations, gradients) x direction (receive, send), chunk and slot: the transfer in flight
  // (schedule.h says when each is posted and waited for).
  std::vector<std::vector<CommHandle>> handles_[4];
  Tensor tokens_, labels_;  // [B, S] i32 host: the micro-batch being loaded
  Tensor shared_grad_;      // the other stage's gradient of gpt.pipeline_shared_param()
  double grad_reduce_blocked_ = 0, pipeline_wait_ = 0;
  void sum_shared_grad(size_t index);
  // One pass of the schedule through the reduction; then the non-finite check, the update and the routers' step.
  StepResult pass(int64_t iteration);
  void check_and_update(StepResult& r, int64_t iteration, float lr);
  void run_transfers(const std::function<void(const ScheduleOp&)>& run_op);
};

}  // namespace moecore::train
