// The expert-parallel dispatchers (spec §6.1, §6.2): AllToAllDispatcher and AllGatherDispatcher over the EP
// group. Local steps are ops (the permutation building blocks of dispatcher.cpp and the chunk sort);
// communication goes through parallel/comm.h (deterministic: data movement is exact and the all-gather
// dispatcher's reduce-scatter sums in group-rank order).
// Not here: routing (the router runs on each rank's own tokens, capacity included, before dispatch).
#include <algorithm>
#include <chrono>

#include "moecore/moe/dispatcher.h"

namespace moecore::moe {
namespace {

void check_layout(const char* who, const DispatchBuffers& buf, const ProcessGroup& g, int64_t E) {
  const EpBuffers& p = buf.ep;
  if (p.ep != g.size() || p.local_experts * p.ep != E)
    MOECORE_FAIL(who, ": the buffers were sized for EP ", p.ep, " with ", p.local_experts,
                 " local experts, but the group '", g.name(), "' has ", g.size(), " ranks and the map ", E,
                 " experts (allocate them with dispatch_buffers_alloc_ep for this layout)");
}

// Sizes this step's all-to-all-v on the host: send_rows[j] = rows to rank j (its El experts' counts), and
// recv_rows[s] = rows from rank s. The counts come to the host here, the layer's one synchronisation.
void size_exchange(EpBuffers& p) {
  const int64_t P = p.ep, El = p.local_experts;
  p.send_plan.tokens_per_expert.copy_to_host(p.send_counts_host.data(), P * El);
  p.chunk_counts.copy_to_host(p.chunk_counts_host.data(), P * El);
  const int64_t* sent = p.send_counts_host.data();
  const int64_t* recv = p.chunk_counts_host.data();
  for (int64_t j = 0; j < P; ++j) {
    p.send_rows[j] = 0;
    p.recv_rows[j] = 0;
    for (int64_t le = 0; le < El; ++le) {
      p.send_rows[j] += sent[j * El + le];
      p.recv_rows[j] += recv[j * El + le];
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

void AllToAllDispatcher::dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                                          const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  check_layout("alltoall dispatcher", buf, ep_, map.size(1));
  const int64_t P = p.ep;
  // Permutation 1: this rank's tokens, expert-major over all E experts (hence grouped by destination rank).
  dispatch_plan_build(p.send_plan, map, ctx);
  permute_tokens(p.send_x, p.send_p, x, probs, p.send_plan, ctx);
  // Count exchange: rank j receives my counts for its experts; chunk_counts[s*El + le] = rows from s for le.
  {
    CommTimer timer(comm_seconds_);
    all_to_all_v(p.chunk_counts, p.el_blocks, p.send_plan.tokens_per_expert, p.el_blocks, ep_);
  }
  ops::moe_chunk_counts(buf.plan.tokens_per_expert, buf.plan.expert_offset, p.chunk_counts, P, ctx);
  size_exchange(p);
  p.send_plan.row_bound = sum(p.send_rows);
  buf.plan.row_bound = sum(p.recv_rows);
  if (buf.plan.row_bound > buf.permuted_x.size(0))
    MOECORE_FAIL("alltoall dispatcher: rank ", ep_.rank(), " of group '", ep_.name(), "' receives ", buf.plan.row_bound,
                 " rows but its buffers hold ", buf.permuted_x.size(0));
}

void AllToAllDispatcher::dispatch(DispatchBuffers& buf, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.row_bound, Rr = buf.plan.row_bound, P = p.ep, El = p.local_experts;
  {
    CommTimer timer(comm_seconds_);
    all_to_all_v(p.stage_x.slice(0, 0, Rr), p.recv_rows, p.send_x.slice(0, 0, Rs), p.send_rows, ep_);
    all_to_all_v(p.stage_p.slice(0, 0, Rr), p.recv_rows, p.send_p.slice(0, 0, Rs), p.send_rows, ep_);
  }
  // Permutation 2: [source][local expert] -> [local expert][source].
  ops::moe_sort_chunks(buf.permuted_x, p.stage_x, p.chunk_counts, P, El, false, ctx);
  ops::moe_sort_chunks(buf.permuted_probs, p.stage_p, p.chunk_counts, P, El, false, ctx);
}

void AllToAllDispatcher::combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  ops::moe_sort_chunks(p.stage_x, buf.expert_out, p.chunk_counts, p.ep, p.local_experts, true, ctx);
}

void AllToAllDispatcher::combine(DispatchBuffers& buf, const ops::Context&) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.row_bound, Rr = buf.plan.row_bound;
  CommTimer timer(comm_seconds_);
  all_to_all_v(p.send_x.slice(0, 0, Rs), p.send_rows, p.stage_x.slice(0, 0, Rr), p.recv_rows, ep_);
}

void AllToAllDispatcher::combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) {
  unpermute_tokens(y, buf.ep.send_x, buf.ep.send_plan, false, ctx);
}

void AllToAllDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.row_bound, Rr = buf.plan.row_bound;
  gather_token_rows(p.send_x, dy, p.send_plan, ctx);
  {
    CommTimer timer(comm_seconds_);
    all_to_all_v(p.stage_x.slice(0, 0, Rr), p.recv_rows, p.send_x.slice(0, 0, Rs), p.send_rows, ep_);
  }
  ops::moe_sort_chunks(buf.dpermuted, p.stage_x, p.chunk_counts, p.ep, p.local_experts, false, ctx);
}

void AllToAllDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.row_bound, Rr = buf.plan.row_bound, P = p.ep, El = p.local_experts;
  ops::moe_sort_chunks(p.stage_f, buf.dexpert_in, p.chunk_counts, P, El, true, ctx);
  ops::moe_sort_chunks(p.stage_p, buf.dpermuted_probs, p.chunk_counts, P, El, true, ctx);
  {
    CommTimer timer(comm_seconds_);
    all_to_all_v(p.send_f.slice(0, 0, Rs), p.send_rows, p.stage_f.slice(0, 0, Rr), p.recv_rows, ep_);
    all_to_all_v(p.send_p.slice(0, 0, Rs), p.send_rows, p.stage_p.slice(0, 0, Rr), p.recv_rows, ep_);
  }
  unpermute_backward(dx, dprobs, p.send_f, p.send_p, p.send_plan, ctx);
}

// ---- AllGatherDispatcher ------------------------------------------------------------------------------

void AllGatherDispatcher::dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs,
                                           const Tensor& map, const ops::Context&) {
  check_layout("allgather dispatcher", buf, ep_, map.size(1));
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
  const int64_t El = p.local_experts, first = ep_.rank() * El;
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
  const int64_t El = p.local_experts, first = ep_.rank() * El;
  p.gdprobs.zero_();
  Tensor mine = p.gdprobs.slice(1, first, first + El);
  ops::moe_unpermute_probs(mine, buf.dpermuted_probs, buf.plan.token_rows, ctx);
  CommTimer timer(comm_seconds_);
  reduce_scatter_sum(dprobs, p.gdprobs, ep_);  // one non-zero contribution per entry: exact
}

}  // namespace moecore::moe
