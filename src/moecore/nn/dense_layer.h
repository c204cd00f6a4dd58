// One pre-norm transformer layer with a dense MLP: explicit forward and backward (no autograd).
//   x_mid = x + dropout(proj(attention(rope(qkv(norm1(x))))));  y = x_mid + dropout(fc2(act(fc1(norm2(x_mid)))))
// as Megatron's bias-dropout-add. Norms are RMSNorm or LayerNorm (with bias); act is SwiGLU (fc1 = [gate; up])
// or GeLU. Linear layers carry a bias when its tensor is defined; QK-norm (Megatron's --qk-layernorm) normalises
// each query and key head before RoPE; RoPE (full or partial, by the rope table's width) is skipped when the
// model has no rotary positions; attention may drop probabilities.
// Not here: parameter ownership and initialisation (model/), the MoE variant of the MLP (moe/).
//
// Gradient contract: weight gradients accumulate (+=); the residual-stream gradient is updated in place
// (dy in, dx out) because the residual fans out.
// dtypes: the residual stream (x, y, dres) and norm statistics are f32; every GEMM operand (norm outputs,
// qkv, attention output, MLP activations, weights) is in the compute dtype, f32, bf16 or f16.
//
// Tensor parallelism (Megatron's ColumnParallelLinear / RowParallelLinear, dims.tp of size P > 1): the layer holds the
// shards of core/shard.h — QKV's query groups and SwiGLU's fc1 rows (gate and up together) split over the group, proj
// and fc2 split along their input — so attention runs on G / P query groups and the MLP on F / P columns; each
// row-parallel output's partial sums are all-reduced. With sequence parallelism the residual stream, the norms and
// the bias-dropout-adds hold this rank's slice of the sequence ([B, S / P, H], rows b * S / P + s); the norm outputs
// are all-gathered into the GEMMs' [B, S, H] inputs and the row-parallel outputs reduce-scattered back (in backward,
// the reverse). The layer's own collectives are over dims.tp; gradients of replicated weights that see a part of the
// data (Param::tp_grad_sum) are the caller's to sum.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include "moecore/kernels/ops.h"
#include "moecore/nn/context_parallel.h"
#include "moecore/nn/fp8.h"
#include "moecore/parallel/comm.h"

namespace moecore::nn {

struct DenseLayerDims {
  int64_t N = 0;           // rows of the residual stream on this rank: B*S, or B*S/P under sequence parallelism
  int64_t H = 0;           // hidden size
  int64_t F = 0;           // MLP hidden size (this rank's F / P columns under TP)
  ops::QkvDims qkv;        // attention geometry (B, S, G, R, D); G: this rank's query groups under TP
  float eps = 1e-5f;       // norm epsilon
  bool layernorm = false;  // LayerNorm (weight and bias) or RMSNorm (weight only)
  ops::MlpActivation act;  // a gated linear unit (fc1 [2F, H]: SwiGLU, quick-GEGLU) or GeLU (fc1 [F, H])
  bool dropout = false;    // hidden dropout may be on (allocates the masked-gradient buffer dres_c)
  bool qk_norm = false;    // QK-norm: the layer's norm over each q and k head (weights [D])
  bool qk_norm_over_heads = false;  // ... over each token's whole q and k projection instead (weights [G*R*D],
                                    // [G*D] of the whole model: under TP the heads are gathered, normed, split back)
  bool rope = true;                 // rotate q and k (the table [S, Dr] gives the rotary width); false: no RoPE
  bool softmax_off_by_one = false;  // --softmax-type off-by-one: a sink logit 0 per head (learnable: the weights')
  int64_t attention_window = -1;    // this layer's sliding window (ops::AttentionOptions::window), -1: none
  DType compute = DType::f32;
  Device device = Device::cpu;       // where the caches and workspaces live
  const ProcessGroup* tp = nullptr;  // the tensor-parallel group (null or one rank: none)
  bool sequence_parallel = false;    // --sequence-parallel (needs tp)
  const ProcessGroup* cp = nullptr;  // the context-parallel group (nn/context_parallel.h; null or one rank: none):
                                     // qkv.S is then this rank's S / CP positions of each sequence
  Fp8Training* fp8 = nullptr;        // this layer's linears run FP8 under this recipe (nn/fp8.h); null: not
  std::string_view layer{};          // the layer's parameter prefix ("decoder.layers.3."): names its linears
  Linear linear(const char* name) const { return {fp8, layer, name}; }
  int64_t fc1_rows() const { return act.fc1_width(F); }
  int64_t tokens() const { return qkv.B * qkv.S; }  // rows of the GEMMs' activations (the whole micro-batch)
  int tp_size() const { return tp ? tp->size() : 1; }
  int cp_size() const { return cp ? cp->size() : 1; }
};

// Views of one layer's weights. Norm weights are the f32 masters; GEMM weights are in the compute dtype.
struct DenseLayerWeights {
  Tensor input_norm;           // [H] f32
  Tensor input_norm_bias;      // [H] f32, LayerNorm only
  Tensor qkv;                  // [G*(R+2)*D, H]
  Tensor proj;                 // [H, G*R*D]
  Tensor mlp_norm;             // [H] f32
  Tensor mlp_norm_bias;        // [H] f32, LayerNorm only
  Tensor fc1;                  // [fc1_rows, H]
  Tensor fc2;                  // [H, F]
  Tensor qkv_bias;             // [G*(R+2)*D] f32, or undefined (no bias); likewise the three below
  Tensor proj_bias;            // [H] f32
  Tensor fc1_bias;             // [fc1_rows] f32
  Tensor fc2_bias;             // [H] f32
  Tensor q_norm, q_norm_bias;  // [D] f32: QK-norm of the query heads (bias: LayerNorm only), or undefined;
                               // over heads: [G*R*D] of all TP ranks
  Tensor k_norm, k_norm_bias;  // [D] f32: QK-norm of the key heads (over heads: [G*D] of all TP ranks)
  Tensor softmax_offset;  // [G*R] f32: the learnable softmax's sink logit per query head (this rank's), or undefined
};

// f32 gradients, same shapes as the weights; accumulated.
struct DenseLayerGrads {
  Tensor input_norm, input_norm_bias, qkv, proj, mlp_norm, mlp_norm_bias, fc1, fc2;
  Tensor qkv_bias, proj_bias, fc1_bias, fc2_bias;
  Tensor q_norm, q_norm_bias, k_norm, k_norm_bias;
  Tensor softmax_offset;
};

// The dropout masks of one layer's forward (p = 0: off, as in evaluation). Backward must get the same keys.
struct LayerDropout {
  ops::Dropout attention;  // attention probabilities (--attention-dropout)
  ops::Dropout attn_out;   // the attention block's bias-dropout-add (--hidden-dropout)
  ops::Dropout mlp_out;    // the MLP (or MoE) block's bias-dropout-add (--hidden-dropout)
};

// Activations saved by forward for backward. Dropping and refilling this struct is recompute.
struct DenseLayerCache {
  Tensor mean1;  // [N] f32, LayerNorm only
  Tensor rstd1;  // [N] f32
  // T = dims.tokens(): the rows of the GEMM side (N = T without sequence parallelism).
  Tensor h1;              // [T, H] compute: norm1 output (all-gathered under sequence parallelism)
  Tensor qkv;             // [T, G*(R+2)*D] compute: after QK-norm and RoPE
  Tensor q_in, k_in;      // [T*G*R, D], [T*G, D] f32: query / key heads before QK-norm (QK-norm only)
  Tensor q_mean, q_rstd;  // [T*G*R] f32 (mean: LayerNorm only); over heads: [T]
  Tensor k_mean, k_rstd;  // [T*G] f32
  Tensor attn;            // [T, G*R*D] compute: attention output
  Tensor lse;             // [B, G*R, S] f32
  Tensor x_mid;           // [N, H] f32: residual after the attention block
  Tensor mean2;           // [N] f32, LayerNorm only
  Tensor rstd2;           // [N] f32
  Tensor h2;              // [T, H] compute: norm2 output (all-gathered under sequence parallelism); [N, H] in an
                          // MoE layer's cache
  Tensor fc1;             // [T, fc1_rows] compute
  Tensor act;             // [T, F] compute
};

// Scratch shared by all layers (forward uses dh for the bias-dropout-add input).
struct DenseLayerWorkspace {
  Tensor dh;      // [T, H] f32: gradient of a norm output; in forward, a linear output before dropout (under TP:
                  // the partial sums before their reduction)
  Tensor dres_c;  // [N, H] compute: the residual gradient (cast, or through dropout) for the GEMMs
  Tensor dqkv;    // [T, G*(R+2)*D] compute
  Tensor dattn;   // [T, G*R*D] compute
  Tensor dfc1;    // [T, fc1_rows] compute
  Tensor dact;    // [T, F] compute
  Tensor qk_y;    // [T*G*R, D] compute: QK-norm output (forward), its gradient (backward); QK-norm only
  Tensor qk_dx;   // [T*G*R, D] f32: QK-norm input gradient
  // QK-norm over heads under TP: the whole projection of all ranks' heads, [T, P*G*R*D]: its input (f32), output or
  // output gradient (compute), input gradient (f32).
  Tensor qk_full_x, qk_full_y, qk_full_dx;
  // Sequence parallelism only:
  Tensor h_local;    // [N, H] compute: a norm's output on this rank's rows, before the all-gather
  Tensor dh_local;   // [N, H] f32: a reduce-scattered row-parallel output (forward) or input gradient (backward)
  Tensor dres_full;  // [T, H] compute: the all-gathered residual gradient for the row-parallel GEMMs
  ContextParallelWorkspace cp;  // context parallelism only (standard attention)
};

// with_mlp=false allocates no fc1/act (layers whose MLP is an MoE layer); with_attention=false no qkv, attention
// output or QK-norm tensors (layers whose attention is MLA, nn/mla.h).
DenseLayerCache dense_layer_cache_alloc(const DenseLayerDims& d, bool with_mlp = true, bool with_attention = true);
DenseLayerWorkspace dense_layer_workspace_alloc(const DenseLayerDims& d, bool with_attention = true);
int64_t dense_layer_cache_bytes(const DenseLayerDims& d, bool with_mlp = true, bool with_attention = true);
int64_t dense_layer_workspace_bytes(const DenseLayerDims& d, bool with_attention = true);

// The two halves, for layers that replace the MLP (MoE): the attention block writes cache.x_mid; the MLP
// norm writes cache.h2 (and its statistics) for this rank's N rows (under sequence parallelism the MoE layer takes
// them as they are, no gather). The backward halves update dres in place.
void attention_block_forward(const Tensor& x, const DenseLayerWeights& w, DenseLayerCache& cache,
                             DenseLayerWorkspace& ws, const Tensor& rope, const DenseLayerDims& d,
                             const LayerDropout& drop, const ops::Context& ctx);
void mlp_norm_forward(const DenseLayerWeights& w, DenseLayerCache& cache, const DenseLayerDims& d,
                      const ops::Context& ctx);
// Selective recompute of the norms (--recompute-modules layernorm): cache.h1 (the input norm's output, all-gathered
// under sequence parallelism) and cache.h2 (the pre-MLP norm's: gathered for a dense MLP, this rank's rows for MoE)
// computed again from x and cache.x_mid -- the same bits as forward's -- before the backward half that reads them, so
// those buffers may be shared by every layer. Collective over TP under sequence parallelism.
void attention_norm_refill(const Tensor& x, const DenseLayerWeights& w, DenseLayerCache& cache, DenseLayerWorkspace& ws,
                           const DenseLayerDims& d, const ops::Context& ctx);
void mlp_norm_refill(const DenseLayerWeights& w, DenseLayerCache& cache, DenseLayerWorkspace& ws,
                     const DenseLayerDims& d, bool dense_mlp, const ops::Context& ctx);
// Selective recompute of core_attn and mlp, likewise: cache.attn and cache.lse from the kept cache.qkv (the attention
// kernel again with the same dropout mask; under CP collective over its group), and a dense MLP's cache.fc1 and
// cache.act from cache.h2 (forward computes them with this function too).
void core_attention_refill(const DenseLayerWeights& w, DenseLayerCache& cache, DenseLayerWorkspace& ws,
                           const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx);
void mlp_refill(const DenseLayerWeights& w, DenseLayerCache& cache, const DenseLayerDims& d, const ops::Context& ctx);
// dres: dL/dx_mid on entry, dL/dx on return.
void attention_block_backward(Tensor& dres, DenseLayerGrads& g, const Tensor& x, const DenseLayerWeights& w,
                              const DenseLayerCache& cache, DenseLayerWorkspace& ws, const Tensor& rope,
                              const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx);
// dres += the MLP norm's input gradient, given dh2 [N, H] f32 = dL/d(norm output).
void mlp_norm_backward(Tensor& dres, DenseLayerGrads& g, const Tensor& dh2, const DenseLayerWeights& w,
                       const DenseLayerCache& cache, const DenseLayerDims& d, const ops::Context& ctx);

// The dense MLP half: y = x_mid + dropout(fc2(act(fc1(norm2(x_mid))))), x_mid from the cache (written by the
// attention half). Backward: dres is dL/dy on entry, dL/dx_mid on return.
void mlp_block_forward(Tensor& y, const DenseLayerWeights& w, DenseLayerCache& cache, DenseLayerWorkspace& ws,
                       const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx);
void mlp_block_backward(Tensor& dres, DenseLayerGrads& g, const DenseLayerWeights& w, const DenseLayerCache& cache,
                        DenseLayerWorkspace& ws, const DenseLayerDims& d, const LayerDropout& drop,
                        const ops::Context& ctx);

// y [N, H] f32 from x [N, H] f32. rope [S, Dr] f32 is the rotary table (unused without RoPE).
void dense_layer_forward(Tensor& y, const Tensor& x, const DenseLayerWeights& w, DenseLayerCache& cache,
                         DenseLayerWorkspace& ws, const Tensor& rope, const DenseLayerDims& d, const LayerDropout& drop,
                         const ops::Context& ctx);
// dres [N, H] f32: dL/dy on entry, dL/dx on return.
void dense_layer_backward(Tensor& dres, DenseLayerGrads& g, const Tensor& x, const DenseLayerWeights& w,
                          const DenseLayerCache& cache, DenseLayerWorkspace& ws, const Tensor& rope,
                          const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx);

// Tensor-parallel building blocks (shared with nn/mla and model/). Without TP each is the one-rank computation.
// [rows, W] as [B, rows / B, W]: a sequence-parallel slice ([B, S/P, W]) or the whole micro-batch ([B, S, W]), the
// views the sequence-dim collectives (all_gather_into / reduce_scatter_from along dim 1) take.
Tensor by_sequence(const Tensor& t, int64_t B);
// A norm whose output feeds column-parallel GEMMs: y [T, H] compute from x [N, H] f32 (under sequence parallelism
// normalised on this rank's rows into ws.h_local, then all-gathered).
void norm_to_gemm_input(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                        DenseLayerWorkspace& ws, const DenseLayerDims& d, const ops::Context& ctx);
// The partial sums of a row-parallel GEMM (or of column-parallel layers' input gradient) in ws.dh [T, H] f32, reduced
// over the group: all-reduced in place, or reduce-scattered into ws.dh_local under sequence parallelism. Returns this
// rank's [N, H] rows of the sum (ws.dh itself without TP).
Tensor reduce_partial(DenseLayerWorkspace& ws, const DenseLayerDims& d);
// A row-parallel linear with its bias-dropout-add: y = x + dropout(reduce(a @ W^T) + b) (linear_residual_forward
// without TP). Backward: dweight += g^T a and da = g @ W with g = dropout'(dy) in the compute dtype (all-gathered
// under sequence parallelism); dbias += the column sums of this rank's rows of g (the caller sums it over the group).
void row_parallel_residual_forward(Tensor& y, const Tensor& x, const Tensor& a, const Tensor& weight,
                                   const Tensor& bias, DenseLayerWorkspace& ws, const DenseLayerDims& d,
                                   const Linear& l, const ops::Dropout& drop, const ops::Context& ctx);
void row_parallel_residual_backward(Tensor& da, Tensor& dweight, Tensor& dbias, const Tensor& dy, const Tensor& a,
                                    const Tensor& weight, DenseLayerWorkspace& ws, const DenseLayerDims& d,
                                    const Linear& l, const ops::Dropout& drop, const ops::Context& ctx);

// The residual update of a block, Megatron's bias-dropout-add: y = x + dropout(a @ W^T + b). out_f32 [N, H]
// is scratch (used only with dropout). Backward: dW += da_in^T a, da = da_in @ W, db += sums of da_in, with
// da_in = dropout'(dy) in the compute dtype (written into dy_c, or dy itself when no cast is needed).
void linear_residual_forward(Tensor& y, const Tensor& x, const Tensor& a, const Tensor& weight, const Tensor& bias,
                             Tensor& out_f32, const Linear& l, const ops::Dropout& drop, const ops::Context& ctx);
void linear_residual_backward(Tensor& da, Tensor& dweight, Tensor& dbias, const Tensor& dy, Tensor& dy_c,
                              const Tensor& a, const Tensor& weight, const Linear& l, const ops::Dropout& drop,
                              const ops::Context& ctx);

}  // namespace moecore::nn
