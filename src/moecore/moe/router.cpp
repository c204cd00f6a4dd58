// The router's entry points (router.h): state, cache and statistics, entry checks, and the order of the
// forward and backward stages (docs/megatron-moe-spec.md §2.2). Each stage is an op: ops::gemm for the fp32 gating
// linear, the router ops of kernels/ops_router.h for everything else; the loss stage is in router_losses.cpp.
// Gradient contract: dweight, dbias and dx accumulate (+=); cache.dlogits is rewritten by every backward.
#include <algorithm>
#include <cmath>

#include "moecore/core/rng.h"
#include "moecore/moe/router_internal.h"

namespace moecore::moe {

using namespace router_detail;

namespace {

ops::RouterRouting routing_of(const MoeConfig& cfg, bool training) {
  ops::RouterRouting p;
  p.score_function = cfg.score_function;
  p.pre_softmax = cfg.pre_softmax;
  p.sinkhorn = cfg.uses(LoadBalancing::sinkhorn);
  p.training = training;
  p.num_groups = cfg.num_groups;
  p.group_topk = cfg.group_topk;
  p.group_score_k = cfg.num_groups > 0 ? cfg.group_score_k() : 0;
  p.scaling_factor = cfg.topk_scaling_factor;
  return p;
}

ops::RouterCapacity capacity_of(const RouterDims& d, const MoeConfig& cfg) {
  const int64_t cap = cfg.capacity_factor > 0 ? expert_capacity(d.T * d.K, d.E, cfg.capacity_factor) : 0;
  return {cap, cfg.drop_policy, cfg.pad_expert_input_to_capacity};
}

// fp32 router: the two products on ops::gemm. A bf16 or f16 x_j is widened chunk by chunk into cache.work (gemm needs
// one operand dtype and dlogits stays f32, as Megatron's router-dtype backward does).
void gating_backward_f32(Tensor& dx, Tensor& dweight, const Tensor& xj, const Tensor& weight, RouterCache& c,
                         bool jitter, const ops::Context& ctx) {
  const int64_t T = xj.size(0);
  const Tensor& dl = c.dlogits;
  if (xj.dtype() == DType::f32) {
    ops::gemm(dweight, dl, true, xj, false, 1.0f, 1.0f, ctx);
  } else {
    for (int64_t r0 = 0; r0 < T; r0 += kWorkRows) {
      const int64_t n = std::min(kWorkRows, T - r0);
      Tensor wk = c.work.slice(0, 0, n);
      wk.copy_from(xj.slice(0, r0, r0 + n));  // bf16 / f16 -> f32 is exact
      ops::gemm(dweight, dl.slice(0, r0, r0 + n), true, wk, false, 1.0f, 1.0f, ctx);
    }
  }
  if (!jitter) {
    ops::gemm(dx, dl, false, weight, false, 1.0f, 1.0f, ctx);
    return;
  }
  for (int64_t r0 = 0; r0 < T; r0 += kWorkRows) {
    const int64_t n = std::min(kWorkRows, T - r0);
    Tensor wk = c.work.slice(0, 0, n);
    ops::gemm(wk, dl.slice(0, r0, r0 + n), false, weight, false, 1.0f, 0.0f, ctx);
    Tensor dxs = dx.slice(0, r0, r0 + n);
    ops::router_jitter_backward(dxs, wk, c.jitter.slice(0, r0, r0 + n), ctx);
  }
}

// Checks shared by forward and backward; returns the weight the fp32 gating GEMM multiplies x by.
const Tensor& check_common(const ArgCheck& chk, const Tensor& x, const RouterWeights& w, const RouterDims& d,
                           const MoeConfig& cfg) {
  if (cfg.router_dtype != DType::f32 && cfg.router_dtype != DType::f64)
    chk.fail("router dtype (--moe-router-dtype) must be f32 or f64, got ", dtype_name(cfg.router_dtype));
  if (d.T <= 0 || d.H <= 0 || d.E <= 0 || d.K <= 0 || d.K > d.E || d.B <= 0 || d.T % d.B != 0)
    chk.fail("bad dims T=", d.T, " B=", d.B, " H=", d.H, " E=", d.E, " K=", d.K,
             " (need T, H, E > 0, 1 <= K <= E, T divisible by B)");
  if (d.E != cfg.num_experts || d.K != cfg.router_topk)
    chk.fail("dims E=", d.E, ", K=", d.K, " disagree with --num-experts (", cfg.num_experts,
             ") and --moe-router-topk (", cfg.router_topk, ")");
  if (!x.defined()) chk.fail("x is undefined");
  if (x.dtype() != DType::f32 && x.dtype() != DType::bf16 && x.dtype() != DType::f16)
    chk.fail("x must be f32, bf16 or f16, got ", dtype_name(x.dtype()));
  chk.tensor("x", x, Shape{d.T, d.H}, x.dtype());
  chk.tensor("weight", w.weight, Shape{d.E, d.H}, DType::f32);
  if (w.bias.defined()) chk.tensor("bias", w.bias, Shape{d.E}, DType::f32);
  if (cfg.router_dtype != DType::f32) return w.weight;
  if (!w.weight_compute.defined()) {
    if (x.dtype() != DType::f32) chk.fail("weight_compute is undefined but x is ", dtype_name(x.dtype()));
    return w.weight;
  }
  chk.tensor("weight_compute", w.weight_compute, Shape{d.E, d.H}, x.dtype());
  return w.weight_compute;
}

void check_state_and_stats(const ArgCheck& chk, const RouterState& st, const RouterStats& stats, const RouterDims& d,
                           const MoeConfig& cfg) {
  if (!st.local_tokens_per_expert.defined() || !st.global_tokens_per_expert.defined())
    chk.fail("the router state has no counters (create it with router_state_init)");
  chk.tensor("state.local_tokens_per_expert", st.local_tokens_per_expert, Shape{d.E}, DType::i64);
  chk.tensor("state.global_tokens_per_expert", st.global_tokens_per_expert, Shape{d.E}, DType::i64);
  if (cfg.enable_expert_bias) chk.tensor("state.expert_bias", st.expert_bias, Shape{d.E}, DType::f32);
  if (cfg.coeff(LoadBalancing::global_aux_loss) > 0)
    chk.tensor("state.global_aux_counts", st.global_aux_counts, Shape{d.E + 1}, DType::i64);
  if (!stats.tokens_per_expert.defined() || !stats.losses.defined() || !stats.dropped.defined())
    chk.fail("the router statistics are not allocated (create them with router_stats_alloc)");
  chk.tensor("stats.tokens_per_expert", stats.tokens_per_expert, Shape{d.E}, DType::i64);
  chk.tensor("stats.losses", stats.losses, Shape{ops::router_loss::count}, DType::f64);
  chk.tensor("stats.dropped", stats.dropped, Shape{1}, DType::i64);
}

void forward_stages(Tensor& probs, Tensor& map, RouterStats& stats, const Tensor& x, const Tensor& padding,
                    const Tensor& wc, const RouterWeights& w, RouterState& st, RouterCache& c, const RouterDims& d,
                    const MoeConfig& cfg, bool training, const ops::Context& ctx) {
  const uint64_t calls = static_cast<uint64_t>(st.calls);
  // Each layer draws its own noise: the stream id (the layer number) is folded into the seed.
  const uint64_t seed = cfg.seed + st.stream * 0x9E3779B97F4A7C15ull;
  const Tensor* xj = &x;
  if (cfg.input_jitter_eps > 0) {  // applied in evaluation too, as Megatron does
    ops::router_jitter_forward(c.x_jittered, c.jitter, x, cfg.input_jitter_eps, philox_key(seed, "router.jitter"),
                               calls * static_cast<uint64_t>(d.T * d.H), ctx);
    xj = &c.x_jittered;
  }
  if (cfg.force_load_balancing || cfg.force_biased != 0) {
    // Random N(0, 1) logits; backward passes their gradient straight through to the real gating linear,
    // whose output is never needed, so it is not computed.
    ops::router_normal_logits(c.logits, philox_key(seed, "router.force_load_balancing"),
                              calls * static_cast<uint64_t>(d.T * d.E), ctx);
    if (cfg.force_biased != 0) {  // plus the layer's skew, the same on every rank (also straight through)
      ops::router_normal_logits(c.forced_bias, philox_key(seed, "router.force_biased"),
                                cfg.force_biased > 0 ? calls * static_cast<uint64_t>(d.E) : 0, ctx);
      ops::scale(c.forced_bias, std::fabs(cfg.force_biased), ctx);
      ops::bias_add(c.logits, c.forced_bias.view({d.E}), ctx);
    }
  } else if (cfg.router_dtype == DType::f32) {
    ops::gemm(c.logits, *xj, false, wc, true, 1.0f, 0.0f, ctx);
    if (w.bias.defined()) ops::bias_add(c.logits, w.bias, ctx);
  } else {
    ops::router_gating_f64(c.logits, *xj, w.weight, w.bias, ctx);
  }
  // The sparse routing weights go to the backward workspace (free during forward) until capacity reads them.
  const Tensor none;
  ops::router_route(c.scores, c.topk_idx, c.topk_w, c.dlogits, map, c.logits,
                    cfg.enable_expert_bias ? st.expert_bias : none, routing_of(cfg, training), ctx);
  ops::router_capacity(probs, map, c.topk_kept, stats.dropped, c.dlogits, c.topk_idx, capacity_of(d, cfg), ctx);
  // Expert-bias counts see the map after capacity and before the dispatcher-level alignment padding.
  if (training && cfg.enable_expert_bias)
    ops::router_map_counts(st.local_tokens_per_expert, map, padding, /*accumulate=*/true, ctx);
  if (cfg.router_padding_alignment > 0) ops::router_pad_map(map, cfg.router_padding_alignment, ctx);
  ops::router_map_counts(stats.tokens_per_expert, map, none, /*accumulate=*/false, ctx);
  stats.losses.zero_();
  if (training) {
    router_losses(stats, st, c, padding, d, cfg, ctx);
  } else {
    c.dlogits_loss.zero_();
  }
  st.calls += 1;
}

}  // namespace

bool router_detail::router_needs_work(const MoeConfig& cfg, DType x_dtype) {
  return cfg.router_dtype == DType::f32 && (x_dtype != DType::f32 || cfg.input_jitter_eps > 0);
}

void router_detail::check_cache(const ArgCheck& chk, const RouterCache& c, const RouterDims& d, const MoeConfig& cfg,
                                DType x_dtype) {
  const DType R = cfg.router_dtype;
  const Shape te{d.T, d.E}, tk{d.T, d.K}, th{d.T, d.H};
  chk.tensor("cache.logits", c.logits, te, R);
  chk.tensor("cache.scores", c.scores, te, R);
  chk.tensor("cache.topk_idx", c.topk_idx, tk, DType::i32);
  chk.tensor("cache.topk_w", c.topk_w, tk, R);
  chk.tensor("cache.topk_kept", c.topk_kept, tk, DType::boolean);
  chk.tensor("cache.dlogits_loss", c.dlogits_loss, te, R);
  chk.tensor("cache.dlogits", c.dlogits, te, R);
  if (cfg.input_jitter_eps > 0) {
    chk.tensor("cache.jitter", c.jitter, th, DType::f32);
    chk.tensor("cache.x_jittered", c.x_jittered, th, x_dtype);
  }
  if (router_needs_work(cfg, x_dtype))
    chk.tensor("cache.work", c.work, Shape{std::min(d.T, kWorkRows), d.H}, DType::f32);
}

double RouterStatsHost::max_over_mean_load() const {
  int64_t sum = 0, mx = 0;
  for (int64_t c : tokens_per_expert) sum += c, mx = std::max(mx, c);
  if (sum == 0) return 0.0;
  return static_cast<double>(mx) * static_cast<double>(tokens_per_expert.size()) / static_cast<double>(sum);
}

RouterStats router_stats_alloc(int64_t E, Device device) {
  if (E <= 0) MOECORE_FAIL("router_stats_alloc: E = ", E, " experts (need at least one)");
  const MemCategory act = MemCategory::activations;
  RouterStats s;
  s.tokens_per_expert = Tensor::zeros({E}, DType::i64, act, device);
  s.losses = Tensor::zeros({ops::router_loss::count}, DType::f64, act, device);
  s.dropped = Tensor::zeros({1}, DType::i64, act, device);
  return s;
}

RouterStatsHost router_stats_host(const RouterStats& s) {
  if (!s.tokens_per_expert.defined() || !s.losses.defined() || !s.dropped.defined())
    MOECORE_FAIL("router_stats_host: the statistics are not allocated (create them with router_stats_alloc)");
  double l[ops::router_loss::count];
  s.losses.copy_to_host(l, ops::router_loss::count);
  RouterStatsHost h;
  h.aux_loss = l[ops::router_loss::aux];
  h.seq_aux_loss = l[ops::router_loss::seq_aux];
  h.global_aux_loss = l[ops::router_loss::global_aux];
  h.z_loss = l[ops::router_loss::z];
  h.weighted_loss = l[ops::router_loss::weighted];
  h.tokens_per_expert.resize(static_cast<size_t>(s.tokens_per_expert.numel()));
  s.tokens_per_expert.copy_to_host(h.tokens_per_expert.data(), s.tokens_per_expert.numel());
  s.dropped.copy_to_host(&h.dropped, 1);
  return h;
}

RouterState router_state_init(const MoeConfig& cfg, Device device) {
  RouterState st;
  const int64_t E = cfg.num_experts;
  if (cfg.enable_expert_bias) st.expert_bias = Tensor::zeros({E}, DType::f32, MemCategory::parameters, device);
  st.local_tokens_per_expert = Tensor::zeros({E}, DType::i64, MemCategory::other, device);
  st.global_tokens_per_expert = Tensor::zeros({E}, DType::i64, MemCategory::other, device);
  if (cfg.coeff(LoadBalancing::global_aux_loss) > 0)
    st.global_aux_counts = Tensor::zeros({E + 1}, DType::i64, MemCategory::other, device);
  return st;
}

int64_t router_state_bytes(const RouterState& st) {
  int64_t n = 0;
  for (const Tensor* t : {&st.local_tokens_per_expert, &st.global_tokens_per_expert, &st.global_aux_counts})
    n += t->defined() ? t->nbytes() : 0;
  return n;
}

void router_finish_step(RouterState& st, const MoeConfig& cfg, bool update_bias, const ops::Context& ctx) {
  if (update_bias && cfg.enable_expert_bias && st.expert_bias.defined())
    ops::router_expert_bias_update(st.expert_bias, st.local_tokens_per_expert, cfg.bias_update_rate, ctx);
  st.local_tokens_per_expert.zero_();
  st.global_tokens_per_expert.zero_();
  st.global_aux_steps = 0;
}

RouterCache router_cache_alloc(const RouterDims& d, const MoeConfig& cfg, DType x_dtype, Device device) {
  const DType R = cfg.router_dtype;
  if (R != DType::f32 && R != DType::f64)
    MOECORE_FAIL("router_cache_alloc: router dtype (--moe-router-dtype) must be f32 or f64, got ", dtype_name(R));
  if (x_dtype != DType::f32 && x_dtype != DType::bf16 && x_dtype != DType::f16)
    MOECORE_FAIL("router_cache_alloc: x dtype must be f32, bf16 or f16, got ", dtype_name(x_dtype));
  const MemCategory act = MemCategory::activations, ws = MemCategory::workspace;
  RouterCache c;
  c.logits = Tensor::empty({d.T, d.E}, R, act, device);
  c.scores = Tensor::empty({d.T, d.E}, R, act, device);
  c.topk_idx = Tensor::empty({d.T, d.K}, DType::i32, act, device);
  c.topk_w = Tensor::empty({d.T, d.K}, R, act, device);
  c.topk_kept = Tensor::empty({d.T, d.K}, DType::boolean, act, device);
  c.dlogits_loss = Tensor::zeros({d.T, d.E}, R, act, device);
  c.dlogits = Tensor::empty({d.T, d.E}, R, ws, device);
  if (cfg.input_jitter_eps > 0) {
    c.x_jittered = Tensor::empty({d.T, d.H}, x_dtype, act, device);
    c.jitter = Tensor::empty({d.T, d.H}, DType::f32, act, device);
  }
  if (cfg.force_biased != 0) c.forced_bias = Tensor::empty({1, d.E}, DType::f32, ws, device);
  if (router_needs_work(cfg, x_dtype)) c.work = Tensor::empty({std::min(d.T, kWorkRows), d.H}, DType::f32, ws, device);
  if (d.sequence_size() > 1) {
    const int64_t all = d.sequence_size() * d.T;
    c.logits_all = Tensor::empty({all, d.E}, R, ws, device);
    c.dlogits_loss_all = Tensor::empty({all, d.E}, R, ws, device);
    c.dlogits_all = Tensor::empty({all, d.E}, R, ws, device);
    c.padding_all = Tensor::empty({all}, DType::boolean, ws, device);
  }
  return c;
}

void router_forward(Tensor& probs, Tensor& map, RouterStats& stats, const Tensor& x, const Tensor& padding_mask,
                    const RouterWeights& w, RouterState& st, RouterCache& cache, const RouterDims& d,
                    const MoeConfig& cfg, bool training, const ops::Context& ctx) {
  const ArgCheck chk("router_forward", ctx.device,
                     {{"probs", &probs},
                      {"map", &map},
                      {"x", &x},
                      {"padding_mask", &padding_mask},
                      {"weight", &w.weight},
                      {"weight_compute", &w.weight_compute}});
  const Tensor& wc = check_common(chk, x, w, d, cfg);
  chk.tensor("probs", probs, Shape{d.T, d.E}, DType::f32);
  chk.tensor("map", map, Shape{d.T, d.E}, DType::boolean);
  if (padding_mask.defined()) chk.tensor("padding_mask", padding_mask, Shape{d.T}, DType::boolean);
  check_state_and_stats(chk, st, stats, d, cfg);
  check_cache(chk, cache, d, cfg, x.dtype());
  forward_stages(probs, map, stats, x, padding_mask, wc, w, st, cache, d, cfg, training, ctx);
}

void router_backward(Tensor& dx, Tensor& dweight, Tensor& dbias, const Tensor& dprobs, const Tensor& x,
                     const RouterWeights& w, RouterCache& cache, const RouterDims& d, const MoeConfig& cfg,
                     float aux_grad_scale, const ops::Context& ctx) {
  const ArgCheck chk("router_backward", ctx.device,
                     {{"dx", &dx},
                      {"dweight", &dweight},
                      {"dprobs", &dprobs},
                      {"x", &x},
                      {"weight", &w.weight},
                      {"weight_compute", &w.weight_compute}});
  check_common(chk, x, w, d, cfg);
  chk.tensor("dx", dx, Shape{d.T, d.H}, DType::f32);
  chk.tensor("dweight", dweight, Shape{d.E, d.H}, DType::f32);
  chk.tensor("dprobs", dprobs, Shape{d.T, d.E}, DType::f32);
  if (w.bias.defined()) chk.tensor("dbias", dbias, Shape{d.E}, DType::f32);
  check_cache(chk, cache, d, cfg, x.dtype());
  const bool jitter = cfg.input_jitter_eps > 0;
  const Tensor& xj = jitter ? cache.x_jittered : x;
  ops::router_route_backward(cache.dlogits, dprobs, cache.logits, cache.scores, cache.topk_idx, cache.topk_w,
                             cache.topk_kept, cache.dlogits_loss, routing_of(cfg, true), aux_grad_scale, ctx);
  if (cfg.router_dtype == DType::f64) {
    const Tensor none;
    ops::router_gating_f64_backward(dx, dweight, cache.dlogits, xj, w.weight, jitter ? cache.jitter : none, ctx);
    if (w.bias.defined()) ops::router_gating_f64_bias_grad(dbias, cache.dlogits, ctx);
  } else {
    gating_backward_f32(dx, dweight, xj, w.weight, cache, jitter, ctx);
    if (w.bias.defined()) ops::bias_grad(dbias, cache.dlogits, ctx);
  }
}

}  // namespace moecore::moe
