// Benchmark of one full training step (forward, backward, AdamW) of a dense GPT.
#pragma once
#include <string>
#include <vector>

#include "moecore/model/config.h"

namespace moecore::bench {
// Prints the memory plan to stderr, runs warm-up + `steps` timed steps, and returns JSON lines with the
// model-FLOPs throughput, the in-run GEMM peak of the compute dtype, their ratio, and the peak resident
// memory against the plan.
std::vector<std::string> bench_train_step(const model::ModelConfig& cfg, int64_t micro_batch, int steps);
}  // namespace moecore::bench
