// GEMM sweep: square shapes and the shapes of a GPT-2-small training step, f32 and bf16.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/device_bench.h"

namespace moecore::bench {

struct GemmShape {
  int64_t M = 0, N = 0, K = 0;  // [M, K] x [K, N]
};
// Square sizes, then GPT-2-small shapes at 1024 tokens (qkv, proj, fc1, fc2, a logits chunk).
std::vector<GemmShape> gemm_default_shapes();
// "MxNxK,MxNxK,..." (e.g. "64x64x64,128x32x16"); raises Error naming `flag` and the bad item.
std::vector<GemmShape> gemm_parse_shapes(const std::string& text, const char* flag);

// CPU: each shape's best of 3 in GFLOP/s against the in-run peak of its dtype.
std::vector<std::string> bench_gemm_lines(const std::vector<GemmShape>& shapes);
// Device: c [M, N] f32 = a [M, K] @ b [N, K]^T (as the CPU sweep) on run.device, f32 and bf16 inputs, each shape's
// median in TFLOP/s against the bf16 peak and in GB/s (a, b read and c written once) against the copy peak.
std::vector<std::string> bench_gemm_device_lines(const std::vector<GemmShape>& shapes, const DeviceRun& run,
                                                 const DevicePeaks& peaks);

}  // namespace moecore::bench
