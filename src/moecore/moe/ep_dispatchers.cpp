// The expert-parallel dispatchers (spec §6.1, §6.2): AllToAllDispatcher and AllGatherDispatcher over the EP
// group. Local steps reuse the permutation building blocks of dispatcher.cpp; communication goes through
// parallel/comm.h (deterministic: data movement is exact and the all-gather dispatcher's reduce-scatter
// sums in group-rank order). CPU memory only, like the local dispatcher.
// Not here: routing (the router runs on each rank's own tokens, capacity included, before dispatch).
#include <algorithm>
#include <chrono>
#include <cstring>

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

// Row copies between the receive layout (chunks ordered [source rank s][local expert le]) and the expert
// layout ([le][s]); counts[s*El + le] rows per chunk. to_expert: expert <- receive; else receive <- expert.
void sort_chunks(const Tensor& expert, const Tensor& recv, EpBuffers& p, bool to_expert) {
  const std::vector<int64_t>& counts = p.counts;
  const int64_t P = p.ep, El = p.local_experts;
  MOECORE_CHECK(expert.dtype() == recv.dtype() && expert.is_contiguous() && recv.is_contiguous(),
                "sort_chunks: the two layouts differ in dtype or are not contiguous");
  const int64_t row_bytes =
      (expert.dim() == 1 ? 1 : expert.stride(0)) * static_cast<int64_t>(dtype_size(expert.dtype()));
  auto* e = static_cast<char*>(expert.raw());
  auto* r = static_cast<char*>(recv.raw());
  // Chunk (s, le) starts at recv_off[s*El+le] in the receive layout and at exp_off[s*El+le] in the expert one.
  std::vector<int64_t>& recv_off = p.recv_off;
  std::vector<int64_t>& exp_off = p.exp_off;
  int64_t o = 0;
  for (int64_t i = 0; i < P * El; ++i) {
    recv_off[i] = o;
    o += counts[i];
  }
  o = 0;
  for (int64_t le = 0; le < El; ++le)
    for (int64_t s = 0; s < P; ++s) {
      exp_off[s * El + le] = o;
      o += counts[s * El + le];
    }
  for (int64_t i = 0; i < P * El; ++i) {
    if (counts[i] == 0) continue;
    char* ep = e + exp_off[i] * row_bytes;
    char* rp = r + recv_off[i] * row_bytes;
    if (to_expert)
      std::memcpy(ep, rp, static_cast<size_t>(counts[i] * row_bytes));
    else
      std::memcpy(rp, ep, static_cast<size_t>(counts[i] * row_bytes));
  }
}

void set_expert_counts(DispatchPlan& plan, const std::vector<int64_t>& counts, int64_t P, int64_t El) {
  plan.E = El;
  plan.tokens_per_expert.assign(El, 0);
  for (int64_t s = 0; s < P; ++s)
    for (int64_t le = 0; le < El; ++le) plan.tokens_per_expert[le] += counts[s * El + le];
  plan.expert_offset.assign(El + 1, 0);
  for (int64_t le = 0; le < El; ++le) plan.expert_offset[le + 1] = plan.expert_offset[le] + plan.tokens_per_expert[le];
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
  const int64_t P = p.ep, El = p.local_experts;
  // Permutation 1: this rank's tokens, expert-major over all E experts (hence grouped by destination rank).
  dispatch_plan_build(p.send_plan, map, ctx);
  permute_tokens(p.send_x, p.send_p, x, probs, p.send_plan, ctx);
  for (int64_t j = 0; j < P; ++j) {
    p.send_rows[j] = 0;
    for (int64_t le = 0; le < El; ++le) p.send_rows[j] += p.send_plan.tokens_per_expert[j * El + le];
  }
  // Count exchange: rank j receives my counts for its experts; counts[s*El + le] = rows from s for le.
  {
    CommTimer timer(comm_seconds_);
    all_to_all_v(std::span<int64_t>(p.counts), p.el_blocks, std::span<const int64_t>(p.send_plan.tokens_per_expert),
                 p.el_blocks, ep_);
  }
  for (int64_t s = 0; s < P; ++s) {
    p.recv_rows[s] = 0;
    for (int64_t le = 0; le < El; ++le) p.recv_rows[s] += p.counts[s * El + le];
  }
  set_expert_counts(buf.plan, p.counts, P, El);
  if (buf.plan.rows() > buf.permuted_x.size(0))
    MOECORE_FAIL("alltoall dispatcher: rank ", ep_.rank(), " of group '", ep_.name(), "' receives ", buf.plan.rows(),
                 " rows but its buffers hold ", buf.permuted_x.size(0));
}

void AllToAllDispatcher::dispatch(DispatchBuffers& buf, const ops::Context&) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.rows(), Rr = buf.plan.rows();
  {
    CommTimer timer(comm_seconds_);
    all_to_all_v(p.stage_x.slice(0, 0, Rr), p.recv_rows, p.send_x.slice(0, 0, Rs), p.send_rows, ep_);
    all_to_all_v(p.stage_p.slice(0, 0, Rr), p.recv_rows, p.send_p.slice(0, 0, Rs), p.send_rows, ep_);
  }
  // Permutation 2: [source][local expert] -> [local expert][source].
  sort_chunks(buf.permuted_x, p.stage_x, buf.ep, true);
  sort_chunks(buf.permuted_probs, p.stage_p, buf.ep, true);
}

void AllToAllDispatcher::combine_prepare(DispatchBuffers& buf, const ops::Context&) {
  sort_chunks(buf.expert_out, buf.ep.stage_x, buf.ep, false);
}

void AllToAllDispatcher::combine(DispatchBuffers& buf, const ops::Context&) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.rows(), Rr = buf.plan.rows();
  CommTimer timer(comm_seconds_);
  all_to_all_v(p.send_x.slice(0, 0, Rs), p.send_rows, p.stage_x.slice(0, 0, Rr), p.recv_rows, ep_);
}

void AllToAllDispatcher::combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) {
  unpermute_tokens(y, buf.ep.send_x.slice(0, 0, buf.ep.send_plan.rows()), buf.ep.send_plan, false, ctx);
}

void AllToAllDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.rows(), Rr = buf.plan.rows();
  gather_token_rows(p.send_x, dy, p.send_plan, ctx);
  {
    CommTimer timer(comm_seconds_);
    all_to_all_v(p.stage_x.slice(0, 0, Rr), p.recv_rows, p.send_x.slice(0, 0, Rs), p.send_rows, ep_);
  }
  sort_chunks(buf.dpermuted, p.stage_x, buf.ep, true);
}

void AllToAllDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  EpBuffers& p = buf.ep;
  const int64_t Rs = p.send_plan.rows(), Rr = buf.plan.rows();
  sort_chunks(buf.dexpert_in, p.stage_f, buf.ep, false);
  sort_chunks(buf.dpermuted_probs, p.stage_p, buf.ep, false);
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
  const int64_t N = p.gmap.size(0), E = p.gmap.size(1), El = p.local_experts, first = ep_.rank() * El;
  const bool* gm = p.gmap.data<bool>();
  const float* gp = p.gprobs.data<float>();
  bool* lm = p.lmap.data<bool>();
  float* lp = p.lprobs.data<float>();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t le = 0; le < El; ++le) {
      lm[t * El + le] = gm[t * E + first + le];
      lp[t * El + le] = gp[t * E + first + le];
    }
  dispatch_plan_build(buf.plan, p.lmap, ctx);
  permute_tokens(buf.permuted_x, buf.permuted_probs, p.gx, p.lprobs, buf.plan, ctx);
}

void AllGatherDispatcher::combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) {
  unpermute_tokens(buf.ep.gy, buf.expert_out.slice(0, 0, buf.plan.rows()), buf.plan, false, ctx);
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
  unpermute_tokens(p.gy, buf.dexpert_in.slice(0, 0, buf.plan.rows()), buf.plan, false, ctx);
  {
    CommTimer timer(comm_seconds_);
    reduce_scatter_sum(p.ty, p.gy, ep_);
  }
  ops::add(dx, dx, p.ty, ctx);
  const int64_t N = p.gdprobs.size(0), E = p.gdprobs.size(1), El = p.local_experts, first = ep_.rank() * El;
  float* gd = p.gdprobs.data<float>();
  std::fill(gd, gd + N * E, 0.0f);
  const int32_t* tr = buf.plan.token_rows.data<int32_t>();
  const float* dpp = buf.dpermuted_probs.data<float>();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t le = 0; le < El; ++le) {
      const int32_t r = tr[t * El + le];
      if (r >= 0) gd[t * E + first + le] = dpp[r];
    }
  CommTimer timer(comm_seconds_);
  reduce_scatter_sum(dprobs, p.gdprobs, ep_);  // one non-zero contribution per entry: exact
}

}  // namespace moecore::moe
