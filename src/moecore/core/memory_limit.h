// The memory this process may still take before the kernel kills it or an allocation fails: its memory cgroup's
// room (v1 and v2) and the machine's MemAvailable, read from /proc and the cgroup files. It does not reserve
// anything, and it does not know what other processes will take later: a check against it is a start-up check.
#pragma once
#include <cstdint>
#include <string>

namespace moecore {

// One limit and the room left under it.
struct MemoryLimit {
  int64_t room = 0;   // bytes still available under this limit; 0 with limit 0: nothing is known
  int64_t limit = 0;  // the limit itself: the cgroup's limit, or the machine's MemTotal
  std::string
      name;  // which: "limit of the memory cgroup v1 /a/b (memory.limit_in_bytes)", "of the machine (MemAvailable..."
  bool known() const { return limit > 0; }
  // "800.0 MiB free of the 1.00 GiB limit of the memory cgroup v1 /a/b (memory.limit_in_bytes)"
  std::string describe() const;
};

// The tightest of
//  - every memory cgroup from this process's own up to its hierarchy's root (cgroup v2: memory.max minus
//    memory.current; cgroup v1: memory.limit_in_bytes minus memory.usage_in_bytes), the inactive page cache of its
//    memory.stat (inactive_file, v1 total_inactive_file) counted as free, since the kernel reclaims it before it
//    kills; "max" and v1's unlimited 2^63 - 4096 are no limit;
//  - the machine's MemAvailable of /proc/meminfo (its MemTotal as the limit).
// The cgroups are found from /proc/self/cgroup and the cgroup mounts of /proc/self/mountinfo. root prefixes every
// path read ("" reads the real files; tests pass a folder holding proc/... and the mounts' folders). A file that
// cannot be read drops that limit; with none left the result is unknown (limit 0).
MemoryLimit memory_limit(const std::string& root = "");

}  // namespace moecore
