// Tests of the linear-layer bias ops on the CPU: bias_add / bias_grad and their grouped and row-scaled
// grouped versions against double references, with strided rows, bf16, f16, empty groups and padding rows;
// finite differences of the scaled pair, accumulation rules, thread-count independence and errors.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::randn;
using testing::to_vector;

const ops::Context kCpu;

Tensor from_double(const Shape& s, const std::vector<double>& v) {
  Tensor t = Tensor::empty(s, DType::f32, MemCategory::other);
  for (size_t i = 0; i < v.size(); ++i) t.data<float>()[i] = static_cast<float>(v[i]);
  return t;
}
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}
using testing::expect_error;

// Group of each row, -1 for padding rows.
std::vector<int64_t> row_groups(const std::vector<int64_t>& group_rows, int64_t R) {
  std::vector<int64_t> g(R, -1);
  int64_t r = 0;
  for (size_t k = 0; k < group_rows.size(); ++k)
    for (int64_t i = 0; i < group_rows[k]; ++i) g[r++] = static_cast<int64_t>(k);
  return g;
}

// y[r, :] + scale[r] * bias[g(r), :] (scale 1 when null); padding rows unchanged. Columns of y outside W
// (a wider parent of a strided view) are not part of y.
std::vector<double> add_ref(const Tensor& y, const Tensor& bias, const float* scale, const std::vector<int64_t>& g) {
  const auto yv = to_vector(y.clone()), bv = to_vector(bias);
  const int64_t R = y.size(0), W = y.size(1);
  std::vector<double> out(yv.begin(), yv.end());
  for (int64_t r = 0; r < R; ++r)
    if (g[r] >= 0)
      for (int64_t w = 0; w < W; ++w) out[r * W + w] += (scale ? scale[r] : 1.0) * bv[g[r] * W + w];
  return out;
}

// dbias0[k, :] + sum over rows r of group k of scale[r] * dy[r, :].
std::vector<double> grad_ref(const Tensor& dbias0, const Tensor& dy, const float* scale,
                             const std::vector<int64_t>& g) {
  const auto dv = to_vector(dy.clone()), b0 = to_vector(dbias0);
  const int64_t R = dy.size(0), W = dy.size(1);
  std::vector<double> out(b0.begin(), b0.end());
  for (int64_t r = 0; r < R; ++r)
    if (g[r] >= 0)
      for (int64_t w = 0; w < W; ++w) out[g[r] * W + w] += (scale ? scale[r] : 1.0) * dv[r * W + w];
  return out;
}

// f32 adds round once (1e-6 relative); bf16 rounds the sum to 8 bits (4e-3), f16 to 11 (within the same bound).
// Gradients sum in double.
TEST(BiasAdd, MatchesReferenceOnStridedRows) {
  const int64_t N = 40, W = 24;
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor wide = randn({N, W + 8}, "y").to(t);
    const Tensor before = wide.clone();
    Tensor y = wide.slice(1, 4, 4 + W);  // row stride W + 8
    const Tensor bias = randn({W}, "bias");
    const std::vector<double> want = add_ref(y, bias, nullptr, row_groups({N}, N));
    ops::bias_add(y, bias, kCpu);
    EXPECT_TENSOR_NEAR(y.clone(), from_double({N, W}, want), t == DType::f32 ? 1e-6 : 4e-3, 1e-6);
    EXPECT_TRUE(bitwise_equal(wide.slice(1, 0, 4).clone(), before.slice(1, 0, 4).clone()));
    EXPECT_TRUE(bitwise_equal(wide.slice(1, 4 + W, W + 8).clone(), before.slice(1, 4 + W, W + 8).clone()));
  }
}

TEST(BiasGrad, AccumulatesColumnSums) {
  const int64_t N = 700, W = 300;  // several row chunks and column blocks
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    const Tensor wide = randn({N, W + 3}, "dy").to(t);
    const Tensor dy = wide.slice(1, 0, W);
    Tensor dbias = randn({W}, "dbias0");
    const std::vector<double> want = grad_ref(dbias, dy, nullptr, row_groups({N}, N));
    ops::bias_grad(dbias, dy, kCpu);
    EXPECT_TENSOR_NEAR(dbias, from_double({W}, want), 1e-6, 1e-6);
  }
}

// Groups {2, 0, 300, 5} over 310 rows: an empty group, a group over several row chunks and 3 padding rows
// (filled with huge values, which must neither change nor be read).
const std::vector<int64_t> kGroups = {2, 0, 300, 5};
constexpr int64_t kRows = 310, kG = 4;

Tensor padded_input(const char* name, DType t, int64_t W) {
  Tensor x = randn({kRows, W}, name);
  for (int64_t r = 307; r < kRows; ++r)
    for (int64_t w = 0; w < W; ++w) x.data<float>()[r * W + w] = t == DType::f16 ? 6e4f : 1e30f;  // finite
  return x.to(t);
}

TEST(BiasGrouped, AddAndGradMatchReference) {
  const int64_t W = 10;
  const auto g = row_groups(kGroups, kRows);
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor y = padded_input("y", t, W);
    const Tensor bias = randn({kG, W}, "bias");
    const std::vector<double> want = add_ref(y, bias, nullptr, g);
    ops::bias_add_grouped(y, bias, testing::counts_tensor(kGroups, Device::cpu), kCpu);
    EXPECT_TENSOR_NEAR(y, from_double({kRows, W}, want), t == DType::f32 ? 1e-6 : 4e-3, 1e-6);

    const Tensor dy = padded_input("dy", t, W);
    Tensor dbias = randn({kG, W}, "dbias0");
    const std::vector<double> want_db = grad_ref(dbias, dy, nullptr, g);
    ops::bias_grad_grouped(dbias, dy, testing::counts_tensor(kGroups, Device::cpu), kCpu);
    EXPECT_TENSOR_NEAR(dbias, from_double({kG, W}, want_db), 1e-6, 1e-6);
  }
}

TEST(BiasGroupedScaled, AddAndGradsMatchReference) {
  const int64_t W = 13;
  const auto g = row_groups(kGroups, kRows);
  const Tensor scale = randn({kRows}, "scale");
  const float* sp = scale.data<float>();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor y = padded_input("y", t, W);
    const Tensor bias = randn({kG, W}, "bias");
    const std::vector<double> want = add_ref(y, bias, sp, g);
    ops::bias_add_grouped_scaled(y, bias, scale, testing::counts_tensor(kGroups, Device::cpu), kCpu);
    EXPECT_TENSOR_NEAR(y, from_double({kRows, W}, want), t == DType::f32 ? 1e-6 : 4e-3, 1e-5);

    const Tensor dy = padded_input("dy", t, W);
    Tensor dbias = randn({kG, W}, "dbias0"), dscale = Tensor::empty({kRows}, DType::f32, MemCategory::other);
    dscale.fill_(NAN);  // written on the covered rows; the padding rows keep their NaN
    const std::vector<double> want_db = grad_ref(dbias, dy, sp, g);
    ops::bias_grad_grouped_scaled(dbias, dscale, dy, bias, scale, testing::counts_tensor(kGroups, Device::cpu), kCpu);
    EXPECT_TENSOR_NEAR(dbias, from_double({kG, W}, want_db), 1e-6, 1e-6);
    const auto dv = to_vector(dy), bv = to_vector(bias);
    std::vector<double> want_ds(kRows, 0.0);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t w = 0; w < W && g[r] >= 0; ++w) want_ds[r] += double(dv[r * W + w]) * bv[g[r] * W + w];
    const int64_t covered = std::accumulate(kGroups.begin(), kGroups.end(), int64_t{0});
    EXPECT_TENSOR_NEAR(dscale.slice(0, 0, covered), from_double({kRows}, want_ds).slice(0, 0, covered), 1e-6, 1e-6);
    for (int64_t r = covered; r < kRows; ++r) EXPECT_TRUE(std::isnan(dscale.data<float>()[r])) << "padding row " << r;

    Tensor dbias2 = randn({kG, W}, "dbias0"), no_dscale;  // without drow_scale: same dbias
    ops::bias_grad_grouped_scaled(dbias2, no_dscale, dy, bias, scale, testing::counts_tensor(kGroups, Device::cpu),
                                  kCpu);
    EXPECT_TRUE(bitwise_equal(dbias2, dbias));
  }
}

// Central differences of sum(w * (y0 + scale * bias[g])) with respect to bias and scale: the function is
// bilinear, so only float rounding of the loss remains (h = 1e-2): 1e-3.
TEST(BiasGroupedScaled, MatchesFiniteDifferences) {
  const std::vector<int64_t> groups = {3, 0, 2};
  const int64_t R = 6, W = 4;
  const Tensor y0 = randn({R, W}, "y0"), wts = randn({R, W}, "w");
  Tensor bias = randn({3, W}, "bias"), scale = randn({R}, "scale");
  auto loss = [&] {
    Tensor y = y0.clone();
    ops::bias_add_grouped_scaled(y, bias, scale, testing::counts_tensor(groups, Device::cpu), kCpu);
    return testing::weighted_sum(y, wts);
  };
  const Tensor num_bias = testing::numerical_gradient(loss, bias);
  const Tensor num_scale = testing::numerical_gradient(loss, scale);
  Tensor dbias = Tensor::zeros({3, W}, DType::f32, MemCategory::other);
  Tensor dscale = Tensor::zeros({R}, DType::f32, MemCategory::other);  // the padding row stays 0, its true value
  ops::bias_grad_grouped_scaled(dbias, dscale, wts, bias, scale, testing::counts_tensor(groups, Device::cpu), kCpu);
  EXPECT_TENSOR_NEAR(dbias, num_bias, 1e-3, 1e-3);
  EXPECT_TENSOR_NEAR(dscale, num_scale, 1e-3, 1e-3);
}

TEST(BiasGrad, IndependentOfThreadCount) {
  const Tensor dy = randn({3000, 70}, "dy");
  const std::vector<int64_t> groups = {1000, 0, 1999};
  const Tensor bias = randn({3, 70}, "bias"), scale = randn({3000}, "scale");
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    Tensor a = Tensor::zeros({70}, DType::f32, MemCategory::other);
    Tensor b = Tensor::zeros({3, 70}, DType::f32, MemCategory::other);
    Tensor ds = Tensor::zeros({3000}, DType::f32, MemCategory::other);
    ops::bias_grad(a, dy, kCpu);
    ops::bias_grad_grouped_scaled(b, ds, dy, bias, scale, testing::counts_tensor(groups, Device::cpu), kCpu);
    omp_set_num_threads(saved);
    std::vector<float> all = to_vector(a);
    for (const Tensor* t : {&b, &ds})
      for (float v : to_vector(*t)) all.push_back(v);
    return all;
  };
  const auto one = run(1), two = run(2);
  EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * sizeof(float)));
}

TEST(Bias, RejectsBadInputs) {
  Tensor y = randn({6, 4}, "y");
  const Tensor bias = randn({2, 4}, "bias"), scale = randn({6}, "scale");
  expect_error([&] { ops::bias_add(y, randn({5}, "b"), kCpu); }, {"bias_add", "bias", "[4]", "[5]"});
  expect_error(
      [&] {
        ops::bias_add_grouped(y, bias, testing::counts_tensor({3, 4}, Device::cpu), kCpu);
      },
      {"bias_add_grouped", "sum to 7", "6 rows"});
  expect_error(
      [&] {
        ops::bias_add_grouped(y, bias, testing::counts_tensor({3, -1}, Device::cpu), kCpu);
      },
      {"bias_add_grouped", "group_rows[1] = -1"});
  expect_error(
      [&] {
        ops::bias_add_grouped(y, bias, testing::counts_tensor({1, 1, 1}, Device::cpu), kCpu);
      },
      {"bias_add_grouped", "[3, 4]"});
  Tensor dbias16 = Tensor::zeros({2, 4}, DType::bf16, MemCategory::other);
  expect_error(
      [&] {
        ops::bias_grad_grouped(dbias16, y, testing::counts_tensor({3, 3}, Device::cpu), kCpu);
      },
      {"bias_grad_grouped", "dbias", "f32"});
  Tensor dscale = Tensor::empty({5}, DType::f32, MemCategory::other), dbias = Tensor::zeros({2, 4}, DType::f32);
  const auto short_dscale = [&] {
    ops::bias_grad_grouped_scaled(dbias, dscale, y, bias, scale, testing::counts_tensor({3, 3}, Device::cpu), kCpu);
  };
  expect_error(short_dscale, {"bias_grad_grouped_scaled", "drow_scale", "[6]"});
}

}  // namespace
}  // namespace moecore
