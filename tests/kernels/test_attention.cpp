// Tests of rope_table / rope_forward / rope_backward (whole and partial rotary dims) and attention_forward /
// attention_backward (with and without dropout) on the CPU: against naive references in double (full S x S
// softmax, the dropout mask from philox_uniform), central finite differences, the bf16 path against f32,
// determinism across thread counts, and entry checks; queries as the last S of Sk keys (from separate q and kv
// tensors, kv a slice) against the rows of the full problem; the AVX-512 tiles against the AVX2 ones. No timing here
// (see bench/).
#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "moecore/kernels/cpu_isa.h"
#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using ops::Dropout;
using ops::QkvDims;
using testing::randn;
using testing::to_vector;

Tensor from_doubles(const Shape& shape, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, DType::f32, MemCategory::other);
  for (size_t i = 0; i < v.size(); ++i) t.data<float>()[i] = static_cast<float>(v[i]);
  return t;
}

Shape qkv_shape(const QkvDims& d) {
  return {d.B, d.S, d.width()};
}
Shape out_shape(const QkvDims& d) {
  return {d.B, d.S, d.q_heads() * d.D};
}
Shape lse_shape(const QkvDims& d) {
  return {d.B, d.q_heads(), d.S};
}

// Naive causal attention in double: the full score row per query, then the textbook gradients. With
// dropout, Pd = P * M / (1 - p) multiplies V (M from philox_uniform at ((b*Hq + h)*S + q)*S + k), dP is
// masked the same way and delta = sum_k P dP = rowsum(dO * out).
struct Reference {
  std::vector<double> out, lse, dqkv;
};

Reference reference(const Tensor& qkv_t, const Tensor* dout_t, const QkvDims& d, const Dropout& drop = {}) {
  const auto x = to_vector(qkv_t);
  const std::vector<float> dout = dout_t ? to_vector(*dout_t) : std::vector<float>();
  const int64_t W = d.width(), H = d.q_heads(), OW = H * d.D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
  auto q_at = [&](int64_t b, int64_t s, int64_t h) {
    return (b * d.S + s) * W + ((h / d.R) * (d.R + 2) + h % d.R) * d.D;
  };
  auto k_at = [&](int64_t b, int64_t s, int64_t g) { return (b * d.S + s) * W + (g * (d.R + 2) + d.R) * d.D; };
  Reference ref{std::vector<double>(d.B * d.S * OW), std::vector<double>(d.B * H * d.S),
                std::vector<double>(dout_t ? d.B * d.S * W : 0)};
  std::vector<double> p(d.S), dp(d.S), keep(d.S, 1.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < d.S; ++q) {
        const int64_t g = h / d.R, qo = q_at(b, q, h), oo = (b * d.S + q) * OW + h * d.D;
        double mx = -INFINITY, sum = 0;
        for (int64_t k = 0; k <= q; ++k) {
          double dot = 0;
          for (int64_t e = 0; e < d.D; ++e) dot += double(x[qo + e]) * x[k_at(b, k, g) + e];
          p[k] = dot * scale;
          mx = std::max(mx, p[k]);
        }
        for (int64_t k = 0; k <= q; ++k) sum += (p[k] = std::exp(p[k] - mx));
        ref.lse[(b * H + h) * d.S + q] = mx + std::log(sum);
        for (int64_t k = 0; k <= q && drop.active(); ++k) {
          const uint64_t i = static_cast<uint64_t>(((b * H + h) * d.S + q) * d.S + k);
          keep[k] = philox_uniform(drop.key, i) >= drop.p ? 1.0 / (1.0 - drop.p) : 0.0;
        }
        for (int64_t k = 0; k <= q; ++k) {
          p[k] /= sum;
          for (int64_t e = 0; e < d.D; ++e) ref.out[oo + e] += p[k] * keep[k] * x[k_at(b, k, g) + d.D + e];
        }
        if (!dout_t) continue;
        double delta = 0;
        for (int64_t k = 0; k <= q; ++k) {
          dp[k] = 0;
          for (int64_t e = 0; e < d.D; ++e) dp[k] += double(dout[oo + e]) * x[k_at(b, k, g) + d.D + e];
          dp[k] *= keep[k];
          delta += p[k] * dp[k];
        }
        for (int64_t k = 0; k <= q; ++k) {
          const double ds = p[k] * (dp[k] - delta) * scale;
          const int64_t ko = k_at(b, k, g);
          for (int64_t e = 0; e < d.D; ++e) {
            ref.dqkv[qo + e] += ds * x[ko + e];
            ref.dqkv[ko + e] += ds * x[qo + e];
            ref.dqkv[ko + d.D + e] += p[k] * keep[k] * dout[oo + e];
          }
        }
      }
  return ref;
}

struct Fwd {
  Tensor out, lse;
};

Fwd run_forward(const Tensor& qkv, const QkvDims& d, const Dropout& drop = {}) {
  Fwd f{Tensor::empty(out_shape(d), qkv.dtype(), MemCategory::other),
        Tensor::empty(lse_shape(d), DType::f32, MemCategory::other)};
  ops::attention_forward(f.out, f.lse, qkv, d, drop, {});
  return f;
}

Tensor run_backward(const Tensor& dout, const Tensor& qkv, const Fwd& f, const QkvDims& d, const Dropout& drop = {}) {
  Tensor dqkv = Tensor::empty(qkv_shape(d), qkv.dtype(), MemCategory::other);
  dqkv.fill_(NAN);  // every element must be written
  ops::attention_backward(dqkv, dout, qkv, f.out, f.lse, d, drop, {});
  return dqkv;
}

std::string name_of(const QkvDims& d) {
  return "B" + std::to_string(d.B) + "_S" + std::to_string(d.S) + "_G" + std::to_string(d.G) + "_R" +
         std::to_string(d.R) + "_D" + std::to_string(d.D);
}

// S = 1, 7 (one partial block), 64 (exactly one), 100, 130 (partial last blocks), 200 (several key
// chunks in backward); GQA (R = 2, 4), MHA (R = 1), B = 2, and head dims that are not multiples of 16.
const QkvDims kShapes[] = {{1, 1, 1, 1, 8},   {1, 7, 2, 2, 8},    {2, 64, 1, 1, 16}, {1, 100, 2, 2, 16},
                           {2, 130, 1, 1, 6}, {1, 130, 1, 4, 64}, {1, 200, 2, 1, 24}};

// f32 kernel vs double reference: only f32 rounding of dot products and sums over <= 200 terms (observed
// ~3e-6 relative), so 2e-5 relative / 2e-6 absolute for out and lse; gradients chain one more product
// and accumulate over more terms: 2e-4 / 2e-5.
TEST(AttentionForward, MatchesNaiveReference) {
  for (const QkvDims& d : kShapes) {
    SCOPED_TRACE(name_of(d));
    Tensor qkv = randn(qkv_shape(d), "qkv");
    const Fwd f = run_forward(qkv, d);
    const Reference ref = reference(qkv, nullptr, d);
    EXPECT_TENSOR_NEAR(f.out, from_doubles(out_shape(d), ref.out), 2e-5, 2e-6);
    EXPECT_TENSOR_NEAR(f.lse, from_doubles(lse_shape(d), ref.lse), 2e-5, 2e-6);
  }
}

// Zero queries give uniform attention: lse[q] = log(q + 1) and out[q] = mean of v[0..q].
TEST(AttentionForward, LseOfUniformScoresIsLogCount) {
  const QkvDims d{1, 150, 1, 1, 16};
  Tensor qkv = randn(qkv_shape(d), "qkv");
  for (int64_t s = 0; s < d.S; ++s)
    for (int64_t e = 0; e < d.D; ++e) qkv.data<float>()[s * d.width() + e] = 0.0f;
  const Fwd f = run_forward(qkv, d);
  std::vector<double> expect(d.S);
  for (int64_t s = 0; s < d.S; ++s) expect[s] = std::log(static_cast<double>(s + 1));
  EXPECT_TENSOR_NEAR(f.lse, from_doubles(lse_shape(d), expect), 1e-6, 1e-6);
  const Reference ref = reference(qkv, nullptr, d);
  EXPECT_TENSOR_NEAR(f.out, from_doubles(out_shape(d), ref.out), 1e-5, 1e-6);
}

TEST(AttentionBackward, MatchesReferenceGradient) {
  for (const QkvDims& d : kShapes) {
    SCOPED_TRACE(name_of(d));
    Tensor qkv = randn(qkv_shape(d), "qkv");
    Tensor dout = randn(out_shape(d), "dout");
    const Fwd f = run_forward(qkv, d);
    const Tensor dqkv = run_backward(dout, qkv, f, d);
    const Reference ref = reference(qkv, &dout, d);
    EXPECT_TENSOR_NEAR(dqkv, from_doubles(qkv_shape(d), ref.dqkv), 2e-4, 2e-5);
  }
}

// Central differences of sum(out * w) in float with h = 1e-2: truncation ~h^2 and rounding noise
// ~1e-6 / h (observed ~1e-4), so 3e-3 relative and 3e-4 absolute on gradients of order one.
TEST(AttentionBackward, MatchesFiniteDifferences) {
  for (const QkvDims& d : {QkvDims{1, 5, 1, 2, 4}, QkvDims{2, 3, 2, 1, 2}}) {
    SCOPED_TRACE(name_of(d));
    Tensor qkv = randn(qkv_shape(d), "qkv");
    const Tensor w = randn(out_shape(d), "weights");
    auto loss = [&] { return testing::weighted_sum(run_forward(qkv, d).out, w); };
    const Tensor numeric = testing::numerical_gradient(loss, qkv);
    const Tensor analytic = run_backward(w, qkv, run_forward(qkv, d), d);
    EXPECT_TENSOR_NEAR(analytic, numeric, 3e-3, 3e-4);
  }
}

// Same bits with 1, 2 and 3 threads, on a shape whose backward splits keys into several chunks.
TEST(AttentionBackward, DeterministicAcrossThreadCounts) {
  const QkvDims d{1, 300, 1, 2, 16};
  Tensor qkv = randn(qkv_shape(d), "qkv");
  Tensor dout = randn(out_shape(d), "dout");
  const int saved = omp_get_max_threads();
  std::vector<std::vector<float>> runs;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    const Fwd f = run_forward(qkv, d);
    std::vector<float> all = to_vector(f.out);
    for (float v : to_vector(f.lse)) all.push_back(v);
    for (float v : to_vector(run_backward(dout, qkv, f, d))) all.push_back(v);
    runs.push_back(all);
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < runs.size(); ++i) {
    ASSERT_EQ(runs[0].size(), runs[i].size());
    EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[i].data(), runs[0].size() * sizeof(float))) << "run " << i;
  }
}

// bf16 / f16 activations vs the f32 kernel on the same (rounded) inputs. Forward: both do the same f32 math, so
// only the output rounding differs (2^-8 relative in bf16, 2^-11 in f16). Backward: out and dout enter delta
// rounded, moving dS by ~one rounding of |dP|, and the result is rounded again: 2e-2 in bf16, 8x less in f16.
TEST(AttentionBf16, MatchesF32Path) {
  for (DType t : {DType::bf16, DType::f16})
    for (const QkvDims& d : {QkvDims{1, 100, 2, 2, 16}, QkvDims{2, 70, 1, 1, 64}}) {
      SCOPED_TRACE(name_of(d) + " " + std::string(dtype_name(t)));
      const double out_rtol = t == DType::bf16 ? 8e-3 : 1e-3, grad_tol = t == DType::bf16 ? 2e-2 : 2.5e-3;
      const Tensor qkv16 = randn(qkv_shape(d), "qkv").to(t);
      const Tensor dout16 = randn(out_shape(d), "dout").to(t);
      const Tensor qkv32 = qkv16.to(DType::f32), dout32 = dout16.to(DType::f32);
      const Fwd f16 = run_forward(qkv16, d), f32 = run_forward(qkv32, d);
      EXPECT_EQ(f16.out.dtype(), t);
      EXPECT_TENSOR_NEAR(f16.out, f32.out, out_rtol, 1e-4);
      EXPECT_TENSOR_NEAR(f16.lse, f32.lse, 1e-6, 1e-6);
      EXPECT_TENSOR_NEAR(run_backward(dout16, qkv16, f16, d), run_backward(dout32, qkv32, f32, d), grad_tol, grad_tol);
    }
}

// ---- Attention dropout ---------------------------------------------------------------------------

Dropout attn_dropout(float p, const char* name = "attn") {
  return Dropout{p, philox_key(3, name)};
}

// Same tolerances as without dropout: the mask only zeroes terms and scales the rest by 1/(1-p).
TEST(AttentionDropout, MatchesNaiveReference) {
  const Dropout drop = attn_dropout(0.3f);
  for (const QkvDims& d : {QkvDims{1, 7, 2, 2, 8}, QkvDims{2, 130, 1, 2, 6}, QkvDims{1, 200, 2, 1, 24}}) {
    SCOPED_TRACE(name_of(d));
    Tensor qkv = randn(qkv_shape(d), "qkv");
    Tensor dout = randn(out_shape(d), "dout");
    const Fwd f = run_forward(qkv, d, drop);
    const Reference ref = reference(qkv, &dout, d, drop);
    EXPECT_TENSOR_NEAR(f.out, from_doubles(out_shape(d), ref.out), 2e-5, 2e-6);
    EXPECT_TENSOR_NEAR(f.lse, from_doubles(lse_shape(d), ref.lse), 2e-5, 2e-6);
    EXPECT_TENSOR_NEAR(run_backward(dout, qkv, f, d, drop), from_doubles(qkv_shape(d), ref.dqkv), 2e-4, 2e-5);
  }
}

// The tile GEMM's AVX-512 variant (cpu/attention_blocks.h, taken where cpu_kernel_isa() is avx512) gives the AVX2
// variant's bits: out, lse and dqkv of every shape above and a head dim of 80 (32-column panels, then a 16-column
// one), without and with dropout. Skipped, saying so, where the CPU has no AVX-512.
TEST(AttentionForward, Avx512TilesGiveTheAvx2Bits) {
  if (!ops::cpu_has_isa(ops::CpuIsa::avx512))
    GTEST_SKIP() << "this CPU has no AVX-512 (F, BW, DQ, VL): only the AVX2 tiles run here";
  ops::cap_cpu_kernel_isa(ops::CpuIsa::avx512);
  if (ops::cpu_kernel_isa() != ops::CpuIsa::avx512) GTEST_SKIP() << "MOECORE_CPU_ISA caps the kernels below AVX-512";
  std::vector<QkvDims> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({1, 150, 1, 2, 80});
  for (const QkvDims& d : shapes)
    for (const Dropout& drop : {Dropout{}, attn_dropout(0.2f)}) {
      SCOPED_TRACE(name_of(d) + (drop.active() ? " dropout" : ""));
      const Tensor qkv = randn(qkv_shape(d), "qkv"), dout = randn(out_shape(d), "dout");
      std::vector<float> runs[2];
      for (const ops::CpuIsa isa : {ops::CpuIsa::avx2, ops::CpuIsa::avx512}) {
        ops::cap_cpu_kernel_isa(isa);
        const Fwd f = run_forward(qkv, d, drop);
        std::vector<float>& all = runs[isa == ops::CpuIsa::avx512];
        all = to_vector(f.out);
        for (float v : to_vector(f.lse)) all.push_back(v);
        for (float v : to_vector(run_backward(dout, qkv, f, d, drop))) all.push_back(v);
      }
      ops::cap_cpu_kernel_isa(ops::CpuIsa::avx512);
      ASSERT_EQ(runs[0].size(), runs[1].size());
      EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)));
    }
}

// lse is that of the undropped scores: bitwise the lse without dropout. Dropout changes out.
TEST(AttentionDropout, LseIsTheUndroppedOne) {
  const QkvDims d{1, 100, 1, 2, 16};
  Tensor qkv = randn(qkv_shape(d), "qkv");
  const Fwd plain = run_forward(qkv, d), dropped = run_forward(qkv, d, attn_dropout(0.5f));
  EXPECT_EQ(0, std::memcmp(plain.lse.raw(), dropped.lse.raw(), plain.lse.nbytes()));
  EXPECT_NE(0, std::memcmp(plain.out.raw(), dropped.out.raw(), plain.out.nbytes()));
}

// The mask is fixed by the key, so sum(out * w) is smooth in qkv; same tolerances as without dropout.
TEST(AttentionDropout, MatchesFiniteDifferences) {
  const Dropout drop = attn_dropout(0.3f, "fd");
  for (const QkvDims& d : {QkvDims{1, 5, 1, 2, 4}, QkvDims{2, 3, 2, 1, 2}}) {
    SCOPED_TRACE(name_of(d));
    Tensor qkv = randn(qkv_shape(d), "qkv");
    const Tensor w = randn(out_shape(d), "weights");
    auto loss = [&] { return testing::weighted_sum(run_forward(qkv, d, drop).out, w); };
    const Tensor numeric = testing::numerical_gradient(loss, qkv);
    const Tensor analytic = run_backward(w, qkv, run_forward(qkv, d, drop), d, drop);
    EXPECT_TENSOR_NEAR(analytic, numeric, 3e-3, 3e-4);
  }
}

// p = 0 skips the mask entirely: any key gives the bits of Dropout{} (which the tests above pin to the
// reference); nonzero p with the same key gives the same bits run after run, with 1 and 2 threads.
TEST(AttentionDropout, ZeroProbabilityIgnoresKeyAndMaskIsDeterministic) {
  const QkvDims d{1, 300, 1, 2, 16};
  Tensor qkv = randn(qkv_shape(d), "qkv");
  Tensor dout = randn(out_shape(d), "dout");
  auto run = [&](const Dropout& drop, int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    const Fwd f = run_forward(qkv, d, drop);
    std::vector<float> all = to_vector(f.out);
    for (float v : to_vector(f.lse)) all.push_back(v);
    for (float v : to_vector(run_backward(dout, qkv, f, d, drop))) all.push_back(v);
    omp_set_num_threads(saved);
    return all;
  };
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(run(Dropout{}, 2), run(Dropout{0.0f, philox_key(5, "any")}, 2)));
  const Dropout drop = attn_dropout(0.2f);
  EXPECT_TRUE(same(run(drop, 1), run(drop, 2)));
  EXPECT_FALSE(same(run(drop, 2), run(attn_dropout(0.2f, "other"), 2)));
}

TEST(AttentionForward, RejectsBadInputs) {
  const QkvDims d{1, 8, 2, 2, 8};
  Tensor out = Tensor::empty(out_shape(d), DType::f32), lse = Tensor::empty(lse_shape(d), DType::f32);
  auto expect_error = [](auto&& fn, const char* op, const char* detail) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << detail;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(op), std::string::npos) << msg;
      EXPECT_NE(msg.find(detail), std::string::npos) << msg;
    }
  };
  const Tensor wide = Tensor::zeros({1, 8, d.width() + 8}, DType::f32);
  const Dropout none;
  expect_error([&] { ops::attention_forward(out, lse, wide, d, none, {}); }, "attention_forward", "[1, 8, 72] f32");
  const Tensor qkv16 = Tensor::zeros(qkv_shape(d), DType::bf16);
  expect_error([&] { ops::attention_forward(out, lse, qkv16, d, none, {}); }, "attention_forward", "bf16");
  const Tensor qkv = Tensor::zeros(qkv_shape(d), DType::f32);
  Tensor bad_lse = Tensor::empty({1, 2, 8}, DType::f32);
  expect_error([&] { ops::attention_forward(out, bad_lse, qkv, d, none, {}); }, "attention_forward", "lse");
  Tensor dqkv = Tensor::empty(qkv_shape(d), DType::f32);
  const Tensor dout16 = Tensor::zeros(out_shape(d), DType::bf16);
  expect_error([&] { ops::attention_backward(dqkv, dout16, qkv, out, lse, d, none, {}); }, "attention_backward",
               "dout");
  const QkvDims odd{1, 8, 2, 2, 7};
  expect_error([&] { ops::attention_forward(out, lse, qkv, odd, none, {}); }, "attention_forward", "D=7");
  EXPECT_THROW(ops::attention_backward(dqkv, out, wide, out, lse, d, none, {}), Error);
  const auto p_one = [&] { ops::attention_forward(out, lse, qkv, d, Dropout{1.0f, {}}, {}); };
  expect_error(p_one, "attention_forward", "p must be in [0, 1), got 1");
  const auto p_negative = [&] { ops::attention_backward(dqkv, out, qkv, out, lse, d, Dropout{-0.25f, {}}, {}); };
  expect_error(p_negative, "attention_backward", "-0.25");
  Tensor rope = Tensor::empty({8, 8}, DType::f32);
  Tensor wide_copy = wide.clone();
  expect_error([&] { ops::rope_forward(wide_copy, rope, d, {}); }, "rope_forward", "qkv");
  Tensor short_rope = Tensor::empty({4, 8}, DType::f32);
  Tensor qkv_copy = qkv.clone();
  expect_error([&] { ops::rope_backward(qkv_copy, short_rope, d, {}); }, "rope_backward", "rope");
}

// ---- Queries as the last S of Sk keys (context parallelism) --------------------------------------

Shape kv_shape(const QkvDims& d) {
  return {d.B, d.keys(), d.width()};
}

// The full causal problem over all Sk positions of qkv [B, Sk, W].
QkvDims full_dims(const QkvDims& d) {
  return {d.B, d.keys(), d.G, d.R, d.D};
}

Fwd run_forward_kv(const Tensor& q, const Tensor& kv, const QkvDims& d, const Dropout& drop) {
  Fwd f{Tensor::empty(out_shape(d), q.dtype(), MemCategory::other),
        Tensor::empty(lse_shape(d), DType::f32, MemCategory::other)};
  ops::attention_forward(f.out, f.lse, q, kv, d, drop, {});
  return f;
}

struct Grads {
  Tensor dq, dkv;
};

// dq and dkv start as NaN: the slots the op must write are checked against values, the others must stay NaN.
Grads run_backward_kv(const Tensor& dout, const Tensor& q, const Tensor& kv, const Fwd& f, const QkvDims& d,
                      const Dropout& drop) {
  Grads g{Tensor::empty(qkv_shape(d), q.dtype(), MemCategory::other),
          Tensor::empty(kv_shape(d), q.dtype(), MemCategory::other)};
  g.dq.fill_(NAN);
  g.dkv.fill_(NAN);
  ops::attention_backward(g.dq, g.dkv, dout, q, kv, f.out, f.lse, d, drop, {});
  return g;
}

// Slots first .. first + count - 1 of every kv group of a [B, rows, W] tensor, as a contiguous [B, rows, G, count, D].
Tensor slots(const Tensor& t, const QkvDims& d, int64_t first, int64_t count) {
  const Tensor c = t.is_contiguous() ? t : t.clone();
  return c.view({t.size(0), t.size(1), d.G, d.R + 2, d.D}).slice(3, first, first + count).clone();
}
Tensor query_slots(const Tensor& t, const QkvDims& d) {
  return slots(t, d, 0, d.R);
}
Tensor kv_slots(const Tensor& t, const QkvDims& d) {
  return slots(t, d, d.R, 2);
}
// Rows a .. b - 1 along dim, contiguous.
Tensor rows(const Tensor& t, int dim, int64_t a, int64_t b) {
  return t.slice(dim, a, b).clone();
}

// Elements whose bits differ (read as f32, to which bf16 widens exactly).
int64_t bits_differ(const Tensor& a, const Tensor& b) {
  const auto va = to_vector(a), vb = to_vector(b);
  if (va.size() != vb.size()) return -1;
  int64_t n = 0;
  for (size_t i = 0; i < va.size(); ++i) n += std::memcmp(&va[i], &vb[i], sizeof(float)) != 0;
  return n;
}
bool all_nan(const Tensor& t) {
  for (float v : to_vector(t))
    if (!std::isnan(v)) return false;
  return true;
}

// S and Sk not multiples of the 64-row blocks, off = Sk - S a multiple of 64 or not (then query blocks straddle key
// blocks), one query, Sk = S given explicitly, GQA (R > 1) and B = 2.
const QkvDims kKeyShapes[] = {{1, 7, 2, 2, 8, 100},   {2, 100, 1, 3, 16, 230}, {1, 64, 2, 1, 24, 192},
                              {1, 130, 1, 2, 6, 130}, {1, 1, 1, 1, 8, 65},     {1, 150, 1, 2, 16, 350}};

std::string keys_name(const QkvDims& d, DType t, const Dropout& drop) {
  return name_of(d) + "_Sk" + std::to_string(d.keys()) + " " + std::string(dtype_name(t)) + " p " +
         std::to_string(drop.p);
}

// Each query row of the forward depends only on its own position: the key blocks start at key 0 in both problems, a
// block wholly in a row's future adds exact zeros, and the mask index is the full problem's. So out and lse equal the
// full problem's last S rows bit for bit, with or without dropout, in both dtypes.
TEST(AttentionKeys, ForwardRowsEqualTheFullProblemBitwise) {
  for (const QkvDims& d : kKeyShapes)
    for (DType t : {DType::f32, DType::bf16, DType::f16})
      for (const Dropout& drop : {Dropout{}, attn_dropout(0.3f, "keys")}) {
        SCOPED_TRACE(keys_name(d, t, drop));
        const int64_t off = d.keys() - d.S;
        const Tensor qkv = randn(kv_shape(d), "qkv").to(t);
        const Fwd full = run_forward(qkv, full_dims(d), drop);
        const Fwd part = run_forward_kv(rows(qkv, 1, off, d.keys()), qkv, d, drop);
        EXPECT_EQ(bits_differ(part.out, rows(full.out, 1, off, d.keys())), 0);
        EXPECT_EQ(bits_differ(part.lse, rows(full.lse, 2, off, d.keys())), 0);
      }
}

// Backward against the full problem with dout zeroed on its first off rows (those rows then add exact zeros to dK
// and dV). dK, dV: every key's sums run over the same query rows in the same order, so bit for bit. dQ: the same
// terms, but the backward cuts keys into chunks by causal work, which differs between the two problems when B*G < 8,
// and adds the chunks' partial sums in another grouping: a few f32 ulps (observed <= 1.2e-7 absolute on values of
// order one), so 1e-5 relative / 1e-6 absolute; in bf16 such a difference can round a value to its neighbour: 8e-3
// (f16: 1e-3).
// With B*G >= 8 (one chunk in both) dQ is bitwise too, checked by the last shape.
TEST(AttentionKeys, BackwardMatchesTheFullProblem) {
  std::vector<QkvDims> shapes(std::begin(kKeyShapes), std::end(kKeyShapes));
  shapes.push_back({2, 70, 4, 2, 8, 200});  // B*G = 8: one key chunk
  for (const QkvDims& d : shapes)
    for (DType t : {DType::f32, DType::bf16, DType::f16})
      for (const Dropout& drop : {Dropout{}, attn_dropout(0.3f, "keys")}) {
        SCOPED_TRACE(keys_name(d, t, drop));
        const int64_t off = d.keys() - d.S, HD = d.q_heads() * d.D;
        const Tensor qkv = randn(kv_shape(d), "qkv").to(t);
        const Tensor q = rows(qkv, 1, off, d.keys());
        const Tensor dout = randn(out_shape(d), "dout").to(t);
        Tensor dout_full = Tensor::zeros({d.B, d.keys(), HD}, t, MemCategory::other);
        dout_full.slice(1, off, d.keys()).copy_from(dout);
        const Fwd full = run_forward(qkv, full_dims(d), drop);
        const Tensor dfull = run_backward(dout_full, qkv, full, full_dims(d), drop);
        const Grads g = run_backward_kv(dout, q, qkv, run_forward_kv(q, qkv, d, drop), d, drop);
        EXPECT_EQ(bits_differ(kv_slots(g.dkv, d), kv_slots(dfull, d)), 0);
        const Tensor dq_full = query_slots(rows(dfull, 1, off, d.keys()), d);
        if (d.B * d.G >= 8)
          EXPECT_EQ(bits_differ(query_slots(g.dq, d), dq_full), 0);
        else
          EXPECT_TENSOR_NEAR(query_slots(g.dq, d), dq_full,
                             t == DType::f32   ? 1e-5
                             : t == DType::f16 ? 1e-3
                                               : 8e-3,
                             1e-6);
        EXPECT_TRUE(all_nan(kv_slots(g.dq, d)));  // no other column touched
        EXPECT_TRUE(all_nan(query_slots(g.dkv, d)));
      }
}

// kv and dkv as dim-1 slices of longer [B, S_long, W] tensors (batch stride S_long * W): the same bits as contiguous
// ones, and dkv's parent keeps every element outside the slice's key and value slots.
TEST(AttentionKeys, KvAndDkvMayBeSlicesOfALongerTensor) {
  const QkvDims d{2, 50, 2, 2, 8, 120};
  const int64_t first = 9, S_long = 150;
  const Dropout drop = attn_dropout(0.2f, "slice");
  const Tensor q = randn(qkv_shape(d), "q"), dout = randn(out_shape(d), "dout");
  const Tensor kv_long = randn({d.B, S_long, d.width()}, "kv_long");
  const Tensor kv = kv_long.slice(1, first, first + d.keys());
  const Fwd ref = run_forward_kv(q, kv.clone(), d, drop), f = run_forward_kv(q, kv, d, drop);
  EXPECT_EQ(bits_differ(f.out, ref.out), 0);
  EXPECT_EQ(bits_differ(f.lse, ref.lse), 0);
  const Grads expect = run_backward_kv(dout, q, kv.clone(), ref, d, drop);
  const Tensor before = randn({d.B, S_long, d.width()}, "dkv_long");
  Tensor dkv_long = before.clone(), dq = Tensor::empty(qkv_shape(d), DType::f32, MemCategory::other);
  Tensor dkv = dkv_long.slice(1, first, first + d.keys());
  ops::attention_backward(dq, dkv, dout, q, kv, f.out, f.lse, d, drop, {});
  EXPECT_EQ(bits_differ(query_slots(dq, d), query_slots(expect.dq, d)), 0);
  EXPECT_EQ(bits_differ(kv_slots(dkv, d), kv_slots(expect.dkv, d)), 0);
  EXPECT_EQ(bits_differ(query_slots(dkv, d), query_slots(before.slice(1, first, first + d.keys()), d)), 0);
  EXPECT_EQ(bits_differ(rows(dkv_long, 1, 0, first), rows(before, 1, 0, first)), 0);
  EXPECT_EQ(bits_differ(rows(dkv_long, 1, first + d.keys(), S_long), rows(before, 1, first + d.keys(), S_long)), 0);
}

// Same bits with 1, 2 and 3 threads when off is not block aligned and the backward cuts keys into several chunks.
TEST(AttentionKeys, DeterministicAcrossThreadCounts) {
  const QkvDims d{1, 200, 1, 2, 16, 330};
  const Dropout drop = attn_dropout(0.2f, "threads");
  const Tensor q = randn(qkv_shape(d), "q"), kv = randn(kv_shape(d), "kv"), dout = randn(out_shape(d), "dout");
  const int saved = omp_get_max_threads();
  std::vector<std::vector<float>> runs;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    const Fwd f = run_forward_kv(q, kv, d, drop);
    const Grads g = run_backward_kv(dout, q, kv, f, d, drop);
    std::vector<float> all;
    for (const Tensor* t : {&f.out, &f.lse, &g.dq, &g.dkv})
      for (float v : to_vector(*t)) all.push_back(v);
    runs.push_back(all);
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < runs.size(); ++i) {
    ASSERT_EQ(runs[0].size(), runs[i].size());
    EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[i].data(), runs[0].size() * sizeof(float))) << "run " << i;
  }
}

TEST(AttentionKeys, RejectsBadInputs) {
  const QkvDims d{1, 8, 2, 2, 8, 12};
  const Dropout none;
  Tensor out = Tensor::empty(out_shape(d), DType::f32), lse = Tensor::empty(lse_shape(d), DType::f32);
  Tensor q = Tensor::zeros(qkv_shape(d), DType::f32), kv = Tensor::zeros(kv_shape(d), DType::f32);
  Tensor dout = Tensor::zeros(out_shape(d), DType::f32), dkv = Tensor::zeros(kv_shape(d), DType::f32);
  QkvDims short_keys = d;
  short_keys.Sk = 5;
  testing::expect_error([&] { ops::attention_forward(out, lse, q, kv, short_keys, none, {}); },
                        {"attention_forward", "Sk (5)", "S (8)"});
  const Tensor wide = Tensor::zeros({1, 12, d.width() + 8}, DType::f32);
  testing::expect_error([&] { ops::attention_forward(out, lse, q, wide, d, none, {}); },
                        {"attention_forward", "kv must have shape [B, Sk, G*(R+2)*D] = [1, 12, 64]", "[1, 12, 72]"});
  const Tensor strided = wide.slice(2, 0, d.width());
  testing::expect_error([&] { ops::attention_forward(out, lse, q, strided, d, none, {}); },
                        {"attention_forward", "kv must have unit stride", "rows 64 elements apart", "[864, 72, 1]"});
  testing::expect_error([&] { ops::attention_backward(q, dkv, dout, q, kv, out, lse, d, none, {}); },
                        {"attention_backward", "dq must not share memory with q"});
  const Tensor kv_long = Tensor::zeros({1, 20, d.width()}, DType::f32);
  Tensor dq = Tensor::zeros(qkv_shape(d), DType::f32), dkv_overlap = kv_long.slice(1, 4, 16);
  testing::expect_error(
      [&] { ops::attention_backward(dq, dkv_overlap, dout, q, kv_long.slice(1, 0, 12), out, lse, d, none, {}); },
      {"attention_backward", "dkv must not share memory with kv"});
}

// ---- RoPE ----------------------------------------------------------------------------------------

Tensor make_rope(int64_t S, int64_t D, float base = 10000.0f) {
  Tensor rope = Tensor::empty({S, D}, DType::f32, MemCategory::other);
  ops::rope_table(rope, base, {});
  return rope;
}

// The table is cos/sin of f32-rounded double angles: 2e-7 absolute. Dr = 12 is a whole head of 12 or the
// rotary part of a wider head; the frequencies depend on Dr only.
TEST(RopeTable, MatchesFormula) {
  const int64_t S = 300, Dr = 12;
  const Tensor rope = make_rope(S, Dr, 500.0f);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = 0; j < Dr / 2; ++j) {
      const double a = s * std::pow(500.0, -2.0 * j / Dr);
      EXPECT_NEAR(rope.data<float>()[s * Dr + j], std::cos(a), 2e-7);
      EXPECT_NEAR(rope.data<float>()[s * Dr + Dr / 2 + j], std::sin(a), 2e-7);
    }
}

// Query and key slots: pairs (j, j + Dr/2) of the first Dr channels rotated by the rotate-half formula;
// channels Dr..D-1 and value slots stay as they are.
std::vector<double> rope_reference(const Tensor& x, const Tensor& rope, const QkvDims& d) {
  const auto xv = to_vector(x), rv = to_vector(rope);
  std::vector<double> expect(xv.begin(), xv.end());
  const int64_t Dr = rope.size(1), half = Dr / 2;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t s = 0; s < d.S; ++s)
      for (int64_t g = 0; g < d.G; ++g)
        for (int64_t slot = 0; slot <= d.R; ++slot) {
          const int64_t o = (b * d.S + s) * d.width() + (g * (d.R + 2) + slot) * d.D;
          for (int64_t j = 0; j < half; ++j) {
            const double c = rv[s * Dr + j], sn = rv[s * Dr + half + j];
            expect[o + j] = xv[o + j] * c - xv[o + j + half] * sn;
            expect[o + j + half] = xv[o + j + half] * c + xv[o + j] * sn;
          }
        }
  return expect;
}

// 1e-6 (f32 rounding).
TEST(RopeForward, MatchesNaiveFormula) {
  const QkvDims d{2, 9, 2, 2, 8};
  const Tensor rope = make_rope(12, d.D);  // longer table than S is allowed
  const Tensor x = randn(qkv_shape(d), "x");
  Tensor y = x.clone();
  ops::rope_forward(y, rope, d, {});
  EXPECT_TENSOR_NEAR(y, from_doubles(qkv_shape(d), rope_reference(x, rope, d)), 1e-6, 1e-6);
}

// Partial rotary (Megatron's --rotary-percent): Dr = 6 and 2 of D = 16. Rotated channels match the
// reference to 1e-6; every other element (pass-through channels, value slots) keeps its bits, also in bf16 / f16.
TEST(RopeForward, PartialRotaryRotatesOnlyFirstDrChannels) {
  const QkvDims d{2, 9, 2, 2, 16};
  for (const int64_t Dr : {int64_t{6}, int64_t{2}}) {
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE("Dr " + std::to_string(Dr) + " " + std::string(dtype_name(t)));
      const Tensor rope = make_rope(d.S, Dr);
      const Tensor x = randn(qkv_shape(d), "x").to(t);
      Tensor y = x.clone();
      ops::rope_forward(y, rope, d, {});
      const double rtol = t == DType::f32 ? 1e-6 : t == DType::f16 ? 5e-4 : 4e-3;
      EXPECT_TENSOR_NEAR(y, from_doubles(qkv_shape(d), rope_reference(x, rope, d)), rtol, 1e-6);
      const size_t esize = dtype_size(t);
      int64_t changed = 0;
      for (int64_t row = 0; row < d.B * d.S; ++row)
        for (int64_t slot = 0; slot < d.G * (d.R + 2); ++slot) {
          const bool rotated = slot % (d.R + 2) <= d.R;
          const int64_t first = rotated ? Dr : 0, o = row * d.width() + slot * d.D;
          const char* a = static_cast<const char*>(x.raw()) + (o + first) * esize;
          const char* b = static_cast<const char*>(y.raw()) + (o + first) * esize;
          changed += std::memcmp(a, b, (d.D - first) * esize) != 0;
        }
      EXPECT_EQ(changed, 0);
      Tensor back = y.clone();
      ops::rope_backward(back, rope, d, {});
      if (t == DType::f32) EXPECT_TENSOR_NEAR(back, x, 1e-6, 1e-6);
    }
  }
}

TEST(RopeForward, RejectsBadRotaryDim) {
  const QkvDims d{1, 4, 1, 1, 8};
  Tensor qkv = randn(qkv_shape(d), "x");
  auto expect_error = [](auto&& fn, const char* op, const char* detail) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << detail;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(op), std::string::npos) << msg;
      EXPECT_NE(msg.find(detail), std::string::npos) << msg;
    }
  };
  Tensor odd = Tensor::zeros({4, 5}, DType::f32), wide = Tensor::zeros({4, 10}, DType::f32);
  expect_error([&] { ops::rope_table(odd, 10000.0f, {}); }, "rope_table", "Dr = 5");
  expect_error([&] { ops::rope_forward(qkv, odd, d, {}); }, "rope_forward", "Dr = 5");
  expect_error([&] { ops::rope_backward(qkv, wide, d, {}); }, "rope_backward", "Dr = 10 and D = 8");
}

TEST(RopeBackward, InvertsForward) {
  const QkvDims d{1, 40, 3, 1, 16};
  const Tensor rope = make_rope(d.S, d.D);
  const Tensor x = randn(qkv_shape(d), "x");
  Tensor y = x.clone();
  ops::rope_forward(y, rope, d, {});
  ops::rope_backward(y, rope, d, {});
  EXPECT_TENSOR_NEAR(y, x, 1e-6, 1e-6);
}

// rope is linear, so central differences are exact up to rounding: 1e-3 relative / absolute. Full rotation and
// partial rotation (Dr = 4 of D = 8).
TEST(RopeBackward, IsTransposeOfForward) {
  for (const auto& dims :
       {std::pair{QkvDims{1, 4, 1, 2, 6}, int64_t{6}}, std::pair{QkvDims{1, 3, 1, 1, 8}, int64_t{4}}}) {
    const QkvDims d = dims.first;  // not a structured binding: clang 14 (the fuzz build) cannot capture those
    const int64_t Dr = dims.second;
    const Tensor rope = make_rope(d.S, Dr, 100.0f);
    Tensor x = randn(qkv_shape(d), "x");
    const Tensor w = randn(qkv_shape(d), "w");
    auto loss = [&] {
      Tensor y = x.clone();
      ops::rope_forward(y, rope, d, {});
      return testing::weighted_sum(y, w);
    };
    const Tensor numeric = testing::numerical_gradient(loss, x);
    Tensor analytic = w.clone();
    ops::rope_backward(analytic, rope, d, {});
    SCOPED_TRACE("Dr = " + std::to_string(Dr));
    EXPECT_TENSOR_NEAR(analytic, numeric, 1e-3, 1e-3);
  }
}

// bf16 / f16 rotate in f32 and round once: 2^-8 (bf16) or 2^-11 (f16) relative to the f32 result.
TEST(RopeForward, Bf16AndF16MatchF32) {
  const QkvDims d{1, 20, 2, 2, 8};
  const Tensor rope = make_rope(d.S, d.D);
  for (DType t : {DType::bf16, DType::f16}) {
    Tensor x16 = randn(qkv_shape(d), "x").to(t);
    Tensor x32 = x16.to(DType::f32);
    ops::rope_forward(x16, rope, d, {});
    ops::rope_forward(x32, rope, d, {});
    EXPECT_TENSOR_NEAR(x16, x32, t == DType::bf16 ? 4e-3 : 5e-4, 1e-5);
  }
}

}  // namespace
}  // namespace moecore
