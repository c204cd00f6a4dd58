// Benchmark of one full training step (forward, backward, AdamW) of a dense GPT.
#pragma once
#include <string>
#include <vector>

#include "bench/device_bench.h"
#include "moecore/model/config.h"

namespace moecore::bench {
// Prints the memory plan to stderr, runs warm-up + `steps` timed steps, and returns JSON lines with the
// model-FLOPs throughput, the in-run GEMM peak of the compute dtype, their ratio, and the peak resident
// memory against the plan; then two train_step_async_save lines (the writer at nice 10, Megatron's default, and at the
// training thread's): the mean step time while an asynchronous checkpoint of the model and its moments is written in
// the background (--async-save) over the mean step without one (ratio_during_save; three saves, each after `steps`
// steps without), and the training thread's own costs of a save (snapshot, commit).
std::vector<std::string> bench_train_step(const model::ModelConfig& cfg, int64_t micro_batch, int steps);
// The same step with the model on run.device (the batch is handed over in host memory, as the data loader does):
// prints the memory plan to stderr; the line has the median step in TFLOP/s (model FLOPs) against the bf16 peak,
// tokens per second, the last loss, and the planned and tracked peak bytes.
std::vector<std::string> bench_train_step_device(const model::ModelConfig& cfg, int64_t micro_batch,
                                                 const DeviceRun& run, const DevicePeaks& peaks);
}  // namespace moecore::bench
