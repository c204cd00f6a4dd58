// The expert-parallel dispatchers (spec §6.1, §6.2): AllToAllDispatcher and AllGatherDispatcher over the EP
// group, with expert tensor parallelism (dispatcher.h's EpBuffers). Local steps are ops (the permutation building
// blocks of dispatcher.cpp and the chunk sort); communication goes through parallel/comm.h (deterministic: data
// movement is exact and the all-gather dispatcher's reduce-scatter sums in group-rank order). Not here: routing (the
// router runs on each rank's own tokens, capacity included, before dispatch).
#include <algorithm>
#include <chrono>

#include "moecore/moe/dispatcher.h"

namespace moecore::moe {
namespace {

void check_layout(const char* who, const DispatchBuffers& buf, const ProcessGroup& g, int64_t E, int64_t group_size,
                  int64_t etp) {
  const EpBuffers& p = buf.ep;
  if (p.ep * p.etp != group_size || p.etp != etp || p.local_experts * p.ep != E)
    MOECORE_FAIL(who, ": the buffers were sized for EP ", p.ep, " x ETP ", p.etp, " with ", p.local_experts,
                 " local experts, but the group '", g.name(), "' has ", g.size(), " ranks at ETP ", etp,
                 " and the map ", E, " experts (allocate them with dispatch_buffers_alloc_ep for this layout)");
}

// Sizes this step's all-to-all-v on the host: send_rows[j] = rows to EP rank j (its El experts' counts),
// recv_rows[s] = rows from EP rank s, and etp_rows[k] = rows ETP rank k received (its block of the gathered rows).
// The counts come to the host here, the layer's one synchronisation.
void size_exchange(EpBuffers& p, int etp_rank) {
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

void AllToAllDispatcher::rows_in(EpBuffers& p, const Tensor& stage, const Tensor& own, const Tensor& send) {
  const int64_t Rs = p.send_plan.row_bound, Rown = sum(p.recv_rows), Rr = sum(p.etp_rows);
  CommTimer timer(comm_seconds_);
  if (p.etp == 1) {
    all_to_all_v(stage.slice(0, 0, Rr), p.recv_rows, send.slice(0, 0, Rs), p.send_rows, ep_);
    return;
  }
  all_to_all_v(own.slice(0, 0, Rown), p.recv_rows, send.slice(0, 0, Rs), p.send_rows, ep_);
  all_gather_v(stage.slice(0, 0, Rr), own.slice(0, 0, Rown), p.etp_rows, etp_);
}

void AllToAllDispatcher::rows_out(EpBuffers& p, const Tensor& send, const Tensor& own, const Tensor& stage) {
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
  EpBuffers& p = buf.ep;
  check_layout("alltoall dispatcher", buf, ep_, map.size(1), int64_t{ep_.size()} * etp_.size(), etp_.size());
  // Permutation 1: this rank's tokens, expert-major over all E experts (hence grouped by destination rank).
  dispatch_plan_build(p.send_plan, map, ctx);
  permute_tokens(p.send_x, p.send_p, x, probs, p.send_plan, ctx);
  // Count exchange: rank j receives my counts for its experts, [s][le] = rows from s for le; with ETP > 1 every ETP
  // rank's counts are gathered after it: chunk_counts [k][s][le].
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
  if (buf.plan.row_bound > p.stage_x.size(0) || (p.etp > 1 && sum(p.recv_rows) > p.own_x.size(0)))
    MOECORE_FAIL("alltoall dispatcher: rank ", ep_.rank(), " of group '", ep_.name(), "' receives ", buf.plan.row_bound,
                 " rows but its buffers hold ", p.stage_x.size(0));
  // Over the static received-token capacity: every received row is dropped (no expert rows), the exchanges unchanged.
  p.overflow = buf.plan.row_bound > buf.permuted_x.size(0);
  if (p.overflow) {
    buf.plan.tokens_per_expert.zero_();
    buf.plan.expert_offset.zero_();
    std::fill(p.chunk_counts_host.begin(), p.chunk_counts_host.end(), int64_t{0});
  }
}

void AllToAllDispatcher::dispatch(DispatchBuffers& buf, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  rows_in(p, p.stage_x, p.own_x, p.send_x);
  rows_in(p, p.stage_p, p.own_p, p.send_p);
  if (p.overflow) {
    buf.plan.row_bound = 0;  // (after the exchange, which used it)
    return;
  }
  // Permutation 2: [source][local expert] -> [local expert][source] (sources: ETP rank, then EP rank).
  const int64_t sources = p.etp * p.ep, El = p.local_experts;
  ops::moe_sort_chunks(buf.permuted_x, p.stage_x, p.chunk_counts, sources, El, false, ctx);
  ops::moe_sort_chunks(buf.permuted_probs, p.stage_p, p.chunk_counts, sources, El, false, ctx);
}

void AllToAllDispatcher::combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  if (p.overflow) return p.stage_x.slice(0, 0, sum(p.etp_rows)).zero_();
  ops::moe_sort_chunks(p.stage_x, buf.expert_out, p.chunk_counts, p.etp * p.ep, p.local_experts, true, ctx);
}

void AllToAllDispatcher::combine(DispatchBuffers& buf, const ops::Context&) {
  EpBuffers& p = buf.ep;
  if (p.etp == 1 || p.stage_x.dtype() == DType::f32) {
    rows_out(p, p.send_x, p.own_x, p.stage_x);
    return;
  }
  // The ETP slices' partial outputs are summed in f32, then sent back in the dtype of x.
  const int64_t Rr = sum(p.etp_rows), Rown = sum(p.recv_rows), Rs = p.send_plan.row_bound;
  p.stage_f.slice(0, 0, Rr).copy_from(p.stage_x.slice(0, 0, Rr));
  {
    CommTimer timer(comm_seconds_);
    reduce_scatter_v_sum(p.own_f.slice(0, 0, Rown), p.stage_f.slice(0, 0, Rr), p.etp_rows, etp_);
  }
  p.own_x.slice(0, 0, Rown).copy_from(p.own_f.slice(0, 0, Rown));
  CommTimer timer(comm_seconds_);
  all_to_all_v(p.send_x.slice(0, 0, Rs), p.send_rows, p.own_x.slice(0, 0, Rown), p.recv_rows, ep_);
}

void AllToAllDispatcher::combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) {
  unpermute_tokens(y, buf.ep.send_x, buf.ep.send_plan, false, ctx);
}

void AllToAllDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  gather_token_rows(p.send_x, dy, p.send_plan, ctx);
  rows_in(p, p.stage_x, p.own_x, p.send_x);
  if (!p.overflow)
    ops::moe_sort_chunks(buf.dpermuted, p.stage_x, p.chunk_counts, p.etp * p.ep, p.local_experts, false, ctx);
}

void AllToAllDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  const int64_t sources = p.etp * p.ep, El = p.local_experts;
  if (p.overflow) {
    const int64_t Rr = sum(p.etp_rows);
    p.stage_f.slice(0, 0, Rr).zero_();
    p.stage_p.slice(0, 0, Rr).zero_();
  } else {
    ops::moe_sort_chunks(p.stage_f, buf.dexpert_in, p.chunk_counts, sources, El, true, ctx);
    ops::moe_sort_chunks(p.stage_p, buf.dpermuted_probs, p.chunk_counts, sources, El, true, ctx);
  }
  rows_out(p, p.send_f, p.own_f, p.stage_f);
  rows_out(p, p.send_p, p.own_p, p.stage_p);
  unpermute_backward(dx, dprobs, p.send_f, p.send_p, p.send_plan, ctx);
}

// ---- AllGatherDispatcher ------------------------------------------------------------------------------

void AllGatherDispatcher::dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs,
                                           const Tensor& map, const ops::Context&) {
  check_layout("allgather dispatcher", buf, ep_, map.size(1), ep_.size(), etp_);
  EpBuffers& p = buf.ep;
  p.in_x = x;
  p.in_probs = probs;
  p.in_map = map;
}

void AllGatherDispatcher::dispatch(DispatchBuffers& buf, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  {
    CommTimer timer(comm_seconds_);
    all_gather(p.gx, p.in_x, ep_);
    all_gather(p.gprobs, p.in_probs, ep_);
    all_gather(p.gmap, p.in_map, ep_);
  }
  // Keep this rank's expert columns, then permute the gathered tokens among the local experts.
  const int64_t El = p.local_experts, first = first_local_expert(p);
  p.lmap.copy_from(p.gmap.slice(1, first, first + El));
  p.lprobs.copy_from(p.gprobs.slice(1, first, first + El));
  dispatch_plan_build(buf.plan, p.lmap, ctx);
  permute_tokens(buf.permuted_x, buf.permuted_probs, p.gx, p.lprobs, buf.plan, ctx);
}

void AllGatherDispatcher::combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) {
  unpermute_tokens(buf.ep.gy, buf.expert_out, buf.plan, false, ctx);
}

void AllGatherDispatcher::combine(DispatchBuffers&, const ops::Context&) {}

void AllGatherDispatcher::combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context&) {
  CommTimer timer(comm_seconds_);
  reduce_scatter_sum(y, buf.ep.gy, ep_);  // the sum over the EP ranks' experts, in rank order
}

void AllGatherDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  {
    CommTimer timer(comm_seconds_);
    all_gather(buf.ep.gy, dy, ep_);
  }
  gather_token_rows(buf.dpermuted, buf.ep.gy, buf.plan, ctx);
}

void AllGatherDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  unpermute_tokens(p.gy, buf.dexpert_in, buf.plan, false, ctx);
  {
    CommTimer timer(comm_seconds_);
    reduce_scatter_sum(p.ty, p.gy, ep_);
  }
  ops::add(dx, dx, p.ty, ctx);
  // This rank's expert columns of the gathered probability gradient; the other columns are zero.
  const int64_t El = p.local_experts, first = first_local_expert(p);
  p.gdprobs.zero_();
  Tensor mine = p.gdprobs.slice(1, first, first + El);
  ops::moe_unpermute_probs(mine, buf.dpermuted_probs, buf.plan.token_rows, ctx);
  CommTimer timer(comm_seconds_);
  reduce_scatter_sum(dprobs, p.gdprobs, ep_);  // one non-zero contribution per entry (per ETP slice with ETP > 1)
}

}  // namespace moecore::moe
