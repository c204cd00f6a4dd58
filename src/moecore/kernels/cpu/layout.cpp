// CPU layout ops, pure copies (with a float dtype conversion where the op allows one): swap the two leading
// dimensions of a [A, B, W] tensor (batch-major <-> Megatron's sequence-major token order), and gather /
// scatter the query or key slots of the fused QKV activation (QK-norm works on rows of one head).
#include <cstring>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {

void transpose_01(Tensor& out, const Tensor& in, const Context& ctx) {
  const cpu::Checker c("transpose_01", ctx, {{"out", &out}, {"in", &in}}, cpu::Backends::cpu_and_cuda);
  c.float_dtype("in");
  c.contiguous("out");
  c.contiguous("in");
  if (in.dim() != 3 || out.dim() != 3 || out.dtype() != in.dtype() || out.size(0) != in.size(1) ||
      out.size(1) != in.size(0) || out.size(2) != in.size(2))
    c.fail("needs in [A, B, W] and out [B, A, W] of one dtype");
  if (cpu::address_of(out) == cpu::address_of(in)) c.fail("out must not alias in");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::transpose_01(out, in, ctx);
  const int64_t A = in.size(0), B = in.size(1);
  const size_t row = static_cast<size_t>(in.size(2)) * dtype_size(in.dtype());
  const auto* src = static_cast<const char*>(in.raw());
  auto* dst = static_cast<char*>(out.raw());
#pragma omp parallel for schedule(static) if (A * B * static_cast <int64_t>(row) > cpu::kParallelWork)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < A; ++a) std::memcpy(dst + (b * A + a) * row, src + (a * B + b) * row, row);
}

namespace {

// Calls fn(row of qkv, row of the packed tensor) for slot j of group g of token n, row (n*G + g)*count + j.
template <class F>
void for_each_qkv_slot(const QkvDims& d, int64_t tokens, int64_t slot, int64_t count, F&& fn) {
  const int64_t rows = tokens * d.G * count;
#pragma omp parallel for schedule(static) if (rows * d.D > cpu::kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t j = r % count, ng = r / count;  // ng = n*G + g
    fn((ng * (d.R + 2) + slot + j) * d.D, r * d.D);
  }
}

void check_slots(const cpu::Checker& c, const Tensor& qkv, const Tensor& packed, const QkvDims& d, int64_t slot,
                 int64_t count) {
  c.float_dtype("qkv");
  c.float_dtype("packed");
  c.contiguous("qkv");
  c.contiguous("packed");
  if (slot < 0 || count <= 0 || slot + count > d.R + 2) c.fail("slots [", slot, ", ", slot + count, ") of ", d.R + 2);
  if (qkv.dim() < 2 || qkv.size(-1) != d.width()) c.fail("qkv's last dim must be G*(R+2)*D = ", d.width());
  const char* q0 = cpu::address_of(qkv);
  const char* p0 = cpu::address_of(packed);
  if (p0 < q0 + qkv.nbytes() && q0 < p0 + packed.nbytes()) c.fail("packed must not overlap qkv");
  const int64_t tokens = qkv.numel() / d.width();
  if (packed.dim() != 2 || packed.size(0) != tokens * d.G * count || packed.size(1) != d.D)
    c.fail("packed must be [", tokens * d.G * count, ", ", d.D, "]");
}

}  // namespace

void qkv_slots_gather(Tensor& packed, const Tensor& qkv, const QkvDims& d, int64_t slot, int64_t count,
                      const Context& ctx) {
  const cpu::Checker c("qkv_slots_gather", ctx, {{"packed", &packed}, {"qkv", &qkv}}, cpu::Backends::cpu_and_cuda);
  check_slots(c, qkv, packed, d, slot, count);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::qkv_slots_gather(packed, qkv, d, slot, count, ctx);
  cpu::with_float_type(packed.dtype(), [&](auto to) {
    cpu::with_float_type(qkv.dtype(), [&](auto ti) {
      auto* out = static_cast<decltype(to)*>(packed.raw());
      const auto* in = static_cast<const decltype(ti)*>(qkv.raw());
      for_each_qkv_slot(d, qkv.numel() / d.width(), slot, count, [&](int64_t src, int64_t dst) {
        for (int64_t i = 0; i < d.D; ++i) cpu::st(out[dst + i], cpu::ld(in[src + i]));
      });
    });
  });
}

void qkv_slots_scatter(Tensor& qkv, const Tensor& packed, const QkvDims& d, int64_t slot, int64_t count,
                       const Context& ctx) {
  const cpu::Checker c("qkv_slots_scatter", ctx, {{"qkv", &qkv}, {"packed", &packed}}, cpu::Backends::cpu_and_cuda);
  check_slots(c, qkv, packed, d, slot, count);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::qkv_slots_scatter(qkv, packed, d, slot, count, ctx);
  cpu::with_float_type(qkv.dtype(), [&](auto to) {
    cpu::with_float_type(packed.dtype(), [&](auto ti) {
      auto* out = static_cast<decltype(to)*>(qkv.raw());
      const auto* in = static_cast<const decltype(ti)*>(packed.raw());
      for_each_qkv_slot(d, qkv.numel() / d.width(), slot, count, [&](int64_t dst, int64_t src) {
        for (int64_t i = 0; i < d.D; ++i) cpu::st(out[dst + i], cpu::ld(in[src + i]));
      });
    });
  });
}

}  // namespace moecore::ops
