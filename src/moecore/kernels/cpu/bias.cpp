// CPU linear-layer biases: bias_add / bias_grad, their grouped versions over contiguous per-expert row
// segments, and the row-scaled grouped pair (MoE fc2 bias weighted by routing probabilities).
// Adds are one pass over the rows; gradients are column sums in double (column_sums.h), deterministic.
// Not here: the bias fused with dropout and the residual add (dropout.cpp), and CUDA.
#include <algorithm>
#include <vector>

#include "moecore/kernels/cpu/column_sums.h"
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

// A 2-D f32|bf16|f16 operand with a unit last stride and a row stride >= its width.
void check_rows(const cpu::Checker& ck, const char* name) {
  const Tensor& t = ck.get(name);
  ck.rank(name, 2);
  ck.float_dtype(name);
  if (t.numel() > 0 && (t.stride(1) != 1 || t.stride(0) < t.size(1))) {
    ck.fail(name, " needs a unit last stride and a row stride >= its width, got strides [", t.stride(0), ", ",
            t.stride(1), "]");
  }
}

void check_f32(const cpu::Checker& ck, const char* name, const Shape& shape) {
  ck.dtype(name, DType::f32);
  ck.shape(name, shape);
  ck.contiguous(name);
}

// Prefix sums of the op's group_rows (cpu::group_counts) into a per-thread buffer [G + 1].
const int64_t* group_offsets(const cpu::Checker& ck, int64_t G, int64_t R) {
  const std::vector<int64_t>& rows = cpu::group_counts(ck, G, R);
  int64_t* off = cpu::scratch<int64_t, 6>(static_cast<size_t>(G + 1));
  off[0] = 0;
  for (int64_t g = 0; g < G; ++g) off[g + 1] = off[g] + rows[g];
  return off;
}

const int64_t* single_group(int64_t N) {
  int64_t* off = cpu::scratch<int64_t, 6>(2);
  off[0] = 0;
  off[1] = N;
  return off;
}

// The segment holding row r < off[G]; empty segments share their offset with the next, and upper_bound
// skips them.
int64_t group_of(const int64_t* off, int64_t G, int64_t r) {
  return std::upper_bound(off + 1, off + G + 1, r) - (off + 1);
}

// y[r, :] += (row_scale ? row_scale[r] : 1) * bias[g(r), :] for rows r < off[G].
template <class T>
void add_kernel(T* y, int64_t ldy, const float* bias, const float* row_scale, const int64_t* off, int64_t G,
                int64_t W) {
  cpu::parallel_rows(off[G], W, [&](int64_t r, int64_t c0, int64_t c1) {
    const float* b = bias + group_of(off, G, r) * W;
    T* yr = y + r * ldy;
    if (row_scale) {
      const float s = row_scale[r];
#pragma omp simd
      for (int64_t w = c0; w < c1; ++w) st(yr[w], ld(yr[w]) + s * b[w]);
    } else {
#pragma omp simd
      for (int64_t w = c0; w < c1; ++w) st(yr[w], ld(yr[w]) + b[w]);
    }
  });
}

template <class T>
void grad_kernel(float* dbias, const T* dy, int64_t ldy, const float* row_scale, const int64_t* off, int64_t G,
                 int64_t W) {
  cpu::segment_column_sums(dbias, off, G, W, [&](int64_t r, int64_t c0, int64_t c1, double* acc) {
    const T* d = dy + r * ldy;
    const double s = row_scale ? row_scale[r] : 1.0;
#pragma omp simd
    for (int64_t w = c0; w < c1; ++w) acc[w - c0] += s * static_cast<double>(ld(d[w]));
  });
}

// drow_scale[r] = dy[r, :] . bias[g(r), :] in double for the rows the groups cover (padding rows untouched).
template <class T>
void row_dot_kernel(float* drow_scale, const T* dy, int64_t ldy, const float* bias, const int64_t* off, int64_t G,
                    int64_t W) {
  const int64_t R = off[G];
#pragma omp parallel for schedule(static) if (R * W > cpu::kParallelWork)
  for (int64_t r = 0; r < R; ++r) {
    const float* b = bias + group_of(off, G, r) * W;
    const T* d = dy + r * ldy;
    double s = 0.0;
    for (int64_t w = 0; w < W; ++w) s += static_cast<double>(ld(d[w])) * b[w];
    drow_scale[r] = static_cast<float>(s);
  }
}

void add_dispatch(Tensor& y, const Tensor& bias, const float* row_scale, const int64_t* off, int64_t G) {
  cpu::with_float_type(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    add_kernel(y.data<T>(), y.stride(0), bias.data<float>(), row_scale, off, G, y.size(1));
  });
}

void grad_dispatch(Tensor& dbias, const Tensor& dy, const float* row_scale, const int64_t* off, int64_t G) {
  cpu::with_float_type(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    grad_kernel(dbias.data<float>(), dy.data<T>(), dy.stride(0), row_scale, off, G, dy.size(1));
  });
}

}  // namespace

void bias_add(Tensor& y, const Tensor& bias, const Context& ctx) {
  const cpu::Checker ck("bias_add", ctx, {{"y", &y}, {"bias", &bias}}, cpu::Backends::cpu_and_cuda);
  check_rows(ck, "y");
  check_f32(ck, "bias", Shape{y.size(1)});
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::bias_add(y, bias, ctx);
  add_dispatch(y, bias, nullptr, single_group(y.size(0)), 1);
}

void bias_grad(Tensor& dbias, const Tensor& dy, const Context& ctx) {
  const cpu::Checker ck("bias_grad", ctx, {{"dbias", &dbias}, {"dy", &dy}}, cpu::Backends::cpu_and_cuda);
  check_rows(ck, "dy");
  check_f32(ck, "dbias", Shape{dy.size(1)});
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::bias_grad(dbias, dy, ctx);
  grad_dispatch(dbias, dy, nullptr, single_group(dy.size(0)), 1);
}

void bias_add_grouped(Tensor& y, const Tensor& bias, const Tensor& group_rows, const Context& ctx) {
  const cpu::Checker ck("bias_add_grouped", ctx, {{"y", &y}, {"bias", &bias}, {"group_rows", &group_rows}},
                        cpu::Backends::cpu_and_cuda);
  check_rows(ck, "y");
  const int64_t G = group_rows.numel();
  check_f32(ck, "bias", Shape{G, y.size(1)});
  cpu::check_group_rows(ck, G);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::bias_add_grouped(y, bias, group_rows, ctx);
  add_dispatch(y, bias, nullptr, group_offsets(ck, G, y.size(0)), G);
}

void bias_grad_grouped(Tensor& dbias, const Tensor& dy, const Tensor& group_rows, const Context& ctx) {
  const cpu::Checker ck("bias_grad_grouped", ctx, {{"dbias", &dbias}, {"dy", &dy}, {"group_rows", &group_rows}},
                        cpu::Backends::cpu_and_cuda);
  check_rows(ck, "dy");
  const int64_t G = group_rows.numel();
  check_f32(ck, "dbias", Shape{G, dy.size(1)});
  cpu::check_group_rows(ck, G);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::bias_grad_grouped(dbias, dy, group_rows, ctx);
  grad_dispatch(dbias, dy, nullptr, group_offsets(ck, G, dy.size(0)), G);
}

void bias_add_grouped_scaled(Tensor& y, const Tensor& bias, const Tensor& row_scale, const Tensor& group_rows,
                             const Context& ctx) {
  const cpu::Checker ck("bias_add_grouped_scaled", ctx,
                        {{"y", &y}, {"bias", &bias}, {"row_scale", &row_scale}, {"group_rows", &group_rows}},
                        cpu::Backends::cpu_and_cuda);
  check_rows(ck, "y");
  const int64_t G = group_rows.numel();
  check_f32(ck, "bias", Shape{G, y.size(1)});
  check_f32(ck, "row_scale", Shape{y.size(0)});
  cpu::check_group_rows(ck, G);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::bias_add_grouped_scaled(y, bias, row_scale, group_rows, ctx);
  add_dispatch(y, bias, row_scale.data<float>(), group_offsets(ck, G, y.size(0)), G);
}

void bias_grad_grouped_scaled(Tensor& dbias, Tensor& drow_scale, const Tensor& dy, const Tensor& bias,
                              const Tensor& row_scale, const Tensor& group_rows, const Context& ctx) {
  const char* op = "bias_grad_grouped_scaled";
  const cpu::Checker ck = drow_scale.defined() ? cpu::Checker(op, ctx,
                                                              {{"dbias", &dbias},
                                                               {"drow_scale", &drow_scale},
                                                               {"dy", &dy},
                                                               {"bias", &bias},
                                                               {"row_scale", &row_scale},
                                                               {"group_rows", &group_rows}},
                                                              cpu::Backends::cpu_and_cuda)
                                               : cpu::Checker(op, ctx,
                                                              {{"dbias", &dbias},
                                                               {"dy", &dy},
                                                               {"bias", &bias},
                                                               {"row_scale", &row_scale},
                                                               {"group_rows", &group_rows}},
                                                              cpu::Backends::cpu_and_cuda);
  check_rows(ck, "dy");
  const int64_t G = group_rows.numel(), R = dy.size(0), W = dy.size(1);
  check_f32(ck, "dbias", Shape{G, W});
  check_f32(ck, "bias", Shape{G, W});
  check_f32(ck, "row_scale", Shape{R});
  if (drow_scale.defined()) check_f32(ck, "drow_scale", Shape{R});
  cpu::check_group_rows(ck, G);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::bias_grad_grouped_scaled(dbias, drow_scale, dy, bias, row_scale, group_rows, ctx);
  const int64_t* off = group_offsets(ck, G, R);
  grad_dispatch(dbias, dy, row_scale.data<float>(), off, G);
  if (!drow_scale.defined()) return;
  cpu::with_float_type(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    row_dot_kernel(drow_scale.data<float>(), dy.data<T>(), dy.stride(0), bias.data<float>(), off, G, W);
  });
}

}  // namespace moecore::ops
