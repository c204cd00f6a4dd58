// Device-memory seam for builds without CUDA: every entry point throws "built without CUDA".
#include <cstring>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/env.h"
#include "moecore/core/error.h"

namespace moecore {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(std::string(what) + ": moecore was built without CUDA (configure with -DMOECORE_CUDA=ON)");
}
}  // namespace
void* device_alloc(int64_t) {
  no_cuda("device_alloc");
}
void device_free(void*) {}
int64_t device_memory_reserved_bytes() {
  no_cuda("device_memory_reserved_bytes");
}
void device_memset(void*, int, int64_t) {
  no_cuda("device_memset");
}
void device_copy(void*, bool, const void*, bool, int64_t) {
  no_cuda("device_copy");
}
void local_copy(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
}
bool device_sync_each_launch() {
  // Nothing is launched without CUDA, but the variable is still checked (as in a CUDA build) rather than ignored.
  (void)env_switch("MOECORE_CUDA_SYNC", false, "synchronise after every CUDA launch, so a fault names its op");
  return false;
}
bool device_available() {
  return false;
}
std::string device_description(int64_t* free_bytes, int64_t* total_bytes) {
  if (free_bytes) *free_bytes = 0;
  if (total_bytes) *total_bytes = 0;
  return "no CUDA device (moecore was built without CUDA)";
}
void device_fill(const DeviceView&, const void*) {
  no_cuda("device_fill");
}
void device_convert(const DeviceView&, const DeviceView&) {
  no_cuda("device_convert");
}
std::string device_unavailable_reason() {
  return "moecore was built without CUDA (configure with -DMOECORE_CUDA=ON on a machine with nvcc)";
}
}  // namespace moecore
