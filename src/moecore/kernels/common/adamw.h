// AdamW's arithmetic, shared by the CPU kernel (cpu/optimizer.cpp) and the CUDA kernel (cuda/elementwise.cu): the
// per-step constants (computed once on the host, in double) and the update of one element in f32. Not here: the
// moments' storage type (f32 or bf16: each backend loads and stores them), the loops.
#pragma once
#include <cmath>

#include "moecore/kernels/common/hd.h"
#include "moecore/kernels/ops.h"

namespace moecore::ops::adamw {

// Per-step constants, computed in double so that bias corrections near 0 (step 1, beta2 = 0.999) keep
// their digits. The update is PyTorch's: p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
struct Consts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_sqrt_bc2, grad_scale;
  explicit Consts(const AdamWParams& p) {
    const double t = static_cast<double>(p.step);
    const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), t);
    const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), t);
    beta1 = p.beta1;
    one_minus_beta1 = 1.0f - p.beta1;
    beta2 = p.beta2;
    one_minus_beta2 = 1.0f - p.beta2;
    eps = p.eps;
    decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
    step_size = static_cast<float>(p.lr / bc1);
    inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    grad_scale = p.grad_scale;
  }
};

// One element, step by step so that each backend loads and stores the moments (f32 or bf16) where it did: the
// scaled gradient g, the new moments from the loaded ones, then the new parameter from them.
MOECORE_HD_FORCEINLINE float scaled_grad(float grad, const Consts& k) {
  return grad * k.grad_scale;
}
MOECORE_HD_FORCEINLINE float first_moment(float m, float g, const Consts& k) {
  return k.beta1 * m + k.one_minus_beta1 * g;
}
MOECORE_HD_FORCEINLINE float second_moment(float v, float g, const Consts& k) {
  return k.beta2 * v + k.one_minus_beta2 * g * g;
}
MOECORE_HD_FORCEINLINE float param(float p, float m, float v, const Consts& k) {
#ifdef __CUDA_ARCH__
  const float denom = sqrtf(v) * k.inv_sqrt_bc2 + k.eps;
#else
  const float denom = std::sqrt(v) * k.inv_sqrt_bc2 + k.eps;
#endif
  return p * k.decay - k.step_size * m / denom;
}

}  // namespace moecore::ops::adamw
