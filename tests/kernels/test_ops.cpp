// CPU op tests: every op against a naive double-precision reference, every backward against central
// finite differences (scalar = weighted_sum(out, random weights)), the accumulation rules, bf16 and f16 paths,
// thread-count independence (bitwise) and error messages. GEMM, RoPE and attention are not tested here.
// Tolerances are stated where used; FD checks use h = 1e-2 in float, so they allow ~1e-2 relative.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::numerical_gradient;
using testing::randn;
using testing::to_vector;
using testing::weighted_sum;

const ops::Context kCpu;

Tensor zeros(const Shape& s, DType t = DType::f32) {
  return Tensor::zeros(s, t, MemCategory::other);
}
Tensor empty(const Shape& s, DType t = DType::f32) {
  return Tensor::empty(s, t, MemCategory::other);
}
Tensor from(const Shape& s, const std::vector<float>& v) {
  Tensor t = empty(s);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}
Tensor ids_tensor(const std::vector<int32_t>& v) {
  Tensor t = empty(Shape{static_cast<int64_t>(v.size())}, DType::i32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}
Tensor from_double(const Shape& s, const std::vector<double>& v) {
  return from(s, std::vector<float>(v.begin(), v.end()));
}
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}
// Fn must throw moecore::Error whose message contains every needle.
using testing::expect_error;

// ---- references (double) -------------------------------------------------------------------------
std::vector<double> rmsnorm_ref(const Tensor& x, const Tensor& w, double eps) {
  const auto xv = to_vector(x), wv = to_vector(w);
  const int64_t N = x.size(0), H = x.size(1);
  std::vector<double> y(xv.size());
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t h = 0; h < H; ++h) ss += double(xv[n * H + h]) * xv[n * H + h];
    const double r = 1.0 / std::sqrt(ss / H + eps);
    for (int64_t h = 0; h < H; ++h) y[n * H + h] = xv[n * H + h] * r * wv[h];
  }
  return y;
}
std::vector<double> layernorm_ref(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  const auto xv = to_vector(x), wv = to_vector(w), bv = to_vector(b);
  const int64_t N = x.size(0), H = x.size(1);
  std::vector<double> y(xv.size());
  for (int64_t n = 0; n < N; ++n) {
    double s = 0, ss = 0;
    for (int64_t h = 0; h < H; ++h) s += xv[n * H + h];
    const double mu = s / H;
    for (int64_t h = 0; h < H; ++h) ss += (xv[n * H + h] - mu) * (xv[n * H + h] - mu);
    const double r = 1.0 / std::sqrt(ss / H + eps);
    for (int64_t h = 0; h < H; ++h) y[n * H + h] = (xv[n * H + h] - mu) * r * wv[h] + bv[h];
  }
  return y;
}
double gelu_ref(double x) {
  return 0.5 * x * std::erfc(-x / std::sqrt(2.0));
}

// ---- embedding -----------------------------------------------------------------------------------
TEST(Embedding, ForwardGathersRows) {
  Tensor table = randn(Shape{5, 3}, "table");
  Tensor ids = ids_tensor({1, 3, 1, 0});
  Tensor out = empty(Shape{4, 3}), out16 = empty(Shape{4, 3}, DType::bf16), outh = empty(Shape{4, 3}, DType::f16);
  ops::embedding_forward(out, ids, table, kCpu);
  ops::embedding_forward(out16, ids, table, kCpu);
  ops::embedding_forward(outh, ids, table, kCpu);
  for (int n = 0; n < 4; ++n)
    for (int h = 0; h < 3; ++h) {
      const float t = table.data<float>()[ids.data<int32_t>()[n] * 3 + h];
      EXPECT_EQ(out.data<float>()[n * 3 + h], t);  // a copy is exact
      EXPECT_EQ(out16.data<bf16>()[n * 3 + h].bits, float_to_bf16(t).bits);
      EXPECT_EQ(outh.data<f16>()[n * 3 + h].bits, float_to_f16(t).bits);
    }
}

TEST(Embedding, BackwardAccumulatesRepeatedIds) {
  Tensor dtable = empty(Shape{5, 3});
  dtable.fill_(1.0f);
  Tensor dout = randn(Shape{4, 3}, "dout");
  ops::embedding_backward(dtable, ids_tensor({2, 0, 2, 2}), dout, kCpu);
  const auto d = to_vector(dout), g = to_vector(dtable);
  for (int h = 0; h < 3; ++h) {
    EXPECT_NEAR(g[2 * 3 + h], 1.0 + d[h] + d[6 + h] + d[9 + h], 1e-6);  // three float adds: ~1e-7
    EXPECT_NEAR(g[0 * 3 + h], 1.0 + d[3 + h], 1e-6);
    for (int v : {1, 3, 4}) EXPECT_EQ(g[v * 3 + h], 1.0f);
  }
}

TEST(Embedding, BackwardFiniteDifferences) {
  Tensor table = randn(Shape{6, 5}, "table");
  Tensor ids = ids_tensor({4, 1, 4, 0, 5, 4, 1});
  Tensor wts = randn(Shape{7, 5}, "weights");
  Tensor out = empty(Shape{7, 5});
  auto loss = [&] {
    ops::embedding_forward(out, ids, table, kCpu);
    return weighted_sum(out, wts);
  };
  Tensor num = numerical_gradient(loss, table);
  Tensor dtable = zeros(Shape{6, 5});
  ops::embedding_backward(dtable, ids, wts, kCpu);
  EXPECT_TENSOR_NEAR(dtable, num, 1e-3, 1e-4);  // linear in the table: FD is exact up to float rounding
}

TEST(Embedding, OutOfRangeIdThrows) {
  Tensor table = randn(Shape{5, 3}, "table");
  Tensor out = empty(Shape{2, 3});
  expect_error(
      [&] {
        ops::embedding_forward(out, ids_tensor({0, 5}), table, kCpu);
      },
      {"embedding_forward", "5", "V = 5"});
  expect_error([&] { ops::embedding_forward(out, ids_tensor({-1, 0}), table, kCpu); }, {"embedding_forward", "-1"});
  Tensor dtable = zeros(Shape{5, 3});
  expect_error([&] { ops::embedding_backward(dtable, ids_tensor({7, 0}), out, kCpu); }, {"embedding_backward", "7"});
}

// ---- norms ---------------------------------------------------------------------------------------
TEST(RmsNorm, ForwardMatchesReference) {
  const int64_t N = 4, H = 13;  // H not a multiple of the vector width exercises loop tails
  Tensor x = randn(Shape{N, H}, "x"), w = randn(Shape{H}, "w", 0.5f);
  Tensor y = empty(Shape{N, H}), y16 = empty(Shape{N, H}, DType::bf16), rstd = empty(Shape{N});
  ops::rmsnorm_forward(y, rstd, x, w, 1e-5f, kCpu);
  EXPECT_TENSOR_NEAR(y, from_double(Shape{N, H}, rmsnorm_ref(x, w, 1e-5)), 1e-5, 1e-6);  // f32 vs double
  ops::rmsnorm_forward(y16, rstd, x, w, 1e-5f, kCpu);
  EXPECT_TRUE(bitwise_equal(y16, y.to(DType::bf16)));  // bf16 output = the f32 result rounded once
  Tensor yh = empty(Shape{N, H}, DType::f16);
  ops::rmsnorm_forward(yh, rstd, x, w, 1e-5f, kCpu);
  EXPECT_TRUE(bitwise_equal(yh, y.to(DType::f16)));  // likewise f16
  const auto xv = to_vector(x);
  double ss = 0;
  for (int h = 0; h < H; ++h) ss += double(xv[h]) * xv[h];
  EXPECT_NEAR(rstd.data<float>()[0], 1.0 / std::sqrt(ss / H + 1e-5), 1e-5);
}

TEST(RmsNorm, BackwardFiniteDifferences) {
  const int64_t N = 3, H = 13;
  Tensor x = randn(Shape{N, H}, "x"), w = randn(Shape{H}, "w", 0.5f), wts = randn(Shape{N, H}, "wts");
  Tensor y = empty(Shape{N, H}), rstd = empty(Shape{N});
  auto loss = [&] {
    ops::rmsnorm_forward(y, rstd, x, w, 1e-5f, kCpu);
    return weighted_sum(y, wts);
  };
  Tensor num_x = numerical_gradient(loss, x), num_w = numerical_gradient(loss, w);
  loss();
  Tensor dx = empty(Shape{N, H}), dw = zeros(Shape{H});
  ops::rmsnorm_backward(dx, dw, wts, x, w, rstd, false, kCpu);
  EXPECT_TENSOR_NEAR(dx, num_x, 1e-2, 1e-3);  // FD truncation O(h^2) plus float noise ~1e-5 / h
  EXPECT_TENSOR_NEAR(dw, num_w, 1e-2, 1e-3);
}

TEST(RmsNorm, AccumulationRules) {
  const int64_t N = 5, H = 20;
  Tensor x = randn(Shape{N, H}, "x"), w = randn(Shape{H}, "w"), dy = randn(Shape{N, H}, "dy");
  Tensor y = empty(Shape{N, H}), rstd = empty(Shape{N});
  ops::rmsnorm_forward(y, rstd, x, w, 1e-6f, kCpu);
  Tensor dx = empty(Shape{N, H}), dw = zeros(Shape{H});
  dx.fill_(std::nanf(""));  // a written dx must not read its old contents
  ops::rmsnorm_backward(dx, dw, dy, x, w, rstd, false, kCpu);
  const Tensor dw_once = dw.clone();
  Tensor dx_acc = randn(Shape{N, H}, "residual");
  const auto before = to_vector(dx_acc);
  ops::rmsnorm_backward(dx_acc, dw, dy, x, w, rstd, true, kCpu);
  const auto after = to_vector(dx_acc), d = to_vector(dx);
  // GCC may contract the += into an FMA, so allow rounding at the scale of the summands.
  for (size_t i = 0; i < d.size(); ++i)
    ASSERT_NEAR(after[i], before[i] + d[i], 1e-6 * (std::fabs(before[i]) + std::fabs(d[i])));
  for (int h = 0; h < H; ++h) EXPECT_EQ(dw.data<float>()[h], 2.0f * dw_once.data<float>()[h]);  // s + s is exact

  // A bf16 or f16 dy gives what its f32 image gives, up to FMA contraction differing between the two builds.
  for (DType t : {DType::bf16, DType::f16}) {
    Tensor dy16 = dy.to(t), dx16 = empty(Shape{N, H}), dx32 = empty(Shape{N, H});
    Tensor dw16 = zeros(Shape{H}), dw32 = zeros(Shape{H});
    ops::rmsnorm_backward(dx16, dw16, dy16, x, w, rstd, false, kCpu);
    ops::rmsnorm_backward(dx32, dw32, dy16.to(DType::f32), x, w, rstd, false, kCpu);
    EXPECT_TENSOR_NEAR(dx16, dx32, 1e-5, 1e-6);
    EXPECT_TENSOR_NEAR(dw16, dw32, 1e-5, 1e-6);
  }
}

TEST(LayerNorm, ForwardMatchesReference) {
  const int64_t N = 4, H = 19;
  Tensor x = randn(Shape{N, H}, "x", 3.0f), w = randn(Shape{H}, "w"), b = randn(Shape{H}, "b");
  x.data<float>()[0] += 100.0f;  // a large mean must not hurt the variance (two-pass)
  Tensor y = empty(Shape{N, H}), mean = empty(Shape{N}), rstd = empty(Shape{N});
  ops::layernorm_forward(y, mean, rstd, x, w, b, 1e-5f, kCpu);
  EXPECT_TENSOR_NEAR(y, from_double(Shape{N, H}, layernorm_ref(x, w, b, 1e-5)), 1e-5, 1e-5);
  for (DType t : {DType::bf16, DType::f16}) {
    Tensor y16 = empty(Shape{N, H}, t);
    ops::layernorm_forward(y16, mean, rstd, x, w, b, 1e-5f, kCpu);
    EXPECT_TRUE(bitwise_equal(y16, y.to(t))) << dtype_name(t);
  }
}

TEST(LayerNorm, BackwardFiniteDifferencesAndAccumulation) {
  const int64_t N = 3, H = 11;
  Tensor x = randn(Shape{N, H}, "x"), w = randn(Shape{H}, "w"), b = randn(Shape{H}, "b");
  Tensor wts = randn(Shape{N, H}, "wts");
  Tensor y = empty(Shape{N, H}), mean = empty(Shape{N}), rstd = empty(Shape{N});
  auto loss = [&] {
    ops::layernorm_forward(y, mean, rstd, x, w, b, 1e-5f, kCpu);
    return weighted_sum(y, wts);
  };
  Tensor num_x = numerical_gradient(loss, x), num_w = numerical_gradient(loss, w);
  Tensor num_b = numerical_gradient(loss, b);
  loss();
  Tensor dx = empty(Shape{N, H}), dw = zeros(Shape{H}), db = zeros(Shape{H});
  ops::layernorm_backward(dx, dw, db, wts, x, w, mean, rstd, false, kCpu);
  EXPECT_TENSOR_NEAR(dx, num_x, 1e-2, 1e-3);  // as for RMSNorm
  EXPECT_TENSOR_NEAR(dw, num_w, 1e-2, 1e-3);
  EXPECT_TENSOR_NEAR(db, num_b, 1e-2, 1e-3);

  const Tensor dw1 = dw.clone(), db1 = db.clone();
  Tensor dx_acc = dx.clone();
  ops::layernorm_backward(dx_acc, dw, db, wts, x, w, mean, rstd, true, kCpu);
  const auto a = to_vector(dx_acc), d = to_vector(dx);
  for (size_t i = 0; i < d.size(); ++i) ASSERT_EQ(a[i], 2.0f * d[i]);
  for (int h = 0; h < H; ++h) {
    EXPECT_EQ(dw.data<float>()[h], 2.0f * dw1.data<float>()[h]);
    EXPECT_EQ(db.data<float>()[h], 2.0f * db1.data<float>()[h]);
  }
}

// ---- activations ---------------------------------------------------------------------------------
TEST(SwiGLU, ForwardMatchesReference) {
  const int64_t N = 3, F = 9;
  Tensor gu = randn(Shape{N, 2 * F}, "gate_up", 3.0f);
  gu.data<float>()[0] = -100.0f;  // sigmoid underflow
  gu.data<float>()[1] = 100.0f;
  Tensor out = empty(Shape{N, F});
  ops::glu_forward(out, gu, ops::GluParams{}, kCpu);
  const auto g = to_vector(gu);
  std::vector<double> ref(N * F);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) {
      const double a = g[n * 2 * F + j], u = g[n * 2 * F + F + j];
      ref[n * F + j] = a / (1.0 + std::exp(-a)) * u;
    }
  EXPECT_TENSOR_NEAR(out, from_double(Shape{N, F}, ref), 1e-6, 1e-6);  // exp within ~2 ulp

  Tensor out16 = empty(Shape{N, F}, DType::bf16);
  ops::glu_forward(out16, gu.to(DType::bf16), ops::GluParams{}, kCpu);
  EXPECT_TENSOR_NEAR(out16, from_double(Shape{N, F}, ref), 2e-2,
                     2e-2);  // bf16 inputs and output: 3 roundings
  Tensor outh = empty(Shape{N, F}, DType::f16);
  ops::glu_forward(outh, gu.to(DType::f16), ops::GluParams{}, kCpu);
  EXPECT_TENSOR_NEAR(outh, from_double(Shape{N, F}, ref), 3e-3, 3e-3);  // f16: 3 roundings of 2^-11

  Tensor out3 = empty(Shape{1, N, F});  // leading dims may be folded any way
  ops::glu_forward(out3, gu.view(Shape{1, N, 2 * F}), ops::GluParams{}, kCpu);
  EXPECT_TRUE(bitwise_equal(out3.view(Shape{N, F}), out));
}

TEST(SwiGLU, BackwardFiniteDifferences) {
  const int64_t N = 3, F = 7;
  Tensor gu = randn(Shape{N, 2 * F}, "gate_up", 2.0f), wts = randn(Shape{N, F}, "wts");
  Tensor out = empty(Shape{N, F});
  auto loss = [&] {
    ops::glu_forward(out, gu, ops::GluParams{}, kCpu);
    return weighted_sum(out, wts);
  };
  Tensor num = numerical_gradient(loss, gu);
  Tensor dgu = empty(Shape{N, 2 * F});
  ops::glu_backward(dgu, wts, gu, ops::GluParams{}, kCpu);
  EXPECT_TENSOR_NEAR(dgu, num, 1e-2, 1e-3);
  Tensor dgu16 = empty(Shape{N, 2 * F}, DType::bf16);
  ops::glu_backward(dgu16, wts.to(DType::bf16), gu.to(DType::bf16), ops::GluParams{}, kCpu);
  EXPECT_TENSOR_NEAR(dgu16, dgu, 3e-2, 3e-2);  // bf16 inputs (rel 4e-3 each) through a product
  Tensor dguh = empty(Shape{N, 2 * F}, DType::f16);
  ops::glu_backward(dguh, wts.to(DType::f16), gu.to(DType::f16), ops::GluParams{}, kCpu);
  EXPECT_TENSOR_NEAR(dguh, dgu, 4e-3, 4e-3);  // f16 inputs (rel 5e-4 each): 8x tighter than bf16
}

// GPT-OSS's gated linear unit (Megatron's --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value c):
// out = min(g, c) sigmoid(1.702 min(g, c)) (clamp(u, -c, c) + 1), against a double reference; the gradient is zero
// where a clamp binds and matches central differences elsewhere (inputs kept off the clamp's kink).
TEST(Glu, ClampedQuickGegluMatchesReferenceAndFiniteDifferences) {
  const int64_t N = 4, F = 11;
  const ops::GluParams p{ops::kQuickGeluAlpha, 1.0f, 1.5f};
  Tensor gu = randn(Shape{N, 2 * F}, "gate_up", 2.0f);
  for (int64_t i = 0; i < gu.numel(); ++i)  // away from +-1.5, where the clamp's derivative jumps
    if (std::fabs(std::fabs(gu.data<float>()[i]) - 1.5f) < 0.05f) gu.data<float>()[i] += 0.2f;
  Tensor out = empty(Shape{N, F});
  ops::glu_forward(out, gu, p, kCpu);
  const auto g = to_vector(gu);
  std::vector<double> ref(N * F);
  int clamped_gates = 0, clamped_ups = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) {
      const double a = std::min<double>(g[n * 2 * F + j], 1.5), u = std::clamp<double>(g[n * 2 * F + F + j], -1.5, 1.5);
      clamped_gates += g[n * 2 * F + j] > 1.5f;
      clamped_ups += std::fabs(g[n * 2 * F + F + j]) > 1.5f;
      ref[n * F + j] = a / (1.0 + std::exp(-1.702 * a)) * (u + 1.0);
    }
  ASSERT_GT(clamped_gates, 2);
  ASSERT_GT(clamped_ups, 2);
  EXPECT_TENSOR_NEAR(out, from_double(Shape{N, F}, ref), 1e-6, 1e-6);

  Tensor wts = randn(Shape{N, F}, "wts");
  auto loss = [&] {
    ops::glu_forward(out, gu, p, kCpu);
    return weighted_sum(out, wts);
  };
  Tensor num = numerical_gradient(loss, gu);
  Tensor dgu = empty(Shape{N, 2 * F});
  ops::glu_backward(dgu, wts, gu, p, kCpu);
  EXPECT_TENSOR_NEAR(dgu, num, 1e-2, 1e-3);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) {
      if (g[n * 2 * F + j] > 1.5f) {
        EXPECT_EQ(dgu.data<float>()[n * 2 * F + j], 0.0f);
      }
      if (std::fabs(g[n * 2 * F + F + j]) > 1.5f) {
        EXPECT_EQ(dgu.data<float>()[n * 2 * F + F + j], 0.0f);
      }
    }
  // SiLU without offset or clamp is GluParams{}: bit for bit the SwiGLU of the tests above.
  Tensor a = empty(Shape{N, F}), b = empty(Shape{N, F});
  ops::glu_forward(a, gu, ops::GluParams{}, kCpu);
  ops::glu_forward(b, gu, ops::GluParams{1.0f, 0.0f, 0.0f}, kCpu);
  EXPECT_TRUE(bitwise_equal(a, b));
  expect_error([&] { ops::glu_forward(a, gu, ops::GluParams{1.0f, 0.0f, -1.0f}, kCpu); }, {"glu_forward", "clamp"});
}

TEST(GeLU, ForwardMatchesErfReference) {
  Tensor x = randn(Shape{5, 9}, "x", 2.5f);
  const float special[] = {0.0f, -10.0f, 10.0f, -5.0f, 3.0f, -0.5f};
  for (int i = 0; i < 6; ++i) x.data<float>()[i] = special[i];
  Tensor out = empty(Shape{5, 9});
  ops::gelu_forward(out, x, kCpu);
  std::vector<double> ref;
  for (float v : to_vector(x)) ref.push_back(gelu_ref(v));
  EXPECT_TENSOR_NEAR(out, from_double(Shape{5, 9}, ref), 1e-5, 1e-7);  // erfc fit: ~1e-6 relative
  Tensor out16 = empty(Shape{5, 9}, DType::bf16);
  ops::gelu_forward(out16, x.to(DType::bf16), kCpu);
  EXPECT_TENSOR_NEAR(out16, out, 2e-2, 2e-2);
  Tensor outh = empty(Shape{5, 9}, DType::f16);
  ops::gelu_forward(outh, x.to(DType::f16), kCpu);
  EXPECT_TENSOR_NEAR(outh, out, 3e-3, 3e-3);
}

TEST(GeLU, BackwardFiniteDifferences) {
  Tensor x = randn(Shape{4, 10}, "x", 2.0f), wts = randn(Shape{4, 10}, "wts");
  Tensor out = empty(Shape{4, 10});
  auto loss = [&] {
    ops::gelu_forward(out, x, kCpu);
    return weighted_sum(out, wts);
  };
  Tensor num = numerical_gradient(loss, x);
  Tensor dx = empty(Shape{4, 10});
  ops::gelu_backward(dx, wts, x, kCpu);
  EXPECT_TENSOR_NEAR(dx, num, 1e-2, 1e-3);
}

// ---- softmax cross-entropy -----------------------------------------------------------------------
TEST(CrossEntropy, LossAndGradientMatchReference) {
  const int64_t N = 4, V = 11;
  Tensor logits = randn(Shape{N, V}, "logits", 3.0f);
  Tensor labels = ids_tensor({3, -1, 0, 10});
  const auto z = to_vector(logits);
  Tensor loss = empty(Shape{N}), loss_nograd = empty(Shape{N});
  Tensor keep = logits.clone();
  ops::softmax_cross_entropy(loss_nograd, keep, labels, 1.0f, false, kCpu);
  EXPECT_TRUE(bitwise_equal(keep, logits));  // without compute_grad the logits are left alone
  ops::softmax_cross_entropy(loss, logits, labels, 1.0f, true, kCpu);
  std::vector<double> ref_loss(N), ref_grad(N * V, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const int lab = labels.data<int32_t>()[n];
    if (lab < 0) continue;
    double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, double(z[n * V + v]));
    for (int64_t v = 0; v < V; ++v) s += std::exp(z[n * V + v] - m);
    ref_loss[n] = m + std::log(s) - z[n * V + lab];
    for (int64_t v = 0; v < V; ++v) ref_grad[n * V + v] = std::exp(z[n * V + v] - m) / s - (v == lab);
  }
  EXPECT_TENSOR_NEAR(loss, from_double(Shape{N}, ref_loss), 1e-5, 1e-6);
  EXPECT_TENSOR_NEAR(loss_nograd, loss, 1e-6, 1e-7);
  EXPECT_TENSOR_NEAR(logits, from_double(Shape{N, V}, ref_grad), 1e-5, 1e-7);
  EXPECT_EQ(loss.data<float>()[1], 0.0f);  // ignored row: zero loss, zero gradient
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(logits.data<float>()[V + v], 0.0f);
}

TEST(CrossEntropy, FiniteDifferencesAndGradScale) {
  const int64_t N = 3, V = 7;
  Tensor logits = randn(Shape{N, V}, "logits", 2.0f);
  Tensor labels = ids_tensor({6, 2, 0});
  Tensor loss = empty(Shape{N});
  auto total = [&] {
    Tensor z = logits.clone();
    ops::softmax_cross_entropy(loss, z, labels, 1.0f, false, kCpu);
    return weighted_sum(loss, from(Shape{N}, {1.0f, 1.0f, 1.0f}));
  };
  Tensor num = numerical_gradient(total, logits);
  Tensor grad = logits.clone(), grad_scaled = logits.clone();
  ops::softmax_cross_entropy(loss, grad, labels, 1.0f, true, kCpu);
  EXPECT_TENSOR_NEAR(grad, num, 1e-2, 1e-3);
  ops::softmax_cross_entropy(loss, grad_scaled, labels, 0.25f, true, kCpu);
  const auto g = to_vector(grad), gs = to_vector(grad_scaled);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(gs[i], 0.25f * g[i], 1e-7);
}

TEST(CrossEntropy, ExtremeLogitsStayFinite) {
  const int64_t V = 4;
  Tensor logits = from(Shape{3, V}, {1000, -1000, 0, 5, 1000, -1000, 0, 5, -1000, -1000, -1000, -1000});
  Tensor labels = ids_tensor({1, 0, 2});
  Tensor loss = empty(Shape{3});
  ops::softmax_cross_entropy(loss, logits, labels, 1.0f, true, kCpu);
  EXPECT_FLOAT_EQ(loss.data<float>()[0], 2000.0f);
  EXPECT_EQ(loss.data<float>()[1], 0.0f);  // e^-995 and smaller vanish next to 1
  EXPECT_NEAR(loss.data<float>()[2], std::log(4.0), 1e-6);
  for (int n = 0; n < 3; ++n) {
    double row = 0;
    for (int v = 0; v < V; ++v) {
      const float gv = logits.data<float>()[n * V + v];
      EXPECT_TRUE(std::isfinite(gv));
      row += gv;
    }
    EXPECT_NEAR(row, 0.0, 1e-6);  // softmax sums to one, minus the one-hot
  }
  EXPECT_FLOAT_EQ(logits.data<float>()[0], 1.0f);
  EXPECT_FLOAT_EQ(logits.data<float>()[1], -1.0f);
}

TEST(CrossEntropy, StridedLogitsView) {
  const int64_t N = 5, V = 37;
  Tensor wide = randn(Shape{N, V + 5}, "wide");
  const Tensor wide_before = wide.clone();
  Tensor view = wide.slice(1, 0, V);
  Tensor dense = view.clone();
  Tensor labels = ids_tensor({0, 36, -5, 7, 20});
  Tensor loss_v = empty(Shape{N}), loss_d = empty(Shape{N});
  ops::softmax_cross_entropy(loss_v, view, labels, 0.5f, true, kCpu);
  ops::softmax_cross_entropy(loss_d, dense, labels, 0.5f, true, kCpu);
  EXPECT_TRUE(bitwise_equal(loss_v, loss_d));
  EXPECT_TRUE(bitwise_equal(view.clone(), dense));
  for (int64_t n = 0; n < N; ++n)  // the columns past V are not touched
    for (int64_t v = V; v < V + 5; ++v)
      EXPECT_EQ(wide.data<float>()[n * (V + 5) + v], wide_before.data<float>()[n * (V + 5) + v]);
}

TEST(CrossEntropy, LabelOutOfRangeThrows) {
  Tensor logits = randn(Shape{2, 6}, "logits"), loss = empty(Shape{2});
  expect_error(
      [&] {
        ops::softmax_cross_entropy(loss, logits, ids_tensor({0, 6}), 1.0f, true, kCpu);
      },
      {"softmax_cross_entropy", "label 6", "V = 6"});
}

// ---- elementwise ---------------------------------------------------------------------------------
TEST(Elementwise, AddEveryDtypeMix) {
  const Shape s{3, 41};
  const Tensor a32 = randn(s, "a"), b32 = randn(s, "b");
  for (DType to : {DType::f32, DType::bf16, DType::f16})
    for (DType ta : {DType::f32, DType::bf16, DType::f16})
      for (DType tb : {DType::f32, DType::bf16, DType::f16}) {
        const Tensor a = a32.to(ta), b = b32.to(tb);
        Tensor out = empty(s, to);
        ops::add(out, a, b, kCpu);
        const auto av = to_vector(a), bv = to_vector(b);
        std::vector<float> sum(av.size());
        for (size_t i = 0; i < av.size(); ++i) sum[i] = av[i] + bv[i];
        EXPECT_TRUE(bitwise_equal(out, from(s, sum).to(to))) << dtype_name(to) << dtype_name(ta) << dtype_name(tb);
      }
  Tensor a = a32.clone();  // out aliasing an input
  ops::add(a, a, b32, kCpu);
  EXPECT_FLOAT_EQ(a.data<float>()[5], a32.data<float>()[5] + b32.data<float>()[5]);
}

// An f16 sum beyond 65504 overflows to ±inf (IEEE half; loss scaling needs the overflow visible), one that rounds
// to 65504 does not; flag_nonfinite sees the infinity.
TEST(Elementwise, AddF16OverflowsToInf) {
  const Tensor a = from(Shape{4}, {60000.0f, -60000.0f, 32752.0f, 65000.0f}).to(DType::f16);
  const Tensor b = from(Shape{4}, {10000.0f, -10000.0f, 32752.0f, 500.0f}).to(DType::f16);
  Tensor out = empty(Shape{4}, DType::f16);
  ops::add(out, a, b, kCpu);
  EXPECT_EQ(to_vector(out), (std::vector<float>{INFINITY, -INFINITY, 65504.0f, 65504.0f}));
  Tensor flag = zeros(Shape{1}, DType::i32);
  ops::flag_nonfinite(flag, out.slice(0, 2, 4).clone(), kCpu);
  EXPECT_EQ(flag.data<int32_t>()[0], 0);
  ops::flag_nonfinite(flag, out, kCpu);
  EXPECT_EQ(flag.data<int32_t>()[0], 1);
}

TEST(Elementwise, ScaleSumSquaresAllFinite) {
  Tensor x = randn(Shape{100003}, "x");  // not a multiple of the 8192-element chunk
  const auto xv = to_vector(x);
  double ref = 0;
  for (float v : xv) ref += double(v) * v;
  EXPECT_NEAR(testing::sum_squares(x), ref, 1e-12 * ref);  // double accumulation, ~1e-16 per add
  Tensor acc = zeros(Shape{1}, DType::f64);                // the op adds to acc: twice gives twice the sum
  ops::sum_squares(acc, x, kCpu);
  ops::sum_squares(acc, x, kCpu);
  EXPECT_NEAR(acc.data<double>()[0], 2 * ref, 2e-12 * ref);
  const Tensor x16 = x.to(DType::bf16), xh = x.to(DType::f16);
  for (const Tensor* t : {&x16, &xh}) {
    double ref16 = 0;
    for (float v : to_vector(*t)) ref16 += double(v) * v;
    EXPECT_NEAR(testing::sum_squares(*t), ref16, 1e-12 * ref16);
  }

  ops::scale(x, 0.5f, kCpu);
  EXPECT_EQ(x.data<float>()[17], 0.5f * xv[17]);

  EXPECT_TRUE(testing::all_finite(x));
  EXPECT_TRUE(testing::all_finite(x16));
  EXPECT_TRUE(testing::all_finite(xh));
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    Tensor y = x.clone();
    y.data<float>()[100002] = bad;
    EXPECT_FALSE(testing::all_finite(y));
    EXPECT_FALSE(testing::all_finite(y.to(DType::bf16)));
    EXPECT_FALSE(testing::all_finite(y.to(DType::f16)));
  }
  Tensor big = x.clone();  // finite in f32 and bf16, beyond f16's range
  big.data<float>()[4242] = 70000.0f;
  EXPECT_TRUE(testing::all_finite(big.to(DType::bf16)));
  EXPECT_FALSE(testing::all_finite(big.to(DType::f16)));
  EXPECT_TRUE(testing::all_finite(from(Shape{1}, {65504.0f}).to(DType::f16)));
  EXPECT_TRUE(testing::all_finite(from(Shape{1}, {3.0e38f})));
  Tensor flag = zeros(Shape{1}, DType::i32);  // a finite tensor leaves a raised flag raised
  flag.data<int32_t>()[0] = 1;
  ops::flag_nonfinite(flag, x, kCpu);
  EXPECT_EQ(flag.data<int32_t>()[0], 1);
}

// Zeros after scaling: exact zeros of either sign, and values whose product with the scale underflows f32; NaN and
// the smallest normal times 1 are not zero. The op adds to acc.
TEST(Elementwise, CountZerosAfterScaling) {
  Tensor x = randn(Shape{100003}, "x");  // many threads' worth
  const int64_t zero_at[] = {0, 17, 4096, 65537, 100002};
  for (int64_t i : zero_at) x.data<float>()[i] = i % 2 ? -0.0f : 0.0f;
  x.data<float>()[5] = 1e-30f;    // * 1e-20 underflows
  x.data<float>()[6] = NAN;       // never zero
  x.data<float>()[7] = 1.2e-38f;  // normal: zero only once scaled down
  for (const auto& [scale, want] : {std::pair{1.0f, int64_t{5}}, std::pair{1e-20f, int64_t{7}}}) {
    Tensor acc = zeros(Shape{1}, DType::i64);
    acc.data<int64_t>()[0] = 3;
    ops::count_zeros(acc, x, scale, kCpu);
    EXPECT_EQ(acc.data<int64_t>()[0], 3 + want) << "scale " << scale;
    Tensor acc16 = zeros(Shape{1}, DType::i64);
    ops::count_zeros(acc16, x.to(DType::bf16), scale, kCpu);  // bf16 keeps the zeros and the tiny values
    EXPECT_EQ(acc16.data<int64_t>()[0], want) << "bf16, scale " << scale;
  }
  Tensor wrong = zeros(Shape{1}, DType::f64);
  expect_error([&] { ops::count_zeros(wrong, x, 1.0f, kCpu); }, {"count_zeros", "acc"});
}

// ---- AdamW ---------------------------------------------------------------------------------------
// Two steps by hand, lr 0.1, betas (0.9, 0.999), eps 1e-8, grads g1 = (0.1, -0.2, 0), g2 = (0.3, 0, -0.4):
//   step 1: m = 0.1 g1, v = 0.001 g1^2, m_hat = g1, v_hat = g1^2, so p -= 0.1 g1 / (|g1| + eps).
//   step 2: m = 0.09 g1 + 0.1 g2, v = 0.000999 g1^2 + 0.001 g2^2, m_hat = m / 0.19, v_hat = v / 0.001999.
// With weight decay 0.01 each step first multiplies p by 1 - 0.1 * 0.01; grad_scale 0.5 halves g.
TEST(AdamW, TwoStepsByHand) {
  struct Case {
    float wd, gscale;
    std::vector<float> p1, p2, m2, v2;
  };
  const Case cases[] = {
      {0.0f,
       1.0f,
       {0.90000001f, -1.9f, 0.5f},
       {0.808221902f, -1.83299418f, 0.57441368f},
       {0.039f, -0.018f, -0.04f},
       {9.999e-05f, 3.996e-05f, 0.00016f}},
      {0.01f,
       0.5f,
       {0.89900002f, -1.89800001f, 0.4995f},
       {0.806322916f, -1.82909619f, 0.573414177f},
       {0.0195f, -0.009f, -0.02f},
       {2.49975e-05f, 9.99e-06f, 4e-05f}},
  };
  for (const Case& c : cases) {
    Tensor p = from(Shape{3}, {1.0f, -2.0f, 0.5f}), m = zeros(Shape{3}), v = zeros(Shape{3});
    ops::AdamWParams hp;
    hp.lr = 0.1f;
    hp.weight_decay = c.wd;
    hp.grad_scale = c.gscale;
    ops::adamw_step(p, from(Shape{3}, {0.1f, -0.2f, 0.0f}), m, v, hp, kCpu);
    EXPECT_TENSOR_NEAR(p, from(Shape{3}, c.p1), 1e-6, 1e-7);  // float math vs exact: a few ulp
    hp.step = 2;
    ops::adamw_step(p, from(Shape{3}, {0.3f, 0.0f, -0.4f}), m, v, hp, kCpu);
    EXPECT_TENSOR_NEAR(p, from(Shape{3}, c.p2), 1e-6, 1e-7);
    EXPECT_TENSOR_NEAR(m, from(Shape{3}, c.m2), 1e-6, 1e-9);
    // 0.999f is 0.99900001287, so 1 - beta2 is 1.3e-5 (relative) off the decimal hand value; the bias
    // correction uses the same float beta2, which is why p still matches to 1e-6.
    EXPECT_TENSOR_NEAR(v, from(Shape{3}, c.v2), 3e-5, 1e-12);
  }
}

TEST(AdamW, Bf16StatesTrackF32States) {
  const int64_t n = 4096;
  Tensor p32 = randn(Shape{n}, "param"), p16 = p32.clone();
  Tensor m32 = zeros(Shape{n}), v32 = zeros(Shape{n});
  Tensor m16 = zeros(Shape{n}, DType::bf16), v16 = zeros(Shape{n}, DType::bf16);
  ops::AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  for (int step = 1; step <= 10; ++step) {
    hp.step = step;
    Tensor g = randn(Shape{n}, "grad", 1.0f, 100 + step);
    ops::adamw_step(p32, g, m32, v32, hp, kCpu);
    ops::adamw_step(p16, g, m16, v16, hp, kCpu);
    if (step == 1) {  // from zero states both compute the same f32 moments; bf16 stores them rounded
      EXPECT_TRUE(bitwise_equal(m16, m32.to(DType::bf16)));
      EXPECT_TRUE(bitwise_equal(v16, v32.to(DType::bf16)));
      EXPECT_TRUE(bitwise_equal(p16, p32));
    }
  }
  // Each step moves a parameter by ~lr; bf16 moments (8-bit mantissas) perturb a step by well under 1%,
  // so after 10 steps the two runs agree to ~0.1 lr with a wide margin.
  EXPECT_TENSOR_NEAR(p16, p32, 0.0, 0.1 * hp.lr);
  // |m| stays below ~1 and each bf16 store rounds by <= 2^-9 relative; ten decayed roundings stay < 1e-2.
  EXPECT_TENSOR_NEAR(m16, m32, 0.0, 1e-2);
}

// bf16 and f16 parameters (Megatron-FSDP's --megatron-fsdp-main-params-dtype): each step is the f32 update of the
// stored value, rounded to the nearest even of the type -- bitwise an f32 step from the same value, then a cast.
TEST(AdamW, HalfParametersAreTheF32UpdateRounded) {
  const int64_t n = 4096;
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor half = randn(Shape{n}, "param").to(dt);
    Tensor m = zeros(Shape{n}), v = zeros(Shape{n}), m32 = zeros(Shape{n}), v32 = zeros(Shape{n});
    ops::AdamWParams hp;
    hp.lr = 1e-2f;
    hp.weight_decay = 0.1f;
    for (int step = 1; step <= 3; ++step) {
      hp.step = step;
      const Tensor g = randn(Shape{n}, "grad", 1.0f, 200 + step);
      Tensor wide = half.to(DType::f32);
      ops::adamw_step(wide, g, m32, v32, hp, kCpu);
      ops::adamw_step(half, g, m, v, hp, kCpu);
      EXPECT_TRUE(bitwise_equal(half, wide.to(dt))) << "step " << step;
      EXPECT_TRUE(bitwise_equal(m, m32)) << "step " << step;
    }
  }
}

// Lion (Chen et al. 2023, emerging_optimizers' update): the decoupled decay, the sign of beta1 m + (1 - beta1) g (0 at
// 0), the momentum moved towards g by 1 - beta2 -- against the formula in double over two steps, with a clip scale, a
// zero gradient and weight decay; bad betas are named.
TEST(Lion, StepIsTheFormula) {
  const std::vector<float> p0 = {1.0f, -2.0f, 0.5f, 0.25f}, g1 = {0.3f, -0.1f, 0.0f, 2.0f},
                           g2 = {-0.5f, 0.2f, 0.0f, 1e-3f};
  Tensor p = from(Shape{4}, p0), m = zeros(Shape{4});
  ops::LionParams hp;
  hp.lr = 0.1f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.99f;
  hp.weight_decay = 0.5f;
  hp.grad_scale = 0.5f;
  std::vector<double> pw(p0.begin(), p0.end()), mw(4, 0.0);
  for (const auto* g : {&g1, &g2}) {
    ops::lion_step(p, from(Shape{4}, *g), m, hp, kCpu);
    for (size_t i = 0; i < 4; ++i) {
      const double gs = 0.5 * (*g)[i], c = 0.9 * mw[i] + 0.1 * gs;
      pw[i] = pw[i] * (1 - 0.1 * 0.5) - 0.1 * (c > 0 ? 1 : c < 0 ? -1 : 0);
      mw[i] = mw[i] + 0.01 * (gs - mw[i]);
    }
  }
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(p.data<float>()[i], pw[i], 1e-6) << i;
    EXPECT_NEAR(m.data<float>()[i], mw[i], 1e-8) << i;
  }
  EXPECT_FLOAT_EQ(p.data<float>()[2], static_cast<float>(0.5 * 0.95 * 0.95));  // (no gradient: the decay alone)
  hp.beta2 = 1.0f;
  expect_error([&] { ops::lion_step(p, from(Shape{4}, g1), m, hp, kCpu); }, {"lion_step", "betas"});
}

TEST(AdamW, RejectsBadStep) {
  Tensor p = zeros(Shape{2}), g = zeros(Shape{2}), m = zeros(Shape{2}), v = zeros(Shape{2});
  ops::AdamWParams hp;
  hp.step = 0;
  expect_error([&] { ops::adamw_step(p, g, m, v, hp, kCpu); }, {"adamw_step", "step"});
}

// ---- determinism and errors ----------------------------------------------------------------------
// Runs fn with 1 and then 2 OpenMP threads; its outputs must agree bit for bit.
void expect_thread_independent(const char* what, const std::function<std::vector<Tensor>()>& fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = fn();
  omp_set_num_threads(2);
  const auto two = fn();
  omp_set_num_threads(saved);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(bitwise_equal(one[i], two[i])) << what << " output " << i;
}

TEST(Determinism, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 600, H = 256, V = 50;  // above the parallel threshold
  const Tensor x = randn(Shape{N, H}, "x"), w = randn(Shape{H}, "w"), b = randn(Shape{H}, "b");
  const Tensor dy = randn(Shape{N, H}, "dy");
  expect_thread_independent("rmsnorm_backward", [&] {
    Tensor y = empty(Shape{N, H}), rstd = empty(Shape{N}), dx = empty(Shape{N, H}), dw = zeros(Shape{H});
    ops::rmsnorm_forward(y, rstd, x, w, 1e-5f, kCpu);
    ops::rmsnorm_backward(dx, dw, dy, x, w, rstd, false, kCpu);
    return std::vector<Tensor>{y, dx, dw};
  });
  expect_thread_independent("layernorm_backward", [&] {
    Tensor y = empty(Shape{N, H}), mean = empty(Shape{N}), rstd = empty(Shape{N});
    Tensor dx = empty(Shape{N, H}), dw = zeros(Shape{H}), db = zeros(Shape{H});
    ops::layernorm_forward(y, mean, rstd, x, w, b, 1e-5f, kCpu);
    ops::layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, false, kCpu);
    return std::vector<Tensor>{y, dx, dw, db};
  });
  expect_thread_independent("embedding_backward", [&] {
    std::vector<int32_t> ids(N);
    for (int64_t n = 0; n < N; ++n) ids[n] = static_cast<int32_t>((n * 7) % V);
    Tensor dtable = zeros(Shape{V, H});
    ops::embedding_backward(dtable, ids_tensor(ids), dy, kCpu);
    return std::vector<Tensor>{dtable};
  });
  expect_thread_independent("softmax_cross_entropy", [&] {
    Tensor logits = x.view(Shape{N * H / 2048, 2048}).clone(), loss = empty(Shape{N * H / 2048});
    std::vector<int32_t> labels(N * H / 2048);
    for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>(i * 31 % 2048) - (i % 5 == 0);
    ops::softmax_cross_entropy(loss, logits, ids_tensor(labels), 0.01f, true, kCpu);
    return std::vector<Tensor>{loss, logits};
  });
  expect_thread_independent("elementwise", [&] {
    Tensor ss = empty(Shape{1}, DType::i64);  // all 64 bits of the double
    ss.data<int64_t>()[0] = std::bit_cast<int64_t>(testing::sum_squares(x));
    Tensor p = x.clone(), m = zeros(Shape{N, H}, DType::bf16), v = zeros(Shape{N, H});
    ops::adamw_step(p, dy, m, v, ops::AdamWParams{}, kCpu);
    Tensor act = empty(Shape{N, H / 2});
    ops::glu_forward(act, x, ops::GluParams{}, kCpu);
    Tensor g = empty(Shape{N, H});
    ops::gelu_backward(g, dy, x, kCpu);
    return std::vector<Tensor>{ss, p, m, v, act, g};
  });
}

TEST(Errors, BadShapesNameTheOp) {
  Tensor x = randn(Shape{4, 8}, "x"), w = randn(Shape{8}, "w"), w9 = randn(Shape{9}, "w9");
  Tensor y = empty(Shape{4, 8}), r = empty(Shape{4}), y7 = empty(Shape{4, 7}), ids = ids_tensor({0, 1, 2, 3});
  expect_error([&] { ops::rmsnorm_forward(y, r, x, w9, 1e-5f, kCpu); }, {"rmsnorm_forward", "w", "[9] f32"});
  expect_error([&] { ops::rmsnorm_backward(y7, w, x, x, w, r, false, kCpu); }, {"rmsnorm_backward", "[4, 7]"});
  expect_error([&] { ops::layernorm_forward(y, r, r, x, w, w9, 1e-5f, kCpu); }, {"layernorm_forward", "b"});
  expect_error([&] { ops::layernorm_backward(y, w, w9, x, x, w, r, r, false, kCpu); }, {"layernorm_backward"});
  expect_error([&] { ops::embedding_forward(y7, ids, x, kCpu); }, {"embedding_forward", "[4, 7]"});
  expect_error([&] { ops::embedding_backward(x, ids, y7, kCpu); }, {"embedding_backward"});
  expect_error([&] { ops::glu_forward(y, x, ops::GluParams{}, kCpu); }, {"glu_forward", "gate_up"});
  expect_error([&] { ops::glu_backward(x, y7, x, ops::GluParams{}, kCpu); }, {"glu_backward"});
  expect_error([&] { ops::gelu_forward(y7, x, kCpu); }, {"gelu_forward"});
  expect_error([&] { ops::gelu_backward(y, y7, x, kCpu); }, {"gelu_backward"});
  expect_error([&] { ops::add(y, x, y7, kCpu); }, {"add", "[4, 7] f32"});
  expect_error([&] { ops::softmax_cross_entropy(w, x, ids, 1.0f, true, kCpu); }, {"softmax_cross_entropy", "loss"});
  expect_error([&] { ops::adamw_step(x, y7, y, y, ops::AdamWParams{}, kCpu); }, {"adamw_step", "grad"});
  Tensor xi = empty(Shape{4, 8}, DType::i32);
  expect_error([&] { ops::scale(xi, 2.0f, kCpu); }, {"scale", "i32"});
  Tensor acc = zeros(Shape{1}, DType::f64), flag = zeros(Shape{1}, DType::i32);
  expect_error([&] { ops::sum_squares(acc, xi, kCpu); }, {"sum_squares"});
  expect_error([&] { ops::sum_squares(flag, x, kCpu); }, {"sum_squares", "acc", "f64"});
  expect_error([&] { ops::flag_nonfinite(flag, x.slice(1, 0, 4), kCpu); }, {"flag_nonfinite", "contiguous"});
  const ops::Context cuda{Device::cuda, nullptr};
  // A host tensor with a cuda context: refused naming the op and the device (with the CUDA kernels built: the
  // tensor is not on the op's device; without them: this build has only the CPU kernels).
  expect_error([&] { ops::scale(x, 2.0f, cuda); }, {"scale", "cuda"});
  Tensor x16 = x.to(DType::bf16);
  expect_error([&] { ops::gelu_forward(y, x16, kCpu); }, {"gelu_forward", "dtype"});
}

}  // namespace
}  // namespace moecore

namespace moecore {
namespace {
// What --device cuda checks at start-up besides the device: the run-time libraries of the CUDA kernels (cuBLAS) load,
// or the reason names the library and where it was looked for; a build without the CUDA kernels says so.
TEST(Backends, CudaLibrariesLoadOrTheReasonNamesThem) {
  const std::string why = ops::cuda_libraries_unavailable_reason();
  if (!ops::cuda_kernels_built()) {
    EXPECT_NE(why.find("no CUDA kernels"), std::string::npos) << why;
    return;
  }
  if (!why.empty()) {
    EXPECT_NE(why.find("libcublas.so."), std::string::npos) << why;
    EXPECT_NE(why.find("LD_LIBRARY_PATH"), std::string::npos) << why;
  }
}
}  // namespace
}  // namespace moecore
