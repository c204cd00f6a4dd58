// Benchmark of one MoE layer (router, local dispatch, grouped experts, combine), forward + backward.
#pragma once
#include <string>
#include <vector>

#include "bench/device_bench.h"
#include "moecore/core/dtype.h"

namespace moecore::bench {
// Balanced-ish random routing from a random router; reports expert model-FLOPs throughput against the
// in-run dense GEMM peak of the same dtype, and saved-activation bytes per token.
std::vector<std::string> bench_moe_layer(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype, int iters);
// The same layer on run.device: forward and forward + backward medians (both from the same timed runs) in TFLOP/s
// against the bf16 peak and in GB/s (x, the weights and y; then dy, x, the weights, dx and the gradients read and
// written; the layer's saved buffers written and read once) against the copy peak.
std::vector<std::string> bench_moe_layer_device(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype,
                                                const DeviceRun& run, const DevicePeaks& peaks);
}  // namespace moecore::bench
