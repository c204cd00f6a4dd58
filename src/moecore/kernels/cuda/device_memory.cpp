// Device-memory seam on the CUDA runtime. Every call is checked; errors name the call and the size.
#include <cuda_runtime.h>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"

namespace moecore {
namespace {
void check(cudaError_t e, const char* what, int64_t bytes) {
  if (e != cudaSuccess)
    MOECORE_FAIL("cuda: ", what, " (", bytes, " bytes) failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}
}  // namespace

void* device_alloc(int64_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, static_cast<size_t>(bytes > 0 ? bytes : 1)), "cudaMalloc", bytes);
  return p;
}
void device_free(void* p) {
  cudaFree(p);
}
void device_memset(void* p, int value, int64_t bytes) {
  check(cudaMemset(p, value, static_cast<size_t>(bytes)), "cudaMemset", bytes);
}
void device_copy(void* dst, bool dst_dev, const void* src, bool src_dev, int64_t bytes) {
  const cudaMemcpyKind kind = dst_dev ? (src_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                      : (src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  check(cudaMemcpy(dst, src, static_cast<size_t>(bytes), kind), "cudaMemcpy", bytes);
}
bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
}  // namespace moecore
