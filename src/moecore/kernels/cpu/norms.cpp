// CPU RMSNorm and LayerNorm, forward and backward. Rows run in parallel; the parameter gradients (dw, db)
// are reduced over N through per-chunk partials, with chunk boundaries fixed by N alone and partials
// summed in chunk order, so every result is independent of the thread count.
// Not here: norms with more than one normalised dim, or fused residual adds (callers use ops::add).
#include "moecore/kernels/common/norm_chunks.h"
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

// dst[h] += sum over chunks c (in order) of partial[c * H + h].
void reduce_partials(float* dst, const float* partial, int64_t chunks, int64_t H) {
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (chunks * H > cpu::kParallelWork)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t h0 = b * kBlock, len = std::min(kBlock, H - h0);
    float acc[kBlock] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = partial + c * H + h0;
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) acc[j] += p[j];
    }
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) dst[h0 + j] += acc[j];
  }
}

template <class TY>
void rmsnorm_forward_kernel(TY* y, float* rstd, const float* x, const float* w, float eps, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * H;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t h = 0; h < H; ++h) ss += xr[h] * xr[h];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    rstd[n] = r;
    TY* yr = y + n * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) st(yr[h], xr[h] * r * w[h]);
  }
}

// A compile-time flag rather than 0 * dx: a written dx may hold NaN garbage from Tensor::empty.
template <bool Accumulate>
inline void put(float& dst, float v) {
  if constexpr (Accumulate)
    dst += v;
  else
    dst = v;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = w * dy, xhat = x * rstd;  dw += sum_n dy * xhat.
template <bool AccumulateDx, class TD>
void rmsnorm_backward_kernel(float* dx, float* dw, const TD* dy, const float* x, const float* w, const float* rstd,
                             int64_t N, int64_t H) {
  const RowChunks chunks(N);
  float* partial = cpu::scratch<float>(static_cast<size_t>(chunks.count * H));
  const float inv_h = 1.0f / static_cast<float>(H);
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t c = 0; c < chunks.count; ++c) {
    float* pw = partial + c * H;
    std::fill(pw, pw + H, 0.0f);
    for (int64_t n = c * chunks.rows_per; n < std::min(N, (c + 1) * chunks.rows_per); ++n) {
      const float* xr = x + n * H;
      const TD* dyr = dy + n * H;
      const float r = rstd[n];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t h = 0; h < H; ++h) dot += w[h] * ld(dyr[h]) * xr[h];
      const float k = dot * r * r * inv_h;  // mean(g * xhat) / rstd
      float* dxr = dx + n * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        const float d = ld(dyr[h]);
        put<AccumulateDx>(dxr[h], r * (w[h] * d - xr[h] * k));
        pw[h] += d * xr[h] * r;
      }
    }
  }
  reduce_partials(dw, partial, chunks.count, H);
}

template <class TY>
void layernorm_forward_kernel(TY* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                              float eps, int64_t N, int64_t H) {
  const float inv_h = 1.0f / static_cast<float>(H);
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * H;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t h = 0; h < H; ++h) s += xr[h];
    const float mu = s * inv_h;
    // Two passes over the (cached) row: E[x^2] - mu^2 cancels badly when |mu| >> std.
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t h = 0; h < H; ++h) ss += (xr[h] - mu) * (xr[h] - mu);
    const float r = 1.0f / std::sqrt(ss * inv_h + eps);
    mean[n] = mu;
    rstd[n] = r;
    TY* yr = y + n * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) st(yr[h], (xr[h] - mu) * r * w[h] + b[h]);
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = w * dy;  dw += sum_n dy * xhat;  db += sum_n dy.
template <bool AccumulateDx, class TD>
void layernorm_backward_kernel(float* dx, float* dw, float* db, const TD* dy, const float* x, const float* w,
                               const float* mean, const float* rstd, int64_t N, int64_t H) {
  const RowChunks chunks(N);
  float* partial = cpu::scratch<float>(static_cast<size_t>(2 * chunks.count * H));
  float* partial_b = partial + chunks.count * H;
  const float inv_h = 1.0f / static_cast<float>(H);
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t c = 0; c < chunks.count; ++c) {
    float* pw = partial + c * H;
    float* pb = partial_b + c * H;
    std::fill(pw, pw + H, 0.0f);
    std::fill(pb, pb + H, 0.0f);
    for (int64_t n = c * chunks.rows_per; n < std::min(N, (c + 1) * chunks.rows_per); ++n) {
      const float* xr = x + n * H;
      const TD* dyr = dy + n * H;
      const float mu = mean[n], r = rstd[n];
      float sg = 0.0f, sgx = 0.0f;
#pragma omp simd reduction(+ : sg, sgx)
      for (int64_t h = 0; h < H; ++h) {
        const float g = w[h] * ld(dyr[h]);
        sg += g;
        sgx += g * (xr[h] - mu) * r;
      }
      const float mg = sg * inv_h, mgx = sgx * inv_h;
      float* dxr = dx + n * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        const float d = ld(dyr[h]);
        const float xhat = (xr[h] - mu) * r;
        put<AccumulateDx>(dxr[h], r * (w[h] * d - mg - xhat * mgx));
        pw[h] += d * xhat;
        pb[h] += d;
      }
    }
  }
  reduce_partials(dw, partial, chunks.count, H);
  reduce_partials(db, partial_b, chunks.count, H);
}

// x [N, H] f32 and every per-row / per-column tensor of a norm op; returns {N, H}.
std::pair<int64_t, int64_t> check_norm(const cpu::Checker& c, std::initializer_list<const char*> rows_h,
                                       std::initializer_list<const char*> rows,
                                       std::initializer_list<const char*> cols) {
  c.rank("x", 2);
  c.dtype("x", DType::f32);
  const int64_t N = c.get("x").size(0), H = c.get("x").size(1);
  for (const char* name : rows_h) {
    c.shape(name, Shape{N, H});
    c.contiguous(name);
  }
  for (const char* name : rows) {
    c.shape(name, Shape{N});
    c.dtype(name, DType::f32);
    c.contiguous(name);
  }
  for (const char* name : cols) {
    c.shape(name, Shape{H});
    c.dtype(name, DType::f32);
    c.contiguous(name);
  }
  return {N, H};
}

// dx is f32 because it joins the f32 residual stream; dy may come straight from a bf16 GEMM.
void check_dx(const cpu::Checker& c) {
  c.dtype("dx", DType::f32);
  c.float_dtype("dy");
}

}  // namespace

void rmsnorm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, float eps, const Context& ctx) {
  const cpu::Checker c("rmsnorm_forward", ctx, {{"y", &y}, {"rstd", &rstd}, {"x", &x}, {"w", &w}},
                       cpu::Backends::cpu_and_cuda);
  const auto [n_rows, h_cols] = check_norm(c, {"y"}, {"rstd"}, {"w"});
  const int64_t N = n_rows, H = h_cols;
  c.float_dtype("y");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::rmsnorm_forward(y, rstd, x, w, eps, ctx);
  cpu::with_float_type(y.dtype(), [&](auto t) {
    rmsnorm_forward_kernel(static_cast<decltype(t)*>(y.raw()), rstd.data<float>(), x.data<float>(), w.data<float>(),
                           eps, N, H);
  });
}

void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      bool accumulate_dx, const Context& ctx) {
  const cpu::Checker c("rmsnorm_backward", ctx,
                       {{"dx", &dx}, {"dw", &dw}, {"dy", &dy}, {"x", &x}, {"w", &w}, {"rstd", &rstd}},
                       cpu::Backends::cpu_and_cuda);
  const auto [n_rows, h_cols] = check_norm(c, {"dx", "dy"}, {"rstd"}, {"w", "dw"});
  const int64_t N = n_rows, H = h_cols;
  check_dx(c);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::rmsnorm_backward(dx, dw, dy, x, w, rstd, accumulate_dx, ctx);
  cpu::with_float_type(dy.dtype(), [&](auto t) {
    const auto* dyp = static_cast<const decltype(t)*>(dy.raw());
    auto* kernel =
        accumulate_dx ? rmsnorm_backward_kernel<true, decltype(t)> : rmsnorm_backward_kernel<false, decltype(t)>;
    kernel(dx.data<float>(), dw.data<float>(), dyp, x.data<float>(), w.data<float>(), rstd.data<float>(), N, H);
  });
}

void layernorm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                       float eps, const Context& ctx) {
  const cpu::Checker c("layernorm_forward", ctx,
                       {{"y", &y}, {"mean", &mean}, {"rstd", &rstd}, {"x", &x}, {"w", &w}, {"b", &b}},
                       cpu::Backends::cpu_and_cuda);
  const auto [n_rows, h_cols] = check_norm(c, {"y"}, {"mean", "rstd"}, {"w", "b"});
  const int64_t N = n_rows, H = h_cols;
  c.float_dtype("y");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::layernorm_forward(y, mean, rstd, x, w, b, eps, ctx);
  cpu::with_float_type(y.dtype(), [&](auto t) {
    layernorm_forward_kernel(static_cast<decltype(t)*>(y.raw()), mean.data<float>(), rstd.data<float>(),
                             x.data<float>(), w.data<float>(), b.data<float>(), eps, N, H);
  });
}

void layernorm_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, bool accumulate_dx, const Context& ctx) {
  const cpu::Checker c(
      "layernorm_backward", ctx,
      {{"dx", &dx}, {"dw", &dw}, {"db", &db}, {"dy", &dy}, {"x", &x}, {"w", &w}, {"mean", &mean}, {"rstd", &rstd}},
      cpu::Backends::cpu_and_cuda);
  const auto [n_rows, h_cols] = check_norm(c, {"dx", "dy"}, {"mean", "rstd"}, {"w", "dw", "db"});
  const int64_t N = n_rows, H = h_cols;
  check_dx(c);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, accumulate_dx, ctx);
  cpu::with_float_type(dy.dtype(), [&](auto t) {
    const auto* dyp = static_cast<const decltype(t)*>(dy.raw());
    auto* kernel =
        accumulate_dx ? layernorm_backward_kernel<true, decltype(t)> : layernorm_backward_kernel<false, decltype(t)>;
    kernel(dx.data<float>(), dw.data<float>(), db.data<float>(), dyp, x.data<float>(), w.data<float>(),
           mean.data<float>(), rstd.data<float>(), N, H);
  });
}

}  // namespace moecore::ops
