// CUDA router kernels of router_gating.cpp and router_topk.cpp: jitter, forced-balancing logits, the fp64 gating
// linear and its gradients, the expert-bias update, routing ((group-limited) top-k, expert bias, sinkhorn), capacity
// dropping, map padding and counts, and the routing Jacobian. Nothing is read on the host.
// Determinism without float atomics: a routing row runs on one thread with the CPU's operations in the CPU's order
// (selections equal the CPU's whenever the scores do; about T threads, so routing is latency- rather than
// bandwidth-bound: tens of microseconds per 16k tokens); the "probs" capacity ranks each expert column with two
// stable radix sorts (value descending, then column), which is the CPU's order (ties to the lower token); counts and
// column scans are integer warp ballots; dw sums 512-token chunks in chunk order in double; dbias walks tokens in
// order (bitwise the CPU's). Sinkhorn runs in one block: its column sums split tokens into fixed ranges (a fixed
// order, not the CPU's), so its matrix agrees with the CPU's to rounding only.
#include <cub/device/device_radix_sort.cuh>

#include "moecore/kernels/common/router_grads.h"
#include "moecore/kernels/cuda/router_util.cuh"

namespace moecore::ops::cuda {
namespace {

using router::r_exp;
using router::score_fn;
using router::score_fn_grad;
using router::with_router_type;

// ---- gating ---------------------------------------------------------------------------------------------------
template <class X>
__global__ void jitter_kernel(X* xj, float* u, const X* x, int64_t n, uint32_t key0, uint32_t key1, uint64_t first,
                              float eps) {
  MOECORE_GRID_STRIDE(i, n) {
    const float r = (1.0f - eps) + 2.0f * eps * philox_uniform_dev(key0, key1, first + static_cast<uint64_t>(i));
    u[i] = r;
    st(xj[i], __fmul_rn(ld(x[i]), r));
  }
}

__global__ void jitter_backward_kernel(float* dx, const float* g, const float* u, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) dx[i] += g[i] * u[i];
}

// philox_normal: Box-Muller in double on the words of counter {block, block >> 32, 0, 0}, rounded to f32.
template <class R>
__global__ void normal_logits_kernel(R* logits, int64_t n, uint32_t key0, uint32_t key1, uint64_t first) {
  MOECORE_GRID_STRIDE(i, n) {
    const uint64_t index = first + static_cast<uint64_t>(i);
    const PhiloxWords w = philox_block(key0, key1, index / 4, 0);
    const int p = static_cast<int>(index % 4) / 2;
    const double u1 = (static_cast<double>(w.w[2 * p]) + 0.5) * 0x1p-32;
    const double u2 = (static_cast<double>(w.w[2 * p + 1]) + 0.5) * 0x1p-32;
    const double radius = sqrt(-2.0 * log(u1)), angle = 6.283185307179586 * u2;
    const float v = static_cast<float>(radius * (index % 2 == 0 ? cos(angle) : sin(angle)));
    logits[i] = R(v);
  }
}

// One block per token, one warp per expert at a time: logits[t, e] = x[t] . w[e] (+ b[e]) in double.
template <class X>
__global__ void gating_kernel(double* logits, const X* x, const float* w, const float* b, int64_t H, int64_t E) {
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t e = warp; e < E; e += warps) {
    double acc = 0;
    for (int64_t h = lane; h < H; h += 32)
      acc += static_cast<double>(ld(x[t * H + h])) * static_cast<double>(w[e * H + h]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) logits[t * E + e] = b ? acc + static_cast<double>(b[e]) : acc;
  }
}

// dx[t, h] += (sum_e dl[t, e] w[e, h]) (* u[t, h]), e in order.
__global__ void gating_dx_kernel(float* dx, const double* dl, const float* w, const float* u, int64_t T, int64_t H,
                                 int64_t E) {
  MOECORE_GRID_STRIDE(i, T * H) {
    const int64_t t = i / H, h = i % H;
    double acc = 0;
    for (int64_t e = 0; e < E; ++e) acc += dl[t * E + e] * static_cast<double>(w[e * H + h]);
    dx[i] += static_cast<float>(u ? acc * static_cast<double>(u[i]) : acc);
  }
}

constexpr int64_t kGateChunk = 512;  // tokens per dw partial sum
constexpr int kGateEb = 8;           // experts per thread

// partial[c, e, h] = sum over the tokens of chunk c, in order, of dl[t, e] x[t, h] (double).
template <class X>
__global__ void gating_dw_partial_kernel(double* partial, const double* dl, const X* x, int64_t T, int64_t H,
                                         int64_t E) {
  const int64_t h = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t e0 = static_cast<int64_t>(blockIdx.y) * kGateEb, c = blockIdx.z;
  if (h >= H) return;
  const int ne = E - e0 < kGateEb ? static_cast<int>(E - e0) : kGateEb;
  double acc[kGateEb] = {};
  const int64_t t1 = (c + 1) * kGateChunk < T ? (c + 1) * kGateChunk : T;
  for (int64_t t = c * kGateChunk; t < t1; ++t) {
    const double xv = static_cast<double>(ld(x[t * H + h]));
#pragma unroll
    for (int k = 0; k < kGateEb; ++k)
      if (k < ne) acc[k] += dl[t * E + e0 + k] * xv;
  }
  for (int k = 0; k < ne; ++k) partial[(c * E + e0 + k) * H + h] = acc[k];
}

__global__ void gating_dw_reduce_kernel(float* dw, const double* partial, int64_t chunks, int64_t EH) {
  MOECORE_GRID_STRIDE(i, EH) {
    double acc = 0;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * EH + i];
    dw[i] += static_cast<float>(acc);
  }
}

__global__ void gating_bias_grad_kernel(float* db, const double* dl, int64_t T, int64_t E) {
  MOECORE_GRID_STRIDE(e, E) {
    double acc = 0;
    for (int64_t t = 0; t < T; ++t) acc += dl[t * E + e];
    db[e] += static_cast<float>(acc);
  }
}

__global__ void expert_bias_update_kernel(float* bias, const int64_t* c, int64_t E, float rate) {
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += c[e];
  for (int64_t e = 0; e < E; ++e) {
    const int64_t diff = total - E * c[e];
    const float sgn = diff > 0 ? 1.0f : (diff < 0 ? -1.0f : 0.0f);
    bias[e] = __fadd_rn(bias[e], __fmul_rn(rate, sgn));
  }
}

// ---- routing --------------------------------------------------------------------------------------------------
// Per-token scratch of the routing kernel (slices of the workspace).
template <class R>
struct RouteScratch {
  R* tmp;            // [T, E]
  R* group_scores;   // [T, G]
  int32_t* gtmp;     // [T, per]
  int32_t* gsel;     // [T, g]
  uint8_t* allowed;  // [T, E]
};

template <class R>
__device__ void select_experts(int32_t* idx, const R* v, int64_t E, int64_t K, int64_t G, int64_t g, int64_t per, R* gs,
                               int32_t* tmp, int32_t* gsel, uint8_t* allowed) {
  if (G <= 0) {
    router::topk(idx, v, E, K);
    return;
  }
  const int64_t Eg = E / G;
  for (int64_t j = 0; j < G; ++j) {
    router::topk(tmp, v + j * Eg, Eg, per);
    R sum = 0;
    for (int64_t i = 0; i < per; ++i) sum += v[j * Eg + tmp[i]];
    gs[j] = sum;
  }
  router::topk(gsel, gs, G, g);
  for (int64_t e = 0; e < E; ++e) allowed[e] = 0;
  for (int64_t i = 0; i < g; ++i)
    for (int64_t e = gsel[i] * Eg; e < (gsel[i] + 1) * Eg; ++e) allowed[e] = 1;
  router::topk(idx, v, E, K, allowed);
}

// cpu route_kernel's row body, one thread per token.
template <class R>
__global__ void route_kernel(R* scores, int32_t* tk_idx, R* tk_w, R* sparse, bool* mp, const R* logits,
                             const float* bias, int64_t T, int64_t E, int64_t K, RouterRouting p, RouteScratch<R> ws) {
  const int64_t G = p.num_groups, g = p.group_topk, per = G > 0 ? p.group_score_k : 0;
  const R scale = p.scaling_factor > 0 ? R(p.scaling_factor) : R(1);
  const ScoreFunction sf = p.score_function;
  MOECORE_GRID_STRIDE(t, T) {
    const R* z = logits + t * E;
    R* s = scores + t * E;
    int32_t* idx = tk_idx + t * K;
    R* w = tk_w + t * K;
    R* sp = sparse + t * E;
    R* tmp = ws.tmp + t * E;
    R* gs = ws.group_scores + t * (G > 0 ? G : 0);
    int32_t* gt = ws.gtmp + t * per;
    int32_t* gsel = ws.gsel + t * (G > 0 ? g : 0);
    uint8_t* allowed = ws.allowed + t * E;
    if (p.sinkhorn) {
      if (K == 1) {
        for (int64_t e = 0; e < E; ++e) s[e] = router::sigmoid(z[e]);
      } else {
        router::softmax_row(s, z, E);
      }
      router::topk(idx, p.training ? sp : s, E, K);
      for (int64_t j = 0; j < K; ++j) w[j] = s[idx[j]];
    } else if (sf == ScoreFunction::softmax && p.pre_softmax) {
      router::softmax_row(s, z, E);
      select_experts(idx, s, E, K, G, g, per, gs, gt, gsel, allowed);
      for (int64_t j = 0; j < K; ++j) w[j] = s[idx[j]];
    } else if (sf == ScoreFunction::softmax) {
      select_experts(idx, z, E, K, G, g, per, gs, gt, gsel, allowed);
      for (int64_t j = 0; j < K; ++j) tmp[j] = z[idx[j]];
      router::softmax_row(w, tmp, K);
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = score_fn(sf, z[e]);
      if (bias)
        for (int64_t e = 0; e < E; ++e) tmp[e] = s[e] + R(bias[e]);
      select_experts(idx, bias ? tmp : s, E, K, G, g, per, gs, gt, gsel, allowed);
      R sum = 0;
      for (int64_t j = 0; j < K; ++j) sum += (w[j] = s[idx[j]]);
      if (K > 1)
        for (int64_t j = 0; j < K; ++j) w[j] /= sum + R(1e-20);
    }
    for (int64_t e = 0; e < E; ++e) {
      sp[e] = R(0);
      mp[t * E + e] = false;
    }
    for (int64_t j = 0; j < K; ++j) {
      sp[idx[j]] = w[j] * scale;
      mp[t * E + idx[j]] = true;
    }
  }
}

// cpu sinkhorn_balance in one block: out = diag(d1) exp(z) diag(d0) until the scalings settle.
template <class R>
__global__ void sinkhorn_kernel(R* out, const R* z, R* d0, R* d1, R* d1_old, R* col_parts, int64_t T, int64_t E) {
  __shared__ double err_shared;
  const R tol = R(1e-4), eps = R(1e-8);
  const int64_t parts = blockDim.x / E > 0 ? blockDim.x / E : 1;
  for (int64_t i = threadIdx.x; i < T * E; i += blockDim.x) out[i] = r_exp(z[i]);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) d1[e] = d1_old[e] = R(1);
  if (threadIdx.x == 0) err_shared = 1e9;
  __syncthreads();
  for (int iter = 0; err_shared > static_cast<double>(tol) && iter < 10000; ++iter) {
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
      R acc = 0;
      for (int64_t e = 0; e < E; ++e) acc += out[t * E + e] * d1[e];
      d0[t] = (R(1) / R(T)) / (acc + eps);
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < parts * E; c += blockDim.x) {
      const int64_t e = c % E, part = c / E, t0 = part * T / parts, t1 = (part + 1) * T / parts;
      R acc = 0;
      for (int64_t t = t0; t < t1; ++t) acc += out[t * E + e] * d0[t];
      col_parts[c] = acc;
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
      R col = 0;
      for (int64_t part = 0; part < parts; ++part) col += col_parts[part * E + e];
      d1[e] = (R(1) / R(E)) / (col + eps);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      R diff = 0;
      for (int64_t e = 0; e < E; ++e) {
        const R dd = d1_old[e] - d1[e];
        diff += dd < R(0) ? -dd : dd;
        d1_old[e] = d1[e];
      }
      err_shared = static_cast<double>(diff / R(E));
    }
    __syncthreads();
  }
  for (int64_t i = threadIdx.x; i < T * E; i += blockDim.x) out[i] = d1[i % E] * out[i] * d0[i / E];
}

// ---- capacity, padding, counts ----------------------------------------------------------------------------------
template <class R>
__global__ void capacity_dropless_kernel(float* pp, bool* mp, bool* kept, int64_t* dropped, const R* sparse, int64_t TE,
                                         int64_t TK, bool pad) {
  MOECORE_GRID_STRIDE(i, TE) {
    pp[i] = static_cast<float>(sparse[i]);
    if (pad) mp[i] = true;
  }
  MOECORE_GRID_STRIDE(i, TK) kept[i] = true;
  if (blockIdx.x == 0 && threadIdx.x == 0) *dropped = 0;
}

// Column-major keys (expert e's column at [e T, (e + 1) T)) and their positions as values.
template <class R>
__global__ void capacity_keys_kernel(R* keys, int32_t* pos, const R* sparse, int64_t T, int64_t E) {
  MOECORE_GRID_STRIDE(i, T * E) {
    const int64_t e = i / T, t = i % T;
    keys[i] = sparse[t * E + e];
    pos[i] = static_cast<int32_t>(i);
  }
}
__global__ void capacity_columns_kernel(int32_t* col, const int32_t* pos, int64_t T, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) col[i] = static_cast<int32_t>(pos[i] / T);
}
// After both sorts, position i = e T + rank holds the column-major index of the column's rank-th largest value.
__global__ void capacity_keep_kernel(uint8_t* keep, const int32_t* order, int64_t T, int64_t n, int64_t cap) {
  MOECORE_GRID_STRIDE(i, n) keep[order[i]] = i % T < cap ? 1 : 0;
}
template <class R>
__global__ void capacity_apply_kernel(float* pp, bool* mp, const uint8_t* keep, const R* sparse, int64_t T, int64_t E,
                                      bool pad) {
  MOECORE_GRID_STRIDE(i, T * E) {
    const bool k = keep[(i % E) * T + i / E] != 0;
    mp[i] = pad ? k : (mp[i] && k);
    pp[i] = k ? static_cast<float>(sparse[i]) : 0.0f;
  }
}

// The "position" policy, one block per expert column: the earliest `cap` routed tokens, then the earliest unrouted
// ones while the column has room.
template <class R>
__global__ void capacity_position_kernel(float* pp, bool* mp, const R* sparse, int64_t T, int64_t E, int64_t cap,
                                         bool pad) {
  __shared__ int shared[32];
  const int64_t e = blockIdx.x;
  int64_t routed_total = 0;
  for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    int total = 0;
    block_exclusive_count(t < T && mp[t * E + e], shared, &total);
    routed_total += total;
  }
  const int64_t room = cap - (routed_total < cap ? routed_total : cap);
  int64_t routed_base = 0, unrouted_base = 0;
  for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const bool routed = t < T && mp[t * E + e];
    int total = 0;
    const int before = block_exclusive_count(routed, shared, &total);
    const int64_t routed_rank = routed_base + before, unrouted_rank = unrouted_base + (threadIdx.x - before);
    if (t < T) {
      const bool k = routed ? routed_rank < cap : unrouted_rank < room;
      mp[t * E + e] = pad ? k : (routed && k);
      pp[t * E + e] = k ? static_cast<float>(sparse[t * E + e]) : 0.0f;
    }
    const int64_t valid = T - t0 < static_cast<int64_t>(blockDim.x) ? T - t0 : blockDim.x;
    routed_base += total;
    unrouted_base += valid - total;
  }
}

// kept[i] = map at the i-th selected pair; dropped = the pairs lost (one block, integer sums).
__global__ void capacity_kept_kernel(bool* kept, int64_t* dropped, const bool* mp, const int32_t* idx, int64_t T,
                                     int64_t E, int64_t K) {
  __shared__ long long shared[32];
  long long lost = 0;
  for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
    const bool k = mp[(i / K) * E + idx[i]];
    kept[i] = k;
    lost += k ? 0 : 1;
  }
  lost = block_reduce(lost, shared, Sum{});
  if (threadIdx.x == 0) *dropped = lost;
}

__global__ void pad_map_kernel(bool* mp, int64_t T, int64_t E, int64_t A) {
  __shared__ int shared[32];
  const int64_t e = blockIdx.x;
  int64_t n = 0;
  for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    int total = 0;
    block_exclusive_count(t < T && mp[t * E + e], shared, &total);
    n += total;
  }
  const int64_t pad = (A - n % A) % A;
  int64_t base = 0;
  for (int64_t t0 = 0; t0 < T && base < pad; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const bool free_slot = t < T && !mp[t * E + e];
    int total = 0;
    const int before = block_exclusive_count(free_slot, shared, &total);
    if (free_slot && base + before < pad) mp[t * E + e] = true;
    base += total;
  }
}

__global__ void map_counts_kernel(int64_t* counts, const bool* mp, const bool* padding, int64_t T, int64_t E,
                                  bool accumulate) {
  __shared__ int shared[32];
  const int64_t e = blockIdx.x;
  int64_t n = 0;
  for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    int total = 0;
    block_exclusive_count(t < T && mp[t * E + e] && !(padding && padding[t]), shared, &total);
    n += total;
  }
  if (threadIdx.x == 0) counts[e] = accumulate ? counts[e] + n : n;
}

// ---- routing Jacobian -----------------------------------------------------------------------------------------
// One thread per token: the routing Jacobian of kernels/common/router_grads.h (route_backward_row).
template <class R>
__global__ void route_backward_kernel(R* dlogits, const float* dp, const R* logits, const R* scores,
                                      const int32_t* tk_idx, const R* tk_w, const bool* kept, const R* dll, int64_t T,
                                      int64_t E, int64_t K, RouterRouting p, float aux_grad_scale, R* dw_all) {
  const auto c = router_math::route_backward_consts<R>(p, K, aux_grad_scale);
  MOECORE_GRID_STRIDE(t, T) {
    router_math::route_backward_row(dlogits + t * E, dw_all + t * K, dp + t * E, tk_idx + t * K, tk_w + t * K,
                                    logits + t * E, scores + t * E, kept + t * K, dll + t * E, E, K, c);
  }
}

unsigned grid_of(const Launch& l, int64_t blocks) {
  MOECORE_CHECK(blocks <= 0x7fffffff, l.op(), " (cuda): ", blocks, " blocks exceed the grid");
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

constexpr int kColumnThreads = 1024;

}  // namespace

void router_jitter_forward(Tensor& xj, Tensor& u, const Tensor& x, float eps, PhiloxKey key, uint64_t first,
                           const Context& ctx) {
  const Launch l("router_jitter_forward", ctx, {{"xj", &xj}, {"u", &u}, {"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  with_float_type(x.dtype(), [&](auto tag) {
    using X = decltype(tag);
    jitter_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<X>(xj), Launch::ptr<float>(u),
                                                            Launch::ptr<const X>(x), n, key[0], key[1], first, eps);
  });
  l.launched("jitter_kernel");
}

void router_jitter_backward(Tensor& dx, const Tensor& g, const Tensor& u, const Context& ctx) {
  const Launch l("router_jitter_backward", ctx, {{"dx", &dx}, {"g", &g}, {"u", &u}});
  const int64_t n = dx.numel();
  if (n == 0) return;
  jitter_backward_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<float>(dx), Launch::ptr<const float>(g),
                                                                   Launch::ptr<const float>(u), n);
  l.launched("jitter_backward_kernel");
}

void router_normal_logits(Tensor& logits, PhiloxKey key, uint64_t first, const Context& ctx) {
  const Launch l("router_normal_logits", ctx, {{"logits", &logits}});
  const int64_t n = logits.numel();
  if (n == 0) return;
  with_router_type(logits.dtype(), [&](auto tag) {
    using R = decltype(tag);
    normal_logits_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<R>(logits), n, key[0], key[1], first);
  });
  l.launched("normal_logits_kernel");
}

void router_gating_f64(Tensor& logits, const Tensor& x, const Tensor& w, const Tensor& bias, const Context& ctx) {
  const Launch l("router_gating_f64", ctx, {{"logits", &logits}, {"x", &x}, {"w", &w}, {"bias", &bias}});
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  if (T * E == 0) return;
  with_float_type(x.dtype(), [&](auto tag) {
    using X = decltype(tag);
    gating_kernel<<<grid_of(l, T), kThreads, 0, l.stream()>>>(
        Launch::ptr<double>(logits), Launch::ptr<const X>(x), Launch::ptr<const float>(w),
        bias.defined() ? Launch::ptr<const float>(bias) : nullptr, H, E);
  });
  l.launched("gating_kernel");
}

void router_gating_f64_backward(Tensor& dx, Tensor& dw, const Tensor& dlogits, const Tensor& x, const Tensor& w,
                                const Tensor& u, const Context& ctx) {
  const Launch l("router_gating_f64_backward", ctx,
                 {{"dx", &dx}, {"dw", &dw}, {"dlogits", &dlogits}, {"x", &x}, {"w", &w}, {"u", &u}});
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  if (T * H == 0) return;
  gating_dx_kernel<<<grid_for(T * H), kThreads, 0, l.stream()>>>(
      Launch::ptr<float>(dx), Launch::ptr<const double>(dlogits), Launch::ptr<const float>(w),
      u.defined() ? Launch::ptr<const float>(u) : nullptr, T, H, E);
  l.launched("gating_dx_kernel");
  if (E == 0) return;
  const int64_t chunks = (T + kGateChunk - 1) / kGateChunk;
  MOECORE_CHECK(chunks <= 65535 && (E + kGateEb - 1) / kGateEb <= 65535, "router_gating_f64_backward (cuda): T = ", T,
                ", E = ", E, " exceed the grid");
  WorkspaceCarver ws;
  ws.reserve<double>(chunks * E * H);
  ws.allocate(l);
  double* partial = ws.take<double>(chunks * E * H);
  const dim3 grid(static_cast<unsigned>((H + kThreads - 1) / kThreads),
                  static_cast<unsigned>((E + kGateEb - 1) / kGateEb), static_cast<unsigned>(chunks));
  with_float_type(x.dtype(), [&](auto tag) {
    using X = decltype(tag);
    gating_dw_partial_kernel<<<grid, kThreads, 0, l.stream()>>>(partial, Launch::ptr<const double>(dlogits),
                                                                Launch::ptr<const X>(x), T, H, E);
  });
  l.launched("gating_dw_partial_kernel");
  gating_dw_reduce_kernel<<<grid_for(E * H), kThreads, 0, l.stream()>>>(Launch::ptr<float>(dw), partial, chunks, E * H);
  l.launched("gating_dw_reduce_kernel");
}

void router_gating_f64_bias_grad(Tensor& dbias, const Tensor& dlogits, const Context& ctx) {
  const Launch l("router_gating_f64_bias_grad", ctx, {{"dbias", &dbias}, {"dlogits", &dlogits}});
  const int64_t T = dlogits.size(0), E = dlogits.size(1);
  if (E == 0) return;
  gating_bias_grad_kernel<<<grid_for(E, 32), 32, 0, l.stream()>>>(Launch::ptr<float>(dbias),
                                                                  Launch::ptr<const double>(dlogits), T, E);
  l.launched("gating_bias_grad_kernel");
}

void router_expert_bias_update(Tensor& expert_bias, const Tensor& counts, float rate, const Context& ctx) {
  const Launch l("router_expert_bias_update", ctx, {{"expert_bias", &expert_bias}, {"counts", &counts}});
  expert_bias_update_kernel<<<1, 1, 0, l.stream()>>>(Launch::ptr<float>(expert_bias),
                                                     Launch::ptr<const int64_t>(counts), counts.numel(), rate);
  l.launched("expert_bias_update_kernel");
}

void router_route(Tensor& scores, Tensor& topk_idx, Tensor& topk_w, Tensor& sparse, Tensor& map, const Tensor& logits,
                  const Tensor& expert_bias, const RouterRouting& p, const Context& ctx) {
  const Launch l("router_route", ctx,
                 {{"scores", &scores},
                  {"topk_idx", &topk_idx},
                  {"topk_w", &topk_w},
                  {"sparse", &sparse},
                  {"map", &map},
                  {"logits", &logits},
                  {"expert_bias", &expert_bias}});
  const int64_t T = logits.size(0), E = logits.size(1), K = topk_idx.size(1);
  if (T == 0) return;
  const int64_t G = p.num_groups > 0 ? p.num_groups : 0, g = G > 0 ? p.group_topk : 0,
                per = G > 0 ? p.group_score_k : 0;
  with_router_type(logits.dtype(), [&](auto tag) {
    using R = decltype(tag);
    WorkspaceCarver w;
    w.reserve<R>(T * E);
    w.reserve<R>(T * G);
    w.reserve<int32_t>(T * per);
    w.reserve<int32_t>(T * g);
    w.reserve<uint8_t>(T * E);
    const bool balance = p.sinkhorn && p.training;
    if (balance) {
      w.reserve<R>(T);
      w.reserve<R>(2 * E);
      w.reserve<R>(kColumnThreads + E);
    }
    w.allocate(l);
    RouteScratch<R> rs{w.take<R>(T * E), w.take<R>(T * G), w.take<int32_t>(T * per), w.take<int32_t>(T * g),
                       w.take<uint8_t>(T * E)};
    if (balance) {
      R* d0 = w.take<R>(T);
      R* d1 = w.take<R>(2 * E);
      R* parts = w.take<R>(kColumnThreads + E);
      sinkhorn_kernel<<<1, kColumnThreads, 0, l.stream()>>>(Launch::ptr<R>(sparse), Launch::ptr<const R>(logits), d0,
                                                            d1, d1 + E, parts, T, E);
      l.launched("sinkhorn_kernel");
    }
    route_kernel<<<grid_for(T, 64), 64, 0, l.stream()>>>(
        Launch::ptr<R>(scores), Launch::ptr<int32_t>(topk_idx), Launch::ptr<R>(topk_w), Launch::ptr<R>(sparse),
        Launch::ptr<bool>(map), Launch::ptr<const R>(logits),
        expert_bias.defined() ? Launch::ptr<const float>(expert_bias) : nullptr, T, E, K, p, rs);
  });
  l.launched("route_kernel");
}

void router_capacity(Tensor& probs, Tensor& map, Tensor& topk_kept, Tensor& dropped, const Tensor& sparse,
                     const Tensor& topk_idx, const RouterCapacity& p, const Context& ctx) {
  const Launch l("router_capacity", ctx,
                 {{"probs", &probs},
                  {"map", &map},
                  {"topk_kept", &topk_kept},
                  {"dropped", &dropped},
                  {"sparse", &sparse},
                  {"topk_idx", &topk_idx}});
  const int64_t T = sparse.size(0), E = sparse.size(1), K = topk_idx.size(1);
  const int64_t cap = p.capacity > 0 ? p.capacity : T + 1;
  float* pp = Launch::ptr<float>(probs);
  bool* mp = Launch::ptr<bool>(map);
  with_router_type(sparse.dtype(), [&](auto tag) {
    using R = decltype(tag);
    const R* sp = Launch::ptr<const R>(sparse);
    if (cap > T) {
      capacity_dropless_kernel<<<grid_for(T * E), kThreads, 0, l.stream()>>>(
          pp, mp, Launch::ptr<bool>(topk_kept), Launch::ptr<int64_t>(dropped), sp, T * E, T * K, p.pad_to_capacity);
      l.launched("capacity_dropless_kernel");
      return;
    }
    if (p.drop_policy == DropPolicy::position) {
      capacity_position_kernel<<<grid_of(l, E), kColumnThreads, 0, l.stream()>>>(pp, mp, sp, T, E, cap,
                                                                                 p.pad_to_capacity);
      l.launched("capacity_position_kernel");
    } else {
      const int64_t n = T * E;
      MOECORE_CHECK(n <= 0x7fffffff, "router_capacity (cuda): T * E = ", n, " exceeds the sort's int32 positions");
      int col_bits = 1;
      while ((int64_t{1} << col_bits) < E) ++col_bits;
      size_t b1 = 0, b2 = 0;
      l.check(cub::DeviceRadixSort::SortPairsDescending(nullptr, b1, static_cast<const R*>(nullptr),
                                                        static_cast<R*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                        static_cast<int32_t*>(nullptr), static_cast<int>(n), 0,
                                                        static_cast<int>(sizeof(R) * 8), l.stream()),
              "cub::DeviceRadixSort::SortPairsDescending (size query)");
      l.check(
          cub::DeviceRadixSort::SortPairs(nullptr, b2, static_cast<const int32_t*>(nullptr),
                                          static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                          static_cast<int32_t*>(nullptr), static_cast<int>(n), 0, col_bits, l.stream()),
          "cub::DeviceRadixSort::SortPairs (size query)");
      WorkspaceCarver w;
      w.reserve<R>(n, 2);
      w.reserve<int32_t>(n, 4);
      w.reserve<uint8_t>(n);
      w.reserve_bytes(b1 > b2 ? b1 : b2);
      w.allocate(l);
      R* keys = w.take<R>(n);
      R* keys_sorted = w.take<R>(n);
      int32_t* pos = w.take<int32_t>(n);
      int32_t* pos_by_value = w.take<int32_t>(n);
      int32_t* col = w.take<int32_t>(n);
      int32_t* col_sorted = w.take<int32_t>(n);
      uint8_t* keep = w.take<uint8_t>(n);
      size_t tmp_bytes = b1 > b2 ? b1 : b2;
      void* tmp = w.take_bytes(tmp_bytes);
      capacity_keys_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(keys, pos, sp, T, E);
      l.launched("capacity_keys_kernel");
      // Stable sorts: equal values keep their column-major (token-ascending) order, then each column's values keep
      // their descending order.
      l.check(cub::DeviceRadixSort::SortPairsDescending(tmp, tmp_bytes, keys, keys_sorted, pos, pos_by_value,
                                                        static_cast<int>(n), 0, static_cast<int>(sizeof(R) * 8),
                                                        l.stream()),
              "cub::DeviceRadixSort::SortPairsDescending");
      l.enqueued("cub::DeviceRadixSort::SortPairsDescending");
      capacity_columns_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(col, pos_by_value, T, n);
      l.launched("capacity_columns_kernel");
      l.check(cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, col, col_sorted, pos_by_value, pos, static_cast<int>(n),
                                              0, col_bits, l.stream()),
              "cub::DeviceRadixSort::SortPairs");
      l.enqueued("cub::DeviceRadixSort::SortPairs");
      capacity_keep_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(keep, pos, T, n, cap);
      l.launched("capacity_keep_kernel");
      capacity_apply_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(pp, mp, keep, sp, T, E, p.pad_to_capacity);
      l.launched("capacity_apply_kernel");
    }
    capacity_kept_kernel<<<1, kColumnThreads, 0, l.stream()>>>(
        Launch::ptr<bool>(topk_kept), Launch::ptr<int64_t>(dropped), mp, Launch::ptr<const int32_t>(topk_idx), T, E, K);
    l.launched("capacity_kept_kernel");
  });
}

void router_pad_map(Tensor& map, int64_t alignment, const Context& ctx) {
  const Launch l("router_pad_map", ctx, {{"map", &map}});
  const int64_t T = map.size(0), E = map.size(1);
  if (T * E == 0) return;
  pad_map_kernel<<<grid_of(l, E), kColumnThreads, 0, l.stream()>>>(Launch::ptr<bool>(map), T, E, alignment);
  l.launched("pad_map_kernel");
}

void router_map_counts(Tensor& counts, const Tensor& map, const Tensor& padding, bool accumulate, const Context& ctx) {
  const Launch l("router_map_counts", ctx, {{"counts", &counts}, {"map", &map}, {"padding", &padding}});
  const int64_t T = map.size(0), E = map.size(1);
  if (E == 0) return;
  map_counts_kernel<<<grid_of(l, E), kColumnThreads, 0, l.stream()>>>(
      Launch::ptr<int64_t>(counts), Launch::ptr<const bool>(map),
      padding.defined() ? Launch::ptr<const bool>(padding) : nullptr, T, E, accumulate);
  l.launched("map_counts_kernel");
}

void router_route_backward(Tensor& dlogits, const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                           const Tensor& topk_idx, const Tensor& topk_w, const Tensor& topk_kept,
                           const Tensor& dlogits_loss, const RouterRouting& p, float loss_scale, const Context& ctx) {
  const Launch l("router_route_backward", ctx,
                 {{"dlogits", &dlogits},
                  {"dprobs", &dprobs},
                  {"logits", &logits},
                  {"scores", &scores},
                  {"topk_idx", &topk_idx},
                  {"topk_w", &topk_w},
                  {"topk_kept", &topk_kept},
                  {"dlogits_loss", &dlogits_loss}});
  const int64_t T = logits.size(0), E = logits.size(1), K = topk_idx.size(1);
  if (T == 0) return;
  with_router_type(logits.dtype(), [&](auto tag) {
    using R = decltype(tag);
    WorkspaceCarver w;
    w.reserve<R>(T * K);
    w.allocate(l);
    route_backward_kernel<<<grid_for(T, 64), 64, 0, l.stream()>>>(
        Launch::ptr<R>(dlogits), Launch::ptr<const float>(dprobs), Launch::ptr<const R>(logits),
        Launch::ptr<const R>(scores), Launch::ptr<const int32_t>(topk_idx), Launch::ptr<const R>(topk_w),
        Launch::ptr<const bool>(topk_kept), Launch::ptr<const R>(dlogits_loss), T, E, K, p, loss_scale,
        w.take<R>(T * K));
  });
  l.launched("route_backward_kernel");
}

}  // namespace moecore::ops::cuda
