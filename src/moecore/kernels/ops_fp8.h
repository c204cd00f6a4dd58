// FP8 GEMMs (docs/fp8-spec.md §3): the three GEMMs of a linear layer -- fprop, dgrad, wgrad -- with both operands
// quantised as Transformer Engine's recipes quantise them. The quantisation itself is ops.h's fp8_quantize (the
// arithmetic: common/fp8.h); which recipe a linear layer uses is the model's (nn/fp8.h).
//
// An operand is described in its GEMM's own layout [rows, reduction]: op(a) [M, K] for a, op(b)^T [N, K] for b, so
// blocks always run along the reduction dimension whatever the stored layout (fprop's activations 1 x 128 along K,
// wgrad's 1 x 128 along the tokens, i.e. 128 x 1 of the stored tensor, weights 128 x 128 in both).
//   c = alpha * D(op(a)) @ D(op(b)) + beta * c, with D(x) = fp8(x * scale) * scale_inv block by block
// (fp8_quantize's saturating round-to-nearest-even and scale rules). Products of FP8 values are exact and accumulate in
// f32: per-tensor scales (a block of the whole operand) multiply the result, as cuBLASLt's FP8 GEMM applies them,
// block scales (powers of two in every recipe that uses them) the values. Transformer Engine accumulates its fprop
// with cuBLAS's fast accumulation; here every GEMM accumulates in f32 throughout (TE's split accumulation).
//
// A non-finite amax of an operand (an infinity or a NaN in it) raises Error naming `what` and the operand: FP8
// training stops where the numbers broke, before the loss shows it (Megatron's NaN policy, moved to its source).
// CPU backend only: the emulation FP8 training runs and is tested with. (CUDA FP8 GEMMs: cuBLASLt and CUTLASS, not
// built yet; a cuda context raises.)
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cfloat>
#include <span>
#include <string_view>

#include "moecore/kernels/ops.h"

namespace moecore::ops {

// given scales and amax outputs have one entry per group of a grouped GEMM (one for a plain GEMM); delayed scaling
// passes its slots' scales and row-0 amaxes.
struct Fp8Operand {
  DType format = DType::f8e4m3;  // f8e4m3 or f8e5m2
  Fp8ScaleRule rule = Fp8ScaleRule::current;
  int64_t block_rows = 0, block_cols = 0;  // in [rows, reduction]; 0: the whole dimension
  std::span<const float> scale{};          // Fp8ScaleRule::given: each group's scale (finite, > 0)
  float inf_scale = FLT_MAX;               // as Fp8Quantize::inf_scale
  std::span<float> amax{};  // optional: each group's max |x| (NaN skipped) maxed into its entry (kept when larger)
};

// The GEMM is named in errors by its parts, joined only when one is raised: layer + linear + " " + pass
// ("decoder.layers.3." "mlp.linear_fc1" "fprop").
struct Fp8Gemm {
  Fp8Operand a, b;
  std::string_view layer{};
  const char* linear = "";
  const char* pass = "";
};

// gemm (ops.h) with FP8 operands.
void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Fp8Gemm& fp8, const Context& ctx);
// gemm_grouped and gemm_grouped_wgrad (ops.h) with FP8 operands: each group's rows of a (wgrad: of a and b) and its
// weight b[g] are quantised on their own (Transformer Engine's GroupedLinear: one quantizer per expert GEMM), so a
// per-tensor rule gives one scale per expert and blocks start at each group's first row.
void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const Tensor& group_rows, float beta,
                  const Fp8Gemm& fp8, const Context& ctx);
void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const Tensor& group_rows, float beta,
                        const Fp8Gemm& fp8, const Context& ctx);

}  // namespace moecore::ops
