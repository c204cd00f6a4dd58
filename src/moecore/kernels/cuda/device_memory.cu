// Device-memory seam on the CUDA runtime (core/backend_hooks.h). Allocation is stream-ordered
// (cudaMallocAsync/cudaFreeAsync on the legacy default stream, which every op uses) from the device's default pool
// with its release threshold raised to the maximum: freed memory stays in the pool for the next allocation instead of
// going back to the driver, and a free never synchronises the device (cudaFree does). Every call is checked; errors
// name the call and the size.
#include <cuda_runtime.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"

namespace moecore {
namespace {
void check(cudaError_t e, const char* what, int64_t bytes) {
  if (e != cudaSuccess)
    MOECORE_FAIL("cuda: ", what, " (", bytes, " bytes) failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

std::atomic<bool> g_device_memory_used{false};  // set by the first device_alloc

// The current device's default pool, made to keep its memory (once per process).
cudaMemPool_t pool() {
  static cudaMemPool_t p = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    int dev = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice", 0);
    check(cudaDeviceGetDefaultMemPool(&p, dev), "cudaDeviceGetDefaultMemPool", 0);
    uint64_t keep = UINT64_MAX;
    check(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute", 0);
  });
  return p;
}
}  // namespace

void* device_alloc(int64_t bytes) {
  const size_t n = static_cast<size_t>(bytes > 0 ? bytes : 1);
  const cudaMemPool_t p = pool();
  g_device_memory_used.store(true, std::memory_order_relaxed);
  void* ptr = nullptr;
  cudaError_t e = cudaMallocFromPoolAsync(&ptr, n, p, nullptr);
  if (e == cudaErrorMemoryAllocation) {
    // The pool may hold freed blocks in sizes that do not fit: wait for pending frees, give them back, try once more.
    (void)cudaGetLastError();
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (before trimming the memory pool)", bytes);
    check(cudaMemPoolTrimTo(p, 0), "cudaMemPoolTrimTo", bytes);
    e = cudaMallocFromPoolAsync(&ptr, n, p, nullptr);
  }
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;  // the caller (Storage) names the allocation, what moecore holds and the plan
  }
  check(e, "cudaMallocFromPoolAsync", bytes);
  return ptr;
}
void device_free(void* p) {
  if (!p) return;
  const cudaError_t e = cudaFreeAsync(p, nullptr);
  // A destructor cannot raise: a failed free means the context is already broken, and the next checked call says so.
  // Said once per process (after a fault every later free fails too).
  // At exit, tensors that outlive the runtime (statics) find it unloaded: nothing to report then.
  static std::atomic<bool> said{false};
  if (e != cudaSuccess && e != cudaErrorCudartUnloading && !said.exchange(true))
    std::fprintf(stderr, "moecore: cudaFreeAsync failed: %s (later failed frees are not reported)\n",
                 cudaGetErrorString(e));
}
int64_t device_memory_reserved_bytes() {
  uint64_t reserved = 0;
  check(cudaMemPoolGetAttribute(pool(), cudaMemPoolAttrReservedMemCurrent, &reserved), "cudaMemPoolGetAttribute", 0);
  return static_cast<int64_t>(reserved);
}
void device_memset(void* p, int value, int64_t bytes) {
  check(cudaMemsetAsync(p, value, static_cast<size_t>(bytes), nullptr), "cudaMemsetAsync", bytes);
  if (device_sync_each_launch()) check(cudaDeviceSynchronize(), "cudaMemsetAsync (MOECORE_CUDA_SYNC=1)", bytes);
}
void device_copy(void* dst, bool dst_dev, const void* src, bool src_dev, int64_t bytes) {
  const cudaMemcpyKind kind = dst_dev ? (src_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                      : (src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  check(cudaMemcpy(dst, src, static_cast<size_t>(bytes), kind), "cudaMemcpy", bytes);
}
void local_copy(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return;
  if (!g_device_memory_used.load(std::memory_order_relaxed)) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
  check(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault), "cudaMemcpy (default kind)", bytes);
}
bool device_available() {
  return device_unavailable_reason().empty();
}
std::string device_unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return "";
  std::string nodes;
  for (const char* dev : {"/dev/nvidiactl", "/dev/nvidia0"})
    nodes += std::string(dev) + (::access(dev, F_OK) == 0 ? " present" : " absent") + ", ";
  return std::string("the CUDA runtime found no usable device (cudaGetDeviceCount: ") +
         (e == cudaSuccess ? "0 devices" : std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e)) + "; " +
         nodes + "the driver library libcuda.so.1 is looked for on the loader path: LD_LIBRARY_PATH, then ldconfig)";
}
std::string device_description(int64_t* free_bytes, int64_t* total_bytes) {
  if (free_bytes) *free_bytes = 0;
  if (total_bytes) *total_bytes = 0;
  int dev = 0;
  cudaDeviceProp prop{};
  size_t free_b = 0, total_b = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess ||
      cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    (void)cudaGetLastError();
    return "a CUDA device that did not answer (" + device_unavailable_reason() + ")";
  }
  if (free_bytes) *free_bytes = static_cast<int64_t>(free_b);
  if (total_bytes) *total_bytes = static_cast<int64_t>(total_b);
  char sizes[64];
  std::snprintf(sizes, sizeof sizes, "%.1f GiB, %.1f GiB free", static_cast<double>(total_b) / (1 << 30),
                static_cast<double>(free_b) / (1 << 30));
  return std::string(prop.name) + " (device " + std::to_string(dev) + ", sm_" + std::to_string(prop.major) +
         std::to_string(prop.minor) + ", " + sizes + ")";
}
}  // namespace moecore
