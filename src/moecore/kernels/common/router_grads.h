// The router's gradient arithmetic, shared by the CPU kernels (cpu/router_topk.cpp, cpu/router_losses.cpp) and the
// CUDA kernels (cuda/router.cu, cuda/router_losses.cu): the routing Jacobian of one token (top-k backward) and the
// scalar tail of the aux losses (loss values and dL/dscores). One source, the same operations in the same order, so
// the CUDA kernels (one thread per token; one thread for the tail) give the CPU's bits wherever their inputs agree.
// Also the aux scores' backward of one token (the losses' gradient through their own scores).
// Not here: the loops over tokens (the backends own them), the per-sequence sums P and cnt (the CPU's token loop, a
// thread per (b, e) column on the device), the z-loss.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>

#include "moecore/kernels/common/router_math.h"

namespace moecore::ops::router_math {

// ---- top-k backward (router_route_backward) ---------------------------------------------------------------------
// The constants of one call: the weights' scale, the loss gradient's scale, and which Jacobian applies.
template <class R>
struct RouteBackward {
  R scale = R(1), loss_scale = R(1);
  bool sinkhorn = false, full_softmax = false, post_softmax = false;
  ScoreFunction sf = ScoreFunction::softmax;
};
template <class R>
MOECORE_HD inline RouteBackward<R> route_backward_consts(const RouterRouting& p, int64_t K, float aux_grad_scale) {
  RouteBackward<R> c;
  c.scale = p.scaling_factor > 0 ? R(p.scaling_factor) : R(1);
  c.loss_scale = R(aux_grad_scale);
  c.sinkhorn = p.sinkhorn;
  c.full_softmax =
      (c.sinkhorn && K > 1) || (!c.sinkhorn && p.score_function == ScoreFunction::softmax && p.pre_softmax);
  c.post_softmax = !c.sinkhorn && p.score_function == ScoreFunction::softmax && !p.pre_softmax;
  c.sf = p.score_function;
  return c;
}
// One token: dl [E] (its dlogits row) written from dp [E] (its dprobs row), the selection idx, w, kept [K], its
// logits z and scores s [E] and its loss gradient dll [E]; dw [K] is scratch. With dw_j = scale * dp[idx_j] for kept
// pairs (0 for dropped ones: probs' = probs * map):
//   post-softmax  dz[idx_j] = w_j (dw_j - sum_i w_i dw_i)            (softmax over the selected logits)
//   pre-softmax   dz = s * (ds - sum_j s_idx_j dw_j), ds = dw scattered  (softmax over all E; sinkhorn k>1)
//   sigmoid-like  dz[idx_j] = f'(z) (dw_j - sum_i dw_i w_i) / (sum sel + 1e-20)   (k == 1: f'(z) dw_j)
// then dz += loss_scale * dll.
template <class R>
MOECORE_HD inline void route_backward_row(R* dl, R* dw, const float* dp, const int32_t* idx, const R* w, const R* z,
                                          const R* s, const bool* kept, const R* dll, int64_t E, int64_t K,
                                          const RouteBackward<R>& c) {
  for (int64_t j = 0; j < K; ++j) dw[j] = kept[j] ? R(dp[idx[j]]) * c.scale : R(0);
  for (int64_t e = 0; e < E; ++e) dl[e] = R(0);
  if (c.full_softmax) {
    R dot = 0;
    for (int64_t j = 0; j < K; ++j) dot += s[idx[j]] * dw[j];
    for (int64_t e = 0; e < E; ++e) dl[e] = -s[e] * dot;
    for (int64_t j = 0; j < K; ++j) dl[idx[j]] += s[idx[j]] * dw[j];
  } else if (c.post_softmax) {
    R dot = 0;
    for (int64_t j = 0; j < K; ++j) dot += w[j] * dw[j];
    for (int64_t j = 0; j < K; ++j) dl[idx[j]] = w[j] * (dw[j] - dot);
  } else if (c.sinkhorn) {  // k == 1: weight = sigmoid(z)
    dl[idx[0]] = dw[0] * s[idx[0]] * (R(1) - s[idx[0]]);
  } else {
    if (K > 1) {
      R sum = 0, dot = 0;
      for (int64_t j = 0; j < K; ++j) sum += s[idx[j]];
      for (int64_t j = 0; j < K; ++j) dot += dw[j] * w[j];
      const R denom = sum + R(1e-20);
      for (int64_t j = 0; j < K; ++j) dw[j] = (dw[j] - dot) / denom;
    }
    for (int64_t j = 0; j < K; ++j) dl[idx[j]] = dw[j] * score_fn_grad(c.sf, z[idx[j]], s[idx[j]]);
  }
  for (int64_t e = 0; e < E; ++e) dl[e] += c.loss_scale * dll[e];
}

// ---- the aux losses' scalar tail (router_aux_losses) ------------------------------------------------------------
// E / (K N^2) * sum_e P_e c_e: one code path for all three losses, so B = 1 seq_aux_loss and the first
// global_aux_loss micro-batch reproduce aux_loss bit for bit.
MOECORE_HD inline double switch_loss(const double* P, const double* c, int64_t E, int64_t K, double N) {
  if (N <= 0) return 0.0;
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) acc += P[e] * c[e];
  return static_cast<double>(E) / (static_cast<double>(K) * N * N) * acc;
}

// From the per-sequence sums P (aux scores) and cnt (routed counts), [B, E] over the n_valid valid tokens, and with
// global_aux_loss the group's counts gc [E + 1] (null otherwise): losses[aux, seq_aux, global_aux] written, the
// global_aux_loss accumulator gtok [E] += gc, and g [B, E] = dL/ds for a token of sequence b (the counts are
// constants). Pt, ct, cavg [E] are scratch. Sums in order on one thread.
MOECORE_HD inline void aux_loss_tail(double* losses, int64_t* gtok, double* g, double* Pt, double* ct, double* cavg,
                                     const double* P, const double* cnt, const int64_t* gc, int64_t n_valid, int64_t E,
                                     const RouterAuxLoss& p) {
  const int64_t K = p.K, B = p.B;
  const double ca = p.coeffs.aux, cs = p.coeffs.seq_aux, cg = p.coeffs.global_aux;
  for (int64_t e = 0; e < E; ++e) {
    Pt[e] = 0, ct[e] = 0;
    for (int64_t b = 0; b < B; ++b) Pt[e] += P[b * E + e], ct[e] += cnt[b * E + e];
  }
  const double N = static_cast<double>(n_valid);
  const double kN2 = N > 0 ? static_cast<double>(E) / (static_cast<double>(K) * N * N) : 0.0;
  double Ng = N, kNg2 = kN2;
  if (cg > 0) {
    // Each rank's partial P with the group's counts and N adds up to the full loss (docs/megatron-moe-spec.md
    // §3.3: TP x DP x CP).
    Ng = static_cast<double>(gc[E]);
    kNg2 = Ng > 0 ? static_cast<double>(E) / (static_cast<double>(K) * Ng * Ng) : 0.0;
    for (int64_t e = 0; e < E; ++e) gtok[e] += gc[e];
    for (int64_t e = 0; e < E; ++e) cavg[e] = static_cast<double>(gtok[e]) / static_cast<double>(p.global_steps);
  }
  // With padding every sequence is normalized by the average valid length (spec §3.3).
  const double Ns = N / static_cast<double>(B);
  const double kNs2 = Ns > 0 ? static_cast<double>(E) / (static_cast<double>(K) * Ns * Ns) : 0.0;
  losses[router_loss::aux] = ca > 0 ? switch_loss(Pt, ct, E, K, N) : 0.0;
  losses[router_loss::seq_aux] = 0.0;
  if (cs > 0) {
    double acc = 0;
    for (int64_t b = 0; b < B; ++b) acc += switch_loss(P + b * E, cnt + b * E, E, K, Ns);
    losses[router_loss::seq_aux] = acc / static_cast<double>(B);
  }
  losses[router_loss::global_aux] = cg > 0 ? switch_loss(Pt, cavg, E, K, Ng) : 0.0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t e = 0; e < E; ++e) {
      double v = 0;
      if (ca > 0) v += ca * kN2 * ct[e];
      if (cs > 0) v += cs * kNs2 * cnt[b * E + e] / static_cast<double>(B);
      if (cg > 0) v += cg * kNg2 * cavg[e];
      g[b * E + e] = v;
    }
}

// The aux scores' backward of one valid token: st [E] (its aux scores on entry) becomes dL/dz from gt [E] = dL/ds of
// its sequence (g of aux_loss_tail) and its logits z [E]:
// softmax: dz = s (ds - <s, ds>); normalized f: dz = f'(z) (ds - <s, ds>) / (sum f + 1e-20).
template <class R>
MOECORE_HD inline void aux_scores_backward_row(R* st, const double* gt, const R* z, int64_t E, ScoreFunction sf) {
  R dot = 0;
  for (int64_t e = 0; e < E; ++e) dot += st[e] * R(gt[e]);
  if (sf == ScoreFunction::softmax) {
    for (int64_t e = 0; e < E; ++e) st[e] = st[e] * (R(gt[e]) - dot);
  } else {
    R sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += score_fn(sf, z[e]);
    const R denom = sum + R(1e-20);
    for (int64_t e = 0; e < E; ++e) {
      const R f = score_fn(sf, z[e]);
      st[e] = score_fn_grad(sf, z[e], f) * (R(gt[e]) - dot) / denom;
    }
  }
}

}  // namespace moecore::ops::router_math
