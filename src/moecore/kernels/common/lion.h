// Lion's arithmetic (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; emerging_optimizers' Lion, the
// scalar optimizer of Megatron's --muon-scalar-optimizer lion), shared by the CPU kernel (cpu/optimizer.cpp) and the
// CUDA kernel (cuda/elementwise.cu): the per-step constants (computed once on the host, in double) and the update of
// one element in f32. Not here: which parameters take it and the clip scale (optim/lion.h).
#pragma once

#include "moecore/kernels/common/hd.h"
#include "moecore/kernels/ops.h"

namespace moecore::ops::lion {

struct Consts {
  float beta1, one_minus_beta1, one_minus_beta2, decay, lr, grad_scale;
  explicit Consts(const LionParams& p)
      : beta1(p.beta1),
        one_minus_beta1(static_cast<float>(1.0 - static_cast<double>(p.beta1))),
        one_minus_beta2(static_cast<float>(1.0 - static_cast<double>(p.beta2))),
        decay(static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay)),
        lr(p.lr),
        grad_scale(p.grad_scale) {}
};

// The direction of the step: sign(beta1 * m + (1 - beta1) * g) (0 at 0; a NaN stays NaN, as torch.sign).
MOECORE_HD_FORCEINLINE float direction(float m, float g, const Consts& k) {
  const float c = k.beta1 * m + k.one_minus_beta1 * g;
  return c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : c;
}
// The new momentum: m moved towards g by 1 - beta2 (torch's lerp below weight 0.5).
MOECORE_HD_FORCEINLINE float momentum(float m, float g, const Consts& k) {
  return m + k.one_minus_beta2 * (g - m);
}
// The decoupled decay first, then the signed step.
MOECORE_HD_FORCEINLINE float param(float p, float direction, const Consts& k) {
  return p * k.decay - k.lr * direction;
}

}  // namespace moecore::ops::lion
