// Router routing tests: hand-worked 3-token x 4-expert cases for every score function (numbers from the
// spec's formulas, computed independently), tie-breaking, group limits, sinkhorn, capacity policies,
// pad-to-capacity, routing-map padding, expert-bias counting and update, config validation, entry errors,
// bf16 / f16 input and thread-count independence. Inputs are made on the host and moved to the test device
// (MOECORE_TEST_DEVICE); results are read through host copies, so the suite also runs on the simulated device.
// Losses and gradients: test_router_losses.cpp.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "moecore/moe/router.h"
#include "test_util.h"

namespace moecore::moe {
namespace {

const ops::Context kCtx{testing::test_device()};

// The elements of a tensor on any device, through a host copy.
template <class T>
std::vector<T> values(const Tensor& t) {
  const Tensor h = testing::host(t);
  return std::vector<T>(h.data<T>(), h.data<T>() + h.numel());
}
// A host tensor of the given values moved to `device`.
Tensor device_i64(const std::vector<int64_t>& v, Device device = testing::test_device()) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i64, MemCategory::other);
  std::copy(v.begin(), v.end(), h.data<int64_t>());
  return h.to_device(device);
}
Tensor device_f32(const std::vector<float>& v, Device device = testing::test_device()) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::f32, MemCategory::other);
  std::copy(v.begin(), v.end(), h.data<float>());
  return h.to_device(device);
}
// A padding mask [T] with the given tokens marked.
Tensor padding_mask(int64_t T, std::initializer_list<int64_t> padded, Device device = testing::test_device()) {
  Tensor h = Tensor::zeros({T}, DType::boolean, MemCategory::other);
  for (int64_t t : padded) h.data<bool>()[t] = true;
  return h.to_device(device);
}

// One router with its weights, state, cache and outputs, all on `device`. H == E with an identity weight makes
// the logits equal to x, so a test states logits directly. forward() leaves host copies of probs, map and the
// statistics for the checks.
struct Router {
  MoeConfig cfg;
  RouterDims d;
  RouterWeights w;
  RouterState st;
  RouterCache cache;
  Tensor x, probs, map, pad;
  RouterStats dstats;
  RouterStatsHost stats;
  Tensor probs_h, map_h;
  ops::Context ctx;
  Router(const MoeConfig& c, int64_t T, int64_t H, int64_t B = 1, DType xdt = DType::f32,
         Device device = testing::test_device())
      : cfg(c), ctx{device} {
    d = {T, B, H, cfg.num_experts, cfg.router_topk};
    w.weight = Tensor::zeros({d.E, H}, DType::f32, MemCategory::other, device);
    st = router_state_init(cfg, device);
    cache = router_cache_alloc(d, cfg, xdt, device);
    dstats = router_stats_alloc(d.E, device);
    x = Tensor::zeros({T, H}, xdt, MemCategory::other, device);
    probs = Tensor::empty({T, d.E}, DType::f32, MemCategory::other, device);
    map = Tensor::empty({T, d.E}, DType::boolean, MemCategory::other, device);
    sync();
  }
  void sync() { w.weight_compute = x.dtype() == DType::f32 ? w.weight : w.weight.to(x.dtype()); }
  void set_logits(const std::vector<std::vector<float>>& z) {
    Tensor wh = Tensor::zeros({d.E, d.H}, DType::f32, MemCategory::other);
    Tensor xh = Tensor::zeros({d.T, d.H}, DType::f32, MemCategory::other);
    for (int64_t e = 0; e < d.E; ++e) wh.data<float>()[e * d.H + e] = 1.0f;
    for (size_t t = 0; t < z.size(); ++t)
      for (size_t e = 0; e < z[t].size(); ++e) xh.data<float>()[t * d.H + e] = z[t][e];
    w.weight.copy_from(wh);
    x.copy_from(xh);
    sync();
  }
  void randomize(uint64_t seed, float wstd = 1.0f) {
    Tensor wh = Tensor::empty({d.E, d.H}, DType::f32, MemCategory::other);
    rng_fill_normal(wh, seed, "test.router.w", 0.0f, wstd);
    w.weight.copy_from(wh);
    x.copy_from(testing::randn(x.shape(), "test.router.x", 1.0f, seed).to(x.dtype()));
    sync();
  }
  void forward(bool training = true) {
    router_forward(probs, map, dstats, x, pad, w, st, cache, d, cfg, training, ctx);
    probs_h = testing::host(probs);
    map_h = testing::host(map);
    stats = router_stats_host(dstats);
  }
  float p(int64_t t, int64_t e) const { return probs_h.data<float>()[t * d.E + e]; }
  bool m(int64_t t, int64_t e) const { return map_h.data<bool>()[t * d.E + e]; }
  int64_t column(int64_t e) const {
    int64_t n = 0;
    for (int64_t t = 0; t < d.T; ++t) n += m(t, e);
    return n;
  }
};

MoeConfig base_config(int64_t E = 4, int64_t K = 2) {
  MoeConfig c;
  c.num_experts = E;
  c.router_topk = K;
  c.load_balancing_type = {LoadBalancing::none};
  return c;
}

const std::vector<std::vector<float>> kLogits = {
    {1.0f, 2.0f, 0.5f, -1.0f}, {0.0f, -0.5f, 3.0f, 2.5f}, {1.5f, 1.5f, -2.0f, 0.25f}};

struct Expect {
  int expert;
  double prob;
};
// Each row lists the routed experts and their probabilities; all other entries must be unrouted and 0.
void expect_routing(const Router& r, const std::vector<std::vector<Expect>>& rows, double tol = 2e-7) {
  for (size_t t = 0; t < rows.size(); ++t) {
    std::set<int> routed;
    for (const Expect& x : rows[t]) {
      routed.insert(x.expert);
      EXPECT_TRUE(r.m(t, x.expert)) << "token " << t << " expert " << x.expert;
      EXPECT_NEAR(r.p(t, x.expert), x.prob, tol) << "token " << t << " expert " << x.expert;
    }
    for (int e = 0; e < r.d.E; ++e)
      if (!routed.count(e)) {
        EXPECT_FALSE(r.m(t, e)) << "token " << t << " expert " << e;
        EXPECT_EQ(r.p(t, e), 0.0f) << "token " << t << " expert " << e;
      }
  }
}

// Runs fn for both router dtypes: the math is the same, only the precision differs.
void for_router_dtypes(const std::function<void(DType)>& fn) {
  for (DType t : {DType::f32, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    fn(t);
  }
}

TEST(Router, WorkedSoftmaxAfterTopk) {
  for_router_dtypes([](DType rd) {
    MoeConfig c = base_config();
    c.router_dtype = rd;
    Router r(c, 3, 4);
    r.set_logits(kLogits);
    r.forward();
    // softmax over the two selected logits; token 2 ties 1.5 = 1.5 and takes the lower experts 0, 1.
    expect_routing(
        r, {{{1, 0.7310585786}, {0, 0.2689414214}}, {{2, 0.6224593312}, {3, 0.3775406688}}, {{0, 0.5}, {1, 0.5}}});
  });
}

TEST(Router, WorkedPreSoftmaxWithScalingFactor) {
  for_router_dtypes([](DType rd) {
    MoeConfig c = base_config();
    c.router_dtype = rd;
    c.pre_softmax = true;
    Router r(c, 3, 4);
    r.set_logits(kLogits);
    r.forward();
    // softmax over all four experts, not renormalized after top-k
    expect_routing(r, {{{1, 0.6094600376}, {0, 0.2242078180}},
                       {{2, 0.5929386539}, {3, 0.3596354729}},
                       {{0, 0.4316480593}, {1, 0.4316480593}}});
    r.cfg.topk_scaling_factor = 2.5f;
    r.forward();
    expect_routing(r,
                   {{{1, 2.5 * 0.6094600376}, {0, 2.5 * 0.2242078180}},
                    {{2, 2.5 * 0.5929386539}, {3, 2.5 * 0.3596354729}},
                    {{0, 2.5 * 0.4316480593}, {1, 2.5 * 0.4316480593}}},
                   5e-7);
  });
}

TEST(Router, WorkedSigmoidWithExpertBias) {
  for_router_dtypes([](DType rd) {
    MoeConfig c = base_config();
    c.router_dtype = rd;
    c.score_function = ScoreFunction::sigmoid;
    c.enable_expert_bias = true;
    Router r(c, 3, 4);
    r.set_logits(kLogits);
    r.st.expert_bias.copy_from(device_f32({0.0f, -0.3f, 0.0f, 0.6f}));
    r.forward();
    // selection on sigmoid + bias; weights are the unbiased sigmoids renormalized over the selected pair
    // (token 0: sigmoid(-1) + sigmoid(1) = 1, so the weights are the sigmoids themselves).
    expect_routing(r, {{{3, 0.2689414214}, {0, 0.7310585786}},
                       {{3, 0.4924249839}, {2, 0.5075750161}},
                       {{3, 0.4074478005}, {0, 0.5925521995}}});
  });
}

TEST(Router, WorkedSqrtSoftplus) {
  for_router_dtypes([](DType rd) {
    MoeConfig c = base_config();
    c.router_dtype = rd;
    c.score_function = ScoreFunction::sqrtsoftplus;
    Router r(c, 3, 4);
    r.set_logits(kLogits);
    r.forward();
    expect_routing(
        r, {{{1, 0.5599803737}, {0, 0.4400196263}}, {{2, 0.5209027287}, {3, 0.4790972713}}, {{0, 0.5}, {1, 0.5}}});
  });
}

TEST(Router, WorkedSigmoidTopOneIsNotRenormalized) {
  MoeConfig c = base_config(4, 1);
  c.score_function = ScoreFunction::sigmoid;
  Router r(c, 3, 4);
  r.set_logits(kLogits);
  r.forward();
  expect_routing(r, {{{1, 0.8807970780}}, {{2, 0.9525741268}}, {{0, 0.8175744762}}});
}

TEST(Router, WorkedGroupLimited) {
  for_router_dtypes([](DType rd) {
    MoeConfig c = base_config();
    c.router_dtype = rd;
    c.num_groups = 2;  // groups {0, 1} and {2, 3}; a group scores the sum of its top K / g = 2 logits
    c.group_topk = 1;
    Router r(c, 3, 4);
    r.set_logits({{3.0f, -2.0f, 2.0f, 1.5f}, {1.0f, 2.0f, 0.5f, -1.0f}, {0.5f, 0.5f, 0.5f, 0.5f}});
    r.forward();
    // token 0: plain top-2 would be {0, 2}; group scores 1.0 vs 3.5 keep group 1 only.
    expect_routing(
        r, {{{2, 0.6224593312}, {3, 0.3775406688}}, {{1, 0.7310585786}, {0, 0.2689414214}}, {{0, 0.5}, {1, 0.5}}});
  });
}

TEST(Router, GroupLimitedTouchesAtMostGroupTopkGroups) {
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    for (bool pre : {false, true}) {
      MoeConfig c = base_config(16, 4);
      c.score_function = sf;
      c.pre_softmax = pre;
      c.num_groups = 4;
      c.group_topk = 2;
      Router r(c, 40, 8);
      r.randomize(3);
      r.forward();
      for (int64_t t = 0; t < r.d.T; ++t) {
        std::set<int64_t> groups;
        int64_t n = 0;
        for (int64_t e = 0; e < 16; ++e)
          if (r.m(t, e)) groups.insert(e / 4), ++n;
        EXPECT_EQ(n, 4);
        EXPECT_LE(groups.size(), 2u);
      }
    }
  }
}

TEST(Router, WorkedSinkhorn) {
  for_router_dtypes([](DType rd) {
    MoeConfig c = base_config();
    c.router_dtype = rd;
    c.load_balancing_type = {LoadBalancing::sinkhorn};
    Router r(c, 3, 4);
    r.set_logits({{3.0f, 2.0f, 0.0f, 0.5f}, {3.0f, 2.5f, 0.0f, -1.0f}, {2.5f, 0.0f, 1.0f, 0.0f}});
    // Training: experts chosen on the sinkhorn-balanced matrix; weights softmax(z) there, not renormalized.
    r.forward(true);
    expect_routing(r, {{{3, 0.0547323995}, {0, 0.6667771258}},
                       {{1, 0.3621871340}, {0, 0.5971456318}},
                       {{2, 0.1608376954}, {3, 0.0591688815}}});
    // Evaluation: plain top-k of softmax(z).
    r.forward(false);
    expect_routing(r, {{{0, 0.6667771258}, {1, 0.2452935964}},
                       {{0, 0.5971456318}, {1, 0.3621871340}},
                       {{0, 0.7208245416}, {2, 0.1608376954}}});
  });
  MoeConfig c = base_config(4, 1);  // k == 1: the activation is a sigmoid
  c.load_balancing_type = {LoadBalancing::sinkhorn};
  Router r(c, 3, 4);
  r.set_logits(kLogits);
  r.forward(false);
  expect_routing(r, {{{1, 0.8807970780}}, {{2, 0.9525741268}}, {{0, 0.8175744762}}});
}

TEST(Router, TiesBreakTowardsLowerIndex) {
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid, ScoreFunction::sqrtsoftplus}) {
    for (bool groups : {false, true}) {
      MoeConfig c = base_config(6, 2);
      c.score_function = sf;
      c.pre_softmax = true;
      if (groups) c.num_groups = 3, c.group_topk = 2;
      Router r(c, 4, 6);  // zero weight: every logit is 0
      r.forward();
      for (int64_t t = 0; t < 4; ++t)
        for (int64_t e = 0; e < 6; ++e) EXPECT_EQ(r.m(t, e), e < 2) << "token " << t << " expert " << e;
    }
  }
}

// Capacity case: sigmoid, K = 1, T = 8, E = 4, cf = 1 => capacity ceil(8 / 4 * 1) = 2. Expert 0 is the
// choice of tokens 0, 2, 3, 5, 6 (logits rising with t except token 6), expert 1 of tokens 1, 7,
// expert 2 of token 4, expert 3 of nobody.
Router capacity_router(DropPolicy policy, bool pad) {
  MoeConfig c = base_config(4, 1);
  c.score_function = ScoreFunction::sigmoid;
  c.capacity_factor = 1.0f;
  c.drop_policy = policy;
  c.pad_expert_input_to_capacity = pad;
  Router r(c, 8, 4);
  r.set_logits({{1.0f, 0, 0, 0},
                {0, 1.0f, 0, 0},
                {2.0f, 0, 0, 0},
                {3.0f, 0, 0, 0},
                {0, 0, 1.0f, 0},
                {4.0f, 0, 0, 0},
                {0.5f, 0, 0, 0},
                {0, 2.0f, 0, 0}});
  r.forward();
  return r;
}

std::vector<int64_t> column_tokens(const Router& r, int64_t e) {
  std::vector<int64_t> out;
  for (int64_t t = 0; t < r.d.T; ++t)
    if (r.m(t, e)) out.push_back(t);
  return out;
}

TEST(Router, CapacityDropsByProbsAndByPosition) {
  Router rp = capacity_router(DropPolicy::probs, false);
  EXPECT_EQ(rp.stats.dropped, 3);
  EXPECT_EQ(column_tokens(rp, 0), (std::vector<int64_t>{3, 5}));  // the two largest probabilities
  EXPECT_EQ(column_tokens(rp, 1), (std::vector<int64_t>{1, 7}));
  EXPECT_EQ(rp.stats.tokens_per_expert, (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(rp.p(0, 0), 0.0f);
  EXPECT_NEAR(rp.p(5, 0), 0.98201379, 1e-7);

  Router rq = capacity_router(DropPolicy::position, false);
  EXPECT_EQ(rq.stats.dropped, 3);
  EXPECT_EQ(column_tokens(rq, 0), (std::vector<int64_t>{0, 2}));  // the two earliest
  EXPECT_EQ(rq.stats.tokens_per_expert, (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_NEAR(rq.p(0, 0), 0.7310585786, 1e-7);
  EXPECT_EQ(rq.p(5, 0), 0.0f);
  // topk_kept marks exactly the surviving selected pairs
  int64_t kept = 0;
  for (bool k : values<bool>(rq.cache.topk_kept)) kept += k;
  EXPECT_EQ(kept, 5);
}

// Megatron's token order with B = 2 sequences of S = 4: token t = s * B + b. Every token picks expert 0 (K = 1,
// sigmoid), its logit rising with the position; capacity = ceil(8 / 4 * 1) = 2. The position policy keeps the
// earliest positions across all sequences, position 0 of both (tokens 0 and 1); batch-major order would have
// kept positions 0 and 1 of sequence 0. The probs policy keeps the last position of both sequences.
TEST(Router, PositionPolicyKeepsTheEarliestPositionsOfEverySequence) {
  const int64_t B = 2, S = 4;
  for (DropPolicy policy : {DropPolicy::position, DropPolicy::probs}) {
    MoeConfig c = base_config(4, 1);
    c.score_function = ScoreFunction::sigmoid;
    c.capacity_factor = 1.0f;
    c.drop_policy = policy;
    Router r(c, B * S, 4, B);
    std::vector<std::vector<float>> z(B * S, std::vector<float>(4, 0.0f));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) z[s * B + b][0] = 1.0f + 0.5f * float(s) + 0.1f * float(b);
    r.set_logits(z);
    r.forward();
    std::vector<std::pair<int64_t, int64_t>> kept;  // (sequence, position)
    for (int64_t t : column_tokens(r, 0)) kept.push_back({t % B, t / B});
    using Kept = std::vector<std::pair<int64_t, int64_t>>;
    if (policy == DropPolicy::position)
      EXPECT_EQ(kept, (Kept{{0, 0}, {1, 0}}));
    else
      EXPECT_EQ(kept, (Kept{{0, 3}, {1, 3}}));
    EXPECT_EQ(r.stats.dropped, 6);
  }
}

TEST(Router, PadToCapacityFillsEveryColumnExactly) {
  for (DropPolicy policy : {DropPolicy::probs, DropPolicy::position}) {
    Router r = capacity_router(policy, true);
    EXPECT_EQ(r.stats.dropped, 3);
    EXPECT_EQ(r.stats.tokens_per_expert, (std::vector<int64_t>{2, 2, 2, 2}));
    // Fillers are real tokens with weight 0; an empty column takes the lowest token indices.
    EXPECT_EQ(column_tokens(r, 3), (std::vector<int64_t>{0, 1}));
    for (int64_t t : {0, 1}) EXPECT_EQ(r.p(t, 3), 0.0f);
    EXPECT_EQ(column_tokens(r, 0),
              policy == DropPolicy::probs ? (std::vector<int64_t>{3, 5}) : (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(column_tokens(r, 2), (std::vector<int64_t>{0, 4}));  // routed token 4, then filler 0
    EXPECT_EQ(r.p(0, 2), 0.0f);
    EXPECT_NEAR(r.p(4, 2), 0.7310585786, 1e-7);
  }
}

TEST(Router, NoDroppingWhenCapacityExceedsTokens) {
  // capacity = ceil(8 / 4 * 5) = 10 > T: nothing dropped; capacity = 8 = T (cf 4): the top-T keep is a no-op.
  for (float cf : {5.0f, 4.0f}) {
    MoeConfig c = base_config(4, 1);
    c.score_function = ScoreFunction::sigmoid;
    c.capacity_factor = cf;
    Router r(c, 8, 4);
    r.randomize(5);
    r.forward();
    EXPECT_EQ(r.stats.dropped, 0);
    int64_t total = 0;
    for (int64_t n : r.stats.tokens_per_expert) total += n;
    EXPECT_EQ(total, 8);
  }
}

TEST(Router, DroplessCountsSumToTokensTimesK) {
  MoeConfig c = base_config(6, 2);
  c.pre_softmax = true;
  Router r(c, 37, 9);
  r.randomize(11);
  r.forward();
  int64_t total = 0;
  for (int64_t n : r.stats.tokens_per_expert) total += n;
  EXPECT_EQ(total, 37 * 2);
  EXPECT_EQ(r.stats.dropped, 0);
}

TEST(Router, RoutingMapPaddingAlignsColumnsAndKeepsProbs) {
  MoeConfig c = base_config(6, 2);
  c.score_function = ScoreFunction::sigmoid;
  Router plain(c, 23, 7);
  plain.randomize(13);
  plain.forward();
  c.router_padding_alignment = 4;
  Router padded(c, 23, 7);
  padded.randomize(13);
  padded.forward();
  EXPECT_EQ(std::memcmp(plain.probs_h.raw(), padded.probs_h.raw(), plain.probs_h.nbytes()), 0);
  for (int64_t e = 0; e < 6; ++e) {
    EXPECT_EQ(padded.column(e) % 4, 0) << "expert " << e;
    EXPECT_EQ(padded.stats.tokens_per_expert[e], padded.column(e));
    // the added slots are the lowest-index unrouted tokens of the column
    int64_t need = (4 - plain.column(e) % 4) % 4;
    for (int64_t t = 0; t < 23; ++t) {
      if (plain.m(t, e)) {
        EXPECT_TRUE(padded.m(t, e));
      } else {
        EXPECT_EQ(padded.m(t, e), need > 0) << "token " << t << " expert " << e;
        need -= padded.m(t, e) ? 1 : 0;
      }
    }
  }
}

TEST(Router, ExpertBiasCountsValidTokensOnlyInTraining) {
  MoeConfig c = base_config(6, 2);
  c.score_function = ScoreFunction::sigmoid;
  c.enable_expert_bias = true;
  Router r(c, 10, 5);
  r.randomize(17);
  r.pad = padding_mask(10, {3, 8});
  r.forward();
  const std::vector<int64_t> before = values<int64_t>(r.st.local_tokens_per_expert);
  int64_t total = 0;
  for (int64_t e = 0; e < 6; ++e) {
    int64_t valid = 0;
    for (int64_t t = 0; t < 10; ++t) valid += r.m(t, e) && t != 3 && t != 8;
    EXPECT_EQ(before[e], valid);
    total += before[e];
  }
  EXPECT_EQ(total, 8 * 2);
  r.forward(false);  // evaluation counts nothing
  EXPECT_EQ(values<int64_t>(r.st.local_tokens_per_expert), before);
}

TEST(Router, ExpertBiasUpdateSignRule) {
  MoeConfig c = base_config(4, 2);
  c.score_function = ScoreFunction::sigmoid;
  c.enable_expert_bias = true;
  c.bias_update_rate = 0.25f;
  RouterState st = router_state_init(c, testing::test_device());
  st.local_tokens_per_expert.copy_from(device_i64({3, 5, 4, 4}));  // mean 4: under, over, exactly mean twice
  st.global_tokens_per_expert.copy_from(device_i64({1, 2, 3, 4}));
  st.global_aux_steps = 2;
  router_finish_step(st, c, true, kCtx);
  std::vector<float> b = values<float>(st.expert_bias);
  EXPECT_EQ(b[0], 0.25f);
  EXPECT_EQ(b[1], -0.25f);
  EXPECT_EQ(b[2], 0.0f);
  EXPECT_EQ(b[3], 0.0f);
  EXPECT_EQ(values<int64_t>(st.local_tokens_per_expert), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(values<int64_t>(st.global_tokens_per_expert), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(st.global_aux_steps, 0);
  st.local_tokens_per_expert.copy_from(device_i64({1, 1, 1, 2}));  // mean 1.25: not an integer, no tie
  router_finish_step(st, c, true, kCtx);
  b = values<float>(st.expert_bias);
  EXPECT_EQ(b[0], 0.5f);
  EXPECT_EQ(b[3], -0.25f);
}

void expect_config_error(const MoeConfig& c, std::initializer_list<std::string> needles, bool fp8 = false) {
  try {
    c.validate(fp8);
    ADD_FAILURE() << "validate accepted a bad config; expected " << *needles.begin();
  } catch (const Error& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(Router, ConfigValidationNamesFlagsAndValues) {
  MoeConfig ok = base_config(8, 2);
  EXPECT_NO_THROW(ok.validate());
  MoeConfig c = ok;
  c.router_topk = 9;
  expect_config_error(c, {"--moe-router-topk (9)", "--num-experts (8)"});
  c = ok;
  c.num_groups = 3, c.group_topk = 1;
  expect_config_error(c, {"--num-experts (8)", "--moe-router-num-groups (3)"});
  c = ok;
  c.load_balancing_type = {LoadBalancing::sinkhorn};
  c.capacity_factor = 1.5f;
  expect_config_error(c, {"--moe-expert-capacity-factor (1.5)", "sinkhorn"});
  c = ok;
  c.enable_expert_bias = true;
  expect_config_error(c, {"--moe-router-enable-expert-bias", "softmax"});
  c = ok;
  c.router_padding_alignment = 16;
  expect_config_error(c, {"--moe-router-padding-for-fp8", "16"});
  EXPECT_NO_THROW(c.validate(true));
  c = ok;
  c.router_topk = 1;
  expect_config_error(c, {"--moe-router-topk 1", "--moe-router-pre-softmax"});
  c = ok;
  c.pad_expert_input_to_capacity = true;
  expect_config_error(c, {"--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor"});
}

using testing::expect_error;

TEST(Router, EntryChecksNameOpShapesAndDtypes) {
  Router r(base_config(4, 2), 5, 3);
  const Device dev = testing::test_device();
  Tensor bad_x = Tensor::zeros({5, 4}, DType::f32, MemCategory::other, dev);
  expect_error(
      [&] { router_forward(r.probs, r.map, r.dstats, bad_x, r.pad, r.w, r.st, r.cache, r.d, r.cfg, true, kCtx); },
      {"router_forward", "x must have shape [5, 3]", "got [5, 4]"});
  Tensor bad_map = Tensor::zeros({5, 4}, DType::f32, MemCategory::other, dev);
  expect_error(
      [&] { router_forward(r.probs, bad_map, r.dstats, r.x, r.pad, r.w, r.st, r.cache, r.d, r.cfg, true, kCtx); },
      {"router_forward", "map must be bool", "got f32"});
  Tensor bad_pad = Tensor::zeros({4}, DType::boolean, MemCategory::other, dev);
  expect_error(
      [&] { router_forward(r.probs, r.map, r.dstats, r.x, bad_pad, r.w, r.st, r.cache, r.d, r.cfg, true, kCtx); },
      {"router_forward", "padding_mask", "[5]"});
  MoeConfig f64 = r.cfg;
  f64.router_dtype = DType::f64;  // the cache was allocated for f32
  expect_error([&] { router_forward(r.probs, r.map, r.dstats, r.x, r.pad, r.w, r.st, r.cache, r.d, f64, true, kCtx); },
               {"router_forward", "cache.logits must be f64"});
  RouterStats unallocated;
  expect_error(
      [&] { router_forward(r.probs, r.map, unallocated, r.x, r.pad, r.w, r.st, r.cache, r.d, r.cfg, true, kCtx); },
      {"router_forward", "router_stats_alloc"});
  r.forward();
  Tensor dx = Tensor::zeros({5, 3}, DType::f32, MemCategory::other, dev);
  Tensor dw = Tensor::zeros({4, 3}, DType::f32, MemCategory::other, dev);
  Tensor bad_dp = Tensor::zeros({5, 4}, DType::bf16, MemCategory::other, dev);
  expect_error([&] { router_backward(dx, dw, bad_dp, r.x, r.w, r.cache, r.d, r.cfg, 1.0f, kCtx); },
               {"router_backward", "dprobs must be f32", "got bf16"});
  RouterDims bad_d = r.d;
  bad_d.K = 3;
  expect_error([&] { router_backward(dx, dw, r.probs, r.x, r.w, r.cache, bad_d, r.cfg, 1.0f, kCtx); },
               {"router_backward", "K=3", "--moe-router-topk (2)"});
}

// On the simulated device a host tensor among the arguments is refused with the device mismatch named, before
// any data is touched: by the router's entry checks and by every op's own checks.
TEST(Router, SimContextRefusesAHostTensor) {
  MoeConfig c = base_config(4, 2);
  c.load_balancing_type = {LoadBalancing::aux_loss};
  c.aux_loss_coeff = {0.1f};
  Router r(c, 5, 3, 1, DType::f32, Device::sim);
  r.randomize(3);
  const Tensor x_sim = r.x;
  r.x = testing::host(x_sim);
  expect_error([&] { r.forward(); }, {"router_forward", "x is on cpu but the router runs on sim"});
  r.x = x_sim;
  r.forward();  // all on sim: fine
  Tensor dx = Tensor::zeros({5, 3}, DType::f32, MemCategory::other, Device::sim);
  Tensor dw = Tensor::zeros({4, 3}, DType::f32, MemCategory::other, Device::sim);
  const Tensor dp_host = testing::randn({5, 4}, "test.router.dp");
  expect_error([&] { router_backward(dx, dw, dp_host, r.x, r.w, r.cache, r.d, r.cfg, 1.0f, r.ctx); },
               {"router_backward", "dprobs is on cpu but the router runs on sim"});
  EXPECT_NO_THROW(router_backward(dx, dw, dp_host.to_device(Device::sim), r.x, r.w, r.cache, r.d, r.cfg, 1.0f, r.ctx));
  // The ops check the same on their own: a host map for the simulated device's counts, and a host padding mask.
  Tensor counts = Tensor::zeros({4}, DType::i64, MemCategory::other, Device::sim);
  expect_error([&] { ops::router_map_counts(counts, testing::host(r.map), Tensor(), false, r.ctx); },
               {"router_map_counts", "map is on cpu but the op runs on sim"});
  expect_error([&] { ops::router_map_counts(counts, r.map, padding_mask(5, {1}, Device::cpu), false, r.ctx); },
               {"router_map_counts", "padding", "is on cpu but the op runs on sim"});
  // A host-side read of a simulated-device tensor is refused too: only ops, collectives and transfers touch it.
  expect_error([&] { (void)r.probs.data<float>(); }, {"host code addressed the data of a sim tensor"});
}

TEST(Router, EvaluationSkipsLossesAndCountersButAppliesJitter) {
  MoeConfig c = base_config(6, 2);
  c.score_function = ScoreFunction::sigmoid;
  c.enable_expert_bias = true;
  c.load_balancing_type = {LoadBalancing::aux_loss};
  c.aux_loss_coeff = {0.1f};
  c.z_loss_coeff = 1e-3f;
  c.input_jitter_eps = 0.05f;
  Router r(c, 6, 5);
  r.randomize(23);
  r.forward(false);
  EXPECT_EQ(r.stats.aux_loss, 0.0);
  EXPECT_EQ(r.stats.z_loss, 0.0);
  EXPECT_EQ(r.stats.weighted_loss, 0.0);
  EXPECT_EQ(values<int64_t>(r.st.local_tokens_per_expert), (std::vector<int64_t>(6, 0)));
  EXPECT_EQ(r.st.calls, 1);
  for (float v : testing::to_vector(r.cache.dlogits_loss)) EXPECT_EQ(v, 0.0f);
  const auto xj = testing::to_vector(r.cache.x_jittered), x = testing::to_vector(r.x),
             u = testing::to_vector(r.cache.jitter);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_GE(u[i], 0.95f);
    EXPECT_LE(u[i], 1.05f);
    EXPECT_EQ(xj[i], x[i] * u[i]);
  }
  EXPECT_NE(u[0], u[1]);
  r.forward(true);  // the next call draws fresh noise
  EXPECT_NE(testing::to_vector(r.cache.jitter)[0], u[0]);
  EXPECT_GT(r.stats.aux_loss, 0.0);
  EXPECT_GT(r.stats.z_loss, 0.0);
}

TEST(Router, ForcedBalancingUsesRandomLogitsWithStraightThroughGradient) {
  MoeConfig c = base_config(8, 2);
  c.pre_softmax = true;
  Router r(c, 64, 4);
  r.randomize(29, 0.01f);  // nearly uniform real logits
  r.cfg.force_load_balancing = true;
  r.forward();
  int64_t lo = 64, hi = 0;
  for (int64_t n : r.stats.tokens_per_expert) lo = std::min(lo, n), hi = std::max(hi, n);
  EXPECT_GT(lo, 4);  // random logits spread 128 routes over 8 experts
  EXPECT_LT(hi, 32);
  const std::vector<float> logits = values<float>(r.cache.logits);
  for (int64_t i = 0; i < 64 * 8; i += 37)
    EXPECT_EQ(logits[i], philox_normal(philox_key(c.seed, "router.force_load_balancing"), i));
  Tensor dx = Tensor::zeros({64, 4}, DType::f32, MemCategory::other, r.ctx.device);
  Tensor dw = Tensor::zeros({8, 4}, DType::f32, MemCategory::other, r.ctx.device);
  Tensor dp = testing::on_test_device(testing::randn({64, 8}, "test.router.dp"));
  router_backward(dx, dw, dp, r.x, r.w, r.cache, r.d, r.cfg, 1.0f, kCtx);
  EXPECT_GT(testing::sum_squares(dw), 0.0);
  EXPECT_GT(testing::sum_squares(dx), 0.0);
}

// --moe-router-force-biased: the random logits plus a per-expert bias N(0, |std|) from the layer's stream, the same on
// every rank: drawn once per layer for std < 0 (the same hot experts every forward), anew each forward for std > 0.
// The skew shows in the loads.
TEST(Router, ForcedBiasSkewsTheLoads) {
  MoeConfig c = base_config(8, 2);
  c.pre_softmax = true;
  c.force_biased = -3.0f;
  Router r(c, 256, 4);
  r.randomize(29, 0.01f);
  r.forward();
  const std::vector<float> bias = values<float>(r.cache.forced_bias);
  for (int64_t e = 0; e < 8; ++e)
    EXPECT_EQ(bias[static_cast<size_t>(e)],
              static_cast<float>(philox_normal(philox_key(c.seed, "router.force_biased"), e)) * 3.0f);
  int64_t hi = 0;
  for (int64_t n : r.stats.tokens_per_expert) hi = std::max(hi, n);
  EXPECT_GT(hi, 2 * 512 / 8);  // the hottest expert takes more than twice its share of the 512 routes
  const std::vector<float> logits = values<float>(r.cache.logits);
  r.forward();
  EXPECT_EQ(values<float>(r.cache.forced_bias), bias);  // std < 0: the layer's bias stays
  EXPECT_NE(values<float>(r.cache.logits), logits);
  c.force_biased = 3.0f;
  Router fresh(c, 256, 4);
  fresh.randomize(29, 0.01f);
  fresh.forward();
  const std::vector<float> first = values<float>(fresh.cache.forced_bias);
  EXPECT_EQ(first, bias);  // (call 0 draws from the same place)
  fresh.forward();
  EXPECT_NE(values<float>(fresh.cache.forced_bias), first);  // std > 0: a new bias each forward
}

// bf16 or f16 x with the fp32 router: logits are the f32-accumulated products of the rounded values; the weight
// gradient widens x chunk by chunk (T > 1024 covers two chunks) and matches a double reference.
TEST(Router, Bf16InputWithFp32Router) {
  for (DType x_dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(x_dtype));
    MoeConfig c = base_config(4, 2);
    c.load_balancing_type = {LoadBalancing::aux_loss};
    c.aux_loss_coeff = {0.01f};
    c.input_jitter_eps = 0.01f;
    Router r(c, 1100, 8, 1, x_dtype);
    r.randomize(31, 0.5f);
    r.forward();
    const auto xj = testing::to_vector(r.cache.x_jittered), wc = testing::to_vector(r.w.weight_compute),
               lg = testing::to_vector(r.cache.logits);
    for (int64_t t = 0; t < 1100; t += 97)
      for (int64_t e = 0; e < 4; ++e) {
        double ref = 0;
        for (int64_t h = 0; h < 8; ++h) ref += double(xj[t * 8 + h]) * double(wc[e * 8 + h]);
        EXPECT_NEAR(lg[t * 4 + e], ref, 1e-5);
      }
    Tensor dx = Tensor::zeros({1100, 8}, DType::f32, MemCategory::other, r.ctx.device);
    Tensor dw = Tensor::zeros({4, 8}, DType::f32, MemCategory::other, r.ctx.device);
    Tensor dp = testing::on_test_device(testing::randn({1100, 4}, "test.router.dp"));
    router_backward(dx, dw, dp, r.x, r.w, r.cache, r.d, r.cfg, 0.5f, kCtx);
    const auto dl = testing::to_vector(r.cache.dlogits), w = testing::to_vector(r.w.weight),
               u = testing::to_vector(r.cache.jitter), gw = testing::to_vector(dw), gx = testing::to_vector(dx);
    for (int64_t e = 0; e < 4; ++e)
      for (int64_t h = 0; h < 8; ++h) {
        double ref = 0;
        for (int64_t t = 0; t < 1100; ++t) ref += double(dl[t * 4 + e]) * double(xj[t * 8 + h]);
        EXPECT_NEAR(gw[e * 8 + h], ref, 1e-4 * (1 + std::fabs(ref)));
      }
    for (int64_t t = 0; t < 1100; t += 53)
      for (int64_t h = 0; h < 8; ++h) {
        double ref = 0;
        for (int64_t e = 0; e < 4; ++e) ref += double(dl[t * 4 + e]) * double(w[e * 8 + h]);
        EXPECT_NEAR(gx[t * 8 + h], ref * u[t * 8 + h], 1e-5);
      }
  }
}

// Outputs are bit-identical with one and two threads (router passes go parallel above 16k [T, E]
// elements). The fp64 router is checked end to end. ops::gemm (oneDNN) is itself not thread-count
// invariant, so the fp32 case takes its logits from forced balancing and leaves out dx and dweight.
TEST(Router, ResultsDoNotDependOnThreadCount) {
  for_router_dtypes([](DType rd) {
    MoeConfig c = base_config(16, 2);
    c.router_dtype = rd;
    c.score_function = ScoreFunction::sigmoid;
    c.enable_expert_bias = true;
    c.num_groups = 4, c.group_topk = 2;
    c.load_balancing_type = {LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss};
    c.aux_loss_coeff = {0.01f, 0.02f};
    c.z_loss_coeff = 1e-3f;
    c.capacity_factor = 1.0f;
    c.router_padding_alignment = 8;
    c.input_jitter_eps = 0.01f;
    c.force_load_balancing = rd == DType::f32;
    std::vector<std::vector<char>> outs;
    const int saved = omp_get_max_threads();
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      Router r(c, 2048, 16, 4);
      r.randomize(37);
      Tensor bias = Tensor::empty({16}, DType::f32, MemCategory::other);
      rng_fill_normal(bias, 1, "test.router.bias", 0.0f, 0.1f);
      r.st.expert_bias.copy_from(bias.to_device(r.ctx.device));
      r.forward();
      Tensor dx = Tensor::zeros({2048, 16}, DType::f32, MemCategory::other, r.ctx.device);
      Tensor dw = Tensor::zeros({16, 16}, DType::f32, MemCategory::other, r.ctx.device);
      router_backward(dx, dw, testing::on_test_device(testing::randn({2048, 16}, "test.router.dp")), r.x, r.w, r.cache,
                      r.d, r.cfg, 1.0f, kCtx);
      std::vector<const Tensor*> checked = {
          &r.probs, &r.map, &r.cache.logits, &r.cache.x_jittered, &r.cache.dlogits_loss, &r.cache.dlogits};
      if (rd == DType::f64) checked.insert(checked.end(), {&dx, &dw});
      std::vector<char> all;
      for (const Tensor* t : checked) {
        const Tensor h = testing::host(*t);
        const char* p = static_cast<const char*>(h.raw());
        all.insert(all.end(), p, p + h.nbytes());
      }
      const double wl = r.stats.weighted_loss;
      all.insert(all.end(), reinterpret_cast<const char*>(&wl), reinterpret_cast<const char*>(&wl) + sizeof wl);
      outs.push_back(all);
    }
    omp_set_num_threads(saved);
    EXPECT_TRUE(outs[0] == outs[1]);
  });
}

}  // namespace
}  // namespace moecore::moe
