// Memory accounting: current and peak bytes by category, for every allocation moecore makes.
// Counters are process-wide and thread-safe; they count moecore's own allocations, not the allocator's
// overhead or third-party libraries (the train-step benchmark compares them with the resident set).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace moecore {

enum class MemCategory : uint8_t { parameters, gradients, optimizer_state, activations, workspace, other };
inline constexpr int kNumMemCategories = 6;
const char* mem_category_name(MemCategory c);

struct MemoryStats {
  std::array<int64_t, kNumMemCategories> current{};  // bytes live now, by category
  std::array<int64_t, kNumMemCategories> peak{};     // highest value of current[c] so far
  int64_t total_current = 0;                         // sum over categories
  int64_t total_peak = 0;                            // highest total_current so far
};

MemoryStats memory_stats();
void memory_reset_peaks();  // peaks := current
void memory_record_alloc(MemCategory c, int64_t bytes);
void memory_record_free(MemCategory c, int64_t bytes);
std::string memory_format_bytes(int64_t bytes);  // "12.3 MiB"
int64_t memory_resident_bytes();                 // this process's resident set (VmRSS), 0 if unknown
int64_t memory_resident_peak_bytes();            // VmHWM, 0 if unknown
int64_t memory_physical_bytes();                 // this machine's RAM (sysconf), 0 if unknown
// The run's memory plan as printed (model::MemoryPlan::format()), kept so that an out-of-memory error can quote it;
// empty until set.
void memory_set_plan(std::string text);
std::string memory_plan_text();

}  // namespace moecore
