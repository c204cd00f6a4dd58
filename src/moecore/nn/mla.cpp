// MLA forward and backward as straight-line sequences of ops (layouts in mla.h). Linear layers: y = x @ W^T.
#include "moecore/nn/mla.h"

#include <algorithm>

#include "moecore/core/buffer_plan.h"
#include "moecore/nn/norm.h"

namespace moecore::nn {
namespace {

Tensor bsw(const Tensor& t, const MlaDims& d) {
  return t.view({d.B, d.S, t.size(1)});
}
// The kernel's [N, nh, 3, D] view of the fused activation; slot 0 query, 1 key, 2 value.
Tensor slot(const Tensor& qkv, const MlaDims& d, int64_t s) {
  return qkv.view({d.N(), d.heads, 3, d.D()}).slice(2, s, s + 1);
}
// A [N, nh * w] tensor as [N, nh, 1, w].
Tensor heads4(const Tensor& t, const MlaDims& d, int64_t w) {
  return t.view({d.N(), d.heads, 1, w});
}
// The first n * w elements of a latent scratch buffer as a contiguous [n, w] tensor.
Tensor first(const Tensor& buf, int64_t n, int64_t w) {
  return buf.view({buf.numel()}).slice(0, 0, n * w).view({n, w});
}
// The latent norm (or a plain cast without --qk-layernorm): y (compute) from x (f32).
void latent_norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                         bool on, float eps, const ops::Context& ctx) {
  if (on)
    norm_forward(y, mean, rstd, x, w, b, eps, ctx);
  else
    y.copy_from(x);
}
// dx_c (compute): the gradient of the latent from dy = dL/dy (compute); dx_f32 is scratch.
void latent_norm_backward(Tensor& dx_c, Tensor& dx_f32, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x,
                          const Tensor& w, const Tensor& b, const Tensor& mean, const Tensor& rstd, bool on,
                          const ops::Context& ctx) {
  if (!on) {
    dx_c.copy_from(dy);
    return;
  }
  norm_backward(dx_f32, dw, db, dy, x, w, b, mean, rstd, false, ctx);
  dx_c.copy_from(dx_f32);
}

}  // namespace

namespace {
// The buffers of one layer's MLA cache and of the shared MLA workspace, each listed once (BufferPlan).
void plan_cache(MlaCache& k, const MlaDims& d, DType c, bool layernorm, BufferPlan& p) {
  const int64_t N = d.N();
  if (d.q_lora) {
    p.empty(k.qa, {N, d.q_lora}, DType::f32);
    p.empty(k.qa_n, {N, d.q_lora}, c);
    p.empty(k.qa_rstd, {N}, DType::f32);
    if (layernorm) p.empty(k.qa_mean, {N}, DType::f32);
  }
  p.empty(k.c, {N, d.kv_lora}, DType::f32);
  p.empty(k.k_pe, {N, d.dr}, c);
  p.empty(k.c_n, {N, d.kv_lora}, c);
  p.empty(k.c_rstd, {N}, DType::f32);
  if (layernorm) p.empty(k.c_mean, {N}, DType::f32);
  p.zeros(k.qkv, {N, d.heads * 3 * d.D()}, c);  // v's padding stays 0
  p.empty(k.attn, {N, d.heads * d.D()}, c);
  p.empty(k.attn_v, {N, d.heads * d.dv}, c);
  p.empty(k.lse, {d.B, d.heads, d.S}, DType::f32);
}

void plan_workspace(MlaWorkspace& w, const MlaDims& d, DType c, BufferPlan& p) {
  const int64_t N = d.N(), lat = std::max(d.q_lora, d.kv_lora);
  p.empty(w.q, {N, d.q_width()}, c);
  p.empty(w.kv, {N, d.kv_width()}, c);
  p.empty(w.kv_down, {N, d.kv_lora + d.dr}, DType::f32);
  p.empty(w.dkv_down, {N, d.kv_lora + d.dr}, c);
  p.empty(w.k_pe, {N, d.dr}, c);
  p.empty(w.dqkv, {N, d.heads * 3 * d.D()}, c);
  p.zeros(w.dattn, {N, d.heads * d.D()}, c);  // padding columns stay 0
  p.empty(w.dattn_v, {N, d.heads * d.dv}, c);
  p.empty(w.dlat_f32, {N, lat}, DType::f32);
  p.empty(w.dlat_n, {N, lat}, c);
  p.empty(w.dlat_c, {N, lat}, c);
  p.empty(w.pe_f32, {N, d.dr}, DType::f32);
  p.empty(w.pe_sum, {N, d.dr}, DType::f32);
  plan_context_parallel_workspace(w.cp, d.qkv(), d.cp, c, p);
}
}  // namespace

MlaCache mla_cache_alloc(const MlaDims& d, DType c, bool layernorm, Device device) {
  return plan_allocate<MlaCache>(
      MemCategory::activations, [&](MlaCache& k, BufferPlan& p) { plan_cache(k, d, c, layernorm, p); }, device);
}

int64_t mla_cache_bytes(const MlaDims& d, DType c, bool layernorm) {
  return plan_bytes<MlaCache>(MemCategory::activations,
                              [&](MlaCache& k, BufferPlan& p) { plan_cache(k, d, c, layernorm, p); });
}

MlaWorkspace mla_workspace_alloc(const MlaDims& d, DType c, Device device) {
  return plan_allocate<MlaWorkspace>(
      MemCategory::workspace, [&](MlaWorkspace& w, BufferPlan& p) { plan_workspace(w, d, c, p); }, device);
}

int64_t mla_workspace_bytes(const MlaDims& d, DType c) {
  return plan_bytes<MlaWorkspace>(MemCategory::workspace,
                                  [&](MlaWorkspace& w, BufferPlan& p) { plan_workspace(w, d, c, p); });
}

void mla_block_forward(const Tensor& x, const DenseLayerWeights& w, const MlaWeights& m, DenseLayerCache& k,
                       MlaCache& mc, DenseLayerWorkspace& ws, MlaWorkspace& mw, const Tensor& rope,
                       const DenseLayerDims& d, const MlaDims& md, const LayerDropout& drop, const ops::Context& ctx) {
  norm_to_gemm_input(k.h1, k.mean1, k.rstd1, x, w.input_norm, w.input_norm_bias, ws, d, ctx);
  if (md.q_lora) {
    linear_fprop(mc.qa, k.h1, m.q_down, 1.0f, 0.0f, d.linear("self_attention.linear_q_down_proj"), ctx);
    latent_norm_forward(mc.qa_n, mc.qa_mean, mc.qa_rstd, mc.qa, m.q_norm, m.q_norm_bias, md.latent_norm, d.eps, ctx);
  }
  // One linear (Megatron's linear_kv_down_proj), its columns the latent and k_pe.
  linear_fprop(mw.kv_down, k.h1, m.kv_down, 1.0f, 0.0f, d.linear("self_attention.linear_kv_down_proj"), ctx);
  mc.c.copy_from(mw.kv_down.slice(1, 0, md.kv_lora));
  mc.k_pe.copy_from(mw.kv_down.slice(1, md.kv_lora, md.kv_lora + md.dr));
  latent_norm_forward(mc.c_n, mc.c_mean, mc.c_rstd, mc.c, m.kv_norm, m.kv_norm_bias, md.latent_norm, d.eps, ctx);
  mla_up_refill(k.h1, m, mc, mw, rope, d, md, ctx);
  Tensor qkv = bsw(mc.qkv, md), attn = bsw(mc.attn, md);
  attention_forward(attn, mc.lse, qkv, md.qkv(), drop.attention, {}, d.cp, mw.cp, ctx);
  mc.attn_v.view({md.N(), md.heads, md.dv}).copy_from(mc.attn.view({md.N(), md.heads, md.D()}).slice(2, 0, md.dv));
  row_parallel_residual_forward(k.x_mid, x, mc.attn_v, w.proj, w.proj_bias, ws, d,
                                d.linear("self_attention.linear_proj"), drop.attn_out, ctx);
}

void mla_up_refill(const Tensor& h1, const MlaWeights& m, MlaCache& mc, MlaWorkspace& mw, const Tensor& rope,
                   const DenseLayerDims& d, const MlaDims& md, const ops::Context& ctx) {
  const int64_t dr = md.dr, dn = md.dn, dv = md.dv, D = md.D();
  const float mult = md.softmax_scale_mult;  // folded into q: the kernel's scale is 1 / sqrt(D)
  if (md.q_lora)
    linear_fprop(mw.q, mc.qa_n, m.q_up, mult, 0.0f, d.linear("self_attention.linear_q_up_proj"), ctx);
  else
    linear_fprop(mw.q, h1, m.q, mult, 0.0f, d.linear("self_attention.linear_q_proj"), ctx);
  linear_fprop(mw.kv, mc.c_n, m.kv_up, 1.0f, 0.0f, d.linear("self_attention.linear_kv_up_proj"), ctx);
  // The kernel's heads: [q_pe | q_nope], [k_pe | k_nope] (k_pe broadcast over the heads), [v | 0].
  Tensor Q = slot(mc.qkv, md, 0), K = slot(mc.qkv, md, 1), V = slot(mc.qkv, md, 2);
  const Tensor q4 = heads4(mw.q, md, dn + dr), kv4 = heads4(mw.kv, md, dn + dv);
  Q.slice(3, 0, dr).copy_from(q4.slice(3, dn, dn + dr));
  Q.slice(3, dr, D).copy_from(q4.slice(3, 0, dn));
  K.slice(3, dr, D).copy_from(kv4.slice(3, 0, dn));
  const Tensor pe = mc.k_pe.view({md.N(), 1, 1, dr});
  for (int64_t h = 0; h < md.heads; ++h) K.slice(1, h, h + 1).slice(3, 0, dr).copy_from(pe);
  V.slice(3, 0, dv).copy_from(kv4.slice(3, dn, dn + dv));
  Tensor qkv = bsw(mc.qkv, md);
  ops::rope_forward(qkv, rope, md.qkv(), ctx);
}

void mla_block_backward(Tensor& dres, DenseLayerGrads& g, MlaGrads& mg, const Tensor& x, const DenseLayerWeights& w,
                        const MlaWeights& m, const DenseLayerCache& k, const MlaCache& mc, DenseLayerWorkspace& ws,
                        MlaWorkspace& mw, const Tensor& rope, const DenseLayerDims& d, const MlaDims& md,
                        const LayerDropout& drop, const ops::Context& ctx) {
  const int64_t kvr = md.kv_lora, dr = md.dr, dn = md.dn, dv = md.dv, D = md.D(), N = md.N();
  const float mult = md.softmax_scale_mult;
  row_parallel_residual_backward(mw.dattn_v, g.proj, g.proj_bias, dres, mc.attn_v, w.proj, ws, d,
                                 d.linear("self_attention.linear_proj"), drop.attn_out, ctx);
  mw.dattn.view({N, md.heads, D}).slice(2, 0, dv).copy_from(mw.dattn_v.view({N, md.heads, dv}));
  Tensor dqkv = bsw(mw.dqkv, md);
  attention_backward(dqkv, nullptr, bsw(mw.dattn, md), bsw(mc.qkv, md), bsw(mc.attn, md), mc.lse, md.qkv(),
                     drop.attention, {}, d.cp, mw.cp, ctx);
  ops::rope_backward(dqkv, rope, md.qkv(), ctx);
  const Tensor dQ = slot(mw.dqkv, md, 0), dK = slot(mw.dqkv, md, 1), dV = slot(mw.dqkv, md, 2);
  Tensor q4 = heads4(mw.q, md, dn + dr), kv4 = heads4(mw.kv, md, dn + dv);
  q4.slice(3, dn, dn + dr).copy_from(dQ.slice(3, 0, dr));
  q4.slice(3, 0, dn).copy_from(dQ.slice(3, dr, D));
  kv4.slice(3, 0, dn).copy_from(dK.slice(3, dr, D));
  kv4.slice(3, dn, dn + dv).copy_from(dV.slice(3, 0, dv));
  mw.pe_sum.zero_();  // dk_pe: k_pe feeds every head
  for (int64_t h = 0; h < md.heads; ++h) {
    mw.pe_f32.view({N, 1, 1, dr}).copy_from(dK.slice(1, h, h + 1).slice(3, 0, dr));
    ops::add(mw.pe_sum, mw.pe_sum, mw.pe_f32, ctx);
  }
  mw.k_pe.copy_from(mw.pe_sum);
  // kv path: dkv -> kv_up, the kv latent (and its norm), kv_down (one linear: [dc | dk_pe]).
  const Linear kv_up = d.linear("self_attention.linear_kv_up_proj");
  linear_wgrad(mg.kv_up, mw.kv, mc.c_n, 1.0f, 1.0f, kv_up, ctx);
  Tensor lat_n = first(mw.dlat_n, N, kvr), lat_f = first(mw.dlat_f32, N, kvr), lat_c = first(mw.dlat_c, N, kvr);
  linear_dgrad(lat_n, mw.kv, m.kv_up, 1.0f, 0.0f, kv_up, ctx);
  latent_norm_backward(lat_c, lat_f, mg.kv_norm, mg.kv_norm_bias, lat_n, mc.c, m.kv_norm, m.kv_norm_bias, mc.c_mean,
                       mc.c_rstd, md.latent_norm, ctx);
  mw.dkv_down.slice(1, 0, kvr).copy_from(lat_c);
  mw.dkv_down.slice(1, kvr, kvr + dr).copy_from(mw.k_pe);
  const Linear kv_down = d.linear("self_attention.linear_kv_down_proj");
  linear_wgrad(mg.kv_down, mw.dkv_down, k.h1, 1.0f, 1.0f, kv_down, ctx);
  linear_dgrad(ws.dh, mw.dkv_down, m.kv_down, 1.0f, 0.0f, kv_down, ctx);
  // q path (dq is the gradient of the scaled q).
  if (md.q_lora) {
    const int64_t qr = md.q_lora;
    Tensor qn = first(mw.dlat_n, N, qr), qf = first(mw.dlat_f32, N, qr), qc = first(mw.dlat_c, N, qr);
    const Linear q_up = d.linear("self_attention.linear_q_up_proj"),
                 q_down = d.linear("self_attention.linear_q_down_proj");
    linear_wgrad(mg.q_up, mw.q, mc.qa_n, mult, 1.0f, q_up, ctx);
    linear_dgrad(qn, mw.q, m.q_up, mult, 0.0f, q_up, ctx);
    latent_norm_backward(qc, qf, mg.q_norm, mg.q_norm_bias, qn, mc.qa, m.q_norm, m.q_norm_bias, mc.qa_mean, mc.qa_rstd,
                         md.latent_norm, ctx);
    linear_wgrad(mg.q_down, qc, k.h1, 1.0f, 1.0f, q_down, ctx);
    linear_dgrad(ws.dh, qc, m.q_down, 1.0f, 1.0f, q_down, ctx);
  } else {
    const Linear q = d.linear("self_attention.linear_q_proj");
    linear_wgrad(mg.q, mw.q, k.h1, mult, 1.0f, q, ctx);
    linear_dgrad(ws.dh, mw.q, m.q, mult, 1.0f, q, ctx);
  }
  // Under TP every gradient from the latents down is this rank's heads' partial sum (norm backward is linear in its
  // upstream gradient): the input gradient is reduced here, the down-projection and latent-norm weight gradients by
  // the caller (Param::tp_grad_sum).
  norm_backward(dres, g.input_norm, g.input_norm_bias, reduce_partial(ws, d), x, w.input_norm, w.input_norm_bias,
                k.mean1, k.rstd1, true, ctx);
}

}  // namespace moecore::nn
