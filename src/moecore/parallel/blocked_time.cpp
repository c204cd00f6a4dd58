// comm_blocked_seconds: the wall-clock time spent inside communication, summed over the threads that communicate.
#include <atomic>
#include <chrono>

#include "moecore/parallel/call.h"

namespace moecore {
namespace detail {
namespace {
std::atomic<int64_t> g_blocked_ns{0};
thread_local int t_depth = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

BlockedScope::BlockedScope() {
  if (t_depth++ == 0) start_ns_ = now_ns();
  lock_ = lock_for_call();
}

BlockedScope::~BlockedScope() {
  --t_depth;
  if (start_ns_ >= 0) g_blocked_ns.fetch_add(now_ns() - start_ns_, std::memory_order_relaxed);
}

}  // namespace detail

double comm_blocked_seconds() {
  return static_cast<double>(detail::g_blocked_ns.load(std::memory_order_relaxed)) * 1e-9;
}

}  // namespace moecore
