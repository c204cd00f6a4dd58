// Megatron's named timers (timers.h).
#include "moecore/train/timers.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <span>

#include "moecore/core/error.h"
#include "moecore/kernels/device_timer.h"
#include "moecore/parallel/comm.h"

namespace moecore::train {
namespace {
struct TimerSpec {
  const char* name;
  int level;
};
constexpr std::array<TimerSpec, kNumTimers> kTimers = {{{"forward-backward", 1},
                                                        {"embedding-grads-all-reduce", 1},
                                                        {"all-grads-sync", 1},
                                                        {"params-all-gather", 1},
                                                        {"optimizer-unscale-and-check-inf", 1},
                                                        {"optimizer-clip-main-grad", 1},
                                                        {"optimizer-count-zeros", 1},
                                                        {"optimizer-inner-step", 1},
                                                        {"optimizer-copy-main-to-model-params", 1},
                                                        {"optimizer", 1},
                                                        {"batch-generator", 2},
                                                        {"forward-compute", 2},
                                                        {"backward-compute", 2},
                                                        {"forward-recv", 2},
                                                        {"forward-send", 2},
                                                        {"backward-recv", 2},
                                                        {"backward-send", 2}}};
size_t index_of(TimerName t) {
  return static_cast<size_t>(t);
}
}  // namespace

const char* timer_name(TimerName t) {
  return kTimers[index_of(t)].name;
}
int timer_level(TimerName t) {
  return kTimers[index_of(t)].level;
}

Timers::Timers(int level, Device device) : level_(level), device_(device) {
  MOECORE_CHECK(level >= 0 && level <= 2, "timers: level ", level, " is not 0, 1 or 2");
}

void Timers::start(TimerName t) {
  if (!on(t)) return;
  const size_t i = index_of(t);
  MOECORE_CHECK(!running_[i], "timer ", timer_name(t), " started while running");
  ops::device_synchronize(device_);
  running_[i] = true;
  started_[i] = std::chrono::steady_clock::now();
}

void Timers::stop(TimerName t) {
  if (!on(t)) return;
  const size_t i = index_of(t);
  MOECORE_CHECK(running_[i], "timer ", timer_name(t), " stopped while not running");
  ops::device_synchronize(device_);
  seconds_[i] += std::chrono::duration<double>(std::chrono::steady_clock::now() - started_[i]).count();
  running_[i] = false;
}

std::array<double, kNumTimers> Timers::take_seconds() {
  const std::array<double, kNumTimers> s = seconds_;
  seconds_.fill(0.0);
  return s;
}

TimerReport timers_gather(Timers& timers, const TrainGroups& g) {
  TimerReport r;
  if (timers.level() == 0) return r;
  for (int i = 0; i < kNumTimers; ++i)
    if (timers.on(static_cast<TimerName>(i))) r.names.push_back(static_cast<TimerName>(i));
  const std::array<double, kNumTimers> s = timers.take_seconds();
  const size_t n = r.names.size(), width = n + 1;  // {world rank, seconds per timer}
  std::vector<double> mine(width);
  mine[0] = comm_initialized() ? comm_world().rank() : 0;
  for (size_t k = 0; k < n; ++k) mine[k + 1] = s[index_of(r.names[k])];
  const ProcessGroup& stage = g.tp.size() > 1 || g.cp.size() > 1 ? g.tp_dp : g.dp;
  std::vector<double> in_stage(width * static_cast<size_t>(stage.size()));
  all_gather(std::span<double>(in_stage), std::span<const double>(mine), stage);
  std::vector<double> all(in_stage.size() * static_cast<size_t>(g.pp.size()));
  all_gather(std::span<double>(all), std::span<const double>(in_stage), g.pp);
  const size_t ranks = all.size() / width;
  std::vector<size_t> order(ranks);
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return all[a * width] < all[b * width]; });
  for (size_t q : order) {
    r.world_ranks.push_back(static_cast<int64_t>(all[q * width]));
    r.ranks.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(q * width + 1),
                         all.begin() + static_cast<std::ptrdiff_t>((q + 1) * width));
  }
  return r;
}

namespace {
// Per timer that ran on some rank: its index in r.names and its (min over the ranks where it ran, max) seconds.
struct MinMax {
  size_t k;
  double min, max;
};
std::vector<MinMax> timers_min_max(const TimerReport& r) {
  std::vector<MinMax> out;
  for (size_t k = 0; k < r.names.size(); ++k) {
    bool ran = false;
    MinMax m{k, 0, 0};
    for (const std::vector<double>& rank : r.ranks) {
      const double s = rank[k];
      if (s <= 0) continue;
      m.min = ran ? std::min(m.min, s) : s;
      m.max = ran ? std::max(m.max, s) : s;
      ran = true;
    }
    if (ran) out.push_back(m);
  }
  return out;
}
// Megatron's (name + ' ').ljust(48, '.').
std::string dotted(const char* name) {
  std::string s = std::string(name) + " ";
  if (s.size() < 48) s.append(48 - s.size(), '.');
  return s;
}
}  // namespace

std::string timers_format(const TimerReport& r, TimingLogOption option, int64_t steps) {
  const double ms = 1000.0 / static_cast<double>(std::max<int64_t>(steps, 1));
  char b[160];
  std::string out;
  if (option == TimingLogOption::all) {
    for (size_t k = 0; k < r.names.size(); ++k) {
      bool first = true;
      for (size_t q = 0; q < r.ranks.size(); ++q) {
        if (r.ranks[q][k] <= 0) continue;
        if (first) out += std::string("\n  ") + timer_name(r.names[k]) + ":";
        first = false;
        std::snprintf(b, sizeof b, "\n     rank %2lld: %.2f", static_cast<long long>(r.world_ranks[q]),
                      r.ranks[q][k] * ms);
        out += b;
      }
    }
    return out.empty() ? out : "times across ranks (ms):" + out;
  }
  const bool max_only = option == TimingLogOption::max;
  for (const MinMax& m : timers_min_max(r)) {
    const std::string name = dotted(timer_name(r.names[m.k]));
    if (max_only)
      std::snprintf(b, sizeof b, "\n    %s: %.2f", name.c_str(), m.max * ms);
    else
      std::snprintf(b, sizeof b, "\n    %s: (%.2f, %.2f)", name.c_str(), m.min * ms, m.max * ms);
    out += b;
  }
  if (out.empty()) return out;
  return (max_only ? "max time across ranks (ms):" : "(min, max) time across ranks (ms):") + out;
}

std::vector<std::pair<std::string, double>> timers_metrics(const TimerReport& r, int64_t steps) {
  std::vector<std::pair<std::string, double>> out;
  for (const MinMax& m : timers_min_max(r))
    out.emplace_back(std::string(timer_name(r.names[m.k])) + "-time",
                     m.max / static_cast<double>(std::max<int64_t>(steps, 1)));
  return out;
}

}  // namespace moecore::train
