// Routing proper (spec §2.5-§2.7, §4.2, §4.4): score functions, (group-limited) top-k with expert bias,
// sinkhorn, capacity dropping, routing-map padding, and the Jacobian of the routing weights (backward).
// Every token row is independent, so rows run in parallel; column passes (capacity, padding, counts) run
// over experts with tokens in order. Results never depend on the thread count.
// Not here: the gating linear and jitter (router.cpp) or any loss (router_losses.cpp).
#include <numeric>

#include "moecore/moe/router_internal.h"

namespace moecore::moe::router_detail {
namespace {

// Top-k of v, or group-limited top-k: a group scores the sum of its top `per` values (Megatron: K / g), the g
// best groups stay, and the experts of the other groups are out of the race (Megatron masks them to -inf).
template <class R>
void select_experts(int32_t* idx, const R* v, int64_t E, int64_t K, int64_t G, int64_t g, int64_t per) {
  if (G <= 0) {
    topk(idx, v, E, K);
    return;
  }
  const int64_t Eg = E / G;
  R* gs = scratch<R, 1>(static_cast<size_t>(G));
  int32_t* tmp = scratch<int32_t, 2>(static_cast<size_t>(per));
  int32_t* gsel = scratch<int32_t, 3>(static_cast<size_t>(g));
  uint8_t* allowed = scratch<uint8_t, 4>(static_cast<size_t>(E));
  for (int64_t j = 0; j < G; ++j) {
    topk(tmp, v + j * Eg, Eg, per);
    R sum = 0;
    for (int64_t i = 0; i < per; ++i) sum += v[j * Eg + tmp[i]];
    gs[j] = sum;
  }
  topk(gsel, gs, G, g);
  std::fill(allowed, allowed + E, uint8_t{0});
  for (int64_t i = 0; i < g; ++i) std::fill(allowed + gsel[i] * Eg, allowed + (gsel[i] + 1) * Eg, uint8_t{1});
  topk(idx, v, E, K, allowed);
}

// out = diag(d1) C diag(d0) rescaled until the expert scalings settle (Megatron's tol 1e-4, eps 1e-8),
// C = exp(z). Column sums run over tokens in order. Megatron loops without a bound; the cap only stops a
// pathological input from hanging the run.
template <class R>
void sinkhorn_balance(R* out, const R* z, int64_t T, int64_t E) {
  const R tol = R(1e-4), eps = R(1e-8);
  R* d0 = scratch<R, 5>(static_cast<size_t>(T));
  R* d1 = scratch<R, 6>(static_cast<size_t>(E));
  R* d1_old = scratch<R, 7>(static_cast<size_t>(E));
  R* col = scratch<R, 8>(static_cast<size_t>(E));
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t i = 0; i < T * E; ++i) out[i] = std::exp(z[i]);
  std::fill(d1, d1 + E, R(1));
  std::fill(d1_old, d1_old + E, R(1));
  R err = R(1e9);
  for (int iter = 0; err > tol && iter < 10000; ++iter) {
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
    for (int64_t t = 0; t < T; ++t) {
      R acc = 0;
      for (int64_t e = 0; e < E; ++e) acc += out[t * E + e] * d1[e];
      d0[t] = (R(1) / R(T)) / (acc + eps);
    }
    std::fill(col, col + E, R(0));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) col[e] += out[t * E + e] * d0[t];
    R diff = 0;
    for (int64_t e = 0; e < E; ++e) {
      d1[e] = (R(1) / R(E)) / (col[e] + eps);
      diff += std::fabs(d1_old[e] - d1[e]);
      d1_old[e] = d1[e];
    }
    err = diff / R(E);
  }
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) out[t * E + e] = d1[e] * out[t * E + e] * d0[t];
}

}  // namespace

template <class R>
void route_tokens(RouterCache& c, Tensor& map, const RouterState& st, const RouterDims& d, const MoeConfig& cfg,
                  bool training) {
  const int64_t T = d.T, E = d.E, K = d.K, G = cfg.num_groups, g = cfg.group_topk;
  const int64_t per = G > 0 ? cfg.group_score_k() : 0;
  const R* logits = c.logits.data<R>();
  R* scores = c.scores.data<R>();
  R* sparse = c.dlogits.data<R>();
  int32_t* tk_idx = c.topk_idx.data<int32_t>();
  R* tk_w = c.topk_w.data<R>();
  bool* mp = map.data<bool>();
  const bool sinkhorn = cfg.uses(LoadBalancing::sinkhorn);
  // Sinkhorn only chooses the experts in training; its matrix shares the buffer with the sparse weights,
  // which is safe because each row is read before it is overwritten.
  if (sinkhorn && training) sinkhorn_balance(sparse, logits, T, E);
  const float* bias = cfg.enable_expert_bias ? st.expert_bias.data<float>() : nullptr;
  const R scale = cfg.topk_scaling_factor > 0 ? R(cfg.topk_scaling_factor) : R(1);
  const ScoreFunction sf = cfg.score_function;
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const R* z = logits + t * E;
    R* s = scores + t * E;
    int32_t* idx = tk_idx + t * K;
    R* w = tk_w + t * K;
    R* sp = sparse + t * E;
    R* tmp = scratch<R, 0>(static_cast<size_t>(E));
    if (sinkhorn) {
      if (K == 1) {
        for (int64_t e = 0; e < E; ++e) s[e] = sigmoid(z[e]);
      } else {
        softmax_row(s, z, E);
      }
      topk(idx, training ? sp : s, E, K);
      for (int64_t j = 0; j < K; ++j) w[j] = s[idx[j]];
    } else if (sf == ScoreFunction::softmax && cfg.pre_softmax) {
      softmax_row(s, z, E);
      select_experts(idx, s, E, K, G, g, per);
      for (int64_t j = 0; j < K; ++j) w[j] = s[idx[j]];
    } else if (sf == ScoreFunction::softmax) {
      select_experts(idx, z, E, K, G, g, per);
      for (int64_t j = 0; j < K; ++j) tmp[j] = z[idx[j]];
      softmax_row(w, tmp, K);
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = score_fn(sf, z[e]);
      if (bias) {  // the bias steers selection (and group scores) only; weights use the unbiased scores
        for (int64_t e = 0; e < E; ++e) tmp[e] = s[e] + R(bias[e]);
      }
      select_experts(idx, bias ? tmp : s, E, K, G, g, per);
      R sum = 0;
      for (int64_t j = 0; j < K; ++j) sum += (w[j] = s[idx[j]]);
      if (K > 1)
        for (int64_t j = 0; j < K; ++j) w[j] /= sum + R(1e-20);
    }
    std::fill(sp, sp + E, R(0));
    std::fill(mp + t * E, mp + (t + 1) * E, false);
    for (int64_t j = 0; j < K; ++j) {
      sp[idx[j]] = w[j] * scale;
      mp[t * E + idx[j]] = true;
    }
  }
}

template <class R>
int64_t route_capacity(Tensor& probs, Tensor& map, RouterCache& c, const RouterDims& d, const MoeConfig& cfg) {
  const int64_t T = d.T, E = d.E, K = d.K;
  const R* sparse = c.dlogits.data<R>();
  float* pp = probs.data<float>();
  bool* mp = map.data<bool>();
  bool* kept = c.topk_kept.data<bool>();
  const int32_t* tk_idx = c.topk_idx.data<int32_t>();
  const int64_t cap = cfg.capacity_factor > 0 ? expert_capacity(T * K, E, cfg.capacity_factor) : T + 1;
  const bool pad = cfg.pad_expert_input_to_capacity;
  if (cap > T) {  // strict: capacity T still runs the (no-op for probs) top-T selection
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
    for (int64_t i = 0; i < T * E; ++i) {
      pp[i] = static_cast<float>(sparse[i]);
      if (pad) mp[i] = true;  // keep is all-true, and padding makes the map equal to it
    }
    std::fill(kept, kept + T * K, true);
    return 0;
  }
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t e = 0; e < E; ++e) {
    int32_t* order = scratch<int32_t, 9>(static_cast<size_t>(T));
    uint8_t* keep = scratch<uint8_t, 10>(static_cast<size_t>(T));
    std::fill(keep, keep + T, uint8_t{0});
    if (cfg.drop_policy == DropPolicy::probs) {
      std::iota(order, order + T, 0);
      std::partial_sort(order, order + cap, order + T, [&](int32_t a, int32_t b) {
        const R va = sparse[a * E + e], vb = sparse[b * E + e];
        return va > vb || (va == vb && a < b);
      });
      for (int64_t i = 0; i < cap; ++i) keep[order[i]] = 1;
    } else {  // the earliest routed tokens (t = s * B + b: earliest positions), then (only matters when
              // padding) the earliest unrouted ones
      int64_t n = 0;
      for (int64_t t = 0; t < T && n < cap; ++t)
        if (mp[t * E + e]) keep[t] = 1, ++n;
      for (int64_t t = 0; t < T && n < cap; ++t)
        if (!mp[t * E + e]) keep[t] = 1, ++n;
    }
    for (int64_t t = 0; t < T; ++t) {
      const bool k = keep[t] != 0;
      mp[t * E + e] = pad ? k : (mp[t * E + e] && k);
      pp[t * E + e] = k ? static_cast<float>(sparse[t * E + e]) : 0.0f;
    }
  }
  int64_t dropped = 0;
  for (int64_t i = 0; i < T * K; ++i) {
    kept[i] = mp[(i / K) * E + tk_idx[i]];
    dropped += kept[i] ? 0 : 1;
  }
  return dropped;
}

void pad_routing_map(Tensor& map, int64_t T, int64_t E, int64_t A) {
  bool* mp = map.data<bool>();
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) n += mp[t * E + e] ? 1 : 0;
    int64_t pad = (A - n % A) % A;
    for (int64_t t = 0; t < T && pad > 0; ++t)
      if (!mp[t * E + e]) mp[t * E + e] = true, --pad;
  }
}

void map_column_counts(int64_t* out, const Tensor& map, const bool* padding, int64_t T, int64_t E) {
  const bool* mp = map.data<bool>();
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) n += (mp[t * E + e] && !(padding && padding[t])) ? 1 : 0;
    out[e] += n;
  }
}

// Per token, with dw_j = scale * dprobs[t, idx_j] for kept pairs (0 for dropped ones: probs' = probs * map):
//   post-softmax  dz[idx_j] = w_j (dw_j - sum_i w_i dw_i)            (softmax over the selected logits)
//   pre-softmax   dz = s * (ds - sum_j s_idx_j dw_j), ds = dw scattered  (softmax over all E; sinkhorn k>1)
//   sigmoid-like  dz[idx_j] = f'(z) (dw_j - sum_i dw_i w_i) / (sum sel + 1e-20)   (k == 1: f'(z) dw_j)
template <class R>
void route_backward(RouterCache& c, const Tensor& dprobs, const RouterDims& d, const MoeConfig& cfg,
                    float aux_grad_scale) {
  const int64_t T = d.T, E = d.E, K = d.K;
  const R* logits = c.logits.data<R>();
  const R* scores = c.scores.data<R>();
  const int32_t* tk_idx = c.topk_idx.data<int32_t>();
  const R* tk_w = c.topk_w.data<R>();
  const bool* kept = c.topk_kept.data<bool>();
  const R* dll = c.dlogits_loss.data<R>();
  const float* dp = dprobs.data<float>();
  R* dlogits = c.dlogits.data<R>();
  const R scale = cfg.topk_scaling_factor > 0 ? R(cfg.topk_scaling_factor) : R(1);
  const R loss_scale = R(aux_grad_scale);
  const bool sinkhorn = cfg.uses(LoadBalancing::sinkhorn);
  const bool full_softmax =
      (sinkhorn && K > 1) || (!sinkhorn && cfg.score_function == ScoreFunction::softmax && cfg.pre_softmax);
  const bool post_softmax = !sinkhorn && cfg.score_function == ScoreFunction::softmax && !cfg.pre_softmax;
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* idx = tk_idx + t * K;
    const R* w = tk_w + t * K;
    const R* z = logits + t * E;
    const R* s = scores + t * E;
    R* dl = dlogits + t * E;
    R* dw = scratch<R, 0>(static_cast<size_t>(K));
    for (int64_t j = 0; j < K; ++j) dw[j] = kept[t * K + j] ? R(dp[t * E + idx[j]]) * scale : R(0);
    std::fill(dl, dl + E, R(0));
    if (full_softmax) {
      R dot = 0;
      for (int64_t j = 0; j < K; ++j) dot += s[idx[j]] * dw[j];
      for (int64_t e = 0; e < E; ++e) dl[e] = -s[e] * dot;
      for (int64_t j = 0; j < K; ++j) dl[idx[j]] += s[idx[j]] * dw[j];
    } else if (post_softmax) {
      R dot = 0;
      for (int64_t j = 0; j < K; ++j) dot += w[j] * dw[j];
      for (int64_t j = 0; j < K; ++j) dl[idx[j]] = w[j] * (dw[j] - dot);
    } else if (sinkhorn) {  // k == 1: weight = sigmoid(z)
      dl[idx[0]] = dw[0] * s[idx[0]] * (R(1) - s[idx[0]]);
    } else {
      const ScoreFunction sf = cfg.score_function;
      if (K > 1) {
        R sum = 0, dot = 0;
        for (int64_t j = 0; j < K; ++j) sum += s[idx[j]];
        for (int64_t j = 0; j < K; ++j) dot += dw[j] * w[j];
        const R denom = sum + R(1e-20);
        for (int64_t j = 0; j < K; ++j) dw[j] = (dw[j] - dot) / denom;
      }
      for (int64_t j = 0; j < K; ++j) dl[idx[j]] = dw[j] * score_fn_grad(sf, z[idx[j]], s[idx[j]]);
    }
    const R* lrow = dll + t * E;
    for (int64_t e = 0; e < E; ++e) dl[e] += loss_scale * lrow[e];
  }
}

#define MOECORE_ROUTER_INSTANTIATE(R)                                                                                  \
  template void route_tokens<R>(RouterCache&, Tensor&, const RouterState&, const RouterDims&, const MoeConfig&, bool); \
  template int64_t route_capacity<R>(Tensor&, Tensor&, RouterCache&, const RouterDims&, const MoeConfig&);             \
  template void route_backward<R>(RouterCache&, const Tensor&, const RouterDims&, const MoeConfig&, float);
MOECORE_ROUTER_INSTANTIATE(float)
MOECORE_ROUTER_INSTANTIATE(double)
#undef MOECORE_ROUTER_INSTANTIATE

}  // namespace moecore::moe::router_detail
