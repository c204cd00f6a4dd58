// Training state <-> checkpoint directories (io/checkpoint.h): the model's f32 master weights, the router
// states (expert bias, noise-stream positions), the optimizer moments and step count, and the data
// position. Everything needed for a bit-identical resume; nothing else (activations are recomputed).
#pragma once
#include <string>

#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"

namespace moecore::train {

struct TrainProgress {
  int64_t iteration = 0;         // optimizer steps completed
  int64_t consumed_samples = 0;  // sequences consumed by training (iteration * global batch)
};

// Writes <root>/iter_<iteration>/ with model.safetensors, optimizer.safetensors and state.json, committed
// atomically; keeps the newest keep_last checkpoints (0: all).
void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const optim::AdamW& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last);

// Loads a committed checkpoint directory into gpt and opt (which must have been built with the same model
// configuration) and returns the progress. Throws Error naming the file, tensor or field and the reason.
TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt,
                                       uint64_t seed);

// A hash of every master weight's bytes (resume tests and log lines).
uint64_t parameter_hash(const model::GptModel& gpt);

}  // namespace moecore::train
