#include "moecore/nn/fp8.h"

#include <cfloat>

#include "moecore/core/error.h"
#include "moecore/nn/fp8_delayed.h"

namespace moecore::nn {

bool Fp8Config::layer_runs_fp8(int64_t l, int64_t num_layers) const {
  if (!on) return false;
  if (l >= num_layers) return true;  // an MTP depth's layer
  return !(first_last_layers_bf16 && (l < num_layers_at_start_in_bf16 || l >= num_layers - num_layers_at_end_in_bf16));
}

Fp8Training::Fp8Training(const Fp8Config& c)
    : cfg_(c), delayed_(c.recipe == Fp8Recipe::delayed ? std::make_unique<Fp8Delayed>(c) : nullptr) {}
Fp8Training::~Fp8Training() = default;

namespace {

enum class Operand : uint8_t { activation, weight, gradient };

// A stateless recipe's operand.
ops::Fp8Operand operand(const Fp8Config& c, Operand kind, DType input) {
  ops::Fp8Operand o;
  o.format = kind == Operand::gradient && c.format == Fp8Format::hybrid ? DType::f8e5m2 : DType::f8e4m3;
  switch (c.recipe) {
    case Fp8Recipe::delayed:
      MOECORE_FAIL("FP8: the delayed recipe's operands come from its state (Fp8Delayed)");
    case Fp8Recipe::tensorwise:
      o.rule = ops::Fp8ScaleRule::current;
      break;
    case Fp8Recipe::blockwise:
      o.rule = ops::Fp8ScaleRule::current_pow2;
      o.block_rows = kind == Operand::weight ? 128 : 1;
      o.block_cols = 128;
      o.inf_scale = input == DType::bf16 ? 0x1.fep127f : FLT_MAX;  // bf16's largest finite value, 0x7F7F
      break;
    case Fp8Recipe::mxfp8:
      o.rule = ops::Fp8ScaleRule::mx;
      o.block_rows = 1;
      o.block_cols = 32;
      break;
  }
  return o;
}

// The operands of one GEMM of linear l (groups: the GEMMs of a grouped call, else 1).
ops::Fp8Gemm operands(Fp8Delayed::Gemm g, const Linear& l, DType input, int64_t groups) {
  if (Fp8Delayed* d = l.fp8->delayed()) return d->operands(g, l, groups);
  const Fp8Config& c = l.fp8->config();
  using enum Fp8Delayed::Gemm;
  const Operand a = g == fprop ? Operand::activation : Operand::gradient;
  const Operand b = g == wgrad ? Operand::activation : Operand::weight;
  return {operand(c, a, input), operand(c, b, input), l.layer, l.name,
          g == fprop   ? "fprop"
          : g == dgrad ? "dgrad"
                       : "wgrad"};
}

}  // namespace

void linear_fprop(Tensor& y, const Tensor& x, const Tensor& w, float alpha, float beta, const Linear& l,
                  const ops::Context& ctx) {
  if (!l.fp8) return ops::gemm(y, x, false, w, true, alpha, beta, ctx);
  ops::gemm(y, x, false, w, true, alpha, beta, operands(Fp8Delayed::Gemm::fprop, l, x.dtype(), 1), ctx);
}

void linear_dgrad(Tensor& dx, const Tensor& dy, const Tensor& w, float alpha, float beta, const Linear& l,
                  const ops::Context& ctx) {
  if (!l.fp8) return ops::gemm(dx, dy, false, w, false, alpha, beta, ctx);
  ops::gemm(dx, dy, false, w, false, alpha, beta, operands(Fp8Delayed::Gemm::dgrad, l, dy.dtype(), 1), ctx);
}

void linear_wgrad(Tensor& dw, const Tensor& dy, const Tensor& x, float alpha, float beta, const Linear& l,
                  const ops::Context& ctx) {
  if (!l.fp8) return ops::gemm(dw, dy, true, x, false, alpha, beta, ctx);
  ops::gemm(dw, dy, true, x, false, alpha, beta, operands(Fp8Delayed::Gemm::wgrad, l, x.dtype(), 1), ctx);
}

void grouped_fprop(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& group_rows, const Linear& l,
                   const ops::Context& ctx) {
  if (!l.fp8) return ops::gemm_grouped(y, x, w, true, group_rows, 0.0f, ctx);
  ops::gemm_grouped(y, x, w, true, group_rows, 0.0f, operands(Fp8Delayed::Gemm::fprop, l, x.dtype(), w.size(0)), ctx);
}

void grouped_dgrad(Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& group_rows, const Linear& l,
                   const ops::Context& ctx) {
  if (!l.fp8) return ops::gemm_grouped(dx, dy, w, false, group_rows, 0.0f, ctx);
  ops::gemm_grouped(dx, dy, w, false, group_rows, 0.0f, operands(Fp8Delayed::Gemm::dgrad, l, dy.dtype(), w.size(0)),
                    ctx);
}

void grouped_wgrad(Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& group_rows, const Linear& l,
                   const ops::Context& ctx) {
  if (!l.fp8) return ops::gemm_grouped_wgrad(dw, dy, x, group_rows, 1.0f, ctx);
  ops::gemm_grouped_wgrad(dw, dy, x, group_rows, 1.0f, operands(Fp8Delayed::Gemm::wgrad, l, x.dtype(), dw.size(0)),
                          ctx);
}

}  // namespace moecore::nn
