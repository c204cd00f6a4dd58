// Private device helpers of the CUDA router kernels (router.cu, router_losses.cu): the router dtype's math, the score
// functions and the deterministic top-k, the CPU's own (kernels/common/router_math.h: one source, the same operations
// in the same order, so selections equal the CPU's wherever the scores do). No kernels here.
#pragma once
#include "moecore/kernels/common/router_math.h"
#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda::router {

using router_math::logsumexp_row;
using router_math::r_exp;
using router_math::r_log;
using router_math::r_log1p;
using router_math::r_sqrt;
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

}  // namespace moecore::ops::cuda::router
