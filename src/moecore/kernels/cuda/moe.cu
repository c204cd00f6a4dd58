// CUDA MoE token permutation (moe_plan, moe_permute, moe_unpermute, moe_unpermute_probs, the all-to-all chunk sort
// and counts) and expert-row steps (probability scaling, the shared expert's gate) of moe.cpp. Plans, offsets and
// counts are computed and read on the device only. The plan, permutations and copies equal the CPU's bit for bit:
// one block per expert counts its routed tokens in token order with warp ballots (integer scans, no atomics). Float
// sums (unpermute, dot products, dg) run in fixed orders without atomics: unpermute in the CPU's order (bitwise), the
// dot products as fixed block trees, dg over 256-token chunks added in chunk order.
// Where the CPU raises on data (ops_cuda.h): routed pairs beyond row_token's M rows are cut off (the plan stays
// consistent, as if those pairs were dropped), a token_rows entry >= M counts as unrouted, negative chunk counts as 0.
#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda {
namespace {

constexpr int kScanThreads = 1024;

// Per expert e (one block): ranks[t, e] = the number of routed tokens before t in column e (-1 where not routed) and
// n[e] the column's routed count.
__global__ void plan_rank_kernel(int32_t* ranks, int64_t* n, const bool* map, int64_t T, int64_t E) {
  __shared__ int shared[32];
  const int64_t e = blockIdx.x;
  int64_t base = 0;
  for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const bool routed = t < T && map[t * E + e];
    int total = 0;
    const int before = block_exclusive_count(routed, shared, &total);
    if (t < T) ranks[t * E + e] = routed ? static_cast<int32_t>(base + before) : -1;
    base += total;
  }
  if (threadIdx.x == 0) n[e] = base;
}

// offsets from the counts, every segment cut to the M rows available (counts follow the cut).
__global__ void plan_offsets_kernel(int64_t* counts, int64_t* offsets, int64_t E, int64_t M) {
  int64_t o = 0;
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t want = counts[e], got = want < M - o ? want : M - o;
    counts[e] = got;
    o += got;
    offsets[e + 1] = o;
  }
}

__global__ void plan_rows_kernel(int32_t* token_rows, int32_t* row_token, const int64_t* offsets, int64_t T, int64_t E,
                                 int64_t M) {
  MOECORE_GRID_STRIDE(i, T * E) {
    const int32_t rank = token_rows[i];
    if (rank < 0) continue;
    const int64_t e = i % E, row = offsets[e] + rank;
    if (row < offsets[e + 1]) {
      token_rows[i] = static_cast<int32_t>(row);
      row_token[row] = static_cast<int32_t>(i / E);
    } else {
      token_rows[i] = -1;
    }
  }
  MOECORE_GRID_STRIDE(r, M) {
    if (r >= offsets[E]) row_token[r] = -1;
  }
}

// One block per row r < offsets[E]: rows[r] = x[row_token[r]], and row_probs[r] = probs[t, e(r)].
template <class TD, class TS>
__global__ void permute_kernel(TD* rows, int64_t ldr, float* row_probs, const TS* x, int64_t ldx, const float* probs,
                               const int32_t* row_token, const int64_t* offsets, int64_t E, int64_t H) {
  const int64_t r = blockIdx.x;
  if (r >= offsets[E]) return;
  const int64_t t = row_token[r];
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) st(rows[r * ldr + j], ld(x[t * ldx + j]));
  if (row_probs && threadIdx.x == 0) row_probs[r] = probs[t * E + segment_of(offsets, E, r)];
}

// One thread per (token, column): the CPU's order (e ascending, the first term assigned unless accumulating).
template <class TR>
__global__ void unpermute_kernel(float* y, int64_t ldy, const TR* rows, int64_t ldr, const int32_t* token_rows,
                                 int64_t T, int64_t E, int64_t H, int64_t M, bool accumulate) {
  MOECORE_GRID_STRIDE(i, T * H) {
    const int64_t t = i / H, j = i % H;
    float acc = accumulate ? y[t * ldy + j] : 0.0f;
    bool first = !accumulate;
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = token_rows[t * E + e];
      if (r < 0 || r >= M) continue;
      const float v = ld(rows[r * ldr + j]);
      acc = first ? v : acc + v;
      first = false;
    }
    y[t * ldy + j] = acc;
  }
}

__global__ void unpermute_probs_kernel(float* out, int64_t ld, const float* values, const int32_t* token_rows,
                                       int64_t T, int64_t E, int64_t M) {
  MOECORE_GRID_STRIDE(i, T * E) {
    const int32_t r = token_rows[i];
    out[(i / E) * ld + i % E] = r >= 0 && r < M ? values[r] : 0.0f;
  }
}

// Chunk starts in the source layout (src_start, ascending, one entry past the last: the rows to move, cut to
// `max_rows`) and where each source chunk goes (dst_start). Chunk c of the source is (s, le) = (c / El, c % El) in
// the receive layout and (c % P, c / P) in the expert layout.
__global__ void sort_chunks_plan_kernel(int64_t* src_start, int64_t* dst_start, const int64_t* n, int64_t P, int64_t El,
                                        bool inverse, int64_t max_rows) {
  const int64_t C = P * El;
  auto count = [&](int64_t s, int64_t le) {
    const int64_t v = n[s * El + le];
    return v < 0 ? int64_t{0} : v;
  };
  int64_t o = 0;
  for (int64_t c = 0; c < C; ++c) {  // the source layout's order
    src_start[c] = o;
    o += inverse ? count(c % P, c / P) : count(c / El, c % El);
  }
  src_start[C] = o < max_rows ? o : max_rows;
  o = 0;
  for (int64_t c = 0; c < C; ++c) {  // the destination layout's order, noted at its source chunk
    const int64_t s = inverse ? c / El : c % P, le = inverse ? c % El : c / P;
    dst_start[inverse ? le * P + s : s * El + le] = o;
    o += count(s, le);
  }
}

template <class W>
__global__ void sort_chunks_copy_kernel(W* out, const W* in, const int64_t* src_start, const int64_t* dst_start,
                                        int64_t C, int64_t row_words, int64_t out_rows) {
  const int64_t rows = src_start[C];
  MOECORE_GRID_STRIDE(i, rows * row_words) {
    const int64_t r = i / row_words, w = i % row_words, c = segment_of(src_start, C, r);
    const int64_t to = dst_start[c] + r - src_start[c];
    if (to < out_rows) out[to * row_words + w] = in[i];
  }
}

__global__ void chunk_counts_kernel(int64_t* counts, int64_t* offsets, const int64_t* chunk_counts, int64_t P,
                                    int64_t El) {
  int64_t o = 0;
  offsets[0] = 0;
  for (int64_t le = 0; le < El; ++le) {
    int64_t n = 0;
    for (int64_t s = 0; s < P; ++s) n += chunk_counts[s * El + le];
    counts[le] = n;
    o += n;
    offsets[le + 1] = o;
  }
}

// a = act * p (one rounding of the f32 product, as the CPU) for rows below offsets[G].
template <class T>
__global__ void scale_rows_kernel(T* a, const T* act, const float* p, const int64_t* offsets, int64_t G, int64_t M,
                                  int64_t F) {
  const int64_t rows = offsets[G];
  MOECORE_GRID_STRIDE(i, M * F) {
    if (i / F >= rows) continue;
    st(a[i], __fmul_rn(ld(act[i]), p[i / F]));
  }
}

template <class T>
__global__ void scale_rows_backward_kernel(float* dp, T* da, T* a, const T* act, const float* p, const int64_t* offsets,
                                           int64_t G, int64_t F, bool accumulate) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  if (r >= offsets[G]) return;
  const float pr = p[r];
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < F; j += blockDim.x) {
    const float v = ld(act[r * F + j]), g = ld(da[r * F + j]);
    dot += v * g;
    st(da[r * F + j], __fmul_rn(g, pr));
    st(a[r * F + j], __fmul_rn(v, pr));
  }
  dot = block_reduce(dot, shared, Sum{});
  if (threadIdx.x == 0) dp[r] = accumulate ? dp[r] + dot : dot;
}

template <class T>
__global__ void shared_gate_forward_kernel(float* y, float* s, const T* x, const float* g, const float* out,
                                           int64_t H) {
  __shared__ float shared[32];
  const int64_t t = blockIdx.x;
  float z = 0.0f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) z += ld(x[t * H + j]) * g[j];
  z = block_reduce(z, shared, Sum{});
  const float sg = 1.0f / (1.0f + expf(-z));
  if (threadIdx.x == 0) s[t] = sg;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) y[t * H + j] += sg * out[t * H + j];
}

template <class T>
__global__ void shared_gate_backward_rows_kernel(T* dout, float* dx, float* dz, const float* dy, const float* g,
                                                 const float* out, const float* s, int64_t H) {
  __shared__ float shared[32];
  const int64_t t = blockIdx.x;
  const float st_ = s[t];
  float ds = 0.0f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) ds += dy[t * H + j] * out[t * H + j];
  ds = block_reduce(ds, shared, Sum{});
  const float dzt = ds * st_ * (1.0f - st_);
  if (threadIdx.x == 0) dz[t] = dzt;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    st(dout[t * H + j], dy[t * H + j] * st_);
    dx[t * H + j] += dzt * g[j];
  }
}

constexpr int64_t kChunk = 256;

// partial[c, j] = sum over the tokens of chunk c, in order, of dz[t] x[t, j]; then dg[j] += the chunks in order.
template <class T>
__global__ void shared_gate_dg_partial_kernel(float* partial, const float* dz, const T* x, int64_t N, int64_t H) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x, c = blockIdx.y;
  if (j >= H) return;
  const int64_t t1 = (c + 1) * kChunk < N ? (c + 1) * kChunk : N;
  float acc = 0.0f;
  for (int64_t t = c * kChunk; t < t1; ++t) acc += dz[t] * ld(x[t * H + j]);
  partial[c * H + j] = acc;
}

__global__ void shared_gate_dg_reduce_kernel(float* dg, const float* partial, int64_t chunks, int64_t H) {
  MOECORE_GRID_STRIDE(j, H) {
    float acc = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * H + j];
    dg[j] += acc;
  }
}

unsigned row_grid(const Launch& l, int64_t rows) {
  MOECORE_CHECK(rows <= 0x7fffffff, l.op(), " (cuda): ", rows, " rows exceed the grid");
  return static_cast<unsigned>(rows);
}
// Threads of a one-block-per-row kernel: 256, or the row's width rounded up to whole warps.
unsigned row_block(int64_t H) {
  return H >= 256 ? 256u : (H <= 32 ? 32u : static_cast<unsigned>((H + 31) / 32 * 32));
}

}  // namespace

void moe_plan(Tensor& counts, Tensor& offsets, Tensor& token_rows, Tensor& row_token, const Tensor& map,
              const Context& ctx) {
  const Launch l("moe_plan", ctx,
                 {{"counts", &counts},
                  {"offsets", &offsets},
                  {"token_rows", &token_rows},
                  {"row_token", &row_token},
                  {"map", &map}});
  const int64_t T = map.size(0), E = map.size(1), M = row_token.numel();
  int64_t* n = Launch::ptr<int64_t>(counts);
  int64_t* off = Launch::ptr<int64_t>(offsets);
  int32_t* tr = Launch::ptr<int32_t>(token_rows);
  if (E > 0) {
    plan_rank_kernel<<<row_grid(l, E), kScanThreads, 0, l.stream()>>>(tr, n, Launch::ptr<const bool>(map), T, E);
    l.launched("plan_rank_kernel");
  }
  plan_offsets_kernel<<<1, 1, 0, l.stream()>>>(n, off, E, M);
  l.launched("plan_offsets_kernel");
  plan_rows_kernel<<<grid_for(T * E > M ? T * E : M), kThreads, 0, l.stream()>>>(tr, Launch::ptr<int32_t>(row_token),
                                                                                 off, T, E, M);
  l.launched("plan_rows_kernel");
}

void moe_permute(Tensor& rows, Tensor& row_probs, const Tensor& x, const Tensor& probs, const Tensor& row_token,
                 const Tensor& offsets, const Context& ctx) {
  const bool with_probs = probs.defined();
  const Launch l("moe_permute", ctx,
                 {{"rows", &rows}, {"x", &x}, {"row_token", &row_token}, {"offsets", &offsets}, {"probs", &probs}});
  const int64_t H = x.size(1), M = rows.size(0), E = offsets.numel() - 1;
  if (M == 0) return;
  with_float_type(rows.dtype(), [&](auto td) {
    with_float_type(x.dtype(), [&](auto ts) {
      using TD = decltype(td);
      using TS = decltype(ts);
      permute_kernel<<<row_grid(l, M), row_block(H), 0, l.stream()>>>(
          Launch::ptr<TD>(rows), rows.stride(0), with_probs ? Launch::ptr<float>(row_probs) : nullptr,
          Launch::ptr<const TS>(x), x.stride(0), with_probs ? Launch::ptr<const float>(probs) : nullptr,
          Launch::ptr<const int32_t>(row_token), Launch::ptr<const int64_t>(offsets), E, H);
    });
  });
  l.launched("permute_kernel");
}

void moe_unpermute(Tensor& y, const Tensor& rows, const Tensor& token_rows, bool accumulate, const Context& ctx) {
  const Launch l("moe_unpermute", ctx, {{"y", &y}, {"rows", &rows}, {"token_rows", &token_rows}});
  const int64_t T = y.size(0), H = y.size(1), E = token_rows.size(1), M = rows.size(0);
  if (T * H == 0) return;
  with_float_type(rows.dtype(), [&](auto tag) {
    using TR = decltype(tag);
    unpermute_kernel<<<grid_for(T * H), kThreads, 0, l.stream()>>>(
        Launch::ptr<float>(y), y.stride(0), Launch::ptr<const TR>(rows), rows.stride(0),
        Launch::ptr<const int32_t>(token_rows), T, E, H, M, accumulate);
  });
  l.launched("unpermute_kernel");
}

void moe_unpermute_probs(Tensor& out, const Tensor& values, const Tensor& token_rows, const Context& ctx) {
  const Launch l("moe_unpermute_probs", ctx, {{"out", &out}, {"values", &values}, {"token_rows", &token_rows}});
  const int64_t T = out.size(0), E = out.size(1);
  if (T * E == 0) return;
  unpermute_probs_kernel<<<grid_for(T * E), kThreads, 0, l.stream()>>>(
      Launch::ptr<float>(out), out.stride(0), Launch::ptr<const float>(values), Launch::ptr<const int32_t>(token_rows),
      T, E, values.numel());
  l.launched("unpermute_probs_kernel");
}

void moe_sort_chunks(Tensor& out, const Tensor& in, const Tensor& chunk_counts, int64_t P, int64_t El, bool inverse,
                     const Context& ctx) {
  const Launch l("moe_sort_chunks", ctx, {{"out", &out}, {"in", &in}, {"chunk_counts", &chunk_counts}});
  const int64_t C = P * El, row_elems = out.dim() == 1 ? 1 : out.stride(0);
  const int64_t row_bytes = row_elems * static_cast<int64_t>(dtype_size(out.dtype()));
  const int64_t max_rows = out.size(0) < in.size(0) ? out.size(0) : in.size(0);
  if (row_bytes == 0 || max_rows == 0) return;
  WorkspaceCarver w;
  w.reserve<int64_t>(C + 1, 2);
  w.allocate(l);
  int64_t* src_start = w.take<int64_t>(C + 1);
  int64_t* dst_start = w.take<int64_t>(C + 1);
  sort_chunks_plan_kernel<<<1, 1, 0, l.stream()>>>(src_start, dst_start, Launch::ptr<const int64_t>(chunk_counts), P,
                                                   El, inverse, max_rows);
  l.launched("sort_chunks_plan_kernel");
  // The widest word that divides a row and both base addresses.
  const auto align = reinterpret_cast<uintptr_t>(out.device_ptr()) | reinterpret_cast<uintptr_t>(in.device_ptr());
  auto copy = [&](auto word) {
    using W = decltype(word);
    const int64_t words = row_bytes / static_cast<int64_t>(sizeof(W));
    sort_chunks_copy_kernel<<<grid_for(max_rows * words), kThreads, 0, l.stream()>>>(
        Launch::ptr<W>(out), Launch::ptr<const W>(in), src_start, dst_start, C, words, out.size(0));
  };
  if (row_bytes % 16 == 0 && align % 16 == 0)
    copy(uint4{});
  else if (row_bytes % 4 == 0 && align % 4 == 0)
    copy(uint32_t{});
  else if (row_bytes % 2 == 0 && align % 2 == 0)
    copy(uint16_t{});
  else
    copy(uint8_t{});
  l.launched("sort_chunks_copy_kernel");
}

void moe_chunk_counts(Tensor& counts, Tensor& offsets, const Tensor& chunk_counts, int64_t P, const Context& ctx) {
  const Launch l("moe_chunk_counts", ctx,
                 {{"counts", &counts}, {"offsets", &offsets}, {"chunk_counts", &chunk_counts}});
  chunk_counts_kernel<<<1, 1, 0, l.stream()>>>(Launch::ptr<int64_t>(counts), Launch::ptr<int64_t>(offsets),
                                               Launch::ptr<const int64_t>(chunk_counts), P, counts.numel());
  l.launched("chunk_counts_kernel");
}

namespace {
// The row offsets of group_rows (cut to M rows) in the workspace.
const int64_t* group_offsets(const Launch& l, const Tensor& group_rows, int64_t M) {
  const int64_t G = group_rows.numel();
  WorkspaceCarver w;
  w.reserve<int64_t>(G + 1, 2);
  w.allocate(l);
  int64_t* offsets = w.take<int64_t>(G + 1);
  int64_t* tiles = w.take<int64_t>(G + 1);
  segment_plan(l, offsets, tiles, Launch::ptr<const int64_t>(group_rows), G, M, 1);
  return offsets;
}
}  // namespace

void moe_scale_rows(Tensor& a, const Tensor& act, const Tensor& p, const Tensor& group_rows, const Context& ctx) {
  const Launch l("moe_scale_rows", ctx, {{"a", &a}, {"act", &act}, {"p", &p}, {"group_rows", &group_rows}});
  const int64_t M = a.size(0), F = a.size(1), G = group_rows.numel();
  const int64_t* off = group_offsets(l, group_rows, M);
  if (M * F == 0) return;
  with_float_type(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    scale_rows_kernel<<<grid_for(M * F), kThreads, 0, l.stream()>>>(Launch::ptr<T>(a), Launch::ptr<const T>(act),
                                                                    Launch::ptr<const float>(p), off, G, M, F);
  });
  l.launched("scale_rows_kernel");
}

void moe_scale_rows_backward(Tensor& dp, Tensor& da, Tensor& a, const Tensor& act, const Tensor& p,
                             const Tensor& group_rows, bool accumulate, const Context& ctx) {
  const Launch l("moe_scale_rows_backward", ctx,
                 {{"dp", &dp}, {"da", &da}, {"a", &a}, {"act", &act}, {"p", &p}, {"group_rows", &group_rows}});
  const int64_t M = a.size(0), F = a.size(1), G = group_rows.numel();
  const int64_t* off = group_offsets(l, group_rows, M);
  if (M == 0) return;
  with_float_type(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    scale_rows_backward_kernel<<<row_grid(l, M), row_block(F), 0, l.stream()>>>(
        Launch::ptr<float>(dp), Launch::ptr<T>(da), Launch::ptr<T>(a), Launch::ptr<const T>(act),
        Launch::ptr<const float>(p), off, G, F, accumulate);
  });
  l.launched("scale_rows_backward_kernel");
}

void moe_shared_gate_forward(Tensor& y, Tensor& s, const Tensor& x, const Tensor& g, const Tensor& out,
                             const Context& ctx) {
  const Launch l("moe_shared_gate_forward", ctx, {{"y", &y}, {"s", &s}, {"x", &x}, {"g", &g}, {"out", &out}});
  const int64_t N = x.size(0), H = x.size(1);
  if (N == 0) return;
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    shared_gate_forward_kernel<<<row_grid(l, N), row_block(H), 0, l.stream()>>>(
        Launch::ptr<float>(y), Launch::ptr<float>(s), Launch::ptr<const T>(x), Launch::ptr<const float>(g),
        Launch::ptr<const float>(out), H);
  });
  l.launched("shared_gate_forward_kernel");
}

void moe_shared_gate_backward(Tensor& dout, Tensor& dx, Tensor& dg, const Tensor& dy, const Tensor& x, const Tensor& g,
                              const Tensor& out, const Tensor& s, const Context& ctx) {
  const Launch l(
      "moe_shared_gate_backward", ctx,
      {{"dout", &dout}, {"dx", &dx}, {"dg", &dg}, {"dy", &dy}, {"x", &x}, {"g", &g}, {"out", &out}, {"s", &s}});
  const int64_t N = x.size(0), H = x.size(1), chunks = (N + kChunk - 1) / kChunk;
  if (N == 0 || H == 0) return;
  MOECORE_CHECK(chunks <= 65535, "moe_shared_gate_backward (cuda): ", N, " tokens exceed the grid");
  WorkspaceCarver w;
  w.reserve<float>(N);
  w.reserve<float>(chunks * H);
  w.allocate(l);
  float* dz = w.take<float>(N);
  float* partial = w.take<float>(chunks * H);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    shared_gate_backward_rows_kernel<<<row_grid(l, N), row_block(H), 0, l.stream()>>>(
        Launch::ptr<T>(dout), Launch::ptr<float>(dx), dz, Launch::ptr<const float>(dy), Launch::ptr<const float>(g),
        Launch::ptr<const float>(out), Launch::ptr<const float>(s), H);
    l.launched("shared_gate_backward_rows_kernel");
    const dim3 grid(static_cast<unsigned>((H + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
    shared_gate_dg_partial_kernel<<<grid, kThreads, 0, l.stream()>>>(partial, dz, Launch::ptr<const T>(x), N, H);
    l.launched("shared_gate_dg_partial_kernel");
  });
  shared_gate_dg_reduce_kernel<<<grid_for(H), kThreads, 0, l.stream()>>>(Launch::ptr<float>(dg), partial, chunks, H);
  l.launched("shared_gate_dg_reduce_kernel");
}

}  // namespace moecore::ops::cuda
