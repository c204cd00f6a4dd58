// Router loss and gradient tests: worked aux/z-loss values, the uniform router (every aux loss is exactly 1),
// seq_aux_loss == aux_loss for one sequence, global_aux_loss accumulation and reset, padding == truncation,
// and central finite differences of router_backward (dx and dweight, fp64 router) for every routing
// variant combined with every loss, plus jitter. Inputs are made on the host and moved to the test device
// (MOECORE_TEST_DEVICE); results are read through host copies. Routing itself: test_router.cpp.
#include <algorithm>
#include <cmath>
#include <initializer_list>
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
// Host f32 values into a tensor on any device.
void upload(Tensor& dst, const std::vector<float>& v) {
  Tensor h = Tensor::empty(dst.shape(), DType::f32, MemCategory::other);
  std::copy(v.begin(), v.end(), h.data<float>());
  dst.copy_from(h.to_device(dst.device()));
}
// dst = N(0, 1) from the named stream, drawn on the host.
void fill_normal(Tensor& dst, uint64_t seed, const char* name, float std = 1.0f) {
  dst.copy_from(testing::randn(dst.shape(), name, std, seed).to_device(dst.device()));
}
// A padding mask [T] with the given tokens marked, on the test device.
Tensor padding_mask(int64_t T, std::initializer_list<int64_t> padded) {
  Tensor h = Tensor::zeros({T}, DType::boolean, MemCategory::other);
  for (int64_t t : padded) h.data<bool>()[t] = true;
  return testing::on_test_device(h);
}
// An independent copy of a router state (copies of the struct share its tensors).
RouterState clone_state(const RouterState& s) {
  RouterState c = s;
  for (Tensor* t : {&c.expert_bias, &c.local_tokens_per_expert, &c.global_tokens_per_expert, &c.global_aux_counts})
    if (t->defined()) *t = t->clone();
  return c;
}

struct Router {
  MoeConfig cfg;
  RouterDims d;
  RouterWeights w;
  RouterState st;
  RouterCache cache;
  Tensor x, probs, map, pad;
  RouterStats dstats;
  RouterStatsHost stats;
  Router(const MoeConfig& c, int64_t T, int64_t H, int64_t B = 1) : cfg(c) {
    const Device dev = testing::test_device();
    d = {T, B, H, cfg.num_experts, cfg.router_topk};
    w.weight = Tensor::zeros({d.E, H}, DType::f32, MemCategory::other, dev);
    w.weight_compute = w.weight;
    st = router_state_init(cfg, dev);
    cache = router_cache_alloc(d, cfg, DType::f32, dev);
    dstats = router_stats_alloc(d.E, dev);
    x = Tensor::zeros({T, H}, DType::f32, MemCategory::other, dev);
    probs = Tensor::empty({T, d.E}, DType::f32, MemCategory::other, dev);
    map = Tensor::empty({T, d.E}, DType::boolean, MemCategory::other, dev);
  }
  void randomize(uint64_t seed) {
    fill_normal(w.weight, seed, "test.router.w");
    fill_normal(x, seed, "test.router.x");
  }
  void forward(bool training = true) {
    router_forward(probs, map, dstats, x, pad, w, st, cache, d, cfg, training, kCtx);
    stats = router_stats_host(dstats);
  }
  std::vector<double> dlogits_loss() const { return values<double>(cache.dlogits_loss.to(DType::f64)); }
};

MoeConfig loss_config(std::vector<LoadBalancing> types, std::vector<float> coeffs, int64_t E = 6, int64_t K = 2,
                      DType rd = DType::f64) {
  MoeConfig c;
  c.num_experts = E;
  c.router_topk = K;
  c.load_balancing_type = std::move(types);
  c.aux_loss_coeff = std::move(coeffs);
  c.router_dtype = rd;
  return c;
}

// Copies rows [t0, t0 + n) of src's input into a router of n tokens with the same weight.
void copy_rows(Router& dst, const Router& src, int64_t t0) {
  dst.w.weight.copy_from(src.w.weight);
  dst.x.copy_from(src.x.slice(0, t0, t0 + dst.d.T));
}

// Copies the first dst.T positions of sequence b of src (tokens are sequence-major: t = s * B + b, so the
// sequence is the rows b, b + B, b + 2B, ...) into a one-sequence router with the same weight.
void copy_sequence(Router& dst, const Router& src, int64_t b) {
  dst.w.weight.copy_from(src.w.weight);
  for (int64_t s = 0; s < dst.d.T; ++s)
    dst.x.slice(0, s, s + 1).copy_from(src.x.slice(0, s * src.d.B + b, s * src.d.B + b + 1));
}

TEST(RouterLosses, WorkedAuxAndZLoss) {
  MoeConfig c = loss_config({LoadBalancing::aux_loss}, {0.5f}, 4, 2);
  c.z_loss_coeff = 0.25f;
  Router r(c, 3, 4);
  upload(r.w.weight, {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1});
  upload(r.x, {1.0f, 2.0f, 0.5f, -1.0f, 0.0f, -0.5f, 3.0f, 2.5f, 1.5f, 1.5f, -2.0f, 0.25f});
  r.forward();
  // P = column sums of softmax, c = top-2 counts [2, 2, 1, 1], N = 3: E / (K N^2) sum P c.
  EXPECT_NEAR(r.stats.aux_loss, 1.0543088549650248, 1e-14);
  EXPECT_NEAR(r.stats.z_loss, 8.037124648593947, 1e-14);  // mean of lse^2
  EXPECT_NEAR(r.stats.weighted_loss, 0.5 * 1.0543088549650248 + 0.25 * 8.037124648593947, 1e-14);
  EXPECT_EQ(r.stats.seq_aux_loss, 0.0);
  EXPECT_EQ(r.stats.global_aux_loss, 0.0);
}

TEST(RouterLosses, UniformRouterGivesExactlyOne) {
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid, ScoreFunction::sqrtsoftplus}) {
    MoeConfig c = loss_config({LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss, LoadBalancing::global_aux_loss},
                              {1.0f, 2.0f, 3.0f}, 8, 2, DType::f32);
    c.score_function = sf;
    c.pre_softmax = true;
    c.z_loss_coeff = 1e-3f;
    Router r(c, 8, 4, 2);  // zero weight: uniform scores
    r.randomize(1);
    r.w.weight.zero_();
    r.forward();
    // sqrtsoftplus scores normalize sqrt(log 2) / (8 sqrt(log 2)), which rounds; the others are exact.
    const double tol = sf == ScoreFunction::sqrtsoftplus ? 1e-6 : 0.0;
    EXPECT_NEAR(r.stats.aux_loss, 1.0, tol);
    EXPECT_NEAR(r.stats.seq_aux_loss, 1.0, tol);
    EXPECT_NEAR(r.stats.global_aux_loss, 1.0, tol);
    EXPECT_NEAR(r.stats.z_loss, std::log(8.0) * std::log(8.0), 1e-5);
    EXPECT_NEAR(r.stats.weighted_loss, 6.0 + 1e-3 * std::log(8.0) * std::log(8.0), 1e-5);
  }
}

TEST(RouterLosses, SeqAuxWithOneSequenceEqualsAuxExactly) {
  for (DType rd : {DType::f32, DType::f64}) {
    for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sqrtsoftplus}) {
      MoeConfig ca = loss_config({LoadBalancing::aux_loss}, {0.3f}, 6, 2, rd);
      ca.score_function = sf;
      MoeConfig cs = ca;
      cs.load_balancing_type = {LoadBalancing::seq_aux_loss};
      Router a(ca, 7, 5), s(cs, 7, 5);
      a.randomize(3);
      s.randomize(3);
      a.forward();
      s.forward();
      EXPECT_GT(a.stats.aux_loss, 0.0);
      EXPECT_EQ(a.stats.aux_loss, s.stats.seq_aux_loss);
      EXPECT_EQ(a.stats.weighted_loss, s.stats.weighted_loss);
      EXPECT_EQ(a.dlogits_loss(), s.dlogits_loss());
    }
  }
}

TEST(RouterLosses, SeqAuxIsMeanOfPerSequenceAux) {
  MoeConfig cs = loss_config({LoadBalancing::seq_aux_loss}, {1.0f});
  cs.score_function = ScoreFunction::sigmoid;
  MoeConfig ca = cs;
  ca.load_balancing_type = {LoadBalancing::aux_loss};
  Router s(cs, 8, 5, 2);
  s.randomize(5);
  s.forward();
  double mean = 0;
  std::vector<double> grad(8 * 6);
  for (int64_t b = 0; b < 2; ++b) {
    Router a(ca, 4, 5);
    copy_sequence(a, s, b);  // sequence b = tokens b, b + 2, b + 4, b + 6 (Megatron's [S, B] order)
    a.forward();
    mean += a.stats.aux_loss / 2;
    const std::vector<double> ga = a.dlogits_loss();
    for (int64_t pos = 0; pos < 4; ++pos)  // each sequence's loss enters with weight 1/B
      for (int64_t e = 0; e < 6; ++e) grad[(pos * 2 + b) * 6 + e] = ga[pos * 6 + e] / 2;
  }
  EXPECT_NEAR(s.stats.seq_aux_loss, mean, 1e-14);
  const std::vector<double> got = s.dlogits_loss();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], grad[i], 1e-15) << i;
}

// Aux-loss pieces recomputed from the cached logits: P[e] = sum of softmax scores, c[e] = top-k counts.
void aux_pieces(const Router& r, std::vector<double>& P, std::vector<double>& c) {
  const int64_t T = r.d.T, E = r.d.E, K = r.d.K;
  const std::vector<double> z = values<double>(r.cache.logits);
  P.assign(E, 0.0);
  c.assign(E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(E);
    double mx = z[t * E], sum = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, z[t * E + e]);
    for (int64_t e = 0; e < E; ++e) sum += s[e] = std::exp(z[t * E + e] - mx);
    for (int64_t e = 0; e < E; ++e) P[e] += s[e] / sum;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (s[e] >= 0 && (best < 0 || s[e] > s[best])) best = e;
      c[best] += 1;
      s[best] = -1;
    }
  }
}

TEST(RouterLosses, GlobalAuxAccumulatesAcrossMicroBatchesAndResets) {
  MoeConfig cg = loss_config({LoadBalancing::global_aux_loss}, {0.2f});
  MoeConfig ca = loss_config({LoadBalancing::aux_loss}, {0.2f});
  Router g(cg, 9, 5), a(ca, 9, 5);
  g.randomize(7);
  a.randomize(7);
  g.forward();
  a.forward();
  EXPECT_EQ(g.stats.global_aux_loss, a.stats.aux_loss);  // first micro-batch: exactly aux_loss
  EXPECT_EQ(g.dlogits_loss(), a.dlogits_loss());
  std::vector<double> P1, c1, P2, c2;
  aux_pieces(g, P1, c1);
  fill_normal(g.x, 8, "test.router.x");  // second micro-batch
  g.forward();
  aux_pieces(g, P2, c2);
  EXPECT_EQ(g.st.global_aux_steps, 2);
  double expect = 0;
  const std::vector<int64_t> global = values<int64_t>(g.st.global_tokens_per_expert);
  for (int64_t e = 0; e < 6; ++e) {
    EXPECT_EQ(global[e], static_cast<int64_t>(c1[e] + c2[e]));
    expect += P2[e] * (c1[e] + c2[e]) / 2;
  }
  expect *= 6.0 / (2.0 * 9 * 9);
  EXPECT_NEAR(g.stats.global_aux_loss, expect, 1e-13);
  router_finish_step(g.st, g.cfg, true, kCtx);
  EXPECT_EQ(g.st.global_aux_steps, 0);
  g.forward();  // after the reset: this micro-batch's aux_loss again
  a.x.copy_from(g.x);
  a.forward();
  EXPECT_EQ(g.stats.global_aux_loss, a.stats.aux_loss);
}

TEST(RouterLosses, PaddingEqualsTruncation) {
  for (DType rd : {DType::f64, DType::f32}) {
    MoeConfig c = loss_config({LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss, LoadBalancing::global_aux_loss},
                              {0.5f, 1.0f, 2.0f}, 6, 2, rd);
    c.score_function = ScoreFunction::sigmoid;
    c.z_loss_coeff = 0.1f;
    Router full(c, 8, 5), cut(c, 5, 5);
    full.randomize(9);
    full.pad = padding_mask(8, {5, 6, 7});
    copy_rows(cut, full, 0);
    full.forward();
    cut.forward();
    // fp64 gating is per row, so the logits agree bit for bit; oneDNN's fp32 GEMM may round differently.
    const double tol = rd == DType::f64 ? 0.0 : 1e-6;
    EXPECT_NEAR(full.stats.aux_loss, cut.stats.aux_loss, tol);
    EXPECT_NEAR(full.stats.seq_aux_loss, cut.stats.seq_aux_loss, tol);
    EXPECT_NEAR(full.stats.global_aux_loss, cut.stats.global_aux_loss, tol);
    EXPECT_NEAR(full.stats.z_loss, cut.stats.z_loss, tol);
    const std::vector<double> gf = full.dlogits_loss(), gc = cut.dlogits_loss();
    for (size_t i = 0; i < gf.size(); ++i) EXPECT_NEAR(gf[i], i < gc.size() ? gc[i] : 0.0, tol) << i;
  }
}

TEST(RouterLosses, SeqAuxWithPaddingUsesAverageValidLength) {
  MoeConfig c = loss_config({LoadBalancing::seq_aux_loss}, {1.0f});
  Router r(c, 8, 5, 2);
  r.randomize(10);
  r.pad = padding_mask(8, {6});  // position 3 of sequence 0 (t = 3 * B + 0): 3 and 4 valid tokens, N = 3.5
  r.forward();
  double expect = 0;
  for (int64_t b = 0; b < 2; ++b) {
    Router one(loss_config({LoadBalancing::aux_loss}, {1.0f}), b == 0 ? 3 : 4, 5);
    copy_sequence(one, r, b);
    one.forward();
    std::vector<double> P, cnt;
    aux_pieces(one, P, cnt);
    double acc = 0;
    for (int64_t e = 0; e < 6; ++e) acc += P[e] * cnt[e];
    expect += 6.0 / (2.0 * 3.5 * 3.5) * acc / 2;
  }
  EXPECT_NEAR(r.stats.seq_aux_loss, expect, 1e-13);
}

TEST(RouterLosses, BackwardAccumulatesParameterGradients) {
  MoeConfig c = loss_config({LoadBalancing::aux_loss}, {0.1f});
  c.z_loss_coeff = 0.01f;
  Router r(c, 6, 5);
  r.randomize(11);
  r.forward();
  Tensor dp = testing::on_test_device(testing::randn({6, 6}, "test.router.dp"));
  Tensor dx = testing::on_test_device(Tensor::zeros({6, 5}, DType::f32, MemCategory::other));
  Tensor dw = testing::on_test_device(Tensor::zeros({6, 5}, DType::f32));
  router_backward(dx, dw, dp, r.x, r.w, r.cache, r.d, r.cfg, 1.0f, kCtx);
  const Tensor dx1 = dx.clone(), dw1 = dw.clone();
  router_backward(dx, dw, dp, r.x, r.w, r.cache, r.d, r.cfg, 1.0f, kCtx);
  const auto a = testing::to_vector(dx), b = testing::to_vector(dx1), p = testing::to_vector(dw),
             q = testing::to_vector(dw1);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], 2 * b[i]);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(p[i], 2 * q[i]);
}

// ---- finite differences --------------------------------------------------------------------------------
// Objective: sum(probs * Rm) + scale * weighted_loss, with probs read in double from the cache (kept pairs
// carry scale_factor * topk_w) so the fp64 router's precision survives. Every evaluation restarts from the
// same state (jitter noise, global_aux_loss counters). An element whose +h / -h evaluations pick different
// experts is skipped (a top-k boundary); at most two may be.
struct FdHarness {
  Router& r;
  RouterState base;
  Tensor Rm;  // [T, E] f32 on the test device (router_backward's dprobs)
  float scale = 0.7f;
  double objective(std::vector<int32_t>* sel) {
    r.st = clone_state(base);
    r.forward();
    const int64_t T = r.d.T, E = r.d.E, K = r.d.K;
    const double sf = r.cfg.topk_scaling_factor > 0 ? r.cfg.topk_scaling_factor : 1.0;
    const std::vector<int32_t> idx = values<int32_t>(r.cache.topk_idx);
    const std::vector<bool> kept = values<bool>(r.cache.topk_kept);
    const std::vector<double> w = values<double>(r.cache.topk_w);
    const std::vector<float> rm = values<float>(Rm);
    double f = scale * r.stats.weighted_loss;
    for (int64_t i = 0; i < T * K; ++i)
      if (kept[i]) f += sf * w[i] * rm[(i / K) * E + idx[i]];
    if (sel) {
      sel->assign(idx.begin(), idx.end());
      for (int64_t i = 0; i < T * K; ++i) sel->push_back(kept[i]);
    }
    return f;
  }
  // Perturbs param (any device) element by element through a host copy.
  void check(Tensor& param, const Tensor& analytic, const char* name, float h, double rtol, double atol) {
    Tensor ph = testing::host(param).clone();
    float* p = ph.data<float>();
    const auto an = testing::to_vector(analytic);
    auto eval = [&](std::vector<int32_t>* s) {
      param.copy_from(ph.to_device(param.device()));
      return objective(s);
    };
    int skipped = 0;
    for (int64_t i = 0; i < param.numel(); ++i) {
      const float orig = p[i];
      std::vector<int32_t> s0, s1;
      p[i] = orig + h;
      const double xp = p[i], fp = eval(&s0);
      p[i] = orig - h;
      const double xm = p[i], fm = eval(&s1);
      p[i] = orig;
      if (s0 != s1) {
        ++skipped;
        continue;
      }
      const double fd = (fp - fm) / (xp - xm);
      EXPECT_NEAR(an[i], fd, atol + rtol * std::fabs(fd)) << name << "[" << i << "]";
    }
    param.copy_from(ph.to_device(param.device()));
    EXPECT_LE(skipped, 2) << name;
  }
};

void fd_check(const MoeConfig& cfg, bool padding, const std::string& label, float h = 1e-3f, double rtol = 1e-4,
              double atol = 1e-6, bool router_bias = false) {
  SCOPED_TRACE(label);
  const int64_t T = 6, H = 5, B = 2;
  Router r(cfg, T, H, B);
  r.randomize(41);
  if (router_bias)
    r.w.bias = testing::on_test_device(testing::randn({cfg.num_experts}, "test.router.linear_bias", 0.5f));
  if (cfg.enable_expert_bias) fill_normal(r.st.expert_bias, 42, "test.router.bias", 0.3f);
  if (padding) r.pad = padding_mask(T, {4});
  if (cfg.uses(LoadBalancing::global_aux_loss)) {  // start from an earlier micro-batch's counts
    Tensor x0 = r.x.clone();
    fill_normal(r.x, 43, "test.router.x");
    r.forward();
    r.x.copy_from(x0);
  }
  FdHarness fd{r, clone_state(r.st), testing::on_test_device(testing::randn({T, cfg.num_experts}, "test.router.R"))};
  fd.objective(nullptr);
  const Device dev = testing::test_device();
  Tensor dx = Tensor::zeros({T, H}, DType::f32, MemCategory::other, dev);
  Tensor dw = Tensor::zeros({cfg.num_experts, H}, DType::f32, MemCategory::other, dev);
  Tensor db = router_bias ? Tensor::zeros({cfg.num_experts}, DType::f32, MemCategory::other, dev) : Tensor();
  router_backward(dx, dw, db, fd.Rm, r.x, r.w, r.cache, r.d, r.cfg, fd.scale, kCtx);
  EXPECT_GT(testing::sum_squares(dw), 0.0);
  fd.check(r.x, dx, "dx", h, rtol, atol);
  fd.check(r.w.weight, dw, "dweight", h, rtol, atol);
  if (router_bias) fd.check(r.w.bias, db, "dbias", h, rtol, atol);
}

struct Variant {
  const char* name;
  void (*apply)(MoeConfig&);
};
const Variant kRouting[] = {
    {"softmax_post", [](MoeConfig&) {}},
    {"softmax_pre", [](MoeConfig& c) { c.pre_softmax = true; }},
    {"softmax_post_groups", [](MoeConfig& c) { c.num_groups = 3, c.group_topk = 2; }},
    {"softmax_pre_groups_scaled",
     [](MoeConfig& c) { c.pre_softmax = true, c.num_groups = 3, c.group_topk = 2, c.topk_scaling_factor = 2.5f; }},
    {"sigmoid", [](MoeConfig& c) { c.score_function = ScoreFunction::sigmoid; }},
    {"sigmoid_bias_groups",
     [](MoeConfig& c) {
       c.score_function = ScoreFunction::sigmoid, c.enable_expert_bias = true, c.num_groups = 2, c.group_topk = 1;
     }},
    {"sigmoid_k1", [](MoeConfig& c) { c.score_function = ScoreFunction::sigmoid, c.router_topk = 1; }},
    {"sqrtsoftplus_bias",
     [](MoeConfig& c) { c.score_function = ScoreFunction::sqrtsoftplus, c.enable_expert_bias = true; }},
    {"sqrtsoftplus_k1_scaled",
     [](MoeConfig& c) {
       c.score_function = ScoreFunction::sqrtsoftplus, c.router_topk = 1, c.topk_scaling_factor = 1.5f;
     }},
    {"softmax_pre_capacity_probs", [](MoeConfig& c) { c.pre_softmax = true, c.capacity_factor = 0.6f; }},
    {"sigmoid_pad_capacity_position_aligned",
     [](MoeConfig& c) {
       c.score_function = ScoreFunction::sigmoid, c.capacity_factor = 0.6f, c.drop_policy = DropPolicy::position;
       c.pad_expert_input_to_capacity = true, c.router_padding_alignment = 4;
     }},
};

struct LossSet {
  const char* name;
  std::vector<LoadBalancing> types;
  std::vector<float> coeffs;
  float z;
  bool padding;
};
const LossSet kLosses[] = {
    {"no_loss", {LoadBalancing::none}, {0.0f}, 0.0f, false},
    {"aux", {LoadBalancing::aux_loss}, {0.3f}, 0.0f, false},
    {"seq_aux", {LoadBalancing::seq_aux_loss}, {0.3f}, 0.0f, false},
    {"global_aux", {LoadBalancing::global_aux_loss}, {0.3f}, 0.0f, false},
    {"z", {LoadBalancing::none}, {0.0f}, 0.05f, false},
    {"all_padded",
     {LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss, LoadBalancing::global_aux_loss},
     {0.5f, 1.0f, 2.0f},
     0.1f,
     true},
};

TEST(RouterGradients, FiniteDifferencesEveryRoutingWithEveryLoss) {
  for (const Variant& v : kRouting) {
    for (const LossSet& l : kLosses) {
      MoeConfig c = loss_config(l.types, l.coeffs);
      c.z_loss_coeff = l.z;
      v.apply(c);
      fd_check(c, l.padding, std::string(v.name) + " + " + l.name);
    }
  }
}

TEST(RouterGradients, FiniteDifferencesSinkhorn) {
  for (int64_t K : {1, 2}) {
    for (float z : {0.0f, 0.05f}) {
      MoeConfig c = loss_config({LoadBalancing::sinkhorn}, {0.0f}, 6, K);
      c.z_loss_coeff = z;
      fd_check(c, z > 0, "sinkhorn k=" + std::to_string(K) + " z=" + std::to_string(z));
    }
  }
}

// The router's linear bias (Megatron's add_bias_linear): logits = x W^T + b, dbias = column sums of dlogits.
TEST(RouterGradients, FiniteDifferencesWithLinearBias) {
  MoeConfig c = loss_config({LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss}, {0.3f, 0.5f});
  c.z_loss_coeff = 0.05f;
  fd_check(c, true, "softmax + aux + seq_aux + z, biased", 1e-3f, 1e-4, 1e-6, true);
  c.score_function = ScoreFunction::sigmoid;
  c.enable_expert_bias = true;
  c.capacity_factor = 0.6f;
  fd_check(c, false, "sigmoid + expert bias + capacity, biased", 1e-3f, 1e-4, 1e-6, true);
}

// A bias shifts the logits: routing x with bias b equals routing with a weight column that reads a constant
// input feature set to 1 (fp32 and fp64 routers; fp32 sums may round differently: 1e-6).
TEST(RouterGradients, LinearBiasEqualsAConstantInputFeature) {
  for (DType rd : {DType::f64, DType::f32}) {
    MoeConfig c = loss_config({LoadBalancing::aux_loss}, {0.3f}, 6, 2, rd);
    Router a(c, 7, 5), b(c, 7, 6);
    a.randomize(45);
    a.w.bias = testing::on_test_device(testing::randn({6}, "test.router.linear_bias", 0.5f));
    const std::vector<float> ax = values<float>(a.x), aw = values<float>(a.w.weight), ab = values<float>(a.w.bias);
    std::vector<float> bx(7 * 6), bw(6 * 6);
    for (int64_t t = 0; t < 7; ++t)
      for (int64_t j = 0; j < 6; ++j) bx[t * 6 + j] = j < 5 ? ax[t * 5 + j] : 1.0f;
    for (int64_t e = 0; e < 6; ++e)
      for (int64_t j = 0; j < 6; ++j) bw[e * 6 + j] = j < 5 ? aw[e * 5 + j] : ab[e];
    upload(b.x, bx);
    upload(b.w.weight, bw);
    a.forward();
    b.forward();
    EXPECT_TENSOR_NEAR(a.probs, b.probs, 1e-6, 1e-7);
    EXPECT_NEAR(a.stats.aux_loss, b.stats.aux_loss, 1e-6);
    auto zeros = [](const Shape& s) { return testing::on_test_device(Tensor::zeros(s, DType::f32)); };
    Tensor dp = testing::on_test_device(testing::randn({7, 6}, "test.router.dp"));
    Tensor dxa = zeros({7, 5}), dwa = zeros({6, 5}), dba = zeros({6});
    Tensor dxb = zeros({7, 6}), dwb = zeros({6, 6});
    router_backward(dxa, dwa, dba, dp, a.x, a.w, a.cache, a.d, a.cfg, 1.0f, kCtx);
    router_backward(dxb, dwb, dp, b.x, b.w, b.cache, b.d, b.cfg, 1.0f, kCtx);
    const std::vector<float> gba = values<float>(dba), gwa = values<float>(dwa), gwb = values<float>(dwb);
    for (int64_t e = 0; e < 6; ++e) {
      EXPECT_NEAR(gba[e], gwb[e * 6 + 5], 1e-6) << e;
      for (int64_t j = 0; j < 5; ++j) EXPECT_NEAR(gwa[e * 5 + j], gwb[e * 6 + j], 1e-6);
    }
  }
}

// Jitter: x_j = fl32(x * u) rounds, so the step is larger and the tolerance looser.
TEST(RouterGradients, FiniteDifferencesThroughJitter) {
  MoeConfig c = loss_config({LoadBalancing::aux_loss}, {0.3f});
  c.input_jitter_eps = 0.2f;
  c.z_loss_coeff = 0.05f;
  fd_check(c, false, "jitter softmax", 1e-2f, 2e-3, 2e-4);
  c.score_function = ScoreFunction::sigmoid;
  fd_check(c, false, "jitter sigmoid", 1e-2f, 2e-3, 2e-4);
}

// The f32 probs output is the cached weight times the scaling factor at kept pairs and 0 elsewhere, so the
// finite-difference objective above measures the same function router_forward returns.
TEST(RouterGradients, ProbsMatchCachedWeights) {
  MoeConfig c = loss_config({LoadBalancing::none}, {0.0f});
  c.pre_softmax = true;
  c.topk_scaling_factor = 2.0f;
  c.capacity_factor = 0.6f;
  c.pad_expert_input_to_capacity = true;
  Router r(c, 6, 5);
  r.randomize(44);
  r.forward();
  std::vector<float> expect(36, 0.0f);
  const std::vector<bool> kept = values<bool>(r.cache.topk_kept);
  const std::vector<int32_t> idx = values<int32_t>(r.cache.topk_idx);
  const std::vector<double> w = values<double>(r.cache.topk_w);
  for (int64_t i = 0; i < 12; ++i)
    if (kept[i]) expect[(i / 2) * 6 + idx[i]] = static_cast<float>(2.0 * w[i]);
  EXPECT_EQ(testing::to_vector(r.probs), expect);
  EXPECT_GT(r.stats.dropped, 0);
}

}  // namespace
}  // namespace moecore::moe
