// Link-time seams for device memory. core never includes CUDA: these are defined in
// kernels/cuda/device_memory.cu and device_copy.cu when the CUDA backend is built, and in kernels/cuda/no_device.cpp
// otherwise (where they throw "built without CUDA"). Every call runs on the stream the ops use (the legacy default
// stream), so a seam call is ordered after every kernel launched before it.
#pragma once
#include <cstdint>
#include <string>

#include "moecore/core/dtype.h"

namespace moecore {

// Stream-ordered device memory from a pool that keeps what it frees (no device-wide synchronisation per free).
// Returns nullptr when the device is out of memory (the caller names the allocation); other failures raise.
void* device_alloc(int64_t bytes);
void device_free(void* p);
// The bytes the pool holds from the driver now (cudaMemPoolAttrReservedMemCurrent): the live allocations plus what
// freed ones left in it; torch.cuda.memory_stats' reserved_bytes.
int64_t device_memory_reserved_bytes();
void device_memset(void* p, int value, int64_t bytes);
// A transfer of `bytes` contiguous bytes (host <-> device, or within the device); synchronous for the host.
void device_copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, int64_t bytes);
// Copies `bytes` between two addresses of this process, each host or device memory (a one-rank collective's
// out := in): cudaMemcpyDefault once this process has allocated device memory, memcpy before that.
void local_copy(void* dst, const void* src, int64_t bytes);
bool device_available();  // true when a CUDA device can be used in this process
// MOECORE_CUDA_SYNC, a switch (core/env.h: 1/true/on/yes, 0/false/off/no/""): on synchronises the device after every
// CUDA launch (a debugging mode: slow), so an asynchronous fault raises naming its kernel. Read once per process; any
// other value raises naming it (in a build without CUDA too, where it returns false).
bool device_sync_each_launch();
// Why device_available() is false, naming what is missing and where it was looked for (the build, the CUDA
// runtime's answer, the /dev/nvidia* nodes); empty when a device is available.
std::string device_unavailable_reason();
// The device this process uses and its memory, e.g. "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB, 78.4 GiB free)";
// free/total bytes through the pointers when given (0 when unknown).
std::string device_description(int64_t* free_bytes = nullptr, int64_t* total_bytes = nullptr);

// A strided view of device memory for the device kernels below: element (i0, ..., i{n-1}) is at
// data + sum(ik * strides[k]) elements of dtype.
struct DeviceView {
  static constexpr int kMaxDims = 6;
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};
// Writes one element value (dtype_size(dst.dtype) bytes, already in dst's dtype) to every element of dst.
void device_fill(const DeviceView& dst, const void* value);
// dst = src converted to dst's dtype (dtype_convert.h's rules), element by element; same shapes, any strides.
void device_convert(const DeviceView& dst, const DeviceView& src);

}  // namespace moecore
