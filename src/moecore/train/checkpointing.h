// Training state <-> checkpoint directories (io/checkpoint.h): the model's f32 master weights, the router
// states (expert bias, noise-stream positions), the optimizer moments and step count, and the data
// position. Everything needed for a bit-identical resume; nothing else (activations are recomputed).
#pragma once
#include <string>
#include <vector>

#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "moecore/train/train_groups.h"

namespace moecore::train {

struct TrainProgress {
  int64_t iteration = 0;         // optimizer steps completed
  int64_t consumed_samples = 0;  // sequences consumed by training (iteration * global batch)
};

// The optimizer state a checkpoint holds for this rank's parameters (aligned with gpt.params(), shaped like
// them): AdamW's moments, full for every parameter this rank holds (a distributed optimizer gathers its
// shards first), and the step count.
struct OptimizerState {
  std::vector<Tensor> exp_avg, exp_avg_sq;
  int64_t steps = 0;
};

// Writes <root>/iter_<iteration>/ committed atomically; keeps the newest keep_last checkpoints (0: all).
// Files: model.safetensors (parameters by Megatron name, expert biases), optimizer.safetensors (moments),
// state.json (progress, router noise positions, the model fingerprint, the expert-parallel size). With
// expert parallelism (EP > 1) the routed experts live in experts-ep<r>-of-<EP>.safetensors instead, each
// written by the EP rank r that holds them (its expert-data-parallel rank 0), with their moments; rank 0
// of dp commits. Collective over groups->dp when given (every rank calls it).
void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const OptimizerState& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last,
                              const TrainGroups* groups = nullptr);
void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const optim::AdamW& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last,
                              const TrainGroups* groups = nullptr);

// Loads a committed checkpoint directory into gpt and the optimizer state (whose tensors must exist with
// this rank's shapes) and returns the progress. Resharding: a checkpoint saved at any EP loads at any other
// EP dividing the number of experts (each rank copies its experts' rows out of whichever shards hold them).
// Throws Error naming the file, tensor or field and the reason.
TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, OptimizerState& opt,
                                       uint64_t seed);
TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt,
                                       uint64_t seed);

// A hash of every master weight's bytes (resume tests and log lines).
uint64_t parameter_hash(const model::GptModel& gpt);

}  // namespace moecore::train
