// Token permutation (expert-major, ascending token) and its inverse, and the single-process LocalDispatcher.
// The passes themselves are ops (kernels/ops.h, "MoE token permutation"); this file sizes the buffers and
// orders the stages. Counts and indices stay in the plan's device tensors.
// Not here: routing (router.h), expert compute (experts.h), communication (the EP dispatchers).
#include "moecore/moe/dispatcher.h"

#include <algorithm>

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

DispatchBuffers dispatch_buffers_alloc_ep(DispatcherKind kind, int64_t T, int64_t H, int64_t E, int64_t ep, int64_t etp,
                                          int64_t max_send, int64_t max_rows, DType x_dtype, Device device) {
  if (kind == DispatcherKind::local || (ep == 1 && etp == 1))
    return dispatch_buffers_alloc(T, H, E, max_rows, x_dtype, device);
  if (ep <= 0 || E % ep != 0)
    MOECORE_FAIL("dispatch buffers: the number of experts (", E, ") must be divisible by the expert-parallel size (",
                 ep, ")");
  if (etp <= 0) MOECORE_FAIL("dispatch buffers: the expert-tensor-parallel size (", etp, ") must be positive");
  const int64_t El = E / ep;
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  // The expert side: El local experts; the token side of the plan depends on the kind.
  const int64_t gathered = ep * etp * T;  // allgather: the tokens of the whole ETP x EP group
  const int64_t plan_tokens = kind == DispatcherKind::allgather ? gathered : 0;
  DispatchBuffers b = dispatch_buffers_alloc(plan_tokens, H, El, max_rows, x_dtype, device);
  EpBuffers& p = b.ep;
  p.ep = ep;
  p.etp = etp;
  p.local_experts = El;
  if (kind == DispatcherKind::alltoall) {
    b.plan.row_token = Tensor();  // the expert side needs only the counts
    b.plan.token_rows = Tensor();
    p.send_plan = dispatch_plan_alloc(T, E, max_send, device);
    p.chunk_counts = Tensor::zeros({etp * E}, DType::i64, act, device);
    if (etp > 1) p.ep_counts = Tensor::zeros({E}, DType::i64, act, device);
    p.send_counts_host.assign(static_cast<size_t>(E), 0);
    p.chunk_counts_host.assign(static_cast<size_t>(etp * E), 0);
    p.send_rows.assign(static_cast<size_t>(ep), 0);
    p.recv_rows.assign(static_cast<size_t>(ep), 0);
    p.etp_rows.assign(static_cast<size_t>(etp), 0);
    p.el_blocks.assign(static_cast<size_t>(ep), El);
    p.send_x = Tensor::empty({max_send, H}, x_dtype, work, device);
    p.send_f = Tensor::empty({max_send, H}, DType::f32, work, device);
    p.send_p = Tensor::empty({max_send}, DType::f32, work, device);
    p.stage_x = Tensor::empty({max_rows, H}, x_dtype, work, device);
    p.stage_f = Tensor::empty({max_rows, H}, DType::f32, work, device);
    p.stage_p = Tensor::empty({max_rows}, DType::f32, work, device);
    if (etp > 1) {  // the rows from the EP sources only: a 1/ETP share of the bound
      const int64_t max_own = (max_rows + etp - 1) / etp;
      p.own_x = Tensor::empty({max_own, H}, x_dtype, work, device);
      p.own_f = Tensor::empty({max_own, H}, DType::f32, work, device);
      p.own_p = Tensor::empty({max_own}, DType::f32, work, device);
    }
  } else {
    p.gmap = Tensor::empty({gathered, E}, DType::boolean, act, device);
    p.lmap = Tensor::empty({gathered, El}, DType::boolean, act, device);
    p.lprobs = Tensor::empty({gathered, El}, DType::f32, act, device);
    p.gx = Tensor::empty({gathered, H}, x_dtype, work, device);
    p.gprobs = Tensor::empty({gathered, E}, DType::f32, work, device);
    p.gy = Tensor::empty({gathered, H}, DType::f32, work, device);
    p.gdprobs = Tensor::empty({gathered, E}, DType::f32, work, device);
    p.ty = Tensor::empty({T, H}, DType::f32, work, device);
  }
  return b;
}

std::vector<Tensor*> dispatch_scratch_tensors(DispatchBuffers& b) {
  EpBuffers& p = b.ep;
  return {&b.expert_out, &b.dpermuted, &b.dexpert_in, &b.dpermuted_probs, &p.send_x, &p.send_f, &p.send_p, &p.stage_x,
          &p.stage_f,    &p.stage_p,   &p.own_x,      &p.own_f,           &p.own_p,  &p.gx,     &p.gprobs, &p.gy,
          &p.gdprobs,    &p.ty};
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
  dispatch_plan_build(buf.plan, map, ctx);
  permute_tokens(buf.permuted_x, buf.permuted_probs, x, probs, buf.plan, ctx);
}

// With one process the rows never leave: the unpermute-sum (the all-to-all dispatcher's last local step)
// writes the output directly.
void LocalDispatcher::combine_prepare(DispatchBuffers&, const ops::Context&) {}

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
