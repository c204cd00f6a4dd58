// CPU AdamW step: one fused pass over param, grad and both moments (f32 or bf16 moments; math in f32,
// bf16 moments rounded to nearest even on store). Elementwise, so any thread split gives the same bits.
// Not here: gradient clipping, loss-scale bookkeeping or the distributed optimizer (optim/ owns them and
// passes the result in through AdamWParams::grad_scale).
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

// Per-step constants, computed in double so that bias corrections near 0 (step 1, beta2 = 0.999) keep
// their digits. The update is PyTorch's: p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
struct AdamWConsts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_sqrt_bc2, grad_scale;
  explicit AdamWConsts(const AdamWParams& p) {
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

template <class TM, class TV>
void adamw_kernel(float* param, const float* grad, TM* exp_avg, TV* exp_avg_sq, const AdamWConsts& k, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * k.grad_scale;
    const float m = k.beta1 * ld(exp_avg[i]) + k.one_minus_beta1 * g;
    const float v = k.beta2 * ld(exp_avg_sq[i]) + k.one_minus_beta2 * g * g;
    st(exp_avg[i], m);
    st(exp_avg_sq[i], v);
    const float denom = std::sqrt(v) * k.inv_sqrt_bc2 + k.eps;
    param[i] = param[i] * k.decay - k.step_size * m / denom;
  }
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWParams& p,
                const Context& ctx) {
  const cpu::Checker c("adamw_step", ctx,
                       {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}},
                       cpu::Backends::cpu_and_cuda);
  c.dtype("param", DType::f32);
  c.dtype("grad", DType::f32);
  c.float_dtype("exp_avg");
  c.float_dtype("exp_avg_sq");
  for (const char* name : {"param", "grad", "exp_avg", "exp_avg_sq"}) {
    c.same_shape(name, "param");
    c.contiguous(name);
  }
  if (p.step < 1) c.fail("step must be >= 1 (1-based, for bias correction), got ", p.step);
  if (!(p.beta1 >= 0.0f && p.beta1 < 1.0f && p.beta2 >= 0.0f && p.beta2 < 1.0f))
    c.fail("betas must lie in [0, 1), got beta1 = ", p.beta1, ", beta2 = ", p.beta2);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::adamw_step(param, grad, exp_avg, exp_avg_sq, p, ctx);
  const AdamWConsts k(p);
  cpu::with_float_type(exp_avg.dtype(), [&](auto tm) {
    cpu::with_float_type(exp_avg_sq.dtype(), [&](auto tv) {
      adamw_kernel(param.data<float>(), grad.data<float>(), static_cast<decltype(tm)*>(exp_avg.raw()),
                   static_cast<decltype(tv)*>(exp_avg_sq.raw()), k, param.numel());
    });
  });
}

}  // namespace moecore::ops
