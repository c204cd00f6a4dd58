// CPU AdamW and Lion steps: one fused pass over param, grad and the moments (AdamW: f32 or bf16 moments; math in f32,
// bf16 values rounded to nearest even on store). Elementwise, so any thread split gives the same bits.
// Not here: gradient clipping, loss-scale bookkeeping or the distributed optimizer (optim/ owns them and
// passes the result in through AdamWParams::grad_scale).
#include "moecore/kernels/common/adamw.h"
#include "moecore/kernels/common/lion.h"
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

using AdamWConsts = adamw::Consts;  // (kernels/common/adamw.h, shared with the CUDA kernel)

template <class TP, class TM, class TV>
void adamw_kernel(TP* param, const float* grad, TM* exp_avg, TV* exp_avg_sq, const AdamWConsts& k, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float g = adamw::scaled_grad(grad[i], k);
    const float m = adamw::first_moment(ld(exp_avg[i]), g, k);
    const float v = adamw::second_moment(ld(exp_avg_sq[i]), g, k);
    st(exp_avg[i], m);
    st(exp_avg_sq[i], v);
    st(param[i], adamw::param(ld(param[i]), m, v, k));
  }
}

void lion_kernel(float* param, const float* grad, float* exp_avg, const lion::Consts& k, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * k.grad_scale;
    const float d = lion::direction(exp_avg[i], g, k);
    exp_avg[i] = lion::momentum(exp_avg[i], g, k);
    param[i] = lion::param(param[i], d, k);
  }
}

}  // namespace

void lion_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, const LionParams& p, const Context& ctx) {
  const cpu::Checker c("lion_step", ctx, {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}},
                       cpu::Backends::cpu_and_cuda);
  for (const char* name : {"param", "grad", "exp_avg"}) {
    c.dtype(name, DType::f32);
    c.same_shape(name, "param");
    c.contiguous(name);
  }
  if (!(p.beta1 >= 0.0f && p.beta1 < 1.0f && p.beta2 >= 0.0f && p.beta2 < 1.0f))
    c.fail("betas must lie in [0, 1), got beta1 = ", p.beta1, ", beta2 = ", p.beta2);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::lion_step(param, grad, exp_avg, p, ctx);
  lion_kernel(param.data<float>(), grad.data<float>(), exp_avg.data<float>(), lion::Consts(p), param.numel());
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWParams& p,
                const Context& ctx) {
  const cpu::Checker c("adamw_step", ctx,
                       {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}},
                       cpu::Backends::cpu_and_cuda);
  c.float_dtype("param");  // (f32 masters; bf16 or f16 ones, each update rounded to nearest even)
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
  cpu::with_float_type(param.dtype(), [&](auto tp) {
    cpu::with_float_type(exp_avg.dtype(), [&](auto tm) {
      cpu::with_float_type(exp_avg_sq.dtype(), [&](auto tv) {
        adamw_kernel(static_cast<decltype(tp)*>(param.raw()), grad.data<float>(),
                     static_cast<decltype(tm)*>(exp_avg.raw()), static_cast<decltype(tv)*>(exp_avg_sq.raw()), k,
                     param.numel());
      });
    });
  });
}

}  // namespace moecore::ops
