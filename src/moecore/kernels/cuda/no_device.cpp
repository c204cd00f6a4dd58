// Device-memory seam for builds without CUDA: every entry point throws "built without CUDA".
#include "moecore/core/backend_hooks.h"
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
void device_memset(void*, int, int64_t) {
  no_cuda("device_memset");
}
void device_copy(void*, bool, const void*, bool, int64_t) {
  no_cuda("device_copy");
}
bool device_available() {
  return false;
}
}  // namespace moecore
