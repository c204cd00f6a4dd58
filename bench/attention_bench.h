// Attention bench: causal flash attention forward, backward and both, in GFLOP/s against the in-run
// oneDNN GEMM peak of the same dtype. One JSON object per line; measures, never asserts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/device_bench.h"
#include "moecore/core/dtype.h"

namespace moecore::bench {
// heads query heads sharing kv_heads key/value heads (heads % kv_heads == 0), head dim D; best of `iters`.
std::vector<std::string> bench_attention_lines(int64_t B, int64_t S, int64_t heads, int64_t kv_heads, int64_t D,
                                               DType dtype, int iters);
// The same on run.device: forward, backward and both, medians in TFLOP/s against the bf16 peak and in GB/s (qkv read
// and out, lse written by the forward; qkv, out, lse, dout read and dqkv written by the backward) against the copy
// peak.
std::vector<std::string> bench_attention_device_lines(int64_t B, int64_t S, int64_t heads, int64_t kv_heads, int64_t D,
                                                      DType dtype, const DeviceRun& run, const DevicePeaks& peaks);
}  // namespace moecore::bench
