// Router losses (spec §3): aux_loss, seq_aux_loss and global_aux_loss on their own recomputed scores and
// top-k map (§3.1: no bias, groups, capacity or scaling), the z-loss (§3.5), and the exact gradient of
// their weighted sum with respect to the logits. Single process: every reduction group has size 1.
// Sums over tokens run in token order (in double), so values never depend on the thread count.
// Not here: calculate_per_token_loss or MTP scaling (moecore does neither).
#include "moecore/moe/router_internal.h"

namespace moecore::moe::router_detail {
namespace {

// E / (K N^2) * sum_e P_e c_e: one code path for all three losses, so B = 1 seq_aux_loss and the first
// global_aux_loss micro-batch reproduce aux_loss bit for bit.
double switch_loss(const double* P, const double* c, int64_t E, int64_t K, double N) {
  if (N <= 0) return 0.0;
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) acc += P[e] * c[e];
  return static_cast<double>(E) / (static_cast<double>(K) * N * N) * acc;
}

// Aux scores (softmax, or normalized sigmoid / sqrtsoftplus) of the valid rows into s, their top-k map
// (1/0) into m; padding rows are zero in both.
template <class R>
void aux_scores(R* s, R* m, const R* logits, const bool* padding, int64_t T, int64_t E, int64_t K, ScoreFunction sf) {
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    R* st = s + t * E;
    R* mt = m + t * E;
    std::fill(mt, mt + E, R(0));
    if (padding && padding[t]) {
      std::fill(st, st + E, R(0));
      continue;
    }
    const R* z = logits + t * E;
    if (sf == ScoreFunction::softmax) {
      softmax_row(st, z, E);
    } else {
      R sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (st[e] = score_fn(sf, z[e]));
      for (int64_t e = 0; e < E; ++e) st[e] /= sum + R(1e-20);
    }
    int32_t* idx = scratch<int32_t, 20>(static_cast<size_t>(K));
    topk(idx, st, E, K);
    for (int64_t j = 0; j < K; ++j) mt[idx[j]] = R(1);
  }
}

// Overwrites the aux scores in s with dL/dz for valid rows, where dL/ds[t, e] = g[b(t) * E + e] and b(t) = t % B
// is the sequence of token t (sequence-major tokens, t = s * B + b):
// softmax: dz = s (ds - <s, ds>); normalized f: dz = f'(z) (ds - <s, ds>) / (sum f + 1e-20).
template <class R>
void aux_scores_backward(R* s, const R* logits, const double* g, const bool* padding, int64_t T, int64_t B, int64_t E,
                         ScoreFunction sf) {
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    R* st = s + t * E;
    if (padding && padding[t]) continue;  // already zero
    const double* gt = g + (t % B) * E;
    const R* z = logits + t * E;
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
}

}  // namespace

template <class R>
void router_losses(RouterStats& stats, RouterState& st, RouterCache& c, const bool* padding, const RouterDims& d,
                   const MoeConfig& cfg) {
  const int64_t T = d.T, E = d.E, K = d.K, B = d.B;
  const R* logits = c.logits.data<R>();
  R* dll = c.dlogits_loss.data<R>();
  int64_t n_valid = 0;
  for (int64_t t = 0; t < T; ++t) n_valid += (padding && padding[t]) ? 0 : 1;
  const double ca = cfg.coeff(LoadBalancing::aux_loss), cs = cfg.coeff(LoadBalancing::seq_aux_loss),
               cg = cfg.coeff(LoadBalancing::global_aux_loss), cz = cfg.z_loss_coeff;
  const bool any_aux = ca > 0 || cs > 0 || cg > 0;

  if (any_aux) {
    R* m = c.dlogits.data<R>();  // the backward workspace is free during forward
    aux_scores(dll, m, logits, padding, T, E, K, cfg.score_function);
    // Per sequence b and expert e: P = sum of scores, cnt = routed count (valid tokens only). Tokens are
    // sequence-major (t = s * B + b, Megatron's [S, B] flattening), so token t belongs to sequence t % B
    // (Megatron's [S*B, E] -> [S, B*E] view). Rows in order, contiguous over experts: a column-wise walk
    // would touch a new cache line per element.
    double* P = scratch<double, 21>(static_cast<size_t>(B * E));
    double* cnt = scratch<double, 22>(static_cast<size_t>(B * E));
    std::fill(P, P + B * E, 0.0);
    std::fill(cnt, cnt + B * E, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      double* Pb = P + (t % B) * E;
      double* cb = cnt + (t % B) * E;
      const R* srow = dll + t * E;
      const R* mrow = m + t * E;
      for (int64_t e = 0; e < E; ++e) {
        Pb[e] += static_cast<double>(srow[e]);
        cb[e] += static_cast<double>(mrow[e]);
      }
    }
    double* Pt = scratch<double, 23>(static_cast<size_t>(E));
    double* ct = scratch<double, 24>(static_cast<size_t>(E));
    double* cavg = scratch<double, 25>(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      Pt[e] = 0, ct[e] = 0;
      for (int64_t b = 0; b < B; ++b) Pt[e] += P[b * E + e], ct[e] += cnt[b * E + e];
    }
    const double N = static_cast<double>(n_valid);
    const double kN2 = N > 0 ? static_cast<double>(E) / (static_cast<double>(K) * N * N) : 0.0;
    double Ng = N, kNg2 = kN2;
    if (cg > 0) {
      // Counts (and the valid-token count) of this micro-batch summed over the data-parallel group (spec
      // §3.3: TP x DP x CP); each rank's partial P with the global counts and N adds up to the full loss.
      int64_t* cg_local = scratch<int64_t, 28>(static_cast<size_t>(E + 1));
      for (int64_t e = 0; e < E; ++e) cg_local[e] = static_cast<int64_t>(ct[e]);
      cg_local[E] = n_valid;
      if (d.global_aux_group && d.global_aux_group->size() > 1)
        all_reduce_sum(std::span<int64_t>(cg_local, static_cast<size_t>(E + 1)), *d.global_aux_group);
      Ng = static_cast<double>(cg_local[E]);
      kNg2 = Ng > 0 ? static_cast<double>(E) / (static_cast<double>(K) * Ng * Ng) : 0.0;
      for (int64_t e = 0; e < E; ++e) st.global_tokens_per_expert[e] += cg_local[e];
      st.global_aux_steps += 1;
      for (int64_t e = 0; e < E; ++e)
        cavg[e] = static_cast<double>(st.global_tokens_per_expert[e]) / static_cast<double>(st.global_aux_steps);
    }
    // With padding every sequence is normalized by the average valid length (Megatron §3.3).
    const double Ns = N / static_cast<double>(B);
    const double kNs2 = Ns > 0 ? static_cast<double>(E) / (static_cast<double>(K) * Ns * Ns) : 0.0;
    if (ca > 0) stats.aux_loss = switch_loss(Pt, ct, E, K, N);
    if (cs > 0) {
      double acc = 0;
      for (int64_t b = 0; b < B; ++b) acc += switch_loss(P + b * E, cnt + b * E, E, K, Ns);
      stats.seq_aux_loss = acc / static_cast<double>(B);
    }
    if (cg > 0) stats.global_aux_loss = switch_loss(Pt, cavg, E, K, Ng);
    // dL/ds[t, e] for a token of sequence b (the counts are constants).
    double* g = scratch<double, 26>(static_cast<size_t>(B * E));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t e = 0; e < E; ++e) {
        double v = 0;
        if (ca > 0) v += ca * kN2 * ct[e];
        if (cs > 0) v += cs * kNs2 * cnt[b * E + e] / static_cast<double>(B);
        if (cg > 0) v += cg * kNg2 * cavg[e];
        g[b * E + e] = v;
      }
    aux_scores_backward(dll, logits, g, padding, T, B, E, cfg.score_function);
  } else {
    std::fill(dll, dll + T * E, R(0));
  }

  if (cz > 0) {
    R* lse = scratch<R, 27>(static_cast<size_t>(T));
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
    for (int64_t t = 0; t < T; ++t) lse[t] = logsumexp_row(logits + t * E, E);
    double sum = 0;
    for (int64_t t = 0; t < T; ++t)
      if (!(padding && padding[t])) sum += static_cast<double>(lse[t]) * static_cast<double>(lse[t]);
    const double nv = static_cast<double>(std::max<int64_t>(n_valid, 1));
    stats.z_loss = sum / nv;
    // d(cz * mean lse^2)/dz = cz * 2 lse softmax(z) / n_valid.
    const R k2 = R(2.0 * cz / nv);
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
    for (int64_t t = 0; t < T; ++t) {
      if (padding && padding[t]) continue;
      const R* z = logits + t * E;
      R* dl = dll + t * E;
      const R a = k2 * lse[t];
      for (int64_t e = 0; e < E; ++e) dl[e] += a * std::exp(z[e] - lse[t]);
    }
  }
  stats.weighted_loss = ca * stats.aux_loss + cs * stats.seq_aux_loss + cg * stats.global_aux_loss + cz * stats.z_loss;
}

template void router_losses<float>(RouterStats&, RouterState&, RouterCache&, const bool*, const RouterDims&,
                                   const MoeConfig&);
template void router_losses<double>(RouterStats&, RouterState&, RouterCache&, const bool*, const RouterDims&,
                                    const MoeConfig&);

}  // namespace moecore::moe::router_detail
