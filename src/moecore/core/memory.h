// Memory accounting: current and peak bytes by category, and per device (cpu, cuda, sim) the bytes, peak and number
// of live allocations, for every allocation moecore makes. Counters are process-wide and thread-safe; they count
// moecore's own allocations, not the allocator's overhead or third-party libraries (the train-step benchmark compares
// them with the resident set).
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

enum class Device : uint8_t;  // core/tensor.h
// The tensors' storages on one device (torch.cuda.memory_stats' allocated_bytes and allocation counts for cuda).
struct DeviceMemoryStats {
  int64_t current = 0;  // bytes live now
  int64_t peak = 0;     // highest value of current so far
  int64_t count = 0;    // storages live now
  int64_t taken = 0;    // memory taken from the allocator so far (Tensor::reacquire_storage included)
};
DeviceMemoryStats memory_device_stats(Device device);

void memory_reset_peaks();  // peaks := current (the devices' too)
void memory_record_alloc(MemCategory c, int64_t bytes, Device device);
void memory_record_free(MemCategory c, int64_t bytes, Device device);
std::string memory_format_bytes(int64_t bytes);  // "12.3 MiB"
int64_t memory_resident_bytes();                 // this process's resident set (VmRSS), 0 if unknown
int64_t memory_resident_peak_bytes();            // VmHWM, 0 if unknown
int64_t memory_physical_bytes();                 // this machine's RAM (sysconf), 0 if unknown
// The run's memory plan as printed (model::MemoryPlan::format()), kept so that an out-of-memory error can quote it;
// empty until set.
void memory_set_plan(std::string text);
std::string memory_plan_text();

}  // namespace moecore
