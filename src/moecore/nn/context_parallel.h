// Context parallelism (Megatron's --context-parallel-size): every sequence of the micro-batch is split over the P
// ranks of the CP group in Megatron's load-balanced order. With c = S / (2P) positions per chunk, rank r holds chunks
// r and 2P-1-r of each sequence: its S / P local positions are [r c, (r+1) c) followed by [(2P-1-r) c, (2P-r) c), so
// that causal attention costs every rank the same. Everything but attention works on the rank's own positions;
// attention all-gathers the group's keys and values (the all-gather flavour of Megatron's CP; no ring), runs each
// local chunk's queries against the keys up to the chunk's end (ops::attention_forward with Sk > S, exact softmax, no
// merging needed), and in backward gathers them again and reduce-scatters their gradients (f32) back to the ranks
// that own them.
// Deterministic: every sum runs in an order fixed by the layout.
// Not here: the split of the batch and of the positions' tables (model/gpt.cpp), the gradient reduction over DP x CP
// (train/).
// Dimensions: core/dims.h, except that S here is a whole sequence's positions (core/dims.h's S is this rank's S / P)
// and P the CP size.
#pragma once
#include "moecore/core/buffer_plan.h"
#include "moecore/kernels/ops.h"
#include "moecore/parallel/comm.h"

namespace moecore::nn {

// The global position of local position s (0 <= s < S / P) on CP rank r of P, for sequences of S positions.
int64_t context_parallel_position(int64_t s, int64_t S, int rank, int size);

// out [B*S, cols] = the rows of the group's local tensors ([B*S/P, cols] each) all-gathered in rank order
// (gathered: [P][B][S/P] rows), put in position order ([B][S] rows). Contiguous, one shape; not for the step loop.
void context_parallel_to_positions(const Tensor& out, const Tensor& gathered, int64_t B, int64_t S, int size);

// Scratch of one attention geometry under CP (shared by the layers; nothing here outlives a call). T = B * S / P
// local rows, T' = B * S rows of the whole sequences, c = S / (2P), W = G*(R+2)*D, O = G*R*D, Wkv = 2*G*D (a row's
// keys and values alone: only they travel).
struct ContextParallelWorkspace {
  Tensor kv;     // [T, Wkv] compute: this rank's keys and values, packed (ops::qkv_slots_gather)
  Tensor rows;   // [T', Wkv] compute: the group's, all-gathered in rank order
  Tensor full;   // [T', W] compute: the same in position order ([B, S, W]; only the key and value slots are written)
  Tensor dkv;    // [T', W] compute (backward): one chunk's dK/dV, position order
  Tensor block;  // [c, Wkv] f32 (backward): one block's dK/dV, packed
  Tensor acc;    // [T', Wkv] f32 (backward): the local chunks' dK/dV in rank order, summed, before the reduce-scatter
  Tensor local;  // [T, Wkv] f32 (backward): this rank's reduce-scattered share of acc
  Tensor q;      // [B * c, W] compute: one local chunk's rows
  Tensor dq;     // [T, W] compute (backward): both chunks' query gradients, chunk-major ([2][B][c])
  Tensor out;    // [B * c, O] compute: one chunk's attention output
  Tensor dout;   // [B * c, O] compute (backward): its gradient
};
// local: the rank's attention geometry (S = the local positions, S / P of the sequence).
void plan_context_parallel_workspace(ContextParallelWorkspace& w, const ops::QkvDims& local, int size, DType compute,
                                     BufferPlan& p);

// A layer's causal attention (ops.h) over qkv [B, S_local, W], out [B, S_local, O]; cp null or of one rank: the op
// itself. Under CP the lse tensor [B, G*R, S_local] holds the two chunks' lse ([2][B][G*R][c]), which only the
// backward here reads. dims: the local geometry (S = S_local, Sk = 0). The dropout masks are drawn per chunk (two
// keys derived from drop's), so they differ from one rank's.
// opt: the sinks and window (ops.h); every chunk is one exact softmax over all of its keys, so a sink counts once per
// query and dsinks (+=) sums this rank's queries (the caller sums it over the CP group with the other gradients).
void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const ops::QkvDims& dims, const ops::Dropout& drop,
                       const ops::AttentionOptions& opt, const ProcessGroup* cp, ContextParallelWorkspace& ws,
                       const ops::Context& ctx);
void attention_backward(Tensor& dqkv, Tensor* dsinks, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const ops::QkvDims& dims, const ops::Dropout& drop,
                        const ops::AttentionOptions& opt, const ProcessGroup* cp, ContextParallelWorkspace& ws,
                        const ops::Context& ctx);

}  // namespace moecore::nn
