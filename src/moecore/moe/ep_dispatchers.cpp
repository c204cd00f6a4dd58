// The expert-parallel dispatchers (docs/megatron-moe-spec.md §6.1, §6.2): AllToAllDispatcher and AllGatherDispatcher
// over the EP group, with expert tensor parallelism (dispatcher.h), each on its own state (AllToAllState,
// AllGatherState). Local steps are ops (the permutation building blocks of dispatcher.cpp and the chunk sort);
// communication goes through parallel/comm.h (deterministic: data movement is exact and the all-gather dispatcher's
// reduce-scatter sums in group-rank order). Not here: routing (the router runs on each rank's own tokens, capacity
// included, before dispatch), buffer allocation (dispatcher.cpp).
#include <algorithm>
#include <chrono>

#include "moecore/moe/dispatcher.h"

namespace moecore::moe {
namespace {

// The state of buffers allocated for dispatcher `who` (State), checked against the layout the dispatcher runs.
template <class State>
State& state_for(const char* who, DispatchBuffers& buf, const ProcessGroup& g, int64_t group_size, int64_t etp) {
  State* s = std::get_if<State>(&buf.state);
  if (!s)
    MOECORE_FAIL(who,
                 ": the buffers were allocated for another dispatcher (allocate them with "
                 "dispatch_buffers_alloc_ep for this dispatcher's kind and layout)");
  if (s->ep * s->etp != group_size || s->etp != etp)
    MOECORE_FAIL(who, ": the buffers were sized for EP ", s->ep, " x ETP ", s->etp, ", but the group '", g.name(),
                 "' has ", g.size(), " ranks at ETP ", etp,
                 " (allocate them with dispatch_buffers_alloc_ep for this layout)");
  return *s;
}

void check_experts(const char* who, const Tensor& map, int64_t ep, int64_t local_experts) {
  if (local_experts * ep != map.size(1))
    MOECORE_FAIL(who, ": the buffers were sized for EP ", ep, " with ", local_experts,
                 " local experts, but the map has ", map.size(1),
                 " experts (allocate them with dispatch_buffers_alloc_ep for this layout)");
}

// Sizes this step's all-to-all-v on the host: send_rows[j] = rows to EP rank j (its El experts' counts),
// recv_rows[s] = rows from EP rank s, and etp_rows[k] = rows ETP rank k received (its block of the gathered rows).
// The counts come to the host here, the layer's one synchronisation.
void size_exchange(AllToAllState& p, int etp_rank) {
  const int64_t P = p.ep, El = p.local_experts, Q = p.etp;
  p.send_plan.tokens_per_expert.copy_to_host(p.send_counts_host.data(), P * El);
  p.chunk_counts.copy_to_host(p.chunk_counts_host.data(), Q * P * El);
  const int64_t* sent = p.send_counts_host.data();
  const int64_t* recv = p.chunk_counts_host.data();
  for (int64_t j = 0; j < P; ++j) {
    p.send_rows[j] = 0;
    for (int64_t le = 0; le < El; ++le) p.send_rows[j] += sent[j * El + le];
  }
  for (int64_t k = 0; k < Q; ++k) {
    p.etp_rows[k] = 0;
    for (int64_t s = 0; s < P; ++s) {
      int64_t n = 0;
      for (int64_t le = 0; le < El; ++le) n += recv[(k * P + s) * El + le];
      if (k == etp_rank) p.recv_rows[s] = n;
      p.etp_rows[k] += n;
    }
  }
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t n = 0;
  for (int64_t x : v) n += x;
  return n;
}

// Adds the wall time of its scope to a dispatcher's communication counter.
class CommTimer {
 public:
  explicit CommTimer(double& acc) : acc_(acc), t0_(std::chrono::steady_clock::now()) {}
  ~CommTimer() { acc_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }
  CommTimer(const CommTimer&) = delete;
  CommTimer& operator=(const CommTimer&) = delete;

 private:
  double& acc_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

// ---- AllToAllDispatcher -------------------------------------------------------------------------------

AllToAllState& AllToAllDispatcher::state_of(DispatchBuffers& buf) const {
  return state_for<AllToAllState>("alltoall dispatcher", buf, ep_, int64_t{ep_.size()} * etp_.size(), etp_.size());
}

void AllToAllDispatcher::rows_in(AllToAllState& p, const Tensor& stage, const Tensor& own, const Tensor& send) {
  const int64_t Rs = p.send_plan.row_bound, Rown = sum(p.recv_rows), Rr = sum(p.etp_rows);
  CommTimer timer(comm_seconds_);
  if (p.etp == 1) {
    all_to_all_v(stage.slice(0, 0, Rr), p.recv_rows, send.slice(0, 0, Rs), p.send_rows, ep_);
    return;
  }
  all_to_all_v(own.slice(0, 0, Rown), p.recv_rows, send.slice(0, 0, Rs), p.send_rows, ep_);
  all_gather_v(stage.slice(0, 0, Rr), own.slice(0, 0, Rown), p.etp_rows, etp_);
}

void AllToAllDispatcher::rows_out(AllToAllState& p, const Tensor& send, const Tensor& own, const Tensor& stage) {
  const int64_t Rs = p.send_plan.row_bound, Rown = sum(p.recv_rows), Rr = sum(p.etp_rows);
  CommTimer timer(comm_seconds_);
  if (p.etp == 1) {
    all_to_all_v(send.slice(0, 0, Rs), p.send_rows, stage.slice(0, 0, Rr), p.recv_rows, ep_);
    return;
  }
  reduce_scatter_v_sum(own.slice(0, 0, Rown), stage.slice(0, 0, Rr), p.etp_rows, etp_);
  all_to_all_v(send.slice(0, 0, Rs), p.send_rows, own.slice(0, 0, Rown), p.recv_rows, ep_);
}

void AllToAllDispatcher::dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                                          const ops::Context& ctx) {
  AllToAllState& p = state_of(buf);
  check_experts("alltoall dispatcher", map, p.ep, p.local_experts);
  // Permutation 1: this rank's tokens, expert-major over all E experts (hence grouped by destination rank).
  dispatch_plan_build(p.send_plan, map, ctx);
  permute_tokens(p.scratch.send_x, p.scratch.send_p, x, probs, p.send_plan, ctx);
}

void AllToAllDispatcher::exchange_counts(DispatchBuffers& buf, const ops::Context& ctx) {
  AllToAllState& p = state_of(buf);
  // Rank j receives my counts for its experts, [s][le] = rows from s for le; with ETP > 1 every ETP rank's counts are
  // gathered after it: chunk_counts [k][s][le].
  {
    CommTimer timer(comm_seconds_);
    const Tensor& mine = p.etp > 1 ? p.ep_counts : p.chunk_counts;
    all_to_all_v(mine, p.el_blocks, p.send_plan.tokens_per_expert, p.el_blocks, ep_);
    if (p.etp > 1) all_gather(p.chunk_counts, p.ep_counts, etp_);
  }
  ops::moe_chunk_counts(buf.plan.tokens_per_expert, buf.plan.expert_offset, p.chunk_counts, p.etp * p.ep, ctx);
  size_exchange(p, etp_.rank());
  p.send_plan.row_bound = sum(p.send_rows);
  buf.plan.row_bound = sum(p.etp_rows);
  if (buf.plan.row_bound > p.scratch.stage_x.size(0) || (p.etp > 1 && sum(p.recv_rows) > p.scratch.own_x.size(0)))
    MOECORE_FAIL("alltoall dispatcher: rank ", ep_.rank(), " of group '", ep_.name(), "' receives ", buf.plan.row_bound,
                 " rows but its buffers hold ", p.scratch.stage_x.size(0));
  // Over the static received-token capacity: every received row is dropped (no expert rows), the exchanges unchanged.
  p.overflow = buf.plan.row_bound > buf.permuted_x.size(0);
  if (p.overflow) {
    buf.plan.tokens_per_expert.zero_();
    buf.plan.expert_offset.zero_();
    std::fill(p.chunk_counts_host.begin(), p.chunk_counts_host.end(), int64_t{0});
  }
}

void AllToAllDispatcher::dispatch(DispatchBuffers& buf, const ops::Context& ctx) {
  AllToAllState& p = state_of(buf);
  AllToAllScratch& w = p.scratch;
  rows_in(p, w.stage_x, w.own_x, w.send_x);
  rows_in(p, w.stage_p, w.own_p, w.send_p);
  if (p.overflow) {
    buf.plan.row_bound = 0;  // (after the exchange, which used it)
    return;
  }
  // Permutation 2: [source][local expert] -> [local expert][source] (sources: ETP rank, then EP rank).
  const int64_t sources = p.etp * p.ep, El = p.local_experts;
  ops::moe_sort_chunks(buf.permuted_x, w.stage_x, p.chunk_counts, sources, El, false, ctx);
  ops::moe_sort_chunks(buf.permuted_probs, w.stage_p, p.chunk_counts, sources, El, false, ctx);
}

void AllToAllDispatcher::combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) {
  AllToAllState& p = state_of(buf);
  if (p.overflow) return p.scratch.stage_x.slice(0, 0, sum(p.etp_rows)).zero_();
  ops::moe_sort_chunks(p.scratch.stage_x, buf.expert_out, p.chunk_counts, p.etp * p.ep, p.local_experts, true, ctx);
}

void AllToAllDispatcher::combine(DispatchBuffers& buf, Tensor&, const ops::Context&) {
  AllToAllState& p = state_of(buf);
  AllToAllScratch& w = p.scratch;
  if (p.etp == 1 || w.stage_x.dtype() == DType::f32) {
    rows_out(p, w.send_x, w.own_x, w.stage_x);
    return;
  }
  // The ETP slices' partial outputs are summed in f32, then sent back in the dtype of x.
  const int64_t Rr = sum(p.etp_rows), Rown = sum(p.recv_rows), Rs = p.send_plan.row_bound;
  w.stage_f.slice(0, 0, Rr).copy_from(w.stage_x.slice(0, 0, Rr));
  {
    CommTimer timer(comm_seconds_);
    reduce_scatter_v_sum(w.own_f.slice(0, 0, Rown), w.stage_f.slice(0, 0, Rr), p.etp_rows, etp_);
  }
  w.own_x.slice(0, 0, Rown).copy_from(w.own_f.slice(0, 0, Rown));
  CommTimer timer(comm_seconds_);
  all_to_all_v(w.send_x.slice(0, 0, Rs), p.send_rows, w.own_x.slice(0, 0, Rown), p.recv_rows, ep_);
}

void AllToAllDispatcher::combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) {
  AllToAllState& p = state_of(buf);
  unpermute_tokens(y, p.scratch.send_x, p.send_plan, false, ctx);
}

void AllToAllDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  AllToAllState& p = state_of(buf);
  AllToAllScratch& w = p.scratch;
  gather_token_rows(w.send_x, dy, p.send_plan, ctx);
  rows_in(p, w.stage_x, w.own_x, w.send_x);
  if (!p.overflow)
    ops::moe_sort_chunks(buf.dpermuted, w.stage_x, p.chunk_counts, p.etp * p.ep, p.local_experts, false, ctx);
}

void AllToAllDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  AllToAllState& p = state_of(buf);
  AllToAllScratch& w = p.scratch;
  const int64_t sources = p.etp * p.ep, El = p.local_experts;
  if (p.overflow) {
    const int64_t Rr = sum(p.etp_rows);
    w.stage_f.slice(0, 0, Rr).zero_();
    w.stage_p.slice(0, 0, Rr).zero_();
  } else {
    ops::moe_sort_chunks(w.stage_f, buf.dexpert_in, p.chunk_counts, sources, El, true, ctx);
    ops::moe_sort_chunks(w.stage_p, buf.dpermuted_probs, p.chunk_counts, sources, El, true, ctx);
  }
  rows_out(p, w.send_f, w.own_f, w.stage_f);
  rows_out(p, w.send_p, w.own_p, w.stage_p);
  unpermute_backward(dx, dprobs, w.send_f, w.send_p, p.send_plan, ctx);
}

// ---- AllGatherDispatcher ------------------------------------------------------------------------------

AllGatherState& AllGatherDispatcher::state_of(DispatchBuffers& buf) const {
  return state_for<AllGatherState>("allgather dispatcher", buf, ep_, ep_.size(), etp_);
}

// Megatron's all-gather dispatch_preprocess has nothing to do but hold the inputs for the gather.
void AllGatherDispatcher::dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs,
                                           const Tensor& map, const ops::Context&) {
  AllGatherState& p = state_of(buf);
  check_experts("allgather dispatcher", map, p.ep, p.local_experts);
  p.in_x = x;
  p.in_probs = probs;
  p.in_map = map;
}

void AllGatherDispatcher::dispatch(DispatchBuffers& buf, const ops::Context& ctx) {
  AllGatherState& p = state_of(buf);
  AllGatherScratch& w = p.scratch;
  {
    CommTimer timer(comm_seconds_);
    all_gather(w.gx, p.in_x, ep_);
    all_gather(w.gprobs, p.in_probs, ep_);
    all_gather(p.gmap, p.in_map, ep_);
  }
  // Keep this rank's expert columns, then permute the gathered tokens among the local experts.
  const int64_t El = p.local_experts, first = first_local_expert(p);
  p.lmap.copy_from(p.gmap.slice(1, first, first + El));
  p.lprobs.copy_from(w.gprobs.slice(1, first, first + El));
  dispatch_plan_build(buf.plan, p.lmap, ctx);
  permute_tokens(buf.permuted_x, buf.permuted_probs, w.gx, p.lprobs, buf.plan, ctx);
}

void AllGatherDispatcher::combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) {
  unpermute_tokens(state_of(buf).scratch.gy, buf.expert_out, buf.plan, false, ctx);
}

void AllGatherDispatcher::combine(DispatchBuffers& buf, Tensor& y, const ops::Context&) {
  AllGatherState& p = state_of(buf);
  CommTimer timer(comm_seconds_);
  reduce_scatter_sum(y, p.scratch.gy, ep_);  // the sum over the EP ranks' experts, in rank order
}

void AllGatherDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  AllGatherState& p = state_of(buf);
  {
    CommTimer timer(comm_seconds_);
    all_gather(p.scratch.gy, dy, ep_);
  }
  gather_token_rows(buf.dpermuted, p.scratch.gy, buf.plan, ctx);
}

void AllGatherDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  AllGatherState& p = state_of(buf);
  AllGatherScratch& w = p.scratch;
  unpermute_tokens(w.gy, buf.dexpert_in, buf.plan, false, ctx);
  {
    CommTimer timer(comm_seconds_);
    reduce_scatter_sum(w.ty, w.gy, ep_);
  }
  ops::add(dx, dx, w.ty, ctx);
  // This rank's expert columns of the gathered probability gradient; the other columns are zero.
  const int64_t El = p.local_experts, first = first_local_expert(p);
  w.gdprobs.zero_();
  Tensor mine = w.gdprobs.slice(1, first, first + El);
  ops::moe_unpermute_probs(mine, buf.dpermuted_probs, buf.plan.token_rows, ctx);
  CommTimer timer(comm_seconds_);
  reduce_scatter_sum(dprobs, w.gdprobs, ep_);  // one non-zero contribution per entry (per ETP slice with ETP > 1)
}

}  // namespace moecore::moe
