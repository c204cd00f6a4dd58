// The machine's dense GEMM peak, measured in-process: the reference for MFU on the training log line and for
// every benchmark ratio (machines here are noisy, so speed is always reported against a same-run peak).
#pragma once
#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::train {
// Best GFLOP/s of a dense [M, K] x [K, N] GEMM through ops::gemm on `device` over `reps` timed runs (after a
// warm-up), timed with ops::DeviceTimer (CUDA events on cuda).
double gemm_gflops(DType dtype, int64_t M, int64_t N, int64_t K, int reps = 5, Device device = Device::cpu);
// The best of a few large square GEMMs of this dtype on `device` (about a second on 2 cores; 4096^3 and 8192^3 on
// cuda).
double gemm_peak_gflops(DType dtype, Device device = Device::cpu);
}  // namespace moecore::train
