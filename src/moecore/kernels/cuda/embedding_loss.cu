// CUDA twins of kernels/cpu/embedding_loss.cpp: the token embedding (whole and vocabulary-parallel) and the losses
// (the fused softmax cross-entropy, the three vocabulary-parallel steps and the on-device loss totals).
// The host never reads ids or labels, so an id outside [0, V) gives a NaN output row (forward) or is skipped
// (backward), and a label >= V a NaN loss and gradient row, where the CPU raises (ops_cuda.h).
// Deterministic without float atomics: embedding_backward sorts (id, token) pairs with CUB's stable radix sort and
// lets one thread per (id, column) add the id's token rows in token order onto dtable, the CPU's order, so the bits
// match the CPU's; loss_totals adds the losses one by one on one thread (the CPU's running double sum, so chunking
// does not change the bits; ~N dependent double adds, tens of microseconds per 16k-token chunk); row reductions of
// the losses use fixed-order block trees.
#include <cub/device/device_radix_sort.cuh>

#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda {
namespace {

template <class TO>
__global__ void embedding_forward_kernel(TO* out, const int32_t* ids, const float* table, int64_t N, int64_t V,
                                         int64_t H) {
  MOECORE_GRID_STRIDE(i, N * H) {
    const int64_t n = i / H, h = i % H, id = ids[n];
    st(out[i], id >= 0 && id < V ? table[id * H + h] : __int_as_float(0x7fc00000));
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) v[i] = static_cast<int32_t>(i);
}

// The vocabulary-parallel lookup: the shard's row of an id in [vocab_start, vocab_start + Vl), zeros for the other
// valid ids, NaN for ids outside [0, vocab_size).
__global__ void embedding_forward_shard_kernel(float* out, const int32_t* ids, const float* table, int64_t N,
                                               int64_t Vl, int64_t H, int64_t vocab_start, int64_t vocab_size) {
  MOECORE_GRID_STRIDE(i, N * H) {
    const int64_t n = i / H, h = i % H, id = ids[n], row = id - vocab_start;
    const bool valid = id >= 0 && id < vocab_size;
    out[i] = !valid ? __int_as_float(0x7fc00000) : (row >= 0 && row < Vl ? table[row * H + h] : 0.0f);
  }
}

// Shard rows of the ids, -1 (skipped by the backward) for ids of other shards.
__global__ void shard_rows_kernel(int32_t* rows, const int32_t* ids, int64_t N, int64_t Vl, int64_t vocab_start) {
  MOECORE_GRID_STRIDE(n, N) {
    const int64_t row = static_cast<int64_t>(ids[n]) - vocab_start;
    rows[n] = row >= 0 && row < Vl ? static_cast<int32_t>(row) : -1;
  }
}

// One CTA per sorted position i and column block: the first position of each id walks that id's run (its tokens in
// ascending order, the sort being stable) and adds their rows onto dtable[id] one by one.
__global__ void embedding_backward_kernel(float* dtable, const int32_t* sorted_ids, const int32_t* sorted_tokens,
                                          const float* dout, int64_t N, int64_t V, int64_t H) {
  const int64_t i = blockIdx.x, h = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  const int32_t id = sorted_ids[i];
  if (h >= H || (i > 0 && sorted_ids[i - 1] == id) || id < 0 || id >= V) return;
  float acc = dtable[static_cast<int64_t>(id) * H + h];
  for (int64_t j = i; j < N && sorted_ids[j] == id; ++j) acc += dout[static_cast<int64_t>(sorted_tokens[j]) * H + h];
  dtable[static_cast<int64_t>(id) * H + h] = acc;
}

constexpr float kNaN = __builtin_nanf("");

// Row statistics of logits row z [V]: max and sum of exp(z - max), over the block.
struct RowStats {
  float m, s;
};
__device__ RowStats row_stats(const float* z, int64_t V, float* shared) {
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, z[v]);
  m = block_reduce(m, shared, Max{});
  float s = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += expf(z[v] - m);
  s = block_reduce(s, shared, Sum{});
  return {m, s};
}

// One CTA per row: loss = (max - z[label]) + log(sum exp(z - max)); with compute_grad, z becomes
// grad_scale * (softmax(z) - onehot(label)).
__global__ void softmax_cross_entropy_kernel(float* loss, float* logits, int64_t ldz, const int32_t* labels, int64_t V,
                                             float grad_scale, bool compute_grad) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  float* z = logits + n * ldz;
  const int32_t label = labels[n];
  if (label < 0 || label >= V) {  // ignored: 0 and a zero gradient; out of range: NaN (the host cannot raise)
    const float fill = label < 0 ? 0.0f : kNaN;
    if (threadIdx.x == 0) loss[n] = fill;
    if (compute_grad)
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) z[v] = fill;
    return;
  }
  const float z_label = z[label];
  const RowStats rs = row_stats(z, V, shared);
  if (threadIdx.x == 0) loss[n] = (rs.m - z_label) + logf(rs.s);  // m + log(s) first would round at |m|'s scale
  if (!compute_grad) return;
  const float k = grad_scale / rs.s;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float g = expf(z[v] - rs.m) * k;
    z[v] = v == label ? g - grad_scale : g;
  }
}

__global__ void vocab_parallel_ce_stats_kernel(float* stats, const float* logits, int64_t ldz, const int32_t* labels,
                                               int64_t Vl, int64_t vocab_start) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  const float* z = logits + n * ldz;
  const RowStats rs = row_stats(z, Vl, shared);
  if (threadIdx.x != 0) return;
  const int64_t local = static_cast<int64_t>(labels[n]) - vocab_start;
  stats[3 * n] = rs.m;
  stats[3 * n + 1] = rs.s;
  stats[3 * n + 2] = labels[n] >= 0 && local >= 0 && local < Vl ? z[local] : 0.0f;
}

// Rank order: the same bits on every rank.
__global__ void vocab_parallel_ce_merge_kernel(float* lse, const float* g, const int32_t* labels, int64_t P, int64_t N,
                                               int64_t vocab_size) {
  MOECORE_GRID_STRIDE(n, N) {
    float m = g[3 * n];
    for (int64_t r = 1; r < P; ++r) m = fmaxf(m, g[(r * N + n) * 3]);
    float s = 0.0f, target = 0.0f;
    for (int64_t r = 0; r < P; ++r) {
      const float* gr = g + (r * N + n) * 3;
      s += gr[1] * expf(gr[0] - m);
      target += gr[2];
    }
    const bool bad = labels[n] >= vocab_size;
    lse[2 * n] = bad ? kNaN : m + logf(s);
    lse[2 * n + 1] = target;
  }
}

__global__ void vocab_parallel_ce_finish_kernel(float* loss, float* logits, int64_t ldz, const float* lse,
                                                const int32_t* labels, int64_t Vl, int64_t vocab_start,
                                                float grad_scale, bool compute_grad) {
  const int64_t n = blockIdx.x;
  float* z = logits + n * ldz;
  const bool counted = labels[n] >= 0;
  const float lse_n = lse[2 * n];
  if (threadIdx.x == 0) loss[n] = counted ? lse_n - lse[2 * n + 1] : 0.0f;
  if (!compute_grad) return;
  const float k = counted ? grad_scale : 0.0f;
  const int64_t local = static_cast<int64_t>(labels[n]) - vocab_start;
  for (int64_t v = threadIdx.x; v < Vl; v += blockDim.x) {
    const float g = k * expf(z[v] - lse_n);
    z[v] = counted && v == local ? g - grad_scale : g;
  }
}

// totals[0] += loss[0] + loss[1] + ... one by one (one thread, tiles staged through shared memory); totals[1] += the
// count of labels >= 0 (integers: any order).
__global__ void loss_totals_kernel(double* totals, const float* loss, const int32_t* labels, int64_t n) {
  constexpr int kTile = 2048;
  __shared__ float tile[kTile];
  __shared__ long long counts[32];
  double sum = totals[0];
  long long counted = 0;
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t len = n - t0 < kTile ? n - t0 : kTile;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      tile[i] = loss[t0 + i];
      counted += labels[t0 + i] >= 0 ? 1 : 0;
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int64_t i = 0; i < len; ++i) sum += tile[i];
    __syncthreads();
  }
  counted = block_reduce(counted, counts, Sum{});
  if (threadIdx.x == 0) {
    totals[0] = sum;
    totals[1] += static_cast<double>(counted);
  }
}

unsigned row_threads(int64_t V) {
  return V >= 1024 ? 1024u : (V > 32 ? static_cast<unsigned>((V + 31) / 32 * 32) : 32u);
}

unsigned rows_grid(const Launch& l, int64_t N) {
  MOECORE_CHECK(N <= 0x7fffffff, l.op(), " (cuda): ", N, " rows exceed the grid");
  return static_cast<unsigned>(N);
}

}  // namespace

void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, const Context& ctx) {
  const Launch l("embedding_forward", ctx, {{"out", &out}, {"ids", &ids}, {"table", &table}});
  const int64_t N = ids.size(0), V = table.size(0), H = table.size(1);
  if (N * H == 0) return;
  with_float_type(out.dtype(), [&](auto t) {
    using TO = decltype(t);
    embedding_forward_kernel<<<grid_for(N * H), kThreads, 0, l.stream()>>>(
        Launch::ptr<TO>(out), Launch::ptr<const int32_t>(ids), Launch::ptr<const float>(table), N, V, H);
  });
  l.launched("embedding_forward_kernel");
}

namespace {
// dtable[ids[n], :] += dout[n, :] for ids in [0, V), in token order per element: a stable radix sort of (id, token)
// pairs, then one thread per (id, column) walks the id's run. With `shard` the ids are first mapped to the rows of the
// shard starting at vocab_start (other shards' ids skipped).
void scatter_add_rows(const Launch& l, Tensor& dtable, const Tensor& ids, const Tensor& dout, bool shard,
                      int64_t vocab_start) {
  const int64_t N = ids.size(0), V = dtable.size(0), H = dtable.size(1);
  if (N == 0 || H == 0) return;
  MOECORE_CHECK(N <= 0x7fffffff && (H + 127) / 128 <= 65535, l.op(), " (cuda): N = ", N, ", H = ", H,
                " exceed the grid");
  size_t sort_bytes = 0;
  l.check(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const int32_t*>(nullptr),
                                          static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                          static_cast<int32_t*>(nullptr), N, 0, 32, l.stream()),
          "cub::DeviceRadixSort::SortPairs (size query)");
  WorkspaceCarver w;
  w.reserve<int32_t>(N, shard ? 4 : 3);
  w.reserve_bytes(sort_bytes);
  w.allocate(l);
  int32_t* tokens = w.take<int32_t>(N);
  int32_t* sorted_ids = w.take<int32_t>(N);
  int32_t* sorted_tokens = w.take<int32_t>(N);
  int32_t* keys = shard ? w.take<int32_t>(N) : nullptr;
  void* sort_tmp = w.take_bytes(sort_bytes);
  iota_kernel<<<grid_for(N), kThreads, 0, l.stream()>>>(tokens, N);
  l.launched("iota_kernel");
  if (shard) {
    shard_rows_kernel<<<grid_for(N), kThreads, 0, l.stream()>>>(keys, Launch::ptr<const int32_t>(ids), N, V,
                                                                vocab_start);
    l.launched("shard_rows_kernel");
  }
  // All 32 key bits: negative (invalid or other shards') ids must sort somewhere defined too.
  l.check(cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, shard ? keys : Launch::ptr<const int32_t>(ids),
                                          sorted_ids, tokens, sorted_tokens, N, 0, 32, l.stream()),
          "cub::DeviceRadixSort::SortPairs");
  l.enqueued("cub::DeviceRadixSort::SortPairs");
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((H + 127) / 128));
  embedding_backward_kernel<<<grid, 128, 0, l.stream()>>>(Launch::ptr<float>(dtable), sorted_ids, sorted_tokens,
                                                          Launch::ptr<const float>(dout), N, V, H);
  l.launched("embedding_backward_kernel");
}
}  // namespace

void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout, const Context& ctx) {
  const Launch l("embedding_backward", ctx, {{"dtable", &dtable}, {"ids", &ids}, {"dout", &dout}});
  scatter_add_rows(l, dtable, ids, dout, false, 0);
}

void embedding_forward_shard(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start,
                             int64_t vocab_size, const Context& ctx) {
  const Launch l("embedding_forward_shard", ctx, {{"out", &out}, {"ids", &ids}, {"table", &table}});
  const int64_t N = ids.size(0), Vl = table.size(0), H = table.size(1);
  if (N * H == 0) return;
  embedding_forward_shard_kernel<<<grid_for(N * H), kThreads, 0, l.stream()>>>(
      Launch::ptr<float>(out), Launch::ptr<const int32_t>(ids), Launch::ptr<const float>(table), N, Vl, H, vocab_start,
      vocab_size);
  l.launched("embedding_forward_shard_kernel");
}

void embedding_backward_shard(Tensor& dtable, const Tensor& ids, const Tensor& dout, int64_t vocab_start,
                              const Context& ctx) {
  const Launch l("embedding_backward_shard", ctx, {{"dtable", &dtable}, {"ids", &ids}, {"dout", &dout}});
  scatter_add_rows(l, dtable, ids, dout, true, vocab_start);
}

void softmax_cross_entropy(Tensor& loss, Tensor& logits, const Tensor& labels, float grad_scale, bool compute_grad,
                           const Context& ctx) {
  const Launch l("softmax_cross_entropy", ctx, {{"loss", &loss}, {"logits", &logits}, {"labels", &labels}});
  const int64_t N = logits.size(0), V = logits.size(1);
  if (N == 0) return;
  softmax_cross_entropy_kernel<<<rows_grid(l, N), row_threads(V), 0, l.stream()>>>(
      Launch::ptr<float>(loss), Launch::ptr<float>(logits), logits.stride(0), Launch::ptr<const int32_t>(labels), V,
      grad_scale, compute_grad);
  l.launched("softmax_cross_entropy_kernel");
}

void vocab_parallel_ce_stats(Tensor& stats, const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                             const Context& ctx) {
  const Launch l("vocab_parallel_ce_stats", ctx, {{"stats", &stats}, {"logits", &logits}, {"labels", &labels}});
  const int64_t N = logits.size(0), Vl = logits.size(1);
  if (N == 0) return;
  vocab_parallel_ce_stats_kernel<<<rows_grid(l, N), row_threads(Vl), 0, l.stream()>>>(
      Launch::ptr<float>(stats), Launch::ptr<const float>(logits), logits.stride(0), Launch::ptr<const int32_t>(labels),
      Vl, vocab_start);
  l.launched("vocab_parallel_ce_stats_kernel");
}

void vocab_parallel_ce_merge(Tensor& lse, const Tensor& gathered, const Tensor& labels, int64_t vocab_size,
                             const Context& ctx) {
  const Launch l("vocab_parallel_ce_merge", ctx, {{"lse", &lse}, {"gathered", &gathered}, {"labels", &labels}});
  const int64_t P = gathered.size(0), N = gathered.size(1);
  if (N == 0) return;
  vocab_parallel_ce_merge_kernel<<<grid_for(N), kThreads, 0, l.stream()>>>(
      Launch::ptr<float>(lse), Launch::ptr<const float>(gathered), Launch::ptr<const int32_t>(labels), P, N,
      vocab_size);
  l.launched("vocab_parallel_ce_merge_kernel");
}

void vocab_parallel_ce_finish(Tensor& loss, Tensor& logits, const Tensor& lse, const Tensor& labels,
                              int64_t vocab_start, float grad_scale, bool compute_grad, const Context& ctx) {
  const Launch l("vocab_parallel_ce_finish", ctx,
                 {{"loss", &loss}, {"logits", &logits}, {"lse", &lse}, {"labels", &labels}});
  const int64_t N = logits.size(0), Vl = logits.size(1);
  if (N == 0) return;
  vocab_parallel_ce_finish_kernel<<<rows_grid(l, N), row_threads(Vl), 0, l.stream()>>>(
      Launch::ptr<float>(loss), Launch::ptr<float>(logits), logits.stride(0), Launch::ptr<const float>(lse),
      Launch::ptr<const int32_t>(labels), Vl, vocab_start, grad_scale, compute_grad);
  l.launched("vocab_parallel_ce_finish_kernel");
}

void loss_totals(Tensor& totals, const Tensor& loss, const Tensor& labels, const Context& ctx) {
  const Launch l("loss_totals", ctx, {{"totals", &totals}, {"loss", &loss}, {"labels", &labels}});
  loss_totals_kernel<<<1, kThreads, 0, l.stream()>>>(Launch::ptr<double>(totals), Launch::ptr<const float>(loss),
                                                     Launch::ptr<const int32_t>(labels), loss.numel());
  l.launched("loss_totals_kernel");
}

}  // namespace moecore::ops::cuda
