// The device path of the lab bench (`moecore bench <what> --device cuda | sim`): the run's options, the ceilings
// measured in the same process (a bf16 GEMM through ops::gemm, which is cuBLAS on cuda, and a device-to-device copy),
// stage timing with ops::DeviceTimer (warm-up, then the median of the timed runs) and the fields every device line
// carries. On sim the same code runs with a wall clock, so the CPU test suite proves each bench's device path end to
// end. No CUDA here: the timer is a link-time seam of the kernels library.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "moecore/core/tensor.h"

namespace moecore::bench {

struct DeviceRun {
  Device device = Device::cuda;
  int warmup = 3;                       // untimed runs first (library handles, workspaces, clocks ramping up)
  int iters = 20;                       // timed runs; every figure is their median
  int64_t peak_gemm = 8192;             // M = N = K of the bf16 GEMM whose speed is peak_tflops
  int64_t peak_copy_bytes = 1LL << 30;  // bytes of the device-to-device copy whose speed is peak_gbps
};

// The ceilings of this device, measured in this process with run's warm-up and iterations.
struct DevicePeaks {
  double tflops = 0;   // bf16 [n, n] x [n, n]^T -> bf16 through ops::gemm, 2 n^3 FLOPs
  double gbps = 0;     // Tensor::copy_from of two contiguous f32 tensors: 2 x bytes (read + write) per second
  double gemm_ms = 0;  // the medians they come from
  double copy_ms = 0;
  int64_t copy_bytes = 0;  // the copy's size (run.peak_copy_bytes rounded down to f32 elements, at least one)
};
DevicePeaks device_peaks_measure(const DeviceRun& run);
// {"name":"device_peaks",...}: printed before a command's other lines.
std::string device_peaks_line(const DeviceRun& run, const DevicePeaks& peaks);

// Runs `stages` in order, back to back: run.warmup times untimed, then run.iters times between timer marks.
// stage_ms[s] is the median of stage s, total_ms the median of the whole sequence (not the sum of stage medians).
struct StageTimes {
  std::vector<double> stage_ms;
  double total_ms = 0;
};
StageTimes device_time_stages(const DeviceRun& run, const std::vector<std::function<void()>>& stages);

// A contiguous tensor on `device` holding N(0, std^2) values drawn on the host from (seed, name) and rounded to
// `dtype` there, so the device receives one same-dtype contiguous transfer and nothing on it is converted.
Tensor random_normal_on(Device device, const Shape& shape, DType dtype, const char* name, float std,
                        MemCategory category = MemCategory::workspace, uint64_t seed = 1);

// The speed fields of a device line: device, timer, iters, median_ms, tflops (flops over the median), peak_tflops,
// ratio (tflops / peak_tflops); and, when bytes > 0 (the least traffic of the work: each operand read and each output
// written once), bytes, gbps, peak_gbps and gbps_ratio.
JsonLine& add_device_speed(JsonLine& line, const DeviceRun& run, const DevicePeaks& peaks, double ms, double flops,
                           double bytes = 0);

}  // namespace moecore::bench
