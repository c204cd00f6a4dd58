#include "moecore/train/schedule.h"

#include <algorithm>

#include "moecore/core/error.h"

namespace moecore::train {
namespace {
// in_flight per chunk, from the order of the ops.
void count_in_flight(Schedule& s, int64_t chunks) {
  std::vector<int64_t> live(static_cast<size_t>(chunks), 0);
  s.in_flight.assign(static_cast<size_t>(chunks), 1);
  for (const ScheduleOp& op : s.ops) {
    const auto c = static_cast<size_t>(op.chunk);
    live[c] += op.kind == ScheduleOp::forward ? 1 : -1;
    s.in_flight[c] = std::max(s.in_flight[c], live[c]);
  }
}
}  // namespace

std::string Schedule::str() const {
  std::string s;
  const bool chunks = in_flight.size() > 1;
  for (const ScheduleOp& op : ops)
    s += (s.empty() ? "" : " ") + std::string(op.kind == ScheduleOp::forward ? "F" : "B") +
         std::to_string(op.micro_batch) + (chunks ? "." + std::to_string(op.chunk) : "");
  return s;
}

Schedule one_f_one_b(int64_t micro_batches, int64_t stages, int64_t stage) {
  if (micro_batches < 1 || stages < 1 || stage < 0 || stage >= stages)
    MOECORE_FAIL("schedule: 1F1B needs micro_batches (", micro_batches, ") >= 1 and 0 <= stage (", stage,
                 ") < stages (", stages, ")");
  const int64_t warmup = std::min(stages - stage - 1, micro_batches);
  Schedule s;
  for (int64_t i = 0; i < warmup; ++i) s.ops.push_back({ScheduleOp::forward, i});
  for (int64_t i = 0; i < micro_batches - warmup; ++i) {
    s.ops.push_back({ScheduleOp::forward, warmup + i});
    s.ops.push_back({ScheduleOp::backward, i});
  }
  for (int64_t i = micro_batches - warmup; i < micro_batches; ++i) s.ops.push_back({ScheduleOp::backward, i});
  count_in_flight(s, 1);
  return s;
}

Schedule interleaved_one_f_one_b(int64_t micro_batches, int64_t stages, int64_t stage, int64_t chunks,
                                 int64_t group_size) {
  const int64_t m = micro_batches, p = stages, g = group_size;
  if (p < 2 || chunks < 2 || stage < 0 || stage >= p)
    MOECORE_FAIL("schedule: the interleaved 1F1B needs stages (", p, ") >= 2, chunks (", chunks,
                 ") >= 2 and 0 <= stage (", stage, ") < stages");
  if (g < p || g > m)
    MOECORE_FAIL("schedule: the micro-batches in a row per virtual pipeline stage (",
                 "--microbatch-group-size-per-virtual-pipeline-stage, default the pipeline size: ", g,
                 ") must lie in [pipeline size ", p, ", micro-batches per data-parallel rank ", m, "]");
  if (m % g != 0 && m % g < p)
    MOECORE_FAIL("schedule: the micro-batches per data-parallel rank (", m, ") modulo the group size per virtual ",
                 "pipeline stage (", g, ") is ", m % g, ": it must be 0 or at least the pipeline size (", p,
                 "), otherwise the last group waits on dependency bubbles (Megatron refuses it too)");
  // Megatron's schedule table: (micro-batch, chunk) of the k-th forward.
  std::vector<ScheduleOp> table;
  for (int64_t first = 0; first < m; first += g) {
    const int64_t end = first + g >= m ? m : first + g;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t i = first; i < end; ++i) table.push_back({ScheduleOp::forward, i, c});
    if (end == m) break;
  }
  const auto total = static_cast<int64_t>(table.size());
  const int64_t warmup = std::min((p - stage - 1) * 2 + (chunks - 1) * g, total);
  auto fwd = [&](int64_t k) { return table[static_cast<size_t>(k)]; };
  auto bwd = [&](int64_t k) {
    ScheduleOp op = table[static_cast<size_t>(k)];
    return ScheduleOp{ScheduleOp::backward, op.micro_batch, chunks - 1 - op.chunk};
  };
  Schedule s;
  for (int64_t k = 0; k < warmup; ++k) s.ops.push_back(fwd(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    s.ops.push_back(fwd(warmup + k));
    s.ops.push_back(bwd(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) s.ops.push_back(bwd(k));
  count_in_flight(s, chunks);
  return s;
}

std::vector<P2PAction> pipeline_transfers(const Schedule& schedule, int64_t stages, int64_t stage) {
  const auto chunks = static_cast<int64_t>(schedule.in_flight.size());
  if (stages < 1 || stage < 0 || stage >= stages || (stages == 1 && chunks > 1))
    MOECORE_FAIL("schedule: transfers of stage ", stage, " of ", stages, " stages with ", chunks, " model chunks");
  const auto& ops = schedule.ops;
  auto receives = [&](const ScheduleOp& op) {  // a forward after the first virtual stage, a backward before the last
    return op.kind == ScheduleOp::forward ? !(stage == 0 && op.chunk == 0)
                                          : !(stage == stages - 1 && op.chunk == chunks - 1);
  };
  std::vector<P2PAction> plan;
  using A = P2PAction;
  const auto stream_of = [](const ScheduleOp& op) {
    return op.kind == ScheduleOp::forward ? A::activations : A::gradients;
  };
  // The receives of each stream, in the order the ops use them, and the next one to post.
  std::vector<size_t> wanted[2];
  for (size_t i = 0; i < ops.size() && stages > 1; ++i)
    if (receives(ops[i])) wanted[stream_of(ops[i])].push_back(i);
  size_t next[2] = {0, 0};
  std::vector<int64_t> backwards_done(static_cast<size_t>(chunks), 0);  // per chunk: its micro-batches 0.. done
  auto post_free = [&] {                                                // every receive in order whose slot is free
    for (int s = 0; s < 2; ++s)
      while (next[s] < wanted[s].size()) {
        const ScheduleOp& op = ops[wanted[s][next[s]]];
        const auto c = static_cast<size_t>(op.chunk);
        if (op.micro_batch >= backwards_done[c] + schedule.in_flight[c]) break;
        plan.push_back({A::post_recv, static_cast<A::Stream>(s), 0, op.chunk, op.micro_batch});
        ++next[s];
      }
  };
  // Per stream, chunk and slot: the micro-batch whose send from that slot is not waited for yet (-1: none).
  std::vector<std::vector<int64_t>> sending[2];
  for (auto& s : sending)
    for (int64_t n : schedule.in_flight) s.emplace_back(static_cast<size_t>(n), -1);
  auto wait_send = [&](A::Stream s, int64_t chunk, int64_t slot) {
    int64_t& mb = sending[s][static_cast<size_t>(chunk)][static_cast<size_t>(slot)];
    if (mb >= 0) plan.push_back({A::wait_send, s, 0, chunk, mb});
    mb = -1;
  };
  post_free();
  for (size_t i = 0; i < ops.size(); ++i) {
    const ScheduleOp& op = ops[i];
    const int64_t slot = schedule.slot(op);
    const bool forward = op.kind == ScheduleOp::forward;
    if (!forward) {  // the slot's buffers are written again: its earlier sends first
      wait_send(A::activations, op.chunk, slot);
      wait_send(A::gradients, op.chunk, slot);
    }
    if (stages > 1 && receives(op)) plan.push_back({A::wait_recv, stream_of(op), 0, op.chunk, op.micro_batch});
    plan.push_back({A::run, A::activations, static_cast<int64_t>(i), op.chunk, op.micro_batch});
    if (!forward) ++backwards_done[static_cast<size_t>(op.chunk)];
    // A forward before the last virtual stage sends its output; a backward after the first its input's gradient.
    const bool sends =
        stages > 1 && (forward ? !(stage == stages - 1 && op.chunk == chunks - 1) : !(stage == 0 && op.chunk == 0));
    if (sends) {
      plan.push_back({A::post_send, stream_of(op), 0, op.chunk, op.micro_batch});
      sending[stream_of(op)][static_cast<size_t>(op.chunk)][static_cast<size_t>(slot)] = op.micro_batch;
    }
    post_free();
  }
  for (int s = 0; s < 2; ++s)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t slot = 0; slot < schedule.in_flight[static_cast<size_t>(c)]; ++slot)
        wait_send(static_cast<A::Stream>(s), c, slot);
  return plan;
}

}  // namespace moecore::train
