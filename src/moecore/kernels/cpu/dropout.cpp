// CPU counter-based dropout (ops.h): dropout_forward / dropout_backward and Megatron's fused
// bias-dropout-add with its backward. Masks are regenerated from (key, element index) by dropout_mask.h,
// never stored; dropped elements are written as +0 whatever x holds. Deterministic by construction.
// Not here: attention-probability dropout (attention.cpp) and CUDA.
#include <cstring>
#include <optional>

#include "moecore/kernels/cpu/column_sums.h"
#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/cpu/dropout_mask.h"

namespace moecore::ops {
namespace {

using cpu::DropoutMask;
using cpu::ld;
using cpu::st;

constexpr int64_t kBlock = 4096;  // elements per mask run; the factors live on the stack

// f[k] = keep factor of element first + k, or 1 without a mask (p = 0).
void fill_factors(const DropoutMask* mask, float* f, uint64_t first, int64_t n) {
  if (mask)
    mask->factors(f, first, n);
  else
    std::fill(f, f + n, 1.0f);
}

inline float apply(float v, float f) {
  return cpu::select_f32(f != 0.0f, v * f, 0.0f);
}

template <class T>
void dropout_kernel(T* y, const T* x, int64_t n, const DropoutMask& mask) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n > cpu::kParallelWork / 4)
  for (int64_t b = 0; b < nb; ++b) {
    alignas(64) float f[kBlock];
    const int64_t i0 = b * kBlock, m = std::min(kBlock, n - i0);
    mask.factors(f, static_cast<uint64_t>(i0), m);
#pragma omp simd
    for (int64_t k = 0; k < m; ++k) st(y[i0 + k], apply(ld(x[i0 + k]), f[k]));
  }
}

void dropout_apply(const char* op, const char* out_name, const char* in_name, Tensor& y, const Tensor& x,
                   const Dropout& d, const Context& ctx, bool inverse) {
  const cpu::Checker ck(op, ctx, {{out_name, &y}, {in_name, &x}}, cpu::Backends::cpu_and_cuda);
  cpu::check_dropout(ck, d);
  ck.float_dtype(in_name);
  ck.same_dtype(out_name, in_name);
  ck.same_shape(out_name, in_name);
  ck.contiguous(out_name);
  ck.contiguous(in_name);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return inverse ? cuda::dropout_backward(y, x, d, ctx) : cuda::dropout_forward(y, x, d, ctx);
  if (!d.active()) {
    if (y.raw() != x.raw()) std::memcpy(y.raw(), x.raw(), static_cast<size_t>(x.nbytes()));
    return;
  }
  const DropoutMask mask(d);
  cpu::with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dropout_kernel(static_cast<T*>(y.raw()), static_cast<const T*>(x.raw()), x.numel(), mask);
  });
}

// y = residual + dropout(x + bias); bias may be null.
template <class TX>
void bias_dropout_add_kernel(float* y, const float* residual, const TX* x, const float* bias, int64_t N, int64_t H,
                             const DropoutMask* mask) {
  cpu::parallel_rows(N, H, [&](int64_t r, int64_t c0, int64_t c1) {
    alignas(64) float f[kBlock];  // parallel_rows hands out at most kBlock columns
    fill_factors(mask, f, static_cast<uint64_t>(r * H + c0), c1 - c0);
    const int64_t o = r * H;
    if (bias) {
#pragma omp simd
      for (int64_t h = c0; h < c1; ++h) y[o + h] = residual[o + h] + apply(ld(x[o + h]) + bias[h], f[h - c0]);
    } else {
#pragma omp simd
      for (int64_t h = c0; h < c1; ++h) y[o + h] = residual[o + h] + apply(ld(x[o + h]), f[h - c0]);
    }
  });
}

// dx = dropout(dy); dbias (may be null) += column sums of the f32 values before dx's rounding.
template <class TX>
void bias_dropout_add_backward_kernel(TX* dx, float* dbias, const float* dy, int64_t N, int64_t H,
                                      const DropoutMask* mask) {
  if (!dbias) {
    cpu::parallel_rows(N, H, [&](int64_t r, int64_t c0, int64_t c1) {
      alignas(64) float f[kBlock];
      fill_factors(mask, f, static_cast<uint64_t>(r * H + c0), c1 - c0);
#pragma omp simd
      for (int64_t h = c0; h < c1; ++h) st(dx[r * H + h], apply(dy[r * H + h], f[h - c0]));
    });
    return;
  }
  const int64_t off[2] = {0, N};
  cpu::segment_column_sums(dbias, off, 1, H, [&](int64_t r, int64_t c0, int64_t c1, double* acc) {
    alignas(64) float f[kBlock];  // segment_column_sums hands out at most 256 columns
    fill_factors(mask, f, static_cast<uint64_t>(r * H + c0), c1 - c0);
#pragma omp simd
    for (int64_t h = c0; h < c1; ++h) {
      const float v = apply(dy[r * H + h], f[h - c0]);
      st(dx[r * H + h], v);
      acc[h - c0] += v;
    }
  });
}

}  // namespace

void dropout_forward(Tensor& y, const Tensor& x, const Dropout& d, const Context& ctx) {
  dropout_apply("dropout_forward", "y", "x", y, x, d, ctx, false);
}

void dropout_backward(Tensor& dx, const Tensor& dy, const Dropout& d, const Context& ctx) {
  dropout_apply("dropout_backward", "dx", "dy", dx, dy, d, ctx, true);
}

void bias_dropout_add(Tensor& y, const Tensor& residual, const Tensor& x, const Tensor& bias, const Dropout& d,
                      const Context& ctx) {
  const char* op = "bias_dropout_add";
  const cpu::Checker ck =
      bias.defined()
          ? cpu::Checker(op, ctx, {{"y", &y}, {"residual", &residual}, {"x", &x}, {"bias", &bias}},
                         cpu::Backends::cpu_and_cuda)
          : cpu::Checker(op, ctx, {{"y", &y}, {"residual", &residual}, {"x", &x}}, cpu::Backends::cpu_and_cuda);
  cpu::check_dropout(ck, d);
  ck.dtype("y", DType::f32);
  ck.dtype("residual", DType::f32);
  ck.float_dtype("x");
  ck.rank("y", 2);
  ck.same_shape("residual", "y");
  ck.same_shape("x", "y");
  for (const char* name : {"y", "residual", "x"}) ck.contiguous(name);
  const int64_t N = y.size(0), H = y.size(1);
  if (bias.defined()) {
    ck.dtype("bias", DType::f32);
    ck.shape("bias", Shape{H});
    ck.contiguous("bias");
  }
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::bias_dropout_add(y, residual, x, bias, d, ctx);
  std::optional<DropoutMask> mask;
  if (d.active()) mask.emplace(d);
  cpu::with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    bias_dropout_add_kernel(y.data<float>(), residual.data<float>(), x.data<T>(),
                            bias.defined() ? bias.data<float>() : nullptr, N, H, mask ? &*mask : nullptr);
  });
}

void bias_dropout_add_backward(Tensor& dx, Tensor& dbias, const Tensor& dy, const Dropout& d, const Context& ctx) {
  const char* op = "bias_dropout_add_backward";
  const cpu::Checker ck =
      dbias.defined()
          ? cpu::Checker(op, ctx, {{"dx", &dx}, {"dbias", &dbias}, {"dy", &dy}}, cpu::Backends::cpu_and_cuda)
          : cpu::Checker(op, ctx, {{"dx", &dx}, {"dy", &dy}}, cpu::Backends::cpu_and_cuda);
  cpu::check_dropout(ck, d);
  ck.float_dtype("dx");
  ck.dtype("dy", DType::f32);
  ck.rank("dy", 2);
  ck.same_shape("dx", "dy");
  ck.contiguous("dx");
  ck.contiguous("dy");
  const int64_t N = dy.size(0), H = dy.size(1);
  if (dbias.defined()) {
    ck.dtype("dbias", DType::f32);
    ck.shape("dbias", Shape{H});
    ck.contiguous("dbias");
  }
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::bias_dropout_add_backward(dx, dbias, dy, d, ctx);
  std::optional<DropoutMask> mask;
  if (d.active()) mask.emplace(d);
  cpu::with_float_type(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    bias_dropout_add_backward_kernel(dx.data<T>(), dbias.defined() ? dbias.data<float>() : nullptr, dy.data<float>(), N,
                                     H, mask ? &*mask : nullptr);
  });
}

}  // namespace moecore::ops
