// CPU token embedding (gather forward, deterministic scatter-add backward) and the fused softmax
// cross-entropy, which overwrites the logits with their gradient so no probability tensor exists.
// Ids and labels are validated before any parallel region (an exception cannot leave one).
// Also each rank's part of the vocabulary-parallel embedding (the same kernels over a range of table rows).
// Not here: the group's reductions (the callers' collectives).
#include <limits>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

void check_ids(const cpu::Checker& c, const char* what, const int32_t* ids, int64_t N, int64_t V, bool allow_negative) {
  for (int64_t n = 0; n < N; ++n) {
    const int32_t id = ids[n];
    if (id >= V || (id < 0 && !allow_negative))
      c.fail(what, " ", id, " at position ", n, " is outside [0, V) with V = ", V,
             allow_negative ? " (negative labels mean ignored)" : "", "; check the tokenizer's vocab size");
  }
}

// Rows [first, first + rows) of the vocabulary live in `table` (the whole table: first 0, rows V); an id outside them
// gives a zero row (forward) or nothing (backward): the vocabulary-parallel embedding's shard.
template <class TO>
void embedding_forward_kernel(TO* out, const int32_t* ids, const float* table, int64_t N, int64_t H, int64_t first,
                              int64_t rows) {
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t row = ids[n] - first;
    TO* dst = out + n * H;
    if (row < 0 || row >= rows) {
      for (int64_t h = 0; h < H; ++h) st(dst[h], 0.0f);
      continue;
    }
    const float* src = table + row * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) st(dst[h], src[h]);
  }
}

// Threads own disjoint column blocks and each walks all tokens in order, so every dtable element
// receives its contributions in token order whatever the split: deterministic with no sorting.
void embedding_backward_kernel(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t H,
                               int64_t first, int64_t rows) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t h0 = b * kBlock, h1 = std::min(H, h0 + kBlock);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t row = ids[n] - first;
      if (row < 0 || row >= rows) continue;
      float* dst = dtable + row * H;
      const float* src = dout + n * H;
#pragma omp simd
      for (int64_t h = h0; h < h1; ++h) dst[h] += src[h];
    }
  }
}

// One row: max, then e = exp(z - max) summed (and kept in place when the gradient is wanted), then
// the gradient grad_scale * (e / sum - onehot). The row stays in cache between the passes.
float softmax_cross_entropy_row(float* z, int64_t V, int32_t label, float grad_scale, bool compute_grad) {
  if (label < 0) {
    if (compute_grad) std::fill(z, z + V, 0.0f);
    return 0.0f;
  }
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) m = z[v] > m ? z[v] : m;  // std::max here does not vectorise (GCC 12)
  const float z_label = z[label];
  float s = 0.0f;
  if (compute_grad) {
#pragma omp simd reduction(+ : s)
    for (int64_t v = 0; v < V; ++v) {
      const float e = cpu::exp_f32(z[v] - m);
      z[v] = e;
      s += e;
    }
    const float k = grad_scale / s;
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) z[v] *= k;
    z[label] -= grad_scale;
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t v = 0; v < V; ++v) s += cpu::exp_f32(z[v] - m);
  }
  return (m - z_label) + std::log(s);  // m + log(s) first would round at |m|'s scale (6e-5 at 1000)
}

}  // namespace

void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, const Context& ctx) {
  const cpu::Checker c("embedding_forward", ctx, {{"out", &out}, {"ids", &ids}, {"table", &table}},
                       cpu::Backends::cpu_and_cuda);
  c.rank("ids", 1);
  c.dtype("ids", DType::i32);
  c.rank("table", 2);
  c.dtype("table", DType::f32);
  c.float_dtype("out");
  const int64_t N = ids.size(0), V = table.size(0), H = table.size(1);
  c.shape("out", Shape{N, H});
  for (const char* name : {"out", "ids", "table"}) c.contiguous(name);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::embedding_forward(out, ids, table, ctx);
  check_ids(c, "id", ids.data<int32_t>(), N, V, false);
  cpu::with_float_type(out.dtype(), [&](auto t) {
    embedding_forward_kernel(static_cast<decltype(t)*>(out.raw()), ids.data<int32_t>(), table.data<float>(), N, H, 0,
                             V);
  });
}

namespace {
// The checks both embedding backwards share: ids [N] i32; dtable [rows, H] f32 (the whole table or a shard of its
// rows); dout [N, H] f32; all contiguous.
void check_embedding_grad(const cpu::Checker& c, const Tensor& dtable, const Tensor& ids) {
  c.rank("ids", 1);
  c.dtype("ids", DType::i32);
  c.rank("dtable", 2);
  c.dtype("dtable", DType::f32);
  c.dtype("dout", DType::f32);
  c.shape("dout", Shape{ids.size(0), dtable.size(1)});
  for (const char* name : {"dtable", "ids", "dout"}) c.contiguous(name);
}
}  // namespace

void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout, const Context& ctx) {
  const cpu::Checker c("embedding_backward", ctx, {{"dtable", &dtable}, {"ids", &ids}, {"dout", &dout}},
                       cpu::Backends::cpu_and_cuda);
  check_embedding_grad(c, dtable, ids);
  const int64_t N = ids.size(0), V = dtable.size(0), H = dtable.size(1);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::embedding_backward(dtable, ids, dout, ctx);
  check_ids(c, "id", ids.data<int32_t>(), N, V, false);
  embedding_backward_kernel(dtable.data<float>(), ids.data<int32_t>(), dout.data<float>(), N, H, 0, V);
}

// The vocabulary-parallel embedding: this rank's rows of the table, zeros (forward) or nothing (backward) for the
// other ids. Not here: the group's reduction (the caller's collective).
void embedding_forward_shard(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start,
                             int64_t vocab_size, const Context& ctx) {
  const cpu::Checker c("embedding_forward_shard", ctx, {{"out", &out}, {"ids", &ids}, {"table", &table}},
                       cpu::Backends::cpu_and_cuda);
  c.rank("ids", 1);
  c.dtype("ids", DType::i32);
  c.rank("table", 2);
  c.dtype("table", DType::f32);
  c.dtype("out", DType::f32);
  const int64_t N = ids.size(0), Vl = table.size(0), H = table.size(1);
  c.shape("out", Shape{N, H});
  for (const char* name : {"out", "ids", "table"}) c.contiguous(name);
  if (vocab_start < 0 || vocab_start + Vl > vocab_size)
    c.fail("the table's rows [", vocab_start, ", ", vocab_start + Vl, ") are not inside the vocabulary [0, ",
           vocab_size, ")");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::embedding_forward_shard(out, ids, table, vocab_start, vocab_size, ctx);
  check_ids(c, "id", ids.data<int32_t>(), N, vocab_size, false);
  embedding_forward_kernel(out.data<float>(), ids.data<int32_t>(), table.data<float>(), N, H, vocab_start, Vl);
}

void embedding_backward_shard(Tensor& dtable, const Tensor& ids, const Tensor& dout, int64_t vocab_start,
                              const Context& ctx) {
  const cpu::Checker c("embedding_backward_shard", ctx, {{"dtable", &dtable}, {"ids", &ids}, {"dout", &dout}},
                       cpu::Backends::cpu_and_cuda);
  check_embedding_grad(c, dtable, ids);
  const int64_t N = ids.size(0), Vl = dtable.size(0), H = dtable.size(1);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::embedding_backward_shard(dtable, ids, dout, vocab_start, ctx);
  embedding_backward_kernel(dtable.data<float>(), ids.data<int32_t>(), dout.data<float>(), N, H, vocab_start, Vl);
}

void softmax_cross_entropy(Tensor& loss, Tensor& logits, const Tensor& labels, float grad_scale, bool compute_grad,
                           const Context& ctx) {
  const cpu::Checker c("softmax_cross_entropy", ctx, {{"loss", &loss}, {"logits", &logits}, {"labels", &labels}},
                       cpu::Backends::cpu_and_cuda);
  c.rank("logits", 2);
  c.dtype("logits", DType::f32);
  c.dtype("labels", DType::i32);
  c.dtype("loss", DType::f32);
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  if (N > 0 && V > 0 && (logits.stride(1) != 1 || ld < V))
    c.fail("logits needs unit column stride and a row stride >= V, got strides [", ld, ", ", logits.stride(1), "]");
  if (V == 0 && N > 0) c.fail("logits has an empty vocab dim");
  c.shape("labels", Shape{N});
  c.shape("loss", Shape{N});
  c.contiguous("labels");
  c.contiguous("loss");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::softmax_cross_entropy(loss, logits, labels, grad_scale, compute_grad, ctx);
  const int32_t* lab = labels.data<int32_t>();
  check_ids(c, "label", lab, N, V, true);
  float* z = logits.data<float>();
  float* out = loss.data<float>();
#pragma omp parallel for schedule(static) if (N * V > cpu::kParallelWork / 4)
  for (int64_t n = 0; n < N; ++n) out[n] = softmax_cross_entropy_row(z + n * ld, V, lab[n], grad_scale, compute_grad);
}

void loss_totals(Tensor& totals, const Tensor& loss, const Tensor& labels, const Context& ctx) {
  const cpu::Checker c("loss_totals", ctx, {{"totals", &totals}, {"loss", &loss}, {"labels", &labels}},
                       cpu::Backends::cpu_and_cuda);
  c.dtype("totals", DType::f64);
  c.shape("totals", Shape{2});
  c.contiguous("totals");
  c.dtype("loss", DType::f32);
  c.rank("loss", 1);
  c.contiguous("loss");
  c.dtype("labels", DType::i32);
  c.shape("labels", loss.shape());
  c.contiguous("labels");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::loss_totals(totals, loss, labels, ctx);
  const float* lp = loss.data<float>();
  const int32_t* yp = labels.data<int32_t>();
  double* t = totals.data<double>();
  double sum = t[0];  // one running sum over all chunks: the bits do not depend on the chunking
  int64_t counted = 0;
  for (int64_t i = 0; i < loss.numel(); ++i) {
    sum += lp[i];
    counted += yp[i] >= 0 ? 1 : 0;
  }
  t[0] = sum;
  t[1] += static_cast<double>(counted);
}

namespace {
// The checks the three vocabulary-parallel steps share: logits [N, Vl] f32 with a unit column stride, labels [N] i32.
void check_vp_logits(const cpu::Checker& c, const Tensor& logits, const Tensor& labels) {
  c.rank("logits", 2);
  c.dtype("logits", DType::f32);
  if (logits.numel() > 0 && (logits.stride(1) != 1 || logits.stride(0) < logits.size(1)))
    c.fail("logits needs unit column stride and a row stride >= its width");
  if (logits.size(1) == 0 && logits.size(0) > 0) c.fail("logits has an empty vocab dim");
  c.dtype("labels", DType::i32);
  c.shape("labels", Shape{logits.size(0)});
  c.contiguous("labels");
}
}  // namespace

void vocab_parallel_ce_stats(Tensor& stats, const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                             const Context& ctx) {
  const cpu::Checker c("vocab_parallel_ce_stats", ctx, {{"stats", &stats}, {"logits", &logits}, {"labels", &labels}},
                       cpu::Backends::cpu_and_cuda);
  check_vp_logits(c, logits, labels);
  const int64_t N = logits.size(0), Vl = logits.size(1), ld = logits.stride(0);
  c.dtype("stats", DType::f32);
  c.shape("stats", Shape{N, 3});
  c.contiguous("stats");
  if (vocab_start < 0) c.fail("vocab_start = ", vocab_start, " is negative");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::vocab_parallel_ce_stats(stats, logits, labels, vocab_start, ctx);
  const float* z = logits.data<float>();
  const int32_t* lab = labels.data<int32_t>();
  float* st = stats.data<float>();
#pragma omp parallel for schedule(static) if (N * Vl > cpu::kParallelWork / 4)
  for (int64_t n = 0; n < N; ++n) {
    const float* zr = z + n * ld;
    float m = zr[0];
#pragma omp simd reduction(max : m)
    for (int64_t v = 0; v < Vl; ++v) m = zr[v] > m ? zr[v] : m;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t v = 0; v < Vl; ++v) s += cpu::exp_f32(zr[v] - m);
    const int64_t local = static_cast<int64_t>(lab[n]) - vocab_start;
    st[3 * n] = m;
    st[3 * n + 1] = s;
    st[3 * n + 2] = lab[n] >= 0 && local >= 0 && local < Vl ? zr[local] : 0.0f;
  }
}

void vocab_parallel_ce_merge(Tensor& lse, const Tensor& gathered, const Tensor& labels, int64_t vocab_size,
                             const Context& ctx) {
  const cpu::Checker c("vocab_parallel_ce_merge", ctx, {{"lse", &lse}, {"gathered", &gathered}, {"labels", &labels}},
                       cpu::Backends::cpu_and_cuda);
  c.rank("gathered", 3);
  c.dtype("gathered", DType::f32);
  c.contiguous("gathered");
  const int64_t P = gathered.size(0), N = gathered.size(1);
  if (gathered.size(2) != 3) c.fail("gathered must be [P, N, 3] (max, sum of exp, label logit per rank)");
  c.dtype("lse", DType::f32);
  c.shape("lse", Shape{N, 2});
  c.contiguous("lse");
  c.dtype("labels", DType::i32);
  c.shape("labels", Shape{N});
  c.contiguous("labels");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::vocab_parallel_ce_merge(lse, gathered, labels, vocab_size, ctx);
  const int32_t* lab = labels.data<int32_t>();
  check_ids(c, "label", lab, N, vocab_size, true);
  const float* g = gathered.data<float>();
  float* out = lse.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    float m = g[3 * n];
    for (int64_t r = 1; r < P; ++r) m = std::max(m, g[(r * N + n) * 3]);
    float s = 0.0f, target = 0.0f;
    for (int64_t r = 0; r < P; ++r) {  // rank order: the same bits on every rank
      const float* gr = g + (r * N + n) * 3;
      s += gr[1] * cpu::exp_f32(gr[0] - m);
      target += gr[2];
    }
    out[2 * n] = m + std::log(s);
    out[2 * n + 1] = target;
  }
}

void vocab_parallel_ce_finish(Tensor& loss, Tensor& logits, const Tensor& lse, const Tensor& labels,
                              int64_t vocab_start, float grad_scale, bool compute_grad, const Context& ctx) {
  const cpu::Checker c("vocab_parallel_ce_finish", ctx,
                       {{"loss", &loss}, {"logits", &logits}, {"lse", &lse}, {"labels", &labels}},
                       cpu::Backends::cpu_and_cuda);
  check_vp_logits(c, logits, labels);
  const int64_t N = logits.size(0), Vl = logits.size(1), ld = logits.stride(0);
  c.dtype("loss", DType::f32);
  c.shape("loss", Shape{N});
  c.contiguous("loss");
  c.dtype("lse", DType::f32);
  c.shape("lse", Shape{N, 2});
  c.contiguous("lse");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::vocab_parallel_ce_finish(loss, logits, lse, labels, vocab_start, grad_scale, compute_grad, ctx);
  float* z = logits.data<float>();
  const float* l = lse.data<float>();
  const int32_t* lab = labels.data<int32_t>();
  float* out = loss.data<float>();
#pragma omp parallel for schedule(static) if (N * Vl > cpu::kParallelWork / 4)
  for (int64_t n = 0; n < N; ++n) {
    float* zr = z + n * ld;
    const bool counted = lab[n] >= 0;
    out[n] = counted ? l[2 * n] - l[2 * n + 1] : 0.0f;
    if (!compute_grad) continue;
    const float k = counted ? grad_scale : 0.0f, lse_n = l[2 * n];
#pragma omp simd
    for (int64_t v = 0; v < Vl; ++v) zr[v] = k * cpu::exp_f32(zr[v] - lse_n);
    const int64_t local = static_cast<int64_t>(lab[n]) - vocab_start;
    if (counted && local >= 0 && local < Vl) zr[local] -= grad_scale;
  }
}

}  // namespace moecore::ops
