// Routed experts, grouped (one grouped GEMM per projection) and sequential (plain GEMMs per expert), with the
// routing probability applied after the activation and the optional biases (the fc2 bias weighted by the
// probability). Both versions share the row-wise steps (ops::moe_scale_rows and its backward), so they differ
// only in how the GEMMs are issued.
// Not here: the shared expert (shared_expert.cpp), the permutation (dispatcher.cpp).
#include "moecore/moe/experts.h"

namespace moecore::moe {
namespace {

// The first R rows of every per-row buffer.
struct RowViews {
  Tensor h, act, a, da, dh;
};
RowViews row_views(const ExpertCache& cache, const ExpertWorkspace& ws, int64_t R, bool backward) {
  RowViews v{cache.h.slice(0, 0, R), cache.act.slice(0, 0, R), ws.a.slice(0, 0, R), {}, {}};
  if (backward) {
    v.da = ws.da.slice(0, 0, R);
    v.dh = ws.dh.slice(0, 0, R);
  }
  return v;
}

// (Devices are checked by the ops, which name the tensor on the wrong one.)
bool has_shape(const Tensor& t, const Shape& s, DType dtype) {
  return t.defined() && t.shape() == s && t.dtype() == dtype && t.is_contiguous();
}
bool has_rows(const Tensor& t, int64_t min_rows, int64_t cols, DType dtype) {
  return t.defined() && t.dim() == 2 && t.size(0) >= min_rows && t.size(1) == cols && t.dtype() == dtype &&
         t.is_contiguous();
}

// Entry checks shared by all four entry points; R is the row count of x.
void check_experts(const char* op, const Tensor& x, const Tensor& probs, const Tensor& tpe, const ExpertWeights& w,
                   const ExpertCache& cache, const ExpertWorkspace& ws, const ExpertDims& d, bool backward) {
  const int64_t R = x.defined() && x.dim() == 2 ? x.size(0) : -1, F1 = d.fc1_rows();
  const DType c = d.compute;
  if (!has_shape(tpe, {d.E}, DType::i64))
    MOECORE_FAIL(op, ": tokens_per_expert must be a contiguous [E = ", d.E, "] i64 tensor, got ",
                 tpe.defined() ? tpe.str() : "undefined");
  if (!has_shape(x, {R, d.H}, c) || !has_shape(probs, {R}, DType::f32))
    MOECORE_FAIL(op, ": need x [R, H=", d.H, "] ", dtype_name(c), " and probs [R] f32, got x ", x.str(), ", probs ",
                 probs.str());
  if (!has_shape(w.fc1, {d.E, F1, d.H}, c) || !has_shape(w.fc2, {d.E, d.H, d.F}, c))
    MOECORE_FAIL(op, ": weights must be fc1 [", d.E, ", ", F1, ", ", d.H, "] and fc2 [", d.E, ", ", d.H, ", ", d.F,
                 "] ", dtype_name(c), ", got fc1 ", w.fc1.str(), ", fc2 ", w.fc2.str());
  const bool b1 = w.fc1_bias.defined(), b2 = w.fc2_bias.defined();
  if (b1 != b2 ||
      (b1 && (!has_shape(w.fc1_bias, {d.E, F1}, DType::f32) || !has_shape(w.fc2_bias, {d.E, d.H}, DType::f32))))
    MOECORE_FAIL(op, ": biases must be both undefined or fc1_bias [", d.E, ", ", F1, "] and fc2_bias [", d.E, ", ", d.H,
                 "] f32, got fc1_bias ", b1 ? w.fc1_bias.str() : "undefined", ", fc2_bias ",
                 b2 ? w.fc2_bias.str() : "undefined");
  const bool cache_ok = has_rows(cache.h, R, F1, c) && has_rows(cache.act, R, d.F, c) && has_rows(ws.a, R, d.F, c) &&
                        (!backward || (has_rows(ws.da, R, d.F, c) && has_rows(ws.dh, R, F1, c)));
  if (!cache_ok)
    MOECORE_FAIL(op, ": cache/workspace too small or of the wrong dtype for ", R, " rows (h ", cache.h.str(), ", act ",
                 cache.act.str(), ", a ", ws.a.str(), "); allocate them with max_rows >= ", R);
}

void check_forward_out(const char* op, const Tensor& y, const Tensor& x, const ExpertDims& d) {
  if (!has_shape(y, x.shape(), d.compute))
    MOECORE_FAIL(op, ": y must be ", x.shape().str(), " ", dtype_name(d.compute), ", got ", y.str());
}

void check_backward_io(const char* op, const Tensor& dx, const Tensor& dprobs, const ExpertGrads& g,
                       const ExpertWeights& w, const Tensor& dy, const Tensor& x, const ExpertDims& d) {
  const int64_t R = x.size(0);
  if (!has_shape(dy, x.shape(), d.compute) || !has_shape(dx, x.shape(), DType::f32) ||
      !has_shape(dprobs, {R}, DType::f32))
    MOECORE_FAIL(op, ": need dy ", x.shape().str(), " ", dtype_name(d.compute), ", dx ", x.shape().str(),
                 " f32, dprobs [", R, "] f32; got dy ", dy.str(), ", dx ", dx.str(), ", dprobs ", dprobs.str());
  if (!has_shape(g.fc1, {d.E, d.fc1_rows(), d.H}, DType::f32) || !has_shape(g.fc2, {d.E, d.H, d.F}, DType::f32))
    MOECORE_FAIL(op, ": gradients must be f32 with the weights' shapes, got fc1 ", g.fc1.str(), ", fc2 ", g.fc2.str());
  if (w.fc1_bias.defined() && (!has_shape(g.fc1_bias, w.fc1_bias.shape(), DType::f32) ||
                               !has_shape(g.fc2_bias, w.fc2_bias.shape(), DType::f32)))
    MOECORE_FAIL(op, ": the weights have biases, so the gradients need fc1_bias ", w.fc1_bias.shape().str(),
                 " and fc2_bias ", w.fc2_bias.shape().str(), " f32, got ",
                 g.fc1_bias.defined() ? g.fc1_bias.str() : "undefined", ", ",
                 g.fc2_bias.defined() ? g.fc2_bias.str() : "undefined");
}

}  // namespace

ExpertCache expert_cache_alloc(const ExpertDims& d) {
  ExpertCache c;
  c.h = Tensor::empty({d.max_rows, d.fc1_rows()}, d.compute, MemCategory::activations, d.device);
  c.act = Tensor::empty({d.max_rows, d.F}, d.compute, MemCategory::activations, d.device);
  return c;
}

ExpertWorkspace expert_workspace_alloc(const ExpertDims& d) {
  ExpertWorkspace w;
  w.a = Tensor::empty({d.max_rows, d.F}, d.compute, MemCategory::workspace, d.device);
  w.da = Tensor::empty({d.max_rows, d.F}, d.compute, MemCategory::workspace, d.device);
  w.dh = Tensor::empty({d.max_rows, d.fc1_rows()}, d.compute, MemCategory::workspace, d.device);
  return w;
}

void experts_forward(Tensor& y, const Tensor& x, const Tensor& probs, const Tensor& tokens_per_expert,
                     const ExpertWeights& w, ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d,
                     const ops::Context& ctx) {
  check_experts("experts_forward", x, probs, tokens_per_expert, w, cache, ws, d, false);
  check_forward_out("experts_forward", y, x, d);
  RowViews v = row_views(cache, ws, x.size(0), false);
  const bool bias = w.fc1_bias.defined();
  const nn::Linear fc1 = d.linear("mlp.experts.linear_fc1"), fc2 = d.linear("mlp.experts.linear_fc2");
  nn::grouped_fprop(v.h, x, w.fc1, tokens_per_expert, fc1, ctx);
  if (bias) ops::bias_add_grouped(v.h, w.fc1_bias, tokens_per_expert, ctx);
  ops::mlp_activation_forward(v.act, v.h, d.act, ctx);
  ops::moe_scale_rows(v.a, v.act, probs, tokens_per_expert, ctx);
  nn::grouped_fprop(y, v.a, w.fc2, tokens_per_expert, fc2, ctx);
  if (bias && d.adds_fc2_bias) ops::bias_add_grouped_scaled(y, w.fc2_bias, probs, tokens_per_expert, ctx);
}

void experts_backward(Tensor& dx, Tensor& dprobs, ExpertGrads& g, const Tensor& dy, const Tensor& x,
                      const Tensor& probs, const Tensor& tokens_per_expert, const ExpertWeights& w,
                      const ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d, const ops::Context& ctx) {
  check_experts("experts_backward", x, probs, tokens_per_expert, w, cache, ws, d, true);
  check_backward_io("experts_backward", dx, dprobs, g, w, dy, x, d);
  RowViews v = row_views(cache, ws, x.size(0), true);
  const bool bias = w.fc1_bias.defined();
  const nn::Linear fc1 = d.linear("mlp.experts.linear_fc1"), fc2 = d.linear("mlp.experts.linear_fc2");
  nn::grouped_dgrad(v.da, dy, w.fc2, tokens_per_expert, fc2, ctx);
  // dprobs = dy . b2 first (written), then the activation term is added to it.
  const bool b2_term = bias && d.adds_fc2_bias;
  Tensor no_term;
  if (bias)
    ops::bias_grad_grouped_scaled(g.fc2_bias, b2_term ? dprobs : no_term, dy, w.fc2_bias, probs, tokens_per_expert,
                                  ctx);
  if (d.recompute_act) ops::mlp_activation_forward(v.act, v.h, d.act, ctx);  // (the same bits as forward's)
  ops::moe_scale_rows_backward(dprobs, v.da, v.a, v.act, probs, tokens_per_expert, b2_term, ctx);
  nn::grouped_wgrad(g.fc2, dy, v.a, tokens_per_expert, fc2, ctx);
  ops::mlp_activation_backward(v.dh, v.da, v.h, d.act, ctx);
  if (bias) ops::bias_grad_grouped(g.fc1_bias, v.dh, tokens_per_expert, ctx);
  nn::grouped_wgrad(g.fc1, v.dh, x, tokens_per_expert, fc1, ctx);
  nn::grouped_dgrad(dx, v.dh, w.fc1, tokens_per_expert, fc1, ctx);
}

// The counts on the host (Megatron's SequentialMLP does tokens_per_expert.tolist()): plain GEMMs per expert need
// their row ranges to launch. Checked against the rows of x.
const std::vector<int64_t>& host_counts(const char* op, const Tensor& tokens_per_expert, int64_t R) {
  thread_local std::vector<int64_t> n;
  n.resize(static_cast<size_t>(tokens_per_expert.numel()));
  tokens_per_expert.copy_to_host(n.data(), tokens_per_expert.numel());
  int64_t sum = 0;
  for (int64_t v : n) {
    if (v < 0) MOECORE_FAIL(op, ": tokens_per_expert holds a negative count ", v);
    sum += v;
  }
  if (sum > R) MOECORE_FAIL(op, ": tokens_per_expert sum to ", sum, " but x has only ", R, " rows");
  return n;
}

// Under FP8 an expert without tokens runs its GEMMs too, on zero rows (as Megatron's SequentialMLP calls every expert):
// its linears quantise their weights (and, with delayed scaling, keep their state) whatever the routing, as grouped
// GEMMs do. Its bias ops are skipped (a bias gradient over no rows would overwrite the accumulated one).
void experts_forward_sequential(Tensor& y, const Tensor& x, const Tensor& probs, const Tensor& tokens_per_expert,
                                const ExpertWeights& w, ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d,
                                const ops::Context& ctx) {
  check_experts("experts_forward_sequential", x, probs, tokens_per_expert, w, cache, ws, d, false);
  check_forward_out("experts_forward_sequential", y, x, d);
  const std::vector<int64_t>& n = host_counts("experts_forward_sequential", tokens_per_expert, x.size(0));
  RowViews v = row_views(cache, ws, x.size(0), false);
  const bool bias = w.fc1_bias.defined();
  const nn::Linear fc1 = d.linear("mlp.experts.linear_fc1"), fc2 = d.linear("mlp.experts.linear_fc2");
  int64_t o = 0;
  for (int64_t e = 0; e < d.E; ++e) {
    if (n[e] == 0 && !d.fp8) continue;
    Tensor h = v.h.slice(0, o, o + n[e]);
    nn::linear_fprop(h, x.slice(0, o, o + n[e]), w.fc1.select(0, e), 1.0f, 0.0f, fc1.of_expert(e), ctx);
    if (bias && n[e] > 0) ops::bias_add(h, w.fc1_bias.select(0, e), ctx);
    o += n[e];
  }
  // The activation and the probability scaling are row-wise, so one pass over all experts' rows equals a pass
  // per expert (the same bits).
  Tensor h = v.h.slice(0, 0, o), act = v.act.slice(0, 0, o);
  ops::mlp_activation_forward(act, h, d.act, ctx);
  ops::moe_scale_rows(v.a, v.act, probs, tokens_per_expert, ctx);
  o = 0;
  for (int64_t e = 0; e < d.E; ++e) {
    if (n[e] == 0 && !d.fp8) continue;
    Tensor ye = y.slice(0, o, o + n[e]);
    nn::linear_fprop(ye, v.a.slice(0, o, o + n[e]), w.fc2.select(0, e), 1.0f, 0.0f, fc2.of_expert(e), ctx);
    o += n[e];
  }
  if (bias && d.adds_fc2_bias) ops::bias_add_grouped_scaled(y, w.fc2_bias, probs, tokens_per_expert, ctx);
}

void experts_backward_sequential(Tensor& dx, Tensor& dprobs, ExpertGrads& g, const Tensor& dy, const Tensor& x,
                                 const Tensor& probs, const Tensor& tokens_per_expert, const ExpertWeights& w,
                                 const ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d,
                                 const ops::Context& ctx) {
  check_experts("experts_backward_sequential", x, probs, tokens_per_expert, w, cache, ws, d, true);
  check_backward_io("experts_backward_sequential", dx, dprobs, g, w, dy, x, d);
  const std::vector<int64_t>& n = host_counts("experts_backward_sequential", tokens_per_expert, x.size(0));
  RowViews v = row_views(cache, ws, x.size(0), true);
  const bool bias = w.fc1_bias.defined(), b2_term = bias && d.adds_fc2_bias;
  Tensor no_term;
  if (bias)
    ops::bias_grad_grouped_scaled(g.fc2_bias, b2_term ? dprobs : no_term, dy, w.fc2_bias, probs, tokens_per_expert,
                                  ctx);
  const nn::Linear fc1 = d.linear("mlp.experts.linear_fc1"), fc2 = d.linear("mlp.experts.linear_fc2");
  int64_t o = 0;
  for (int64_t e = 0; e < d.E; ++e) {
    if (n[e] == 0 && !d.fp8) continue;
    Tensor da = v.da.slice(0, o, o + n[e]);
    nn::linear_dgrad(da, dy.slice(0, o, o + n[e]), w.fc2.select(0, e), 1.0f, 0.0f, fc2.of_expert(e), ctx);
    o += n[e];
  }
  // Row-wise again: dprobs, dL/dact and the recomputed a for all experts' rows in one pass.
  if (d.recompute_act) {
    Tensor act = v.act.slice(0, 0, o);
    ops::mlp_activation_forward(act, v.h.slice(0, 0, o), d.act, ctx);
  }
  ops::moe_scale_rows_backward(dprobs, v.da, v.a, v.act, probs, tokens_per_expert, b2_term, ctx);
  Tensor dh = v.dh.slice(0, 0, o), da = v.da.slice(0, 0, o), h = v.h.slice(0, 0, o);
  ops::mlp_activation_backward(dh, da, h, d.act, ctx);
  o = 0;
  for (int64_t e = 0; e < d.E; ++e) {
    if (n[e] == 0 && !d.fp8) continue;
    const Tensor xe = x.slice(0, o, o + n[e]), dye = dy.slice(0, o, o + n[e]), a = v.a.slice(0, o, o + n[e]);
    Tensor dhe = v.dh.slice(0, o, o + n[e]), dxe = dx.slice(0, o, o + n[e]);
    Tensor g1 = g.fc1.select(0, e), g2 = g.fc2.select(0, e);
    nn::linear_wgrad(g2, dye, a, 1.0f, 1.0f, fc2.of_expert(e), ctx);
    if (bias && n[e] > 0) {
      Tensor gb1 = g.fc1_bias.select(0, e);
      ops::bias_grad(gb1, dhe, ctx);
    }
    nn::linear_wgrad(g1, dhe, xe, 1.0f, 1.0f, fc1.of_expert(e), ctx);
    nn::linear_dgrad(dxe, dhe, w.fc1.select(0, e), 1.0f, 0.0f, fc1.of_expert(e), ctx);
    o += n[e];
  }
}

}  // namespace moecore::moe
