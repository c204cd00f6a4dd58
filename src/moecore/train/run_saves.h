// The checkpoints of a training run (train(), --save): each written before the run goes on, or with --async-save
// handed to a background worker (async_save.h) and committed at a later step boundary, with the run's log lines and
// the error that stops a run whose save failed. Not here: what a checkpoint holds (checkpointing.h), when the run
// saves (trainer.cpp).
#pragma once
#include <cstdint>
#include <cstdio>
#include <optional>

#include "moecore/core/error.h"
#include "moecore/train/async_save.h"
#include "moecore/train/optimizer.h"
#include "moecore/train/trainer.h"

namespace moecore::train {

// A failed save stops the run (Megatron's behaviour): retrying would need free space the job cannot make, and going on
// would risk losing more steps than the last committed checkpoint holds. The Error names the file, the byte offset and
// the errno, and the iteration that stays the newest valid checkpoint; nothing of the failed save is committed.
class RunSaves {
 public:
  // cfg, opt and log must outlive it. Nothing is saved when cfg.save is empty.
  RunSaves(const TrainConfig& cfg, Optimizer& opt, std::FILE* log);
  // A checkpoint at progress.iteration (collective), with the LR schedule's state and the dynamic loss scaler's (when
  // given). With --async-save it first finishes the save in flight, and returns once the state is snapshotted.
  void save(const TrainProgress& progress, const OptParamSchedulerState& scheduler,
            const std::optional<GradScalerState>& grad_scaler);
  // At each step boundary, `iteration` steps done (collective while a save is in flight, never blocking): commits the
  // save in flight once every rank has written its files.
  void step_boundary(int64_t iteration) { commit(/*blocking=*/false, iteration); }
  // Before the run returns: the save in flight is finished and committed.
  void finish(int64_t iteration) { commit(/*blocking=*/true, iteration); }

 private:
  void commit(bool blocking, int64_t iteration);
  [[noreturn]] void failed(const Error& e, int64_t checkpoint, int64_t iteration) const;

  const TrainConfig& cfg_;
  Optimizer& opt_;
  std::FILE* log_;
  std::optional<AsyncCheckpointSaver> async_;
};

}  // namespace moecore::train
