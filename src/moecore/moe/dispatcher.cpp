// Token permutation (expert-major, ascending token) and its inverse, and the single-process LocalDispatcher.
// The passes themselves are ops (kernels/ops.h, "MoE token permutation"); this file sizes the buffers and
// orders the stages. Counts and indices stay in the plan's device tensors.
// Not here: routing (router.h), expert compute (experts.h), communication (the EP dispatchers).
#include "moecore/moe/dispatcher.h"

#include <algorithm>
#include <type_traits>

namespace moecore::moe {
namespace {

void check_plan(const char* op, const DispatchPlan& plan) {
  if (!plan.expert_offset.defined() || plan.expert_offset.numel() != plan.E + 1 || !plan.row_token.defined() ||
      !plan.token_rows.defined())
    MOECORE_FAIL(op, ": the dispatch plan is not built (call dispatch_plan_build first)");
}

}  // namespace

DispatchPlan dispatch_plan_alloc(int64_t T, int64_t E, int64_t max_rows, Device device) {
  const auto act = MemCategory::activations;
  DispatchPlan plan;
  plan.T = T;
  plan.E = E;
  plan.tokens_per_expert = Tensor::zeros({E}, DType::i64, act, device);
  plan.expert_offset = Tensor::zeros({E + 1}, DType::i64, act, device);
  plan.row_token = Tensor::empty({max_rows}, DType::i32, act, device);
  plan.token_rows = Tensor::empty({T, E}, DType::i32, act, device);
  plan.row_bound = max_rows;
  return plan;
}

int64_t dispatch_max_rows(int64_t T, int64_t E, int64_t K, int64_t capacity, bool pad_to_capacity, int64_t alignment) {
  if (T < 0 || E <= 0 || K <= 0 || K > E)
    MOECORE_FAIL("dispatch_max_rows: need T >= 0 and 0 < K <= E, got T ", T, ", E ", E, ", K ", K);
  // A token meets an expert at most once, so no expert holds more than T rows.
  int64_t rows = T * K;
  if (capacity > 0) {
    const int64_t per_expert = std::min(capacity, T);
    rows = pad_to_capacity ? E * per_expert : std::min(rows, E * per_expert);
  }
  if (alignment > 1) rows += E * (alignment - 1);
  return rows;
}

DispatchBuffers dispatch_buffers_alloc(int64_t T, int64_t H, int64_t E, int64_t max_rows, DType x_dtype,
                                       Device device) {
  if (x_dtype != DType::f32 && x_dtype != DType::bf16 && x_dtype != DType::f16)
    MOECORE_FAIL("dispatch_buffers_alloc: x dtype must be f32, bf16 or f16, got ", dtype_name(x_dtype));
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  DispatchBuffers b;
  b.plan = dispatch_plan_alloc(T, E, max_rows, device);
  b.permuted_x = Tensor::empty({max_rows, H}, x_dtype, act, device);
  b.permuted_probs = Tensor::empty({max_rows}, DType::f32, act, device);
  b.expert_out = Tensor::empty({max_rows, H}, x_dtype, work, device);  // forward scratch, not kept for backward
  b.dpermuted = Tensor::empty({max_rows, H}, x_dtype, work, device);
  b.dexpert_in = Tensor::empty({max_rows, H}, DType::f32, work, device);
  b.dpermuted_probs = Tensor::empty({max_rows}, DType::f32, work, device);
  return b;
}

DispatcherKind parse_dispatcher_kind(const std::string& s) {
  if (s == "alltoall") return DispatcherKind::alltoall;
  if (s == "allgather") return DispatcherKind::allgather;
  if (s == "flex")
    MOECORE_FAIL(
        "--moe-token-dispatcher-type flex is not supported yet: Megatron's flex dispatcher (DeepEP, HybridEP); "
        "use alltoall");
  MOECORE_FAIL("--moe-token-dispatcher-type: '", s, "' is not supported (use alltoall or allgather)");
}

const char* dispatcher_kind_name(DispatcherKind k) {
  switch (k) {
    case DispatcherKind::local:
      return "local";
    case DispatcherKind::alltoall:
      return "alltoall";
    case DispatcherKind::allgather:
      return "allgather";
  }
  return "?";
}

int64_t dispatch_max_rows_ep(int64_t T, int64_t E, int64_t K, int64_t capacity, bool pad_to_capacity, int64_t alignment,
                             int64_t ep, int64_t etp) {
  if (ep <= 0 || E % ep != 0)
    MOECORE_FAIL("dispatch_max_rows_ep: the number of experts (", E,
                 ") must be divisible by the expert-parallel size (", ep, ")");
  if (etp <= 0) MOECORE_FAIL("dispatch_max_rows_ep: the expert-tensor-parallel size (", etp, ") must be positive");
  if (ep == 1 && etp == 1) return dispatch_max_rows(T, E, K, capacity, pad_to_capacity, alignment);
  if (alignment > 1)
    MOECORE_FAIL("dispatch_max_rows_ep: router padding (alignment ", alignment,
                 ") is not supported with expert parallelism yet");
  const int64_t El = E / ep;
  // Rows one source rank sends to one destination: a token meets each of the El experts at most once.
  int64_t per_source = dispatch_max_rows(T, E, K, 0, false, 0);
  per_source = std::min(per_source, T * std::min(K, El));
  if (capacity > 0) {
    const int64_t per_expert = std::min(capacity, T);
    per_source = pad_to_capacity ? El * per_expert : std::min(per_source, El * per_expert);
  }
  return ep * etp * per_source;
}

DispatchBuffers dispatch_buffers_alloc_ep(DispatcherKind kind, const DispatchDims& d) {
  if (kind == DispatcherKind::local || (d.ep == 1 && d.etp == 1))
    return dispatch_buffers_alloc(d.T, d.H, d.E, d.max_rows, d.x_dtype, d.device);
  if (d.ep <= 0 || d.E % d.ep != 0)
    MOECORE_FAIL("dispatch buffers: the number of experts (", d.E, ") must be divisible by the expert-parallel size (",
                 d.ep, ")");
  if (d.etp <= 0) MOECORE_FAIL("dispatch buffers: the expert-tensor-parallel size (", d.etp, ") must be positive");
  // The expert side: El local experts; the token side of the plan depends on the kind (all-gather: the tokens of the
  // whole ETP x EP group; all-to-all: none, the expert side needs only the counts).
  const int64_t El = d.E / d.ep;
  const int64_t plan_tokens = kind == DispatcherKind::allgather ? d.ep * d.etp * d.T : 0;
  DispatchBuffers b = dispatch_buffers_alloc(plan_tokens, d.H, El, d.max_rows, d.x_dtype, d.device);
  if (kind == DispatcherKind::alltoall) {
    b.plan.row_token = Tensor();
    b.plan.token_rows = Tensor();
    b.state = AllToAllDispatcher::alloc_state(d);
  } else {
    b.state = AllGatherDispatcher::alloc_state(d);
  }
  return b;
}

AllToAllState AllToAllDispatcher::alloc_state(const DispatchDims& d) {
  const int64_t P = d.ep, Q = d.etp, E = d.E, El = E / P, H = d.H;
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  AllToAllState s;
  s.ep = P;
  s.etp = Q;
  s.local_experts = El;
  s.send_plan = dispatch_plan_alloc(d.T, E, d.max_send, d.device);
  s.chunk_counts = Tensor::zeros({Q * E}, DType::i64, act, d.device);
  if (Q > 1) s.ep_counts = Tensor::zeros({E}, DType::i64, act, d.device);
  s.send_counts_host.assign(static_cast<size_t>(E), 0);
  s.chunk_counts_host.assign(static_cast<size_t>(Q * E), 0);
  s.send_rows.assign(static_cast<size_t>(P), 0);
  s.recv_rows.assign(static_cast<size_t>(P), 0);
  s.etp_rows.assign(static_cast<size_t>(Q), 0);
  s.el_blocks.assign(static_cast<size_t>(P), El);
  AllToAllScratch& w = s.scratch;
  w.send_x = Tensor::empty({d.max_send, H}, d.x_dtype, work, d.device);
  w.send_f = Tensor::empty({d.max_send, H}, DType::f32, work, d.device);
  w.send_p = Tensor::empty({d.max_send}, DType::f32, work, d.device);
  w.stage_x = Tensor::empty({d.max_rows, H}, d.x_dtype, work, d.device);
  w.stage_f = Tensor::empty({d.max_rows, H}, DType::f32, work, d.device);
  w.stage_p = Tensor::empty({d.max_rows}, DType::f32, work, d.device);
  if (Q > 1) {  // the rows from the EP sources only: a 1/ETP share of the bound
    const int64_t max_own = (d.max_rows + Q - 1) / Q;
    w.own_x = Tensor::empty({max_own, H}, d.x_dtype, work, d.device);
    w.own_f = Tensor::empty({max_own, H}, DType::f32, work, d.device);
    w.own_p = Tensor::empty({max_own}, DType::f32, work, d.device);
  }
  return s;
}

AllGatherState AllGatherDispatcher::alloc_state(const DispatchDims& d) {
  const int64_t El = d.E / d.ep, gathered = d.ep * d.etp * d.T, E = d.E, H = d.H;
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  AllGatherState s;
  s.ep = d.ep;
  s.etp = d.etp;
  s.local_experts = El;
  s.gmap = Tensor::empty({gathered, E}, DType::boolean, act, d.device);
  s.lmap = Tensor::empty({gathered, El}, DType::boolean, act, d.device);
  s.lprobs = Tensor::empty({gathered, El}, DType::f32, act, d.device);
  AllGatherScratch& w = s.scratch;
  w.gx = Tensor::empty({gathered, H}, d.x_dtype, work, d.device);
  w.gprobs = Tensor::empty({gathered, E}, DType::f32, work, d.device);
  w.gy = Tensor::empty({gathered, H}, DType::f32, work, d.device);
  w.gdprobs = Tensor::empty({gathered, E}, DType::f32, work, d.device);
  w.ty = Tensor::empty({d.T, H}, DType::f32, work, d.device);
  return s;
}

namespace {
// The scratch of buffers b (DispatchBuffers, const or not) as pointers to its tensors, in one order per kind.
template <class Buffers>
auto scratch_of(Buffers& b) {
  using T = std::conditional_t<std::is_const_v<Buffers>, const Tensor, Tensor>;
  std::vector<T*> v = {&b.expert_out, &b.dpermuted, &b.dexpert_in, &b.dpermuted_probs};
  if (auto* s = std::get_if<AllToAllState>(&b.state)) {
    auto& w = s->scratch;
    for (T* t : {&w.send_x, &w.send_f, &w.send_p, &w.stage_x, &w.stage_f, &w.stage_p, &w.own_x, &w.own_f, &w.own_p})
      v.push_back(t);
  } else if (auto* g = std::get_if<AllGatherState>(&b.state)) {
    auto& w = g->scratch;
    for (T* t : {&w.gx, &w.gprobs, &w.gy, &w.gdprobs, &w.ty}) v.push_back(t);
  }
  return v;
}
}  // namespace

std::vector<Tensor*> dispatch_scratch_tensors(DispatchBuffers& b) {
  return scratch_of(b);
}
std::vector<const Tensor*> dispatch_scratch_tensors(const DispatchBuffers& b) {
  return scratch_of(b);
}

std::vector<const Tensor*> dispatch_refilled_tensors(const DispatchBuffers& b) {
  const DispatchPlan& p = b.plan;
  std::vector<const Tensor*> v = {&p.tokens_per_expert, &p.expert_offset, &p.row_token,
                                  &p.token_rows,        &b.permuted_x,    &b.permuted_probs};
  if (const auto* s = std::get_if<AllToAllState>(&b.state)) {
    const DispatchPlan& sp = s->send_plan;
    for (const Tensor* t :
         {&sp.tokens_per_expert, &sp.expert_offset, &sp.row_token, &sp.token_rows, &s->chunk_counts, &s->ep_counts})
      v.push_back(t);
  } else if (const auto* g = std::get_if<AllGatherState>(&b.state)) {
    for (const Tensor* t : {&g->gmap, &g->lmap, &g->lprobs}) v.push_back(t);
  }
  return v;
}

bool dispatch_overflowed(const DispatchBuffers& b) {
  const auto* s = std::get_if<AllToAllState>(&b.state);
  return s && s->overflow;
}

void dispatch_plan_build(DispatchPlan& plan, const Tensor& map, const ops::Context& ctx) {
  if (map.dtype() != DType::boolean || map.dim() != 2 || !map.is_contiguous())
    MOECORE_FAIL("dispatch_plan_build: map must be a contiguous [T, E] bool tensor, got ", map.str());
  const int64_t T = map.size(0), E = map.size(1);
  if (!plan.row_token.defined() || plan.T != T || plan.E != E)
    MOECORE_FAIL("dispatch_plan_build: the plan was allocated for T = ", plan.T, ", E = ", plan.E, " but the map is ",
                 map.str(), " (allocate the buffers with dispatch_buffers_alloc)");
  ops::moe_plan(plan.tokens_per_expert, plan.expert_offset, plan.token_rows, plan.row_token, map, ctx);
  plan.row_bound = plan.row_token.numel();
}

void permute_tokens(Tensor& permuted_x, Tensor& permuted_probs, const Tensor& x, const Tensor& probs,
                    const DispatchPlan& plan, const ops::Context& ctx) {
  check_plan("permute_tokens", plan);
  ops::moe_permute(permuted_x, permuted_probs, x, probs, plan.row_token, plan.expert_offset, ctx);
}

void unpermute_tokens(Tensor& y, const Tensor& rows, const DispatchPlan& plan, bool accumulate,
                      const ops::Context& ctx) {
  check_plan("unpermute_tokens", plan);
  ops::moe_unpermute(y, rows, plan.token_rows, accumulate, ctx);
}

void gather_token_rows(Tensor& rows, const Tensor& src, const DispatchPlan& plan, const ops::Context& ctx) {
  check_plan("gather_token_rows", plan);
  if (src.dtype() != DType::f32) MOECORE_FAIL("gather_token_rows: src must be f32, got ", src.str());
  Tensor none;
  ops::moe_permute(rows, none, src, none, plan.row_token, plan.expert_offset, ctx);
}

void unpermute_backward(Tensor& dx, Tensor& dprobs, const Tensor& drows, const Tensor& dprob_rows,
                        const DispatchPlan& plan, const ops::Context& ctx) {
  check_plan("unpermute_backward", plan);
  ops::moe_unpermute(dx, drows, plan.token_rows, true, ctx);
  ops::moe_unpermute_probs(dprobs, dprob_rows, plan.token_rows, ctx);
}

// ---- LocalDispatcher ----------------------------------------------------------------------------------

void LocalDispatcher::dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                                       const ops::Context& ctx) {
  if (!std::holds_alternative<LocalState>(buf.state))
    MOECORE_FAIL(
        "local dispatcher: the buffers were allocated for an expert-parallel dispatcher (allocate them with "
        "dispatch_buffers_alloc, or run the dispatcher they were sized for)");
  dispatch_plan_build(buf.plan, map, ctx);
  permute_tokens(buf.permuted_x, buf.permuted_probs, x, probs, buf.plan, ctx);
}

// With one process the rows never leave: the unpermute-sum (the all-to-all dispatcher's last local step)
// writes the output directly.
void LocalDispatcher::combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) {
  unpermute_tokens(y, buf.expert_out, buf.plan, false, ctx);
}

void LocalDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  gather_token_rows(buf.dpermuted, dy, buf.plan, ctx);
}

void LocalDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  unpermute_backward(dx, dprobs, buf.dexpert_in, buf.dpermuted_probs, buf.plan, ctx);
}

}  // namespace moecore::moe
