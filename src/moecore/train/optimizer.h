// The optimizer of a training run behind one interface, the only one the training step calls: how a step's gradients
// are reduced over the parallel groups (during backward with --overlap-grad-reduce), checked for non-finite values,
// normed (every parameter counted once) and applied, and how its state goes into and out of checkpoints.
// Implementations (make_optimizer): gradients all-reduced in buckets, then AdamW with its state on every data-parallel
// rank, or Muon (optim/muon.h) with its state on every rank or, with --use-distributed-optimizer, each parameter's on
// the rank that owns it (Megatron's layer-wise distributed optimizer); and AdamW's distributed optimizer
// (--use-distributed-optimizer: ZeRO-1, gradients reduce-scattered, masters all-gathered, with --overlap-param-gather
// just before forward reads them); and Megatron-FSDP's optim_grads and optim_grads_params (ZeRO-2 and ZeRO-3: the
// distributed optimizer's shards with the gradients, and the parameters, sharded per decoder layer; its no_shard and
// optim are the all-reduce and the distributed optimizer). Not here: the LR schedule (trainer.h).
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/timers.h"
#include "moecore/train/train_groups.h"

namespace moecore::train {

struct TrainConfig;
class AsyncCheckpointSaver;

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One step's gradient reduction (tensor-parallel sums included): begin_grad_reduction() before the step's first
  // micro-batch; while overlaps_grad_reduction(), grad_ready(first, end) as the model reports the gradients of
  // params()[first, end) final (its set_grad_ready hook, which the step installs for the last micro-batch);
  // finish_grad_reduction() after the last backward -- it waits for the reductions in flight, or without overlap runs
  // them all. Collective over the groups.
  virtual bool overlaps_grad_reduction() const = 0;
  virtual void begin_grad_reduction() = 0;
  virtual void grad_ready(size_t first, size_t end) = 0;
  virtual void finish_grad_reduction() = 0;
  // Multiplies every reduced gradient this rank holds by s (after finish_grad_reduction: a loss scale's inverse and
  // the per-token normalisation, grad_scaler.h and step.h). Local.
  virtual void scale_grads(float s) = 0;
  // The first non-finite reduced gradient this rank holds (a parameter's name), "" when all are finite.
  virtual std::string first_nonfinite_grad() = 0;
  // The update with learning rate lr: the global gradient norm over every group, clipping, the step, then the compute
  // copies (or, --overlap-param-gather, their gathers posted for the next forward). Collective.
  virtual optim::StepStats step(float lr) = 0;
  // After step(), until the next begin_grad_reduction(): the zero elements of the reduced gradients as the update
  // applied them, times its clip scale in f32 (Megatron's count_zeros_fp32, which counts after clipping in place;
  // moecore's update reads the gradients unchanged), every element counted once over the groups as in the grad norm.
  // Collective.
  virtual int64_t count_zeros_in_grad(float clip_scale) = 0;
  // The L2 norm of the f32 parameters (Megatron's calc_params_l2_norm over the main params), every parameter counted
  // once over the groups as in the grad norm; the distributed optimizer sums its ranks' own updated ranges, so the
  // norm is the updated one while --overlap-param-gather's gathers are in flight. Collective.
  virtual double params_norm() = 0;
  // --overlap-param-gather: params()[first, end) current before forward reads them (the model's set_params_needed
  // hook); settle() completes every gather in flight (before a checkpoint, at the end). No-ops otherwise.
  virtual bool gathers_params_later() const { return false; }
  virtual void params_needed(size_t first, size_t end) {}
  virtual void settle() {}
  // Megatron-FSDP (optim_grads, optim_grads_params): the gradients are reduced after every micro-batch's passes, so the
  // step installs the model's grad_ready hook for every micro-batch, not only the last; the model's unit hooks
  // (GptModel::set_params_needed, set_params_released, set_grads_needed) drive the gathers and releases. settle()
  // leaves every parameter whole and current (a checkpoint's or the caller's model after training).
  virtual bool reduces_every_micro_batch() const { return false; }
  virtual bool follows_units() const { return false; }
  virtual void params_released(size_t first, size_t end) {}
  virtual void grads_needed(size_t first, size_t end) {}
  // Checkpoints (checkpointing.h): the moments of every parameter this rank holds, gathered where sharded. Collective.
  // With `async` (--async-save) the save is handed to it (async_save.h) instead of written before returning.
  virtual void save(const std::string& root, const TrainProgress& progress, uint64_t seed, int keep_last,
                    const CheckpointSaveOptions& parts, AsyncCheckpointSaver* async) = 0;
  virtual LoadedTrainingState load(const std::string& dir, uint64_t seed, const CheckpointLoadOptions& parts) = 0;
  // Bytes of optimizer state on this rank, and what one rank would hold unsharded.
  virtual int64_t state_bytes() const = 0;
};

// The optimizer state per element of each parameter that the optimizer cfg selects holds (unsharded): the memory
// plan's (GptModel::memory_plan), before the optimizer or the model exists.
model::GptModel::StateBytesPerElement optimizer_state_bytes(const TrainConfig& cfg, const optim::AdamWConfig& adam);

// Megatron-FSDP's optim_grads and optim_grads_params: `plan`, gpt's plan with every gradient and parameter whole and
// the optimizer state unsharded (GptModel::memory_plan), as this rank holds it while training -- the optimizer state,
// the summed gradients and (optim_grads_params) the f32 masters sharded over dense_ranks (dp x cp, or one instance of
// it with hybrid sharding; experts: expert_ranks, edp or its instance), the gradients of one decoder layer whole at a
// time (and of the embeddings, final norm and output layer), the values of one layer gathered at a time (and of the
// others), and the staging buffers. A checkpoint save and the end of training gather every parameter for their while
// (Optimizer::settle). Other strategies: plan.
model::MemoryPlan fsdp_memory_plan(const model::GptModel& gpt, model::MemoryPlan plan, const TrainConfig& cfg,
                                   const optim::AdamWConfig& adam, int dense_ranks, int expert_ranks, int etp_ranks);

// How Megatron-FSDP wants the model built (par with ModelParallel::fsdp_grads and fsdp_params set): its layers'
// gradients, and under optim_grads_params their values, born without memory, the values' initial values drawn into the
// optimizer's shards -- no rank ever holds the whole model. (A model built whole trains alike: FsdpOptimizer gives its
// layers' memory back; `moecore train` does so when --load-hf or --moe-use-upcycling writes whole weights first.)
model::ModelParallel fsdp_model_parallel(model::ModelParallel par, const TrainConfig& cfg);

// The optimizer cfg selects (optimizer, muon, use_distributed_optimizer, fsdp, num_distributed_optimizer_instances,
// overlap_grad_reduce, overlap_param_gather, ddp_bucket_size) over gpt's parameters, with adamw's hyperparameters (and,
// for AdamW without the distributed optimizer, its state: adamw must hold it; Muon makes its own, for the scalar
// parameters too). Its step's phases run under `timers` (timers.h; null:
// untimed). gpt, adamw, groups and timers must outlive it.
std::unique_ptr<Optimizer> make_optimizer(model::GptModel& gpt, optim::AdamW& adamw, const TrainConfig& cfg,
                                          const TrainGroups& groups, Timers* timers = nullptr);

}  // namespace moecore::train
