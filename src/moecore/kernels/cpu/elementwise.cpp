// CPU elementwise ops: add, scale, sum_squares, all_finite, count_zeros, and the gated-linear-unit / exact-GeLU
// activations.
// Each is one pass over contiguous memory with vectorised inner loops. Reductions (sum_squares) use
// fixed-size chunks summed in chunk order, so the result does not depend on the thread count.
// Not here: row-wise normalisation (norms.cpp) and the softmax loss (embedding_loss.cpp).
#include <cmath>

#include "moecore/kernels/common/glu.h"
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

template <class TO, class TA, class TB>
void add_kernel(TO* out, const TA* a, const TB* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) st(out[i], ld(a[i]) + ld(b[i]));
}

template <class T>
double sum_squares_kernel(const T* x, int64_t n) {
  constexpr int64_t kChunk = 8192;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  double* partial = cpu::scratch<double>(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (n > cpu::kParallelWork)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c * kChunk; i < end; ++i) {
      const double v = ld(x[i]);
      s += v * v;
    }
    partial[c] = s;
  }
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  return total;
}

// The exponent field all ones marks inf and NaN in every format; OR-ing the test is order-free.
bool all_finite_f32(const float* x, int64_t n) {
  uint32_t bad = 0;
#pragma omp parallel for simd schedule(static) reduction(| : bad) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) bad |= (std::bit_cast<uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u;
  return bad == 0;
}
bool all_finite_bf16(const bf16* x, int64_t n) {
  uint32_t bad = 0;
#pragma omp parallel for simd schedule(static) reduction(| : bad) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) bad |= (x[i].bits & 0x7f80u) == 0x7f80u;
  return bad == 0;
}
bool all_finite_f16(const f16* x, int64_t n) {
  uint32_t bad = 0;
#pragma omp parallel for simd schedule(static) reduction(| : bad) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) bad |= (x[i].bits & 0x7c00u) == 0x7c00u;
  return bad == 0;
}

template <class T>
int64_t count_zeros_kernel(const T* x, int64_t n, float scale) {
  int64_t zeros = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : zeros) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) zeros += ld(x[i]) * scale == 0.0f ? 1 : 0;
  return zeros;
}

constexpr auto sigmoid = [](float g) { return 1.0f / (1.0f + cpu::exp_f32(-g)); };

// The GLU's arithmetic is kernels/common/glu.h's, with this backend's sigmoid.
template <class T>
void glu_forward_kernel(T* out, const T* gate_up, int64_t rows, int64_t F, const GluParams p) {
  cpu::parallel_rows(rows, F, [&](int64_t r, int64_t c0, int64_t c1) {
    const T* g = gate_up + r * 2 * F;
    const T* u = g + F;
    T* o = out + r * F;
#pragma omp simd
    for (int64_t j = c0; j < c1; ++j) st(o[j], glu::forward(ld(g[j]), ld(u[j]), p, sigmoid));
  });
}

template <class T>
void glu_backward_kernel(T* dgate_up, const T* dout, const T* gate_up, int64_t rows, int64_t F, const GluParams p) {
  cpu::parallel_rows(rows, F, [&](int64_t r, int64_t c0, int64_t c1) {
    const T* g = gate_up + r * 2 * F;
    const T* u = g + F;
    const T* d = dout + r * F;
    T* dg = dgate_up + r * 2 * F;
    T* du = dg + F;
#pragma omp simd
    for (int64_t j = c0; j < c1; ++j) {
      const glu::Grad r = glu::backward(ld(g[j]), ld(u[j]), ld(d[j]), p, sigmoid);
      st(dg[j], r.dg);
      st(du[j], r.du);
    }
  });
}

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

template <class T>
void gelu_forward_kernel(T* out, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork / 4)
  for (int64_t i = 0; i < n; ++i) {
    const float v = ld(x[i]);
    st(out[i], 0.5f * v * cpu::erfc_f32(-v * kInvSqrt2));
  }
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x).
template <class T>
void gelu_backward_kernel(T* dx, const T* dout, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork / 4)
  for (int64_t i = 0; i < n; ++i) {
    const float v = ld(x[i]);
    const float cdf = 0.5f * cpu::erfc_f32(-v * kInvSqrt2);
    const float pdf = kInvSqrt2Pi * cpu::exp_f32(-0.5f * v * v);
    st(dx[i], ld(dout[i]) * (cdf + v * pdf));
  }
}

// out [.., F] against gate_up [.., 2F]: same leading dims, one dtype, contiguous; the GLU's parameters finite (a
// clamp >= 0).
void check_glu(const cpu::Checker& c, const char* half, const char* full, const GluParams& p) {
  if (!std::isfinite(p.alpha) || !std::isfinite(p.offset) || !std::isfinite(p.clamp) || p.clamp < 0.0f)
    c.fail(full, ": GLU parameters alpha ", p.alpha, ", offset ", p.offset, ", clamp ", p.clamp,
           " must be finite (the clamp >= 0, 0 for none)");
  const Tensor &h = c.get(half), &f = c.get(full);
  c.float_dtype(full);
  c.same_dtype(half, full);
  c.contiguous(half);
  c.contiguous(full);
  bool ok = h.dim() >= 1 && h.dim() == f.dim() && f.size(-1) == 2 * h.size(-1);
  for (int i = 0; ok && i + 1 < h.dim(); ++i) ok = h.size(i) == f.size(i);
  if (!ok) c.fail(full, " must be ", half, " with a last dim twice as wide ([.., 2F] vs [.., F])");
}

}  // namespace

void add(Tensor& out, const Tensor& a, const Tensor& b, const Context& ctx) {
  const cpu::Checker c("add", ctx, {{"out", &out}, {"a", &a}, {"b", &b}}, cpu::Backends::cpu_and_cuda);
  for (const char* name : {"out", "a", "b"}) {
    c.float_dtype(name);
    c.contiguous(name);
  }
  c.same_shape("a", "out");
  c.same_shape("b", "out");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::add(out, a, b, ctx);
  cpu::with_float_type(out.dtype(), [&](auto to) {
    cpu::with_float_type(a.dtype(), [&](auto ta) {
      cpu::with_float_type(b.dtype(), [&](auto tb) {
        add_kernel(static_cast<decltype(to)*>(out.raw()), static_cast<const decltype(ta)*>(a.raw()),
                   static_cast<const decltype(tb)*>(b.raw()), out.numel());
      });
    });
  });
}

void scale(Tensor& x, float alpha, const Context& ctx) {
  const cpu::Checker c("scale", ctx, {{"x", &x}}, cpu::Backends::cpu_and_cuda);
  c.dtype("x", DType::f32);
  c.contiguous("x");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::scale(x, alpha, ctx);
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) p[i] *= alpha;
}

void sum_squares(Tensor& acc, const Tensor& x, const Context& ctx) {
  const cpu::Checker c("sum_squares", ctx, {{"acc", &acc}, {"x", &x}}, cpu::Backends::cpu_and_cuda);
  c.dtype("acc", DType::f64);
  c.shape("acc", Shape{1});
  c.float_dtype("x");
  c.contiguous("x");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::sum_squares(acc, x, ctx);
  const double s = cpu::with_float_type(
      x.dtype(), [&](auto t) { return sum_squares_kernel(static_cast<const decltype(t)*>(x.raw()), x.numel()); });
  acc.data<double>()[0] += s;
}

void flag_nonfinite(Tensor& flag, const Tensor& x, const Context& ctx) {
  const cpu::Checker c("flag_nonfinite", ctx, {{"flag", &flag}, {"x", &x}}, cpu::Backends::cpu_and_cuda);
  c.dtype("flag", DType::i32);
  c.shape("flag", Shape{1});
  c.float_dtype("x");
  c.contiguous("x");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::flag_nonfinite(flag, x, ctx);
  const bool finite = x.dtype() == DType::bf16  ? all_finite_bf16(x.data<bf16>(), x.numel())
                      : x.dtype() == DType::f16 ? all_finite_f16(x.data<f16>(), x.numel())
                                                : all_finite_f32(x.data<float>(), x.numel());
  if (!finite) flag.data<int32_t>()[0] = 1;
}

void count_zeros(Tensor& acc, const Tensor& x, float scale, const Context& ctx) {
  const cpu::Checker c("count_zeros", ctx, {{"acc", &acc}, {"x", &x}}, cpu::Backends::cpu_and_cuda);
  c.dtype("acc", DType::i64);
  c.shape("acc", Shape{1});
  c.float_dtype("x");
  c.contiguous("x");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::count_zeros(acc, x, scale, ctx);
  acc.data<int64_t>()[0] += cpu::with_float_type(x.dtype(), [&](auto t) {
    return count_zeros_kernel(static_cast<const decltype(t)*>(x.raw()), x.numel(), scale);
  });
}

void glu_forward(Tensor& out, const Tensor& gate_up, const GluParams& p, const Context& ctx) {
  const cpu::Checker c("glu_forward", ctx, {{"out", &out}, {"gate_up", &gate_up}}, cpu::Backends::cpu_and_cuda);
  check_glu(c, "out", "gate_up", p);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::glu_forward(out, gate_up, p, ctx);
  const int64_t F = out.size(-1), rows = F ? out.numel() / F : 0;
  cpu::with_float_type(out.dtype(), [&](auto t) {
    using T = decltype(t);
    glu_forward_kernel(static_cast<T*>(out.raw()), static_cast<const T*>(gate_up.raw()), rows, F, p);
  });
}

void glu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up, const GluParams& p, const Context& ctx) {
  const cpu::Checker c("glu_backward", ctx, {{"dgate_up", &dgate_up}, {"dout", &dout}, {"gate_up", &gate_up}},
                       cpu::Backends::cpu_and_cuda);
  check_glu(c, "dout", "gate_up", p);
  c.same_shape("dgate_up", "gate_up");
  c.same_dtype("dgate_up", "gate_up");
  c.contiguous("dgate_up");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::glu_backward(dgate_up, dout, gate_up, p, ctx);
  const int64_t F = dout.size(-1), rows = F ? dout.numel() / F : 0;
  cpu::with_float_type(dout.dtype(), [&](auto t) {
    using T = decltype(t);
    glu_backward_kernel(static_cast<T*>(dgate_up.raw()), static_cast<const T*>(dout.raw()),
                        static_cast<const T*>(gate_up.raw()), rows, F, p);
  });
}

void mlp_activation_forward(Tensor& act, const Tensor& h, const MlpActivation& a, const Context& ctx) {
  if (a.glu) return glu_forward(act, h, a.params, ctx);
  gelu_forward(act, h, ctx);
}

void mlp_activation_backward(Tensor& dh, const Tensor& dact, const Tensor& h, const MlpActivation& a,
                             const Context& ctx) {
  if (a.glu) return glu_backward(dh, dact, h, a.params, ctx);
  gelu_backward(dh, dact, h, ctx);
}

void gelu_forward(Tensor& out, const Tensor& x, const Context& ctx) {
  const cpu::Checker c("gelu_forward", ctx, {{"out", &out}, {"x", &x}}, cpu::Backends::cpu_and_cuda);
  c.float_dtype("x");
  c.same_dtype("out", "x");
  c.same_shape("out", "x");
  c.contiguous("out");
  c.contiguous("x");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::gelu_forward(out, x, ctx);
  cpu::with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    gelu_forward_kernel(static_cast<T*>(out.raw()), static_cast<const T*>(x.raw()), x.numel());
  });
}

void gelu_backward(Tensor& dx, const Tensor& dout, const Tensor& x, const Context& ctx) {
  const cpu::Checker c("gelu_backward", ctx, {{"dx", &dx}, {"dout", &dout}, {"x", &x}}, cpu::Backends::cpu_and_cuda);
  c.float_dtype("x");
  for (const char* name : {"dx", "dout"}) {
    c.same_dtype(name, "x");
    c.same_shape(name, "x");
    c.contiguous(name);
  }
  c.contiguous("x");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::gelu_backward(dx, dout, x, ctx);
  cpu::with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    gelu_backward_kernel(static_cast<T*>(dx.raw()), static_cast<const T*>(dout.raw()), static_cast<const T*>(x.raw()),
                         x.numel());
  });
}

}  // namespace moecore::ops
