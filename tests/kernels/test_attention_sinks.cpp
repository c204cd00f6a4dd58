// Tests of attention_forward / attention_backward with AttentionOptions on the CPU: a sliding window, learnable
// sinks, off-by-one sinks and both, against a naive reference in double (the explicit softmax over [scores, sink],
// separate q and kv tensors, queries as the last S of Sk keys), central finite differences of q, kv and the sinks,
// bitwise equality of a window longer than the keys with no window, the skipping of key blocks outside every row's
// window, and entry checks.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using ops::AttentionOptions;
using ops::Dropout;
using ops::QkvDims;
using testing::randn;
using testing::to_vector;

enum class Sink { none, off_by_one, learnable };

struct Case {
  QkvDims d;
  int64_t window;
  Sink sink;
};

std::string name_of(const Case& c) {
  const char* sinks[] = {"none", "off_by_one", "learnable"};
  return "B" + std::to_string(c.d.B) + "_S" + std::to_string(c.d.S) + "_Sk" + std::to_string(c.d.keys()) + "_G" +
         std::to_string(c.d.G) + "_R" + std::to_string(c.d.R) + "_D" + std::to_string(c.d.D) + "_window" +
         std::to_string(c.window) + "_sink_" + sinks[static_cast<int>(c.sink)];
}

Tensor from_doubles(const Shape& shape, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, DType::f32, MemCategory::other);
  for (size_t i = 0; i < v.size(); ++i) t.data<float>()[i] = static_cast<float>(v[i]);
  return t;
}

struct Problem {
  Case c;
  Tensor q, kv, sinks, dout;  // q [B, S, W], kv [B, Sk, W], sinks [Hq] (learnable only), dout [B, S, Hq*D]
  AttentionOptions opt() const { return {c.window, c.sink == Sink::off_by_one, sinks.defined() ? &sinks : nullptr}; }
};

Problem problem(const Case& c) {
  const QkvDims& d = c.d;
  Problem p{c, randn({d.B, d.S, d.width()}, "q"), randn({d.B, d.keys(), d.width()}, "kv"), Tensor(),
            randn({d.B, d.S, d.q_heads() * d.D}, "dout")};
  if (c.sink == Sink::learnable) p.sinks = randn({d.q_heads()}, "sinks", 1.5f);
  return p;
}

// Naive attention in double: for the query at position pos = Sk - S + i, the keys max(0, pos - window) .. pos and the
// sink logit s_h (0 for off-by-one) form one softmax row; the sink's probability is dropped.
struct Reference {
  std::vector<double> out, lse, dq, dkv, dsinks;
};

Reference reference(const Problem& pr) {
  const QkvDims& d = pr.c.d;
  const auto q = to_vector(pr.q), kv = to_vector(pr.kv), dout = to_vector(pr.dout);
  const std::vector<float> sinks = pr.sinks.defined() ? to_vector(pr.sinks) : std::vector<float>(d.q_heads(), 0.0f);
  const bool has_sink = pr.c.sink != Sink::none;
  const int64_t W = d.width(), H = d.q_heads(), OW = H * d.D, Sk = d.keys(), off = Sk - d.S;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
  auto q_at = [&](int64_t b, int64_t s, int64_t h) {
    return (b * d.S + s) * W + ((h / d.R) * (d.R + 2) + h % d.R) * d.D;
  };
  auto k_at = [&](int64_t b, int64_t s, int64_t g) { return (b * Sk + s) * W + (g * (d.R + 2) + d.R) * d.D; };
  Reference ref{std::vector<double>(d.B * d.S * OW), std::vector<double>(d.B * H * d.S),
                std::vector<double>(d.B * d.S * W), std::vector<double>(d.B * Sk * W), std::vector<double>(H)};
  std::vector<double> x(Sk), p(Sk), dp(Sk);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < d.S; ++i) {
        const int64_t g = h / d.R, qo = q_at(b, i, h), oo = (b * d.S + i) * OW + h * d.D, pos = off + i;
        const int64_t first = pr.c.window < 0 ? 0 : std::max<int64_t>(0, pos - pr.c.window);
        double sum = has_sink ? std::exp(double(sinks[h])) : 0.0;
        for (int64_t k = first; k <= pos; ++k) {
          double dot = 0;
          for (int64_t e = 0; e < d.D; ++e) dot += double(q[qo + e]) * kv[k_at(b, k, g) + e];
          x[k] = dot * scale;
          sum += std::exp(x[k]);
        }
        const double lse = std::log(sum);
        ref.lse[(b * H + h) * d.S + i] = lse;
        double delta = 0;
        for (int64_t k = first; k <= pos; ++k) {
          p[k] = std::exp(x[k] - lse);
          dp[k] = 0;
          for (int64_t e = 0; e < d.D; ++e) {
            ref.out[oo + e] += p[k] * kv[k_at(b, k, g) + d.D + e];
            dp[k] += double(dout[oo + e]) * kv[k_at(b, k, g) + d.D + e];
          }
          delta += p[k] * dp[k];
        }
        if (has_sink) ref.dsinks[h] -= std::exp(double(sinks[h]) - lse) * delta;
        for (int64_t k = first; k <= pos; ++k) {
          const double ds = p[k] * (dp[k] - delta) * scale;
          const int64_t ko = k_at(b, k, g);
          for (int64_t e = 0; e < d.D; ++e) {
            ref.dq[qo + e] += ds * kv[ko + e];
            ref.dkv[ko + e] += ds * q[qo + e];
            ref.dkv[ko + d.D + e] += p[k] * dout[oo + e];
          }
        }
      }
  return ref;
}

struct Result {
  Tensor out, lse, dq, dkv, dsinks;
};

Result run_forward(const Problem& pr) {
  const QkvDims& d = pr.c.d;
  Result r{Tensor::empty({d.B, d.S, d.q_heads() * d.D}, DType::f32, MemCategory::other),
           Tensor::empty({d.B, d.q_heads(), d.S}, DType::f32, MemCategory::other), Tensor(), Tensor(), Tensor()};
  ops::attention_forward(r.out, r.lse, pr.q, pr.kv, d, Dropout{}, pr.opt(), {});
  return r;
}

// dsinks starts at 0.5 (it accumulates); dq and dkv at 0 (the slots the op must not write stay 0, as in the
// reference).
Result run(const Problem& pr) {
  const QkvDims& d = pr.c.d;
  Result r = run_forward(pr);
  r.dq = Tensor::zeros(pr.q.shape(), DType::f32, MemCategory::other);
  r.dkv = Tensor::zeros(pr.kv.shape(), DType::f32, MemCategory::other);
  r.dsinks = Tensor::empty({d.q_heads()}, DType::f32, MemCategory::other);
  r.dsinks.fill_(0.5f);
  ops::attention_backward(r.dq, r.dkv, pr.sinks.defined() ? &r.dsinks : nullptr, pr.dout, pr.q, pr.kv, r.out, r.lse, d,
                          Dropout{}, pr.opt(), {});
  return r;
}

// S = 7 (one partial block), 100 (two), 200 (several key chunks in backward), GQA (R = 2, 4), MHA, B = 2, and
// queries that are the last S of Sk keys (context parallelism), with windows shorter than, across and past a block.
std::vector<Case> cases() {
  std::vector<Case> all;
  const QkvDims shapes[] = {{1, 7, 2, 2, 8}, {2, 100, 1, 4, 16}, {1, 200, 2, 1, 24}, {1, 70, 1, 2, 8, 150}};
  for (const QkvDims& d : shapes)
    for (int64_t window : {int64_t{-1}, int64_t{3}, int64_t{70}})
      for (Sink sink : {Sink::none, Sink::off_by_one, Sink::learnable})
        if (window >= 0 || sink != Sink::none) all.push_back({d, window, sink});
  return all;
}

// Same tolerances as the plain kernel against its reference (test_attention.cpp): f32 rounding of sums over at most
// 200 terms.
TEST(AttentionSinksWindow, MatchesNaiveReference) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(name_of(c));
    const Problem pr = problem(c);
    const Result r = run(pr);
    const Reference ref = reference(pr);
    EXPECT_TENSOR_NEAR(r.out, from_doubles(r.out.shape(), ref.out), 2e-5, 2e-6);
    EXPECT_TENSOR_NEAR(r.lse, from_doubles(r.lse.shape(), ref.lse), 2e-5, 2e-6);
    EXPECT_TENSOR_NEAR(r.dq, from_doubles(r.dq.shape(), ref.dq), 2e-4, 2e-5);
    EXPECT_TENSOR_NEAR(r.dkv, from_doubles(r.dkv.shape(), ref.dkv), 2e-4, 2e-5);
    if (c.sink == Sink::learnable) {
      std::vector<double> want = ref.dsinks;
      for (double& v : want) v += 0.5;
      EXPECT_TENSOR_NEAR(r.dsinks, from_doubles(r.dsinks.shape(), want), 2e-4, 2e-5);
    } else {
      EXPECT_EQ(to_vector(r.dsinks), std::vector<float>(c.d.q_heads(), 0.5f));  // untouched
    }
  }
}

// A sink takes probability mass: each row's weights sum to 1 - P_sink < 1, so with all values 1 every output is
// 1 - exp(s_h - lse) and not 1.
TEST(AttentionSinksWindow, SinkTakesProbabilityMass) {
  Problem pr = problem({{1, 9, 1, 2, 4}, -1, Sink::learnable});
  const QkvDims& d = pr.c.d;
  for (int64_t s = 0; s < d.S; ++s)
    for (int64_t e = 0; e < d.D; ++e) pr.kv.data<float>()[s * d.width() + (d.R + 1) * d.D + e] = 1.0f;
  const Result r = run_forward(pr);
  for (int64_t h = 0; h < d.q_heads(); ++h)
    for (int64_t i = 0; i < d.S; ++i) {
      const double expect = 1.0 - std::exp(pr.sinks.data<float>()[h] - r.lse.data<float>()[h * d.S + i]);
      EXPECT_LT(expect, 0.999);
      EXPECT_NEAR(r.out.data<float>()[i * d.q_heads() * d.D + h * d.D], expect, 1e-6);
    }
}

// Central differences of sum(out * dout) in float, h = 1e-2 (as in test_attention.cpp): 3e-3 relative, 3e-4 absolute.
TEST(AttentionSinksWindow, MatchesFiniteDifferences) {
  for (const Case& c : {Case{{1, 5, 1, 2, 4}, 1, Sink::learnable}, Case{{2, 4, 2, 1, 2, 7}, 2, Sink::learnable},
                        Case{{1, 6, 1, 2, 4}, 2, Sink::off_by_one}}) {
    SCOPED_TRACE(name_of(c));
    Problem pr = problem(c);
    auto loss = [&] { return testing::weighted_sum(run_forward(pr).out, pr.dout); };
    const Tensor num_q = testing::numerical_gradient(loss, pr.q);
    const Tensor num_kv = testing::numerical_gradient(loss, pr.kv);
    const Result r = run(pr);
    EXPECT_TENSOR_NEAR(r.dq, num_q, 3e-3, 3e-4);
    EXPECT_TENSOR_NEAR(r.dkv, num_kv, 3e-3, 3e-4);
    if (c.sink != Sink::learnable) continue;
    const Tensor num_s = testing::numerical_gradient(loss, pr.sinks);
    Tensor ds = r.dsinks.clone();
    for (int64_t h = 0; h < ds.numel(); ++h) ds.data<float>()[h] -= 0.5f;
    EXPECT_TENSOR_NEAR(ds, num_s, 3e-3, 3e-4);
  }
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// A window of Sk or more keys sees every earlier key: the bits of no window, forward and backward.
TEST(AttentionSinksWindow, WindowLongerThanKeysIsNoWindow) {
  for (Sink sink : {Sink::none, Sink::learnable})
    for (const QkvDims& d : {QkvDims{1, 200, 2, 1, 24}, QkvDims{1, 70, 1, 2, 8, 150}}) {
      Problem plain = problem({d, -1, sink}), wide = problem({d, d.keys(), sink});
      const Result a = run(plain), b = run(wide);
      EXPECT_TRUE(same_bits(a.out, b.out));
      EXPECT_TRUE(same_bits(a.lse, b.lse));
      EXPECT_TRUE(same_bits(a.dq, b.dq));
      EXPECT_TRUE(same_bits(a.dkv, b.dkv));
      EXPECT_TRUE(same_bits(a.dsinks, b.dsinks));
    }
}

// Key blocks outside every row's window are not read: NaN keys and values at positions 0..63 leave the rows whose
// query block (64 rows) starts past key 63 + window finite, forward and backward, and those of a window that reaches
// them NaN.
TEST(AttentionSinksWindow, SkipsKeyBlocksOutsideTheWindow) {
  const QkvDims d{1, 256, 1, 2, 8};
  for (int64_t window : {int64_t{3}, int64_t{100}}) {
    SCOPED_TRACE(window);
    Problem pr = problem({d, window, Sink::learnable});
    for (int64_t s = 0; s < 64; ++s)
      for (int64_t c = d.R * d.D; c < d.width(); ++c) pr.kv.data<float>()[s * d.width() + c] = NAN;
    const Result r = run(pr);
    const int64_t OW = d.q_heads() * d.D;
    bool finite_tail = true;
    for (int64_t i = 128; i < d.S; ++i)
      for (int64_t c = 0; c < OW; ++c) finite_tail = finite_tail && std::isfinite(r.out.data<float>()[i * OW + c]);
    for (int64_t i = 128 * d.width(); i < d.S * d.width(); ++i)
      finite_tail = finite_tail && std::isfinite(r.dq.data<float>()[i]) && std::isfinite(r.dkv.data<float>()[i]);
    EXPECT_EQ(finite_tail, window == 3);
  }
}

TEST(AttentionSinksWindow, RejectsBadOptions) {
  const Problem pr = problem({{1, 8, 2, 2, 8}, -1, Sink::learnable});
  Result r = run_forward(pr);
  auto fwd = [&](const AttentionOptions& o) {
    ops::attention_forward(r.out, r.lse, pr.q, pr.kv, pr.c.d, Dropout{}, o, {});
  };
  testing::expect_error([&] { fwd({-2}); }, {"attention_forward", "window", "-2"});
  testing::expect_error([&] { fwd({-1, true, &pr.sinks}); }, {"attention_forward", "exclusive"});
  const Tensor wrong = Tensor::zeros({3}, DType::f32, MemCategory::other);
  testing::expect_error([&] { fwd({-1, false, &wrong}); }, {"attention_forward", "sinks must have shape [4]"});
  Tensor dq = Tensor::zeros(pr.q.shape(), DType::f32, MemCategory::other), dkv = pr.kv.clone(), ds = wrong.clone();
  testing::expect_error(
      [&] {
        ops::attention_backward(dq, dkv, &ds, pr.dout, pr.q, pr.kv, r.out, r.lse, pr.c.d, Dropout{},
                                {-1, true, nullptr}, {});
      },
      {"attention_backward", "dsinks needs learnable sinks"});
}

}  // namespace
}  // namespace moecore
