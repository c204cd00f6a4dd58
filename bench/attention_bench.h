// Attention bench: causal flash attention forward, backward and both, in GFLOP/s against the in-run
// oneDNN GEMM peak of the same dtype. One JSON object per line; measures, never asserts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/dtype.h"

namespace moecore::bench {
// heads query heads sharing kv_heads key/value heads (heads % kv_heads == 0), head dim D; best of `iters`.
std::vector<std::string> bench_attention_lines(int64_t B, int64_t S, int64_t heads, int64_t kv_heads, int64_t D,
                                               DType dtype, int iters);
}  // namespace moecore::bench
