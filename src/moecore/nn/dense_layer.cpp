// Dense transformer layer: forward and backward as straight-line sequences of ops.
// Linear layers follow the y = x @ W^T convention (W is [out, in], as in Megatron and PyTorch):
//   forward  y = x @ W^T;  backward  dx = dy @ W,  dW += dy^T @ x.
#include "moecore/nn/dense_layer.h"

#include "moecore/core/buffer_plan.h"
#include "moecore/nn/norm.h"

namespace moecore::nn {
namespace {

// [N, W] activations as the [B, S, W] tensors the attention ops take.
Tensor bsw(const Tensor& t, const DenseLayerDims& d) {
  return t.view({d.qkv.B, d.qkv.S, t.size(1)});
}

// The layer's sinks and window (the learnable sink logits are the weights', this rank's heads).
ops::AttentionOptions attention_options(const DenseLayerWeights& w, const DenseLayerDims& d) {
  return {d.attention_window, d.softmax_off_by_one, w.softmax_offset.defined() ? &w.softmax_offset : nullptr};
}

}  // namespace

namespace {
// The buffers of one layer's cache and of the shared workspace, each listed once (BufferPlan).
void plan_cache(DenseLayerCache& k, const DenseLayerDims& d, bool with_mlp, bool with_attention, BufferPlan& p) {
  const DType c = d.compute;
  const auto& q = d.qkv;
  const int64_t T = d.tokens();
  if (d.layernorm) p.empty(k.mean1, {d.N}, DType::f32);
  if (d.layernorm) p.empty(k.mean2, {d.N}, DType::f32);
  p.empty(k.rstd1, {d.N}, DType::f32);
  p.empty(k.h1, {T, d.H}, c);
  p.empty(k.x_mid, {d.N, d.H}, DType::f32);
  p.empty(k.rstd2, {d.N}, DType::f32);
  p.empty(k.h2, {with_mlp ? T : d.N, d.H}, c);  // an MoE layer takes this rank's rows as they are
  if (with_mlp) {
    p.empty(k.fc1, {T, d.fc1_rows()}, c);
    p.empty(k.act, {T, d.F}, c);
  }
  if (!with_attention) return;
  p.empty(k.qkv, {T, q.width()}, c);
  if (d.qk_norm) {
    const int64_t q_rows = d.qk_norm_over_heads ? T : T * q.q_heads(), k_rows = d.qk_norm_over_heads ? T : T * q.G;
    p.empty(k.q_in, {T * q.q_heads(), q.D}, DType::f32);
    p.empty(k.k_in, {T * q.G, q.D}, DType::f32);
    p.empty(k.q_rstd, {q_rows}, DType::f32);
    p.empty(k.k_rstd, {k_rows}, DType::f32);
    if (d.layernorm) p.empty(k.q_mean, {q_rows}, DType::f32);
    if (d.layernorm) p.empty(k.k_mean, {k_rows}, DType::f32);
  }
  p.empty(k.attn, {T, q.q_heads() * q.D}, c);
  p.empty(k.lse, {q.B, q.q_heads(), q.S}, DType::f32);
}

void plan_workspace(DenseLayerWorkspace& w, const DenseLayerDims& d, bool with_attention, BufferPlan& p) {
  const DType c = d.compute;
  const int64_t T = d.tokens();
  const bool tp = d.tp_size() > 1;
  p.empty(w.dh, {T, d.H}, DType::f32);
  if (c != DType::f32 || d.dropout || tp) p.empty(w.dres_c, {d.N, d.H}, c);
  if (with_attention) {
    p.empty(w.dqkv, {T, d.qkv.width()}, c);
    p.empty(w.dattn, {T, d.qkv.q_heads() * d.qkv.D}, c);
    plan_context_parallel_workspace(w.cp, d.qkv, d.cp_size(), c, p);
  }
  p.empty(w.dfc1, {T, d.fc1_rows()}, c);
  p.empty(w.dact, {T, d.F}, c);
  if (d.qk_norm && with_attention) {
    p.empty(w.qk_y, {T * d.qkv.q_heads(), d.qkv.D}, c);
    p.empty(w.qk_dx, {T * d.qkv.q_heads(), d.qkv.D}, DType::f32);
    if (d.qk_norm_over_heads && tp) {
      const int64_t whole = d.tp_size() * d.qkv.q_heads() * d.qkv.D;
      p.empty(w.qk_full_x, {T, whole}, DType::f32);
      p.empty(w.qk_full_y, {T, whole}, c);
      p.empty(w.qk_full_dx, {T, whole}, DType::f32);
    }
  }
  if (tp && d.sequence_parallel) {
    p.empty(w.h_local, {d.N, d.H}, c);
    p.empty(w.dh_local, {d.N, d.H}, DType::f32);
    p.empty(w.dres_full, {T, d.H}, c);
  }
}
}  // namespace

DenseLayerCache dense_layer_cache_alloc(const DenseLayerDims& d, bool with_mlp, bool with_attention) {
  return plan_allocate<DenseLayerCache>(
      MemCategory::activations,
      [&](DenseLayerCache& k, BufferPlan& p) { plan_cache(k, d, with_mlp, with_attention, p); }, d.device);
}

int64_t dense_layer_cache_bytes(const DenseLayerDims& d, bool with_mlp, bool with_attention) {
  return plan_bytes<DenseLayerCache>(MemCategory::activations, [&](DenseLayerCache& k, BufferPlan& p) {
    plan_cache(k, d, with_mlp, with_attention, p);
  });
}

DenseLayerWorkspace dense_layer_workspace_alloc(const DenseLayerDims& d, bool with_attention) {
  return plan_allocate<DenseLayerWorkspace>(
      MemCategory::workspace, [&](DenseLayerWorkspace& w, BufferPlan& p) { plan_workspace(w, d, with_attention, p); },
      d.device);
}

int64_t dense_layer_workspace_bytes(const DenseLayerDims& d, bool with_attention) {
  return plan_bytes<DenseLayerWorkspace>(
      MemCategory::workspace, [&](DenseLayerWorkspace& w, BufferPlan& p) { plan_workspace(w, d, with_attention, p); });
}

void linear_residual_forward(Tensor& y, const Tensor& x, const Tensor& a, const Tensor& weight, const Tensor& bias,
                             Tensor& out_f32, const Linear& l, const ops::Dropout& drop, const ops::Context& ctx) {
  if (drop.active()) {
    linear_fprop(out_f32, a, weight, 1.0f, 0.0f, l, ctx);
    ops::bias_dropout_add(y, x, out_f32, bias, drop, ctx);
    return;
  }
  if (!y.same_data(x)) y.copy_from(x);
  if (bias.defined()) ops::bias_add(y, bias, ctx);
  linear_fprop(y, a, weight, 1.0f, 1.0f, l, ctx);
}

void linear_residual_backward(Tensor& da, Tensor& dweight, Tensor& dbias, const Tensor& dy, Tensor& dy_c,
                              const Tensor& a, const Tensor& weight, const Linear& l, const ops::Dropout& drop,
                              const ops::Context& ctx) {
  const Tensor* g = &dy;
  if (drop.active()) {
    ops::bias_dropout_add_backward(dy_c, dbias, dy, drop, ctx);
    g = &dy_c;
  } else {
    if (dbias.defined()) ops::bias_grad(dbias, dy, ctx);
    if (a.dtype() != DType::f32) {
      dy_c.copy_from(dy);
      g = &dy_c;
    }
  }
  linear_dgrad(da, *g, weight, 1.0f, 0.0f, l, ctx);
  linear_wgrad(dweight, *g, a, 1.0f, 1.0f, l, ctx);
}

namespace {
bool tensor_parallel(const DenseLayerDims& d) {
  return d.tp_size() > 1;
}
bool seq_parallel(const DenseLayerDims& d) {
  return tensor_parallel(d) && d.sequence_parallel;
}
Tensor by_sequence(const Tensor& t, const DenseLayerDims& d) {
  return nn::by_sequence(t, d.qkv.B);
}
}  // namespace

Tensor by_sequence(const Tensor& t, int64_t B) {
  return t.view({B, t.size(0) / B, t.size(1)});
}

void norm_to_gemm_input(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                        DenseLayerWorkspace& ws, const DenseLayerDims& d, const ops::Context& ctx) {
  if (!seq_parallel(d)) {
    norm_forward(y, mean, rstd, x, w, b, d.eps, ctx);
    return;
  }
  norm_forward(ws.h_local, mean, rstd, x, w, b, d.eps, ctx);
  all_gather_into(by_sequence(y, d), by_sequence(ws.h_local, d), 1, *d.tp);
}

Tensor reduce_partial(DenseLayerWorkspace& ws, const DenseLayerDims& d) {
  if (!tensor_parallel(d)) return ws.dh;
  if (seq_parallel(d)) {
    reduce_scatter_from(by_sequence(ws.dh_local, d), by_sequence(ws.dh, d), 1, *d.tp);
    return ws.dh_local;
  }
  all_reduce_sum(ws.dh, *d.tp);
  return ws.dh;
}

void row_parallel_residual_forward(Tensor& y, const Tensor& x, const Tensor& a, const Tensor& weight,
                                   const Tensor& bias, DenseLayerWorkspace& ws, const DenseLayerDims& d,
                                   const Linear& l, const ops::Dropout& drop, const ops::Context& ctx) {
  if (!tensor_parallel(d)) {
    linear_residual_forward(y, x, a, weight, bias, ws.dh, l, drop, ctx);
    return;
  }
  linear_fprop(ws.dh, a, weight, 1.0f, 0.0f, l, ctx);
  ops::bias_dropout_add(y, x, reduce_partial(ws, d), bias, drop, ctx);
}

void row_parallel_residual_backward(Tensor& da, Tensor& dweight, Tensor& dbias, const Tensor& dy, const Tensor& a,
                                    const Tensor& weight, DenseLayerWorkspace& ws, const DenseLayerDims& d,
                                    const Linear& l, const ops::Dropout& drop, const ops::Context& ctx) {
  if (!tensor_parallel(d)) {
    linear_residual_backward(da, dweight, dbias, dy, ws.dres_c, a, weight, l, drop, ctx);
    return;
  }
  ops::bias_dropout_add_backward(ws.dres_c, dbias, dy, drop, ctx);
  const Tensor* g = &ws.dres_c;
  if (seq_parallel(d)) {
    all_gather_into(by_sequence(ws.dres_full, d), by_sequence(ws.dres_c, d), 1, *d.tp);
    g = &ws.dres_full;
  }
  linear_dgrad(da, *g, weight, 1.0f, 0.0f, l, ctx);
  linear_wgrad(dweight, *g, a, 1.0f, 1.0f, l, ctx);
}

namespace {
// The input gradient of column-parallel GEMMs fed by a norm (dres += norm'(reduce(g @ W))): g [T, out] compute,
// weight [out, H]; the partial product is reduced over the group first.
void column_parallel_norm_backward(Tensor& dres, Tensor& dw_norm, Tensor& db_norm, const Tensor& g,
                                   const Tensor& weight, const Linear& l, const Tensor& x, const Tensor& w_norm,
                                   const Tensor& b_norm, const Tensor& mean, const Tensor& rstd,
                                   DenseLayerWorkspace& ws, const DenseLayerDims& d, const ops::Context& ctx) {
  linear_dgrad(ws.dh, g, weight, 1.0f, 0.0f, l, ctx);
  const Tensor dnorm = reduce_partial(ws, d);
  norm_backward(dres, dw_norm, db_norm, dnorm, x, w_norm, b_norm, mean, rstd, true, ctx);
}
}  // namespace

namespace {
// One QK-norm's rows: [T*heads, D] per head, or [T, heads*D] over heads (the view of the same gathered slots).
Tensor qk_rows(const Tensor& t, const DenseLayerDims& d) {
  return d.qk_norm_over_heads ? t.view({d.tokens(), t.numel() / d.tokens()}) : t;
}

// The whole projection's columns [T, P*n] of all TP ranks (into ws.qk_full_x's first P*n columns) from this rank's
// [T, n]; without TP none (nullopt).
Tensor gather_heads(const Tensor& full, const Tensor& local, const DenseLayerDims& d) {
  const int64_t T = local.size(0), n = local.size(1);
  Tensor out = full.view({full.numel()}).slice(0, 0, T * n * d.tp_size()).view({T, n * d.tp_size()});
  all_gather_into(out, local, 1, *d.tp);
  return out;
}

Tensor own_columns(const Tensor& full, const DenseLayerDims& d) {
  const int64_t n = full.size(1) / d.tp_size(), r = d.tp->rank();
  return full.slice(1, r * n, (r + 1) * n);
}

// The norm over each token's whole projection (qk_norm_over_heads): under TP every rank gathers all heads, norms the
// whole rows (the same on every rank, so the weight's gradient is whole) and keeps its own columns.
void over_heads_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                        DenseLayerWorkspace& ws, const DenseLayerDims& d, const ops::Context& ctx) {
  if (d.tp_size() == 1) return norm_forward(y, mean, rstd, x, w, b, d.eps, ctx);
  const Tensor xf = gather_heads(ws.qk_full_x, x, d);
  Tensor yf = ws.qk_full_y.view({ws.qk_full_y.numel()}).slice(0, 0, xf.numel()).view(xf.shape());
  norm_forward(yf, mean, rstd, xf, w, b, d.eps, ctx);
  y.copy_from(own_columns(yf, d));
}

void over_heads_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                         const Tensor& b, const Tensor& mean, const Tensor& rstd, DenseLayerWorkspace& ws,
                         const DenseLayerDims& d, const ops::Context& ctx) {
  if (d.tp_size() == 1) return norm_backward(dx, dw, db, dy, x, w, b, mean, rstd, false, ctx);
  const Tensor xf = gather_heads(ws.qk_full_x, x, d), dyf = gather_heads(ws.qk_full_y, dy, d);
  Tensor dxf = ws.qk_full_dx.view({ws.qk_full_dx.numel()}).slice(0, 0, xf.numel()).view(xf.shape());
  norm_backward(dxf, dw, db, dyf, xf, w, b, mean, rstd, false, ctx);
  dx.copy_from(own_columns(dxf, d));
}

void qk_norm_one_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                         DenseLayerWorkspace& ws, const DenseLayerDims& d, const ops::Context& ctx) {
  if (!d.qk_norm_over_heads) return norm_forward(y, mean, rstd, x, w, b, d.eps, ctx);
  Tensor yr = qk_rows(y, d);
  over_heads_forward(yr, mean, rstd, qk_rows(x, d), w, b, ws, d, ctx);
}

void qk_norm_one_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                          const Tensor& b, const Tensor& mean, const Tensor& rstd, DenseLayerWorkspace& ws,
                          const DenseLayerDims& d, const ops::Context& ctx) {
  if (!d.qk_norm_over_heads) return norm_backward(dx, dw, db, dy, x, w, b, mean, rstd, false, ctx);
  Tensor dxr = qk_rows(dx, d);
  over_heads_backward(dxr, dw, db, qk_rows(dy, d), qk_rows(x, d), w, b, mean, rstd, ws, d, ctx);
}
}  // namespace

// QK-norm: the query heads (slots 0..R-1 of each group) and the key head (slot R) go through the layer's norm as
// rows of D (or, over heads, as one row per token), with one weight per kind, and back into the fused activation.
void qk_norm_forward(DenseLayerCache& k, const DenseLayerWeights& w, DenseLayerWorkspace& ws, const DenseLayerDims& d,
                     const ops::Context& ctx) {
  const ops::QkvDims& q = d.qkv;
  Tensor yk = ws.qk_y.slice(0, 0, k.k_in.size(0));
  ops::qkv_slots_gather(k.q_in, k.qkv, q, 0, q.R, ctx);
  qk_norm_one_forward(ws.qk_y, k.q_mean, k.q_rstd, k.q_in, w.q_norm, w.q_norm_bias, ws, d, ctx);
  ops::qkv_slots_scatter(k.qkv, ws.qk_y, q, 0, q.R, ctx);
  ops::qkv_slots_gather(k.k_in, k.qkv, q, q.R, 1, ctx);
  qk_norm_one_forward(yk, k.k_mean, k.k_rstd, k.k_in, w.k_norm, w.k_norm_bias, ws, d, ctx);
  ops::qkv_slots_scatter(k.qkv, yk, q, q.R, 1, ctx);
}

// dqkv's query and key slots: dL/d(norm output) on entry, dL/d(norm input) on return.
void qk_norm_backward(Tensor& dqkv, DenseLayerGrads& g, const DenseLayerCache& k, const DenseLayerWeights& w,
                      DenseLayerWorkspace& ws, const DenseLayerDims& d, const ops::Context& ctx) {
  const ops::QkvDims& q = d.qkv;
  const int64_t kr = k.k_in.size(0);
  Tensor dyk = ws.qk_y.slice(0, 0, kr), dxk = ws.qk_dx.slice(0, 0, kr);
  ops::qkv_slots_gather(ws.qk_y, dqkv, q, 0, q.R, ctx);
  qk_norm_one_backward(ws.qk_dx, g.q_norm, g.q_norm_bias, ws.qk_y, k.q_in, w.q_norm, w.q_norm_bias, k.q_mean, k.q_rstd,
                       ws, d, ctx);
  ops::qkv_slots_scatter(dqkv, ws.qk_dx, q, 0, q.R, ctx);
  ops::qkv_slots_gather(dyk, dqkv, q, q.R, 1, ctx);
  qk_norm_one_backward(dxk, g.k_norm, g.k_norm_bias, dyk, k.k_in, w.k_norm, w.k_norm_bias, k.k_mean, k.k_rstd, ws, d,
                       ctx);
  ops::qkv_slots_scatter(dqkv, dxk, q, q.R, 1, ctx);
}

void attention_block_forward(const Tensor& x, const DenseLayerWeights& w, DenseLayerCache& k, DenseLayerWorkspace& ws,
                             const Tensor& rope, const DenseLayerDims& d, const LayerDropout& drop,
                             const ops::Context& ctx) {
  norm_to_gemm_input(k.h1, k.mean1, k.rstd1, x, w.input_norm, w.input_norm_bias, ws, d, ctx);
  linear_fprop(k.qkv, k.h1, w.qkv, 1.0f, 0.0f, d.linear("self_attention.linear_qkv"), ctx);
  if (w.qkv_bias.defined()) ops::bias_add(k.qkv, w.qkv_bias, ctx);
  if (d.qk_norm) qk_norm_forward(k, w, ws, d, ctx);
  Tensor qkv = bsw(k.qkv, d), attn = bsw(k.attn, d);
  if (d.rope) ops::rope_forward(qkv, rope, d.qkv, ctx);
  attention_forward(attn, k.lse, qkv, d.qkv, drop.attention, attention_options(w, d), d.cp, ws.cp, ctx);
  row_parallel_residual_forward(k.x_mid, x, k.attn, w.proj, w.proj_bias, ws, d, d.linear("self_attention.linear_proj"),
                                drop.attn_out, ctx);
}

void mlp_norm_forward(const DenseLayerWeights& w, DenseLayerCache& k, const DenseLayerDims& d,
                      const ops::Context& ctx) {
  norm_forward(k.h2, k.mean2, k.rstd2, k.x_mid, w.mlp_norm, w.mlp_norm_bias, d.eps, ctx);
}

void attention_norm_refill(const Tensor& x, const DenseLayerWeights& w, DenseLayerCache& k, DenseLayerWorkspace& ws,
                           const DenseLayerDims& d, const ops::Context& ctx) {
  norm_to_gemm_input(k.h1, k.mean1, k.rstd1, x, w.input_norm, w.input_norm_bias, ws, d, ctx);
}

void mlp_norm_refill(const DenseLayerWeights& w, DenseLayerCache& k, DenseLayerWorkspace& ws, const DenseLayerDims& d,
                     bool dense_mlp, const ops::Context& ctx) {
  if (dense_mlp)
    norm_to_gemm_input(k.h2, k.mean2, k.rstd2, k.x_mid, w.mlp_norm, w.mlp_norm_bias, ws, d, ctx);
  else
    mlp_norm_forward(w, k, d, ctx);
}

void core_attention_refill(const DenseLayerWeights& w, DenseLayerCache& k, DenseLayerWorkspace& ws,
                           const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx) {
  Tensor qkv = bsw(k.qkv, d), attn = bsw(k.attn, d);  // (the kept q, k, v: after QK-norm and RoPE)
  attention_forward(attn, k.lse, qkv, d.qkv, drop.attention, attention_options(w, d), d.cp, ws.cp, ctx);
}

void mlp_refill(const DenseLayerWeights& w, DenseLayerCache& k, const DenseLayerDims& d, const ops::Context& ctx) {
  linear_fprop(k.fc1, k.h2, w.fc1, 1.0f, 0.0f, d.linear("mlp.linear_fc1"), ctx);
  if (w.fc1_bias.defined()) ops::bias_add(k.fc1, w.fc1_bias, ctx);
  ops::mlp_activation_forward(k.act, k.fc1, d.act, ctx);
}

void dense_layer_forward(Tensor& y, const Tensor& x, const DenseLayerWeights& w, DenseLayerCache& k,
                         DenseLayerWorkspace& ws, const Tensor& rope, const DenseLayerDims& d, const LayerDropout& drop,
                         const ops::Context& ctx) {
  attention_block_forward(x, w, k, ws, rope, d, drop, ctx);
  mlp_block_forward(y, w, k, ws, d, drop, ctx);
}

void mlp_block_forward(Tensor& y, const DenseLayerWeights& w, DenseLayerCache& k, DenseLayerWorkspace& ws,
                       const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx) {
  norm_to_gemm_input(k.h2, k.mean2, k.rstd2, k.x_mid, w.mlp_norm, w.mlp_norm_bias, ws, d, ctx);
  mlp_refill(w, k, d, ctx);  // fc1 and its activation
  row_parallel_residual_forward(y, k.x_mid, k.act, w.fc2, w.fc2_bias, ws, d, d.linear("mlp.linear_fc2"), drop.mlp_out,
                                ctx);
}

void mlp_norm_backward(Tensor& dres, DenseLayerGrads& g, const Tensor& dh2, const DenseLayerWeights& w,
                       const DenseLayerCache& k, const DenseLayerDims& d, const ops::Context& ctx) {
  norm_backward(dres, g.mlp_norm, g.mlp_norm_bias, dh2, k.x_mid, w.mlp_norm, w.mlp_norm_bias, k.mean2, k.rstd2, true,
                ctx);
}

void attention_block_backward(Tensor& dres, DenseLayerGrads& g, const Tensor& x, const DenseLayerWeights& w,
                              const DenseLayerCache& k, DenseLayerWorkspace& ws, const Tensor& rope,
                              const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx) {
  row_parallel_residual_backward(ws.dattn, g.proj, g.proj_bias, dres, k.attn, w.proj, ws, d,
                                 d.linear("self_attention.linear_proj"), drop.attn_out, ctx);
  Tensor dqkv = bsw(ws.dqkv, d);
  attention_backward(dqkv, g.softmax_offset.defined() ? &g.softmax_offset : nullptr, bsw(ws.dattn, d), bsw(k.qkv, d),
                     bsw(k.attn, d), k.lse, d.qkv, drop.attention, attention_options(w, d), d.cp, ws.cp, ctx);
  if (d.rope) ops::rope_backward(dqkv, rope, d.qkv, ctx);
  if (d.qk_norm) qk_norm_backward(ws.dqkv, g, k, w, ws, d, ctx);
  if (g.qkv_bias.defined()) ops::bias_grad(g.qkv_bias, ws.dqkv, ctx);
  const Linear qkv = d.linear("self_attention.linear_qkv");
  linear_wgrad(g.qkv, ws.dqkv, k.h1, 1.0f, 1.0f, qkv, ctx);
  column_parallel_norm_backward(dres, g.input_norm, g.input_norm_bias, ws.dqkv, w.qkv, qkv, x, w.input_norm,
                                w.input_norm_bias, k.mean1, k.rstd1, ws, d, ctx);
}

void dense_layer_backward(Tensor& dres, DenseLayerGrads& g, const Tensor& x, const DenseLayerWeights& w,
                          const DenseLayerCache& k, DenseLayerWorkspace& ws, const Tensor& rope,
                          const DenseLayerDims& d, const LayerDropout& drop, const ops::Context& ctx) {
  mlp_block_backward(dres, g, w, k, ws, d, drop, ctx);
  // Attention block, in reverse: dres is dL/dx_mid here.
  attention_block_backward(dres, g, x, w, k, ws, rope, d, drop, ctx);
}

void mlp_block_backward(Tensor& dres, DenseLayerGrads& g, const DenseLayerWeights& w, const DenseLayerCache& k,
                        DenseLayerWorkspace& ws, const DenseLayerDims& d, const LayerDropout& drop,
                        const ops::Context& ctx) {
  // MLP block, in reverse: dres is dL/dy here.
  row_parallel_residual_backward(ws.dact, g.fc2, g.fc2_bias, dres, k.act, w.fc2, ws, d, d.linear("mlp.linear_fc2"),
                                 drop.mlp_out, ctx);
  ops::mlp_activation_backward(ws.dfc1, ws.dact, k.fc1, d.act, ctx);
  if (g.fc1_bias.defined()) ops::bias_grad(g.fc1_bias, ws.dfc1, ctx);
  const Linear fc1 = d.linear("mlp.linear_fc1");
  linear_wgrad(g.fc1, ws.dfc1, k.h2, 1.0f, 1.0f, fc1, ctx);
  column_parallel_norm_backward(dres, g.mlp_norm, g.mlp_norm_bias, ws.dfc1, w.fc1, fc1, k.x_mid, w.mlp_norm,
                                w.mlp_norm_bias, k.mean2, k.rstd2, ws, d, ctx);
}

}  // namespace moecore::nn
