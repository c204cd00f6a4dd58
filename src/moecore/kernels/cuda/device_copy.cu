// The device kernels of Tensor::fill_ / zero_ / copy_from / to / clone on cuda (core/backend_hooks.h): a fill and a
// dtype-converting copy over strided views of up to DeviceView::kMaxDims dims, int64 indexing, grid-stride loops
// under a capped grid. Conversions are core/dtype_convert.h's, so the bits equal the host's convert(). Launched on the
// legacy default stream like every op; MOECORE_CUDA_SYNC=1 synchronises after each launch so a fault names its kernel.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/dtype_convert.h"
#include "moecore/core/env.h"
#include "moecore/core/error.h"

namespace moecore {
namespace {

constexpr int kThreads = 256;

struct Layout {  // shape and strides, by value into the kernel
  int ndim;
  bool contiguous;
  int64_t shape[DeviceView::kMaxDims];
  int64_t strides[DeviceView::kMaxDims];
};

bool contiguous(const DeviceView& v) {
  int64_t s = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    if (v.shape[i] != 1 && v.strides[i] != s) return false;
    s *= v.shape[i];
  }
  return true;
}

Layout layout_of(const DeviceView& v) {
  Layout l{};
  l.ndim = v.ndim;
  l.contiguous = contiguous(v);
  for (int i = 0; i < v.ndim; ++i) {
    l.shape[i] = v.shape[i];
    l.strides[i] = v.strides[i];
  }
  return l;
}

int64_t numel(const DeviceView& v) {
  int64_t n = 1;
  for (int i = 0; i < v.ndim; ++i) n *= v.shape[i];
  return n;
}

// The element offset of row-major index k.
__device__ __forceinline__ int64_t offset_of(const Layout& l, int64_t k) {
  if (l.contiguous) return k;
  int64_t off = 0;
  for (int i = l.ndim - 1; i >= 0; --i) {
    const int64_t d = l.shape[i];
    off += (k % d) * l.strides[i];
    k /= d;
  }
  return off;
}

#define DEVICE_COPY_GRID_STRIDE(k, n)                                                    \
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < (n); \
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <class T>
__global__ void fill_kernel(T* dst, Layout l, int64_t n, T value) {
  DEVICE_COPY_GRID_STRIDE(k, n) dst[offset_of(l, k)] = value;
}

template <class T>
__global__ void copy_kernel(T* dst, Layout dl, const T* src, Layout sl, int64_t n) {
  DEVICE_COPY_GRID_STRIDE(k, n) dst[offset_of(dl, k)] = src[offset_of(sl, k)];
}

__global__ void f32_to_bf16_kernel(uint16_t* dst, Layout dl, const float* src, Layout sl, int64_t n) {
  DEVICE_COPY_GRID_STRIDE(k, n) dst[offset_of(dl, k)] = dtype_convert::float_to_bf16(src[offset_of(sl, k)]);
}

__global__ void bf16_to_f32_kernel(float* dst, Layout dl, const uint16_t* src, Layout sl, int64_t n) {
  DEVICE_COPY_GRID_STRIDE(k, n) dst[offset_of(dl, k)] = dtype_convert::bf16_to_float(src[offset_of(sl, k)]);
}

__global__ void f32_to_f16_kernel(uint16_t* dst, Layout dl, const float* src, Layout sl, int64_t n) {
  DEVICE_COPY_GRID_STRIDE(k, n) dst[offset_of(dl, k)] = dtype_convert::float_to_f16(src[offset_of(sl, k)]);
}

__global__ void f16_to_f32_kernel(float* dst, Layout dl, const uint16_t* src, Layout sl, int64_t n) {
  DEVICE_COPY_GRID_STRIDE(k, n) dst[offset_of(dl, k)] = dtype_convert::f16_to_float(src[offset_of(sl, k)]);
}

__global__ void convert_kernel(void* dst, DType dt, Layout dl, const void* src, DType st, Layout sl, int64_t n) {
  DEVICE_COPY_GRID_STRIDE(k, n) dtype_convert::convert_element(dst, dt, offset_of(dl, k), src, st, offset_of(sl, k));
}

unsigned grid_for(int64_t n) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < 1 ? 1 : (want > 65536 ? 65536 : want));
}

void launched(const char* kernel, const DeviceView& dst) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && device_sync_each_launch()) e = cudaDeviceSynchronize();
  if (e != cudaSuccess)
    MOECORE_FAIL("cuda: ", kernel, " into a ", dtype_name(dst.dtype), " tensor of ", numel(dst),
                 " elements failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

template <class T>
void fill_as(const DeviceView& dst, const void* value, int64_t n) {
  T v;
  std::memcpy(&v, value, sizeof v);
  fill_kernel<T><<<grid_for(n), kThreads>>>(static_cast<T*>(dst.data), layout_of(dst), n, v);
  launched("device_fill", dst);
}

template <class T>
void copy_as(const DeviceView& dst, const DeviceView& src, int64_t n) {
  copy_kernel<T><<<grid_for(n), kThreads>>>(static_cast<T*>(dst.data), layout_of(dst), static_cast<const T*>(src.data),
                                            layout_of(src), n);
  launched("device_convert (copy)", dst);
}

}  // namespace

bool device_sync_each_launch() {
  static const bool on = [] {
    return env_switch("MOECORE_CUDA_SYNC", false, "synchronise after every CUDA launch, so a fault names its op");
  }();
  return on;
}

void device_fill(const DeviceView& dst, const void* value) {
  const int64_t n = numel(dst);
  if (n == 0) return;
  switch (dtype_size(dst.dtype)) {
    case 1:
      return fill_as<uint8_t>(dst, value, n);
    case 2:
      return fill_as<uint16_t>(dst, value, n);
    case 4:
      return fill_as<uint32_t>(dst, value, n);
    case 8:
      return fill_as<uint64_t>(dst, value, n);
  }
  MOECORE_FAIL("device_fill: no kernel for dtype ", dtype_name(dst.dtype));
}

void device_convert(const DeviceView& dst, const DeviceView& src) {
  MOECORE_CHECK(dst.ndim == src.ndim, "device_convert: ", dst.ndim, "-D into ", src.ndim, "-D");
  for (int i = 0; i < dst.ndim; ++i)
    MOECORE_CHECK(dst.shape[i] == src.shape[i], "device_convert: shapes differ at dim ", i);
  const int64_t n = numel(dst);
  if (n == 0) return;
  if (dst.dtype == src.dtype) {
    if (contiguous(dst) && contiguous(src)) {
      const cudaError_t e = cudaMemcpyAsync(dst.data, src.data, static_cast<size_t>(n) * dtype_size(dst.dtype),
                                            cudaMemcpyDeviceToDevice, nullptr);
      if (e != cudaSuccess)
        MOECORE_FAIL("cuda: cudaMemcpyAsync (device to device, ", n, " elements) failed: ", cudaGetErrorName(e), ": ",
                     cudaGetErrorString(e));
      launched("device_convert (cudaMemcpyAsync)", dst);
      return;
    }
    switch (dtype_size(dst.dtype)) {
      case 1:
        return copy_as<uint8_t>(dst, src, n);
      case 2:
        return copy_as<uint16_t>(dst, src, n);
      case 4:
        return copy_as<uint32_t>(dst, src, n);
      case 8:
        return copy_as<uint64_t>(dst, src, n);
    }
  }
  const Layout dl = layout_of(dst), sl = layout_of(src);
  if (dst.dtype == DType::bf16 && src.dtype == DType::f32) {
    f32_to_bf16_kernel<<<grid_for(n), kThreads>>>(static_cast<uint16_t*>(dst.data), dl,
                                                  static_cast<const float*>(src.data), sl, n);
  } else if (dst.dtype == DType::f32 && src.dtype == DType::bf16) {
    bf16_to_f32_kernel<<<grid_for(n), kThreads>>>(static_cast<float*>(dst.data), dl,
                                                  static_cast<const uint16_t*>(src.data), sl, n);
  } else if (dst.dtype == DType::f16 && src.dtype == DType::f32) {
    f32_to_f16_kernel<<<grid_for(n), kThreads>>>(static_cast<uint16_t*>(dst.data), dl,
                                                 static_cast<const float*>(src.data), sl, n);
  } else if (dst.dtype == DType::f32 && src.dtype == DType::f16) {
    f16_to_f32_kernel<<<grid_for(n), kThreads>>>(static_cast<float*>(dst.data), dl,
                                                 static_cast<const uint16_t*>(src.data), sl, n);
  } else {
    convert_kernel<<<grid_for(n), kThreads>>>(dst.data, dst.dtype, dl, src.data, src.dtype, sl, n);
  }
  launched("device_convert", dst);
}

}  // namespace moecore
