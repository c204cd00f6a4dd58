// The output layer fused with softmax cross-entropy, chunked over tokens so that no [N, V] logits or
// probability tensor exists: each chunk's logits are computed, turned into their gradient in place, and
// consumed by the two backward GEMMs before the next chunk reuses the buffer.
// Under tensor parallelism (a group of P ranks) each rank holds the output-layer rows of vocabulary ids
// [r * V / P, (r + 1) * V / P) and the cross-entropy is vocabulary-parallel (Megatron's VocabParallelCrossEntropy):
// per chunk, one all-gather of [n, 3] row statistics; the input gradient's partial sums are all-reduced once.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include "moecore/kernels/ops.h"
#include "moecore/nn/fp8.h"
#include "moecore/parallel/comm.h"

namespace moecore::nn {

struct LmHeadWorkspace {
  int64_t chunk = 0;  // tokens per chunk
  Tensor logits;      // [chunk, V] f32 (V: this rank's vocabulary rows)
  Tensor dlogits_c;   // [chunk, V] compute dtype (bf16 or f16 compute only)
  Tensor loss;        // [chunk] f32
  Tensor totals;      // [2] f64: the last call's loss sum over labels >= 0 and the number of those labels
  // Tensor parallel only (tp > 1):
  Tensor stats;     // [chunk, 3] f32: this rank's row max, sum of exp and label logit
  Tensor gathered;  // [tp * chunk, 3] f32: every rank's, in rank order
  Tensor lse;       // [chunk, 2] f32: the merged log-sum-exp and label logit
};

// Chunk size so that one logits chunk stays near 64 MiB. V: this rank's vocabulary rows (the whole vocabulary
// divided by tp).
LmHeadWorkspace lm_head_workspace_alloc(int64_t N, int64_t V, DType compute, Device device = Device::cpu,
                                        int64_t tp = 1);
int64_t lm_head_workspace_bytes(int64_t N, int64_t V, DType compute, int64_t tp = 1);

// Writes ws.totals (on the device: the loss summed over labels >= 0, and their count; nothing is read back).
// h [N, H] compute, w [V, H] compute, labels [N] i32. When dh is given: dh [N, H] f32 is written with
// d(grad_scale * sum loss)/dh and dw [V, H] f32 += the weight gradient. Without dh the call is forward-only.
// tp (null or size 1: one rank holds the whole vocabulary): w and dw are this rank's [V / P, H] rows, labels are
// global ids, and the loss totals and dh come out equal on every rank of the group (collective over tp); with
// reduce_dh = false dh holds this rank's partial sum instead (the caller reduce-scatters it: sequence parallelism).
// output: the output layer's GEMMs (FP8 with --fp8-output-proj; chunks are multiples of 32 tokens, so MXFP8's blocks
// along the tokens in wgrad are the whole tensor's).
void lm_head_loss(Tensor* dh, Tensor* dw, const Tensor& h, const Tensor& w, const Tensor& labels, float grad_scale,
                  LmHeadWorkspace& ws, const ops::Context& ctx, const ProcessGroup* tp = nullptr, bool reduce_dh = true,
                  const Linear& output = {});

}  // namespace moecore::nn
