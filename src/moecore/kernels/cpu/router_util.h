// Private helpers of the CPU router kernels (router_*.cpp): score functions in the router dtype, the
// deterministic top-k, a per-thread scratch of their own, and the entry checks shared by the router ops.
// No kernels here. Only kernels/cpu/router_*.cpp include this.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/ops_router.h"

namespace moecore::ops::cpu::router {

// Below this many [T, E] elements a router pass runs on the calling thread.
inline constexpr int64_t kParallelWork = 1 << 14;

// Grow-only buffer owned by the calling thread (OpenMP threads persist, so after the first step no call
// allocates). Slot separates buffers that are live at the same time; this template is the router's own, so its
// slots never meet those of other kernels.
template <class T, int Slot>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <class R>
inline R sigmoid(R z) {
  if (z >= R(0)) return R(1) / (R(1) + std::exp(-z));
  const R e = std::exp(z);
  return e / (R(1) + e);
}
template <class R>
inline R softplus(R z) {
  return std::max(z, R(0)) + std::log1p(std::exp(-std::fabs(z)));
}
// The sigmoid-family score f(z) and its derivative given f (sqrtsoftplus' = sigmoid / (2 f), -> 0 as f -> 0).
template <class R>
inline R score_fn(ScoreFunction f, R z) {
  return f == ScoreFunction::sigmoid ? sigmoid(z) : std::sqrt(softplus(z));
}
template <class R>
inline R score_fn_grad(ScoreFunction f, R z, R fz) {
  if (f == ScoreFunction::sigmoid) return fz * (R(1) - fz);
  return fz > R(0) ? sigmoid(z) / (R(2) * fz) : R(0);
}

template <class R>
inline void softmax_row(R* out, const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, z[i]);
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(z[i] - mx));
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}
template <class R>
inline R logsumexp_row(const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, z[i]);
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(z[i] - mx);
  return mx + std::log(sum);
}

// The k largest of v[0, n) whose allowed[i] != 0 (all when allowed is null), written to idx in descending
// order. Ties go to the lower index: an element enters only if strictly larger than one already held, and is
// placed after equal ones.
template <class R>
inline void topk(int32_t* idx, const R* v, int64_t n, int64_t k, const uint8_t* allowed = nullptr) {
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
    held = std::min(held + 1, k);
  }
}

// Calls fn(R{}) with R = float or double for a router dtype already checked to be f32 or f64.
template <class Fn>
decltype(auto) with_router_type(DType t, Fn&& fn) {
  if (t == DType::f64) return fn(double{});
  return fn(float{});
}

// The Checker argument `name`: contiguous, of shape s and dtype t.
inline void check_arg(const Checker& ck, const char* name, const Shape& s, DType t) {
  ck.shape(name, s);
  ck.dtype(name, t);
  ck.contiguous(name);
}
// The router dtype R of the Checker argument `name` (f32 or f64), which must be [rows, cols] and contiguous.
inline DType router_dtype(const Checker& ck, const char* name, int64_t rows, int64_t cols) {
  const DType r = ck.get(name).dtype();
  if (r != DType::f32 && r != DType::f64) ck.fail(name, " must be f32 or f64 (the router dtype), got ", dtype_name(r));
  check_arg(ck, name, Shape{rows, cols}, r);
  return r;
}
// An optional argument (undefined: absent). The Checker opens the op's device scope but lists only the required
// arguments, so these failures name the optional one themselves.
inline void check_optional(const Checker& ck, const Context& ctx, const char* name, const Tensor& t, const Shape& s,
                           DType dt) {
  if (!t.defined()) return;
  if (t.device() != ctx.device)
    ck.fail(name, " ", t.str(), " is on ", device_name(t.device()), " but the op runs on ", device_name(ctx.device));
  if (!(t.shape() == s)) ck.fail(name, " must have shape ", s.str(), ", got ", t.shape().str());
  if (t.dtype() != dt) ck.fail(name, " must be ", dtype_name(dt), ", got ", dtype_name(t.dtype()));
  if (!t.is_contiguous()) ck.fail(name, " ", t.str(), " must be contiguous");
}
// The padding mask [T] bool of a router op, or null for none.
inline const bool* padding_of(const Checker& ck, const Context& ctx, const Tensor& padding, int64_t T) {
  check_optional(ck, ctx, "padding", padding, Shape{T}, DType::boolean);
  return padding.defined() ? padding.data<bool>() : nullptr;
}
inline int64_t valid_tokens(const bool* padding, int64_t T) {
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t) n += (padding && padding[t]) ? 0 : 1;
  return n;
}

}  // namespace moecore::ops::cpu::router
