// The output layer fused with softmax cross-entropy, chunked over tokens so that no [N, V] logits or
// probability tensor exists: each chunk's logits are computed, turned into their gradient in place, and
// consumed by the two backward GEMMs before the next chunk reuses the buffer.
#pragma once
#include "moecore/kernels/ops.h"

namespace moecore::nn {

struct LmHeadWorkspace {
  int64_t chunk = 0;  // tokens per chunk
  Tensor logits;      // [chunk, V] f32
  Tensor dlogits_c;   // [chunk, V] compute dtype (bf16 compute only)
  Tensor loss;        // [chunk] f32
  Tensor totals;      // [2] f64: the last call's loss sum over labels >= 0 and the number of those labels
};

// Chunk size so that one logits chunk stays near 64 MiB.
LmHeadWorkspace lm_head_workspace_alloc(int64_t N, int64_t V, DType compute, Device device = Device::cpu);
int64_t lm_head_workspace_bytes(int64_t N, int64_t V, DType compute);

// Writes ws.totals (on the device: the loss summed over labels >= 0, and their count; nothing is read back).
// h [N, H] compute, w [V, H] compute, labels [N] i32. When dh is given: dh [N, H] f32 is written with
// d(grad_scale * sum loss)/dh and dw [V, H] f32 += the weight gradient. Without dh the call is forward-only.
void lm_head_loss(Tensor* dh, Tensor* dw, const Tensor& h, const Tensor& w, const Tensor& labels, float grad_scale,
                  LmHeadWorkspace& ws, const ops::Context& ctx);

}  // namespace moecore::nn
