// CUDA RMSNorm and LayerNorm, forward and backward: one CTA per row for the row statistics and dx (f32, fixed-order
// block reductions), and the parameter gradients (dw, db) as the CPU computes them: per-chunk partial column sums
// over the CPU's row chunks (at most 128 chunks, boundaries fixed by N), each chunk's rows in row order, then the
// chunks added in chunk order. No atomics, so every result is deterministic; the price is a second pass over dy and
// x for the partials (the CPU fuses it into the dx pass), about 1.5x the memory traffic of a fused kernel.
#include "moecore/kernels/common/norm_chunks.h"
#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda {
namespace {

template <class TY>
__global__ void rmsnorm_forward_kernel(TY* y, float* rstd, const float* x, const float* w, float eps, int64_t H) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  const float* xr = x + n * H;
  float ss = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) ss += xr[h] * xr[h];
  ss = block_reduce(ss, shared, Sum{});
  const float r = 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
  if (threadIdx.x == 0) rstd[n] = r;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) st(y[n * H + h], xr[h] * r * w[h]);
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = w * dy, xhat = x * rstd.
template <bool Accumulate, class TD>
__global__ void rmsnorm_dx_kernel(float* dx, const TD* dy, const float* x, const float* w, const float* rstd,
                                  int64_t H) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  const float* xr = x + n * H;
  const TD* dyr = dy + n * H;
  const float r = rstd[n];
  float dot = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dot += w[h] * ld(dyr[h]) * xr[h];
  dot = block_reduce(dot, shared, Sum{});
  const float k = dot * r * r * (1.0f / static_cast<float>(H));
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const float v = r * (w[h] * ld(dyr[h]) - xr[h] * k);
    if constexpr (Accumulate)
      dx[n * H + h] += v;
    else
      dx[n * H + h] = v;
  }
}

// partial_w[c, h] = sum over the rows of chunk c of dy * xhat (and partial_b[c, h] of dy for LayerNorm).
template <bool Layer, class TD>
__global__ void norm_partials_kernel(float* partial_w, float* partial_b, const TD* dy, const float* x,
                                     const float* mean, const float* rstd, int64_t N, int64_t H, int64_t rows_per) {
  const int64_t c = blockIdx.y, h = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (h >= H) return;
  const int64_t n0 = c * rows_per, n1 = n0 + rows_per < N ? n0 + rows_per : N;
  float pw = 0.0f, pb = 0.0f;
  for (int64_t n = n0; n < n1; ++n) {
    const float d = ld(dy[n * H + h]);
    if constexpr (Layer) {
      pw += d * ((x[n * H + h] - mean[n]) * rstd[n]);
      pb += d;
    } else {
      pw += d * x[n * H + h] * rstd[n];
    }
  }
  partial_w[c * H + h] = pw;
  if constexpr (Layer) partial_b[c * H + h] = pb;
}

// dst[h] += sum over chunks c, in order, of partial[c * H + h].
__global__ void reduce_partials_kernel(float* dst, const float* partial, int64_t chunks, int64_t H) {
  MOECORE_GRID_STRIDE(h, H) {
    float acc = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * H + h];
    dst[h] += acc;
  }
}

template <class TY>
__global__ void layernorm_forward_kernel(TY* y, float* mean, float* rstd, const float* x, const float* w,
                                         const float* b, float eps, int64_t H) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  const float* xr = x + n * H;
  const float inv_h = 1.0f / static_cast<float>(H);
  float s = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) s += xr[h];
  const float mu = block_reduce(s, shared, Sum{}) * inv_h;
  float ss = 0.0f;  // two passes: E[x^2] - mu^2 cancels badly when |mu| >> std
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) ss += (xr[h] - mu) * (xr[h] - mu);
  ss = block_reduce(ss, shared, Sum{});
  const float r = 1.0f / sqrtf(ss * inv_h + eps);
  if (threadIdx.x == 0) {
    mean[n] = mu;
    rstd[n] = r;
  }
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) st(y[n * H + h], (xr[h] - mu) * r * w[h] + b[h]);
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = w * dy.
template <bool Accumulate, class TD>
__global__ void layernorm_dx_kernel(float* dx, const TD* dy, const float* x, const float* w, const float* mean,
                                    const float* rstd, int64_t H) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  const float* xr = x + n * H;
  const TD* dyr = dy + n * H;
  const float mu = mean[n], r = rstd[n], inv_h = 1.0f / static_cast<float>(H);
  float sg = 0.0f, sgx = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const float g = w[h] * ld(dyr[h]);
    sg += g;
    sgx += g * (xr[h] - mu) * r;
  }
  const float mg = block_reduce(sg, shared, Sum{}) * inv_h;
  const float mgx = block_reduce(sgx, shared, Sum{}) * inv_h;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const float xhat = (xr[h] - mu) * r;
    const float v = r * (w[h] * ld(dyr[h]) - mg - xhat * mgx);
    if constexpr (Accumulate)
      dx[n * H + h] += v;
    else
      dx[n * H + h] = v;
  }
}

// Threads per row CTA: a warp for narrow rows, up to 256.
unsigned row_threads(int64_t H) {
  return H >= 256 ? 256u : (H > 32 ? static_cast<unsigned>((H + 31) / 32 * 32) : 32u);
}
// Blocks of a one-CTA-per-row kernel: N, within grid.x's limit.
unsigned rows_grid(const Launch& l, int64_t N) {
  MOECORE_CHECK(N <= 0x7fffffff, l.op(), " (cuda): ", N, " rows exceed the grid");
  return static_cast<unsigned>(N);
}

// dw (and db) += the chunked column sums of dy * xhat (and dy).
template <bool Layer, class TD>
void norm_param_grads(const Launch& l, float* dw, float* db, const TD* dy, const float* x, const float* mean,
                      const float* rstd, int64_t N, int64_t H) {
  const RowChunks chunks(N);
  WorkspaceCarver w;
  w.reserve<float>(chunks.count * H, Layer ? 2 : 1);
  w.allocate(l);
  float* partial_w = w.take<float>(chunks.count * H);
  float* partial_b = Layer ? w.take<float>(chunks.count * H) : nullptr;
  const dim3 grid(static_cast<unsigned>((H + kThreads - 1) / kThreads), static_cast<unsigned>(chunks.count));
  norm_partials_kernel<Layer>
      <<<grid, kThreads, 0, l.stream()>>>(partial_w, partial_b, dy, x, mean, rstd, N, H, chunks.rows_per);
  l.launched("norm_partials_kernel");
  reduce_partials_kernel<<<grid_for(H), kThreads, 0, l.stream()>>>(dw, partial_w, chunks.count, H);
  if constexpr (Layer) reduce_partials_kernel<<<grid_for(H), kThreads, 0, l.stream()>>>(db, partial_b, chunks.count, H);
  l.launched("reduce_partials_kernel");
}

}  // namespace

void rmsnorm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, float eps, const Context& ctx) {
  const Launch l("rmsnorm_forward", ctx, {{"y", &y}, {"rstd", &rstd}, {"x", &x}, {"w", &w}});
  const int64_t N = x.size(0), H = x.size(1);
  if (N == 0) return;
  with_float_type(y.dtype(), [&](auto t) {
    using T = decltype(t);
    rmsnorm_forward_kernel<<<rows_grid(l, N), row_threads(H), 0, l.stream()>>>(
        Launch::ptr<T>(y), Launch::ptr<float>(rstd), Launch::ptr<const float>(x), Launch::ptr<const float>(w), eps, H);
  });
  l.launched("rmsnorm_forward_kernel");
}

void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      bool accumulate_dx, const Context& ctx) {
  const Launch l("rmsnorm_backward", ctx,
                 {{"dx", &dx}, {"dw", &dw}, {"dy", &dy}, {"x", &x}, {"w", &w}, {"rstd", &rstd}});
  const int64_t N = x.size(0), H = x.size(1);
  if (N == 0 || H == 0) return;
  with_float_type(dy.dtype(), [&](auto t) {
    using TD = decltype(t);
    auto* kernel = accumulate_dx ? rmsnorm_dx_kernel<true, TD> : rmsnorm_dx_kernel<false, TD>;
    kernel<<<rows_grid(l, N), row_threads(H), 0, l.stream()>>>(Launch::ptr<float>(dx), Launch::ptr<const TD>(dy),
                                                               Launch::ptr<const float>(x), Launch::ptr<const float>(w),
                                                               Launch::ptr<const float>(rstd), H);
    l.launched("rmsnorm_dx_kernel");
    norm_param_grads<false>(l, Launch::ptr<float>(dw), nullptr, Launch::ptr<const TD>(dy), Launch::ptr<const float>(x),
                            nullptr, Launch::ptr<const float>(rstd), N, H);
  });
}

void layernorm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                       float eps, const Context& ctx) {
  const Launch l("layernorm_forward", ctx,
                 {{"y", &y}, {"mean", &mean}, {"rstd", &rstd}, {"x", &x}, {"w", &w}, {"b", &b}});
  const int64_t N = x.size(0), H = x.size(1);
  if (N == 0) return;
  with_float_type(y.dtype(), [&](auto t) {
    using T = decltype(t);
    layernorm_forward_kernel<<<rows_grid(l, N), row_threads(H), 0, l.stream()>>>(
        Launch::ptr<T>(y), Launch::ptr<float>(mean), Launch::ptr<float>(rstd), Launch::ptr<const float>(x),
        Launch::ptr<const float>(w), Launch::ptr<const float>(b), eps, H);
  });
  l.launched("layernorm_forward_kernel");
}

void layernorm_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, bool accumulate_dx, const Context& ctx) {
  const Launch l(
      "layernorm_backward", ctx,
      {{"dx", &dx}, {"dw", &dw}, {"db", &db}, {"dy", &dy}, {"x", &x}, {"w", &w}, {"mean", &mean}, {"rstd", &rstd}});
  const int64_t N = x.size(0), H = x.size(1);
  if (N == 0 || H == 0) return;
  with_float_type(dy.dtype(), [&](auto t) {
    using TD = decltype(t);
    auto* kernel = accumulate_dx ? layernorm_dx_kernel<true, TD> : layernorm_dx_kernel<false, TD>;
    kernel<<<rows_grid(l, N), row_threads(H), 0, l.stream()>>>(
        Launch::ptr<float>(dx), Launch::ptr<const TD>(dy), Launch::ptr<const float>(x), Launch::ptr<const float>(w),
        Launch::ptr<const float>(mean), Launch::ptr<const float>(rstd), H);
    l.launched("layernorm_dx_kernel");
    norm_param_grads<true>(l, Launch::ptr<float>(dw), Launch::ptr<float>(db), Launch::ptr<const TD>(dy),
                           Launch::ptr<const float>(x), Launch::ptr<const float>(mean), Launch::ptr<const float>(rstd),
                           N, H);
  });
}

}  // namespace moecore::ops::cuda
