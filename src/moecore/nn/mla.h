// Multi-head latent attention (MLA, DeepSeek-V2/V3; Megatron's MLASelfAttention): explicit forward and backward of
// the attention half of a layer, x_mid = x + dropout(proj(attention(q, k, v))) with h = norm1(x) and
//   q  = h Wq^T                        or  q = norm_q(h Wq_down^T) Wq_up^T        (q_lora_rank > 0)   [T, nh(dn+dr)]
//   [c' | k_pe] = h Wkv_down^T, c = norm_kv(c')  (one linear, as Megatron's linear_kv_down_proj)  [T, kvr], [T, dr]
//   kv = c Wkv_up^T                                                                                 [T, nh(dn+dv)]
// per head: q = [q_nope | q_pe], k = [k_nope | k_pe] (k_pe shared by the heads), v; RoPE on q_pe and k_pe;
// softmax scale softmax_scale_mult / sqrt(dn + dr). norm_q / norm_kv are the model's norm over the latent (Megatron:
// present with --qk-layernorm). Weight layouts are Megatron's (and so the parameters load from its checkpoints).
// Implementation: the heads go through the fused causal attention kernel (G = nh, R = 1) with head dim D = dn + dr;
// within the kernel's head the RoPE channels come first ([q_pe | q_nope], which leaves every score unchanged) and v
// is zero-padded from dv to D.
// Gradient contract as dense_layer.h: weight gradients accumulate; dres is updated in place (dL/dx_mid in, dL/dx out).
// Tensor parallelism (DenseLayerDims::tp, MlaDims::heads = this rank's heads): the up-projections (linear_q_proj,
// linear_q_up_proj, linear_kv_up_proj) split by head and linear_proj row-parallel; the down-projections and latent
// norms replicated, computed on the whole micro-batch (Megatron computes them on the sequence-parallel rows: the same
// values, at the cost of the down-projections' FLOPs on every rank); their gradients come out as this rank's heads'
// partial sums, summed over TP by the caller (Param::tp_grad_sum).
// Dimensions: core/dims.h. The projections run on the whole micro-batch, T = B * S rows (MlaDims::N() is that T).
#pragma once
#include "moecore/nn/dense_layer.h"

namespace moecore::nn {

struct MlaDims {
  int64_t B = 0, S = 0, H = 0;
  int64_t heads = 0;                   // nh
  int64_t q_lora = 0;                  // 0: q = h Wq^T
  int64_t kv_lora = 0;                 // kvr
  int64_t dn = 0;                      // --qk-head-dim: q/k channels without RoPE
  int64_t dr = 0;                      // --qk-pos-emb-head-dim: q/k channels with RoPE
  int64_t dv = 0;                      // --v-head-dim
  bool latent_norm = true;             // norm_q / norm_kv (Megatron: --qk-layernorm)
  float softmax_scale_mult = 1.0f;     // YaRN: mscale(scaling factor, mscale_all_dim)^2
  int cp = 1;                          // context-parallel size (S: this rank's S / cp positions; the workspace's share)
  int64_t N() const { return B * S; }  // T of core/dims.h: the GEMM rows, not the sequence-parallel residual rows
  int64_t D() const { return dn + dr; }  // the kernel's head dim
  int64_t q_width() const { return heads * (dn + dr); }
  int64_t kv_width() const { return heads * (dn + dv); }
  ops::QkvDims qkv() const { return {B, S, heads, 1, D()}; }
};

// Views of one layer's MLA weights (GEMM weights in the compute dtype, norm weights f32 masters).
struct MlaWeights {
  Tensor q;                          // [nh(dn+dr), H]  (q_lora == 0)
  Tensor q_down, q_up;               // [q_lora, H], [nh(dn+dr), q_lora]  (q_lora > 0)
  Tensor q_norm;                     // [q_lora] f32 (latent_norm)
  Tensor kv_down;                    // [kvr + dr, H]
  Tensor kv_norm;                    // [kvr] f32 (latent_norm)
  Tensor kv_up;                      // [nh(dn+dv), kvr]
  Tensor q_norm_bias, kv_norm_bias;  // [.] f32, LayerNorm only
};
struct MlaGrads {
  Tensor q, q_down, q_up, q_norm, kv_down, kv_norm, kv_up, q_norm_bias, kv_norm_bias;
};

// Saved by forward for backward (plus the layer's DenseLayerCache: h1, norm statistics, x_mid).
struct MlaCache {
  Tensor qa;                // [T, q_lora] f32: q down-projection (norm input)
  Tensor qa_mean, qa_rstd;  // [T] f32
  Tensor qa_n;              // [T, q_lora] compute: its norm
  Tensor c;                 // [T, kvr] f32: kv down-projection's latent columns (norm input)
  Tensor k_pe;              // [T, dr] compute: its RoPE columns, before RoPE
  Tensor c_mean, c_rstd;    // [T] f32
  Tensor c_n;               // [T, kvr] compute: its norm
  Tensor qkv;               // [T, nh * 3 * D] compute: the kernel's input after RoPE (v padded)
  Tensor attn;              // [T, nh * D] compute: the kernel's output (padded)
  Tensor attn_v;            // [T, nh * dv] compute: the output projection's input
  Tensor lse;               // [B, nh, S] f32
};
// Scratch shared by the MLA layers of a model.
struct MlaWorkspace {
  Tensor q;                     // [T, nh(dn+dr)] compute: q (forward), dq (backward)
  Tensor kv;                    // [T, nh(dn+dv)] compute: kv, dkv
  Tensor kv_down;               // [T, kvr + dr] f32: the kv down-projection's output (forward)
  Tensor dkv_down;              // [T, kvr + dr] compute: its gradient [dc | dk_pe] (backward)
  Tensor k_pe;                  // [T, dr] compute: dk_pe
  Tensor dqkv;                  // [T, nh * 3 * D] compute
  Tensor dattn;                 // [T, nh * D] compute (pad columns stay 0)
  Tensor dattn_v;               // [T, nh * dv] compute
  Tensor dlat_n;                // [T, max(q_lora, kvr)] compute: a latent's gradient (norm output side)
  Tensor dlat_f32;              // [T, max(q_lora, kvr)] f32: the latent norm's input gradient
  Tensor dlat_c;                // [T, max(q_lora, kvr)] compute: the same, for the down-projection GEMMs
  Tensor pe_f32, pe_sum;        // [T, dr] f32: one head's dk_pe, and their sum
  ContextParallelWorkspace cp;  // context parallelism only
};

MlaCache mla_cache_alloc(const MlaDims& d, DType compute, bool layernorm, Device device = Device::cpu);
MlaWorkspace mla_workspace_alloc(const MlaDims& d, DType compute, Device device = Device::cpu);
int64_t mla_cache_bytes(const MlaDims& d, DType compute, bool layernorm);
int64_t mla_workspace_bytes(const MlaDims& d, DType compute);

// The up projections (Megatron's mla_up_proj): mc.qkv, the attention kernel's input after RoPE, from h1 (the input
// norm's output) and the kept latents -- forward computes it with this function, and selective recompute of
// mla_up_proj again before the backward (so mc.qkv may be shared by the layers). Uses mw.q and mw.kv; k_pe comes from
// the cache (the down-projection's). d: the layer's (its linears' FP8 recipe and name).
void mla_up_refill(const Tensor& h1, const MlaWeights& m, MlaCache& mc, MlaWorkspace& mw, const Tensor& rope,
                   const DenseLayerDims& d, const MlaDims& md, const ops::Context& ctx);
// x [N, H] f32 -> k.x_mid (dense cache: h1 and its norm statistics, x_mid). w: the layer's input norm, proj
// (+bias); m: the MLA weights. rope [S, dr] f32 (the rotary table, YaRN-scaled when configured).
void mla_block_forward(const Tensor& x, const DenseLayerWeights& w, const MlaWeights& m, DenseLayerCache& k,
                       MlaCache& mc, DenseLayerWorkspace& ws, MlaWorkspace& mw, const Tensor& rope,
                       const DenseLayerDims& d, const MlaDims& md, const LayerDropout& drop, const ops::Context& ctx);
void mla_block_backward(Tensor& dres, DenseLayerGrads& g, MlaGrads& mg, const Tensor& x, const DenseLayerWeights& w,
                        const MlaWeights& m, const DenseLayerCache& k, const MlaCache& mc, DenseLayerWorkspace& ws,
                        MlaWorkspace& mw, const Tensor& rope, const DenseLayerDims& d, const MlaDims& md,
                        const LayerDropout& drop, const ops::Context& ctx);

}  // namespace moecore::nn
