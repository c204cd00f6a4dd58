#include "moecore/nn/lm_head.h"

#include <algorithm>

#include "moecore/core/buffer_plan.h"

namespace moecore::nn {

namespace {
int64_t chunk_tokens(int64_t N, int64_t V) {
  const int64_t want = std::max<int64_t>((int64_t{16} << 20) / std::max<int64_t>(V, 1) / 32 * 32, 32);
  return std::clamp<int64_t>(want, 1, std::max<int64_t>(N, 1));
}
}  // namespace

namespace {
void plan_workspace(LmHeadWorkspace& ws, int64_t N, int64_t V, DType compute, int64_t tp, BufferPlan& p) {
  ws.chunk = chunk_tokens(N, V);
  p.empty(ws.logits, {ws.chunk, V}, DType::f32);
  if (compute != DType::f32) p.empty(ws.dlogits_c, {ws.chunk, V}, compute);
  p.empty(ws.loss, {ws.chunk}, DType::f32);
  p.zeros(ws.totals, {2}, DType::f64);
  if (tp <= 1) return;
  p.empty(ws.stats, {ws.chunk, 3}, DType::f32);
  p.empty(ws.gathered, {tp * ws.chunk, 3}, DType::f32);
  p.empty(ws.lse, {ws.chunk, 2}, DType::f32);
}
}  // namespace

LmHeadWorkspace lm_head_workspace_alloc(int64_t N, int64_t V, DType compute, Device device, int64_t tp) {
  return plan_allocate<LmHeadWorkspace>(
      MemCategory::workspace, [&](LmHeadWorkspace& ws, BufferPlan& p) { plan_workspace(ws, N, V, compute, tp, p); },
      device);
}

int64_t lm_head_workspace_bytes(int64_t N, int64_t V, DType compute, int64_t tp) {
  return plan_bytes<LmHeadWorkspace>(
      MemCategory::workspace, [&](LmHeadWorkspace& ws, BufferPlan& p) { plan_workspace(ws, N, V, compute, tp, p); });
}

void lm_head_loss(Tensor* dh, Tensor* dw, const Tensor& h, const Tensor& w, const Tensor& labels, float grad_scale,
                  LmHeadWorkspace& ws, const ops::Context& ctx, const ProcessGroup* tp, bool reduce_dh,
                  const Linear& output) {
  const int64_t N = h.size(0), P = tp ? tp->size() : 1, Vl = w.size(0);
  const int64_t ws_tp = ws.stats.defined() ? ws.gathered.size(0) / ws.stats.size(0) : 1;
  if (ws_tp != P)
    MOECORE_FAIL("lm_head_loss: the workspace was allocated for tensor-parallel size ", ws_tp, ", the group '",
                 tp ? tp->name() : std::string("(none)"), "' has ", P, " ranks");
  const int64_t vocab_start = P > 1 ? tp->rank() * Vl : 0;
  ws.totals.zero_();
  for (int64_t t0 = 0; t0 < N; t0 += ws.chunk) {
    const int64_t n = std::min(ws.chunk, N - t0);
    const Tensor hc = h.slice(0, t0, t0 + n), lc = labels.slice(0, t0, t0 + n);
    Tensor logits = ws.logits.slice(0, 0, n), loss = ws.loss.slice(0, 0, n);
    linear_fprop(logits, hc, w, 1.0f, 0.0f, output, ctx);
    if (P == 1) {
      ops::softmax_cross_entropy(loss, logits, lc, grad_scale, dh != nullptr, ctx);
    } else {
      Tensor stats = ws.stats.slice(0, 0, n), gathered = ws.gathered.slice(0, 0, P * n), lse = ws.lse.slice(0, 0, n);
      ops::vocab_parallel_ce_stats(stats, logits, lc, vocab_start, ctx);
      all_gather(gathered, stats, *tp);
      ops::vocab_parallel_ce_merge(lse, gathered.view({P, n, 3}), lc, P * Vl, ctx);
      ops::vocab_parallel_ce_finish(loss, logits, lse, lc, vocab_start, grad_scale, dh != nullptr, ctx);
    }
    ops::loss_totals(ws.totals, loss, lc, ctx);
    if (!dh) continue;
    Tensor dlogits = logits;
    if (ws.dlogits_c.defined()) {
      dlogits = ws.dlogits_c.slice(0, 0, n);
      dlogits.copy_from(logits);
    }
    Tensor dhc = dh->slice(0, t0, t0 + n);
    linear_dgrad(dhc, dlogits, w, 1.0f, 0.0f, output, ctx);
    linear_wgrad(*dw, dlogits, hc, 1.0f, 1.0f, output, ctx);
  }
  // Each rank's dh is the product with its vocabulary rows only: the sum over the group (rank order) is the whole.
  if (dh && P > 1 && reduce_dh) all_reduce_sum(*dh, *tp);
}

}  // namespace moecore::nn
