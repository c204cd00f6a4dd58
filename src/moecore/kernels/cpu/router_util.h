// Private helpers of the CPU router kernels (router_*.cpp): the score functions and the deterministic top-k (from
// kernels/common/router_math.h), a per-thread scratch of their own, and the entry checks shared by the router ops.
// No kernels here. Only kernels/cpu/router_*.cpp include this.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moecore/kernels/common/router_math.h"
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

// The per-row arithmetic, shared with the CUDA kernels (kernels/common/router_math.h).
using router_math::logsumexp_row;
using router_math::score_fn;
using router_math::score_fn_grad;
using router_math::sigmoid;
using router_math::softmax_row;
using router_math::softplus;
using router_math::topk;

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
