// Private helpers of the CPU backend: f32|bf16|f16 element load/store, branch-free exp/erfc that GCC
// vectorises inside `omp simd` loops, entry checks that raise moecore::Error naming the op and every
// argument (shared with the CUDA kernels, which ops dispatch to after them), and a grow-only per-thread
// scratch buffer. Only kernels/cpu/*.cpp include this; it holds no kernels. Written without intrinsics so
// it builds on any -march (AVX2 and AVX-512 both vectorise).
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moecore/kernels/cuda/ops_cuda.h"
#include "moecore/kernels/ops.h"

namespace moecore::ops::cpu {

// Below this many elements an op runs on the calling thread: a parallel region costs a few microseconds.
inline constexpr int64_t kParallelWork = 1 << 15;

inline float ld(float v) {
  return v;
}
inline float ld(bf16 v) {
  return bf16_to_float(v);
}
inline float ld(f16 v) {
  return f16_to_float(v);
}

inline void st(float& dst, float v) {
  dst = v;
}
// Round to nearest even. float_to_bf16's early NaN return has no arithmetic, so GCC still vectorises it.
inline void st(bf16& dst, float v) {
  dst = float_to_bf16(v);
}
// Round to nearest even, ±inf beyond 65504 (dtype.h's branch-free float_to_f16, which vectorises).
inline void st(f16& dst, float v) {
  dst = float_to_f16(v);
}

// c ? a : b without a branch. GCC keeps FP trapping semantics (-ftrapping-math), so it will not
// if-convert a ternary whose arms do arithmetic, and such a loop stays scalar; a bit-mask select does not.
inline float select_f32(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & m) | (std::bit_cast<uint32_t>(b) & ~m));
}

// e^x within ~1 ulp (Cephes expf polynomial); 0 below -87, clamped to e^88 above, NaN stays NaN.
// libm's expf does not vectorise without -ffast-math, and exp dominates softmax, silu and gelu.
// Forced inline: a call in a loop body stops GCC from vectorising it.
[[gnu::always_inline]] inline float exp_f32(float x) {
  float xc = x < -87.0f ? -87.0f : x;
  xc = xc > 88.0f ? 88.0f : xc;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: the sum's low mantissa bits hold round(x / ln 2)
  const float j = std::fma(xc, 1.44269504088896341f, kRound);
  const float n = j - kRound;
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float er = std::fma(p, r * r, r) + 1.0f;
  const uint32_t scale_bits = (std::bit_cast<uint32_t>(j) - 0x4B400000u + 127u) << 23;
  const float res = er * std::bit_cast<float>(scale_bits);
  return select_f32(x < -87.0f, 0.0f, res);
}

// erfc(x) with relative error ~1e-6 for |x| < 4 and ~4e-6 out to 9 (Numerical Recipes' Chebyshev fit,
// 1.2e-7 in exact arithmetic). Relative accuracy in the tails is what GeLU's Phi = erfc(-x/sqrt2)/2 needs.
[[gnu::always_inline]] inline float erfc_f32(float x) {
  const float z = std::fabs(x);
  const float t = 1.0f / std::fma(0.5f, z, 1.0f);
  float p = 0.17087277f;
  p = std::fma(p, t, -0.82215223f);
  p = std::fma(p, t, 1.48851587f);
  p = std::fma(p, t, -1.13520398f);
  p = std::fma(p, t, 0.27886807f);
  p = std::fma(p, t, -0.18628806f);
  p = std::fma(p, t, 0.09678418f);
  p = std::fma(p, t, 0.37409196f);
  p = std::fma(p, t, 1.00002368f);
  p = std::fma(p, t, -1.26551223f);
  const float ans = t * exp_f32(std::fma(-z, z, p));
  return select_f32(x >= 0.0f, ans, 2.0f - ans);
}

// The dtypes activations are stored in (f32 math, rounded on store): f32, bf16 or f16.
inline bool is_float_storage(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16;
}

// Calls fn(T{}) with T = float, bf16 or f16 for a dtype already checked to be one of them (is_float_storage).
template <class Fn>
decltype(auto) with_float_type(DType t, Fn&& fn) {
  if (t == DType::bf16) return fn(bf16{});
  if (t == DType::f16) return fn(f16{});
  return fn(float{});
}

// True when the kernels library is built with the CUDA kernels (kernels/cuda/, MOECORE_HAVE_CUDA_KERNELS).
#ifdef MOECORE_HAVE_CUDA_KERNELS
inline constexpr bool kCudaKernels = true;
#else
inline constexpr bool kCudaKernels = false;
#endif

// The backends of an op: every op has the CPU kernels; ops with `cpu_and_cuda` also run on a cuda context when the
// build has the CUDA kernels (kCudaKernels). Such an op dispatches after its entry checks, so both backends share
// them: `if constexpr (cpu::kCudaKernels) if (ctx.device == Device::cuda) return cuda::<op>(..., ctx);` (the
// `if constexpr` keeps builds without CUDA from referencing kernels/cuda/ops_cuda.h's functions).
enum class Backends : uint8_t { cpu, cpu_and_cuda };

// The context check of every op: cpu or sim, or cuda for an op with CUDA kernels in a build that has them
// (fail(...) raises naming the op).
template <class Fail>
void check_context(const Context& ctx, Fail&& fail, Backends backends = Backends::cpu) {
  if (ctx.device == Device::cpu || ctx.device == Device::sim) return;
  if (ctx.device == Device::cuda && backends == Backends::cpu_and_cuda && kCudaKernels) return;
  if (ctx.device == Device::cuda && backends == Backends::cpu_and_cuda)
    fail(
        "called with a cuda context, but this build has only the CPU kernels (configure with -DMOECORE_CUDA=ON on "
        "a machine with nvcc)");
  fail("called with a ", device_name(ctx.device),
       " context, but this op has only the CPU kernels (no CUDA kernel yet)");
}

// The address of a tensor's first element on any device, for address comparisons in checks only: it never
// dereferences, and a cuda tensor's address is a device pointer.
inline const char* address_of(const Tensor& t) {
  return static_cast<const char*>(t.device() == Device::cuda ? t.device_ptr() : t.raw());
}

// Entry checks of one op call. Every failure message names the op, the failed rule and all arguments
// with their shapes and dtypes, e.g. "rmsnorm_forward: w must have shape [8], got [9]; arguments:
// y [4, 8] f32, rstd [4] f32, x [4, 8] f32, w [9] f32".
class Checker {
 public:
  using Arg = std::pair<const char*, const Tensor*>;
  // The CPU kernels serve the host (Device::cpu) and the simulated device (Device::sim); with `cpu_and_cuda`
  // (see Backends) a cuda context passes too. Every tensor must be on the context's device. On cpu and sim the
  // checker opens the op body's DeviceAccess scope for its lifetime; on cuda it opens none, so host code that
  // addressed cuda tensor data before the dispatch would raise instead of reading device memory.
  Checker(const char* op, const Context& ctx, std::initializer_list<Arg> args, Backends backends = Backends::cpu)
      : op_(op), args_(args) {
    check_context(
        ctx, [&](auto&&... m) { fail(m...); }, backends);
    if (ctx.device != Device::cuda) access_.emplace();
    for (const Arg& a : args_) {
      if (!a.second->defined()) fail(a.first, " is an undefined tensor");
      if (a.second->device() != ctx.device)
        fail(a.first, " is on ", device_name(a.second->device()), " but the op runs on ", device_name(ctx.device));
    }
  }

  template <class... Args>
  [[noreturn]] void fail(Args&&... msg) const {
    std::string all;
    for (const Arg& a : args_) {
      all += all.empty() ? "" : ", ";
      all += std::string(a.first) + " " + (a.second->defined() ? a.second->str() : "undefined");
    }
    MOECORE_FAIL(op_, ": ", std::forward<Args>(msg)..., "; arguments: ", all);
  }

  const Tensor& get(const char* name) const {
    for (const Arg& a : args_)
      if (std::string_view(a.first) == name) return *a.second;
    fail("internal: no argument named ", name);
  }
  void dtype(const char* name, DType t) const {
    if (get(name).dtype() != t) fail(name, " must be ", dtype_name(t), ", got ", dtype_name(get(name).dtype()));
  }
  void float_dtype(const char* name) const {
    if (!is_float_storage(get(name).dtype()))
      fail(name, " must be f32, bf16 or f16, got ", dtype_name(get(name).dtype()));
  }
  void same_dtype(const char* name, const char* other) const {
    if (get(name).dtype() != get(other).dtype()) fail(name, " and ", other, " must share one dtype");
  }
  void rank(const char* name, int r) const {
    if (get(name).dim() != r) fail(name, " must be ", r, "-D, got ", get(name).shape().str());
  }
  void shape(const char* name, const Shape& s) const {
    if (!(get(name).shape() == s)) fail(name, " must have shape ", s.str(), ", got ", get(name).shape().str());
  }
  void same_shape(const char* name, const char* other) const {
    if (!(get(name).shape() == get(other).shape())) fail(name, " and ", other, " must have the same shape");
  }
  void contiguous(const char* name) const {
    if (!get(name).is_contiguous()) fail(name, " must be contiguous");
  }

 private:
  const char* op_;
  std::vector<Arg> args_;
  std::optional<DeviceAccess> access_;
};

// The checks of group_rows that read no counts: [G] i64, contiguous. A CUDA kernel reads the counts on the device.
inline void check_group_rows(const Checker& ck, int64_t G) {
  ck.dtype("group_rows", DType::i64);
  ck.shape("group_rows", Shape{G});
  ck.contiguous("group_rows");
}

// The group sizes of a grouped op (group_rows [G] i64 on the op's device, a Checker argument named
// "group_rows"), read by the CPU kernel into the calling thread's buffer (a host read: the CUDA path never calls
// this). Raises unless every count is >= 0 and they sum to at most R (rows past the sum are padding, neither read
// nor written).
inline const std::vector<int64_t>& group_counts(const Checker& ck, int64_t G, int64_t R) {
  const Tensor& t = ck.get("group_rows");
  check_group_rows(ck, G);
  thread_local std::vector<int64_t> rows;
  rows.assign(t.data<int64_t>(), t.data<int64_t>() + G);
  int64_t sum = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (rows[g] < 0) ck.fail("group_rows[", g, "] = ", rows[g], " is negative");
    sum += rows[g];
  }
  if (sum > R) ck.fail("group_rows sum to ", sum, " but there are only ", R, " rows");
  return rows;
}

// fn(row, c0, c1) over rows x column blocks, in parallel when the work is large. For ops whose output
// element depends only on its own row position, so any split gives the same bits.
template <class Fn>
void parallel_rows(int64_t rows, int64_t cols, Fn&& fn) {
  constexpr int64_t kBlock = 4096;
  const int64_t nb = cols > 0 ? (cols + kBlock - 1) / kBlock : 0;
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols > kParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) fn(r, b * kBlock, std::min(cols, (b + 1) * kBlock));
}

// Grow-only buffer owned by the calling thread; filled before a parallel region and read inside it.
// Kernels run every step with fixed shapes, so after the first step this never allocates.
template <class T, int Slot = 0>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace moecore::ops::cpu
