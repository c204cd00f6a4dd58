// Shared by the GPU tests (test_cuda_*.cpp, ctest label "gpu"): one tensor on both backends, NaN-poisoned outputs,
// seeded random inputs, and the per-dtype tolerances. Every test starts with SKIP_WITHOUT_GPU() (gpu/gpu_test.h: a
// skip without a device, a failure with MOECORE_REQUIRE_GPU=1).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gpu/gpu_test.h"
#include "moecore/kernels/ops.h"
#include "moecore/kernels/ops_router.h"
#include "test_util.h"

namespace moecore::testing_cuda {

inline ops::Context ctx_of(bool gpu) {
  return gpu ? ops::Context{Device::cuda, nullptr} : ops::Context{};
}

// One tensor on both backends: the CPU reference and its copy on the GPU.
struct Both {
  Tensor cpu, gpu;
  Tensor& on(bool g) { return g ? gpu : cpu; }
};
inline Both both(const Tensor& host) {
  return {host.clone(), host.to_device(Device::cuda)};
}
inline Both randn(const Shape& s, const char* name, uint64_t seed, DType t = DType::f32, float std = 1.0f) {
  return both(testing::randn(s, name, std, seed).to(t));
}
// Poisoned outputs: NaN for float dtypes, the byte 0xA5 in every element of integer and bool ones.
inline Both nans(const Shape& s, DType t = DType::f32) {
  Tensor h = Tensor::empty(s, t, MemCategory::other);
  if (dtype_is_float(t))
    h.fill_(std::numeric_limits<float>::quiet_NaN());
  else
    std::memset(h.raw(), 0xA5, static_cast<size_t>(h.nbytes()));
  return both(h);
}
inline Both ints(const std::vector<int32_t>& v) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::other);
  std::memcpy(h.raw(), v.data(), v.size() * sizeof(int32_t));
  return both(h);
}
inline Both counts(const std::vector<int64_t>& v) {
  return both(testing::counts_tensor(v, Device::cpu));
}
// Random values in [lo, hi) from a seed.
inline std::vector<int32_t> random_ints(int64_t n, int32_t lo, int32_t hi, uint64_t seed) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = lo + static_cast<int32_t>(testing::mix(seed * 1000003 + i) % (hi - lo));
  return v;
}

// Tolerances by output dtype: f32 ~1e-5 relative; bf16 and f16 about two ulps (a value rounds to either neighbour
// when the two backends' f32 results differ in the last bits): 2 * 2^-8 and 2 * 2^-11.
constexpr double kRtolF32 = 1e-5, kRtolBf16 = 8e-3, kRtolF16 = 1e-3;
inline double rtol_of(DType t) {
  return t == DType::bf16 ? kRtolBf16 : t == DType::f16 ? kRtolF16 : kRtolF32;
}

inline void expect_near(const Both& x, double rtol, double atol) {
  EXPECT_TENSOR_NEAR(testing::host(x.gpu), x.cpu, rtol, atol);
}
inline void expect_bitwise(const Both& x) {
  const Tensor g = testing::host(x.gpu);
  ASSERT_EQ(g.shape(), x.cpu.shape());
  const Tensor c = x.cpu.is_contiguous() ? x.cpu : x.cpu.clone();
  EXPECT_EQ(std::memcmp(g.raw(), c.raw(), static_cast<size_t>(c.nbytes())), 0) << "GPU and CPU bits differ";
}

inline const DType kFloat[] = {DType::f32, DType::bf16, DType::f16};

}  // namespace moecore::testing_cuda
