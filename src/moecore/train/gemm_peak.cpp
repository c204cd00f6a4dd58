#include "moecore/train/gemm_peak.h"

#include <algorithm>
#include <chrono>

#include "moecore/core/rng.h"
#include "moecore/kernels/ops.h"

namespace moecore::train {
namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

double gemm_gflops(DType dtype, int64_t M, int64_t N, int64_t K, int reps) {
  Tensor a = Tensor::empty({M, K}, dtype, MemCategory::workspace);
  Tensor b = Tensor::empty({N, K}, dtype, MemCategory::workspace);
  Tensor c = Tensor::empty({M, N}, DType::f32, MemCategory::workspace);
  rng_fill_uniform(a, 1, "gemm_peak.a", -1, 1);
  rng_fill_uniform(b, 1, "gemm_peak.b", -1, 1);
  ops::gemm(c, a, false, b, true, 1.0f, 0.0f, {});  // warm-up (primitive creation)
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    ops::gemm(c, a, false, b, true, 1.0f, 0.0f, {});
    best = std::min(best, now() - t0);
  }
  return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) / best / 1e9;
}

double gemm_peak_gflops(DType dtype) {
  double peak = 0;
  for (int64_t n : {1024, 2048}) peak = std::max(peak, gemm_gflops(dtype, n, n, n, n == 1024 ? 8 : 3));
  return peak;
}

}  // namespace moecore::train
