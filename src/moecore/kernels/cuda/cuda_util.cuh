// Private helpers of the CUDA backend (kernels/cuda/*.cu only): an op call's launch record (its stream from
// ctx.stream, checks of every CUDA call that raise naming the call, the op and its arguments' shapes (after every
// launch with MOECORE_CUDA_SYNC=1, so asynchronous faults name their kernel), and a grow-only device workspace per
// device and stream), f32|bf16|f16 element load/store with the CPU's rounding (round to nearest even, the same NaN
// bits), the dtype switch, grid sizing and fixed-order block reductions. No kernels of ops here.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "moecore/core/dtype_convert.h"
#include "moecore/kernels/cuda/ops_cuda.h"

namespace moecore::ops::cuda {

// One op call on the device: its name and arguments (for error messages) and its stream.
class Launch {
 public:
  using Arg = std::pair<const char*, const Tensor*>;
  Launch(const char* op, const Context& ctx, std::initializer_list<Arg> args);

  cudaStream_t stream() const { return stream_; }
  const char* op() const { return op_; }
  // Raises moecore::Error naming `call`, the op and every argument unless e is cudaSuccess.
  void check(cudaError_t e, const char* call) const {
    if (e != cudaSuccess) [[unlikely]]
      fail(call, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  // After a kernel launch: a bad configuration (or an earlier asynchronous error) raises here. With
  // MOECORE_CUDA_SYNC=1 the device is synchronised too, so a fault inside the kernel raises here, naming it and the op.
  void launched(const char* kernel) const {
    check(cudaGetLastError(), kernel);
    if (sync_each_launch()) synchronise(kernel);
  }
  // After a library call that enqueues device work (cuBLAS, CUB, an async copy), its status already checked: with
  // MOECORE_CUDA_SYNC=1 the device is synchronised, so a fault in the library's kernels names the call and the op.
  void enqueued(const char* call) const {
    if (sync_each_launch()) synchronise(call);
  }
  // MOECORE_CUDA_SYNC=1 (core/backend_hooks.h device_sync_each_launch, shared with the device-memory kernels).
  static bool sync_each_launch();
  [[noreturn]] void fail(const char* call, const char* error, const char* detail) const;
  // A device buffer of at least `bytes` for this op call, shared by every op on this device and stream (ops on one
  // stream run one after another). Grow-only: growing synchronises the stream once, so shapes fixed after the first
  // step never allocate again.
  void* workspace(size_t bytes) const;
  // The f32 pointer of a tensor's device memory.
  template <class T>
  static T* ptr(const Tensor& t) {
    return static_cast<T*>(t.device_ptr());
  }

 private:
  void synchronise(const char* after) const;  // cudaDeviceSynchronize, raising with the call it followed
  const char* op_;
  cudaStream_t stream_;
  Arg args_[8];
  int nargs_ = 0;
};

// Carves typed, 256-byte aligned pieces out of one workspace request: count the pieces first (reserve: `pieces` pieces
// of n elements each, one per take below), then take them. Each piece is aligned on its own, so a reserve of 2n
// elements is not two takes of n; taking more than was reserved raises (an internal error, before any kernel writes).
class WorkspaceCarver {
 public:
  template <class T>
  void reserve(int64_t n, int pieces = 1) {
    bytes_ += static_cast<size_t>(pieces) * align(static_cast<size_t>(n) * sizeof(T));
  }
  void reserve_bytes(size_t b) { bytes_ += align(b); }
  void allocate(const Launch& l) { base_ = static_cast<char*>(l.workspace(bytes_ ? bytes_ : 256)); }
  template <class T>
  T* take(int64_t n) {
    return static_cast<T*>(take_bytes(static_cast<size_t>(n) * sizeof(T)));
  }
  void* take_bytes(size_t b) {
    void* p = base_ + used_;
    used_ += align(b);
    MOECORE_CHECK(used_ <= (bytes_ ? bytes_ : 256), "workspace carver: took ", used_, " bytes of the ", bytes_,
                  " reserved (each take needs its own reserve)");
    return p;
  }

 private:
  static size_t align(size_t b) { return (b + 255) / 256 * 256; }
  size_t bytes_ = 0, used_ = 0;
  char* base_ = nullptr;
};

// The plan of a grouped op, computed on the device by one thread (G is the expert count, small): offsets [G + 1]
// the row offsets of the groups of group_rows ([G] i64 on the device; null: one group of R rows), and tiles [G + 1]
// the prefix sums of each group's ceil(rows / tile_rows) row tiles. A negative count counts as 0 and rows past R
// are cut off (the CPU kernels raise instead; the host never reads the counts here).
void segment_plan(const Launch& l, int64_t* offsets, int64_t* tiles, const int64_t* group_rows, int64_t G, int64_t R,
                  int64_t tile_rows);

// The segment holding item i of a prefix-sum array prefix [G + 1] (row offsets or tile counts): the first g with
// prefix[g + 1] > i, for 0 <= i < prefix[G]. Empty segments share their prefix sum with the next and are skipped.
__device__ __forceinline__ int64_t segment_of(const int64_t* prefix, int64_t G, int64_t i) {
  int64_t lo = 0, hi = G;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (prefix[mid + 1] > i)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// ---- element access (device) --------------------------------------------------------------------
__device__ __forceinline__ float ld(float v) {
  return v;
}
__device__ __forceinline__ float ld(bf16 v) {
  return dtype_convert::bf16_to_float(v.bits);
}
__device__ __forceinline__ float ld(f16 v) {
  return dtype_convert::f16_to_float(v.bits);
}
__device__ __forceinline__ void st(float& dst, float v) {
  dst = v;
}
// core/dtype_convert.h's float_to_bf16 (the host's, bit for bit): round to nearest even, NaN quieted.
__device__ __forceinline__ void st(bf16& dst, float v) {
  dst.bits = dtype_convert::float_to_bf16(v);
}
// core/dtype.h's float_to_f16_bits (the host's, bit for bit): round to nearest even, ±inf beyond 65504.
__device__ __forceinline__ void st(f16& dst, float v) {
  dst.bits = dtype_convert::float_to_f16(v);
}

// Calls fn(T{}) with T = float, bf16 or f16 for a dtype already checked to be one of them.
template <class Fn>
decltype(auto) with_float_type(DType t, Fn&& fn) {
  if (t == DType::bf16) return fn(bf16{});
  if (t == DType::f16) return fn(f16{});
  return fn(float{});
}

// ---- launch shapes --------------------------------------------------------------------------------
inline constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n items: enough to fill the GPU, never more than the items need.
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(want < 1 ? 1 : (want > 65536 ? 65536 : want));
}
#define MOECORE_GRID_STRIDE(i, n)                                                        \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

// ---- fixed-order block reductions (blockDim.x a multiple of 32, at most 1024) -----------------------
// Every thread gets the result; the summation tree depends only on blockDim.x, so results are deterministic.
// `shared` holds 32 elements; the call ends with __syncthreads(), so it may be reused right away.
template <class T, class Op>
__device__ T block_reduce(T v, T* shared, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T r = shared[0];
  for (int w = 1; w < warps; ++w) r = op(r, shared[w]);
  __syncthreads();
  return r;
}
struct Sum {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// ---- Philox-4x32-10 (core/rng.cpp), for dropout masks ---------------------------------------------
// Word `index % 4` of counter block index / 4 with counter {block, block >> 32, 1, 0}: philox_uniform's word
// (counter2 = 0: the words of philox_normal's Box-Muller pairs).
struct PhiloxWords {
  uint32_t w[4];
};
__device__ __forceinline__ PhiloxWords philox_block(uint32_t key0, uint32_t key1, uint64_t block,
                                                    uint32_t counter2 = 1) {
  uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32), c2 = counter2, c3 = 0;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    const uint32_t n0 = hi1 ^ c1 ^ key0, n2 = hi0 ^ c3 ^ key1;
    c1 = lo1;
    c3 = lo0;
    c0 = n0;
    c2 = n2;
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// A dropout mask on the device: keep factor of flat element i is `scale` when its Philox word >= threshold
// (philox_uniform(key, i) >= p), else 0; without a mask (p = 0) every factor is 1.
struct DeviceMask {
  uint32_t key0 = 0, key1 = 0, threshold = 0;
  float scale = 1.0f;
  bool active = false;
  __device__ __forceinline__ float factor(uint64_t i) const {
    if (!active) return 1.0f;
    return philox_block(key0, key1, i / 4).w[i % 4] >= threshold ? scale : 0.0f;
  }
};
DeviceMask device_mask(const Dropout& d);  // host side: the threshold of p, as cpu::DropoutMask computes it
// Dropped elements are +0 whatever v holds (the CPU's select).
__device__ __forceinline__ float apply_factor(float v, float f) {
  return f != 0.0f ? v * f : 0.0f;
}

// philox_uniform(key, index) of core/rng.cpp bit for bit: the word's (w + 0.5) 2^-32 rounded to f32 once, clamped
// below 1.
__device__ __forceinline__ float philox_uniform_dev(uint32_t key0, uint32_t key1, uint64_t index) {
  const uint32_t w = philox_block(key0, key1, index / 4).w[index % 4];
  return fminf(__double2float_rn((static_cast<double>(w) + 0.5) * 0x1p-32), 0x1.fffffep-1f);
}

// ---- block-wide integer scans (blockDim.x a multiple of 32) ---------------------------------------------------
// The number of threads before this one (in thread order) whose flag is set, and in *total the block's count. Every
// thread of the block must call it; `shared` holds 32 ints and may be reused after the call.
__device__ __forceinline__ int block_exclusive_count(bool flag, int* shared, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) shared[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < warps; ++w) {
    const int c = shared[w];
    before += w < warp ? c : 0;
    all += c;
  }
  __syncthreads();
  *total = all;
  return before + __popc(ballot & ((1u << lane) - 1u));
}

}  // namespace moecore::ops::cuda
