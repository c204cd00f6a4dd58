// Routed-experts bench: grouped experts_forward + experts_backward (SwiGLU) on a random balanced top-K
// routing, in GFLOP/s against the in-run dense GEMM peak of the same dtype. One JSON object per line;
// measures, never asserts. The whole MoE layer (router, dispatch, shared expert) is moe_layer_bench.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/device_bench.h"
#include "moecore/core/dtype.h"

namespace moecore::bench {
// N tokens, hidden H, expert ffn F, E experts, top-K; R = N*K expert rows.
std::vector<std::string> bench_experts_lines(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype);
// The same work on run.device: the median forward + backward in TFLOP/s against the bf16 peak and in GB/s (every
// argument of the two calls read, every output written, the accumulated weight gradients read and written, once per
// call) against the copy peak.
std::vector<std::string> bench_experts_device_lines(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype,
                                                    const DeviceRun& run, const DevicePeaks& peaks);
}  // namespace moecore::bench
