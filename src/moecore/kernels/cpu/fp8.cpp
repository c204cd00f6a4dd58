// CPU FP8 quantisation and dequantisation (ops.h; the arithmetic: common/fp8.h): the reference the FP8 recipes run on
// this backend, block by block -- each block's amax, its scale, then its bytes. Blocks are independent and each is
// computed whole by one thread, so any thread split gives the same bits.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "moecore/kernels/common/fp8.h"
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;

struct Blocks {
  int64_t M, K, br, bc, rows, cols;  // the tensor, a block, the grid of blocks
  Blocks(int64_t m, int64_t k, int64_t block_rows, int64_t block_cols)
      : M(m),
        K(k),
        br(block_rows > 0 ? block_rows : std::max<int64_t>(m, 1)),
        bc(block_cols > 0 ? block_cols : std::max<int64_t>(k, 1)),
        rows((m + br - 1) / br),
        cols((k + bc - 1) / bc) {}
};

template <class T>
void quantize_kernel(const T* x, uint8_t* q, float* scale_inv, float* amax_out, const Blocks& b, bool e5m2,
                     const Fp8Quantize& p) {
  const float fp8_max = fp8::max_of(e5m2);
  float total = 0.0f;
#pragma omp parallel for collapse(2) schedule(static) reduction(max : total) if (b.M * b.K > cpu::kParallelWork)
  for (int64_t i = 0; i < b.rows; ++i)
    for (int64_t j = 0; j < b.cols; ++j) {
      const int64_t r0 = i * b.br, r1 = std::min(b.M, r0 + b.br), c0 = j * b.bc, c1 = std::min(b.K, c0 + b.bc);
      float amax = 0.0f;  // (fmaxf: NaN elements skipped)
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = fp8::fmax_skip_nan(amax, std::fabs(ld(x[r * b.K + c])));
      total = std::max(total, amax);
      float scale = 1.0f, inv = 1.0f;
      switch (p.rule) {
        case Fp8ScaleRule::given:
          scale = p.scale;
          inv = 1.0f / scale;
          break;
        case Fp8ScaleRule::current:
        case Fp8ScaleRule::current_pow2:
          scale = fp8::scale_from_amax(amax, fp8_max, p.rule == Fp8ScaleRule::current_pow2, 0.0f, p.inf_scale);
          inv = 1.0f / scale;
          break;
        case Fp8ScaleRule::mx: {
          const uint8_t e = fp8::e8m0_of_amax(amax, e5m2);
          scale = fp8::e8m0_scale(e);
          inv = fp8::e8m0_value(e);
          break;
        }
      }
      scale_inv[i * b.cols + j] = inv;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q[r * b.K + c] = fp8::cast(ld(x[r * b.K + c]) * scale, e5m2);
    }
  if (amax_out) *amax_out = fp8::fmax_skip_nan(*amax_out, total);
}

template <class T>
void dequantize_kernel(const uint8_t* q, const float* scale_inv, T* x, const Blocks& b, bool e5m2) {
  cpu::parallel_rows(b.M, b.K, [&](int64_t r, int64_t c0, int64_t c1) {
    const float* inv = scale_inv + (r / b.br) * b.cols;
    for (int64_t c = c0; c < c1; ++c) cpu::st(x[r * b.K + c], fp8::value_of(q[r * b.K + c], e5m2) * inv[c / b.bc]);
  });
}

bool fp8_format(DType t) {
  return t == DType::f8e4m3 || t == DType::f8e5m2;
}

void check_blocks(const cpu::Checker& c, const char* data, int64_t block_rows, int64_t block_cols, Blocks* out) {
  c.rank(data, 2);
  c.contiguous(data);
  if (block_rows < 0 || block_cols < 0)
    c.fail("block sizes must be >= 0 (0: the whole dimension), got ", block_rows, " x ", block_cols);
  const Tensor& t = c.get(data);
  *out = Blocks(t.size(0), t.size(1), block_rows, block_cols);
  c.dtype("scale_inv", DType::f32);
  c.shape("scale_inv", Shape{out->rows, out->cols});
  c.contiguous("scale_inv");
}

}  // namespace

void fp8_quantize(const Tensor& x, Tensor& q, Tensor& scale_inv, Tensor* amax_out, const Fp8Quantize& p,
                  const Context& ctx) {
  const cpu::Checker c("fp8_quantize", ctx, {{"x", &x}, {"q", &q}, {"scale_inv", &scale_inv}});
  if (x.dtype() != DType::f32 && x.dtype() != DType::bf16) c.fail("x must be f32 or bf16, got ", dtype_name(x.dtype()));
  if (!fp8_format(q.dtype())) c.fail("q must be f8e4m3 or f8e5m2, got ", dtype_name(q.dtype()));
  c.same_shape("q", "x");
  c.contiguous("q");
  Blocks b(0, 0, 0, 0);
  check_blocks(c, "x", p.block_rows, p.block_cols, &b);
  if (amax_out &&
      (amax_out->device() != ctx.device || amax_out->dtype() != DType::f32 || !(amax_out->shape() == Shape{1})))
    c.fail("amax_out must be a [1] f32 tensor on ", device_name(ctx.device), ", got ",
           amax_out->defined() ? amax_out->str() + " on " + device_name(amax_out->device()) : "an undefined tensor");
  if (p.rule == Fp8ScaleRule::given && !(p.scale > 0.0f && p.scale <= FLT_MAX))
    c.fail("a given scale must be finite and > 0, got ", p.scale);
  if (!(p.inf_scale > 0.0f)) c.fail("inf_scale must be > 0, got ", p.inf_scale);
  const bool e5m2 = q.dtype() == DType::f8e5m2;
  float* amax = amax_out ? amax_out->data<float>() : nullptr;
  auto* bytes = static_cast<uint8_t*>(q.raw());
  if (x.dtype() == DType::f32)
    quantize_kernel(x.data<float>(), bytes, scale_inv.data<float>(), amax, b, e5m2, p);
  else
    quantize_kernel(x.data<bf16>(), bytes, scale_inv.data<float>(), amax, b, e5m2, p);
}

void fp8_dequantize(const Tensor& q, const Tensor& scale_inv, Tensor& x, int64_t block_rows, int64_t block_cols,
                    const Context& ctx) {
  const cpu::Checker c("fp8_dequantize", ctx, {{"q", &q}, {"scale_inv", &scale_inv}, {"x", &x}});
  if (!fp8_format(q.dtype())) c.fail("q must be f8e4m3 or f8e5m2, got ", dtype_name(q.dtype()));
  if (x.dtype() != DType::f32 && x.dtype() != DType::bf16) c.fail("x must be f32 or bf16, got ", dtype_name(x.dtype()));
  c.same_shape("x", "q");
  c.contiguous("x");
  Blocks b(0, 0, 0, 0);
  check_blocks(c, "q", block_rows, block_cols, &b);
  const bool e5m2 = q.dtype() == DType::f8e5m2;
  const auto* bytes = static_cast<const uint8_t*>(q.raw());
  if (x.dtype() == DType::f32)
    dequantize_kernel(bytes, scale_inv.data<float>(), x.data<float>(), b, e5m2);
  else
    dequantize_kernel(bytes, scale_inv.data<float>(), x.data<bf16>(), b, e5m2);
}

}  // namespace moecore::ops
