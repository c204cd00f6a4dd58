// The router's per-row arithmetic, shared by the CPU kernels (cpu/router_*.cpp, through cpu/router_util.h) and the
// CUDA kernels (cuda/router*.cu, through cuda/router_util.cuh): the router dtype's math functions, the score functions
// and their derivative, the row softmax and log-sum-exp, and the deterministic top-k. One source, the same operations
// in the same order, so both backends select the same experts wherever their scores agree.
// Not here: loops over tokens, threads or kernels (the backends own those), the losses' tail (router_grads.h).
#pragma once
#include <cmath>
#include <cstdint>

#include "moecore/kernels/common/hd.h"
#include "moecore/kernels/ops_router.h"

namespace moecore::ops::router_math {

// exp, log, log1p and sqrt in the router dtype R (float or double): the C++ library on the host, CUDA's on the device.
#ifdef __CUDA_ARCH__
MOECORE_HD_FORCEINLINE float r_exp(float x) {
  return expf(x);
}
MOECORE_HD_FORCEINLINE double r_exp(double x) {
  return exp(x);
}
MOECORE_HD_FORCEINLINE float r_log(float x) {
  return logf(x);
}
MOECORE_HD_FORCEINLINE double r_log(double x) {
  return log(x);
}
MOECORE_HD_FORCEINLINE float r_log1p(float x) {
  return log1pf(x);
}
MOECORE_HD_FORCEINLINE double r_log1p(double x) {
  return log1p(x);
}
MOECORE_HD_FORCEINLINE float r_sqrt(float x) {
  return sqrtf(x);
}
MOECORE_HD_FORCEINLINE double r_sqrt(double x) {
  return sqrt(x);
}
#else
template <class R>
inline R r_exp(R x) {
  return std::exp(x);
}
template <class R>
inline R r_log(R x) {
  return std::log(x);
}
template <class R>
inline R r_log1p(R x) {
  return std::log1p(x);
}
template <class R>
inline R r_sqrt(R x) {
  return std::sqrt(x);
}
#endif

template <class R>
MOECORE_HD_FORCEINLINE R sigmoid(R z) {
  if (z >= R(0)) return R(1) / (R(1) + r_exp(-z));
  const R e = r_exp(z);
  return e / (R(1) + e);
}
// max(z, 0) + log1p(exp(-|z|)).
template <class R>
MOECORE_HD_FORCEINLINE R softplus(R z) {
  return (z > R(0) ? z : R(0)) + r_log1p(r_exp(-(z < R(0) ? -z : z)));
}
// The sigmoid-family score f(z) and its derivative given f (sqrtsoftplus' = sigmoid / (2 f), -> 0 as f -> 0).
template <class R>
MOECORE_HD_FORCEINLINE R score_fn(ScoreFunction f, R z) {
  return f == ScoreFunction::sigmoid ? sigmoid(z) : r_sqrt(softplus(z));
}
template <class R>
MOECORE_HD_FORCEINLINE R score_fn_grad(ScoreFunction f, R z, R fz) {
  if (f == ScoreFunction::sigmoid) return fz * (R(1) - fz);
  return fz > R(0) ? sigmoid(z) / (R(2) * fz) : R(0);
}

// out [n] = softmax(z [n]), the maximum subtracted first.
template <class R>
MOECORE_HD inline void softmax_row(R* out, const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = z[i] > mx ? z[i] : mx;
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = r_exp(z[i] - mx));
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}
template <class R>
MOECORE_HD inline R logsumexp_row(const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = z[i] > mx ? z[i] : mx;
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += r_exp(z[i] - mx);
  return mx + r_log(sum);
}

// The k largest of v[0, n) whose allowed[i] != 0 (all when allowed is null), written to idx in descending
// order. Ties go to the lower index: an element enters only if strictly larger than one already held, and is
// placed after equal ones.
template <class R>
MOECORE_HD inline void topk(int32_t* idx, const R* v, int64_t n, int64_t k, const uint8_t* allowed = nullptr) {
  int64_t held = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (allowed && !allowed[i]) continue;
    if (held == k && !(v[i] > v[idx[k - 1]])) continue;
    int64_t p = held < k ? held : k - 1;
    while (p > 0 && v[idx[p - 1]] < v[i]) {
      idx[p] = idx[p - 1];
      --p;
    }
    idx[p] = static_cast<int32_t>(i);
    held = held + 1 < k ? held + 1 : k;
  }
}

}  // namespace moecore::ops::router_math
