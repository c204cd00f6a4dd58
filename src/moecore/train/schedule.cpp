#include "moecore/train/schedule.h"

#include <algorithm>

#include "moecore/core/error.h"

namespace moecore::train {

std::string Schedule::str() const {
  std::string s;
  for (const ScheduleOp& op : ops)
    s += (s.empty() ? "" : " ") + std::string(op.kind == ScheduleOp::forward ? "F" : "B") +
         std::to_string(op.micro_batch);
  return s;
}

Schedule one_f_one_b(int64_t micro_batches, int64_t stages, int64_t stage) {
  if (micro_batches < 1 || stages < 1 || stage < 0 || stage >= stages)
    MOECORE_FAIL("schedule: 1F1B needs micro_batches (", micro_batches, ") >= 1 and 0 <= stage (", stage,
                 ") < stages (", stages, ")");
  const int64_t warmup = std::min(stages - stage - 1, micro_batches);
  Schedule s;
  s.in_flight = std::min(warmup + 1, micro_batches);
  for (int64_t i = 0; i < warmup; ++i) s.ops.push_back({ScheduleOp::forward, i});
  for (int64_t i = 0; i < micro_batches - warmup; ++i) {
    s.ops.push_back({ScheduleOp::forward, warmup + i});
    s.ops.push_back({ScheduleOp::backward, i});
  }
  for (int64_t i = micro_batches - warmup; i < micro_batches; ++i) s.ops.push_back({ScheduleOp::backward, i});
  return s;
}

}  // namespace moecore::train
