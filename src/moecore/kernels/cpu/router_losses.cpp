// CPU router losses (ops_router.h, docs/megatron-moe-spec.md §3): aux_loss, seq_aux_loss and global_aux_loss on their
// own recomputed scores and top-k map (§3.1: no bias, groups, capacity or scaling), the z-loss (§3.5), and the exact
// gradient of their weighted sum with respect to the logits. Sums over tokens run in token order (in double),
// so values never depend on the thread count. On a cuda context every op dispatches to kernels/cuda/router_losses.cu
// after its checks.
// Not here: the all-reduce of global_aux_loss's counts (moe/router_losses.cpp calls it between the ops),
// calculate_per_token_loss or MTP scaling (moecore does neither).
#include "moecore/kernels/common/router_grads.h"
#include "moecore/kernels/cpu/router_util.h"

namespace moecore::ops {
namespace {

using cpu::router::kParallelWork;
using cpu::router::score_fn;
using cpu::router::score_fn_grad;
using cpu::router::scratch;

template <class R>
void aux_scores_kernel(R* s, R* m, const R* logits, const bool* padding, int64_t T, int64_t E, int64_t K,
                       ScoreFunction sf) {
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
      cpu::router::softmax_row(st, z, E);
    } else {
      R sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (st[e] = score_fn(sf, z[e]));
      for (int64_t e = 0; e < E; ++e) st[e] /= sum + R(1e-20);
    }
    int32_t* idx = scratch<int32_t, 20>(static_cast<size_t>(K));
    cpu::router::topk(idx, st, E, K);
    for (int64_t j = 0; j < K; ++j) mt[idx[j]] = R(1);
  }
}

// Overwrites the aux scores in s with dL/dz for valid rows, where dL/ds[t, e] = g[b(t) * E + e] and b(t) = t % B
// is the sequence of token t (sequence-major tokens, t = s * B + b): kernels/common/router_grads.h, per row.
template <class R>
void aux_scores_backward(R* s, const R* logits, const double* g, const bool* padding, int64_t T, int64_t B, int64_t E,
                         ScoreFunction sf) {
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    R* st = s + t * E;
    if (padding && padding[t]) continue;  // already zero
    router_math::aux_scores_backward_row(st, g + (t % B) * E, logits + t * E, E, sf);
  }
}

// The aux losses and their gradient; dll holds the aux scores on entry (router_aux_losses' contract). gc: the
// group's counts [E + 1] (null without global_aux_loss), gtok: the global_aux_loss accumulator.
template <class R>
void aux_losses_kernel(R* dll, double* losses, int64_t* gtok, const R* m, const R* logits, const int64_t* gc,
                       const bool* padding, int64_t T, int64_t E, const RouterAuxLoss& p) {
  const int64_t B = p.B;
  const int64_t n_valid = cpu::router::valid_tokens(padding, T);
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
  double* g = scratch<double, 26>(static_cast<size_t>(B * E));
  router_math::aux_loss_tail(losses, gtok, g, Pt, ct, cavg, P, cnt, gc, n_valid, E, p);
  aux_scores_backward(dll, logits, g, padding, T, B, E, p.score_function);
}

template <class R>
void z_loss_kernel(R* dll, double* losses, const R* logits, const bool* padding, int64_t T, int64_t E, double cz) {
  R* lse = scratch<R, 27>(static_cast<size_t>(T));
#pragma omp parallel for schedule(static) if (T * E > kParallelWork)
  for (int64_t t = 0; t < T; ++t) lse[t] = cpu::router::logsumexp_row(logits + t * E, E);
  double sum = 0;
  for (int64_t t = 0; t < T; ++t)
    if (!(padding && padding[t])) sum += static_cast<double>(lse[t]) * static_cast<double>(lse[t]);
  const double nv = static_cast<double>(std::max<int64_t>(cpu::router::valid_tokens(padding, T), 1));
  losses[router_loss::z] = sum / nv;
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

void check_losses(const cpu::Checker& ck) {
  cpu::router::check_arg(ck, "losses", Shape{router_loss::count}, DType::f64);
}

}  // namespace

void router_aux_scores(Tensor& aux_scores, Tensor& aux_map, Tensor& counts, const Tensor& logits, const Tensor& padding,
                       ScoreFunction score_function, int64_t K, const Context& ctx) {
  const cpu::Checker ck("router_aux_scores", ctx,
                        {{"aux_scores", &aux_scores}, {"aux_map", &aux_map}, {"logits", &logits}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("logits", 2);
  const int64_t T = logits.size(0), E = logits.size(1);
  const DType rt = cpu::router::router_dtype(ck, "logits", T, E);
  for (const char* name : {"aux_scores", "aux_map"}) cpu::router::check_arg(ck, name, Shape{T, E}, rt);
  cpu::router::check_optional(ck, ctx, "counts", counts, Shape{E + 1}, DType::i64);
  if (K < 1 || K > E) ck.fail("top-k K = ", K, " must lie in [1, E = ", E, "]");
  cpu::router::check_optional(ck, ctx, "padding", padding, Shape{T}, DType::boolean);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::router_aux_scores(aux_scores, aux_map, counts, logits, padding, score_function, K, ctx);
  const bool* pad = cpu::router::padding_of(ck, ctx, padding, T);
  cpu::router::with_router_type(rt, [&](auto tag) {
    using R = decltype(tag);
    const R* m = aux_map.data<R>();
    aux_scores_kernel(aux_scores.data<R>(), aux_map.data<R>(), logits.data<R>(), pad, T, E, K, score_function);
    if (!counts.defined()) return;
    int64_t* c = counts.data<int64_t>();
    std::fill(c, c + E, int64_t{0});
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) c[e] += m[t * E + e] != R(0) ? 1 : 0;
    c[E] = cpu::router::valid_tokens(pad, T);
  });
}

void router_aux_losses(Tensor& dlogits_loss, Tensor& losses, Tensor& global_tokens, const Tensor& aux_map,
                       const Tensor& logits, const Tensor& counts, const Tensor& padding, const RouterAuxLoss& p,
                       const Context& ctx) {
  const cpu::Checker ck(
      "router_aux_losses", ctx,
      {{"dlogits_loss", &dlogits_loss}, {"losses", &losses}, {"aux_map", &aux_map}, {"logits", &logits}},
      cpu::Backends::cpu_and_cuda);
  ck.rank("logits", 2);
  const int64_t T = logits.size(0), E = logits.size(1);
  const DType rt = cpu::router::router_dtype(ck, "logits", T, E);
  for (const char* name : {"dlogits_loss", "aux_map"}) cpu::router::check_arg(ck, name, Shape{T, E}, rt);
  check_losses(ck);
  if (p.K < 1 || p.K > E) ck.fail("top-k K = ", p.K, " must lie in [1, E = ", E, "]");
  if (p.B < 1 || T % p.B != 0) ck.fail("B = ", p.B, " sequences must divide the ", T, " tokens");
  if (p.coeffs.aux < 0 || p.coeffs.seq_aux < 0 || p.coeffs.global_aux < 0)
    ck.fail("loss coefficients must not be negative: aux ", p.coeffs.aux, ", seq_aux ", p.coeffs.seq_aux,
            ", global_aux ", p.coeffs.global_aux);
  const bool global = p.coeffs.global_aux > 0;
  if (global && (!counts.defined() || !global_tokens.defined() || p.global_steps < 1))
    ck.fail("global_aux_loss needs counts [", E + 1, "] i64, global_tokens [", E, "] i64 and global_steps >= 1 (got ",
            p.global_steps, ")");
  cpu::router::check_optional(ck, ctx, "counts", counts, Shape{E + 1}, DType::i64);
  cpu::router::check_optional(ck, ctx, "global_tokens", global_tokens, Shape{E}, DType::i64);
  cpu::router::check_optional(ck, ctx, "padding", padding, Shape{T}, DType::boolean);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::router_aux_losses(dlogits_loss, losses, global_tokens, aux_map, logits, counts, padding, p, ctx);
  const bool* pad = cpu::router::padding_of(ck, ctx, padding, T);
  cpu::router::with_router_type(rt, [&](auto tag) {
    using R = decltype(tag);
    aux_losses_kernel(dlogits_loss.data<R>(), losses.data<double>(), global ? global_tokens.data<int64_t>() : nullptr,
                      aux_map.data<R>(), logits.data<R>(), global ? counts.data<int64_t>() : nullptr, pad, T, E, p);
  });
}

void router_z_loss(Tensor& dlogits_loss, Tensor& losses, const Tensor& logits, const Tensor& padding, double coeff,
                   const Context& ctx) {
  const cpu::Checker ck("router_z_loss", ctx,
                        {{"dlogits_loss", &dlogits_loss}, {"losses", &losses}, {"logits", &logits}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("logits", 2);
  const int64_t T = logits.size(0), E = logits.size(1);
  const DType rt = cpu::router::router_dtype(ck, "logits", T, E);
  cpu::router::check_arg(ck, "dlogits_loss", Shape{T, E}, rt);
  check_losses(ck);
  if (coeff < 0) ck.fail("coeff (--moe-z-loss-coeff) = ", coeff, " is negative");
  cpu::router::check_optional(ck, ctx, "padding", padding, Shape{T}, DType::boolean);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_z_loss(dlogits_loss, losses, logits, padding, coeff, ctx);
  const bool* pad = cpu::router::padding_of(ck, ctx, padding, T);
  cpu::router::with_router_type(rt, [&](auto tag) {
    using R = decltype(tag);
    z_loss_kernel(dlogits_loss.data<R>(), losses.data<double>(), logits.data<R>(), pad, T, E, coeff);
  });
}

void router_loss_weighted(Tensor& losses, const RouterLossCoeffs& c, const Context& ctx) {
  const cpu::Checker ck("router_loss_weighted", ctx, {{"losses", &losses}}, cpu::Backends::cpu_and_cuda);
  check_losses(ck);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_loss_weighted(losses, c, ctx);
  double* l = losses.data<double>();
  l[router_loss::weighted] = c.aux * l[router_loss::aux] + c.seq_aux * l[router_loss::seq_aux] +
                             c.global_aux * l[router_loss::global_aux] + c.z * l[router_loss::z];
}

}  // namespace moecore::ops
