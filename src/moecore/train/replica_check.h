// Megatron's --check-weight-hash-across-dp-replicas-interval (training.py post_training_step_callbacks ->
// core/utils.py check_param_hashes_across_dp_replicas): the parameters every data-parallel replica holds alike are
// hashed and the hashes compared across the replicas; a divergence (a bit flip, a rank that skipped an update, a
// non-deterministic reduction) stops the run naming the tensor and the ranks that differ.
#pragma once
#include <cstdint>
#include <cstdio>

#include "moecore/model/gpt.h"
#include "moecore/train/train_groups.h"

namespace moecore::train {

// Collective over the data-parallel groups (non-expert parameters over dense_grads(), expert parameters over edp).
// Returns the number of tensors compared on this rank; throws Error on a mismatch. `log` (may be null) gets Megatron's
// line ">>> Weight hashes match after N iterations".
int64_t check_replica_hashes(const model::GptModel& gpt, const TrainGroups& groups, int64_t iteration, std::FILE* log);

}  // namespace moecore::train
