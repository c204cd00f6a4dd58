// Benchmark of one MoE layer (router, local dispatch, grouped experts, combine), forward + backward.
#pragma once
#include <string>
#include <vector>

#include "moecore/core/dtype.h"

namespace moecore::bench {
// Balanced-ish random routing from a random router; reports expert model-FLOPs throughput against the
// in-run dense GEMM peak of the same dtype, and saved-activation bytes per token.
std::vector<std::string> bench_moe_layer(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype, int iters);
}  // namespace moecore::bench
