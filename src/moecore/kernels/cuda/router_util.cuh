// Private device helpers of the CUDA router kernels (router.cu, router_losses.cu): the router dtype's math, the score
// functions and the deterministic top-k of cpu/router_util.h, written out again for the device with the same
// operations in the same order (so selections equal the CPU's wherever the scores do). No kernels here.
#pragma once
#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda::router {

__device__ __forceinline__ float r_exp(float x) {
  return expf(x);
}
__device__ __forceinline__ double r_exp(double x) {
  return exp(x);
}
__device__ __forceinline__ float r_log(float x) {
  return logf(x);
}
__device__ __forceinline__ double r_log(double x) {
  return log(x);
}
__device__ __forceinline__ float r_log1p(float x) {
  return log1pf(x);
}
__device__ __forceinline__ double r_log1p(double x) {
  return log1p(x);
}
__device__ __forceinline__ float r_sqrt(float x) {
  return sqrtf(x);
}
__device__ __forceinline__ double r_sqrt(double x) {
  return sqrt(x);
}

template <class R>
__device__ __forceinline__ R sigmoid(R z) {
  if (z >= R(0)) return R(1) / (R(1) + r_exp(-z));
  const R e = r_exp(z);
  return e / (R(1) + e);
}
template <class R>
__device__ __forceinline__ R softplus(R z) {
  return (z > R(0) ? z : R(0)) + r_log1p(r_exp(-(z < R(0) ? -z : z)));
}
template <class R>
__device__ __forceinline__ R score_fn(ScoreFunction f, R z) {
  return f == ScoreFunction::sigmoid ? sigmoid(z) : r_sqrt(softplus(z));
}
template <class R>
__device__ __forceinline__ R score_fn_grad(ScoreFunction f, R z, R fz) {
  if (f == ScoreFunction::sigmoid) return fz * (R(1) - fz);
  return fz > R(0) ? sigmoid(z) / (R(2) * fz) : R(0);
}

template <class R>
__device__ void softmax_row(R* out, const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = z[i] > mx ? z[i] : mx;
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = r_exp(z[i] - mx));
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}
template <class R>
__device__ R logsumexp_row(const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = z[i] > mx ? z[i] : mx;
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += r_exp(z[i] - mx);
  return mx + r_log(sum);
}

// cpu::router::topk: the k largest allowed values, descending, ties to the lower index.
template <class R>
__device__ void topk(int32_t* idx, const R* v, int64_t n, int64_t k, const uint8_t* allowed = nullptr) {
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

// Calls fn(R{}) with R = float or double for a router dtype already checked to be f32 or f64.
template <class Fn>
decltype(auto) with_router_type(DType t, Fn&& fn) {
  if (t == DType::f64) return fn(double{});
  return fn(float{});
}

}  // namespace moecore::ops::cuda::router
