// CUDA linear-layer biases (bias_add / bias_grad, grouped and row-scaled grouped) and counter-based dropout
// (dropout_forward / _backward, bias_dropout_add and its backward). Group sizes are read on the device through a
// segment plan (cuda_util.cuh). Dropout masks come from Philox on the device, bit-identical to the CPU's (the mask
// depends on (key, flat index) only). Column sums (dbias) reproduce the CPU's order exactly: each group's rows in
// chunks of 256 summed in row order in double (one thread per column and chunk), then the chunks in chunk order onto
// the f32 gradient (column_sums.h). Deterministic, no atomics; the serial 256-row walk per thread and a second launch
// cost some bandwidth against a one-pass atomic reduction. The fused backward regenerates one Philox block per
// element there (instead of one per four), about 40 integer ops per element.
#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda {
namespace {

constexpr int64_t kChunkRows = 256;

// Contiguous row segments: offsets [G + 1] and 256-row chunk counts [G + 1] from segment_plan, or (null offsets) one
// segment of all R rows.
struct Segments {
  const int64_t* offsets = nullptr;
  const int64_t* chunks = nullptr;
  int64_t G = 1, R = 0;
  __device__ int64_t rows() const { return offsets ? offsets[G] : R; }
  __device__ int64_t begin(int64_t g) const { return offsets ? offsets[g] : 0; }
  __device__ int64_t end(int64_t g) const { return offsets ? offsets[g + 1] : R; }
  __device__ int64_t group_of_row(int64_t r) const { return offsets ? segment_of(offsets, G, r) : 0; }
  __device__ int64_t chunk_begin(int64_t g) const { return offsets ? chunks[g] : 0; }
  __device__ int64_t chunk_end(int64_t g) const { return offsets ? chunks[g + 1] : (R + kChunkRows - 1) / kChunkRows; }
  __device__ int64_t group_of_chunk(int64_t c) const { return offsets ? segment_of(chunks, G, c) : 0; }
};

// The segments of an op: the plan of group_rows in the workspace (G + 1 offsets and chunk counts), or one segment.
// `extra_bytes` more workspace follow the plan, returned through *extra.
Segments make_segments(const Launch& l, const Tensor* group_rows, int64_t R, size_t extra_bytes, void** extra) {
  WorkspaceCarver w;
  const int64_t G = group_rows ? group_rows->numel() : 1;
  if (group_rows) w.reserve<int64_t>(G + 1, 2);
  w.reserve_bytes(extra_bytes);
  w.allocate(l);
  Segments s;
  s.G = G;
  s.R = R;
  if (group_rows) {
    int64_t* offsets = w.take<int64_t>(G + 1);
    int64_t* chunks = w.take<int64_t>(G + 1);
    segment_plan(l, offsets, chunks, Launch::ptr<const int64_t>(*group_rows), G, R, kChunkRows);
    s.offsets = offsets;
    s.chunks = chunks;
  }
  if (extra) *extra = w.take_bytes(extra_bytes);
  return s;
}

// y[r, :] += (row_scale ? row_scale[r] : 1) * bias[g(r), :] for the rows the segments cover.
template <class T>
__global__ void bias_add_kernel(T* y, int64_t ldy, const float* bias, const float* row_scale, Segments seg, int64_t W) {
  const int64_t rows = seg.rows();
  MOECORE_GRID_STRIDE(i, seg.R * W) {
    const int64_t r = i / W, w = i % W;
    if (r >= rows) continue;
    const float b = bias[seg.group_of_row(r) * W + w];
    T& dst = y[r * ldy + w];
    st(dst, row_scale ? ld(dst) + row_scale[r] * b : ld(dst) + b);
  }
}

// partial[c * W + w] = the double sum, in row order, of term(r, w) over the rows of chunk c.
template <class Term>
__global__ void column_partials_kernel(double* partial, Segments seg, int64_t W, Term term) {
  const int64_t c = blockIdx.x, w = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (w >= W || c >= seg.chunk_end(seg.G - 1)) return;
  const int64_t g = seg.group_of_chunk(c);
  const int64_t r0 = seg.begin(g) + (c - seg.chunk_begin(g)) * kChunkRows;
  const int64_t r1 = r0 + kChunkRows < seg.end(g) ? r0 + kChunkRows : seg.end(g);
  double acc = 0.0;
  for (int64_t r = r0; r < r1; ++r) acc += term(r, w);
  partial[c * W + w] = acc;
}

// out[g * W + w] = f32(out[g * W + w] + the chunk sums of group g in chunk order).
__global__ void column_finish_kernel(float* out, const double* partial, Segments seg, int64_t W) {
  MOECORE_GRID_STRIDE(i, seg.G * W) {
    const int64_t g = i / W, w = i % W;
    double s = out[i];
    for (int64_t c = seg.chunk_begin(g); c < seg.chunk_end(g); ++c) s += partial[c * W + w];
    out[i] = static_cast<float>(s);
  }
}

// Upper bound of the chunks of R rows in G segments: sum ceil(n_g / 256) <= R / 256 + G.
int64_t max_chunks(int64_t R, int64_t G) {
  return (R + kChunkRows - 1) / kChunkRows + G;
}

// out [G, W] += the segments' column sums of term (deterministic, see the file comment).
template <class Term>
void column_sums(const Launch& l, float* out, const Tensor* group_rows, int64_t R, int64_t W, Term term) {
  const int64_t G = group_rows ? group_rows->numel() : 1;
  if (W == 0 || G == 0) return;
  const int64_t chunks = max_chunks(R, G);
  void* extra = nullptr;
  const Segments seg = make_segments(l, group_rows, R, static_cast<size_t>(chunks * W) * sizeof(double), &extra);
  double* partial = static_cast<double*>(extra);
  if (R > 0) {
    MOECORE_CHECK(chunks <= 0x7fffffff && (W + kThreads - 1) / kThreads <= 65535, l.op(),
                  " (cuda): too many rows or columns for the column-sum grid: R = ", R, ", W = ", W);
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>((W + kThreads - 1) / kThreads));
    column_partials_kernel<<<grid, kThreads, 0, l.stream()>>>(partial, seg, W, term);
    l.launched("column_partials_kernel");
  }
  column_finish_kernel<<<grid_for(G * W), kThreads, 0, l.stream()>>>(out, partial, seg, W);
  l.launched("column_finish_kernel");
}

template <class T>
struct BiasGradTerm {
  const T* dy;
  int64_t ldy;
  const float* row_scale;
  __device__ double operator()(int64_t r, int64_t w) const {
    const double s = row_scale ? row_scale[r] : 1.0;
    return s * static_cast<double>(ld(dy[r * ldy + w]));
  }
};

// drow_scale[r] = dy[r, :] . bias[g(r), :] in double (fixed tree) for the covered rows; one CTA per row.
template <class T>
__global__ void row_dot_kernel(float* drow_scale, const T* dy, int64_t ldy, const float* bias, Segments seg,
                               int64_t W) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  if (r >= seg.rows()) return;
  const float* b = bias + seg.group_of_row(r) * W;
  double s = 0.0;
  for (int64_t w = threadIdx.x; w < W; w += blockDim.x) s += static_cast<double>(ld(dy[r * ldy + w])) * b[w];
  s = block_reduce(s, shared, Sum{});
  if (threadIdx.x == 0) drow_scale[r] = static_cast<float>(s);
}

void add_dispatch(const Launch& l, Tensor& y, const Tensor& bias, const float* row_scale, const Tensor* group_rows) {
  const int64_t R = y.size(0), W = y.size(1);
  if (R * W == 0) return;
  const Segments seg = make_segments(l, group_rows, R, 0, nullptr);
  with_float_type(y.dtype(), [&](auto t) {
    using T = decltype(t);
    bias_add_kernel<<<grid_for(R * W), kThreads, 0, l.stream()>>>(Launch::ptr<T>(y), y.stride(0),
                                                                  Launch::ptr<const float>(bias), row_scale, seg, W);
  });
  l.launched("bias_add_kernel");
}

void grad_dispatch(const Launch& l, Tensor& dbias, const Tensor& dy, const float* row_scale, const Tensor* group_rows) {
  with_float_type(dy.dtype(), [&](auto t) {
    using T = decltype(t);
    column_sums(l, Launch::ptr<float>(dbias), group_rows, dy.size(0), dy.size(1),
                BiasGradTerm<T>{Launch::ptr<const T>(dy), dy.stride(0), row_scale});
  });
}

// ---- dropout ----------------------------------------------------------------------------------------
// Each thread takes one Philox block: elements 4q .. 4q + 3.
template <class T>
__global__ void dropout_kernel(T* y, const T* x, int64_t n, DeviceMask m) {
  MOECORE_GRID_STRIDE(q, (n + 3) / 4) {
    const PhiloxWords words = philox_block(m.key0, m.key1, static_cast<uint64_t>(q));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = 4 * q + k;
      if (i < n) st(y[i], apply_factor(ld(x[i]), words.w[k] >= m.threshold ? m.scale : 0.0f));
    }
  }
}

// y = residual + dropout(x + bias), flat index i = n * H + h.
template <class TX>
__global__ void bias_dropout_add_kernel(float* y, const float* residual, const TX* x, const float* bias, int64_t n,
                                        int64_t H, DeviceMask m) {
  MOECORE_GRID_STRIDE(q, (n + 3) / 4) {
    PhiloxWords words = {};
    if (m.active) words = philox_block(m.key0, m.key1, static_cast<uint64_t>(q));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = 4 * q + k;
      if (i >= n) break;
      const float f = m.active ? (words.w[k] >= m.threshold ? m.scale : 0.0f) : 1.0f;
      const float v = bias ? ld(x[i]) + bias[i % H] : ld(x[i]);
      y[i] = residual[i] + apply_factor(v, f);
    }
  }
}

template <class TX>
__global__ void dropout_grad_kernel(TX* dx, const float* dy, int64_t n, DeviceMask m) {
  MOECORE_GRID_STRIDE(i, n) st(dx[i], apply_factor(dy[i], m.factor(static_cast<uint64_t>(i))));
}

// dx = dropout(dy) written on the way through the column sums (every element visited once); the f32 value before
// dx's rounding is summed.
template <class TX>
struct DropoutGradTerm {
  TX* dx;
  const float* dy;
  int64_t H;
  DeviceMask m;
  __device__ double operator()(int64_t r, int64_t w) const {
    const int64_t i = r * H + w;
    const float v = apply_factor(dy[i], m.factor(static_cast<uint64_t>(i)));
    st(dx[i], v);
    return v;
  }
};

void dropout_apply(const char* op, const char* out_name, const char* in_name, Tensor& y, const Tensor& x,
                   const Dropout& d, const Context& ctx) {
  const Launch l(op, ctx, {{out_name, &y}, {in_name, &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  if (!d.active()) {
    if (y.device_ptr() != x.device_ptr()) {
      l.check(cudaMemcpyAsync(y.device_ptr(), x.device_ptr(), static_cast<size_t>(x.nbytes()), cudaMemcpyDeviceToDevice,
                              l.stream()),
              "cudaMemcpyAsync");
      l.enqueued("cudaMemcpyAsync");
    }
    return;
  }
  const DeviceMask m = device_mask(d);
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    dropout_kernel<<<grid_for((n + 3) / 4), kThreads, 0, l.stream()>>>(Launch::ptr<T>(y), Launch::ptr<const T>(x), n,
                                                                       m);
  });
  l.launched("dropout_kernel");
}

}  // namespace

void bias_add(Tensor& y, const Tensor& bias, const Context& ctx) {
  const Launch l("bias_add", ctx, {{"y", &y}, {"bias", &bias}});
  add_dispatch(l, y, bias, nullptr, nullptr);
}

void bias_grad(Tensor& dbias, const Tensor& dy, const Context& ctx) {
  const Launch l("bias_grad", ctx, {{"dbias", &dbias}, {"dy", &dy}});
  grad_dispatch(l, dbias, dy, nullptr, nullptr);
}

void bias_add_grouped(Tensor& y, const Tensor& bias, const Tensor& group_rows, const Context& ctx) {
  const Launch l("bias_add_grouped", ctx, {{"y", &y}, {"bias", &bias}, {"group_rows", &group_rows}});
  if (group_rows.numel() > 0) add_dispatch(l, y, bias, nullptr, &group_rows);
}

void bias_grad_grouped(Tensor& dbias, const Tensor& dy, const Tensor& group_rows, const Context& ctx) {
  const Launch l("bias_grad_grouped", ctx, {{"dbias", &dbias}, {"dy", &dy}, {"group_rows", &group_rows}});
  grad_dispatch(l, dbias, dy, nullptr, &group_rows);
}

void bias_add_grouped_scaled(Tensor& y, const Tensor& bias, const Tensor& row_scale, const Tensor& group_rows,
                             const Context& ctx) {
  const Launch l("bias_add_grouped_scaled", ctx,
                 {{"y", &y}, {"bias", &bias}, {"row_scale", &row_scale}, {"group_rows", &group_rows}});
  if (group_rows.numel() > 0) add_dispatch(l, y, bias, Launch::ptr<const float>(row_scale), &group_rows);
}

void bias_grad_grouped_scaled(Tensor& dbias, Tensor& drow_scale, const Tensor& dy, const Tensor& bias,
                              const Tensor& row_scale, const Tensor& group_rows, const Context& ctx) {
  const Launch l("bias_grad_grouped_scaled", ctx,
                 {{"dbias", &dbias},
                  {"drow_scale", &drow_scale},
                  {"dy", &dy},
                  {"bias", &bias},
                  {"row_scale", &row_scale},
                  {"group_rows", &group_rows}});
  grad_dispatch(l, dbias, dy, Launch::ptr<const float>(row_scale), &group_rows);
  const int64_t R = dy.size(0), W = dy.size(1);
  if (!drow_scale.defined() || R == 0 || group_rows.numel() == 0) return;
  MOECORE_CHECK(R <= 0x7fffffff, "bias_grad_grouped_scaled (cuda): R = ", R, " rows exceed the grid");
  const Segments seg = make_segments(l, &group_rows, R, 0, nullptr);
  with_float_type(dy.dtype(), [&](auto t) {
    using T = decltype(t);
    row_dot_kernel<<<static_cast<unsigned>(R), kThreads, 0, l.stream()>>>(
        Launch::ptr<float>(drow_scale), Launch::ptr<const T>(dy), dy.stride(0), Launch::ptr<const float>(bias), seg, W);
  });
  l.launched("row_dot_kernel");
}

void dropout_forward(Tensor& y, const Tensor& x, const Dropout& d, const Context& ctx) {
  dropout_apply("dropout_forward", "y", "x", y, x, d, ctx);
}

void dropout_backward(Tensor& dx, const Tensor& dy, const Dropout& d, const Context& ctx) {
  dropout_apply("dropout_backward", "dx", "dy", dx, dy, d, ctx);
}

void bias_dropout_add(Tensor& y, const Tensor& residual, const Tensor& x, const Tensor& bias, const Dropout& d,
                      const Context& ctx) {
  const Launch l("bias_dropout_add", ctx, {{"y", &y}, {"residual", &residual}, {"x", &x}, {"bias", &bias}});
  const int64_t N = y.size(0), H = y.size(1), n = N * H;
  if (n == 0) return;
  const DeviceMask m = device_mask(d);
  const float* bp = bias.defined() ? Launch::ptr<const float>(bias) : nullptr;
  with_float_type(x.dtype(), [&](auto t) {
    using TX = decltype(t);
    bias_dropout_add_kernel<<<grid_for((n + 3) / 4), kThreads, 0, l.stream()>>>(
        Launch::ptr<float>(y), Launch::ptr<const float>(residual), Launch::ptr<const TX>(x), bp, n, H, m);
  });
  l.launched("bias_dropout_add_kernel");
}

void bias_dropout_add_backward(Tensor& dx, Tensor& dbias, const Tensor& dy, const Dropout& d, const Context& ctx) {
  const Launch l("bias_dropout_add_backward", ctx, {{"dx", &dx}, {"dbias", &dbias}, {"dy", &dy}});
  const int64_t N = dy.size(0), H = dy.size(1), n = N * H;
  const DeviceMask m = device_mask(d);
  with_float_type(dx.dtype(), [&](auto t) {
    using TX = decltype(t);
    if (dbias.defined()) {
      column_sums(l, Launch::ptr<float>(dbias), nullptr, N, H,
                  DropoutGradTerm<TX>{Launch::ptr<TX>(dx), Launch::ptr<const float>(dy), H, m});
    } else if (n > 0) {
      dropout_grad_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<TX>(dx), Launch::ptr<const float>(dy),
                                                                    n, m);
      l.launched("dropout_grad_kernel");
    }
  });
}

}  // namespace moecore::ops::cuda
