// Tests of the counter-based dropout ops (dropout_forward / dropout_backward, bias_dropout_add and its
// backward) on the CPU: the mask against philox_uniform element by element, keep fractions, identity at
// p = 0, forward/backward adjointness, scalar reference loops, thread-count independence and errors.
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moecore/kernels/cpu_isa.h"
#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::randn;
using testing::to_vector;

const ops::Context kCpu;

Tensor empty(const Shape& s, DType t = DType::f32) {
  return Tensor::empty(s, t, MemCategory::other);
}
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}
uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
using testing::expect_error;

ops::Dropout dropout(float p, const char* name = "mask") {
  return ops::Dropout{p, philox_key(11, name)};
}
bool kept(const ops::Dropout& d, uint64_t i) {
  return philox_uniform(d.key, i) >= d.p;
}

// fn() with n OpenMP threads; restores the team size.
template <class Fn>
auto with_threads(int n, Fn&& fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  auto r = fn();
  omp_set_num_threads(saved);
  return r;
}

TEST(Dropout, ZeroProbabilityIsIdentity) {
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = randn({37, 41}, "x").to(t);
    Tensor y = empty(x.shape(), t);
    ops::dropout_forward(y, x, ops::Dropout{}, kCpu);
    EXPECT_TRUE(bitwise_equal(y, x));
    ops::dropout_backward(y, x, dropout(0.0f), kCpu);  // a key without p changes nothing
    EXPECT_TRUE(bitwise_equal(y, x));
    Tensor inplace = x.clone();
    ops::dropout_forward(inplace, inplace, ops::Dropout{}, kCpu);
    EXPECT_TRUE(bitwise_equal(inplace, x));
  }
}

// Every element against philox_uniform: kept ones are exactly x * s with s = 1 / (1 - p) in f32, dropped
// ones exactly +0. Sizes not a multiple of 4 and a parallel size; bf16 and f16 round x * s once.
TEST(Dropout, MaskMatchesPhiloxUniformAndScalesExactly) {
  for (const float p : {0.1f, 0.5f, 0.9f}) {
    const ops::Dropout d = dropout(p);
    const float s = 1.0f / (1.0f - p);
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{70001}}) {
      const Tensor x = randn({n}, "x");
      Tensor y = empty({n});
      ops::dropout_forward(y, x, d, kCpu);
      const Tensor x16 = x.to(DType::bf16), xh = x.to(DType::f16);
      Tensor y16 = empty({n}, DType::bf16), yh = empty({n}, DType::f16);
      ops::dropout_forward(y16, x16, d, kCpu);
      ops::dropout_forward(yh, xh, d, kCpu);
      int64_t bad = 0, bad16 = 0, badh = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float xi = x.data<float>()[i], x16i = bf16_to_float(x16.data<bf16>()[i]);
        const float xhi = f16_to_float(xh.data<f16>()[i]);
        const float want = kept(d, i) ? xi * s : 0.0f;
        const float want16 = bf16_to_float(float_to_bf16(kept(d, i) ? x16i * s : 0.0f));
        const float wanth = f16_to_float(float_to_f16(kept(d, i) ? xhi * s : 0.0f));
        bad += bits(y.data<float>()[i]) != bits(want);
        bad16 += bits(bf16_to_float(y16.data<bf16>()[i])) != bits(want16);
        badh += bits(f16_to_float(yh.data<f16>()[i])) != bits(wanth);
      }
      EXPECT_EQ(bad, 0) << "p " << p << " n " << n;
      EXPECT_EQ(bad16, 0) << "p " << p << " n " << n;
      EXPECT_EQ(badh, 0) << "f16, p " << p << " n " << n;
    }
  }
}

// The masks' AVX-512 variant (kernels/cpu_isa.h) gives the AVX2 variant's bits, for runs of every length and offset
// and in attention's dropout; skipped, saying so, where the CPU has no AVX-512 (the test above pins the variant the
// machine runs to philox_uniform). Prints the two variants' times for 2^22 elements (not asserted).
TEST(Dropout, Avx512MasksAreTheAvx2Masks) {
  if (!ops::cpu_has_isa(ops::CpuIsa::avx512))
    GTEST_SKIP() << "this CPU has no AVX-512 (F, BW, DQ, VL): only the AVX2 variant runs here";
  const auto under = [](ops::CpuIsa isa, const std::function<void()>& fn) {
    ops::cap_cpu_kernel_isa(isa);
    const bool took = ops::cpu_kernel_isa() == isa;
    const auto t0 = std::chrono::steady_clock::now();
    if (took) fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ops::cap_cpu_kernel_isa(ops::CpuIsa::avx512);
    return took ? s : -1.0;
  };
  if (under(ops::CpuIsa::avx512, [] {}) < 0) GTEST_SKIP() << "MOECORE_CPU_ISA caps the kernels below AVX-512";
  for (const float p : {0.1f, 0.5f})
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{255}, int64_t{70001}, int64_t{1} << 22}) {
      const ops::Dropout d = dropout(p);
      const Tensor x = randn({n}, "x");
      Tensor y2 = empty({n}), y5 = empty({n});
      double t2 = 0, t5 = 0;
      for (int pass = 0; pass < 2; ++pass) {  // (timed the second time: the outputs' pages faulted in by the first)
        t2 = under(ops::CpuIsa::avx2, [&] { ops::dropout_forward(y2, x, d, kCpu); });
        t5 = under(ops::CpuIsa::avx512, [&] { ops::dropout_forward(y5, x, d, kCpu); });
      }
      EXPECT_TRUE(bitwise_equal(y2, y5)) << "p " << p << " n " << n;
      if (n == int64_t{1} << 22 && p == 0.5f)
        std::printf("dropout_forward over 2^22 elements: AVX2 %.2f ms, AVX-512 %.2f ms\n", 1e3 * t2, 1e3 * t5);
    }
  // attention's dropout on P regenerates the masks by block (cpu/attention.cpp)
  const ops::QkvDims dims{1, 130, 2, 2, 16};
  const Tensor qkv = randn({dims.B, dims.S, dims.width()}, "qkv");
  const ops::Dropout pd = dropout(0.3f, "attention");
  Tensor out2 = empty({dims.B, dims.S, dims.q_heads() * dims.D}), out5 = empty(out2.shape());
  Tensor lse2 = empty({dims.B, dims.q_heads(), dims.S}), lse5 = empty(lse2.shape());
  under(ops::CpuIsa::avx2, [&] { ops::attention_forward(out2, lse2, qkv, dims, pd, kCpu); });
  under(ops::CpuIsa::avx512, [&] { ops::attention_forward(out5, lse5, qkv, dims, pd, kCpu); });
  EXPECT_TRUE(bitwise_equal(out2, out5));
}

// Binomial keep count over 1e6 elements: within 4 standard deviations of n (1 - p).
TEST(Dropout, KeepFractionWithinFourSigma) {
  const int64_t n = 1000000;
  Tensor ones = empty({n});
  ones.fill_(1.0f);
  for (const float p : {0.1f, 0.5f}) {
    Tensor y = ones.clone();
    ops::dropout_forward(y, y, dropout(p), kCpu);
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += y.data<float>()[i] != 0.0f;
    const double sigma = std::sqrt(n * p * (1.0 - p));
    EXPECT_LE(std::fabs(count - n * (1.0 - p)), 4 * sigma) << "p " << p << " kept " << count;
  }
}

TEST(Dropout, SameKeySameMaskOtherKeyOtherMask) {
  const Tensor x = randn({1000}, "x");
  Tensor a = empty(x.shape()), b = empty(x.shape()), c = empty(x.shape());
  ops::dropout_forward(a, x, dropout(0.5f, "first"), kCpu);
  ops::dropout_forward(b, x, dropout(0.5f, "first"), kCpu);
  ops::dropout_forward(c, x, dropout(0.5f, "second"), kCpu);
  EXPECT_TRUE(bitwise_equal(a, b));
  int64_t differ = 0;
  for (int64_t i = 0; i < x.numel(); ++i) differ += (a.data<float>()[i] == 0.0f) != (c.data<float>()[i] == 0.0f);
  EXPECT_GT(differ, 300);  // about half of the 1000 elements
}

// <dropout(x), g> = <x, dropout_backward(g)>: both sides sum the same products x_i g_i s over kept i.
TEST(Dropout, BackwardIsAdjointOfForward) {
  const ops::Dropout d = dropout(0.3f);
  const Tensor x = randn({123, 45}, "x"), g = randn({123, 45}, "g");
  Tensor y = empty(x.shape()), dx = empty(x.shape());
  ops::dropout_forward(y, x, d, kCpu);
  ops::dropout_backward(dx, g, d, kCpu);
  const double lhs = testing::weighted_sum(y, g), rhs = testing::weighted_sum(x, dx);
  EXPECT_NEAR(lhs, rhs, 1e-5 * (1.0 + std::fabs(lhs)));
}

// Bitwise the same with 1 and 2 threads, on sizes large enough for the parallel paths.
TEST(Dropout, IndependentOfThreadCount) {
  const ops::Dropout d = dropout(0.2f);
  const Tensor x = randn({1200, 257}, "x"), bias = randn({257}, "bias");
  auto run = [&] {
    Tensor y = empty(x.shape()), bda = empty(x.shape()), dx = empty(x.shape());
    Tensor dbias = Tensor::zeros({257}, DType::f32, MemCategory::other);
    ops::dropout_forward(y, x, d, kCpu);
    ops::bias_dropout_add(bda, x, x, bias, d, kCpu);
    ops::bias_dropout_add_backward(dx, dbias, x, d, kCpu);
    std::vector<float> all = to_vector(y);
    for (const Tensor* t : {&bda, &dx, &dbias})
      for (float v : to_vector(*t)) all.push_back(v);
    return all;
  };
  const std::vector<float> one = with_threads(1, run), two = with_threads(2, run);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * sizeof(float)));
}

// ---- bias_dropout_add ----------------------------------------------------------------------------

// The scalar loop does the kernel's f32 arithmetic (x + bias, times s, plus residual) in the same order,
// so f32 agrees to the last bit but for contraction into an FMA: 1e-6 relative.
TEST(BiasDropoutAdd, MatchesScalarReference) {
  const int64_t N = 33, H = 70;
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const bool with_bias : {true, false}) {
      for (const float p : {0.0f, 0.25f}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + (with_bias ? " bias" : " no bias") + " p " + std::to_string(p));
        const ops::Dropout d = dropout(p);
        const Tensor x = randn({N, H}, "x").to(t), residual = randn({N, H}, "residual");
        const Tensor bias = with_bias ? randn({H}, "bias") : Tensor();
        Tensor y = residual.clone();  // y aliases residual
        ops::bias_dropout_add(y, y, x, bias, d, kCpu);
        const auto xv = to_vector(x), rv = to_vector(residual);
        Tensor want = empty({N, H});
        const float s = 1.0f / (1.0f - p);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t h = 0; h < H; ++h) {
            const int64_t i = n * H + h;
            const float v = xv[i] + (with_bias ? bias.data<float>()[h] : 0.0f);
            want.data<float>()[i] = rv[i] + (p == 0.0f || kept(d, i) ? v * (p == 0.0f ? 1.0f : s) : 0.0f);
          }
        EXPECT_TENSOR_NEAR(y, want, 1e-6, 1e-7);
      }
    }
  }
}

TEST(BiasDropoutAdd, ZeroProbabilityIsResidualPlusBias) {
  const Tensor x = randn({5, 9}, "x"), residual = randn({5, 9}, "residual"), bias = randn({9}, "bias");
  Tensor y = empty({5, 9});
  ops::bias_dropout_add(y, residual, x, bias, ops::Dropout{}, kCpu);
  for (int64_t i = 0; i < 45; ++i) {
    const float want = residual.data<float>()[i] + (x.data<float>()[i] + bias.data<float>()[i % 9]);
    EXPECT_EQ(bits(y.data<float>()[i]), bits(want));
  }
}

// dx = dy * mask * s; dbias accumulates the column sums of the unrounded dx (a double reference; the
// kernel sums in double too, so 1e-6 relative).
TEST(BiasDropoutAddBackward, MatchesScalarReference) {
  const int64_t N = 600, H = 19;  // several 256-row chunks
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const float p : {0.0f, 0.4f}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " p " + std::to_string(p));
      const ops::Dropout d = dropout(p, "bda");
      const Tensor dy = randn({N, H}, "dy");
      Tensor dx = empty({N, H}, t), dbias = randn({H}, "dbias0");
      const auto dbias0 = to_vector(dbias);
      ops::bias_dropout_add_backward(dx, dbias, dy, d, kCpu);
      const float s = p == 0.0f ? 1.0f : 1.0f / (1.0f - p);
      Tensor want_dx = empty({N, H});
      std::vector<double> want_db(dbias0.begin(), dbias0.end());
      for (int64_t i = 0; i < N * H; ++i) {
        const float v = p == 0.0f || kept(d, i) ? dy.data<float>()[i] * s : 0.0f;
        want_dx.data<float>()[i] = v;
        want_db[i % H] += v;
      }
      EXPECT_TRUE(bitwise_equal(dx, want_dx.to(t)));
      for (int64_t h = 0; h < H; ++h)
        EXPECT_NEAR(dbias.data<float>()[h], want_db[h], 1e-6 * (1 + std::fabs(want_db[h]))) << "column " << h;
      Tensor dx2 = empty({N, H}, t), no_bias;
      ops::bias_dropout_add_backward(dx2, no_bias, dy, d, kCpu);
      EXPECT_TRUE(bitwise_equal(dx2, dx));
    }
  }
}

TEST(Dropout, RejectsBadInputs) {
  const Tensor x = randn({4, 6}, "x");
  Tensor y = empty({4, 6});
  expect_error([&] { ops::dropout_forward(y, x, dropout(1.0f), kCpu); }, {"dropout_forward", "p", "1"});
  expect_error([&] { ops::dropout_backward(y, x, dropout(-0.5f), kCpu); }, {"dropout_backward", "-0.5"});
  expect_error([&] { ops::dropout_forward(y, x, dropout(NAN), kCpu); }, {"dropout_forward", "nan"});
  Tensor y16 = empty({4, 6}, DType::bf16);
  expect_error([&] { ops::dropout_forward(y16, x, dropout(0.1f), kCpu); }, {"dropout_forward", "dtype"});
  Tensor wide = empty({4, 7});
  expect_error([&] { ops::bias_dropout_add(wide, x, x, Tensor(), dropout(0.1f), kCpu); },
               {"bias_dropout_add", "[4, 7]"});
  const Tensor bias = empty({5});
  expect_error([&] { ops::bias_dropout_add(y, x, x, bias, dropout(0.1f), kCpu); }, {"bias_dropout_add", "bias"});
  Tensor dbias = empty({6}, DType::bf16);
  expect_error([&] { ops::bias_dropout_add_backward(y, dbias, x, dropout(0.1f), kCpu); },
               {"bias_dropout_add_backward", "dbias"});
}

}  // namespace
}  // namespace moecore
