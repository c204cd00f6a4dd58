// The router's entry points (router.h): state, cache, entry checks, input jitter, the gating linear
// (ops::gemm for the fp32 router, a plain double loop for fp64) and its backward, and the order of the
// forward stages (spec §2.2). Routing itself lives in router_topk.cpp, the losses in router_losses.cpp.
// Gradient contract: dweight, dbias and dx accumulate (+=); cache.dlogits is rewritten by every backward.
#include <algorithm>
#include <type_traits>

#include "moecore/core/rng.h"
#include "moecore/moe/router_internal.h"

namespace moecore::moe {

using namespace router_detail;

namespace {

constexpr int64_t kWorkRows = 1024;  // rows of cache.work: a chunk of x widened to f32, or of dlogits @ W

template <class Fn>
decltype(auto) with_x_type(DType t, Fn&& fn) {
  if (t == DType::bf16) return fn(bf16{});
  return fn(float{});
}

// x_j = x * u, u ~ U(1 - eps, 1 + eps) from element st.calls * T * H + i of the "router.jitter" stream, kept
// in f32 for backward (Megatron draws u in x's dtype; f32 keeps small eps meaningful for bf16 x).
template <class X>
void jitter_forward(X* xj, float* u, const X* x, int64_t n, uint64_t seed, uint64_t first, float eps) {
  const PhiloxKey key = philox_key(seed, "router.jitter");
#pragma omp parallel for schedule(static) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float r = (1.0f - eps) + 2.0f * eps * philox_uniform(key, first + static_cast<uint64_t>(i));
    u[i] = r;
    from_float(xj[i], to_float(x[i]) * r);
  }
}

// logits[t, e] = sum_h x[t, h] w[e, h] (+ b[e]) in double (fp64 router; the f32 master weight is widened).
template <class X>
void gating_f64(double* logits, const X* x, const float* w, const float* b, int64_t T, int64_t H, int64_t E) {
#pragma omp parallel for schedule(static) if (T * E * H > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    double* xr = scratch<double, 30>(static_cast<size_t>(H));
    for (int64_t h = 0; h < H; ++h) xr[h] = to_float(x[t * H + h]);
    for (int64_t e = 0; e < E; ++e) {
      const float* wr = w + e * H;
      double acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t h = 0; h < H; ++h) acc += xr[h] * static_cast<double>(wr[h]);
      logits[t * E + e] = b ? acc + static_cast<double>(b[e]) : acc;
    }
  }
}

// dweight += dl^T x_j and dx += (dl W) * u, accumulated in double per output element (fp64 router).
// dweight takes experts in blocks of 8 so x_j streams through once per block; both products fold four
// terms per accumulator update (a load-store per FMA would bound the loop).
template <class X>
void gating_backward_f64(float* dx, float* dw, const double* dl, const X* xj, const float* w, const float* u, int64_t T,
                         int64_t H, int64_t E) {
  constexpr int64_t kEb = 8;
  const int64_t blocks = (E + kEb - 1) / kEb;
#pragma omp parallel for schedule(static) if (T * E * H > kParallelWork)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t e0 = blk * kEb, ne = std::min(kEb, E - e0);
    double* acc = scratch<double, 31>(static_cast<size_t>(kEb * H));
    double* xr = scratch<double, 33>(static_cast<size_t>(4 * H));
    std::fill(acc, acc + ne * H, 0.0);
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
      const int64_t nt = std::min<int64_t>(4, T - t0);
      for (int64_t i = 0; i < 4 * H; ++i) xr[i] = i < nt * H ? static_cast<double>(to_float(xj[t0 * H + i])) : 0.0;
      for (int64_t k = 0; k < ne; ++k) {
        double a[4] = {};
        for (int64_t j = 0; j < nt; ++j) a[j] = dl[(t0 + j) * E + e0 + k];
        double* ak = acc + k * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h)
          ak[h] += a[0] * xr[h] + a[1] * xr[H + h] + a[2] * xr[2 * H + h] + a[3] * xr[3 * H + h];
      }
    }
    for (int64_t k = 0; k < ne; ++k)
      for (int64_t h = 0; h < H; ++h) dw[(e0 + k) * H + h] += static_cast<float>(acc[k * H + h]);
  }
#pragma omp parallel for schedule(static) if (T * E * H > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    double* acc = scratch<double, 32>(static_cast<size_t>(H));
    std::fill(acc, acc + H, 0.0);
    int64_t e = 0;
    for (; e + 4 <= E; e += 4) {
      const double a0 = dl[t * E + e], a1 = dl[t * E + e + 1], a2 = dl[t * E + e + 2], a3 = dl[t * E + e + 3];
      const float *w0 = w + e * H, *w1 = w0 + H, *w2 = w1 + H, *w3 = w2 + H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h)
        acc[h] += a0 * static_cast<double>(w0[h]) + a1 * static_cast<double>(w1[h]) + a2 * static_cast<double>(w2[h]) +
                  a3 * static_cast<double>(w3[h]);
    }
    for (; e < E; ++e) {
      const double a = dl[t * E + e];
      const float* wr = w + e * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) acc[h] += a * static_cast<double>(wr[h]);
    }
    for (int64_t h = 0; h < H; ++h)
      dx[t * H + h] += static_cast<float>(u ? acc[h] * static_cast<double>(u[t * H + h]) : acc[h]);
  }
}

// dbias[e] += sum_t dl[t, e], in double and token order (fp64 router; the fp32 one uses ops::bias_grad).
void gating_bias_grad_f64(float* db, const double* dl, int64_t T, int64_t E) {
  double* acc = scratch<double, 34>(static_cast<size_t>(E));
  std::fill(acc, acc + E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) acc[e] += dl[t * E + e];
  for (int64_t e = 0; e < E; ++e) db[e] += static_cast<float>(acc[e]);
}

// fp32 router: the same two products on ops::gemm. A bf16 x_j is widened chunk by chunk into cache.work
// (gemm needs one operand dtype and dlogits stays f32, as Megatron's router-dtype backward does).
void gating_backward_f32(Tensor& dx, Tensor& dweight, const Tensor& xj, const Tensor& weight, RouterCache& c,
                         bool jitter, const ops::Context& ctx) {
  const int64_t T = xj.size(0), H = xj.size(1);
  const Tensor& dl = c.dlogits;
  if (xj.dtype() == DType::f32) {
    ops::gemm(dweight, dl, true, xj, false, 1.0f, 1.0f, ctx);
  } else {
    for (int64_t r0 = 0; r0 < T; r0 += kWorkRows) {
      const int64_t n = std::min(kWorkRows, T - r0);
      Tensor wk = c.work.slice(0, 0, n);
      float* wp = wk.data<float>();
      const bf16* xp = xj.data<bf16>() + r0 * H;
#pragma omp parallel for simd schedule(static) if (n * H > kParallelWork)
      for (int64_t i = 0; i < n * H; ++i) wp[i] = bf16_to_float(xp[i]);
      ops::gemm(dweight, dl.slice(0, r0, r0 + n), true, wk, false, 1.0f, 1.0f, ctx);
    }
  }
  if (!jitter) {
    ops::gemm(dx, dl, false, weight, false, 1.0f, 1.0f, ctx);
    return;
  }
  const float* u = c.jitter.data<float>();
  float* dxp = dx.data<float>();
  for (int64_t r0 = 0; r0 < T; r0 += kWorkRows) {
    const int64_t n = std::min(kWorkRows, T - r0);
    Tensor wk = c.work.slice(0, 0, n);
    ops::gemm(wk, dl.slice(0, r0, r0 + n), false, weight, false, 1.0f, 0.0f, ctx);
    const float* wp = wk.data<float>();
    const int64_t off = r0 * H;
#pragma omp parallel for simd schedule(static) if (n * H > kParallelWork)
    for (int64_t i = 0; i < n * H; ++i) dxp[off + i] += wp[i] * u[off + i];
  }
}

// Checks shared by forward and backward; returns the weight the fp32 gating GEMM multiplies x by.
const Tensor& check_common(const ArgCheck& chk, const Tensor& x, const RouterWeights& w, const RouterDims& d,
                           const MoeConfig& cfg, const ops::Context& ctx) {
  if (ctx.device != Device::cpu) chk.fail("called with a CUDA context, but the router has only the CPU backend");
  if (cfg.router_dtype != DType::f32 && cfg.router_dtype != DType::f64)
    chk.fail("router dtype (--moe-router-dtype) must be f32 or f64, got ", dtype_name(cfg.router_dtype));
  if (d.T <= 0 || d.H <= 0 || d.E <= 0 || d.K <= 0 || d.K > d.E || d.B <= 0 || d.T % d.B != 0)
    chk.fail("bad dims T=", d.T, " B=", d.B, " H=", d.H, " E=", d.E, " K=", d.K,
             " (need T, H, E > 0, 1 <= K <= E, T divisible by B)");
  if (d.E != cfg.num_experts || d.K != cfg.router_topk)
    chk.fail("dims E=", d.E, ", K=", d.K, " disagree with --num-experts (", cfg.num_experts,
             ") and --moe-router-topk (", cfg.router_topk, ")");
  if (!x.defined()) chk.fail("x is undefined");
  if (x.dtype() != DType::f32 && x.dtype() != DType::bf16)
    chk.fail("x must be f32 or bf16, got ", dtype_name(x.dtype()));
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

template <class R>
void forward_impl(Tensor& probs, Tensor& map, RouterStats& stats, const Tensor& x, const bool* padding,
                  const Tensor& wc, const RouterWeights& w, RouterState& st, RouterCache& c, const RouterDims& d,
                  const MoeConfig& cfg, bool training, const ops::Context& ctx) {
  const int64_t T = d.T, H = d.H, E = d.E;
  const uint64_t calls = static_cast<uint64_t>(st.calls);
  // Each layer draws its own noise: the stream id (the layer number) is folded into the seed.
  const uint64_t seed = cfg.seed + st.stream * 0x9E3779B97F4A7C15ull;
  const Tensor* xj = &x;
  if (cfg.input_jitter_eps > 0) {  // applied in evaluation too, as Megatron does
    with_x_type(x.dtype(), [&](auto tag) {
      using X = decltype(tag);
      jitter_forward(c.x_jittered.data<X>(), c.jitter.data<float>(), x.data<X>(), T * H, seed,
                     calls * static_cast<uint64_t>(T * H), cfg.input_jitter_eps);
    });
    xj = &c.x_jittered;
  }
  if (cfg.force_load_balancing) {
    // Random N(0, 1) logits; backward passes their gradient straight through to the real gating linear,
    // whose output is never needed, so it is not computed.
    const PhiloxKey key = philox_key(seed, "router.force_load_balancing");
    R* lp = c.logits.data<R>();
    const uint64_t first = calls * static_cast<uint64_t>(T * E);
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
    for (int64_t i = 0; i < T * E; ++i) lp[i] = R(philox_normal(key, first + static_cast<uint64_t>(i)));
  } else if constexpr (std::is_same_v<R, float>) {
    ops::gemm(c.logits, *xj, false, wc, true, 1.0f, 0.0f, ctx);
    if (w.bias.defined()) ops::bias_add(c.logits, w.bias, ctx);
  } else {
    with_x_type(x.dtype(), [&](auto tag) {
      using X = decltype(tag);
      gating_f64(c.logits.data<double>(), xj->data<X>(), w.weight.data<float>(),
                 w.bias.defined() ? w.bias.data<float>() : nullptr, T, H, E);
    });
  }
  route_tokens<R>(c, map, st, d, cfg, training);
  stats.dropped = route_capacity<R>(probs, map, c, d, cfg);
  // Expert-bias counts see the map after capacity and before the dispatcher-level alignment padding.
  if (training && cfg.enable_expert_bias) map_column_counts(st.local_tokens_per_expert.data(), map, padding, T, E);
  if (cfg.router_padding_alignment > 0) pad_routing_map(map, T, E, cfg.router_padding_alignment);
  stats.tokens_per_expert.assign(static_cast<size_t>(E), 0);
  map_column_counts(stats.tokens_per_expert.data(), map, nullptr, T, E);
  stats.aux_loss = stats.seq_aux_loss = stats.global_aux_loss = stats.z_loss = stats.weighted_loss = 0;
  if (training) {
    router_losses<R>(stats, st, c, padding, d, cfg);
  } else {
    c.dlogits_loss.zero_();
  }
  st.calls += 1;
}

}  // namespace

bool router_detail::router_needs_work(const MoeConfig& cfg, DType x_dtype) {
  return cfg.router_dtype == DType::f32 && (x_dtype == DType::bf16 || cfg.input_jitter_eps > 0);
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

double RouterStats::max_over_mean_load() const {
  int64_t sum = 0, mx = 0;
  for (int64_t c : tokens_per_expert) sum += c, mx = std::max(mx, c);
  if (sum == 0) return 0.0;
  return static_cast<double>(mx) * static_cast<double>(tokens_per_expert.size()) / static_cast<double>(sum);
}

RouterState router_state_init(const MoeConfig& cfg) {
  RouterState st;
  const int64_t E = cfg.num_experts;
  if (cfg.enable_expert_bias) st.expert_bias = Tensor::zeros({E}, DType::f32, MemCategory::parameters);
  st.local_tokens_per_expert.assign(static_cast<size_t>(E), 0);
  st.global_tokens_per_expert.assign(static_cast<size_t>(E), 0);
  return st;
}

void router_finish_step(RouterState& st, const MoeConfig& cfg, bool update_bias) {
  const int64_t E = static_cast<int64_t>(st.local_tokens_per_expert.size());
  if (update_bias && cfg.enable_expert_bias && st.expert_bias.defined()) {
    MOECORE_CHECK(st.expert_bias.numel() == E && st.expert_bias.dtype() == DType::f32,
                  "router_finish_step: expert_bias ", st.expert_bias.str(), " for ", E, " experts");
    int64_t total = 0;
    for (int64_t n : st.local_tokens_per_expert) total += n;
    float* bias = st.expert_bias.data<float>();
    // sign(mean - c_e) = sign(total - E * c_e), exact in integers, so a tie leaves the bias alone.
    for (int64_t e = 0; e < E; ++e) {
      const int64_t diff = total - E * st.local_tokens_per_expert[e];
      const float sgn = diff > 0 ? 1.0f : (diff < 0 ? -1.0f : 0.0f);
      bias[e] += cfg.bias_update_rate * sgn;
    }
  }
  std::fill(st.local_tokens_per_expert.begin(), st.local_tokens_per_expert.end(), 0);
  std::fill(st.global_tokens_per_expert.begin(), st.global_tokens_per_expert.end(), 0);
  st.global_aux_steps = 0;
}

RouterCache router_cache_alloc(const RouterDims& d, const MoeConfig& cfg, DType x_dtype) {
  const DType R = cfg.router_dtype;
  if (R != DType::f32 && R != DType::f64)
    MOECORE_FAIL("router_cache_alloc: router dtype (--moe-router-dtype) must be f32 or f64, got ", dtype_name(R));
  if (x_dtype != DType::f32 && x_dtype != DType::bf16)
    MOECORE_FAIL("router_cache_alloc: x dtype must be f32 or bf16, got ", dtype_name(x_dtype));
  const MemCategory act = MemCategory::activations, ws = MemCategory::workspace;
  RouterCache c;
  c.logits = Tensor::empty({d.T, d.E}, R, act);
  c.scores = Tensor::empty({d.T, d.E}, R, act);
  c.topk_idx = Tensor::empty({d.T, d.K}, DType::i32, act);
  c.topk_w = Tensor::empty({d.T, d.K}, R, act);
  c.topk_kept = Tensor::empty({d.T, d.K}, DType::boolean, act);
  c.dlogits_loss = Tensor::zeros({d.T, d.E}, R, act);
  c.dlogits = Tensor::empty({d.T, d.E}, R, ws);
  if (cfg.input_jitter_eps > 0) {
    c.x_jittered = Tensor::empty({d.T, d.H}, x_dtype, act);
    c.jitter = Tensor::empty({d.T, d.H}, DType::f32, act);
  }
  if (router_needs_work(cfg, x_dtype)) c.work = Tensor::empty({std::min(d.T, kWorkRows), d.H}, DType::f32, ws);
  return c;
}

void router_forward(Tensor& probs, Tensor& map, RouterStats& stats, const Tensor& x, const Tensor& padding_mask,
                    const RouterWeights& w, RouterState& st, RouterCache& cache, const RouterDims& d,
                    const MoeConfig& cfg, bool training, const ops::Context& ctx) {
  const ArgCheck chk("router_forward", {{"probs", &probs},
                                        {"map", &map},
                                        {"x", &x},
                                        {"padding_mask", &padding_mask},
                                        {"weight", &w.weight},
                                        {"weight_compute", &w.weight_compute}});
  const Tensor& wc = check_common(chk, x, w, d, cfg, ctx);
  chk.tensor("probs", probs, Shape{d.T, d.E}, DType::f32);
  chk.tensor("map", map, Shape{d.T, d.E}, DType::boolean);
  if (padding_mask.defined()) chk.tensor("padding_mask", padding_mask, Shape{d.T}, DType::boolean);
  if (cfg.enable_expert_bias) chk.tensor("state.expert_bias", st.expert_bias, Shape{d.E}, DType::f32);
  if (static_cast<int64_t>(st.local_tokens_per_expert.size()) != d.E ||
      static_cast<int64_t>(st.global_tokens_per_expert.size()) != d.E)
    chk.fail("router state counters have ", st.local_tokens_per_expert.size(), " / ",
             st.global_tokens_per_expert.size(), " entries for E=", d.E, " (create the state with router_state_init)");
  check_cache(chk, cache, d, cfg, x.dtype());
  const bool* padding = padding_mask.defined() ? padding_mask.data<bool>() : nullptr;
  if (cfg.router_dtype == DType::f64)
    forward_impl<double>(probs, map, stats, x, padding, wc, w, st, cache, d, cfg, training, ctx);
  else
    forward_impl<float>(probs, map, stats, x, padding, wc, w, st, cache, d, cfg, training, ctx);
}

void router_backward(Tensor& dx, Tensor& dweight, Tensor& dbias, const Tensor& dprobs, const Tensor& x,
                     const RouterWeights& w, RouterCache& cache, const RouterDims& d, const MoeConfig& cfg,
                     float aux_grad_scale, const ops::Context& ctx) {
  const ArgCheck chk("router_backward", {{"dx", &dx},
                                         {"dweight", &dweight},
                                         {"dprobs", &dprobs},
                                         {"x", &x},
                                         {"weight", &w.weight},
                                         {"weight_compute", &w.weight_compute}});
  check_common(chk, x, w, d, cfg, ctx);
  chk.tensor("dx", dx, Shape{d.T, d.H}, DType::f32);
  chk.tensor("dweight", dweight, Shape{d.E, d.H}, DType::f32);
  chk.tensor("dprobs", dprobs, Shape{d.T, d.E}, DType::f32);
  if (w.bias.defined()) chk.tensor("dbias", dbias, Shape{d.E}, DType::f32);
  check_cache(chk, cache, d, cfg, x.dtype());
  const bool jitter = cfg.input_jitter_eps > 0;
  const Tensor& xj = jitter ? cache.x_jittered : x;
  if (cfg.router_dtype == DType::f64) {
    route_backward<double>(cache, dprobs, d, cfg, aux_grad_scale);
    with_x_type(x.dtype(), [&](auto tag) {
      using X = decltype(tag);
      gating_backward_f64(dx.data<float>(), dweight.data<float>(), cache.dlogits.data<double>(), xj.data<X>(),
                          w.weight.data<float>(), jitter ? cache.jitter.data<float>() : nullptr, d.T, d.H, d.E);
    });
    if (w.bias.defined()) gating_bias_grad_f64(dbias.data<float>(), cache.dlogits.data<double>(), d.T, d.E);
  } else {
    route_backward<float>(cache, dprobs, d, cfg, aux_grad_scale);
    gating_backward_f32(dx, dweight, xj, w.weight, cache, jitter, ctx);
    if (w.bias.defined()) ops::bias_grad(dbias, cache.dlogits, ctx);
  }
}

}  // namespace moecore::moe
