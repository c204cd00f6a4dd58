// ops::newton_schulz and Muon's elementwise ops (ops.h): the coefficient sets as emerging_optimizers v0.3.0 lists them;
// the orthogonalisation of X = U diag(sigma) V^T equals U diag(p(sigma / ||sigma||)) V^T, p the scalar iteration of the
// coefficients (f32 and bf16 products), on random and ill-conditioned spectra, with the output's singular values near 1
// wherever the input's are not tiny; either orientation, a batch of matrices, forced orientation with a shard sum;
// the zero matrix; bad input named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/kernels/common/muon.h"
#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::error_of;

// A column-orthonormal n x k matrix (Gram-Schmidt in double on a random one), row-major.
std::vector<double> orthonormal(int64_t n, int64_t k, uint64_t seed) {
  const Tensor r = testing::randn({n, k}, "orthonormal", 1.0f, seed);
  std::vector<double> q(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < n * k; ++i) q[static_cast<size_t>(i)] = r.data<float>()[i];
  for (int64_t j = 0; j < k; ++j) {
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t p = 0; p < j; ++p) {
        double d = 0;
        for (int64_t i = 0; i < n; ++i) d += q[i * k + j] * q[i * k + p];
        for (int64_t i = 0; i < n; ++i) q[i * k + j] -= d * q[i * k + p];
      }
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += q[i * k + j] * q[i * k + j];
    for (int64_t i = 0; i < n; ++i) q[i * k + j] /= std::sqrt(s);
  }
  return q;
}

// The m x n matrix U diag(d) V^T (U m x r, V n x r), as f32 and in double.
Tensor from_spectrum(const std::vector<double>& u, const std::vector<double>& v, const std::vector<double>& d,
                     int64_t m, int64_t n) {
  const int64_t r = static_cast<int64_t>(d.size());
  Tensor x = Tensor::empty({m, n}, DType::f32, MemCategory::other);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t k = 0; k < r; ++k) s += u[i * r + k] * d[static_cast<size_t>(k)] * v[j * r + k];
      x.data<float>()[i * n + j] = static_cast<float>(s);
    }
  return x;
}

// The scalar map of `steps` Newton-Schulz steps on each normalised singular value.
std::vector<double> scalar_iteration(std::vector<double> s, ops::NsCoefficients c, int steps) {
  double norm = 0;
  for (double v : s) norm += v * v;
  norm = std::sqrt(norm);
  for (double& v : s) {
    v /= norm;
    for (int k = 0; k < steps; ++k) {
      const ops::muon::NsStep t = ops::muon::ns_step(c, k);
      v = t.a * v + t.b * v * v * v + t.c * v * v * v * v * v;
    }
  }
  return s;
}

Tensor orthogonalised(const Tensor& x, const ops::NewtonSchulz& p) {
  Tensor y = testing::on_test_device(x.clone());  // (on the cpu, the tensor itself)
  ops::newton_schulz(y, p, {}, ops::Context{y.device()});
  return testing::host(y);
}

TEST(NewtonSchulz, CoefficientSetsAndSchedulesAreEmergingOptimizers) {
  using ops::NsCoefficients;
  using ops::muon::ns_step;
  const ops::muon::NsStep q0 = ns_step(NsCoefficients::quintic, 0), q4 = ns_step(NsCoefficients::quintic, 4);
  EXPECT_EQ(q0.a, 4.0848f);
  EXPECT_EQ(q0.b, -6.8946f);
  EXPECT_EQ(q0.c, 2.9270f);
  EXPECT_EQ(q4.a, 2.8366f);
  EXPECT_EQ(q4.b, -3.0525f);
  EXPECT_EQ(q4.c, 1.2012f);
  EXPECT_EQ(ns_step(NsCoefficients::quintic, 5).a, q0.a);  // cycles
  EXPECT_EQ(ns_step(NsCoefficients::simple, 3).b, -4.7750f);
  EXPECT_EQ(ns_step(NsCoefficients::polar_express, 0).c, 16.4607f);
  EXPECT_EQ(ns_step(NsCoefficients::polar_express, 20).a, 1.8750f);  // repeats its last
  EXPECT_EQ(ns_step(NsCoefficients::cans, 9).b, -1.6447f);
  EXPECT_EQ(ns_step(NsCoefficients::aol, 4).a, 4.0098f);
  EXPECT_EQ(ns_step(NsCoefficients::deepseekv4, 7).a, 3.4445f);
  EXPECT_EQ(ns_step(NsCoefficients::deepseekv4, 8).a, 2.0f);
  EXPECT_EQ(ns_step(NsCoefficients::deepseekv4, 30).c, 0.5f);
  EXPECT_EQ(enum_parse<NsCoefficients>("polar_express", "t"), NsCoefficients::polar_express);
}

// X = U diag(sigma) V^T: NS(X) = U diag(p(sigma)) V^T, checked element-wise against the product in double; the output's
// singular values are near 1 wherever sigma / ||sigma|| >= 3e-3 (quintic).
TEST(NewtonSchulz, ActsOnSingularValuesAsTheScalarIteration) {
  struct Case {
    int64_t m, n;
    std::vector<double> sigma;
    const char* what;
  };
  std::vector<double> flat(12, 1.0), decaying, ill;
  for (int k = 0; k < 12; ++k) decaying.push_back(std::exp(-0.3 * k));
  for (int k = 0; k < 12; ++k) ill.push_back(std::pow(10.0, -2.0 * k / 11.0));  // condition number 100
  const Case cases[] = {{12, 20, flat, "flat"},
                        {12, 20, decaying, "decaying"},
                        {20, 12, ill, "ill-conditioned, tall"},
                        {12, 12, ill, "ill-conditioned, square"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const int64_t r = static_cast<int64_t>(c.sigma.size());
    const auto u = orthonormal(c.m, r, 11), v = orthonormal(c.n, r, 12);
    const Tensor x = from_spectrum(u, v, c.sigma, c.m, c.n);
    const std::vector<double> p = scalar_iteration(c.sigma, ops::NsCoefficients::quintic, 5);
    const Tensor want = from_spectrum(u, v, p, c.m, c.n);
    for (double s : p) {
      EXPECT_GE(s, 0.95);
      EXPECT_LE(s, 1.16);
    }
    ops::NewtonSchulz ns;
    ns.bf16 = false;
    EXPECT_TENSOR_NEAR(orthogonalised(x, ns), want, 0.0, 2e-5);
    ns.bf16 = true;  // Megatron's default precision: every product rounded to bf16
    EXPECT_TENSOR_NEAR(orthogonalised(x, ns), want, 0.0, 3e-2);
  }
}

TEST(NewtonSchulz, OtherCoefficientsAndStepCounts) {
  const std::vector<double> sigma = {1.0, 0.7, 0.4, 0.2, 0.1, 0.05};
  const auto u = orthonormal(6, 6, 21), v = orthonormal(10, 6, 22);
  const Tensor x = from_spectrum(u, v, sigma, 6, 10);
  for (auto c : {ops::NsCoefficients::simple, ops::NsCoefficients::polar_express, ops::NsCoefficients::cans,
                 ops::NsCoefficients::aol, ops::NsCoefficients::deepseekv4})
    for (int steps : {1, 3, 10}) {
      SCOPED_TRACE(std::string(enum_name(c)) + " x " + std::to_string(steps));
      ops::NewtonSchulz ns;
      ns.bf16 = false;
      ns.coefficients = c;
      ns.steps = steps;
      EXPECT_TENSOR_NEAR(orthogonalised(x, ns), from_spectrum(u, v, scalar_iteration(sigma, c, steps), 6, 10), 0.0,
                         5e-5);
    }
}

// Either orientation gives the transpose of the other's result; a batch equals its matrices one by one; a forced
// orientation with a shard sum that sums one shard is the plain result, its calls the norms then one per step.
TEST(NewtonSchulz, OrientationBatchAndShardSum) {
  ops::NewtonSchulz ns;
  ns.bf16 = false;
  const Tensor x = testing::randn({3, 8, 14}, "ns.batch");
  const Tensor whole = orthogonalised(x, ns);
  for (int64_t g = 0; g < 3; ++g) {
    const Tensor one = orthogonalised(x.select(0, g).clone(), ns);
    EXPECT_TENSOR_NEAR(whole.select(0, g).clone(), one, 0.0, 1e-6);
    Tensor xt = Tensor::empty({14, 8}, DType::f32, MemCategory::other);
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < 14; ++j) xt.data<float>()[j * 8 + i] = x.select(0, g).clone().data<float>()[i * 14 + j];
    const Tensor tall = orthogonalised(xt, ns);
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < 14; ++j) EXPECT_NEAR(tall.data<float>()[j * 8 + i], one.data<float>()[i * 14 + j], 1e-5);
  }
  for (int forced : {0, 1}) {
    SCOPED_TRACE(forced);
    ops::NewtonSchulz f = ns;
    f.transpose = forced;
    int calls = 0;
    Tensor y = testing::on_test_device(x.clone());
    ops::newton_schulz(
        y, f,
        [&](Tensor& t) {
          ++calls;
          EXPECT_TRUE(t.dtype() == DType::f64 || t.dtype() == DType::f32);
        },
        ops::Context{y.device()});
    EXPECT_EQ(calls, 1 + ns.steps);
    EXPECT_TENSOR_NEAR(testing::host(y), whole, 0.0, 2e-5);  // (the orientation changes only the Gram's side)
  }
}

TEST(NewtonSchulz, ZeroStaysZero) {
  Tensor x = Tensor::zeros({4, 6}, DType::f32, MemCategory::other);
  for (bool bf16 : {false, true}) {
    ops::NewtonSchulz ns;
    ns.bf16 = bf16;
    const Tensor y = orthogonalised(x, ns);
    EXPECT_EQ(testing::sum_squares(y), 0.0);
  }
}

TEST(NewtonSchulz, BadInputIsNamed) {
  const ops::Context ctx{Device::cpu};
  ops::NewtonSchulz ns;
  Tensor v = Tensor::zeros({8}, DType::f32, MemCategory::other);
  EXPECT_NE(error_of([&] { ops::newton_schulz(v, ns, {}, ctx); }).find("2-D or 3-D"), std::string::npos);
  Tensor h = Tensor::zeros({4, 4}, DType::bf16, MemCategory::other);
  EXPECT_NE(error_of([&] { ops::newton_schulz(h, ns, {}, ctx); }).find("x must be f32"), std::string::npos);
  Tensor x = Tensor::zeros({4, 4}, DType::f32, MemCategory::other);
  ns.steps = 0;
  EXPECT_NE(error_of([&] { ops::newton_schulz(x, ns, {}, ctx); }).find("steps must be >= 1"), std::string::npos);
  ns.steps = 5;
  ns.transpose = 2;
  EXPECT_NE(error_of([&] { ops::newton_schulz(x, ns, {}, ctx); }).find("transpose"), std::string::npos);
}

// The momentum and the update element by element against their formulas.
TEST(MuonOps, MomentumAndUpdate) {
  const Tensor g = testing::randn({5, 7}, "muon.g"), m0 = testing::randn({5, 7}, "muon.m"),
               w0 = testing::randn({5, 7}, "muon.w");
  for (bool nesterov : {false, true}) {
    Tensor m = testing::on_test_device(m0.clone()), u = testing::on_test_device(Tensor::zeros({5, 7}, DType::f32));
    const Tensor gd = testing::on_test_device(g);
    ops::MuonMomentumParams p;
    p.beta = 0.8f;
    p.nesterov = nesterov;
    p.grad_scale = 0.5f;
    ops::muon_momentum(u, m, gd, p, ops::Context{u.device()});
    const Tensor mh = testing::host(m), uh = testing::host(u);
    for (int64_t i = 0; i < 35; ++i) {
      const float gs = g.data<float>()[i] * 0.5f;
      const float want_m = 0.8f * m0.data<float>()[i] + 0.2f * gs;
      EXPECT_NEAR(mh.data<float>()[i], want_m, 1e-6);  // (the compiler may contract into FMAs)
      EXPECT_NEAR(uh.data<float>()[i], nesterov ? 0.2f * gs + 0.8f * want_m : want_m, 1e-6);
    }
  }
  Tensor w = testing::on_test_device(w0.clone());
  ops::muon_update(w, testing::on_test_device(g), 0.1f, 0.5f, ops::Context{w.device()});
  const Tensor wh = testing::host(w);
  for (int64_t i = 0; i < 35; ++i)
    EXPECT_NEAR(wh.data<float>()[i], w0.data<float>()[i] * 0.95f - 0.1f * g.data<float>()[i], 1e-6);
  Tensor bad = testing::on_test_device(m0.clone());
  ops::MuonMomentumParams p;
  const Tensor gd = testing::on_test_device(g);
  EXPECT_NE(error_of([&] { ops::muon_momentum(bad, bad, gd, p, ops::Context{bad.device()}); }).find("alias"),
            std::string::npos);
}

}  // namespace
}  // namespace moecore
