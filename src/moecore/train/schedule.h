// Pipeline schedules: the order in which one stage runs the forward and backward passes of a step's micro-batches,
// and how many micro-batches it holds between the two at once (the model's activation slots). Megatron's
// non-interleaved 1F1B (PipeDream-Flush): stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates one
// forward and one backward, then drains the remaining backwards. With one stage it is forward, backward per
// micro-batch -- gradient accumulation without pipelining. Not here: the passes themselves (step.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moecore::train {

struct ScheduleOp {
  enum Kind : uint8_t { forward, backward };
  Kind kind = forward;
  int64_t micro_batch = 0;  // 0-based, within this rank's micro-batches of the step
};

struct Schedule {
  std::vector<ScheduleOp> ops;
  int64_t in_flight = 1;  // the most micro-batches between their forward and their backward at any point
  // Micro-batch i's activation slot: backwards run in forward order, so i modulo in_flight is free again by then.
  int64_t slot(int64_t micro_batch) const { return micro_batch % in_flight; }
  std::string str() const;  // "F0 F1 B0 F2 B1 B2" (tests, logs)
};

// The 1F1B schedule of `stage` (0-based) in a pipeline of `stages`, for `micro_batches` micro-batches (Error unless
// micro_batches >= 1 and 0 <= stage < stages).
Schedule one_f_one_b(int64_t micro_batches, int64_t stages = 1, int64_t stage = 0);

}  // namespace moecore::train
