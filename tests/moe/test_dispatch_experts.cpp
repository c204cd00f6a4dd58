// Dispatch and experts: permutation layout against a naive reference, the MoE permutation ops (plan, permute,
// unpermute, chunk sort, chunk counts) against naive loops, round trips with identity experts, fused equals
// unfused, adjoint checks of the dispatch backward, grouped GEMM against per-group GEMMs, grouped experts against
// the sequential reference (with and without linear biases), counts covering fewer rows than the buffers, finite
// differences of the experts and the shared expert, and the device seam's errors.
// Every tensor the code under test sees is on testing::test_device() (MOECORE_TEST_DEVICE); inputs are built on
// the host and results read through host copies. References run on the host (kCpu).
// Tolerances are stated per test; f32 GEMM results are compared with rtol/atol ~1e-5, bf16 with ~2e-2 (f16
// passes the same bounds: its rounding is 8x finer).
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>

#include "moecore/core/rng.h"
#include "moecore/moe/dispatcher.h"
#include "moecore/moe/experts.h"
#include "moecore/nn/fp8_delayed.h"
#include "test_util.h"

namespace moecore {
namespace {

using moe::DispatchPlan;
using testing::host;
using testing::on_test_device;
using testing::randn;
using testing::to_vector;
using testing::to_vector_i64;

const ops::Context kCpu{};  // the host references
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

ops::Context test_ctx() {
  return ops::Context{testing::test_device()};
}
Tensor dev_empty(const Shape& shape, DType dt) {
  return Tensor::empty(shape, dt, MemCategory::other, testing::test_device());
}
Tensor dev_zeros(const Shape& shape, DType dt) {
  return Tensor::zeros(shape, dt, MemCategory::other, testing::test_device());
}
// A copy on the test device that never aliases t (on the CPU on_test_device returns t itself): for outputs.
Tensor fresh(const Tensor& t) {
  return on_test_device(t.clone());
}
// A float tensor (any device) overwritten with NaN through a host copy: what is read before written shows up.
void fill_nan(Tensor& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype(), MemCategory::other);
  h.fill_(kNaN);
  t.copy_from(h);
}
Tensor dev_nans(const Shape& shape, DType dt) {
  Tensor t = dev_empty(shape, dt);
  fill_nan(t);
  return t;
}
// Host t [n, ...] with `extra` NaN rows appended: a buffer longer than the rows the counts cover.
Tensor with_nan_rows(const Tensor& t, int64_t extra) {
  Shape s = t.shape();
  s[0] += extra;
  Tensor p = Tensor::empty(s, t.dtype(), MemCategory::other);
  p.fill_(kNaN);
  p.slice(0, 0, t.size(0)).copy_from(t);
  return p;
}
std::vector<int32_t> to_vector_i32(const Tensor& t) {
  std::vector<int32_t> v(static_cast<size_t>(t.numel()));
  t.copy_to_host(v.data(), t.numel());
  return v;
}
using testing::sum_squares;
// t's leading elements equal `prefix` bit for bit (finite values) and every later one is NaN.
void expect_prefix_then_nan(const Tensor& t, const std::vector<float>& prefix, const std::string& what) {
  const auto v = to_vector(t);
  ASSERT_GE(v.size(), prefix.size()) << what;
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + int64_t(prefix.size())), prefix) << what;
  const auto nans = std::count_if(v.begin() + int64_t(prefix.size()), v.end(), [](float f) { return std::isnan(f); });
  EXPECT_EQ(size_t(nans), v.size() - prefix.size()) << what << ": elements past the covered rows were written";
}
using testing::expect_error;

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

// The plan of a host map, built on the test device with room for max_rows rows.
DispatchPlan plan_for(const Tensor& map, int64_t max_rows) {
  DispatchPlan plan = moe::dispatch_plan_alloc(map.size(0), map.size(1), max_rows, testing::test_device());
  moe::dispatch_plan_build(plan, on_test_device(map), test_ctx());
  return plan;
}
// The routed rows, read from the plan's offsets on the host.
int64_t routed_rows(const DispatchPlan& plan) {
  return to_vector_i64(plan.expert_offset).back();
}

// ---- Dispatch ----------------------------------------------------------------------------------

TEST(Dispatch, PlanAndPermuteMatchNaiveExpertMajorLayout) {
  const ops::Context ctx = test_ctx();
  const int64_t T = 37, E = 6, K = 3, H = 5;
  const Tensor map = random_map(T, E, K, 1), probs = probs_for(map, -1);
  const DispatchPlan plan = plan_for(map, T * K + 4);
  std::vector<std::pair<int64_t, int64_t>> order;  // (t, e) expert-major, ascending token
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < T; ++t)
      if (map.data<bool>()[t * E + e]) order.push_back({t, e});
  ASSERT_EQ(routed_rows(plan), int64_t(order.size()));
  const auto tpe = to_vector_i64(plan.tokens_per_expert), offset = to_vector_i64(plan.expert_offset);
  for (int64_t e = 0, off = 0; e < E; ++e) {
    EXPECT_EQ(offset[e], off);
    off += tpe[e];
  }
  const auto row_token = to_vector_i32(plan.row_token), token_rows = to_vector_i32(plan.token_rows);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = randn({T, H}, "x").to(dt);
    Tensor px = dev_empty({T * K + 4, H}, dt), pp = dev_empty({T * K + 4}, DType::f32);
    moe::permute_tokens(px, pp, on_test_device(x), on_test_device(probs), plan, ctx);
    const auto vx = to_vector(x), vpx = to_vector(px), vpp = to_vector(pp);
    for (size_t i = 0; i < order.size(); ++i) {
      const auto [t, e] = order[i];
      EXPECT_EQ(row_token[i], t);
      EXPECT_EQ(token_rows[t * E + e], int32_t(i));
      EXPECT_EQ(vpp[i], probs.data<float>()[t * E + e]);
      for (int64_t j = 0; j < H; ++j) ASSERT_EQ(vpx[i * H + j], vx[t * H + j]);
    }
  }
  for (int64_t i = 0; i < T * E; ++i) {
    if (!map.data<bool>()[i]) {
      EXPECT_EQ(token_rows[i], -1);
    }
  }
}

TEST(Dispatch, DroplessTokensPerExpertSumToTK) {
  for (int64_t K : {1, 2, 4}) {
    const auto tpe = to_vector_i64(plan_for(random_map(50, 8, K, 2), 50 * K).tokens_per_expert);
    EXPECT_EQ(std::accumulate(tpe.begin(), tpe.end(), int64_t{0}), 50 * K);
    EXPECT_EQ(moe::dispatch_max_rows(50, 8, K, 0, false, 0), 50 * K);
  }
  EXPECT_EQ(moe::dispatch_max_rows(50, 8, 2, 10, true, 0), 80);    // E * capacity
  EXPECT_EQ(moe::dispatch_max_rows(50, 8, 2, 20, false, 0), 100);  // min(T*K, E*capacity)
  EXPECT_EQ(moe::dispatch_max_rows(50, 8, 2, 0, false, 16), 100 + 8 * 15);
}

TEST(Dispatch, PlanRejectsMoreRowsThanTheBuffers) {
  moe::DispatchBuffers buf = moe::dispatch_buffers_alloc(10, 4, 4, 15, DType::f32, testing::test_device());
  EXPECT_THROW(moe::dispatch_plan_build(buf.plan, on_test_device(random_map(10, 4, 2, 3)), test_ctx()), Error);
}

// Megatron's dropless round trip: experts = identity times the probability 1/K, combine = x.
// Backward with dy = x returns x. f32 sums of K terms of x/K: rtol 1e-6.
TEST(Dispatch, LocalRoundTripWithIdentityExpertsReturnsInput) {
  const ops::Context ctx = test_ctx();
  const int64_t T = 33, E = 8, K = 2, H = 16, M = moe::dispatch_max_rows(T, E, K, 0, false, 0);
  const Tensor map = random_map(T, E, K, 4), probs = probs_for(map, 1.0f / K);
  const Tensor x = randn({T, H}, "x");
  const Tensor xd = on_test_device(x), probs_d = on_test_device(probs), map_d = on_test_device(map);
  moe::DispatchBuffers buf = moe::dispatch_buffers_alloc(T, H, E, M, DType::f32, ctx.device);
  moe::LocalDispatcher disp;
  disp.dispatch_prepare(buf, xd, probs_d, map_d, ctx);
  disp.exchange_counts(buf, ctx);
  disp.dispatch(buf, ctx);
  const int64_t R = routed_rows(buf.plan);
  const auto px = to_vector(buf.permuted_x), pp = to_vector(buf.permuted_probs);
  Tensor eo = Tensor::zeros({M, H}, DType::f32);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < H; ++j) eo.data<float>()[r * H + j] = px[r * H + j] * pp[r];
  buf.expert_out.copy_from(eo);
  Tensor y = dev_empty({T, H}, DType::f32);
  disp.combine_prepare(buf, ctx);
  disp.combine(buf, y, ctx);
  disp.combine_finish(buf, y, ctx);
  EXPECT_TENSOR_NEAR(y, x, 1e-6, 1e-7);

  disp.combine_backward(buf, xd, ctx);  // dy = x
  const auto dpermuted = to_vector(buf.dpermuted);
  Tensor dpp = Tensor::zeros({M}, DType::f32), dei = Tensor::zeros({M, H}, DType::f32);
  for (int64_t r = 0; r < R; ++r) {
    dpp.data<float>()[r] = float(r);
    for (int64_t j = 0; j < H; ++j) dei.data<float>()[r * H + j] = dpermuted[r * H + j] / K;
  }
  buf.dpermuted_probs.copy_from(dpp);
  buf.dexpert_in.copy_from(dei);
  Tensor dx = dev_zeros({T, H}, DType::f32), dprobs = dev_nans({T, E}, DType::f32);
  disp.dispatch_backward(buf, dx, dprobs, ctx);
  EXPECT_TENSOR_NEAR(dx, x, 1e-6, 1e-7);
  const auto token_rows = to_vector_i32(buf.plan.token_rows);
  const auto vdp = to_vector(dprobs);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = token_rows[t * E + e];
      EXPECT_EQ(vdp[t * E + e], r >= 0 ? float(r) : 0.0f);
    }
}

// The fused single-pass kernels equal a naive unfused loop (scatter-add in ascending row order), bit for bit:
// ascending rows within a token are ascending experts, the order unpermute promises.
TEST(Dispatch, FusedUnpermuteEqualsNaiveLoop) {
  const ops::Context ctx = test_ctx();
  const int64_t T = 41, E = 7, K = 3, H = 19;
  const Tensor map = random_map(T, E, K, 5);
  const DispatchPlan plan = plan_for(map, T * K);
  const int64_t R = routed_rows(plan);
  const auto row_token = to_vector_i32(plan.row_token);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor rows = randn({R, H}, "rows").to(dt), rows_d = on_test_device(rows);
    const auto vr = to_vector(rows);
    for (bool accumulate : {false, true}) {
      const Tensor y0 = randn({T, H}, "y0");
      Tensor y = fresh(y0);
      moe::unpermute_tokens(y, rows_d, plan, accumulate, ctx);
      std::vector<float> ref = accumulate ? to_vector(y0) : std::vector<float>(T * H, 0.0f);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < H; ++j) ref[row_token[r] * H + j] += vr[r * H + j];
      EXPECT_EQ(to_vector(y), ref) << dtype_name(dt) << " accumulate " << accumulate;
    }
  }
}

// Adjoint identities of the backward stages: <permute(x), r> == <x, unpermute(r)> and
// <permuted_probs(p), q> == <p, scatter(q)>. Double sums of f32 values: rtol 1e-5.
TEST(Dispatch, BackwardStagesAreAdjointsOfTheForward) {
  const ops::Context ctx = test_ctx();
  const int64_t T = 29, E = 5, K = 2, H = 12;
  const Tensor map = random_map(T, E, K, 6), probs = probs_for(map, -1);
  const Tensor x = randn({T, H}, "x");
  const Tensor xd = on_test_device(x), probs_d = on_test_device(probs), map_d = on_test_device(map);
  moe::DispatchBuffers buf = moe::dispatch_buffers_alloc(T, H, E, T * K, DType::f32, ctx.device);
  moe::LocalDispatcher disp;
  disp.dispatch_prepare(buf, xd, probs_d, map_d, ctx);
  const int64_t R = routed_rows(buf.plan);
  const Tensor r = randn({R, H}, "r"), q = randn({R}, "q");
  buf.dexpert_in.slice(0, 0, R).copy_from(r);
  buf.dpermuted_probs.slice(0, 0, R).copy_from(q);
  Tensor dx = dev_zeros({T, H}, DType::f32), dprobs = dev_empty({T, E}, DType::f32);
  disp.dispatch_backward(buf, dx, dprobs, ctx);
  const double lhs_x = testing::weighted_sum(buf.permuted_x.slice(0, 0, R), r), rhs_x = testing::weighted_sum(x, dx);
  const double lhs_p = testing::weighted_sum(buf.permuted_probs.slice(0, 0, R), q);
  const double rhs_p = testing::weighted_sum(probs, dprobs);
  EXPECT_NEAR(lhs_x, rhs_x, 1e-5 * (1 + std::fabs(lhs_x)));
  EXPECT_NEAR(lhs_p, rhs_p, 1e-5 * (1 + std::fabs(lhs_p)));
  // combine is unpermute; its backward (gather of dy) is permute: <unpermute(e), dy> == <e, gather(dy)>.
  const Tensor eo = randn({R, H}, "eo"), dy = randn({T, H}, "dy");
  buf.expert_out.slice(0, 0, R).copy_from(eo);
  Tensor y = dev_empty({T, H}, DType::f32);
  disp.combine_prepare(buf, ctx);
  disp.combine_finish(buf, y, ctx);
  disp.combine_backward(buf, on_test_device(dy), ctx);
  const double lhs_c = testing::weighted_sum(y, dy), rhs_c = testing::weighted_sum(eo, buf.dpermuted.slice(0, 0, R));
  EXPECT_NEAR(lhs_c, rhs_c, 1e-5 * (1 + std::fabs(lhs_c)));
}

// ---- MoE permutation ops -----------------------------------------------------------------------

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

// moe_plan writes every count, offset and token row, and -1 into row_token past the routed rows (garbage before);
// a map routing nothing leaves every row -1.
TEST(DispatchOps, PlanSetsRowTokenToMinusOnePastTheRoutedRows) {
  const ops::Context ctx = test_ctx();
  const int64_t T = 9, E = 4, K = 2, M = T * K + 7;
  for (bool empty : {false, true}) {
    const Tensor map = empty ? Tensor::zeros({T, E}, DType::boolean) : random_map(T, E, K, 8);
    Tensor garbage = Tensor::empty({M}, DType::i32);
    std::fill(garbage.data<int32_t>(), garbage.data<int32_t>() + M, 12345);
    Tensor row_token = on_test_device(garbage), token_rows = dev_empty({T, E}, DType::i32);
    Tensor counts = testing::counts_tensor(std::vector<int64_t>(E, 99));
    Tensor offsets = testing::counts_tensor(std::vector<int64_t>(E + 1, 99));
    ops::moe_plan(counts, offsets, token_rows, row_token, on_test_device(map), ctx);
    std::vector<int64_t> want_counts(E, 0), want_offsets(E + 1, 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) want_counts[e] += map.data<bool>()[t * E + e];
    std::partial_sum(want_counts.begin(), want_counts.end(), want_offsets.begin() + 1);
    EXPECT_EQ(to_vector_i64(counts), want_counts);
    EXPECT_EQ(to_vector_i64(offsets), want_offsets);
    const int64_t R = want_offsets[E];
    EXPECT_EQ(R, empty ? 0 : T * K);
    const auto rt = to_vector_i32(row_token), tr = to_vector_i32(token_rows);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        if (tr[t * E + e] >= 0) {
          EXPECT_EQ(rt[tr[t * E + e]], t);
        }
    for (int64_t r = 0; r < M; ++r) {
      if (r < R) {
        EXPECT_TRUE(rt[r] >= 0 && rt[r] < T) << r;
      } else {
        EXPECT_EQ(rt[r], -1) << r;
      }
    }
  }
}

// moe_permute writes rows [0, offsets[E]) only (NaN rows past them stay NaN), with and without probabilities;
// moe_unpermute and moe_unpermute_probs never read those rows, so their NaN does not reach the outputs.
TEST(DispatchOps, PermuteAndUnpermuteLeaveRowsPastTheOffsetsAlone) {
  const ops::Context ctx = test_ctx();
  const int64_t T = 13, E = 5, K = 2, H = 6, M = T * K + 7;
  const Tensor map = random_map(T, E, K, 9), probs = probs_for(map, -1);
  const DispatchPlan plan = plan_for(map, M);
  const int64_t R = routed_rows(plan);
  const auto rt = to_vector_i32(plan.row_token), tr = to_vector_i32(plan.token_rows);
  const Tensor probs_d = on_test_device(probs);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = randn({T, H}, "x").to(dt), xd = on_test_device(x);
    const auto vx = to_vector(x);
    std::vector<float> want_rows, want_probs;
    for (int64_t r = 0; r < R; ++r) {
      want_rows.insert(want_rows.end(), vx.begin() + rt[r] * H, vx.begin() + (rt[r] + 1) * H);
      const int64_t e = std::find(tr.begin() + rt[r] * E, tr.begin() + (rt[r] + 1) * E, r) - tr.begin() - rt[r] * E;
      want_probs.push_back(probs.data<float>()[rt[r] * E + e]);
    }
    Tensor rows = dev_nans({M, H}, dt), row_probs = dev_nans({M}, DType::f32), none;
    ops::moe_permute(rows, row_probs, xd, probs_d, plan.row_token, plan.expert_offset, ctx);
    expect_prefix_then_nan(rows, want_rows, "rows " + std::string(dtype_name(dt)));
    expect_prefix_then_nan(row_probs, want_probs, "row_probs");
    Tensor rows_only = dev_nans({M, H}, dt);
    ops::moe_permute(rows_only, none, xd, none, plan.row_token, plan.expert_offset, ctx);
    expect_prefix_then_nan(rows_only, want_rows, "rows without probs " + std::string(dtype_name(dt)));

    const auto vrows = to_vector(rows);
    std::vector<float> want_y(T * H, 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        if (tr[t * E + e] >= 0)
          for (int64_t j = 0; j < H; ++j) want_y[t * H + j] += vrows[tr[t * E + e] * H + j];
    Tensor y = dev_nans({T, H}, DType::f32), out = dev_nans({T, E}, DType::f32);
    ops::moe_unpermute(y, rows, plan.token_rows, false, ctx);
    EXPECT_EQ(to_vector(y), want_y) << dtype_name(dt);
    ops::moe_unpermute_probs(out, row_probs, plan.token_rows, ctx);
    EXPECT_EQ(to_vector(out), to_vector(probs));
    expect_prefix_then_nan(rows, want_rows, "rows after the unpermute");
  }
}

// The all-to-all chunk sort against a naive reference: forward takes chunks (s, le) from the [s][le] order to
// [le][s], inverse takes them back bit for bit; rows past the chunks stay NaN either way. Rows of H values and
// of one value (the probabilities), f32 and bf16, empty chunks included.
TEST(DispatchOps, SortChunksMatchesNaiveAndInverseRestores) {
  const ops::Context ctx = test_ctx();
  const int64_t P = 3, El = 2, H = 5, M = 26;
  const std::vector<int64_t> counts = {4, 0, 7, 3, 0, 5};  // chunk (s, le) at s * El + le
  const int64_t R = total(counts);
  const Tensor chunks = testing::counts_tensor(counts);
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t w : {H, int64_t{1}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " width " + std::to_string(w));
      const Shape shape = w == 1 ? Shape{M} : Shape{M, w};
      const Tensor in = hashed(shape, 11).to(dt);
      const auto vin = to_vector(in);
      std::vector<int64_t> recv_off(P * El + 1, 0);
      std::partial_sum(counts.begin(), counts.end(), recv_off.begin() + 1);
      std::vector<float> want;
      for (int64_t le = 0; le < El; ++le)
        for (int64_t s = 0; s < P; ++s)
          want.insert(want.end(), vin.begin() + recv_off[s * El + le] * w, vin.begin() + recv_off[s * El + le + 1] * w);
      Tensor out = dev_nans(shape, dt), back = dev_nans(shape, dt);
      ops::moe_sort_chunks(out, with_nan_rows(in.slice(0, 0, R), M - R).to_device(ctx.device), chunks, P, El, false,
                           ctx);
      expect_prefix_then_nan(out, want, "expert layout");
      ops::moe_sort_chunks(back, out, chunks, P, El, true, ctx);
      expect_prefix_then_nan(back, std::vector<float>(vin.begin(), vin.begin() + R * w), "receive layout");
    }
}

// Rows per local expert: the sum over source ranks of the chunk counts, and their prefix sums.
TEST(DispatchOps, ChunkCountsSumOverSourceRanks) {
  const ops::Context ctx = test_ctx();
  struct Case {
    int64_t P;
    std::vector<int64_t> chunks, counts, offsets;
  };
  for (const Case& c : {Case{3, {4, 0, 7, 3, 0, 5}, {11, 8}, {0, 11, 19}}, Case{1, {2, 0, 6}, {2, 0, 6}, {0, 2, 2, 8}},
                        Case{2, {0, 0}, {0}, {0, 0}}}) {
    const int64_t El = int64_t(c.counts.size());
    Tensor counts = testing::counts_tensor(std::vector<int64_t>(El, -7));
    Tensor offsets = testing::counts_tensor(std::vector<int64_t>(El + 1, -7));
    ops::moe_chunk_counts(counts, offsets, testing::counts_tensor(c.chunks), c.P, ctx);
    EXPECT_EQ(to_vector_i64(counts), c.counts) << "P " << c.P;
    EXPECT_EQ(to_vector_i64(offsets), c.offsets) << "P " << c.P;
  }
}

// ---- Grouped GEMM ------------------------------------------------------------------------------

const std::vector<int64_t> kGroups = {0, 5, 0, 17, 1, 0, 64, 3};  // zero-row groups included
// Balanced enough that, with several threads, whole groups are handed to threads.
const std::vector<int64_t> kBalanced = {9, 11, 10, 12, 0, 10, 9, 11, 10, 12};

// c per group through ops::gemm on row slices (the host reference).
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
// of either side (rtol 8e-3), an f16 output one f16 rounding (2^-11: rtol 1e-3). With beta = 0 c starts as NaN: it must
// not be read.
void check_grouped(const std::vector<int64_t>& groups, int64_t N, int64_t K, DType in, DType out) {
  const ops::Context ctx = test_ctx();
  const int64_t R = total(groups), G = int64_t(groups.size());
  const Tensor a = hashed({R, K}, 1).to(in), a_d = on_test_device(a), counts = testing::counts_tensor(groups);
  for (bool tb : {true, false})
    for (float beta : {0.0f, 1.0f}) {
      const Tensor b = hashed(tb ? Shape{G, N, K} : Shape{G, K, N}, 2).to(in);
      Tensor c0 = hashed({R, N}, 3).to(out);
      if (beta == 0.0f) c0.fill_(kNaN);
      Tensor c = fresh(c0), ref = c0.clone();
      ops::gemm_grouped(c, a_d, on_test_device(b), tb, counts, beta, ctx);
      gemm_per_group(ref, a, b, tb, groups, beta);
      const double rtol = out == DType::bf16 ? 8e-3 : out == DType::f16 ? 1e-3 : 1e-5;
      EXPECT_LE(testing::tolerance_ratio(c, ref, rtol, 1e-5 * std::sqrt(double(K))), 1.0)
          << dtype_name(in) << "->" << dtype_name(out) << " trans_b " << tb << " beta " << beta << " N " << N << " K "
          << K;
    }
}

TEST(GroupedGemm, MatchesPerGroupGemm) {
  for (const auto* groups : {&kGroups, &kBalanced})
    for (DType in : {DType::f32, DType::bf16, DType::f16})
      for (DType out : {DType::f32, DType::bf16, DType::f16}) check_grouped(*groups, 29, 45, in, out);
}

// Large enough that bf16 / f16 widening is tiled along N, rows and (for the f32 accumulator) both.
TEST(GroupedGemm, TiledBf16Widening) {
  check_grouped({0, 700}, 600, 8192, DType::bf16, DType::bf16);
  check_grouped({0, 700}, 600, 8192, DType::f16, DType::f16);
}

// c[g] = a_g^T b_g + beta c[g]; zero-row groups get beta * c[g]. M = 128 exercises the padded-copy path.
TEST(GroupedGemm, WgradMatchesPerGroupGemm) {
  const ops::Context ctx = test_ctx();
  for (const auto* groups : {&kGroups, &kBalanced})
    for (DType in : {DType::f32, DType::bf16, DType::f16})
      for (int64_t M : {int64_t{37}, int64_t{128}})
        for (float beta : {0.0f, 1.0f, 0.5f}) {
          const std::vector<int64_t>& kg = *groups;
          const int64_t R = total(kg), G = int64_t(kg.size()), N = 23;
          const Tensor a = randn({R, M}, "a").to(in), b = randn({R, N}, "b").to(in);
          Tensor c0 = randn({G, M, N}, "c");
          Tensor c = fresh(c0), ref = c0.clone();
          ops::gemm_grouped_wgrad(c, on_test_device(a), on_test_device(b), testing::counts_tensor(kg), beta, ctx);
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
  const ops::Context ctx = test_ctx();
  const Tensor counts = testing::counts_tensor({700, 0});
  for (DType t : {DType::bf16, DType::f16}) {
    const Tensor a = hashed({700, 8192}, 4).to(t), b = hashed({700, 64}, 5).to(t);
    const Tensor a_d = on_test_device(a), b_d = on_test_device(b);
    for (float beta : {0.0f, 0.5f, 1.0f}) {
      Tensor ref = hashed({2, 8192, 64}, 6), c = fresh(ref);
      ops::gemm_grouped_wgrad(c, a_d, b_d, counts, beta, ctx);
      Tensor r0 = ref.select(0, 0), r1 = ref.select(0, 1);
      ops::gemm(r0, a, true, b, false, 1.0f, beta, kCpu);
      ops::scale(r1, beta, kCpu);
      EXPECT_TENSOR_NEAR(c, ref, 1e-5, 1e-3);
    }
  }
}

// Counts may now sum to fewer rows than the buffers ({4, 5} over 10 rows is valid): a sum above the rows, a
// count per weight group that does not match, and a negative count raise.
TEST(GroupedGemm, BadGroupsThrow) {
  const ops::Context ctx = test_ctx();
  Tensor c = dev_empty({10, 4}, DType::f32);
  const Tensor a = dev_empty({10, 3}, DType::f32), b = dev_empty({2, 4, 3}, DType::f32);
  EXPECT_THROW(ops::gemm_grouped(c, a, b, true, testing::counts_tensor({5, 6}), 0.0f, ctx), Error);
  EXPECT_THROW(ops::gemm_grouped(c, a, b, true, testing::counts_tensor({4, 5, 1}), 0.0f, ctx), Error);
  EXPECT_THROW(ops::gemm_grouped(c, a, b, true, testing::counts_tensor({11, -1}), 0.0f, ctx), Error);
}

// Counts covering R of R + 6 rows: the rows past R of a and b hold NaN (never read) and those of c stay NaN
// (never written); the covered rows, and every wgrad entry, equal the exact-size run bit for bit.
TEST(GroupedGemm, CountsBelowTheBufferRowsTouchOnlyTheCoveredRows) {
  const ops::Context ctx = test_ctx();
  const int64_t R = total(kGroups), G = int64_t(kGroups.size()), P = 6, N = 29, K = 45;
  const Tensor counts = testing::counts_tensor(kGroups);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor a = hashed({R, K}, 1).to(dt), a_pad = on_test_device(with_nan_rows(a, P)), a_d = on_test_device(a);
    for (bool tb : {true, false})
      for (float beta : {0.0f, 1.0f}) {
        const Tensor b = on_test_device(hashed(tb ? Shape{G, N, K} : Shape{G, K, N}, 2).to(dt));
        const Tensor c0 = hashed({R, N}, 3).to(dt);
        Tensor c = fresh(c0), c_pad = fresh(with_nan_rows(c0, P));
        ops::gemm_grouped(c, a_d, b, tb, counts, beta, ctx);
        ops::gemm_grouped(c_pad, a_pad, b, tb, counts, beta, ctx);
        expect_prefix_then_nan(
            c_pad, to_vector(c),
            std::string(dtype_name(dt)) + " trans_b " + std::to_string(tb) + " beta " + std::to_string(beta));
      }
    for (int64_t M : {int64_t{37}, int64_t{128}}) {
      const Tensor wa = randn({R, M}, "a").to(dt), wb = randn({R, N}, "b").to(dt), c0 = randn({G, M, N}, "c");
      Tensor c = fresh(c0), c_pad = fresh(c0);
      ops::gemm_grouped_wgrad(c, on_test_device(wa), on_test_device(wb), counts, 1.0f, ctx);
      ops::gemm_grouped_wgrad(c_pad, on_test_device(with_nan_rows(wa, P)), on_test_device(with_nan_rows(wb, P)), counts,
                              1.0f, ctx);
      EXPECT_EQ(to_vector(c_pad), to_vector(c)) << "wgrad " << dtype_name(dt) << " M " << M;
    }
  }
}

// ---- Routed experts ----------------------------------------------------------------------------

// Host inputs; run_experts copies them to the test device.
struct ExpertCase {
  moe::ExpertDims d;
  std::vector<int64_t> tpe;
  moe::ExpertWeights w;
  Tensor x, probs, dy;  // x, dy [R, H] compute; probs [R] f32
};

moe::ExpertWeights device_weights(const moe::ExpertWeights& w) {
  auto up = [](const Tensor& t) { return t.defined() ? on_test_device(t) : Tensor(); };
  return {up(w.fc1), up(w.fc2), up(w.fc1_bias), up(w.fc2_bias)};
}

ExpertCase make_case(bool swiglu, DType dt, std::vector<int64_t> tpe, int64_t H, int64_t F, bool bias = false) {
  ExpertCase c;
  const int64_t E = int64_t(tpe.size()), R = total(tpe);
  c.d.E = E;
  c.d.H = H;
  c.d.F = F;
  c.d.act.glu = swiglu;
  c.d.max_rows = R + 3;  // larger than R: the experts must use only the first R rows
  c.d.compute = dt;
  c.d.device = testing::test_device();
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
  Tensor y, dx, dprobs;  // on the test device
  moe::ExpertGrads g;
};

// Caches, workspace and written outputs start as NaN: anything read before written shows up.
ExpertResult run_experts(const ExpertCase& c, bool grouped, int backward_calls = 1) {
  const ops::Context ctx = test_ctx();
  const int64_t R = c.x.size(0), H = c.d.H, E = c.d.E;
  moe::ExpertCache cache = moe::expert_cache_alloc(c.d);
  moe::ExpertWorkspace ws = moe::expert_workspace_alloc(c.d);
  for (Tensor* t : {&cache.h, &cache.act, &ws.a, &ws.da, &ws.dh}) fill_nan(*t);
  const moe::ExpertWeights w = device_weights(c.w);
  const Tensor x = on_test_device(c.x), probs = on_test_device(c.probs), dy = on_test_device(c.dy);
  const Tensor tpe = testing::counts_tensor(c.tpe);
  ExpertResult r{dev_nans({R, H}, c.d.compute),
                 dev_nans({R, H}, DType::f32),
                 dev_nans({R}, DType::f32),
                 {dev_zeros({E, c.d.fc1_rows(), H}, DType::f32), dev_zeros({E, H, c.d.F}, DType::f32)}};
  if (c.w.fc1_bias.defined()) {
    r.g.fc1_bias = dev_zeros({E, c.d.fc1_rows()}, DType::f32);
    r.g.fc2_bias = dev_zeros({E, H}, DType::f32);
  }
  if (grouped)
    moe::experts_forward(r.y, x, probs, tpe, w, cache, ws, c.d, ctx);
  else
    moe::experts_forward_sequential(r.y, x, probs, tpe, w, cache, ws, c.d, ctx);
  for (int i = 0; i < backward_calls; ++i) {
    if (grouped)
      moe::experts_backward(r.dx, r.dprobs, r.g, dy, x, probs, tpe, w, cache, ws, c.d, ctx);
    else
      moe::experts_backward_sequential(r.dx, r.dprobs, r.g, dy, x, probs, tpe, w, cache, ws, c.d, ctx);
  }
  return r;
}

using testing::all_finite;

// Same math, GEMMs issued differently. f32: rtol/atol 1e-5. bf16: intermediate roundings may land on the
// other side of a tie, so rtol 2e-2 with atol 2e-2 (values are O(1)); weight grads sum over rows, atol 5e-2.
TEST(Experts, GroupedEqualsSequentialWithZeroTokenExperts) {
  for (bool swiglu : {true, false})
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
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
        EXPECT_EQ(sum_squares(r->g.fc1.select(0, 1)), 0.0);  // the expert with no tokens
        EXPECT_EQ(sum_squares(r->g.fc2.select(0, 1)), 0.0);
      }
    }
}

// FP8 delayed scaling (nn/fp8_delayed.h): sequential experts run an expert without tokens on zero rows, so its weights
// are quantised and their amaxes recorded as grouped GEMMs record them (Megatron's SequentialMLP calls every expert);
// every slot of both ends the same (the output gradients' amaxes to the GEMMs' rounding; with biases the empty expert's
// bias gradients stay zero), and the outputs agree as without FP8.
TEST(Experts, Fp8DelayedStateIsTheSameGroupedAndSequential) {
  nn::Fp8Config fc;
  fc.on = true;
  fc.recipe = nn::Fp8Recipe::delayed;
  fc.format = nn::Fp8Format::hybrid;
  for (bool bias : {false, true}) {
    SCOPED_TRACE(bias ? "biases" : "no biases");
    ExpertCase c = make_case(true, DType::f32, {7, 0, 13, 1, 9}, 32, 24, bias);
    c.d.layer = "decoder.layers.1.";
    ExpertResult r[2];
    std::map<std::string, nn::Fp8Delayed::Record> state[2];
    for (int grouped : {1, 0}) {
      nn::Fp8Training f(fc);
      c.d.fp8 = &f;
      f.delayed()->begin(nn::Fp8Delayed::Pass::forward, 0);  // (its gradients taken in the same pass, as MTP's)
      r[grouped] = run_experts(c, grouped);
      state[grouped] = f.delayed()->records();
    }
    for (const char* linear : {"decoder.layers.1.mlp.experts.linear_fc1", "decoder.layers.1.mlp.experts.linear_fc2"}) {
      const std::vector<float>&a = state[1].at(linear).slots, &b = state[0].at(linear).slots;  // [5, 3, 2]
      ASSERT_EQ(a.size(), 30u) << linear;
      ASSERT_EQ(b.size(), 30u) << linear;
      for (int64_t e = 0; e < 5; ++e) {  // per expert: (scale, amax) of the input, weight and output-gradient slots
        const float *pa = a.data() + e * 6, *pb = b.data() + e * 6;
        EXPECT_EQ(std::memcmp(pa, pb, 4 * sizeof(float)), 0) << linear << " expert " << e;  // the same x and W
        EXPECT_NEAR(pa[5], pb[5], 1e-5 * pa[5]) << linear << " expert " << e;               // (dh: the GEMMs' rounding)
        EXPECT_GT(pb[3], 0.0f) << linear << " expert " << e << ": its weight amax";
      }
      EXPECT_EQ(b[1 * 6 + 1], 0.0f) << linear << ": the empty expert's input amax";
    }
    EXPECT_TENSOR_NEAR(r[1].y, r[0].y, 1e-5, 1e-5);
    EXPECT_TENSOR_NEAR(r[1].g.fc1, r[0].g.fc1, 1e-5, 2.5e-5);
    if (bias) {
      EXPECT_EQ(sum_squares(r[0].g.fc1_bias.select(0, 1)), 0.0);
    }
  }
}

// With Megatron's add_bias_linear: h = x W1^T + b1, y = p (act(h) W2^T + b2). Grouped equals sequential (same
// tolerances as above), and against a naive per-row reference in f32 (rtol/atol 1e-5).
TEST(Experts, BiasesGroupedEqualsSequentialAndNaive) {
  for (bool swiglu : {true, false})
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
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
      EXPECT_EQ(sum_squares(a.g.fc1_bias.select(0, 1)), 0.0);  // the expert with no tokens
      EXPECT_EQ(sum_squares(a.g.fc2_bias.select(0, 1)), 0.0);
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
  const ops::Context ctx = test_ctx();
  const ExpertCase c = make_case(true, DType::f32, {2, 3}, 8, 4, true);
  ExpertCase half = c;
  half.w.fc2_bias = Tensor();
  EXPECT_THROW(run_experts(half, true), Error);  // fc1 bias without fc2 bias
  moe::ExpertCache cache = moe::expert_cache_alloc(c.d);
  moe::ExpertWorkspace ws = moe::expert_workspace_alloc(c.d);
  const moe::ExpertWeights w = device_weights(c.w);
  const Tensor x = on_test_device(c.x), probs = on_test_device(c.probs), dy = on_test_device(c.dy);
  const Tensor tpe = testing::counts_tensor(c.tpe);
  Tensor y = dev_empty({5, 8}, DType::f32), dx = dev_empty({5, 8}, DType::f32), dp = dev_empty({5}, DType::f32);
  moe::ExpertGrads g{dev_zeros({2, 8, 8}, DType::f32), dev_zeros({2, 8, 4}, DType::f32)};
  moe::experts_forward(y, x, probs, tpe, w, cache, ws, c.d, ctx);
  EXPECT_THROW(moe::experts_backward(dx, dp, g, dy, x, probs, tpe, w, cache, ws, c.d, ctx), Error);
}

TEST(Experts, NoRowsAtAll) {
  for (bool bias : {false, true}) {
    const ExpertCase c = make_case(true, DType::f32, {0, 0, 0}, 8, 4, bias);
    for (bool grouped : {true, false}) {
      const ExpertResult r = run_experts(c, grouped);
      EXPECT_EQ(sum_squares(r.g.fc1) + sum_squares(r.g.fc2), 0.0);
      if (bias) {
        EXPECT_EQ(sum_squares(r.g.fc1_bias) + sum_squares(r.g.fc2_bias), 0.0);
      }
    }
  }
}

// Counts covering R of R + 5 rows: x, dy and probs hold NaN past R (never read); y, dx and dprobs stay NaN there
// (never written); the covered rows and every weight gradient equal the exact-size run bit for bit.
TEST(Experts, CountsBelowTheBufferRowsTouchOnlyTheCoveredRows) {
  const int64_t P = 5;
  for (bool grouped : {true, false})
    for (bool bias : {false, true})
      for (bool swiglu : {true, false})
        for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
          SCOPED_TRACE(std::string(grouped ? "grouped " : "sequential ") + (bias ? "biased " : "") +
                       (swiglu ? "swiglu " : "gelu ") + std::string(dtype_name(dt)));
          const ExpertCase c = make_case(swiglu, dt, {7, 0, 13, 1, 9}, 16, 12, bias);
          ExpertCase padded = c;
          padded.d.max_rows = c.d.max_rows + P;
          padded.x = with_nan_rows(c.x, P);
          padded.dy = with_nan_rows(c.dy, P);
          padded.probs = with_nan_rows(c.probs, P);
          const ExpertResult a = run_experts(c, grouped), b = run_experts(padded, grouped);
          expect_prefix_then_nan(b.y, to_vector(a.y), "y");
          expect_prefix_then_nan(b.dx, to_vector(a.dx), "dx");
          expect_prefix_then_nan(b.dprobs, to_vector(a.dprobs), "dprobs");
          EXPECT_EQ(to_vector(b.g.fc1), to_vector(a.g.fc1));
          EXPECT_EQ(to_vector(b.g.fc2), to_vector(a.g.fc2));
          if (bias) {
            EXPECT_EQ(to_vector(b.g.fc1_bias), to_vector(a.g.fc1_bias));
            EXPECT_EQ(to_vector(b.g.fc2_bias), to_vector(a.g.fc2_bias));
          }
        }
}

// Calling backward twice doubles the weight gradients (+=) and rewrites dx and dprobs identically.
// The second call adds the same product to a nonzero C, which may round differently: rtol 1e-6.
TEST(Experts, BackwardTwiceDoublesWeightGrads) {
  const ExpertCase c = make_case(true, DType::f32, {4, 0, 6}, 16, 8);
  const ExpertResult once = run_experts(c, true, 1), twice = run_experts(c, true, 2);
  Tensor g1 = host(once.g.fc1).clone(), g2 = host(once.g.fc2).clone();
  ops::scale(g1, 2.0f, kCpu);
  ops::scale(g2, 2.0f, kCpu);
  EXPECT_TENSOR_NEAR(twice.g.fc1, g1, 1e-6, 1e-7);
  EXPECT_TENSOR_NEAR(twice.g.fc2, g2, 1e-6, 1e-7);
  EXPECT_EQ(to_vector(twice.dx), to_vector(once.dx));
  EXPECT_EQ(to_vector(twice.dprobs), to_vector(once.dprobs));
}

// Central differences (f32, step 1e-2) of L = sum(y * dy) against the analytic gradients: rtol 1e-2, atol
// 2e-3. The host inputs are perturbed and copied to the device for every evaluation.
TEST(Experts, FiniteDifferences) {
  const ops::Context ctx = test_ctx();
  for (bool swiglu : {true, false})
    for (bool bias : {false, true}) {
      SCOPED_TRACE(std::string(swiglu ? "swiglu" : "gelu") + (bias ? " biased" : ""));
      ExpertCase c = make_case(swiglu, DType::f32, {3, 0, 2}, 6, 4, bias);
      const ExpertResult r = run_experts(c, true);
      moe::ExpertCache cache = moe::expert_cache_alloc(c.d);
      moe::ExpertWorkspace ws = moe::expert_workspace_alloc(c.d);
      Tensor y = dev_empty(c.x.shape(), DType::f32);
      const Tensor tpe = testing::counts_tensor(c.tpe);
      auto loss = [&] {
        moe::experts_forward(y, on_test_device(c.x), on_test_device(c.probs), tpe, device_weights(c.w), cache, ws, c.d,
                             ctx);
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

struct SharedCase {  // host tensors
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

// The weights in the compute dtype on the test device (the gate stays f32).
moe::SharedExpertWeights shared_device_weights(const moe::SharedExpertWeights& w, DType dt) {
  return {on_test_device(w.fc1.to(dt)), on_test_device(w.fc2.to(dt)),
          w.gate.defined() ? on_test_device(w.gate) : Tensor()};
}

struct SharedResult {
  Tensor y, dx;  // on the test device
  moe::SharedExpertGrads g;
};

// y = y0 + shared(x); dx starts at ones (it accumulates).
SharedResult run_shared(const SharedCase& c, bool swiglu, DType dt) {
  const ops::Context ctx = test_ctx();
  const int64_t T = c.x.size(0), H = c.x.size(1), Fs = c.w.fc2.size(1);
  const bool gate = c.w.gate.defined();
  const moe::SharedExpertWeights w = shared_device_weights(c.w, dt);
  moe::SharedExpertCache cache = moe::shared_expert_cache_alloc(T, H, Fs, swiglu, gate, dt, ctx.device);
  Tensor ones = Tensor::empty({T, H}, DType::f32);
  ones.fill_(1.0f);
  SharedResult r{fresh(c.y0),
                 fresh(ones),
                 {dev_zeros(c.w.fc1.shape(), DType::f32), dev_zeros(c.w.fc2.shape(), DType::f32),
                  gate ? dev_zeros({1, H}, DType::f32) : Tensor()}};
  const Tensor x = on_test_device(c.x.to(dt)), dy = on_test_device(c.dy);
  moe::shared_expert_forward(r.y, x, w, cache, moe::SharedExpertDims{ops::MlpActivation{swiglu, {}}}, ctx);
  moe::shared_expert_backward(r.dx, r.g, dy, x, w, cache, moe::SharedExpertDims{ops::MlpActivation{swiglu, {}}}, ctx);
  return r;
}

// Central differences (f32, step 1e-2) of L = sum(y * dy): rtol 1e-2, atol 2e-3. dx is checked as dx - 1.
TEST(SharedExpert, FiniteDifferencesWithAndWithoutGate) {
  const ops::Context ctx = test_ctx();
  for (bool swiglu : {true, false})
    for (bool gate : {false, true}) {
      SCOPED_TRACE(std::string(swiglu ? "swiglu" : "gelu") + (gate ? " gated" : ""));
      SharedCase c = make_shared(4, 5, 3, swiglu, gate);
      const SharedResult r = run_shared(c, swiglu, DType::f32);
      moe::SharedExpertCache cache = moe::shared_expert_cache_alloc(4, 5, 3, swiglu, gate, DType::f32, ctx.device);
      Tensor y = dev_empty({4, 5}, DType::f32);
      auto loss = [&] {
        y.copy_from(c.y0);
        moe::shared_expert_forward(y, on_test_device(c.x), shared_device_weights(c.w, DType::f32), cache,
                                   moe::SharedExpertDims{ops::MlpActivation{swiglu, {}}}, ctx);
        return testing::weighted_sum(y, c.dy);
      };
      EXPECT_NEAR(loss(), testing::weighted_sum(r.y, c.dy), 1e-5);
      Tensor dx = host(r.dx).clone();
      for (int64_t i = 0; i < dx.numel(); ++i) dx.data<float>()[i] -= 1.0f;
      EXPECT_TENSOR_NEAR(dx, testing::numerical_gradient(loss, c.x), 1e-2, 2e-3);
      EXPECT_TENSOR_NEAR(r.g.fc1, testing::numerical_gradient(loss, c.w.fc1), 1e-2, 2e-3);
      EXPECT_TENSOR_NEAR(r.g.fc2, testing::numerical_gradient(loss, c.w.fc2), 1e-2, 2e-3);
      if (gate) EXPECT_TENSOR_NEAR(r.g.gate, testing::numerical_gradient(loss, c.w.gate), 1e-2, 2e-3);
    }
}

// The bf16 path (bf16 GEMM operands and activations, f32 gate math) tracks f32 within bf16 tolerance; the f16
// path within 8x less (2^-11 against 2^-8 per rounding).
TEST(SharedExpert, Bf16TracksF32) {
  SharedCase c = make_shared(9, 16, 8, true, true);
  const SharedResult a = run_shared(c, true, DType::f32);
  for (DType t : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    const SharedResult b = run_shared(c, true, t);
    const double k = t == DType::bf16 ? 1.0 : 0.125;
    EXPECT_TENSOR_NEAR(b.y, a.y, 3e-2 * k, 3e-2 * k);
    EXPECT_TENSOR_NEAR(b.dx, a.dx, 3e-2 * k, 3e-2 * k);
    EXPECT_TENSOR_NEAR(b.g.fc1, a.g.fc1, 3e-2 * k, 1e-1 * k);
    EXPECT_TENSOR_NEAR(b.g.fc2, a.g.fc2, 3e-2 * k, 1e-1 * k);
    EXPECT_TENSOR_NEAR(b.g.gate, a.g.gate, 3e-2 * k, 1e-1 * k);
  }
}

// ---- Device seam (explicit Device::sim and Device::cpu, whatever MOECORE_TEST_DEVICE says) -------------------

// An op given a tensor on another device than its context raises, naming the op, the tensor and both devices.
TEST(DeviceSeam, OpsNameTheTensorOnTheWrongDevice) {
  const ops::Context cpu{Device::cpu}, sim{Device::sim};
  const Tensor map = random_map(6, 3, 2, 10), map_sim = map.to_device(Device::sim);
  DispatchPlan on_cpu = moe::dispatch_plan_alloc(6, 3, 12, Device::cpu);
  DispatchPlan on_sim = moe::dispatch_plan_alloc(6, 3, 12, Device::sim);
  expect_error(
      [&] {
        ops::moe_plan(on_cpu.tokens_per_expert, on_cpu.expert_offset, on_cpu.token_rows, on_cpu.row_token, map_sim,
                      cpu);
      },
      {"moe_plan", "map is on sim", "runs on cpu"});
  expect_error(
      [&] {
        ops::moe_plan(on_sim.tokens_per_expert, on_sim.expert_offset, on_sim.token_rows, on_sim.row_token, map, sim);
      },
      {"moe_plan", "map is on cpu", "runs on sim"});
  moe::dispatch_plan_build(on_sim, map_sim, sim);
  const Tensor x = randn({6, 4}, "x"), probs = probs_for(map, -1);
  Tensor rows = Tensor::empty({12, 4}, DType::f32, MemCategory::other, Device::sim);
  Tensor row_probs = Tensor::empty({12}, DType::f32, MemCategory::other, Device::sim);
  expect_error([&] { moe::permute_tokens(rows, row_probs, x, probs.to_device(Device::sim), on_sim, sim); },
               {"moe_permute", "x is on cpu", "runs on sim"});
  Tensor c = Tensor::empty({12, 5}, DType::f32, MemCategory::other, Device::sim);
  const Tensor b = Tensor::zeros({3, 5, 4}, DType::f32, MemCategory::other, Device::sim);
  expect_error(
      [&] {
        ops::gemm_grouped(c, rows, b, true, testing::counts_tensor({2, 3, 4}, Device::cpu), 0, sim);
      },
      {"gemm_grouped", "group_rows is on cpu", "runs on sim"});
  Tensor c_cpu = Tensor::empty({12, 5}, DType::f32);
  expect_error(
      [&] {
        ops::gemm_grouped(c_cpu, Tensor::zeros({12, 4}, DType::f32), b.to_device(Device::cpu), true,
                          testing::counts_tensor({2, 3, 4}, Device::sim), 0, cpu);
      },
      {"gemm_grouped", "group_rows is on sim", "runs on cpu"});
  Tensor chunks_out = Tensor::empty({12, 4}, DType::f32);
  expect_error(
      [&] {
        ops::moe_sort_chunks(chunks_out, rows, testing::counts_tensor({1, 2}, Device::cpu), 2, 1, false, cpu);
      },
      {"moe_sort_chunks", "in is on sim", "runs on cpu"});
}

// Host code addressing a sim tensor's data raises (only ops, collectives and transfers may); the explicit
// transfers read it.
TEST(DeviceSeam, HostCodeCannotAddressSimData) {
  const Tensor t = Tensor::zeros({4}, DType::f32, MemCategory::other, Device::sim);
  expect_error([&] { (void)t.data<float>(); }, {"host code", "sim"});
  expect_error([&] { (void)t.raw(); }, {"host code", "sim"});
  DispatchPlan plan = moe::dispatch_plan_alloc(6, 3, 12, Device::sim);
  moe::dispatch_plan_build(plan, random_map(6, 3, 2, 11).to_device(Device::sim), ops::Context{Device::sim});
  expect_error([&] { (void)plan.tokens_per_expert.data<int64_t>(); }, {"host code", "sim"});
  EXPECT_EQ(to_vector(t), std::vector<float>(4, 0.0f));
  const auto tpe = to_vector_i64(plan.tokens_per_expert);
  EXPECT_EQ(std::accumulate(tpe.begin(), tpe.end(), int64_t{0}), 12);
}

}  // namespace
}  // namespace moecore
