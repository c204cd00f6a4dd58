// Megatron's named timers of a training step (megatron/core/timers.py), for --timing-log-level, --timing-log-option
// and --log-timers-to-tensorboard: each phase of the step adds its wall time to a timer named as in Megatron, and
// every log interval the times of all ranks are gathered for the "(min, max) time across ranks (ms):" block and the
// "<name>-time" metrics. Not here: the iteration time (the log line's own clock, run_log.h), a profiler.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moecore/core/enum_names.h"
#include "moecore/core/tensor.h"
#include "moecore/train/train_groups.h"

namespace moecore::train {

// The phases moecore times, in the order Megatron's training_log lists them, with their Megatron log level:
//   1 (once per step): forward-backward (the schedule's passes through the gradient reduction: the two timers
//     below nest in it, as in Megatron), embedding-grads-all-reduce (the pipeline's shared embedding),
//     all-grads-sync (the data-parallel reduction; moecore's also holds the tensor-parallel sums Megatron times as
//     non-tensor-parallel-grads-all-reduce), params-all-gather (the distributed optimizer's gathers of the
//     updated masters; with --overlap-param-gather only their posting), optimizer-unscale-and-check-inf (the
//     non-finite check), optimizer-clip-main-grad (the global grad norm and clip scale),
//     optimizer-count-zeros (--log-num-zeros-in-grad), optimizer-inner-step (the AdamW update),
//     optimizer-copy-main-to-model-params (the compute copies), optimizer (all of the optimizer's part of the step).
//   2 (per micro-batch): batch-generator (the BatchFn calls), forward-compute, backward-compute, and the pipeline's
//     waits for its transfers: forward-recv / forward-send (activations), backward-recv / backward-send (their
//     gradients; moecore posts every transfer ahead and times the wait for it).
// Megatron's optimizer-copy-to-main-grad has no counterpart (moecore's gradients are the f32 main gradients).
enum class TimerName : uint8_t {
  forward_backward,
  embedding_grads_all_reduce,
  all_grads_sync,
  params_all_gather,
  optimizer_unscale_and_check_inf,
  optimizer_clip_main_grad,
  optimizer_count_zeros,
  optimizer_inner_step,
  optimizer_copy_main_to_model_params,
  optimizer,
  batch_generator,
  forward_compute,
  backward_compute,
  forward_recv,
  forward_send,
  backward_recv,
  backward_send,
  count
};
inline constexpr int kNumTimers = static_cast<int>(TimerName::count);
const char* timer_name(TimerName t);  // Megatron's name, e.g. "forward-backward"
int timer_level(TimerName t);         // 1 or 2

// The timers of one rank. level 0 | 1 | 2 (--timing-log-level): timers above it are off (start and stop return at
// once: no clock read, no device wait). An active timer waits for the device at start and at stop (as Megatron's does
// with torch.cuda.synchronize), so on cuda it measures the work its phase queued; cpu and sim ops run synchronously. No
// barrier: each rank's time is its own (Megatron's --barrier-with-L1-time synchronises the ranks first).
// Single-threaded: the training thread's.
class Timers {
 public:
  Timers(int level, Device device);
  int level() const { return level_; }
  bool on(TimerName t) const { return timer_level(t) <= level_; }
  void start(TimerName t);
  void stop(TimerName t);
  // The seconds each timer ran since the last call, and resets them.
  std::array<double, kNumTimers> take_seconds();

 private:
  int level_;
  Device device_;
  std::array<double, kNumTimers> seconds_{};
  std::array<std::chrono::steady_clock::time_point, kNumTimers> started_{};
  std::array<bool, kNumTimers> running_{};
};

// Times its scope with timer t (nothing when timers is null or t is off). Its end never raises: a device error in the
// stop's wait is dropped (the device's next checked call reports it), so an exception leaving the scope stays the one
// that propagates.
class TimerScope {
 public:
  TimerScope(Timers* timers, TimerName t) : timers_(timers && timers->on(t) ? timers : nullptr), t_(t) {
    if (timers_) timers_->start(t_);
  }
  ~TimerScope() {
    if (!timers_) return;
    try {
      timers_->stop(t_);
    } catch (...) {
    }
  }
  TimerScope(const TimerScope&) = delete;
  TimerScope& operator=(const TimerScope&) = delete;

 private:
  Timers* timers_;
  TimerName t_;
};

// One interval's timers on every rank of the run: per timer of the level, each rank's seconds, ranks in world order.
struct TimerReport {
  std::vector<TimerName> names;            // the timers of the level, in Megatron's order
  std::vector<std::vector<double>> ranks;  // [rank][name] seconds
  std::vector<int64_t> world_ranks;        // [rank] its world rank
};
// Gathers this rank's take_seconds() from every rank (collective over every rank of the run: the stage, then the
// pipeline). Empty at level 0 (no collective).
TimerReport timers_gather(Timers& timers, const TrainGroups& g);
// --timing-log-option: the timers block's statistic over the ranks.
enum class TimingLogOption : uint8_t { max, minmax, all };
inline constexpr EnumName<TimingLogOption> kTimingLogOptionNames[] = {
    {TimingLogOption::max, "max"}, {TimingLogOption::minmax, "minmax"}, {TimingLogOption::all, "all"}};
constexpr std::span<const EnumName<TimingLogOption>> enum_names(TimingLogOption) {
  return kTimingLogOptionNames;
}
// Megatron's block for the log (Timers.log with normalizer = the interval's steps; ms per step): option minmax
// "(min, max) time across ranks (ms):" with a line per timer that ran on some rank, max the maxima, all each
// rank's time. Ranks where a timer did not run (0 s) are left out of its min. "" when no timer ran.
std::string timers_format(const TimerReport& r, TimingLogOption option, int64_t steps);
// The metrics of Timers.write: "<name>-time", the maximum over the ranks in seconds per step, for each timer that
// ran.
std::vector<std::pair<std::string, double>> timers_metrics(const TimerReport& r, int64_t steps);

}  // namespace moecore::train
