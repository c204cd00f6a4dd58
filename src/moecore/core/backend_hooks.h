// Link-time seams for device memory. core never includes CUDA: these are defined in
// kernels/cuda/device_memory.cu when the CUDA backend is built, and in core/no_device.cpp otherwise
// (where they throw "built without CUDA").
#pragma once
#include <cstdint>

namespace moecore {
void* device_alloc(int64_t bytes);
void device_free(void* p);
void device_memset(void* p, int value, int64_t bytes);
void device_copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, int64_t bytes);
bool device_available();  // true when a CUDA device can be used in this process
}  // namespace moecore
