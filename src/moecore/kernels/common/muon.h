// Muon's arithmetic (docs/muon-spec.md §3), shared by the CPU kernels (cpu/muon.cpp) and the CUDA kernels
// (cuda/elementwise.cu): the Newton-Schulz coefficient sets and their schedules, and the per-element momentum and
// update. Not here: the orthogonalisation's GEMMs (ops::newton_schulz composes them), which matrices Muon sees
// (optim/muon.h).
#pragma once
#include <cstdint>
#include <span>

#include "moecore/core/enum_names.h"
#include "moecore/kernels/common/hd.h"

namespace moecore::ops {

// Megatron's --muon-coefficient-type (emerging_optimizers v0.3.0's NSCoeffT; "custom" needs coefficient sets that
// Megatron never passes, so it is no choice here).
enum class NsCoefficients : uint8_t { simple, quintic, polar_express, cans, aol, deepseekv4 };
inline constexpr EnumName<NsCoefficients> kNsCoefficientsNames[] = {{NsCoefficients::simple, "simple"},
                                                                    {NsCoefficients::quintic, "quintic"},
                                                                    {NsCoefficients::polar_express, "polar_express"},
                                                                    {NsCoefficients::cans, "cans"},
                                                                    {NsCoefficients::aol, "aol"},
                                                                    {NsCoefficients::deepseekv4, "deepseekv4"}};
constexpr std::span<const EnumName<NsCoefficients>> enum_names(NsCoefficients) {
  return kNsCoefficientsNames;
}

namespace muon {

// One Newton-Schulz step's (a, b, c): X <- a X + (b A + c A A) X with A = X X^T.
struct NsStep {
  float a, b, c;
};

// The coefficient sets as emerging_optimizers v0.3.0 lists them (muon_utils.py, "rounded to closest representable in
// single precision": float literals here).
inline constexpr NsStep kSimple[] = {{3.4445f, -4.7750f, 2.0315f}};
inline constexpr NsStep kQuintic[] = {{4.0848f, -6.8946f, 2.9270f},
                                      {3.9505f, -6.3029f, 2.6377f},
                                      {3.7418f, -5.5913f, 2.3037f},
                                      {2.8769f, -3.1427f, 1.2046f},
                                      {2.8366f, -3.0525f, 1.2012f}};
inline constexpr NsStep kPolarExpress[] = {{8.2051f, -22.9019f, 16.4607f}, {4.0664f, -2.8612f, 0.5184f},
                                           {3.9096f, -2.8234f, 0.5250f},   {3.2856f, -2.4153f, 0.4853f},
                                           {2.2779f, -1.6198f, 0.3985f},   {1.8726f, -1.2307f, 0.3585f},
                                           {1.8564f, -1.2132f, 0.3568f},   {1.8750f, -1.2500f, 0.3750f}};
inline constexpr NsStep kCans[] = {{8.4703f, -25.1081f, 18.6293f},
                                   {4.1828f, -3.1087f, 0.5806f},
                                   {3.9619f, -2.9541f, 0.5630f},
                                   {3.2866f, -2.4647f, 0.5074f},
                                   {2.2737f, -1.6447f, 0.4162f}};
inline constexpr NsStep kAol[] = {{4.0098f, -7.0585f, 2.4635f},
                                  {3.4585f, -5.5479f, 2.5959f},
                                  {2.7573f, -3.2939f, 1.4254f},
                                  {2.7215f, -3.0494f, 1.3169f}};
inline constexpr NsStep kDeepSeekV4[] = {{3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f},
                                         {3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f},
                                         {3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f},
                                         {3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f},
                                         {2.0f, -1.5f, 0.5f},          {2.0f, -1.5f, 0.5f}};

// The coefficients of step k (0-based) of a run: "cycle" sets (simple, quintic, aol) restart after their last,
// "repeat last" sets (polar_express, cans, deepseekv4) keep their last (emerging_optimizers' get_coefficient_iterator).
inline NsStep ns_step(NsCoefficients type, int k) {
  std::span<const NsStep> s;
  bool cycle = true;
  switch (type) {
    case NsCoefficients::simple:
      s = kSimple;
      break;
    case NsCoefficients::quintic:
      s = kQuintic;
      break;
    case NsCoefficients::aol:
      s = kAol;
      break;
    case NsCoefficients::polar_express:
      s = kPolarExpress, cycle = false;
      break;
    case NsCoefficients::cans:
      s = kCans, cycle = false;
      break;
    case NsCoefficients::deepseekv4:
      s = kDeepSeekV4, cycle = false;
      break;
  }
  const size_t n = s.size(), i = static_cast<size_t>(k);
  return s[cycle ? i % n : (i < n ? i : n - 1)];
}

// Per-step constants of the momentum and the update, computed once on the host.
struct MomentumConsts {
  float beta, one_minus_beta, grad_scale;
  bool nesterov;
};
// M <- beta M + (1 - beta) g (an EMA, emerging_optimizers' lerp), g the gradient times its clip scale; the matrix
// to orthogonalise is U = (1 - beta) g + beta M with Nesterov, else M.
MOECORE_HD_FORCEINLINE float momentum(float m, float g, const MomentumConsts& k) {
  return k.beta * m + k.one_minus_beta * g;
}
MOECORE_HD_FORCEINLINE float to_orthogonalise(float m, float g, const MomentumConsts& k) {
  return k.nesterov ? k.one_minus_beta * g + k.beta * m : m;
}
MOECORE_HD_FORCEINLINE float scaled_grad(float grad, const MomentumConsts& k) {
  return grad * k.grad_scale;
}
// W <- decay W - step O, decay = 1 - lr wd (decoupled, before the update), step = lr (O already carries its scale).
MOECORE_HD_FORCEINLINE float update(float w, float o, float decay, float step) {
  return w * decay - step * o;
}

}  // namespace muon
}  // namespace moecore::ops
