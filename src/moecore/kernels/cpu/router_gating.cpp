// CPU router gating (ops_router.h): input jitter and its backward multiply, forced-balancing logits, the fp64
// gating linear with its backward and bias gradient, and the expert-bias update. Every output element is
// summed in double in an order fixed by the shapes, so results do not depend on the thread count. On a cuda context
// every op dispatches to kernels/cuda/router.cu after its checks.
// Not here: the fp32 gating linear (ops::gemm), routing (router_topk.cpp) or losses (router_losses.cpp).
#include "moecore/kernels/cpu/router_util.h"

namespace moecore::ops {
namespace {

using cpu::router::kParallelWork;
using cpu::router::scratch;

template <class X>
void jitter_kernel(X* xj, float* u, const X* x, int64_t n, PhiloxKey key, uint64_t first, float eps) {
#pragma omp parallel for schedule(static) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float r = (1.0f - eps) + 2.0f * eps * philox_uniform(key, first + static_cast<uint64_t>(i));
    u[i] = r;
    from_float(xj[i], to_float(x[i]) * r);
  }
}

template <class X>
void gating_kernel(double* logits, const X* x, const float* w, const float* b, int64_t T, int64_t H, int64_t E) {
#pragma omp parallel for schedule(static) if (T * E * H > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    double* xr = scratch<double, 30>(static_cast<size_t>(H));
    for (int64_t h = 0; h < H; ++h) xr[h] = to_float(x[t * H + h]);
    for (int64_t e = 0; e < E; ++e) {
      const float* wr = w + e * H;
      double acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t h = 0; h < H; ++h) acc += xr[h] * static_cast<double>(wr[h]);
      logits[t * E + e] = b ? acc + static_cast<double>(b[e]) : acc;
    }
  }
}

// dweight takes experts in blocks of 8 so x streams through once per block; both products fold four terms per
// accumulator update (a load-store per FMA would bound the loop).
template <class X>
void gating_backward_kernel(float* dx, float* dw, const double* dl, const X* xj, const float* w, const float* u,
                            int64_t T, int64_t H, int64_t E) {
  constexpr int64_t kEb = 8;
  const int64_t blocks = (E + kEb - 1) / kEb;
#pragma omp parallel for schedule(static) if (T * E * H > kParallelWork)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t e0 = blk * kEb, ne = std::min(kEb, E - e0);
    double* acc = scratch<double, 31>(static_cast<size_t>(kEb * H));
    double* xr = scratch<double, 33>(static_cast<size_t>(4 * H));
    std::fill(acc, acc + ne * H, 0.0);
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
      const int64_t nt = std::min<int64_t>(4, T - t0);
      for (int64_t i = 0; i < 4 * H; ++i) xr[i] = i < nt * H ? static_cast<double>(to_float(xj[t0 * H + i])) : 0.0;
      for (int64_t k = 0; k < ne; ++k) {
        double a[4] = {};
        for (int64_t j = 0; j < nt; ++j) a[j] = dl[(t0 + j) * E + e0 + k];
        double* ak = acc + k * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h)
          ak[h] += a[0] * xr[h] + a[1] * xr[H + h] + a[2] * xr[2 * H + h] + a[3] * xr[3 * H + h];
      }
    }
    for (int64_t k = 0; k < ne; ++k)
      for (int64_t h = 0; h < H; ++h) dw[(e0 + k) * H + h] += static_cast<float>(acc[k * H + h]);
  }
#pragma omp parallel for schedule(static) if (T * E * H > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    double* acc = scratch<double, 32>(static_cast<size_t>(H));
    std::fill(acc, acc + H, 0.0);
    int64_t e = 0;
    for (; e + 4 <= E; e += 4) {
      const double a0 = dl[t * E + e], a1 = dl[t * E + e + 1], a2 = dl[t * E + e + 2], a3 = dl[t * E + e + 3];
      const float *w0 = w + e * H, *w1 = w0 + H, *w2 = w1 + H, *w3 = w2 + H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h)
        acc[h] += a0 * static_cast<double>(w0[h]) + a1 * static_cast<double>(w1[h]) + a2 * static_cast<double>(w2[h]) +
                  a3 * static_cast<double>(w3[h]);
    }
    for (; e < E; ++e) {
      const double a = dl[t * E + e];
      const float* wr = w + e * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) acc[h] += a * static_cast<double>(wr[h]);
    }
    for (int64_t h = 0; h < H; ++h)
      dx[t * H + h] += static_cast<float>(u ? acc[h] * static_cast<double>(u[t * H + h]) : acc[h]);
  }
}

// The x of a gating op: [rows, H] f32|bf16|f16, contiguous.
void check_x(const cpu::Checker& ck, const char* name, int64_t rows, int64_t H) {
  ck.float_dtype(name);
  ck.shape(name, Shape{rows, H});
  ck.contiguous(name);
}

}  // namespace

void router_jitter_forward(Tensor& xj, Tensor& u, const Tensor& x, float eps, PhiloxKey key, uint64_t first,
                           const Context& ctx) {
  const cpu::Checker ck("router_jitter_forward", ctx, {{"xj", &xj}, {"u", &u}, {"x", &x}}, cpu::Backends::cpu_and_cuda);
  ck.rank("x", 2);
  const int64_t T = x.size(0), H = x.size(1);
  check_x(ck, "x", T, H);
  check_x(ck, "xj", T, H);
  ck.same_dtype("xj", "x");
  cpu::router::check_arg(ck, "u", Shape{T, H}, DType::f32);
  if (!(eps >= 0.0f && eps < 1.0f)) ck.fail("eps (--moe-input-jitter-eps) must lie in [0, 1), got ", eps);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_jitter_forward(xj, u, x, eps, key, first, ctx);
  cpu::with_float_type(x.dtype(), [&](auto tag) {
    using X = decltype(tag);
    jitter_kernel(xj.data<X>(), u.data<float>(), x.data<X>(), T * H, key, first, eps);
  });
}

void router_jitter_backward(Tensor& dx, const Tensor& g, const Tensor& u, const Context& ctx) {
  const cpu::Checker ck("router_jitter_backward", ctx, {{"dx", &dx}, {"g", &g}, {"u", &u}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("dx", 2);
  const Shape s = dx.shape();
  for (const char* name : {"dx", "g", "u"}) cpu::router::check_arg(ck, name, s, DType::f32);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_jitter_backward(dx, g, u, ctx);
  const int64_t n = dx.numel();
  float* dxp = dx.data<float>();
  const float* gp = g.data<float>();
  const float* up = u.data<float>();
#pragma omp parallel for simd schedule(static) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) dxp[i] += gp[i] * up[i];
}

void router_normal_logits(Tensor& logits, PhiloxKey key, uint64_t first, const Context& ctx) {
  const cpu::Checker ck("router_normal_logits", ctx, {{"logits", &logits}}, cpu::Backends::cpu_and_cuda);
  ck.rank("logits", 2);
  const DType rt = cpu::router::router_dtype(ck, "logits", logits.size(0), logits.size(1));
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_normal_logits(logits, key, first, ctx);
  const int64_t n = logits.numel();
  cpu::router::with_router_type(rt, [&](auto tag) {
    using R = decltype(tag);
    R* lp = logits.data<R>();
#pragma omp parallel for schedule(static) if (n > kParallelWork)
    for (int64_t i = 0; i < n; ++i) lp[i] = R(philox_normal(key, first + static_cast<uint64_t>(i)));
  });
}

void router_gating_f64(Tensor& logits, const Tensor& x, const Tensor& w, const Tensor& bias, const Context& ctx) {
  const cpu::Checker ck("router_gating_f64", ctx, {{"logits", &logits}, {"x", &x}, {"w", &w}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("w", 2);
  ck.rank("x", 2);
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  check_x(ck, "x", T, H);
  cpu::router::check_arg(ck, "w", Shape{E, H}, DType::f32);
  cpu::router::check_arg(ck, "logits", Shape{T, E}, DType::f64);
  cpu::router::check_optional(ck, ctx, "bias", bias, Shape{E}, DType::f32);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_gating_f64(logits, x, w, bias, ctx);
  cpu::with_float_type(x.dtype(), [&](auto tag) {
    using X = decltype(tag);
    gating_kernel(logits.data<double>(), x.data<X>(), w.data<float>(), bias.defined() ? bias.data<float>() : nullptr, T,
                  H, E);
  });
}

void router_gating_f64_backward(Tensor& dx, Tensor& dw, const Tensor& dlogits, const Tensor& x, const Tensor& w,
                                const Tensor& u, const Context& ctx) {
  const cpu::Checker ck("router_gating_f64_backward", ctx,
                        {{"dx", &dx}, {"dw", &dw}, {"dlogits", &dlogits}, {"x", &x}, {"w", &w}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("w", 2);
  ck.rank("x", 2);
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  check_x(ck, "x", T, H);
  cpu::router::check_arg(ck, "w", Shape{E, H}, DType::f32);
  cpu::router::check_arg(ck, "dw", Shape{E, H}, DType::f32);
  cpu::router::check_arg(ck, "dx", Shape{T, H}, DType::f32);
  cpu::router::check_arg(ck, "dlogits", Shape{T, E}, DType::f64);
  cpu::router::check_optional(ck, ctx, "u", u, Shape{T, H}, DType::f32);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_gating_f64_backward(dx, dw, dlogits, x, w, u, ctx);
  cpu::with_float_type(x.dtype(), [&](auto tag) {
    using X = decltype(tag);
    gating_backward_kernel(dx.data<float>(), dw.data<float>(), dlogits.data<double>(), x.data<X>(), w.data<float>(),
                           u.defined() ? u.data<float>() : nullptr, T, H, E);
  });
}

void router_gating_f64_bias_grad(Tensor& dbias, const Tensor& dlogits, const Context& ctx) {
  const cpu::Checker ck("router_gating_f64_bias_grad", ctx, {{"dbias", &dbias}, {"dlogits", &dlogits}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("dlogits", 2);
  const int64_t T = dlogits.size(0), E = dlogits.size(1);
  cpu::router::check_arg(ck, "dlogits", Shape{T, E}, DType::f64);
  cpu::router::check_arg(ck, "dbias", Shape{E}, DType::f32);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_gating_f64_bias_grad(dbias, dlogits, ctx);
  const double* dl = dlogits.data<double>();
  float* db = dbias.data<float>();
  double* acc = scratch<double, 34>(static_cast<size_t>(E));
  std::fill(acc, acc + E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) acc[e] += dl[t * E + e];
  for (int64_t e = 0; e < E; ++e) db[e] += static_cast<float>(acc[e]);
}

void router_expert_bias_update(Tensor& expert_bias, const Tensor& counts, float rate, const Context& ctx) {
  const cpu::Checker ck("router_expert_bias_update", ctx, {{"expert_bias", &expert_bias}, {"counts", &counts}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("counts", 1);
  const int64_t E = counts.size(0);
  cpu::router::check_arg(ck, "counts", Shape{E}, DType::i64);
  cpu::router::check_arg(ck, "expert_bias", Shape{E}, DType::f32);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::router_expert_bias_update(expert_bias, counts, rate, ctx);
  const int64_t* c = counts.data<int64_t>();
  float* bias = expert_bias.data<float>();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += c[e];
  // sign(mean - c_e) = sign(total - E * c_e), exact in integers, so a tie leaves the bias alone.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t diff = total - E * c[e];
    const float sgn = diff > 0 ? 1.0f : (diff < 0 ? -1.0f : 0.0f);
    bias[e] += rate * sgn;
  }
}

}  // namespace moecore::ops
