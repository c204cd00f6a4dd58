#include "moecore/moe/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace moecore::moe {
namespace {

RouterDims router_dims(const MoeLayerDims& d, const MoeConfig& cfg) {
  return {d.T, d.B, d.H, cfg.num_experts, cfg.router_topk, d.global_aux_group, d.sequence_group};
}

ExpertDims expert_dims(const MoeLayerDims& d, const MoeConfig& cfg, int64_t max_rows) {
  ExpertDims e;
  e.E = cfg.num_experts / d.ep;  // local experts
  e.H = d.H;
  e.F = d.F / d.etp;  // this rank's slice of every local expert
  e.adds_fc2_bias = d.etp_rank == 0;
  e.recompute_act = d.recompute_act;
  e.act = cfg.activation();
  e.max_rows = max_rows;
  e.compute = d.compute;
  e.device = d.device;
  e.fp8 = d.fp8;
  e.layer = d.layer;
  return e;
}

// The expert columns the dispatcher sees: E, plus the clone slots with ECHO.
int64_t columns_of(const MoeLayerDims& d, const MoeConfig& cfg) {
  return cfg.num_experts + (d.echo.enabled() ? d.echo.slots : 0);
}

int64_t capacity_of(const MoeLayerDims& d, const MoeConfig& cfg) {
  return cfg.capacity_factor > 0 ? expert_capacity(d.T * cfg.router_topk, cfg.num_experts, cfg.capacity_factor) : 0;
}
// Rows this rank's tokens produce (over all E experts).
int64_t max_send_of(const MoeLayerDims& d, const MoeConfig& cfg) {
  return dispatch_max_rows(d.T, columns_of(d, cfg), cfg.router_topk, capacity_of(d, cfg),
                           cfg.pad_expert_input_to_capacity, cfg.router_padding_alignment);
}
// Rows this rank's local experts can receive.
int64_t max_rows_of(const MoeLayerDims& d, const MoeConfig& cfg) {
  if ((d.ep == 1 && d.etp == 1) || d.dispatcher == DispatcherKind::local) return max_send_of(d, cfg);
  return dispatch_max_rows_ep(d.T, columns_of(d, cfg), cfg.router_topk, capacity_of(d, cfg),
                              cfg.pad_expert_input_to_capacity, cfg.router_padding_alignment, d.ep, d.etp);
}

int64_t bytes_of(const Tensor& t) {
  return t.defined() ? t.nbytes() : 0;
}

}  // namespace

namespace {
// The scratch tensors of a cache (MoeLayerCache, const or not), by address, so they can be aliased and counted in one
// place.
template <class Cache>
auto scratch_tensors(Cache& c) {
  using T = std::conditional_t<std::is_const_v<Cache>, const Tensor, Tensor>;
  std::vector<T*> v = {&c.dprobs,       &c.router.dlogits, &c.router.work, &c.router.forced_bias, &c.expert_ws.a,
                       &c.expert_ws.da, &c.expert_ws.dh,   &c.shared.dact, &c.shared.dh,          &c.shared.dout_c};
  for (T* t : dispatch_scratch_tensors(c.dispatch)) v.push_back(t);
  if (c.echo.ep > 1)
    for (T* t : echo_scratch_tensors(c.echo)) v.push_back(t);
  return v;
}
// The saved tensors of the routing (kept by a recomputed layer) and those a forward refills from it.
std::vector<const Tensor*> routing_tensors(const MoeLayerCache& c) {
  const auto& r = c.router;
  std::vector<const Tensor*> v = {&r.x_jittered,
                                  &r.jitter,
                                  &r.logits,
                                  &r.scores,
                                  &r.topk_idx,
                                  &r.topk_w,
                                  &r.topk_kept,
                                  &r.dlogits_loss,
                                  &c.probs,
                                  &c.map,
                                  &c.stats.tokens_per_expert,
                                  &c.stats.losses,
                                  &c.stats.dropped};
  for (const Tensor* t : echo_routing_tensors(c.echo)) v.push_back(t);
  return v;
}
std::vector<const Tensor*> refilled_tensors(const MoeLayerCache& c) {
  const auto& s = c.shared;
  std::vector<const Tensor*> v = dispatch_refilled_tensors(c.dispatch);
  for (const Tensor* t : {&c.experts.h, &c.experts.act, &s.h, &s.act, &s.out, &s.gate_s}) v.push_back(t);
  for (const Tensor* t : echo_refilled_tensors(c.echo)) v.push_back(t);
  return v;
}
}  // namespace

MoeLayerCache moe_layer_cache_alloc(const MoeLayerDims& d, const MoeConfig& cfg, const MoeLayerCache* share) {
  const int64_t E = cfg.num_experts;
  if (d.ep <= 0 || E % d.ep != 0)
    MOECORE_FAIL("MoE layer: --num-experts (", E, ") must be divisible by --expert-model-parallel-size (", d.ep, ")");
  if (d.etp <= 0 || d.F % d.etp != 0)
    MOECORE_FAIL("MoE layer: the expert ffn size (--moe-ffn-hidden-size, ", d.F,
                 ") must be divisible by --expert-tensor-parallel-size (", d.etp, ")");
  if ((d.ep > 1 || d.etp > 1) && d.dispatcher == DispatcherKind::local)
    MOECORE_FAIL("MoE layer: expert-parallel size ", d.ep, " x expert-tensor-parallel size ", d.etp,
                 " needs the alltoall or allgather dispatcher");
  echo_check_layout(d.echo.slots, d.received_capacity, d.ep, d.etp, d.dispatcher, cfg);
  const int64_t rows = max_rows_of(d, cfg), kept = moe_layer_received_rows(d, cfg);
  MoeLayerCache c;
  c.router = router_cache_alloc(router_dims(d, cfg), cfg, d.compute, d.device);
  c.stats = router_stats_alloc(E, d.device);
  c.probs = Tensor::empty({d.T, E}, DType::f32, MemCategory::activations, d.device);
  c.map = Tensor::empty({d.T, E}, DType::boolean, MemCategory::activations, d.device);
  c.dprobs = Tensor::empty({d.T, E}, DType::f32, MemCategory::workspace, d.device);
  DispatchDims dd;
  dd.T = d.T;
  dd.H = d.H;
  dd.E = columns_of(d, cfg);
  dd.ep = d.ep;
  dd.etp = d.etp;
  dd.max_send = max_send_of(d, cfg);
  dd.max_rows = rows;
  dd.x_dtype = d.compute;
  dd.device = d.device;
  c.dispatch = dispatch_buffers_alloc_ep(d.dispatcher, dd);
  if (kept < rows) {  // the saved expert side at the static capacity (the staging scratch keeps every row)
    c.dispatch.permuted_x = Tensor::empty({kept, d.H}, d.compute, MemCategory::activations, d.device);
    c.dispatch.permuted_probs = Tensor::empty({kept}, DType::f32, MemCategory::activations, d.device);
  }
  const ExpertDims ed = expert_dims(d, cfg, rows);
  if (d.echo.enabled()) c.echo = echo_cache_alloc(d.echo, d.T, E, ed);
  c.experts = expert_cache_alloc(expert_dims(d, cfg, kept));
  c.expert_ws = expert_workspace_alloc(ed);
  if (d.Fs > 0)
    c.shared = shared_expert_cache_alloc(d.T, d.H, d.Fs, cfg.swiglu, cfg.shared_expert_gate, d.compute, d.device);
  if (share) {
    // Replacing the freshly allocated scratch by the donor's frees it again; allocation is once per model.
    const std::vector<Tensor*> mine = scratch_tensors(c);
    const std::vector<const Tensor*> theirs = scratch_tensors(*share);
    MOECORE_CHECK(mine.size() == theirs.size() && c.dispatch.state.index() == share->dispatch.state.index(),
                  "moe_layer_cache_alloc: the scratch donor has another dispatcher");
    for (size_t i = 0; i < mine.size(); ++i) {
      MOECORE_CHECK(
          mine[i]->defined() == theirs[i]->defined() && (!mine[i]->defined() || mine[i]->shape() == theirs[i]->shape()),
          "moe_layer_cache_alloc: scratch donor has different shapes");
      *mine[i] = *theirs[i];
    }
  }
  return c;
}

SharedExpertDims shared_expert_dims(const MoeLayerDims& d, const MoeConfig& cfg) {
  return {cfg.activation(), d.fp8, d.layer};
}

int64_t moe_layer_received_rows(const MoeLayerDims& d, const MoeConfig& cfg) {
  const int64_t all = max_rows_of(d, cfg);
  if (d.received_capacity <= 0) return all;
  const auto avg = static_cast<double>(d.T * cfg.router_topk);
  return std::min(all, static_cast<int64_t>(std::ceil(static_cast<double>(d.received_capacity) * avg)));
}

bool moe_layer_overflowed(const MoeLayerCache& c) {
  return dispatch_overflowed(c.dispatch);
}

void moe_layer_cache_share_refilled(MoeLayerCache& c, const MoeLayerCache& from) {
  // The refilled tensors are the dispatch buffers' saved part (their scratch is shared already), the experts' and the
  // shared expert's caches: alias them whole (the host-side plans in the copies are rewritten by each forward).
  DispatchBuffers own = c.dispatch;
  c.dispatch = from.dispatch;
  const std::vector<Tensor*> mine = dispatch_scratch_tensors(own), now = dispatch_scratch_tensors(c.dispatch);
  for (size_t i = 0; i < now.size(); ++i) *now[i] = *mine[i];  // scratch: whoever owned it before
  c.experts = from.experts;
  if (!c.echo.recompute_dispatch) c.echo.clones = from.echo.clones;
  const SharedExpertCache shared = c.shared;
  c.shared = from.shared;
  c.shared.dact = shared.dact;  // (scratch)
  c.shared.dh = shared.dh;
  c.shared.dout_c = shared.dout_c;
  c.owns_refilled = false;
}

int64_t moe_layer_cache_bytes(const MoeLayerCache& c) {
  int64_t n = 0;
  for (const Tensor* t : routing_tensors(c)) n += bytes_of(*t);
  if (c.owns_refilled)
    for (const Tensor* t : refilled_tensors(c))
      if ((t != &c.experts.act || c.owns_expert_act) && ((t != &c.shared.h && t != &c.shared.act) || c.owns_shared_act))
        n += bytes_of(*t);
  return n;
}

int64_t moe_layer_scratch_bytes(const MoeLayerCache& c) {
  int64_t n = 0;
  for (const Tensor* t : scratch_tensors(c)) n += bytes_of(*t);
  return n;
}

namespace {
// A run of received rows and the local experts they belong to: [first_row, first_row + rows) and experts
// [first_expert, first_expert + experts) of the dispatcher's local columns.
struct RowRange {
  int64_t first_row = 0, rows = 0, first_expert = 0, experts = 0;
};
struct ExpertRows {
  RowRange home, clones;  // clones: empty without ECHO
};
ExpertRows expert_rows(const DispatchBuffers& b, const MoeLayerCache& c, const MoeLayerDims& d, const MoeConfig& cfg) {
  const int64_t R = b.plan.row_bound, El = cfg.num_experts / d.ep;
  if (!d.echo.enabled()) return {{0, R, 0, El}, {}};
  const int64_t Rh = echo_home_rows(b, c.echo);
  return {{0, Rh, 0, El}, {Rh, R - Rh, El, c.echo.Sl}};
}

ExpertDims range_dims(const MoeLayerDims& d, const MoeConfig& cfg, const RowRange& r) {
  ExpertDims ed = expert_dims(d, cfg, r.rows);
  ed.E = r.experts;
  return ed;
}
ExpertCache range_cache(const ExpertCache& c, const RowRange& r) {
  return {c.h.slice(0, r.first_row, r.first_row + r.rows), c.act.slice(0, r.first_row, r.first_row + r.rows)};
}
ExpertWorkspace range_workspace(const ExpertWorkspace& w, const RowRange& r) {
  const int64_t a = r.first_row, z = r.first_row + r.rows;
  return {w.a.slice(0, a, z), w.da.slice(0, a, z), w.dh.slice(0, a, z)};
}

void experts_rows_forward(DispatchBuffers& b, MoeLayerCache& c, const RowRange& r, const ExpertWeights& w,
                          const MoeLayerDims& d, const MoeConfig& cfg, const ops::Context& ctx) {
  const int64_t a = r.first_row, z = r.first_row + r.rows;
  Tensor xin = b.permuted_x.slice(0, a, z), pin = b.permuted_probs.slice(0, a, z), out = b.expert_out.slice(0, a, z);
  const Tensor tpe = b.plan.tokens_per_expert.slice(0, r.first_expert, r.first_expert + r.experts);
  ExpertCache cache = range_cache(c.experts, r);
  ExpertWorkspace ws = range_workspace(c.expert_ws, r);
  const ExpertDims ed = range_dims(d, cfg, r);
  if (cfg.grouped_gemm)
    experts_forward(out, xin, pin, tpe, w, cache, ws, ed, ctx);
  else
    experts_forward_sequential(out, xin, pin, tpe, w, cache, ws, ed, ctx);
}

void experts_rows_backward(ExpertGrads& g, DispatchBuffers& b, MoeLayerCache& c, const RowRange& r,
                           const ExpertWeights& w, const MoeLayerDims& d, const MoeConfig& cfg,
                           const ops::Context& ctx) {
  const int64_t a = r.first_row, z = r.first_row + r.rows;
  Tensor dout = b.dpermuted.slice(0, a, z), din = b.dexpert_in.slice(0, a, z), dpin = b.dpermuted_probs.slice(0, a, z);
  const Tensor xin = b.permuted_x.slice(0, a, z), pin = b.permuted_probs.slice(0, a, z);
  const Tensor tpe = b.plan.tokens_per_expert.slice(0, r.first_expert, r.first_expert + r.experts);
  const ExpertCache cache = range_cache(c.experts, r);
  ExpertWorkspace ws = range_workspace(c.expert_ws, r);
  const ExpertDims ed = range_dims(d, cfg, r);
  if (cfg.grouped_gemm)
    experts_backward(din, dpin, g, dout, xin, pin, tpe, w, cache, ws, ed, ctx);
  else
    experts_backward_sequential(din, dpin, g, dout, xin, pin, tpe, w, cache, ws, ed, ctx);
}
}  // namespace

void moe_layer_forward(Tensor& y, const Tensor& x, const Tensor& padding_mask, const MoeLayerWeights& w,
                       RouterState& st, MoeLayerCache& c, Dispatcher& dispatcher, const MoeLayerDims& d,
                       const MoeConfig& cfg, bool training, const ops::Context& ctx, bool route) {
  if (d.Fs > 0 && (w.experts.fc1_bias.defined() || w.router.bias.defined()))
    MOECORE_FAIL(
        "MoE layer: linear biases (add_bias_linear) are not supported with a shared expert, as in Megatron "
        "(SharedExpertMLP asserts add_bias_linear == False); use --disable-bias-linear or drop "
        "--moe-shared-expert-intermediate-size (",
        d.Fs, ")");
  // route (a recompute keeps the routing it repeats)
  if (route)
    router_forward(c.probs, c.map, c.stats, x, padding_mask, w.router, st, c.router, router_dims(d, cfg), cfg, training,
                   ctx);
  // dispatch (with ECHO: the plan and the rerouting, and the clones' weights on their way to their slots)
  DispatchBuffers& b = c.dispatch;
  const bool echo = d.echo.enabled();
  if (echo) {
    if (route) echo_plan(c.echo, c.stats.tokens_per_expert, c.map, c.probs, d.echo, ctx);
    echo_fetch_clones_start(c.echo, w.experts, d.echo);
  }
  dispatcher.dispatch_prepare(b, x, echo ? c.echo.probs : c.probs, echo ? c.echo.map : c.map, ctx);
  dispatcher.exchange_counts(b, ctx);
  dispatcher.dispatch(b, ctx);
  // experts, over the rows the host knows to bound this step's (no device read); with ECHO the home experts' rows,
  // then (once the clones have arrived) the clone slots' rows with the clones' weights
  const ExpertRows rows = expert_rows(b, c, d, cfg);
  experts_rows_forward(b, c, rows.home, w.experts, d, cfg, ctx);
  if (echo) {
    echo_fetch_clones_wait(c.echo);
    experts_rows_forward(b, c, rows.clones, c.echo.clones, d, cfg, ctx);
  }
  // combine
  dispatcher.combine_prepare(b, ctx);
  dispatcher.combine(b, y, ctx);
  dispatcher.combine_finish(b, y, ctx);
  if (d.Fs > 0) shared_expert_forward(y, x, w.shared, c.shared, shared_expert_dims(d, cfg), ctx);
}

void moe_layer_backward(Tensor& dx, MoeLayerGrads& g, const Tensor& dy, const Tensor& x, const MoeLayerWeights& w,
                        MoeLayerCache& c, Dispatcher& dispatcher, const MoeLayerDims& d, const MoeConfig& cfg,
                        float aux_grad_scale, const ops::Context& ctx) {
  DispatchBuffers& b = c.dispatch;
  // (clones dropped after forward travel again while the combine and the home experts run backward)
  if (d.echo.enabled() && c.echo.recompute_dispatch) echo_fetch_clones_start(c.echo, w.experts, d.echo);
  // combine, in reverse
  dispatcher.combine_backward(b, dy, ctx);
  // experts, in reverse (with ECHO the clones' gradients then go home)
  const ExpertRows rows = expert_rows(b, c, d, cfg);
  experts_rows_backward(g.experts, b, c, rows.home, w.experts, d, cfg, ctx);
  if (d.echo.enabled()) {
    echo_fetch_clones_wait(c.echo);  // (nothing in flight without recompute_dispatch)
    ExpertGrads& cg = c.echo.clone_grads;
    for (Tensor* t : {&cg.fc1, &cg.fc2, &cg.fc1_bias, &cg.fc2_bias})
      if (t->defined()) t->zero_();
    experts_rows_backward(cg, b, c, rows.clones, c.echo.clones, d, cfg, ctx);
    echo_reduce_clone_grads(g.experts, c.echo, d.echo, ctx);
  }
  // dispatch, in reverse: dx gets the experts' input gradient, dprobs the routing-weight gradient (with ECHO over the
  // clone columns, folded back onto the home experts)
  dx.zero_();
  if (d.echo.enabled()) {
    dispatcher.dispatch_backward(b, dx, c.echo.dprobs, ctx);
    ops::moe_echo_fold(c.dprobs, c.echo.dprobs, c.echo.slot_expert, c.echo.Sl, ctx);
  } else {
    dispatcher.dispatch_backward(b, dx, c.dprobs, ctx);
  }
  // route, in reverse
  router_backward(dx, g.router, g.router_bias, c.dprobs, x, w.router, c.router, router_dims(d, cfg), cfg,
                  aux_grad_scale, ctx);
  if (d.Fs > 0) shared_expert_backward(dx, g.shared, dy, x, w.shared, c.shared, shared_expert_dims(d, cfg), ctx);
}

}  // namespace moecore::moe
