// CPU rotary position embeddings (rotate-half over the first Dr channels of each head; Dr = D rotates the
// whole head) on the query and key slots of Megatron's interleaved qkv, in place, plus the cos/sin table.
// Value slots and channels Dr..D-1 are never touched.
// Not here: position offsets or scaling variants (YaRN, NTK), and CUDA.
#include <cmath>

#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/ops.h"

namespace moecore::ops {
namespace {

// Rotates each (x[j], x[j + Dr/2]) pair by +angle (forward) or -angle (backward: the transpose of a
// rotation is its inverse, so the gradient goes back through the same table).
template <class T>
void rotate_slots(T* qkv, const float* rope, int64_t Dr, const QkvDims& d, bool inverse) {
  const int64_t half = Dr / 2, width = d.width();
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for collapse(2) schedule(static) if (d.B * d.S * width > cpu::kParallelWork)
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t s = 0; s < d.S; ++s) {
      const float* cosv = rope + s * Dr;
      const float* sinv = cosv + half;
      T* row = qkv + (b * d.S + s) * width;
      for (int64_t g = 0; g < d.G; ++g) {
        for (int64_t slot = 0; slot <= d.R; ++slot) {  // R query slots, then the key slot; not the value
          T* x = row + (g * (d.R + 2) + slot) * d.D;
#pragma omp simd
          for (int64_t j = 0; j < half; ++j) {
            const float x1 = cpu::ld(x[j]), x2 = cpu::ld(x[j + half]);
            const float sn = sign * sinv[j];
            cpu::st(x[j], x1 * cosv[j] - x2 * sn);
            cpu::st(x[j + half], x2 * cosv[j] + x1 * sn);
          }
        }
      }
    }
  }
}

void rope_apply(const char* op, const char* name, Tensor& qkv, const Tensor& rope, const QkvDims& d, const Context& ctx,
                bool inverse) {
  const cpu::Checker ck(op, ctx, {{name, &qkv}, {"rope", &rope}}, cpu::Backends::cpu_and_cuda);
  if (d.B < 0 || d.S < 0 || d.G < 1 || d.R < 1 || d.D < 2 || d.D % 2 != 0) {
    ck.fail("dims must have B, S >= 0, G, R >= 1 and an even D >= 2; got B=", d.B, " S=", d.S, " G=", d.G, " R=", d.R,
            " D=", d.D);
  }
  ck.float_dtype(name);
  ck.contiguous(name);
  if (!(qkv.shape() == Shape{d.B, d.S, d.width()})) {
    ck.fail(name, " must have shape [B, S, G*(R+2)*D] = ", Shape{d.B, d.S, d.width()}.str(), " for dims B=", d.B,
            " S=", d.S, " G=", d.G, " R=", d.R, " D=", d.D, ", got ", qkv.shape().str());
  }
  ck.dtype("rope", DType::f32);
  ck.rank("rope", 2);
  ck.contiguous("rope");
  // A table built once for the longest sequence serves every shorter one.
  const int64_t Dr = rope.size(1);
  if (Dr < 2 || Dr % 2 != 0 || Dr > d.D) {
    ck.fail("the rotary dim Dr = rope.size(1) must be even with 2 <= Dr <= D, got Dr = ", Dr, " and D = ", d.D);
  }
  if (rope.size(0) < d.S) {
    ck.fail("rope must have shape [S', Dr] with S' >= S = ", d.S, ", got ", rope.shape().str());
  }
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return inverse ? cuda::rope_backward(qkv, rope, d, ctx) : cuda::rope_forward(qkv, rope, d, ctx);
  cpu::with_float_type(qkv.dtype(), [&](auto tag) {
    using T = decltype(tag);
    rotate_slots(qkv.data<T>(), rope.data<float>(), Dr, d, inverse);
  });
}

}  // namespace

void rope_table(Tensor& rope, float base, const Context& ctx) {
  const cpu::Checker ck("rope_table", ctx, {{"rope", &rope}}, cpu::Backends::cpu_and_cuda);
  ck.dtype("rope", DType::f32);
  ck.rank("rope", 2);
  ck.contiguous("rope");
  const int64_t S = rope.size(0), Dr = rope.size(1);
  if (Dr < 2 || Dr % 2 != 0) ck.fail("the rotary dim Dr = rope.size(1) must be even and >= 2, got Dr = ", Dr);
  if (!(base > 0.0f) || !std::isfinite(base)) ck.fail("base must be a positive finite number, got ", base);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::rope_table(rope, base, ctx);
  float* t = rope.data<float>();
  // Angles in double: at positions in the thousands an f32 angle is already off by ~1e-4 rad.
#pragma omp parallel for schedule(static) if (S * Dr > cpu::kParallelWork)
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t j = 0; j < Dr / 2; ++j) {
      const double inv_freq = std::pow(static_cast<double>(base), -2.0 * static_cast<double>(j) / Dr);
      const double angle = static_cast<double>(s) * inv_freq;
      t[s * Dr + j] = static_cast<float>(std::cos(angle));
      t[s * Dr + Dr / 2 + j] = static_cast<float>(std::sin(angle));
    }
  }
}

void rope_forward(Tensor& qkv, const Tensor& rope, const QkvDims& dims, const Context& ctx) {
  rope_apply("rope_forward", "qkv", qkv, rope, dims, ctx, false);
}

void rope_backward(Tensor& dqkv, const Tensor& rope, const QkvDims& dims, const Context& ctx) {
  rope_apply("rope_backward", "dqkv", dqkv, rope, dims, ctx, true);
}

}  // namespace moecore::ops
