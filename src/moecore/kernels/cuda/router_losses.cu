// CUDA router losses of router_losses.cpp: the aux losses' own scores and top-k map, aux / seq-aux / global-aux
// losses with their logit gradient, the z-loss and the weighted sum. Nothing is read on the host.
// Determinism without float atomics: token rows run one per thread in the CPU's order of operations; the per-sequence
// sums P_b[e], c_b[e] walk their tokens in order on one thread each (the CPU's double sums, bit for bit given the
// same scores); the scalar tail (losses, dL/ds) runs on one thread in the CPU's order; the z-loss sums lse^2 over a
// fixed block tree (a fixed order, not the CPU's serial one: it agrees to rounding).
#include "moecore/kernels/common/router_grads.h"
#include "moecore/kernels/cuda/router_util.cuh"

namespace moecore::ops::cuda {
namespace {

using router::r_exp;
using router::score_fn;
using router::score_fn_grad;
using router::with_router_type;

template <class R>
__global__ void aux_scores_kernel(R* s, R* m, const R* logits, const bool* padding, int32_t* idx_all, int64_t T,
                                  int64_t E, int64_t K, ScoreFunction sf) {
  MOECORE_GRID_STRIDE(t, T) {
    R* st_ = s + t * E;
    R* mt = m + t * E;
    for (int64_t e = 0; e < E; ++e) mt[e] = R(0);
    if (padding && padding[t]) {
      for (int64_t e = 0; e < E; ++e) st_[e] = R(0);
      continue;
    }
    const R* z = logits + t * E;
    if (sf == ScoreFunction::softmax) {
      router::softmax_row(st_, z, E);
    } else {
      R sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (st_[e] = score_fn(sf, z[e]));
      for (int64_t e = 0; e < E; ++e) st_[e] /= sum + R(1e-20);
    }
    int32_t* idx = idx_all + t * K;
    router::topk(idx, st_, E, K);
    for (int64_t j = 0; j < K; ++j) mt[idx[j]] = R(1);
  }
}

// Block e < E: counts[e] = routed tokens of column e; block E: counts[E] = valid tokens.
template <class R>
__global__ void aux_counts_kernel(int64_t* counts, const R* m, const bool* padding, int64_t T, int64_t E) {
  __shared__ int shared[32];
  const int64_t e = blockIdx.x;
  int64_t n = 0;
  for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const bool c = t < T && (e < E ? m[t * E + e] != R(0) : !(padding && padding[t]));
    int total = 0;
    block_exclusive_count(c, shared, &total);
    n += total;
  }
  if (threadIdx.x == 0) counts[e] = n;
}

// P[b, e] and cnt[b, e]: sums over the tokens t = b, b + B, ... in order (the CPU's per-sequence order).
template <class R>
__global__ void aux_sums_kernel(double* P, double* cnt, const R* s, const R* m, int64_t T, int64_t B, int64_t E) {
  MOECORE_GRID_STRIDE(i, B * E) {
    const int64_t b = i / E, e = i % E;
    double p = 0, c = 0;
    for (int64_t t = b; t < T; t += B) {
      p += static_cast<double>(s[t * E + e]);
      c += static_cast<double>(m[t * E + e]);
    }
    P[i] = p;
    cnt[i] = c;
  }
}

// The scalar tail of cpu aux_losses_kernel on one thread (kernels/common/router_grads.h): losses, global_tokens and
// g[b, e] = dL/ds.
__global__ void aux_tail_kernel(double* losses, int64_t* gtok, double* g, double* Pt, double* ct, double* cavg,
                                const double* P, const double* cnt, const int64_t* gc, const bool* padding, int64_t T,
                                int64_t E, RouterAuxLoss p) {
  int64_t n_valid = 0;
  for (int64_t t = 0; t < T; ++t) n_valid += (padding && padding[t]) ? 0 : 1;
  router_math::aux_loss_tail(losses, gtok, g, Pt, ct, cavg, P, cnt, gc, n_valid, E, p);
}

// cpu aux_scores_backward, one thread per token: s (the aux scores) becomes dL/dz on valid rows.
template <class R>
__global__ void aux_backward_kernel(R* s, const R* logits, const double* g, const bool* padding, int64_t T, int64_t B,
                                    int64_t E, ScoreFunction sf) {
  MOECORE_GRID_STRIDE(t, T) {
    R* st_ = s + t * E;
    if (padding && padding[t]) continue;
    router_math::aux_scores_backward_row(st_, g + (t % B) * E, logits + t * E, E, sf);
  }
}

template <class R>
__global__ void lse_kernel(R* lse, const R* logits, int64_t T, int64_t E) {
  MOECORE_GRID_STRIDE(t, T) lse[t] = router::logsumexp_row(logits + t * E, E);
}

// One block: losses[z] = sum over valid tokens of lse^2 / max(valid, 1) (fixed tree), and the gradient factor.
template <class R>
__global__ void z_loss_sum_kernel(double* losses, double* nv_out, const R* lse, const bool* padding, int64_t T) {
  __shared__ double shared[32];
  double sum = 0, valid = 0;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    if (padding && padding[t]) continue;
    sum += static_cast<double>(lse[t]) * static_cast<double>(lse[t]);
    valid += 1;
  }
  sum = block_reduce(sum, shared, Sum{});
  valid = block_reduce(valid, shared, Sum{});
  if (threadIdx.x == 0) {
    const double nv = valid > 1 ? valid : 1.0;
    losses[router_loss::z] = sum / nv;
    *nv_out = nv;
  }
}

template <class R>
__global__ void z_loss_grad_kernel(R* dll, const R* logits, const R* lse, const double* nv, const bool* padding,
                                   int64_t T, int64_t E, double cz) {
  MOECORE_GRID_STRIDE(i, T * E) {
    const int64_t t = i / E;
    if (padding && padding[t]) continue;
    const R k2 = R(2.0 * cz / *nv);
    const R a = k2 * lse[t];
    dll[i] += a * r_exp(logits[i] - lse[t]);
  }
}

__global__ void loss_weighted_kernel(double* l, RouterLossCoeffs c) {
  l[router_loss::weighted] = c.aux * l[router_loss::aux] + c.seq_aux * l[router_loss::seq_aux] +
                             c.global_aux * l[router_loss::global_aux] + c.z * l[router_loss::z];
}

constexpr int kColumnThreads = 1024;

const bool* padding_ptr(const Tensor& padding) {
  return padding.defined() ? Launch::ptr<const bool>(padding) : nullptr;
}

}  // namespace

void router_aux_scores(Tensor& aux_scores, Tensor& aux_map, Tensor& counts, const Tensor& logits, const Tensor& padding,
                       ScoreFunction score_function, int64_t K, const Context& ctx) {
  const Launch l("router_aux_scores", ctx,
                 {{"aux_scores", &aux_scores},
                  {"aux_map", &aux_map},
                  {"counts", &counts},
                  {"logits", &logits},
                  {"padding", &padding}});
  const int64_t T = logits.size(0), E = logits.size(1);
  const bool* pad = padding_ptr(padding);
  with_router_type(logits.dtype(), [&](auto tag) {
    using R = decltype(tag);
    if (T > 0) {
      WorkspaceCarver w;
      w.reserve<int32_t>(T * K);
      w.allocate(l);
      aux_scores_kernel<<<grid_for(T, 64), 64, 0, l.stream()>>>(Launch::ptr<R>(aux_scores), Launch::ptr<R>(aux_map),
                                                                Launch::ptr<const R>(logits), pad,
                                                                w.take<int32_t>(T * K), T, E, K, score_function);
      l.launched("aux_scores_kernel");
    }
    if (!counts.defined()) return;
    MOECORE_CHECK(E < 0x7fffffff, "router_aux_scores (cuda): E = ", E, " columns exceed the grid");
    aux_counts_kernel<<<static_cast<unsigned>(E + 1), kColumnThreads, 0, l.stream()>>>(
        Launch::ptr<int64_t>(counts), Launch::ptr<const R>(aux_map), pad, T, E);
    l.launched("aux_counts_kernel");
  });
}

void router_aux_losses(Tensor& dlogits_loss, Tensor& losses, Tensor& global_tokens, const Tensor& aux_map,
                       const Tensor& logits, const Tensor& counts, const Tensor& padding, const RouterAuxLoss& p,
                       const Context& ctx) {
  const Launch l("router_aux_losses", ctx,
                 {{"dlogits_loss", &dlogits_loss},
                  {"losses", &losses},
                  {"global_tokens", &global_tokens},
                  {"aux_map", &aux_map},
                  {"logits", &logits},
                  {"counts", &counts},
                  {"padding", &padding}});
  const int64_t T = logits.size(0), E = logits.size(1), B = p.B;
  const bool global = p.coeffs.global_aux > 0;
  const bool* pad = padding_ptr(padding);
  WorkspaceCarver w;
  w.reserve<double>(3 * B * E);
  w.reserve<double>(3 * E);
  w.allocate(l);
  double* P = w.take<double>(B * E);
  double* cnt = w.take<double>(B * E);
  double* g = w.take<double>(B * E);
  double* Pt = w.take<double>(E);
  double* ct = w.take<double>(E);
  double* cavg = w.take<double>(E);
  with_router_type(logits.dtype(), [&](auto tag) {
    using R = decltype(tag);
    aux_sums_kernel<<<grid_for(B * E, 64), 64, 0, l.stream()>>>(P, cnt, Launch::ptr<const R>(dlogits_loss),
                                                                Launch::ptr<const R>(aux_map), T, B, E);
    l.launched("aux_sums_kernel");
    aux_tail_kernel<<<1, 1, 0, l.stream()>>>(Launch::ptr<double>(losses),
                                             global ? Launch::ptr<int64_t>(global_tokens) : nullptr, g, Pt, ct, cavg, P,
                                             cnt, global ? Launch::ptr<const int64_t>(counts) : nullptr, pad, T, E, p);
    l.launched("aux_tail_kernel");
    if (T == 0) return;
    aux_backward_kernel<<<grid_for(T, 64), 64, 0, l.stream()>>>(
        Launch::ptr<R>(dlogits_loss), Launch::ptr<const R>(logits), g, pad, T, B, E, p.score_function);
    l.launched("aux_backward_kernel");
  });
}

void router_z_loss(Tensor& dlogits_loss, Tensor& losses, const Tensor& logits, const Tensor& padding, double coeff,
                   const Context& ctx) {
  const Launch l("router_z_loss", ctx,
                 {{"dlogits_loss", &dlogits_loss}, {"losses", &losses}, {"logits", &logits}, {"padding", &padding}});
  const int64_t T = logits.size(0), E = logits.size(1);
  const bool* pad = padding_ptr(padding);
  with_router_type(logits.dtype(), [&](auto tag) {
    using R = decltype(tag);
    WorkspaceCarver w;
    w.reserve<R>(T);
    w.reserve<double>(1);
    w.allocate(l);
    R* lse = w.take<R>(T);
    double* nv = w.take<double>(1);
    if (T > 0 && E > 0) {
      lse_kernel<<<grid_for(T, 64), 64, 0, l.stream()>>>(lse, Launch::ptr<const R>(logits), T, E);
      l.launched("lse_kernel");
    }
    z_loss_sum_kernel<<<1, kColumnThreads, 0, l.stream()>>>(Launch::ptr<double>(losses), nv, lse, pad, T);
    l.launched("z_loss_sum_kernel");
    if (T * E == 0) return;
    z_loss_grad_kernel<<<grid_for(T * E), kThreads, 0, l.stream()>>>(
        Launch::ptr<R>(dlogits_loss), Launch::ptr<const R>(logits), lse, nv, pad, T, E, coeff);
    l.launched("z_loss_grad_kernel");
  });
}

void router_loss_weighted(Tensor& losses, const RouterLossCoeffs& coeffs, const Context& ctx) {
  const Launch l("router_loss_weighted", ctx, {{"losses", &losses}});
  loss_weighted_kernel<<<1, 1, 0, l.stream()>>>(Launch::ptr<double>(losses), coeffs);
  l.launched("loss_weighted_kernel");
}

}  // namespace moecore::ops::cuda
