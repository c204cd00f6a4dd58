// The vocabulary-parallel embedding's lookup and gradient (ops.h): the rows of this rank's vocabulary range, zeros
// (forward) or nothing (backward) for the other ids. Not here: the group's reduction (the caller's collective).
// On a cuda context both dispatch to kernels/cuda/embedding_loss.cu after the checks that read no ids.
#include <algorithm>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {

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
  const int32_t* id = ids.data<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    if (id[n] < 0 || id[n] >= vocab_size)
      c.fail("id ", id[n], " at position ", n, " is outside [0, V) with V = ", vocab_size,
             "; check the tokenizer's vocab size");
  const float* tab = table.data<float>();
  float* o = out.data<float>();
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t row = id[n] - vocab_start;
    float* dst = o + n * H;
    if (row < 0 || row >= Vl) {
      std::fill(dst, dst + H, 0.0f);
      continue;
    }
    const float* src = tab + row * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) dst[h] = src[h];
  }
}

void embedding_backward_shard(Tensor& dtable, const Tensor& ids, const Tensor& dout, int64_t vocab_start,
                              const Context& ctx) {
  const cpu::Checker c("embedding_backward_shard", ctx, {{"dtable", &dtable}, {"ids", &ids}, {"dout", &dout}},
                       cpu::Backends::cpu_and_cuda);
  c.rank("ids", 1);
  c.dtype("ids", DType::i32);
  c.rank("dtable", 2);
  c.dtype("dtable", DType::f32);
  c.dtype("dout", DType::f32);
  const int64_t N = ids.size(0), Vl = dtable.size(0), H = dtable.size(1);
  c.shape("dout", Shape{N, H});
  for (const char* name : {"dtable", "ids", "dout"}) c.contiguous(name);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::embedding_backward_shard(dtable, ids, dout, vocab_start, ctx);
  const int32_t* id = ids.data<int32_t>();
  float* dt = dtable.data<float>();
  const float* d = dout.data<float>();
  // Threads own disjoint column blocks and walk the tokens in order: deterministic, as embedding_backward.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (N * H > cpu::kParallelWork)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t h0 = b * kBlock, h1 = std::min(H, h0 + kBlock);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t row = id[n] - vocab_start;
      if (row < 0 || row >= Vl) continue;
      float* dst = dt + row * H;
      const float* src = d + n * H;
#pragma omp simd
      for (int64_t h = h0; h < h1; ++h) dst[h] += src[h];
    }
  }
}

}  // namespace moecore::ops
