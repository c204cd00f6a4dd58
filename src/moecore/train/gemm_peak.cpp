#include "moecore/train/gemm_peak.h"

#include <algorithm>

#include "moecore/core/rng.h"
#include "moecore/kernels/device_timer.h"
#include "moecore/kernels/ops.h"

namespace moecore::train {

double gemm_gflops(DType dtype, int64_t M, int64_t N, int64_t K, int reps, Device device) {
  Tensor a = Tensor::empty({M, K}, dtype, MemCategory::workspace);
  Tensor b = Tensor::empty({N, K}, dtype, MemCategory::workspace);
  rng_fill_uniform(a, 1, "gemm_peak.a", -1, 1);
  rng_fill_uniform(b, 1, "gemm_peak.b", -1, 1);
  a = a.to_device(device, MemCategory::workspace);
  b = b.to_device(device, MemCategory::workspace);
  Tensor c = Tensor::empty({M, N}, DType::f32, MemCategory::workspace, device);
  const ops::Context ctx{device, nullptr};
  ops::gemm(c, a, false, b, true, 1.0f, 0.0f, ctx);  // warm-up (primitive creation, library load)
  ops::DeviceTimer timer(device);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    timer.mark(0);
    ops::gemm(c, a, false, b, true, 1.0f, 0.0f, ctx);
    timer.mark(1);
    best = std::min(best, timer.elapsed_ms(0, 1) / 1e3);
  }
  return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) / best / 1e9;
}

double gemm_peak_gflops(DType dtype, Device device) {
  double peak = 0;
  if (device == Device::cuda) {
    for (int64_t n : {4096, 8192}) peak = std::max(peak, gemm_gflops(dtype, n, n, n, 5, device));
    return peak;
  }
  for (int64_t n : {1024, 2048}) peak = std::max(peak, gemm_gflops(dtype, n, n, n, n == 1024 ? 8 : 3, device));
  return peak;
}

}  // namespace moecore::train
