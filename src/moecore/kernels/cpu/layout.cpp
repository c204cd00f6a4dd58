// CPU layout ops: swap the two leading dimensions of a [A, B, W] tensor (batch-major <-> Megatron's
// sequence-major token order). A pure copy: rows of W elements move whole, in either float dtype.
#include <cstring>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {

void transpose_01(Tensor& out, const Tensor& in, const Context& ctx) {
  const cpu::Checker c("transpose_01", ctx, {{"out", &out}, {"in", &in}});
  c.float_dtype("in");
  c.contiguous("out");
  c.contiguous("in");
  if (in.dim() != 3 || out.dim() != 3 || out.dtype() != in.dtype() || out.size(0) != in.size(1) ||
      out.size(1) != in.size(0) || out.size(2) != in.size(2))
    c.fail("needs in [A, B, W] and out [B, A, W] of one dtype");
  if (out.raw() == in.raw()) c.fail("out must not alias in");
  const int64_t A = in.size(0), B = in.size(1);
  const size_t row = static_cast<size_t>(in.size(2)) * dtype_size(in.dtype());
  const auto* src = static_cast<const char*>(in.raw());
  auto* dst = static_cast<char*>(out.raw());
#pragma omp parallel for schedule(static) if (A * B * static_cast <int64_t>(row) > cpu::kParallelWork)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < A; ++a) std::memcpy(dst + (b * A + a) * row, src + (a * B + b) * row, row);
}

}  // namespace moecore::ops
