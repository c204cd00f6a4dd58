// The gated linear unit of an MLP's fused fc1 output [gate | up], shared by the CPU and the CUDA kernels (cpu/
// elementwise.cpp, cuda/elementwise.cu): Megatron's glu with its activation (SiLU for --swiglu, quick-GELU for
// --quick-geglu), --glu-linear-offset and --activation-func-clamp-value:
//   g' = min(g, c), u' = clamp(u, -c, c)   (c: the clamp value; none when 0)
//   out = g' sigmoid(alpha g') (u' + offset)          alpha 1 (SiLU) or 1.702 (quick-GELU)
// The clamps pass the gradient where they do not bind (torch.clamp's rule: also at the bound). The backend supplies
// its sigmoid, so each keeps its own exp; the rest is one source for both.
#pragma once
#include <cstdint>

#include "moecore/kernels/common/hd.h"

namespace moecore::ops {

struct GluParams {
  float alpha = 1.0f;   // the activation's sigmoid slope: 1 = SiLU (SwiGLU), 1.702 = quick-GELU (GPT-OSS)
  float offset = 0.0f;  // --glu-linear-offset: added to the linear half
  float clamp = 0.0f;   // --activation-func-clamp-value; 0: no clamp
  bool operator==(const GluParams&) const = default;
};

inline constexpr float kQuickGeluAlpha = 1.702f;

// An MLP's activation on its fc1 output: a gated linear unit (fc1 [.., 2F] = [gate | up], GluParams) or exact GeLU
// (fc1 [.., F]).
struct MlpActivation {
  bool glu = true;
  GluParams params;
  int64_t fc1_width(int64_t F) const { return glu ? 2 * F : F; }
  bool operator==(const MlpActivation&) const = default;
};

namespace glu {

MOECORE_HD_FORCEINLINE float clamp_gate(float g, const GluParams& p) {
  return p.clamp > 0.0f && g > p.clamp ? p.clamp : g;
}
MOECORE_HD_FORCEINLINE float clamp_linear(float u, const GluParams& p) {
  if (p.clamp <= 0.0f) return u;
  return u > p.clamp ? p.clamp : (u < -p.clamp ? -p.clamp : u);
}

// out for one (gate, up) pair; sigmoid(x) = 1 / (1 + exp(-x)) in the backend's exp.
template <class Sigmoid>
MOECORE_HD_FORCEINLINE float forward(float g, float u, const GluParams& p, Sigmoid sigmoid) {
  const float gc = clamp_gate(g, p), uc = clamp_linear(u, p);
  return gc * sigmoid(p.alpha * gc) * (uc + p.offset);
}

// d/dg [g s(alpha g)] = s (1 + alpha g (1 - s)); zero where a clamp binds (branch-free, so the loops vectorise).
struct Grad {
  float dg, du;
};
template <class Sigmoid>
MOECORE_HD_FORCEINLINE Grad backward(float g, float u, float dout, const GluParams& p, Sigmoid sigmoid) {
  const float gc = clamp_gate(g, p), uc = clamp_linear(u, p);
  const float s = sigmoid(p.alpha * gc);
  const float dg = dout * (uc + p.offset) * s * (1.0f + p.alpha * gc * (1.0f - s)), du = dout * gc * s;
  const bool clamps = p.clamp > 0.0f;
  const bool g_free = !clamps || !(g > p.clamp), u_free = !clamps || !(u > p.clamp || u < -p.clamp);
  return {g_free ? dg : 0.0f, u_free ? du : 0.0f};
}

}  // namespace glu
}  // namespace moecore::ops
