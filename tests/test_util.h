// Shared helpers for the GoogleTest suite: random tensors, comparisons with stated tolerances, and a
// central finite-difference gradient check. Header-only so each test binary stays self-contained.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "moecore/core/rng.h"
#include "moecore/core/tensor.h"
#include "moecore/kernels/ops.h"

namespace moecore::testing {

// True in the AddressSanitizer build (scripts/sanitize.sh): its allocator keeps freed memory in quarantine and
// its shadow memory counts in the resident set, so resident-memory measurements do not hold there.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

// A contiguous f32 tensor filled with N(0, std^2) from a named stream.
inline Tensor randn(const Shape& shape, const char* name, float std = 1.0f, uint64_t seed = 7) {
  Tensor t = Tensor::empty(shape, DType::f32, MemCategory::other);
  rng_fill_normal(t, seed, name, 0.0f, std);
  return t;
}

// The device the model, MoE and training tests put their tensors on: MOECORE_TEST_DEVICE = cpu (default) or
// sim (the simulated device, whose data host code cannot read; ctest runs those binaries once more with it).
inline Device test_device() {
  const char* v = std::getenv("MOECORE_TEST_DEVICE");
  return v && *v ? parse_device(v) : Device::cpu;
}
// A host copy of any tensor (the explicit transfer tests read device results through).
inline Tensor host(const Tensor& t) {
  return t.to_device(Device::cpu);
}
// A copy of a host tensor on the test device (the tensor itself on the CPU).
inline Tensor on_test_device(const Tensor& t) {
  return t.to_device(test_device());
}

// A [n] i64 tensor of counts (the group sizes grouped ops take) on `device`.
inline Tensor counts_tensor(const std::vector<int64_t>& v, Device device = test_device()) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i64, MemCategory::other);
  for (size_t i = 0; i < v.size(); ++i) t.data<int64_t>()[i] = v[i];
  return t.to_device(device);
}
// The elements of an i64 tensor on any device.
inline std::vector<int64_t> to_vector_i64(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  t.copy_to_host(v.data(), t.numel());
  return v;
}

// The elements of any tensor (any device) as f32.
inline std::vector<float> to_vector(const Tensor& t) {
  Tensor f = host(t).to(DType::f32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

// Largest |a - b| / (atol + rtol * |b|) over elements; <= 1 means "within tolerance".
inline double tolerance_ratio(const Tensor& a, const Tensor& b, double rtol, double atol) {
  const auto va = to_vector(a), vb = to_vector(b);
  double worst = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    const double r = std::fabs(double(va[i]) - double(vb[i])) / (atol + rtol * std::fabs(double(vb[i])));
    if (!(r <= worst)) worst = std::isnan(r) ? INFINITY : r;
  }
  return worst;
}

#define EXPECT_TENSOR_NEAR(a, b, rtol, atol)                                      \
  do {                                                                            \
    ASSERT_EQ((a).shape(), (b).shape()) << (a).str() << " vs " << (b).str();      \
    EXPECT_LE(::moecore::testing::tolerance_ratio((a), (b), (rtol), (atol)), 1.0) \
        << #a " vs " #b " (rtol " << (rtol) << ", atol " << (atol) << ")";        \
  } while (0)

// The sum of squares of a float tensor on any device (ops::sum_squares into a [1] f64 on its device, read back).
inline double sum_squares(const Tensor& x) {
  Tensor acc = Tensor::zeros({1}, DType::f64, MemCategory::other, x.device());
  ops::sum_squares(acc, x.is_contiguous() ? x : x.clone(), ops::Context{x.device()});
  double s = 0;
  acc.copy_to_host(&s, 1);
  return s;
}
// True when every element of a float tensor on any device is finite (ops::flag_nonfinite).
inline bool all_finite(const Tensor& x) {
  Tensor flag = Tensor::zeros({1}, DType::i32, MemCategory::other, x.device());
  ops::flag_nonfinite(flag, x.is_contiguous() ? x : x.clone(), ops::Context{x.device()});
  int32_t f = 0;
  flag.copy_to_host(&f, 1);
  return f == 0;
}

// splitmix64: a well-mixed 64-bit hash for deterministic test values.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The message of the moecore::Error fn raises, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// fn must raise moecore::Error whose message contains every needle.
inline void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << *needles.begin();
  } catch (const Error& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

// Central finite differences of a scalar function with respect to every element of x (f32, contiguous).
// Evaluated in float with step h; compare against analytic gradients with a tolerance of ~1e-2 relative.
inline Tensor numerical_gradient(const std::function<double()>& loss, Tensor& x, float h = 1e-2f) {
  Tensor g = Tensor::zeros(x.shape(), DType::f32, MemCategory::other);
  float* xp = x.data<float>();
  float* gp = g.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float orig = xp[i];
    xp[i] = orig + h;
    const double lp = loss();
    xp[i] = orig - h;
    const double lm = loss();
    xp[i] = orig;
    gp[i] = static_cast<float>((lp - lm) / (2.0 * h));
  }
  return g;
}

// sum(out * weights) in double: the scalar whose gradient with respect to out is `weights`.
inline double weighted_sum(const Tensor& out, const Tensor& weights) {
  const auto a = to_vector(out), b = to_vector(weights);
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// ../shared/data relative to the source tree, or "" when absent (tests then GTEST_SKIP with a message).
inline std::string shared_data_dir() {
  for (const char* p : {MOECORE_SOURCE_DIR "/../shared/data", "../shared/data", "../../shared/data"}) {
    if (std::filesystem::is_directory(p)) return p;
  }
  return "";
}

}  // namespace moecore::testing
