// Dispatch and experts: permutation layout against a naive reference, round trips with identity experts,
// fused equals unfused, adjoint checks of the dispatch backward, grouped GEMM against per-group GEMMs,
// grouped experts against the sequential reference (with and without linear biases), finite differences of the
// experts and the shared expert.
// Tolerances are stated per test; f32 GEMM results are compared with rtol/atol ~1e-5, bf16 with ~2e-2.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "moecore/core/rng.h"
#include "moecore/moe/dispatcher.h"
#include "moecore/moe/experts.h"
#include "test_util.h"

namespace moecore {
namespace {

using moe::DispatchPlan;
using testing::randn;
using testing::to_vector;

const ops::Context kCpu{};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A [T, E] map where token t picks K distinct experts (a seeded shuffle), plus probs that are 0 elsewhere.
Tensor random_map(int64_t T, int64_t E, int64_t K, uint64_t seed) {
  Tensor map = Tensor::zeros({T, E}, DType::boolean);
  const PhiloxKey key = philox_key(seed, "test.map");
  std::vector<int64_t> perm(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t j = k + std::min<int64_t>(E - k - 1, int64_t(philox_uniform(key, t * K + k) * float(E - k)));
      std::swap(perm[k], perm[j]);
      map.data<bool>()[t * E + perm[k]] = true;
    }
  }
  return map;
}

Tensor probs_for(const Tensor& map, float value_or_negative_for_random) {
  Tensor p = Tensor::zeros(map.shape(), DType::f32);
  const Tensor r = randn(map.shape(), "probs");
  for (int64_t i = 0; i < map.numel(); ++i)
    if (map.data<bool>()[i])
      p.data<float>()[i] =
          value_or_negative_for_random >= 0 ? value_or_negative_for_random : 0.1f + std::fabs(r.data<float>()[i]);
  return p;
}

DispatchPlan plan_for(const Tensor& map) {
  DispatchPlan plan;
  moe::dispatch_plan_build(plan, map, kCpu);
  return plan;
}

// ---- Dispatch ----------------------------------------------------------------------------------

TEST(Dispatch, PlanAndPermuteMatchNaiveExpertMajorLayout) {
  const int64_t T = 37, E = 6, K = 3, H = 5;
  const Tensor map = random_map(T, E, K, 1), probs = probs_for(map, -1);
  const DispatchPlan plan = plan_for(map);
  std::vector<std::pair<int64_t, int64_t>> order;  // (t, e) expert-major, ascending token
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < T; ++t)
      if (map.data<bool>()[t * E + e]) order.push_back({t, e});
  ASSERT_EQ(plan.rows(), int64_t(order.size()));
  for (int64_t e = 0, off = 0; e < E; ++e) {
    EXPECT_EQ(plan.expert_offset[e], off);
    off += plan.tokens_per_expert[e];
  }
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = randn({T, H}, "x").to(dt);
    Tensor px = Tensor::empty({T * K + 4, H}, dt), pp = Tensor::empty({T * K + 4}, DType::f32);
    moe::permute_tokens(px, pp, x, probs, plan, kCpu);
    const auto vx = to_vector(x), vpx = to_vector(px);
    for (size_t i = 0; i < order.size(); ++i) {
      const auto [t, e] = order[i];
      EXPECT_EQ(plan.row_token.data<int32_t>()[i], t);
      EXPECT_EQ(plan.token_rows.data<int32_t>()[t * E + e], int32_t(i));
      EXPECT_EQ(pp.data<float>()[i], probs.data<float>()[t * E + e]);
      for (int64_t j = 0; j < H; ++j) ASSERT_EQ(vpx[i * H + j], vx[t * H + j]);
    }
  }
  for (int64_t i = 0; i < T * E; ++i) {
    if (!map.data<bool>()[i]) {
      EXPECT_EQ(plan.token_rows.data<int32_t>()[i], -1);
    }
  }
}

TEST(Dispatch, DroplessTokensPerExpertSumToTK) {
  for (int64_t K : {1, 2, 4}) {
    const DispatchPlan plan = plan_for(random_map(50, 8, K, 2));
    EXPECT_EQ(std::accumulate(plan.tokens_per_expert.begin(), plan.tokens_per_expert.end(), int64_t{0}), 50 * K);
    EXPECT_EQ(moe::dispatch_max_rows(50, 8, K, 0, false, 0), 50 * K);
  }
  EXPECT_EQ(moe::dispatch_max_rows(50, 8, 2, 10, true, 0), 80);    // E * capacity
  EXPECT_EQ(moe::dispatch_max_rows(50, 8, 2, 20, false, 0), 100);  // min(T*K, E*capacity)
  EXPECT_EQ(moe::dispatch_max_rows(50, 8, 2, 0, false, 16), 100 + 8 * 15);
}

TEST(Dispatch, PlanRejectsMoreRowsThanTheBuffers) {
  moe::DispatchBuffers buf = moe::dispatch_buffers_alloc(10, 4, 4, 15, DType::f32);
  EXPECT_THROW(moe::dispatch_plan_build(buf.plan, random_map(10, 4, 2, 3), kCpu), Error);
}

// Megatron's dropless round trip: experts = identity times the probability 1/K, combine = x.
// Backward with dy = x returns x. f32 sums of K terms of x/K: rtol 1e-6.
TEST(Dispatch, LocalRoundTripWithIdentityExpertsReturnsInput) {
  const int64_t T = 33, E = 8, K = 2, H = 16;
  const Tensor map = random_map(T, E, K, 4), probs = probs_for(map, 1.0f / K);
  const Tensor x = randn({T, H}, "x");
  moe::DispatchBuffers buf =
      moe::dispatch_buffers_alloc(T, H, E, moe::dispatch_max_rows(T, E, K, 0, false, 0), DType::f32);
  moe::LocalDispatcher disp;
  disp.dispatch_prepare(buf, x, probs, map, kCpu);
  disp.dispatch(buf, kCpu);
  const int64_t R = buf.plan.rows();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < H; ++j)
      buf.expert_out.data<float>()[r * H + j] =
          buf.permuted_x.data<float>()[r * H + j] * buf.permuted_probs.data<float>()[r];
  Tensor y = Tensor::empty({T, H}, DType::f32);
  disp.combine_prepare(buf, kCpu);
  disp.combine(buf, kCpu);
  disp.combine_finish(buf, y, kCpu);
  EXPECT_TENSOR_NEAR(y, x, 1e-6, 1e-7);

  disp.combine_backward(buf, x, kCpu);  // dy = x
  for (int64_t r = 0; r < R; ++r) {
    buf.dpermuted_probs.data<float>()[r] = float(r);
    for (int64_t j = 0; j < H; ++j)
      buf.dexpert_in.data<float>()[r * H + j] = buf.dpermuted.data<float>()[r * H + j] / K;
  }
  Tensor dx = Tensor::zeros({T, H}, DType::f32), dprobs = Tensor::empty({T, E}, DType::f32);
  dprobs.fill_(kNaN);
  disp.dispatch_backward(buf, dx, dprobs, kCpu);
  EXPECT_TENSOR_NEAR(dx, x, 1e-6, 1e-7);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = buf.plan.token_rows.data<int32_t>()[t * E + e];
      EXPECT_EQ(dprobs.data<float>()[t * E + e], r >= 0 ? float(r) : 0.0f);
    }
}

// The fused single-pass kernels equal a naive unfused loop (scatter-add in ascending row order), bit for bit:
// ascending rows within a token are ascending experts, the order unpermute promises.
TEST(Dispatch, FusedUnpermuteEqualsNaiveLoop) {
  const int64_t T = 41, E = 7, K = 3, H = 19;
  const Tensor map = random_map(T, E, K, 5);
  const DispatchPlan plan = plan_for(map);
  const int64_t R = plan.rows();
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor rows = randn({R, H}, "rows").to(dt);
    const auto vr = to_vector(rows);
    for (bool accumulate : {false, true}) {
      const Tensor y0 = randn({T, H}, "y0");
      Tensor y = y0.clone();
      moe::unpermute_tokens(y, rows, plan, accumulate, kCpu);
      std::vector<float> ref = accumulate ? to_vector(y0) : std::vector<float>(T * H, 0.0f);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < H; ++j) ref[plan.row_token.data<int32_t>()[r] * H + j] += vr[r * H + j];
      EXPECT_EQ(to_vector(y), ref) << dtype_name(dt) << " accumulate " << accumulate;
    }
  }
}

// Adjoint identities of the backward stages: <permute(x), r> == <x, unpermute(r)> and
// <permuted_probs(p), q> == <p, scatter(q)>. Double sums of f32 values: rtol 1e-5.
TEST(Dispatch, BackwardStagesAreAdjointsOfTheForward) {
  const int64_t T = 29, E = 5, K = 2, H = 12;
  const Tensor map = random_map(T, E, K, 6), probs = probs_for(map, -1);
  const Tensor x = randn({T, H}, "x");
  moe::DispatchBuffers buf = moe::dispatch_buffers_alloc(T, H, E, T * K, DType::f32);
  moe::LocalDispatcher disp;
  disp.dispatch_prepare(buf, x, probs, map, kCpu);
  const int64_t R = buf.plan.rows();
  const Tensor r = randn({R, H}, "r"), q = randn({R}, "q");
  buf.dexpert_in.slice(0, 0, R).copy_from(r);
  buf.dpermuted_probs.slice(0, 0, R).copy_from(q);
  Tensor dx = Tensor::zeros({T, H}, DType::f32), dprobs = Tensor::empty({T, E}, DType::f32);
  disp.dispatch_backward(buf, dx, dprobs, kCpu);
  const double lhs_x = testing::weighted_sum(buf.permuted_x.slice(0, 0, R), r), rhs_x = testing::weighted_sum(x, dx);
  const double lhs_p = testing::weighted_sum(buf.permuted_probs.slice(0, 0, R), q);
  const double rhs_p = testing::weighted_sum(probs, dprobs);
  EXPECT_NEAR(lhs_x, rhs_x, 1e-5 * (1 + std::fabs(lhs_x)));
  EXPECT_NEAR(lhs_p, rhs_p, 1e-5 * (1 + std::fabs(lhs_p)));
  // combine is unpermute; its backward (gather of dy) is permute: <unpermute(e), dy> == <e, gather(dy)>.
  const Tensor eo = randn({R, H}, "eo"), dy = randn({T, H}, "dy");
  buf.expert_out.slice(0, 0, R).copy_from(eo);
  Tensor y = Tensor::empty({T, H}, DType::f32);
  disp.combine_prepare(buf, kCpu);
  disp.combine_finish(buf, y, kCpu);
  disp.combine_backward(buf, dy, kCpu);
  const double lhs_c = testing::weighted_sum(y, dy), rhs_c = testing::weighted_sum(eo, buf.dpermuted.slice(0, 0, R));
  EXPECT_NEAR(lhs_c, rhs_c, 1e-5 * (1 + std::fabs(lhs_c)));
}

// ---- Grouped GEMM ------------------------------------------------------------------------------

const std::vector<int64_t> kGroups = {0, 5, 0, 17, 1, 0, 64, 3};  // zero-row groups included
// Balanced enough that, with several threads, whole groups are handed to threads.
const std::vector<int64_t> kBalanced = {9, 11, 10, 12, 0, 10, 9, 11, 10, 12};

// Cheap hash-based values in [-1, 1): the large GEMM cases would spend seconds in Box-Muller otherwise.
Tensor hashed(const Shape& shape, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ (seed * 40503u + 0x9e3779b9u);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = float(h & 0xffff) / 32768.0f - 1.0f;
  }
  return t;
}

int64_t total(const std::vector<int64_t>& g) {
  return std::accumulate(g.begin(), g.end(), int64_t{0});
}

// c per group through ops::gemm on row slices (the reference).
void gemm_per_group(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const std::vector<int64_t>& groups,
                    float beta) {
  int64_t o = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g] > 0) {
      Tensor cg = c.slice(0, o, o + groups[g]);
      ops::gemm(cg, a.slice(0, o, o + groups[g]), false, b.select(0, int64_t(g)), trans_b, 1.0f, beta, kCpu);
    }
    o += groups[g];
  }
}

// f32: both sides accumulate in f32 over K = 45 terms (rtol/atol 1e-5); a bf16 output adds one rounding
// of either side (rtol 8e-3). With beta = 0 c starts as NaN: it must not be read.
void check_grouped(const std::vector<int64_t>& groups, int64_t N, int64_t K, DType in, DType out) {
  const int64_t R = total(groups), G = int64_t(groups.size());
  const Tensor a = hashed({R, K}, 1).to(in);
  for (bool tb : {true, false})
    for (float beta : {0.0f, 1.0f}) {
      const Tensor b = hashed(tb ? Shape{G, N, K} : Shape{G, K, N}, 2).to(in);
      Tensor c0 = hashed({R, N}, 3).to(out);
      if (beta == 0.0f) c0.fill_(kNaN);
      Tensor c = c0.clone(), ref = c0.clone();
      ops::gemm_grouped(c, a, b, tb, groups, beta, kCpu);
      gemm_per_group(ref, a, b, tb, groups, beta);
      const double rtol = out == DType::bf16 ? 8e-3 : 1e-5;
      EXPECT_LE(testing::tolerance_ratio(c, ref, rtol, 1e-5 * std::sqrt(double(K))), 1.0)
          << dtype_name(in) << "->" << dtype_name(out) << " trans_b " << tb << " beta " << beta << " N " << N << " K "
          << K;
    }
}

TEST(GroupedGemm, MatchesPerGroupGemm) {
  for (const auto* groups : {&kGroups, &kBalanced})
    for (DType in : {DType::f32, DType::bf16})
      for (DType out : {DType::f32, DType::bf16}) check_grouped(*groups, 29, 45, in, out);
}

// Large enough that bf16 widening is tiled along N, rows and (for the f32 accumulator) both.
TEST(GroupedGemm, TiledBf16Widening) {
  check_grouped({0, 700}, 600, 8192, DType::bf16, DType::bf16);
}

// c[g] = a_g^T b_g + beta c[g]; zero-row groups get beta * c[g]. M = 128 exercises the padded-copy path.
TEST(GroupedGemm, WgradMatchesPerGroupGemm) {
  for (const auto* groups : {&kGroups, &kBalanced})
    for (DType in : {DType::f32, DType::bf16})
      for (int64_t M : {int64_t{37}, int64_t{128}})
        for (float beta : {0.0f, 1.0f, 0.5f}) {
          const std::vector<int64_t>& kg = *groups;
          const int64_t R = total(kg), G = int64_t(kg.size()), N = 23;
          const Tensor a = randn({R, M}, "a").to(in), b = randn({R, N}, "b").to(in);
          Tensor c0 = randn({G, M, N}, "c");
          Tensor c = c0.clone(), ref = c0.clone();
          ops::gemm_grouped_wgrad(c, a, b, kg, beta, kCpu);
          int64_t o = 0;
          for (int64_t g = 0; g < G; ++g) {
            Tensor rg = ref.select(0, g);
            const int64_t n = kg[g];
            if (n > 0)
              ops::gemm(rg, a.slice(0, o, o + n), true, b.slice(0, o, o + n), false, 1.0f, beta, kCpu);
            else
              for (int64_t i = 0; i < M * N; ++i) rg.data<float>()[i] *= beta;
            o += n;
          }
          EXPECT_LE(testing::tolerance_ratio(c, ref, 1e-5, 1e-4), 1.0)
              << dtype_name(in) << " M " << M << " beta " << beta;
        }
}

TEST(GroupedGemm, WgradTiledBf16Rows) {
  const std::vector<int64_t> groups = {700, 0};
  const Tensor a = hashed({700, 8192}, 4).to(DType::bf16), b = hashed({700, 64}, 5).to(DType::bf16);
  for (float beta : {0.0f, 0.5f, 1.0f}) {
    Tensor c = hashed({2, 8192, 64}, 6), ref = c.clone();
    ops::gemm_grouped_wgrad(c, a, b, groups, beta, kCpu);
    Tensor r0 = ref.select(0, 0), r1 = ref.select(0, 1);
    ops::gemm(r0, a, true, b, false, 1.0f, beta, kCpu);
    ops::scale(r1, beta, kCpu);
    EXPECT_TENSOR_NEAR(c, ref, 1e-5, 1e-3);
  }
}

TEST(GroupedGemm, BadGroupsThrow) {
  Tensor c = Tensor::empty({10, 4}, DType::f32), a = Tensor::empty({10, 3}, DType::f32);
  const Tensor b = Tensor::empty({2, 4, 3}, DType::f32);
  EXPECT_THROW(ops::gemm_grouped(c, a, b, true, {4, 5}, 0.0f, kCpu), Error);
  EXPECT_THROW(ops::gemm_grouped(c, a, b, true, {4, 5, 1}, 0.0f, kCpu), Error);
  EXPECT_THROW(ops::gemm_grouped(c, a, b, true, {11, -1}, 0.0f, kCpu), Error);
}

// ---- Routed experts ----------------------------------------------------------------------------

struct ExpertCase {
  moe::ExpertDims d;
  std::vector<int64_t> tpe;
  moe::ExpertWeights w;
  Tensor x, probs, dy;  // x, dy [R, H] compute; probs [R] f32
};

ExpertCase make_case(bool swiglu, DType dt, std::vector<int64_t> tpe, int64_t H, int64_t F, bool bias = false) {
  ExpertCase c;
  const int64_t E = int64_t(tpe.size()), R = total(tpe);
  c.d.E = E;
  c.d.H = H;
  c.d.F = F;
  c.d.swiglu = swiglu;
  c.d.max_rows = R + 3;  // larger than R: the experts must use only the first R rows
  c.d.compute = dt;
  c.tpe = tpe;
  c.w.fc1 = randn({E, c.d.fc1_rows(), H}, "fc1", 1.0f / std::sqrt(float(H))).to(dt);
  c.w.fc2 = randn({E, H, F}, "fc2", 1.0f / std::sqrt(float(F))).to(dt);
  if (bias) {
    c.w.fc1_bias = randn({E, c.d.fc1_rows()}, "fc1_bias", 0.5f);
    c.w.fc2_bias = randn({E, H}, "fc2_bias", 0.5f);
  }
  if (R == 0) {  // core's rng/convert pass null pointers to memcpy for empty tensors (UBSan)
    c.x = Tensor::empty({0, H}, dt);
    c.dy = Tensor::empty({0, H}, dt);
    c.probs = Tensor::empty({0}, DType::f32);
    return c;
  }
  c.x = randn({R, H}, "x").to(dt);
  c.dy = randn({R, H}, "dy").to(dt);
  c.probs = randn({R}, "p");
  for (int64_t r = 0; r < R; ++r) c.probs.data<float>()[r] = 0.2f + 0.5f * std::fabs(c.probs.data<float>()[r]);
  return c;
}

struct ExpertResult {
  Tensor y, dx, dprobs;
  moe::ExpertGrads g;
};

// Caches, workspace and written outputs start as NaN: anything read before written shows up.
ExpertResult run_experts(const ExpertCase& c, bool grouped, int backward_calls = 1) {
  const int64_t R = c.x.size(0), H = c.d.H, E = c.d.E;
  moe::ExpertCache cache = moe::expert_cache_alloc(c.d);
  moe::ExpertWorkspace ws = moe::expert_workspace_alloc(c.d);
  for (Tensor* t : {&cache.h, &cache.act, &ws.a, &ws.da, &ws.dh}) t->fill_(kNaN);
  ExpertResult r{Tensor::empty({R, H}, c.d.compute),
                 Tensor::empty({R, H}, DType::f32),
                 Tensor::empty({R}, DType::f32),
                 {Tensor::zeros({E, c.d.fc1_rows(), H}, DType::f32), Tensor::zeros({E, H, c.d.F}, DType::f32)}};
  if (c.w.fc1_bias.defined()) {
    r.g.fc1_bias = Tensor::zeros({E, c.d.fc1_rows()}, DType::f32);
    r.g.fc2_bias = Tensor::zeros({E, H}, DType::f32);
  }
  for (Tensor* t : {&r.y, &r.dx, &r.dprobs}) t->fill_(kNaN);
  if (grouped)
    moe::experts_forward(r.y, c.x, c.probs, c.tpe, c.w, cache, ws, c.d, kCpu);
  else
    moe::experts_forward_sequential(r.y, c.x, c.probs, c.tpe, c.w, cache, ws, c.d, kCpu);
  for (int i = 0; i < backward_calls; ++i) {
    if (grouped)
      moe::experts_backward(r.dx, r.dprobs, r.g, c.dy, c.x, c.probs, c.tpe, c.w, cache, ws, c.d, kCpu);
    else
      moe::experts_backward_sequential(r.dx, r.dprobs, r.g, c.dy, c.x, c.probs, c.tpe, c.w, cache, ws, c.d, kCpu);
  }
  return r;
}

bool all_finite(const Tensor& t) {
  const auto v = to_vector(t);
  return std::all_of(v.begin(), v.end(), [](float f) { return std::isfinite(f); });
}

// Same math, GEMMs issued differently. f32: rtol/atol 1e-5. bf16: intermediate roundings may land on the
// other side of a tie, so rtol 2e-2 with atol 2e-2 (values are O(1)); weight grads sum over rows, atol 5e-2.
TEST(Experts, GroupedEqualsSequentialWithZeroTokenExperts) {
  for (bool swiglu : {true, false})
    for (DType dt : {DType::f32, DType::bf16}) {
      const ExpertCase c = make_case(swiglu, dt, {7, 0, 13, 1, 9}, 32, 24);
      const ExpertResult a = run_experts(c, true), b = run_experts(c, false);
      const double rtol = dt == DType::f32 ? 1e-5 : 2e-2, atol = dt == DType::f32 ? 1e-5 : 2e-2;
      SCOPED_TRACE(std::string(swiglu ? "swiglu " : "gelu ") + std::string(dtype_name(dt)));
      EXPECT_TENSOR_NEAR(a.y, b.y, rtol, atol);
      EXPECT_TENSOR_NEAR(a.dx, b.dx, rtol, atol);
      EXPECT_TENSOR_NEAR(a.dprobs, b.dprobs, rtol, atol);
      EXPECT_TENSOR_NEAR(a.g.fc1, b.g.fc1, rtol, 2.5 * atol);
      EXPECT_TENSOR_NEAR(a.g.fc2, b.g.fc2, rtol, 2.5 * atol);
      for (const ExpertResult* r : {&a, &b}) {
        for (const Tensor* t : {&r->y, &r->dx, &r->dprobs, &r->g.fc1, &r->g.fc2}) EXPECT_TRUE(all_finite(*t));
        EXPECT_EQ(ops::sum_squares(r->g.fc1.select(0, 1), kCpu), 0.0);  // the expert with no tokens
        EXPECT_EQ(ops::sum_squares(r->g.fc2.select(0, 1), kCpu), 0.0);
      }
    }
}

// With Megatron's add_bias_linear: h = x W1^T + b1, y = p (act(h) W2^T + b2). Grouped equals sequential (same
// tolerances as above), and against a naive per-row reference in f32 (rtol/atol 1e-5).
TEST(Experts, BiasesGroupedEqualsSequentialAndNaive) {
  for (bool swiglu : {true, false})
    for (DType dt : {DType::f32, DType::bf16}) {
      const ExpertCase c = make_case(swiglu, dt, {7, 0, 13, 1, 9}, 32, 24, true);
      const ExpertResult a = run_experts(c, true), b = run_experts(c, false);
      const double rtol = dt == DType::f32 ? 1e-5 : 2e-2, atol = dt == DType::f32 ? 1e-5 : 2e-2;
      SCOPED_TRACE(std::string(swiglu ? "swiglu " : "gelu ") + std::string(dtype_name(dt)));
      EXPECT_TENSOR_NEAR(a.y, b.y, rtol, atol);
      EXPECT_TENSOR_NEAR(a.dx, b.dx, rtol, atol);
      EXPECT_TENSOR_NEAR(a.dprobs, b.dprobs, rtol, atol);
      for (auto [ga, gb] : {std::pair{&a.g.fc1, &b.g.fc1},
                            {&a.g.fc2, &b.g.fc2},
                            {&a.g.fc1_bias, &b.g.fc1_bias},
                            {&a.g.fc2_bias, &b.g.fc2_bias}})
        EXPECT_TENSOR_NEAR(*ga, *gb, rtol, 2.5 * atol);
      EXPECT_EQ(ops::sum_squares(a.g.fc1_bias.select(0, 1), kCpu), 0.0);  // the expert with no tokens
      EXPECT_EQ(ops::sum_squares(a.g.fc2_bias.select(0, 1), kCpu), 0.0);
      if (dt != DType::f32) continue;
      // Naive reference of y: per row r of expert e, fc1 + b1, activation, times p, fc2, plus p * b2.
      const int64_t H = c.d.H, F = c.d.F, F1 = c.d.fc1_rows();
      std::vector<float> yref;
      for (int64_t e = 0, r = 0; e < c.d.E; ++e)
        for (int64_t i = 0; i < c.tpe[e]; ++i, ++r) {
          std::vector<double> h(F1), act(F);
          for (int64_t j = 0; j < F1; ++j) {
            h[j] = c.w.fc1_bias.data<float>()[e * F1 + j];
            for (int64_t k = 0; k < H; ++k)
              h[j] += double(c.x.data<float>()[r * H + k]) * c.w.fc1.data<float>()[(e * F1 + j) * H + k];
          }
          for (int64_t j = 0; j < F; ++j) {
            const double g = h[j];
            act[j] = swiglu ? g / (1 + std::exp(-g)) * h[F + j] : 0.5 * g * (1 + std::erf(g / std::sqrt(2.0)));
          }
          const double p = c.probs.data<float>()[r];
          for (int64_t k = 0; k < H; ++k) {
            double acc = 0;
            for (int64_t j = 0; j < F; ++j) acc += act[j] * p * c.w.fc2.data<float>()[(e * H + k) * F + j];
            yref.push_back(float(acc + p * c.w.fc2_bias.data<float>()[e * H + k]));
          }
        }
      const auto y = to_vector(a.y);
      ASSERT_EQ(y.size(), yref.size());
      for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], yref[i], 1e-5 + 1e-5 * std::fabs(yref[i])) << i;
    }
}

// Zero biases give exactly the bias-free result (the bias-free path never touches the bias ops).
TEST(Experts, ZeroBiasesEqualNoBiases) {
  const ExpertCase plain = make_case(true, DType::f32, {4, 0, 6}, 16, 8);
  ExpertCase zero = plain;
  zero.w.fc1_bias = Tensor::zeros({3, 16}, DType::f32);
  zero.w.fc2_bias = Tensor::zeros({3, 16}, DType::f32);
  const ExpertResult a = run_experts(plain, true), b = run_experts(zero, true);
  EXPECT_EQ(to_vector(a.y), to_vector(b.y));
  EXPECT_EQ(to_vector(a.dx), to_vector(b.dx));
  EXPECT_EQ(to_vector(a.dprobs), to_vector(b.dprobs));
  EXPECT_EQ(to_vector(a.g.fc1), to_vector(b.g.fc1));
  EXPECT_EQ(to_vector(a.g.fc2), to_vector(b.g.fc2));
  EXPECT_FALSE(a.g.fc1_bias.defined());
}

TEST(Experts, MissingBiasGradientsAreRejected) {
  const ExpertCase c = make_case(true, DType::f32, {2, 3}, 8, 4, true);
  ExpertCase half = c;
  half.w.fc2_bias = Tensor();
  EXPECT_THROW(run_experts(half, true), Error);  // fc1 bias without fc2 bias
  moe::ExpertCache cache = moe::expert_cache_alloc(c.d);
  moe::ExpertWorkspace ws = moe::expert_workspace_alloc(c.d);
  Tensor y = Tensor::empty({5, 8}, DType::f32), dx = Tensor::empty({5, 8}, DType::f32);
  Tensor dp = Tensor::empty({5}, DType::f32);
  moe::ExpertGrads g{Tensor::zeros({2, 8, 8}, DType::f32), Tensor::zeros({2, 8, 4}, DType::f32)};
  moe::experts_forward(y, c.x, c.probs, c.tpe, c.w, cache, ws, c.d, kCpu);
  EXPECT_THROW(moe::experts_backward(dx, dp, g, c.dy, c.x, c.probs, c.tpe, c.w, cache, ws, c.d, kCpu), Error);
}

TEST(Experts, NoRowsAtAll) {
  for (bool bias : {false, true}) {
    const ExpertCase c = make_case(true, DType::f32, {0, 0, 0}, 8, 4, bias);
    for (bool grouped : {true, false}) {
      const ExpertResult r = run_experts(c, grouped);
      EXPECT_EQ(ops::sum_squares(r.g.fc1, kCpu) + ops::sum_squares(r.g.fc2, kCpu), 0.0);
      if (bias) {
        EXPECT_EQ(ops::sum_squares(r.g.fc1_bias, kCpu) + ops::sum_squares(r.g.fc2_bias, kCpu), 0.0);
      }
    }
  }
}

// Calling backward twice doubles the weight gradients (+=) and rewrites dx and dprobs identically.
// The second call adds the same product to a nonzero C, which may round differently: rtol 1e-6.
TEST(Experts, BackwardTwiceDoublesWeightGrads) {
  const ExpertCase c = make_case(true, DType::f32, {4, 0, 6}, 16, 8);
  const ExpertResult once = run_experts(c, true, 1), twice = run_experts(c, true, 2);
  Tensor g1 = once.g.fc1.clone(), g2 = once.g.fc2.clone();
  ops::scale(g1, 2.0f, kCpu);
  ops::scale(g2, 2.0f, kCpu);
  EXPECT_TENSOR_NEAR(twice.g.fc1, g1, 1e-6, 1e-7);
  EXPECT_TENSOR_NEAR(twice.g.fc2, g2, 1e-6, 1e-7);
  EXPECT_EQ(to_vector(twice.dx), to_vector(once.dx));
  EXPECT_EQ(to_vector(twice.dprobs), to_vector(once.dprobs));
}

// Central differences (f32, step 1e-2) of L = sum(y * dy) against the analytic gradients: rtol 1e-2, atol
// 2e-3.
TEST(Experts, FiniteDifferences) {
  for (bool swiglu : {true, false})
    for (bool bias : {false, true}) {
      SCOPED_TRACE(std::string(swiglu ? "swiglu" : "gelu") + (bias ? " biased" : ""));
      ExpertCase c = make_case(swiglu, DType::f32, {3, 0, 2}, 6, 4, bias);
      const ExpertResult r = run_experts(c, true);
      moe::ExpertCache cache = moe::expert_cache_alloc(c.d);
      moe::ExpertWorkspace ws = moe::expert_workspace_alloc(c.d);
      Tensor y = Tensor::empty(c.x.shape(), DType::f32);
      auto loss = [&] {
        moe::experts_forward(y, c.x, c.probs, c.tpe, c.w, cache, ws, c.d, kCpu);
        return testing::weighted_sum(y, c.dy);
      };
      EXPECT_TENSOR_NEAR(r.dx, testing::numerical_gradient(loss, c.x), 1e-2, 2e-3);
      EXPECT_TENSOR_NEAR(r.dprobs, testing::numerical_gradient(loss, c.probs), 1e-2, 2e-3);
      EXPECT_TENSOR_NEAR(r.g.fc1, testing::numerical_gradient(loss, c.w.fc1), 1e-2, 2e-3);
      EXPECT_TENSOR_NEAR(r.g.fc2, testing::numerical_gradient(loss, c.w.fc2), 1e-2, 2e-3);
      if (bias) {
        EXPECT_TENSOR_NEAR(r.g.fc1_bias, testing::numerical_gradient(loss, c.w.fc1_bias), 1e-2, 2e-3);
        EXPECT_TENSOR_NEAR(r.g.fc2_bias, testing::numerical_gradient(loss, c.w.fc2_bias), 1e-2, 2e-3);
      }
    }
}

// ---- Shared expert -----------------------------------------------------------------------------

struct SharedCase {
  moe::SharedExpertWeights w;
  Tensor x, y0, dy;
};

SharedCase make_shared(int64_t T, int64_t H, int64_t Fs, bool swiglu, bool gate) {
  SharedCase c;
  c.w.fc1 = randn({swiglu ? 2 * Fs : Fs, H}, "s.fc1", 1.0f / std::sqrt(float(H)));
  c.w.fc2 = randn({H, Fs}, "s.fc2", 1.0f / std::sqrt(float(Fs)));
  if (gate) c.w.gate = randn({1, H}, "s.gate", 0.5f);
  c.x = randn({T, H}, "s.x");
  c.y0 = randn({T, H}, "s.y0");
  c.dy = randn({T, H}, "s.dy");
  return c;
}

struct SharedResult {
  Tensor y, dx;
  moe::SharedExpertGrads g;
};

// y = y0 + shared(x); dx starts at ones (it accumulates).
SharedResult run_shared(const SharedCase& c, bool swiglu, DType dt) {
  const int64_t T = c.x.size(0), H = c.x.size(1), Fs = c.w.fc2.size(1);
  const bool gate = c.w.gate.defined();
  moe::SharedExpertWeights w{c.w.fc1.to(dt), c.w.fc2.to(dt), c.w.gate};
  moe::SharedExpertCache cache = moe::shared_expert_cache_alloc(T, H, Fs, swiglu, gate, dt);
  SharedResult r{c.y0.clone(),
                 Tensor::empty({T, H}, DType::f32),
                 {Tensor::zeros(c.w.fc1.shape(), DType::f32), Tensor::zeros(c.w.fc2.shape(), DType::f32),
                  gate ? Tensor::zeros({1, H}, DType::f32) : Tensor()}};
  r.dx.fill_(1.0f);
  const Tensor x = c.x.to(dt);
  moe::shared_expert_forward(r.y, x, w, cache, swiglu, kCpu);
  moe::shared_expert_backward(r.dx, r.g, c.dy, x, w, cache, swiglu, kCpu);
  return r;
}

// Central differences (f32, step 1e-2) of L = sum(y * dy): rtol 1e-2, atol 2e-3. dx is checked as dx - 1.
TEST(SharedExpert, FiniteDifferencesWithAndWithoutGate) {
  for (bool swiglu : {true, false})
    for (bool gate : {false, true}) {
      SCOPED_TRACE(std::string(swiglu ? "swiglu" : "gelu") + (gate ? " gated" : ""));
      SharedCase c = make_shared(4, 5, 3, swiglu, gate);
      const SharedResult r = run_shared(c, swiglu, DType::f32);
      moe::SharedExpertCache cache = moe::shared_expert_cache_alloc(4, 5, 3, swiglu, gate, DType::f32);
      Tensor y = Tensor::empty({4, 5}, DType::f32);
      auto loss = [&] {
        y.copy_from(c.y0);
        moe::shared_expert_forward(y, c.x, c.w, cache, swiglu, kCpu);
        return testing::weighted_sum(y, c.dy);
      };
      EXPECT_NEAR(loss(), testing::weighted_sum(r.y, c.dy), 1e-5);
      Tensor dx = r.dx.clone();
      for (int64_t i = 0; i < dx.numel(); ++i) dx.data<float>()[i] -= 1.0f;
      EXPECT_TENSOR_NEAR(dx, testing::numerical_gradient(loss, c.x), 1e-2, 2e-3);
      EXPECT_TENSOR_NEAR(r.g.fc1, testing::numerical_gradient(loss, c.w.fc1), 1e-2, 2e-3);
      EXPECT_TENSOR_NEAR(r.g.fc2, testing::numerical_gradient(loss, c.w.fc2), 1e-2, 2e-3);
      if (gate) EXPECT_TENSOR_NEAR(r.g.gate, testing::numerical_gradient(loss, c.w.gate), 1e-2, 2e-3);
    }
}

// The bf16 path (bf16 GEMM operands and activations, f32 gate math) tracks f32 within bf16 tolerance.
TEST(SharedExpert, Bf16TracksF32) {
  SharedCase c = make_shared(9, 16, 8, true, true);
  const SharedResult a = run_shared(c, true, DType::f32), b = run_shared(c, true, DType::bf16);
  EXPECT_TENSOR_NEAR(b.y, a.y, 3e-2, 3e-2);
  EXPECT_TENSOR_NEAR(b.dx, a.dx, 3e-2, 3e-2);
  EXPECT_TENSOR_NEAR(b.g.fc1, a.g.fc1, 3e-2, 1e-1);
  EXPECT_TENSOR_NEAR(b.g.fc2, a.g.fc2, 3e-2, 1e-1);
  EXPECT_TENSOR_NEAR(b.g.gate, a.g.gate, 3e-2, 1e-1);
}

}  // namespace
}  // namespace moecore
