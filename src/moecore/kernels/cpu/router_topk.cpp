// CPU routing kernels (ops_router.h, docs/megatron-moe-spec.md §2.5-§2.7, §4.2, §4.4): score functions, (group-limited)
// top-k with expert bias, sinkhorn, capacity dropping, routing-map padding and counts, and the Jacobian of the
// routing weights. Every token row is independent, so rows run in parallel; column passes (capacity, padding,
// counts) run over experts with tokens in order. Results never depend on the thread count. On a cuda context every op
// dispatches to kernels/cuda/router.cu after its checks.
// Not here: the gating linear and jitter (router_gating.cpp) or any loss (router_losses.cpp).
#include <numeric>

#include "moecore/kernels/common/router_grads.h"
#include "moecore/kernels/cpu/router_util.h"

namespace moecore::ops {
namespace {

using cpu::router::kParallelWork;
using cpu::router::score_fn;
using cpu::router::score_fn_grad;
using cpu::router::scratch;
using cpu::router::sigmoid;
using cpu::router::softmax_row;
using cpu::router::topk;

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

template <class R>
void route_kernel(R* scores, int32_t* tk_idx, R* tk_w, R* sparse, bool* mp, const R* logits, const float* bias,
                  int64_t T, int64_t E, int64_t K, const RouterRouting& p) {
  const int64_t G = p.num_groups, g = p.group_topk, per = G > 0 ? p.group_score_k : 0;
  // Sinkhorn only chooses the experts in training; its matrix shares the buffer with the sparse weights,
  // which is safe because each row is read before it is overwritten.
  if (p.sinkhorn && p.training) sinkhorn_balance(sparse, logits, T, E);
  const R scale = p.scaling_factor > 0 ? R(p.scaling_factor) : R(1);
  const ScoreFunction sf = p.score_function;
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const R* z = logits + t * E;
    R* s = scores + t * E;
    int32_t* idx = tk_idx + t * K;
    R* w = tk_w + t * K;
    R* sp = sparse + t * E;
    R* tmp = scratch<R, 0>(static_cast<size_t>(E));
    if (p.sinkhorn) {
      if (K == 1) {
        for (int64_t e = 0; e < E; ++e) s[e] = sigmoid(z[e]);
      } else {
        softmax_row(s, z, E);
      }
      topk(idx, p.training ? sp : s, E, K);
      for (int64_t j = 0; j < K; ++j) w[j] = s[idx[j]];
    } else if (sf == ScoreFunction::softmax && p.pre_softmax) {
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
int64_t capacity_kernel(float* pp, bool* mp, bool* kept, const R* sparse, const int32_t* tk_idx, int64_t T, int64_t E,
                        int64_t K, const RouterCapacity& p) {
  const int64_t cap = p.capacity > 0 ? p.capacity : T + 1;
  const bool pad = p.pad_to_capacity;
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
    if (p.drop_policy == DropPolicy::probs) {
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

// Per token, the routing Jacobian of kernels/common/router_grads.h (route_backward_row).
template <class R>
void route_backward_kernel(R* dlogits, const float* dp, const R* logits, const R* scores, const int32_t* tk_idx,
                           const R* tk_w, const bool* kept, const R* dll, int64_t T, int64_t E, int64_t K,
                           const RouterRouting& p, float aux_grad_scale) {
  const auto c = router_math::route_backward_consts<R>(p, K, aux_grad_scale);
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    R* dw = scratch<R, 0>(static_cast<size_t>(K));
    router_math::route_backward_row(dlogits + t * E, dw, dp + t * E, tk_idx + t * K, tk_w + t * K, logits + t * E,
                                    scores + t * E, kept + t * K, dll + t * E, E, K, c);
  }
}

// The routing parameters against the shapes (K selected of E, groups dividing E).
void check_routing(const cpu::Checker& ck, const RouterRouting& p, int64_t E, int64_t K) {
  if (K < 1 || K > E) ck.fail("top-k K = ", K, " must lie in [1, E = ", E, "]");
  if (p.num_groups < 0) ck.fail("num_groups = ", p.num_groups, " is negative");
  if (p.num_groups > 0 &&
      (E % p.num_groups != 0 || p.group_topk < 1 || p.group_topk > p.num_groups || p.group_score_k < 1 ||
       p.group_score_k > E / p.num_groups || K > p.group_topk * (E / p.num_groups)))
    ck.fail("group-limited top-k needs E (", E, ") divisible by num_groups (", p.num_groups, "), 1 <= group_topk (",
            p.group_topk, ") <= num_groups, 1 <= group_score_k (", p.group_score_k, ") <= E / num_groups and K (", K,
            ") <= group_topk * E / num_groups");
}

}  // namespace

void router_route(Tensor& scores, Tensor& topk_idx, Tensor& topk_w, Tensor& sparse, Tensor& map, const Tensor& logits,
                  const Tensor& expert_bias, const RouterRouting& p, const Context& ctx) {
  const cpu::Checker ck("router_route", ctx,
                        {{"scores", &scores},
                         {"topk_idx", &topk_idx},
                         {"topk_w", &topk_w},
                         {"sparse", &sparse},
                         {"map", &map},
                         {"logits", &logits}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("logits", 2);
  ck.rank("topk_idx", 2);
  const int64_t T = logits.size(0), E = logits.size(1), K = topk_idx.size(1);
  const DType rt = cpu::router::router_dtype(ck, "logits", T, E);
  for (const char* name : {"scores", "sparse"}) cpu::router::check_arg(ck, name, Shape{T, E}, rt);
  cpu::router::check_arg(ck, "map", Shape{T, E}, DType::boolean);
  cpu::router::check_arg(ck, "topk_idx", Shape{T, K}, DType::i32);
  cpu::router::check_arg(ck, "topk_w", Shape{T, K}, rt);
  cpu::router::check_optional(ck, ctx, "expert_bias", expert_bias, Shape{E}, DType::f32);
  check_routing(ck, p, E, K);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::router_route(scores, topk_idx, topk_w, sparse, map, logits, expert_bias, p, ctx);
  const float* bias = expert_bias.defined() ? expert_bias.data<float>() : nullptr;
  cpu::router::with_router_type(rt, [&](auto tag) {
    using R = decltype(tag);
    route_kernel(scores.data<R>(), topk_idx.data<int32_t>(), topk_w.data<R>(), sparse.data<R>(), map.data<bool>(),
                 logits.data<R>(), bias, T, E, K, p);
  });
}

void router_capacity(Tensor& probs, Tensor& map, Tensor& topk_kept, Tensor& dropped, const Tensor& sparse,
                     const Tensor& topk_idx, const RouterCapacity& p, const Context& ctx) {
  const cpu::Checker ck("router_capacity", ctx,
                        {{"probs", &probs},
                         {"map", &map},
                         {"topk_kept", &topk_kept},
                         {"dropped", &dropped},
                         {"sparse", &sparse},
                         {"topk_idx", &topk_idx}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("sparse", 2);
  ck.rank("topk_idx", 2);
  const int64_t T = sparse.size(0), E = sparse.size(1), K = topk_idx.size(1);
  const DType rt = cpu::router::router_dtype(ck, "sparse", T, E);
  cpu::router::check_arg(ck, "probs", Shape{T, E}, DType::f32);
  cpu::router::check_arg(ck, "map", Shape{T, E}, DType::boolean);
  cpu::router::check_arg(ck, "topk_idx", Shape{T, K}, DType::i32);
  cpu::router::check_arg(ck, "topk_kept", Shape{T, K}, DType::boolean);
  cpu::router::check_arg(ck, "dropped", Shape{1}, DType::i64);
  if (p.capacity < 0) ck.fail("capacity = ", p.capacity, " is negative (0: dropless)");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::router_capacity(probs, map, topk_kept, dropped, sparse, topk_idx, p, ctx);
  cpu::router::with_router_type(rt, [&](auto tag) {
    using R = decltype(tag);
    dropped.data<int64_t>()[0] = capacity_kernel(probs.data<float>(), map.data<bool>(), topk_kept.data<bool>(),
                                                 sparse.data<R>(), topk_idx.data<int32_t>(), T, E, K, p);
  });
}

void router_pad_map(Tensor& map, int64_t alignment, const Context& ctx) {
  const cpu::Checker ck("router_pad_map", ctx, {{"map", &map}}, cpu::Backends::cpu_and_cuda);
  ck.rank("map", 2);
  const int64_t T = map.size(0), E = map.size(1);
  cpu::router::check_arg(ck, "map", Shape{T, E}, DType::boolean);
  if (alignment <= 0) ck.fail("alignment = ", alignment, " must be positive");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_pad_map(map, alignment, ctx);
  const int64_t A = alignment;
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

void router_map_counts(Tensor& counts, const Tensor& map, const Tensor& padding, bool accumulate, const Context& ctx) {
  const cpu::Checker ck("router_map_counts", ctx, {{"counts", &counts}, {"map", &map}}, cpu::Backends::cpu_and_cuda);
  ck.rank("map", 2);
  const int64_t T = map.size(0), E = map.size(1);
  cpu::router::check_arg(ck, "map", Shape{T, E}, DType::boolean);
  cpu::router::check_arg(ck, "counts", Shape{E}, DType::i64);
  cpu::router::check_optional(ck, ctx, "padding", padding, Shape{T}, DType::boolean);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_map_counts(counts, map, padding, accumulate, ctx);
  const bool* pad = cpu::router::padding_of(ck, ctx, padding, T);
  const bool* mp = map.data<bool>();
  int64_t* out = counts.data<int64_t>();
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) n += (mp[t * E + e] && !(pad && pad[t])) ? 1 : 0;
    out[e] = accumulate ? out[e] + n : n;
  }
}

void router_route_backward(Tensor& dlogits, const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                           const Tensor& topk_idx, const Tensor& topk_w, const Tensor& topk_kept,
                           const Tensor& dlogits_loss, const RouterRouting& p, float loss_scale, const Context& ctx) {
  const cpu::Checker ck("router_route_backward", ctx,
                        {{"dlogits", &dlogits},
                         {"dprobs", &dprobs},
                         {"logits", &logits},
                         {"scores", &scores},
                         {"topk_idx", &topk_idx},
                         {"topk_w", &topk_w},
                         {"topk_kept", &topk_kept},
                         {"dlogits_loss", &dlogits_loss}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("logits", 2);
  ck.rank("topk_idx", 2);
  const int64_t T = logits.size(0), E = logits.size(1), K = topk_idx.size(1);
  const DType rt = cpu::router::router_dtype(ck, "logits", T, E);
  for (const char* name : {"dlogits", "scores", "dlogits_loss"}) cpu::router::check_arg(ck, name, Shape{T, E}, rt);
  cpu::router::check_arg(ck, "dprobs", Shape{T, E}, DType::f32);
  cpu::router::check_arg(ck, "topk_idx", Shape{T, K}, DType::i32);
  cpu::router::check_arg(ck, "topk_w", Shape{T, K}, rt);
  cpu::router::check_arg(ck, "topk_kept", Shape{T, K}, DType::boolean);
  check_routing(ck, p, E, K);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::router_route_backward(dlogits, dprobs, logits, scores, topk_idx, topk_w, topk_kept, dlogits_loss, p,
                                         loss_scale, ctx);
  cpu::router::with_router_type(rt, [&](auto tag) {
    using R = decltype(tag);
    route_backward_kernel(dlogits.data<R>(), dprobs.data<float>(), logits.data<R>(), scores.data<R>(),
                          topk_idx.data<int32_t>(), topk_w.data<R>(), topk_kept.data<bool>(), dlogits_loss.data<R>(), T,
                          E, K, p, loss_scale);
  });
}

}  // namespace moecore::ops
