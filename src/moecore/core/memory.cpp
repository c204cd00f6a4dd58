// Process-wide memory counters. Peaks are updated with compare-exchange so concurrent allocations
// never lose a maximum.
#include "moecore/core/memory.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>

#include "moecore/core/tensor.h"

namespace moecore {
namespace {
std::atomic<int64_t> g_current[kNumMemCategories];
std::atomic<int64_t> g_peak[kNumMemCategories];
std::atomic<int64_t> g_total{0};
std::atomic<int64_t> g_total_peak{0};
constexpr int kNumDevices = 3;  // Device: cpu, cuda, sim
std::atomic<int64_t> g_device_current[kNumDevices];
std::atomic<int64_t> g_device_peak[kNumDevices];
std::atomic<int64_t> g_device_count[kNumDevices];
std::atomic<int64_t> g_device_taken[kNumDevices];
int device_index(Device d) {
  const int i = static_cast<int>(d);
  return i < kNumDevices ? i : 0;
}

void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t old = peak.load(std::memory_order_relaxed);
  while (value > old && !peak.compare_exchange_weak(old, value, std::memory_order_relaxed)) {
  }
}

int64_t read_status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line)) {
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;
  }
  return 0;
}
}  // namespace

const char* mem_category_name(MemCategory c) {
  static const char* names[] = {"parameters", "gradients", "optimizer_state", "activations", "workspace", "other"};
  return names[static_cast<int>(c)];
}

void memory_record_alloc(MemCategory c, int64_t bytes, Device device) {
  const int i = static_cast<int>(c), d = device_index(device);
  raise_peak(g_peak[i], g_current[i].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  raise_peak(g_total_peak, g_total.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  raise_peak(g_device_peak[d], g_device_current[d].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  g_device_count[d].fetch_add(1, std::memory_order_relaxed);
  g_device_taken[d].fetch_add(1, std::memory_order_relaxed);
}

void memory_record_free(MemCategory c, int64_t bytes, Device device) {
  const int d = device_index(device);
  g_current[static_cast<int>(c)].fetch_sub(bytes, std::memory_order_relaxed);
  g_total.fetch_sub(bytes, std::memory_order_relaxed);
  g_device_current[d].fetch_sub(bytes, std::memory_order_relaxed);
  g_device_count[d].fetch_sub(1, std::memory_order_relaxed);
}

DeviceMemoryStats memory_device_stats(Device device) {
  const int d = device_index(device);
  return {g_device_current[d].load(), g_device_peak[d].load(), g_device_count[d].load(), g_device_taken[d].load()};
}

MemoryStats memory_stats() {
  MemoryStats s;
  for (int i = 0; i < kNumMemCategories; ++i) {
    s.current[i] = g_current[i].load();
    s.peak[i] = g_peak[i].load();
  }
  s.total_current = g_total.load();
  s.total_peak = g_total_peak.load();
  return s;
}

void memory_reset_peaks() {
  for (int i = 0; i < kNumMemCategories; ++i) g_peak[i].store(g_current[i].load());
  g_total_peak.store(g_total.load());
  for (int d = 0; d < kNumDevices; ++d) g_device_peak[d].store(g_device_current[d].load());
}

std::string memory_format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  return buf;
}

int64_t memory_resident_bytes() {
  return read_status_kib("VmRSS");
}
int64_t memory_resident_peak_bytes() {
  return read_status_kib("VmHWM");
}

}  // namespace moecore

namespace moecore {
int64_t memory_physical_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}
namespace {
std::mutex g_plan_mutex;
std::string g_plan;
}  // namespace

void memory_set_plan(std::string text) {
  const std::lock_guard lock(g_plan_mutex);
  g_plan = std::move(text);
}

std::string memory_plan_text() {
  const std::lock_guard lock(g_plan_mutex);
  return g_plan;
}

}  // namespace moecore
